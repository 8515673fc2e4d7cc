"""The worker group: who this process is (what torchrun or Slurm said at launch), which device it
owns, how ranks agree, and each rank's sign of life."""
