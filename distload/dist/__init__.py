"""The worker group: who this process is (launch facts from torchrun or Slurm), which device it
owns, how ranks agree, and each rank's sign of life."""
