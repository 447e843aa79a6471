"""Which of the target's layers tell most about the token after next? A linear probe, CPU.

An EAGLE-3 head drafting x[t+2] sees the target's residual stream at t from three layers (the bundled
drafter: the streams leaving layers 1, 14 and 26 of SmolLM2's 30) and the embedding of x[t+1]. This
fits, for several choices of layers, one ridge regression from [those streams at t, embed(x[t+1])]
to the target's final (normed) hidden state at t+1, which decides x[t+2], and counts how often the
fitted state's argmax over the full vocabulary is the target's own pick, on conversations held apart
from the fit. A linear map sees far less than the head (no attention over earlier positions, no
product of the token with the context), so read the differences between choices, not the level.

  .venv/bin/python bench/cpu/tap_probe.py --data DIR [--rows 96] [--max-len 384]

DIR is an `eaglet data` output directory (the target's own replies); the rows are taken from its
last shard. Writes a JSON record (bench/results/tap-probe-cpu-*.json).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eaglet.kvcache import Causal
from eaglet.perf.record import write_record
from eaglet.weights import load_model

# "the stream leaving layer L" (SGLang's eagle_aux_hidden_state_layer_ids); 29 is the last layer's
# output before the final norm
CHOICES = {
    "26 (one tap)": (26,),
    "29 (one tap, the last layer)": (29,),
    "1, 14, 26 (the bundled drafter)": (1, 14, 26),
    "1, 14, 29": (1, 14, 29),
    "14, 26, 29": (14, 26, 29),
    "1, 14, 26, 29": (1, 14, 26, 29),
    "none (the embedding alone)": (),
}


def read_rows(data: Path, n: int, max_len: int) -> list[dict]:
    shard = sorted(data.glob("shard-*.jsonl"))[-1]
    rows = []
    with open(shard) as f:
        for line in f:
            r = json.loads(line)
            if len(r["input_ids"]) - r["prompt_len"] >= 32:
                rows.append({"input_ids": r["input_ids"][:max_len], "prompt_len": r["prompt_len"]})
            if len(rows) == n:
                break
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--ridge", type=float, default=1e-2, help="λ as a fraction of the features' mean energy (the mean diagonal of XᵀX, standardized features)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()

    loaded = load_model(args.model, "float32", "cpu", tokenizer=False)
    model = loaded.model
    n = model.config.num_layers
    rows = read_rows(Path(args.data), args.rows, args.max_len)
    last = {}

    def keep_last(mod, inp, out):  # the final norm's input: the stream leaving the last layer
        last["x"] = inp[0] + (inp[1] if len(inp) > 1 and inp[1] is not None else 0)
    handle = model.model.norm.register_forward_hook(keep_last)
    layers, finals, ids_all = {layer: [] for layer in range(n)}, [], []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["input_ids"]])
            pos = torch.arange(ids.shape[1]).unsqueeze(0)
            hidden, taps = model(ids, pos, Causal(), None, capture=tuple(range(1, n)))
            taps = taps[0].view(ids.shape[1], n - 1, -1)
            for layer in range(n - 1):
                layers[layer].append(taps[:, layer])
            layers[n - 1].append(last["x"][0])
            finals.append(hidden[0])
            ids_all.append(ids[0])
    handle.remove()

    # positions t with x[t+1] and x[t+2] in the reply: features at t, label the final state at t+1
    emb_w, lm_w = model.model.embed_tokens.weight, model.lm_head.weight
    split = int(len(rows) * 0.75)  # rows before it fit the probe, the rest test it
    sel = {"fit": [], "test": []}
    for i, r in enumerate(rows):
        t = torch.arange(r["prompt_len"] - 1, len(r["input_ids"]) - 2)
        sel["fit" if i < split else "test"].append((i, t))

    def gather(part, taps):
        xs, ys = [], []
        for i, t in sel[part]:
            feats = [layers[layer][i][t] for layer in taps] + [emb_w[ids_all[i][t + 1]]]
            xs.append(torch.cat(feats, -1))
            ys.append(finals[i][t + 1])
        return torch.cat(xs).double(), torch.cat(ys).double()

    y_test_full = None
    results = {}
    for name, taps in CHOICES.items():
        x, y = gather("fit", taps)
        xt, yt = gather("test", taps)
        mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
        x, xt = (x - mu) / sd, (xt - mu) / sd
        ymu = y.mean(0)
        gram = x.T @ x
        lam = args.ridge * gram.diagonal().mean()
        w = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), x.T @ (y - ymu))
        pred = (xt @ w + ymu).float()
        if y_test_full is None:
            y_test_full = yt.float() @ lm_w.T
            truth = y_test_full.argmax(-1)
            sure = y_test_full.softmax(-1).amax(-1)
        got = (pred @ lm_w.T).argmax(-1)
        hit = got == truth
        results[name] = {"layers": list(taps), "features": x.shape[1], "fit_positions": x.shape[0],
                         "test_positions": xt.shape[0], "agreement": float(hit.float().mean()),
                         "agreement_where_target_p_lt_0.5": float(hit[sure < 0.5].float().mean()),
                         "agreement_where_target_p_ge_0.9": float(hit[sure >= 0.9].float().mean())}
        print(f"{name:34s} agreement {results[name]['agreement']:.3f}  (target p<0.5: "
              f"{results[name]['agreement_where_target_p_lt_0.5']:.3f}, p>=0.9: "
              f"{results[name]['agreement_where_target_p_ge_0.9']:.3f})  {xt.shape[0]} test positions")
    path = write_record("tap-probe", vars(args), results, out_dir=args.out)
    print(f"record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
