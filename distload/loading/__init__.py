"""The load path, in the order the data flows (every rank runs each step):

    sources      a source URI -> its files (local folder, s3://, gs://, az://), one listing
    index        file headers -> the checkpoint index (names, dtypes, shapes, byte ranges)
    layout       whole or pre-sharded (patterns, the manifest): which files are this rank's
    choice       the read choice: which backend, shared or not (pure)
    plan         the rank plan: source, choice, index and what the rank must end up with
    planner      makes the rank plan (the steps above, on one rank) and asks the backend's preflight
    agreement    every rank planned the same read, and the ranks of a shared read hold identical lists
    request      what a reader is given (files, device, slices... and its own typed options)
    backends/    the readers (one object each), onto cuda:<local_rank> or cpu
    delivery     what the backend hands over is checked against the rank plan
    loader       the steps above, end to end, with a timeout on every collective
    dtensors     a load whose targets are DTensors (each rank reads its local shards' bytes)
    report       digest, progress, the per-rank and job report

``stores/`` holds the object-store clients the sources and readers share; ``host_memory`` the
policy for new host tensors (huge pages). Nothing here imports the sharded-checkpoint or
live-update areas: they build on this one.
"""
