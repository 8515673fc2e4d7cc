"""Tensor parallelism as pure data: a sharding spec decides each tensor's action (spec.py), an
action becomes the rows a TP rank holds of a tensor, its slice (slices.py), a rank's place in
its TP group is one type (place.py), and the ``vllm`` spec saves under the names vLLM's engine
gives the tensors (vllm_names.py). No I/O besides reading a spec file, no torch.distributed."""
