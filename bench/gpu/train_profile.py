"""Where a `train-draft` step spends its time: the three phases of a step (the frozen target's
forward, the head's TTT forward, backward and optimizer), each timed alone (synchronised) and
profiled alone, so every kernel (GPU) or operator (CPU) seen belongs to that phase: count and
microseconds per step, grouped by kind, costliest first. The same batches, head and optimizer as
`eaglet train-draft` (Trainer.target_pass, head_loss, optimizer_step). A probe for choosing what to
speed up in training, not part of the package.

  python3 bench/gpu/train_profile.py MODEL DATA_DIR [DATA_DIR ...] --out OUT [--steps 6] [--warmup 3]
      [--batch-tokens 32768] [--max-len 1024] [--init-from DRAFTER] [--device cpu] [--dtype bfloat16]
"""
import argparse
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from step_profile import print_summary, summary  # the decoding-step probe's kernel tables (this directory is on sys.path)
from torch.profiler import ProfilerActivity, profile

from eaglet.perf.record import write_record
from eaglet.train.trainer import TrainConfig, Trainer, collate
from eaglet.weights import load_model

PHASES = ("target", "ttt_forward", "backward_step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6, help="profiled steps, after the warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--init-from", help="a drafter to start from (its vocabulary kept), as train-draft")
    ap.add_argument("--device")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    target = load_model(args.model, args.dtype, args.device, tokenizer=False).model
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data=tuple(args.data), out=out, batch_tokens=args.batch_tokens, max_len=args.max_len,
                          draft_vocab=args.draft_vocab, init_from=args.init_from, epochs=1)
        tr = Trainer(cfg, target, progress=False)
    cuda = tr.device.type == "cuda"
    hdtype = next(tr.head.parameters()).dtype
    embed = tr.target.model.embed_tokens.weight.to(hdtype)
    n = args.warmup + args.steps
    if n > tr.total:
        raise SystemExit(f"the data makes {tr.total} steps; --warmup + --steps is {n}")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    wall = defaultdict(float)
    ops = {p: defaultdict(lambda: [0, 0.0]) for p in PHASES}

    @contextmanager
    def phase(name, step):
        measured = step >= args.warmup
        sync()
        prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) if measured else None
        if prof:
            prof.__enter__()
        t0 = time.perf_counter()
        yield
        sync()
        if prof:
            wall[name] += time.perf_counter() - t0  # the profiler's own cost is outside these bounds
            prof.__exit__(None, None, None)
            for e in prof.events():
                if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
                    ops[name][e.name][0] += 1
                    ops[name][e.name][1] += e.device_time_total
                elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:
                    ops[name][e.name][0] += 1
                    ops[name][e.name][1] += e.self_cpu_time_total

    tokens = padded = 0
    for step in range(n):
        tr.opt.zero_grad(set_to_none=True)
        ids, mask = collate(tr.rows, tr.plan[step], cfg.max_len, tr.device)
        with phase("target", step):
            taps, tgt = tr.target_pass(ids, hdtype)
        with phase("ttt_forward", step):
            loss = tr.head_loss(ids, mask, embed, taps, tgt, cuda).loss
        with phase("backward_step", step):
            loss.backward()
            tr.optimizer_step()
        if step >= args.warmup:
            tokens += int(mask.sum())
            padded += ids.numel()

    per = args.steps
    results = {"steps": per, "assistant_tokens_per_step": tokens / per, "padded_tokens_per_step": padded / per,
               "tokens_per_s": tokens / sum(wall.values()), "phases": {}}
    what = "kernels" if cuda else "operators (self time; 'kernels' below)"
    for name in PHASES:
        rows = sorted(((k, c / per, us / per) for k, (c, us) in ops[name].items()), key=lambda r: -r[2])
        r = results["phases"][name] = {"wall_ms": wall[name] / per * 1e3, "profiled_us": sum(x[2] for x in rows),
                                       "count": sum(x[1] for x in rows), **summary(rows, top=25)}
        print(f"{name}: {r['wall_ms']:.2f} ms a step (synchronised), {r['profiled_us'] / 1e3:.2f} ms in "
              f"{r['count']:.0f} {what}")
        print_summary(r)
    print(f"{results['assistant_tokens_per_step']:.0f} assistant tokens a step ({results['padded_tokens_per_step']:.0f} "
          f"padded): {results['tokens_per_s']:.0f} tokens/s with every phase synchronised")
    print(f"record: {write_record('train-profile', vars(args), results, args.out, models={'target': args.model})}")


if __name__ == "__main__":
    main()
