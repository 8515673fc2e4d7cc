"""Checkpoints as files: saving pre-sharded (per-rank) checkpoints from a running job or
offline from a whole one (reshard), inspecting and verifying what is on disk, and ``pull``, which
copies a checkpoint folder onto every node. Reading checkpoints is the load path's job."""
