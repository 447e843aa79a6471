"""The GPU runtime: CUDA graphs (graphs.py) and per-phase timing (timer.py)."""
