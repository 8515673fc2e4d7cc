"""Shared reads: ranks that need the same bytes read each byte from storage once per job and
exchange it. plan.py decides who reads what and who receives it (pure); stream.py runs it."""
