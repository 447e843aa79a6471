"""The sampled draw under top-k / top-p on the GPU: the package's path (cut_draw.py's kernel from
cut_draw.MIN_ROWS rows, the sort below), cut_draw.py's one program a row at any row count, and the
torch path (a sort of each row's vocabulary, then the compiled Gumbel-max), each captured in a CUDA
graph and timed by CUDA events, for the logits a plain step (B, V) and a tree verify (B, 16, V) draw
from; and how many draws the package's path shares with the sort. Random logits, nothing to stage.

  python3 bench/gpu/draw_ab.py OUT_DIR [VOCAB ...]      # default 49152 (SmolLM2) and 128256 (Llama 3)
"""
import statistics
import sys

import torch

from eaglet import cut_draw
from eaglet.kernels import Kernels
from eaglet.perf.record import write_record
from eaglet.sampling import RowSampling, SamplingParams

SETTINGS = {"top-p 0.9": SamplingParams(0.7, top_p=0.9), "top-k 50": SamplingParams(1.0, top_k=50),
            "top-k 40, top-p 0.95": SamplingParams(1.0, top_k=40, top_p=0.95)}
SHAPES = [(1,), (16,), (64,), (1, 16), (16, 16)]  # rows (and tree nodes) ahead of the vocabulary
REPLAYS, REPEATS = 50, 5


def graphed_ms(fn) -> float:
    """Median over REPEATS of the mean time of one replay of fn's CUDA graph (REPLAYS a repeat)."""
    for _ in range(2):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPLAYS)
    return statistics.median(times)


def main(out_dir: str, vocabs: list[int]) -> None:
    dev = torch.device("cuda")
    fast = Kernels.choose(dev)
    slow = Kernels.choose(dev, disable=("draw",))
    results = {}
    for v in vocabs:
        for shape in SHAPES:
            b = shape[0]
            for name, p in SETTINGS.items():
                rs = RowSampling(b, dev)
                rs.set(list(range(b)), [p] * b, [p.stream(i) for i in range(b)])
                rs.choose_mode(range(b))
                logits = (torch.randn(*shape, v, device=dev) * 3).to(torch.bfloat16)
                offset = 1 if len(shape) == 1 else torch.arange(shape[1], device=dev).expand(b, -1)
                agree = lambda: float((rs.pick(logits, offset, fast) == rs.pick(logits, offset, slow)).float().mean())  # noqa: E731
                ms = {k: graphed_ms(lambda kern=kern: rs.pick(logits, offset, kern)) for k, kern in
                      (("kernel", fast), ("sort", slow))}
                ms["agree"] = agree()  # the package's path and the sort: the same draws but for float near-ties
                saved, cut_draw.MIN_ROWS = cut_draw.MIN_ROWS, 1
                try:
                    ms["one_program"] = graphed_ms(lambda: rs.pick(logits, offset, fast))
                finally:
                    cut_draw.MIN_ROWS = saved
                key = f"{v} {'x'.join(map(str, shape))} {name}"
                results[key] = {**ms, "speedup": ms["sort"] / ms["kernel"]}
                print(f"V {v:6d}  rows {'x'.join(map(str, shape)):6s} {name:22s} package {ms['kernel'] * 1e3:7.1f} µs"
                      f"  one program a row {ms['one_program'] * 1e3:7.1f}  sort {ms['sort'] * 1e3:7.1f}"
                      f"  agree {ms['agree']:.3f}", flush=True)
    print("record:", write_record("draw-ab", {"vocabs": vocabs, "replays": REPLAYS, "repeats": REPEATS}, results,
                                  out_dir))


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2:]] or [49152, 128256])
