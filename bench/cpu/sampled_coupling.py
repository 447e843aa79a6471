"""How much a sampled drafted node is accepted under the Gumbel coupling eaglet verifies with (the
target's draw is argmax(log p + g), the drafter's children the top-k of log q + g over the same noise
g) against recursive rejection sampling over the same children drawn without replacement from q
(Leviathan et al.'s rule at k = 1: 1 - TV(p, q); Jeon et al.'s recursion for k > 1), and against
deterministic top-k children (the target's mass on them). On SmolLM2's own sampled continuations of
held-out ShareGPT first turns, with the bundled EAGLE-3 head teacher-forced (its training-time-test
depths: the node's ancestors are the true tokens). A probe, CPU.

  .venv/bin/python bench/cpu/sampled_coupling.py [--num-prompts 12] [--max-new-tokens 96] [--temperatures 0.3 0.7 1.0]

Per temperature and depth it prints the mean acceptance of one node with k = 1 and k = --children
children under each rule; the rules differ only in how a node's draft is judged, so the table says
whether verifying with rejection sampling instead of the coupling would raise sampled τ.
"""
import argparse
import time

import torch

from eaglet.config import SpecConfig
from eaglet.generate import GenerationConfig, Generator
from eaglet.kvcache import AppendKV
from eaglet.models.attention import AttnMeta
from eaglet.perf.record import write_record
from eaglet.sampling import SamplingParams
from eaglet.spec.speculator import bundled_drafter, load_speculator
from eaglet.train.regen import RegenConfig, split_prompts
from eaglet.train.ttt import ttt_hidden
from eaglet.weights import load_model

RULES = ("top1", "gumbel1", "rejection1", "topk", "gumbelk", "rejectionk")


def gumbel(shape) -> torch.Tensor:
    return -torch.log(-torch.log(torch.rand(shape).clamp_min(1e-20)))


def rejection_accept(p: torch.Tensor, q: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """(N,) probability that recursive rejection sampling accepts one of the candidates (N, k), drawn
    in order without replacement from q: candidate i is accepted with min(1, p_i(x) / q_i(x)); after a
    rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} is q_i without x, renormalized."""
    p, q, rejected = p.clone(), q.clone(), torch.ones(p.shape[0])
    for i in range(cand.shape[1]):
        x = cand[:, i:i + 1]
        a = (p.gather(1, x) / q.gather(1, x).clamp_min(1e-30)).clamp(max=1.0)[:, 0]
        rejected = rejected * (1 - a)
        rest = (p - q).clamp_min(0)
        p = rest / rest.sum(-1, keepdim=True).clamp_min(1e-30)
        q = q.scatter(1, x, 0.0)
        q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
    return 1 - rejected


def node_acceptance(lp: torch.Tensor, lq: torch.Tensor, k: int, draws: int) -> dict[str, torch.Tensor]:
    """Per position (N,): each rule's acceptance of one node, from the target's and the drafter's
    log-probabilities (N, V) (the drafter's -inf outside its vocabulary); the noised rules averaged
    over `draws` noise draws."""
    p, q = lp.exp(), lq.exp()
    out = {"top1": p.gather(1, q.argmax(-1, keepdim=True))[:, 0],
           "rejection1": 1 - 0.5 * (p - q).abs().sum(-1),
           "topk": p.gather(1, q.topk(k, -1).indices).sum(-1)}
    g1, gk, rk = (torch.zeros(p.shape[0]) for _ in range(3))
    for _ in range(draws):
        g = gumbel(p.shape)
        drawn = (lp + g).argmax(-1)  # the target's draw
        cand = (lq + g).topk(k, -1).indices  # k draws without replacement from q, coupled to it
        g1 += (cand[:, 0] == drawn).float()
        gk += (cand == drawn[:, None]).any(-1).float()
        rk += rejection_accept(p, q, cand)
    out.update(gumbel1=g1 / draws, gumbelk=gk / draws, rejectionk=rk / draws)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.7, 1.0])
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--draws", type=int, default=48, help="noise draws a position for the noised rules")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(None, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    _, held = split_prompts(RegenConfig(out=None, source=None, turns="all"))
    chats = (tok.apply_chat([{"role": "user", "content": t}]) for _, t in held)
    prompts = [c for c in chats if len(c) <= 256][:args.num_prompts]
    head = load_speculator(SpecConfig("eagle3", str(bundled_drafter()), steps=args.depths), model).head
    d2t, vocab = head.draft_to_target(), model.config.vocab_size
    results = {}
    for temp in args.temperatures:
        t0 = time.time()
        cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(temperature=temp, seed=1))
        acc = {r: [[] for _ in range(args.depths)] for r in RULES}
        for prompt, c in zip(prompts, Generator(model, tok).generate(prompts, cfg)):
            ids = torch.tensor([prompt + c.tokens])
            n = ids.shape[1]
            with torch.no_grad():
                pos = torch.arange(n)[None]
                hidden, taps = model(ids, pos, AppendKV(model.config.num_layers),
                                     AttnMeta.build(torch.zeros(1, dtype=torch.long), pos, n), capture=head.cfg.aux_layers)
                logits = model.logits(hidden)[0].float()
                for d, h in enumerate(ttt_hidden(head, model.model.embed_tokens.weight, taps, ids, args.depths)):
                    # depth d at index t guesses x[t+2+d], which the target drew from its logits at t+1+d
                    ts = torch.arange(max(len(prompt) - 2 - d, 0), n - 2 - d)
                    lq = torch.full((len(ts), vocab), float("-inf"))
                    lq[:, d2t] = (head.logits(h[0, ts]).float() / temp).log_softmax(-1)
                    lp = (logits[ts + 1 + d] / temp).log_softmax(-1)
                    for r, v in node_acceptance(lp, lq, args.children, args.draws).items():
                        acc[r][d] += v.tolist()
        res = {r: [sum(v) / len(v) for v in per] for r, per in acc.items()}
        res["positions"] = [len(v) for v in acc["top1"]]
        results[str(temp)] = res
        print(f"T = {temp} ({time.time() - t0:.0f} s, {res['positions'][0]} positions), acceptance of a node at depth 1..{args.depths}:")
        for r in RULES:
            name = r.replace("k", str(args.children)) if r.endswith("k") else r
            print(f"  {name:12s} " + " ".join(f"{a:.3f}" for a in res[r]))
    path = write_record("sampled-coupling", vars(args), results, args.out,
                        models={"target": loaded.path, "drafter": str(bundled_drafter())})
    print(f"record: {path}")


if __name__ == "__main__":
    main()
