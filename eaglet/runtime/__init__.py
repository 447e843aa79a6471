"""The decode runtime: the decoder that owns rows, graphs and lookahead (decoder.py), the plain step
it runs (plain.py; the speculative one is spec/loop.py), CUDA graphs (graphs.py), and what may watch
its steps (observer.py; per-phase timing, timer.py)."""
