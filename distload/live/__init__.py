"""Live updates to a model that is already loaded: in-place reload, weight sync from a trainer,
and sleep/wake. Each works on the model's existing tensors (see targets)."""
