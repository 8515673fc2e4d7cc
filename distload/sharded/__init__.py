"""Sharded checkpoints: writing per-rank shards (from a running job, or offline from a whole
checkpoint), and inspecting and verifying what is on disk. Reading them is the load path's job."""
