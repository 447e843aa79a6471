"""How full `train-draft`'s batches are, by length window: for each --length-window, the batch plan
of one epoch over the given `eaglet data` directories (the trainer's own `batch_plan`), its number
of batches (optimizer steps at --grad-accum 1), and the share of each batch's padded tokens that
are real (prompt and reply). Nothing is trained; the GPU's time a step scales with padded tokens.

  .venv/bin/python bench/cpu/batch_padding.py DATA_DIR [DATA_DIR...] [--windows 256 1024 4096]
"""
import argparse

from eaglet.perf.record import write_record
from eaglet.train.regen import read_shards
from eaglet.train.trainer import TrainConfig, batch_plan, row_lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="+")
    ap.add_argument("--windows", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows = [r for d in args.data for r in read_shards(d)]
    lengths = row_lengths(rows, args.max_len)
    assistant = sum(n - r["prompt_len"] for n, r in zip(lengths, rows))
    results = {"rows": len(rows), "tokens": sum(lengths), "assistant_tokens": assistant, "windows": {}}
    for w in args.windows:
        cfg = TrainConfig(data="-", out="-", batch_tokens=args.batch_tokens, max_len=args.max_len,
                          length_window=w, seed=args.seed)
        plan = batch_plan(lengths, cfg)
        padded = sum(len(b) * max(lengths[i] for i in b) for b in plan)
        results["windows"][w] = {"batches": len(plan), "padded_tokens": padded,
                                 "real_share": round(sum(lengths) / padded, 4),
                                 "real_tokens_per_batch": round(sum(lengths) / len(plan))}
        print(f"window {w:6d}: {len(plan):5d} batches, {sum(lengths) / padded:.1%} of padded tokens real, "
              f"{sum(lengths) / len(plan):,.0f} real tokens a batch")
    print(f"record: {write_record('batch-padding', vars(args), results, args.out)}")


if __name__ == "__main__":
    main()
