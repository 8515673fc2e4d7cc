"""distload inside vLLM: ``--load-format distload`` and reloading an engine's weights (plugin.py),
imported only inside vLLM."""
