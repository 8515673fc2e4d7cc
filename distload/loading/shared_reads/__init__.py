"""Shared reads: ranks that need the same bytes read each byte from storage once per job and
exchange it. plan.py decides who reads what and who receives it (pure); rounds.py is the engine
(read ahead, agree each round before any message), which stream.py runs for loads and
distload pull for its copies."""
