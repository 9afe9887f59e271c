"""hpcmem: get GPU training jobs on Slurm past CUDA out-of-memory."""

__version__ = "0.1.0"
