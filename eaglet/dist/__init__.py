"""Several processes: tensor-parallel workers (workers.py, tp.py) and the NCCL proof (nccl.py)."""
