"""The command line (``python -m distload ...``) and its two runnable demos."""
