"""distload inside vLLM: ``--load-format distload`` (plugin.py) and the names vLLM's engine gives
the checkpoint's tensors (names.py)."""
