"""distload inside verl: the checkpoint engine ``distload`` (engine.py), which moves each
version of the actor's weights to the rollout workers over distload's weight-sync channel.

verl imports this module when its config names it, and the import registers the engine in
verl's ``CheckpointEngineRegistry``::

    actor_rollout_ref.rollout.checkpoint_engine.backend=distload
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=distload.verl

(verl 0.9 reads no entry points for its checkpoint engines: ``custom_backend_module`` is the
hook it imports on every worker before it builds the engine.) Nothing of verl is imported
unless this module is.
"""

from distload.verl.engine import DistloadCheckpointEngine

__all__ = ["DistloadCheckpointEngine"]
