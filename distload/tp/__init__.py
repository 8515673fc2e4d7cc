"""Tensor parallelism as pure data: a sharding spec decides each tensor's action (spec.py), an
action becomes the rows a TP rank holds of it, its slice (slices.py), and a rank's place in
its TP group is one type (place.py). No I/O, no torch.distributed."""
