"""Drafter training (eaglet/train): the Trainer on a tiny random target
with self-distilled data (the target's own greedy continuations, so there is something to learn):
the loss falls (with soft or hard labels), a resumed run repeats the uninterrupted one exactly,
checkpoints survive a crash mid-write, the exported drafter is the trained head and speculates
losslessly, --init-from fine-tunes (or widens) an existing drafter, and two ranks under torchrun
train exactly what one process accumulating their batches does, --shared-lm-head drafts through the
target's output layer. The TTT loss itself: test_ttt.py; the vocabulary, the batch plan and the
target's causal forward: test_train_parts.py."""
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import eaglet.train.trainer as trainer_mod
from eaglet.config import SpecConfig
from eaglet.errors import InvalidInput
from eaglet.generate import GenerationConfig, Generator
from eaglet.kvcache import KVCache
from eaglet.models.attention import AttnMeta
from eaglet.spec.drafters.eagle3_ckpt import load_eagle3
from eaglet.spec.drafters.eagle3_head import Eagle3Head
from eaglet.spec.speculator import Speculator
from eaglet.train.trainer import TrainConfig, Trainer
from eaglet.train.vocab import most_frequent, token_counts
from eaglet.weights import load_model

from .test_eagle3_ckpt import drafts

GREEDY = GenerationConfig(max_new_tokens=16, ignore_eos=True)
N_ROWS, PROMPT, NEW = 48, 8, 24  # 48 rows of 32 tokens; 256 tokens a batch -> 6 batches an epoch


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(tiny_dirs["llama3"][0], dtype="float32", device="cpu", tokenizer=False).model


pytestmark = pytest.mark.usefixtures("one_thread")  # small matmuls: one thread is as fast


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    """Self-distilled rows: random prompts with the target's greedy continuations, two shards."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (PROMPT,), generator=g).tolist() for _ in range(N_ROWS)]
    outs = Generator(target, None).generate(prompts, GenerationConfig(max_new_tokens=NEW, ignore_eos=True))
    rows = [{"id": str(i), "input_ids": p + o.tokens, "prompt_len": len(p)} for i, (p, o) in enumerate(zip(prompts, outs))]
    d = tmp_path_factory.mktemp("data")
    for k in range(2):
        part = rows[k * N_ROWS // 2:(k + 1) * N_ROWS // 2]
        (d / f"shard-{k:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return d, rows


def config(data_dir, out, **kw) -> TrainConfig:
    base = dict(lr=3e-3, batch_tokens=256, ttt_steps=3, draft_vocab=64, epochs=5, save_every=10, seed=0)
    return TrainConfig(data=str(data_dir), out=str(out), **{**base, **kw})


def make_trainer(cfg, target) -> Trainer:
    return Trainer(cfg, target, progress=False, log=lambda *a: None)


@pytest.fixture(scope="module")
def trained(data, target, tmp_path_factory):
    """30 steps from scratch; the trainer and its output directory."""
    out = tmp_path_factory.mktemp("trained")
    tr = make_trainer(config(data[0], out, max_steps=30), target)
    result = tr.train()
    return tr, out, result


@torch.no_grad()
def head_logits(head: Eagle3Head, target) -> torch.Tensor:
    """The head's logits over fixed random tokens and taps (the same for every head): two heads
    that compute the same function give the same."""
    g = torch.Generator().manual_seed(5)
    ids, taps = torch.randint(0, 128, (2, 9), generator=g), torch.randn(2, 9, 3 * 64, generator=g)
    emb = F.embedding(ids, target.model.embed_tokens.weight)
    return head.logits(run_head(head, emb, head.fc(taps)))


def run_head(head: Eagle3Head, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head over (B, T) pairs from an empty cache, plain causal attention (as at inference)."""
    c, (b, t) = head.cfg.layer, emb.shape[:2]
    cache = KVCache(c.num_layers, b, c.num_kv_heads, t, c.head_dim, emb.dtype, "cpu")
    positions = torch.arange(t).expand(b, t)
    return head(emb, hidden, positions, cache, AttnMeta.build(cache.lens, positions, cache.kv_len(t)))


# ---- draft vocabulary ---------------------------------------------------------------------------

# ---- the trainer --------------------------------------------------------------------------------

def test_training_lowers_the_loss(trained, data):
    tr, out, result = trained
    losses = [h["loss"] for h in tr.history]
    assert len(losses) == 30 and result["steps"] == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # the soft cross-entropy is floored by the target's own entropy (~9.7 here, 3 TTT steps), so
    # a clear fall is ~0.6; batch-to-batch noise without learning is ~0.1
    assert first - last > 0.4, losses
    acc0 = [h["acc"][0] for h in tr.history]
    assert max(acc0[:3]) < 0.1 and min(acc0[-5:]) > 0.3  # step-0 draft accuracy: from ~0 to ~0.4
    assert torch.equal(tr.head.draft_to_target(), most_frequent(token_counts(data[1], 128), 64))  # vocabulary from the data
    assert json.loads((out / "history.json").read_text()) == tr.history
    assert torch.load(out / "checkpoints" / "latest.pt", weights_only=False)["step"] == 30
    rows = [i for bt in tr.plan[:30] for i in bt]  # the record says how much of each batch was padding
    assert result["tokens_this_run"] == sum(len(tr.rows[i]["input_ids"]) for i in rows)
    assert result["assistant_tokens_this_run"] < result["tokens_this_run"] <= result["padded_tokens_this_run"]


def test_resume_repeats_the_uninterrupted_run(data, target, tmp_path, monkeypatch):
    whole = make_trainer(config(data[0], tmp_path / "a", max_steps=8, save_every=3), target)
    whole.train()  # checkpoints at 3, 6 and the last step, 8
    assert torch.load(tmp_path / "a" / "checkpoints" / "latest.pt", weights_only=False)["step"] == 8

    real = Trainer.checkpoint

    def checkpoint_then_die(self):
        real(self)
        if self.step == 4:  # killed right after the checkpoint of step 4 is on disk
            raise Killed

    monkeypatch.setattr(Trainer, "checkpoint", checkpoint_then_die)
    with pytest.raises(Killed):
        make_trainer(config(data[0], tmp_path / "b", max_steps=8, save_every=2), target).train()
    monkeypatch.undo()
    resumed = make_trainer(config(data[0], tmp_path / "b", max_steps=8, save_every=2), target)
    assert resumed.step == 4 and resumed.history == whole.history[:4]
    resumed.train()
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history]  # exactly
    assert resumed.history == whole.history  # accuracies and learning rates too
    a, b = whole.head.state_dict(), resumed.head.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_time_limit_checkpoints_exports_and_resumes(data, target, tmp_path):
    """--time-limit: the run stops after the step that crosses it, with a checkpoint and an export;
    a rerun resumes the same schedule and ends where an uninterrupted run ends."""
    whole = make_trainer(config(data[0], tmp_path / "a", max_steps=5), target)
    whole.train()
    first = make_trainer(config(data[0], tmp_path / "b", max_steps=5, time_limit=0.0), target)
    r = first.train()
    assert r["steps"] == 1 and r["steps_this_run"] == 1 and not r["finished"]
    assert (tmp_path / "b" / "drafter" / "model.safetensors").exists()
    rest = make_trainer(config(data[0], tmp_path / "b", max_steps=5), target)
    assert rest.step == 1
    r = rest.train()
    assert r["finished"] and r["steps_this_run"] == 4 and set(r["ms_per_step"]) == {"target", "ttt_forward",
                                                                                      "backward_step"}
    assert [h["loss"] for h in rest.history] == [h["loss"] for h in whole.history]


def test_checkpoint_survives_a_crash_mid_write(data, target, tmp_path, monkeypatch):
    real_save, calls = torch.save, []

    def crashing_save(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) == 1:
            return real_save(obj, f, *a, **kw)
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(trainer_mod.torch, "save", crashing_save)
    cfg = config(data[0], tmp_path, max_steps=4, save_every=2)
    with pytest.raises(OSError, match="disk full"):
        make_trainer(cfg, target).train()
    monkeypatch.undo()
    latest = tmp_path / "checkpoints" / "latest.pt"
    assert len(calls) == 2 and all(str(f) != str(latest) for f in calls)  # written beside it, then renamed
    assert torch.load(latest, weights_only=False)["step"] == 2  # the step-2 checkpoint, whole
    resumed = make_trainer(cfg, target)
    assert resumed.step == 2 and len(resumed.history) == 2
    assert resumed.train()["steps"] == 4


def test_export_loads_in_the_speculative_core(trained, target):
    tr, out, result = trained
    assert result["export"] == str(out / "drafter")
    head, embed = load_eagle3(out / "drafter", target.config, "cpu", torch.float32)
    assert embed is None and head.cfg.aux_layers == tr.head.cfg.aux_layers
    assert torch.equal(head.d2t, tr.head.d2t) and torch.equal(head.t2d, tr.head.t2d)
    assert torch.allclose(head_logits(tr.head, target), head_logits(head, target), rtol=0, atol=1e-6)

    prompts = [r["input_ids"][:PROMPT] for r in [*tr.rows[:3]]] + [[5, 9, 17], list(range(3, 20))]
    plain = [c.tokens for c in Generator(target, None).generate(prompts, GREEDY)]
    spec = Generator(target, None, Speculator(SpecConfig("eagle3", steps=3), head=head, head_embed=embed))
    outs = spec.generate(prompts, GREEDY)
    assert [c.tokens for c in outs] == plain
    tau = sum(c.spec.accept_length for c in outs) / len(outs)
    assert tau > 1.2, tau  # trained on the target's own continuations, the drafter gets some right


def test_init_from_fine_tunes_an_existing_drafter(trained, data, target, tmp_path):
    tr, out, _ = trained
    logs = []
    ft = Trainer(config(data[0], tmp_path / "ft", max_steps=1, draft_vocab=None, init_from=str(out / "drafter")),
                 target, progress=False, log=logs.append)
    assert ft.head.cfg.draft_vocab_size == 64  # the drafter's vocabulary is kept, not rebuilt
    assert torch.equal(ft.head.draft_to_target(), tr.head.draft_to_target())
    assert any("draft vocabulary of 64 ids covers" in m for m in logs)
    assert all(p.requires_grad for p in ft.head.parameters())
    ft.train()
    fresh = make_trainer(config(data[0], tmp_path / "fresh", max_steps=1), target)
    fresh.train()
    assert ft.history[0]["loss"] < fresh.history[0]["loss"] - 0.4  # ~9.8 vs ~10.6 (the floor is ~9.7)
    ft_head, _ = load_eagle3(tmp_path / "ft" / "drafter", target.config, "cpu", torch.float32)
    assert ft_head.cfg.draft_vocab_size == 64 and torch.equal(ft_head.d2t, tr.head.d2t)


def test_init_from_keeps_a_drafters_own_embedding(trained, data, target, tmp_path):
    """A drafter that brings its own embedding table (as SGLang's Kimi-K2 drafters do) is trained
    with it (frozen) and exported with it, not with the target's."""
    src, own = tmp_path / "own", 0.05 * torch.randn(128, 64, generator=torch.Generator().manual_seed(4))
    shutil.copytree(trained[1] / "drafter", src)
    save_file({**load_file(str(src / "model.safetensors")), "embed_tokens.weight": own}, str(src / "model.safetensors"))
    runs = {name: make_trainer(config(data[0], tmp_path / name, max_steps=2, draft_vocab=None, init_from=str(init)),
                               target) for name, init in (("own", src), ("theirs", trained[1] / "drafter"))}
    for tr in runs.values():
        tr.train()
    assert torch.equal(runs["own"].head_embed, own) and runs["theirs"].head_embed is None
    assert runs["own"].history[0]["loss"] != runs["theirs"].history[0]["loss"]  # the same head, another table
    assert torch.equal(load_eagle3(tmp_path / "own" / "drafter", target.config, "cpu", torch.float32)[1], own)


def test_init_from_can_widen_the_drafters_mlp(trained, data, target, tmp_path):
    """--init-from with a wider --intermediate-size: the widened head computes exactly what the
    drafter did, training moves the added width, and the export (SGLang format) says the new width;
    a narrower one is refused."""
    tr, out, _ = trained
    width = tr.head.cfg.layer.intermediate_size
    wide = tr.head.widen_mlp(2 * width, torch.Generator().manual_seed(0))
    assert torch.allclose(head_logits(tr.head, target), head_logits(wide, target), rtol=0, atol=1e-6)
    logs = []
    ft = Trainer(config(data[0], tmp_path / "wide", max_steps=2, init_from=str(out / "drafter"),
                        intermediate_size=2 * width), target, progress=False, log=logs.append)
    assert ft.head.midlayer.mlp.down_proj.weight.shape == (64, 2 * width)
    assert any(f"MLP widened from {width} to {2 * width}" in m for m in logs)
    ft.train()
    assert ft.head.midlayer.mlp.down_proj.weight[:, width:].abs().sum() > 0  # the added width learned
    saved = json.loads((tmp_path / "wide" / "drafter" / "config.json").read_text())
    assert saved["intermediate_size"] == 2 * width
    head, _ = load_eagle3(tmp_path / "wide" / "drafter", target.config, "cpu", torch.float32)
    assert head.cfg.layer.intermediate_size == 2 * width
    with pytest.raises(InvalidInput, match="narrower"):
        Trainer(config(data[0], tmp_path / "narrow", max_steps=1, init_from=str(out / "drafter"),
                       intermediate_size=width // 2), target, progress=False, log=logs.append)


def test_init_from_can_widen_the_drafters_attention(trained, data, target, tmp_path):
    """--init-from with more query and key/value heads: the widened head computes exactly what the
    drafter did and speculates the same, training moves the added heads, and the export's config.json
    says the new shape (the SGLang format) and loads back; a shape that cannot hold the old heads is refused."""
    tr, out, _ = trained
    c = tr.head.cfg.layer
    nh, nkv = 2 * c.num_heads, 2 * c.num_kv_heads  # 8 / 4 from 4 / 2
    wide = tr.head.widen_attention(nh, nkv, torch.Generator().manual_seed(0))
    assert torch.allclose(head_logits(tr.head, target), head_logits(wide, target), rtol=0, atol=1e-6)
    assert drafts(wide, target) == drafts(tr.head, target)  # the same drafts accepted at every step
    mha = tr.head.widen_attention(c.num_heads, c.num_heads)  # grouped heads to one key/value head each
    assert torch.allclose(head_logits(tr.head, target), head_logits(mha, target), rtol=0, atol=1e-6)
    logs = []
    ft = Trainer(config(data[0], tmp_path / "wideattn", max_steps=2, init_from=str(out / "drafter"),
                        num_heads=nh, num_kv_heads=nkv), target, progress=False, log=logs.append)
    o = ft.head.midlayer.self_attn.o_proj.weight
    assert o.shape == (64, nh * c.head_dim) and (o.detach().abs().sum(0) == 0).sum() == (nh - c.num_heads) * c.head_dim
    assert any(f"attention widened from {c.num_heads} query / {c.num_kv_heads} key-value heads to {nh} / {nkv}" in m
               for m in logs)
    ft.train()
    assert (o.detach().abs().sum(0) == 0).sum() == 0  # every added head writes something now
    saved = json.loads((tmp_path / "wideattn" / "drafter" / "config.json").read_text())
    assert (saved["num_attention_heads"], saved["num_key_value_heads"]) == (nh, nkv)
    head, _ = load_eagle3(tmp_path / "wideattn" / "drafter", target.config, "cpu", torch.float32)
    assert (head.cfg.layer.num_heads, head.cfg.layer.num_kv_heads) == (nh, nkv)
    for bad in (dict(num_heads=c.num_heads, num_kv_heads=3), dict(num_heads=c.num_heads // 2)):
        with pytest.raises(InvalidInput, match="do not hold"):
            Trainer(config(data[0], tmp_path / "bad", max_steps=1, init_from=str(out / "drafter"), **bad),
                    target, progress=False, log=logs.append)
    fresh = make_trainer(config(data[0], tmp_path / "fresh", max_steps=1, num_heads=8, num_kv_heads=8), target)
    assert (fresh.head.cfg.layer.num_heads, fresh.head.cfg.layer.num_kv_heads) == (8, 8)  # a fresh head takes the shape
    with pytest.raises(InvalidInput, match="not a multiple"):
        make_trainer(config(data[0], tmp_path / "fresh2", max_steps=1, num_heads=6, num_kv_heads=4), target)
    with pytest.raises(InvalidInput, match="must be positive"):
        config(data[0], tmp_path / "fresh3", num_kv_heads=0)


def test_init_from_can_deepen_the_drafter(trained, data, target, tmp_path):
    """--init-from with --num-layers 2: the deepened head computes exactly what the drafter did and
    speculates the same, training grows the added layer, and the export (num_hidden_layers 2,
    layers.1.*) loads back; fewer layers, or widening a head of two, are refused; a fresh head takes
    the depth."""
    tr, out, _ = trained
    deep = tr.head.deepen(2, torch.Generator().manual_seed(0))
    assert deep.cfg.layer.num_layers == 2 and "layers.1.self_attn.q_proj.weight" in deep.state_dict()
    assert torch.allclose(head_logits(tr.head, target), head_logits(deep, target), rtol=0, atol=1e-6)
    assert drafts(deep, target) == drafts(tr.head, target)  # the same drafts accepted at every step
    logs = []
    ft = Trainer(config(data[0], tmp_path / "deep", max_steps=2, init_from=str(out / "drafter"), num_layers=2),
                 target, progress=False, log=logs.append)
    added = ft.head.layers["1"]
    assert added.self_attn.o_proj.weight.abs().sum() == 0 and added.mlp.down_proj.weight.abs().sum() == 0
    assert any("deepened from 1 to 2 layers" in m for m in logs)
    ft.train()
    assert added.self_attn.o_proj.weight.abs().sum() > 0 and added.mlp.down_proj.weight.abs().sum() > 0
    saved = json.loads((tmp_path / "deep" / "drafter" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 2
    head, _ = load_eagle3(tmp_path / "deep" / "drafter", target.config, "cpu", torch.float32)
    assert head.cfg.layer.num_layers == 2
    assert torch.allclose(head_logits(ft.head, target), head_logits(head, target), rtol=0, atol=1e-6)
    with pytest.raises(InvalidInput, match="fewer than the head's 2"):
        Trainer(config(data[0], tmp_path / "shallow", max_steps=1, init_from=str(tmp_path / "deep" / "drafter"),
                       num_layers=1), target, progress=False, log=logs.append)
    with pytest.raises(InvalidInput, match="one-layer heads only"):
        Trainer(config(data[0], tmp_path / "widedeep", max_steps=1, init_from=str(tmp_path / "deep" / "drafter"),
                       intermediate_size=2 * head.cfg.layer.intermediate_size), target, progress=False, log=logs.append)
    fresh = make_trainer(config(data[0], tmp_path / "fresh", max_steps=1, num_layers=3), target)
    assert list(fresh.head.layers) == ["1", "2"]
    with pytest.raises(InvalidInput, match="must be positive"):
        config(data[0], tmp_path / "fresh3", num_layers=0)


def test_shared_lm_head_trains_everything_but_the_targets_output_layer(trained, data, target, tmp_path):
    """--shared-lm-head with --init-from: the drafter's own lm_head gives way to the target's (whole
    vocabulary; the head turned to land near it, eagle3_outmap), which training leaves untouched while the rest learns; the export holds no lm_head
    and loads back drafting through the target's layer; a draft vocabulary with it is refused; and a
    rerun resumes from its checkpoint."""
    tr, out, _ = trained
    t = target.lm_head.weight.detach().clone()
    logs = []
    cfg = config(data[0], tmp_path / "shared", max_steps=12, draft_vocab=None, init_from=str(out / "drafter"),
                 shared_lm_head=True)
    ft = Trainer(cfg, target, progress=False, log=logs.append)
    assert ft.head.cfg.shared_lm_head and ft.head.cfg.draft_vocab_size == 128
    assert any("drafting through the target's output layer (128 ids)" in m for m in logs)
    assert not ft.head.lm_head.weight.requires_grad and all(p.requires_grad for p in ft.params)
    assert len(ft.params) == len(list(ft.head.parameters())) - 1
    fc0 = ft.head.fc.weight.detach().clone()
    ft.train()
    assert torch.equal(ft.head.lm_head.weight, t) and torch.equal(target.lm_head.weight, t)
    assert not torch.equal(ft.head.fc.weight, fc0)
    losses = [h["loss"] for h in ft.history]
    assert sum(losses[-3:]) < sum(losses[:3]), losses  # it learns to draft through the target's rows
    saved = json.loads((tmp_path / "shared" / "drafter" / "config.json").read_text())
    assert "draft_vocab_size" not in saved
    head, _ = load_eagle3(tmp_path / "shared" / "drafter", target.config, "cpu", torch.float32, target.lm_head.weight)
    assert head.cfg.shared_lm_head and torch.equal(head.fc.weight, ft.head.fc.weight)
    again = Trainer(config(data[0], tmp_path / "shared2", max_steps=2, draft_vocab=None,
                           init_from=str(tmp_path / "shared" / "drafter")), target, progress=False, log=logs.append)
    assert again.head.cfg.shared_lm_head and not again.head.lm_head.weight.requires_grad  # kept from the export
    resumed = Trainer(cfg, target, progress=False, log=logs.append)  # the checkpoint of the finished run
    assert resumed.step == 12 and torch.equal(resumed.head.fc.weight, ft.head.fc.weight)
    with pytest.raises(InvalidInput, match="leave out --draft-vocab"):
        config(data[0], tmp_path / "x", init_from=str(out / "drafter"), shared_lm_head=True)
    fresh = make_trainer(config(data[0], tmp_path / "fresh", max_steps=1, draft_vocab=None, shared_lm_head=True), target)
    assert fresh.head.cfg.shared_lm_head and torch.equal(fresh.head.lm_head.weight, t)


def test_init_from_can_rechoose_the_draft_vocabulary(trained, data, target, tmp_path):
    """--init-from with --draft-vocab N: the vocabulary becomes the data's N most frequent ids, the
    rows of ids the drafter had are kept; the head still speculates losslessly and the export says
    the new size."""
    tr, out, _ = trained
    logs = []
    ft = Trainer(config(data[0], tmp_path / "big", max_steps=2, init_from=str(out / "drafter"), draft_vocab=96),
                 target, progress=False, log=logs.append)
    old, ids = tr.head.draft_to_target(), ft.head.draft_to_target()
    counts = token_counts(ft.rows, 128)
    assert torch.equal(ids, most_frequent(counts, 96)) and torch.isin(old, ids).all()
    assert torch.equal(ft.head.lm_head.weight[torch.isin(ids, old)], tr.head.lm_head.weight)
    assert any("re-chosen: 96 ids, 64 of the drafter's 64 kept" in m for m in logs)
    ft.train()
    head, _ = load_eagle3(tmp_path / "big" / "drafter", target.config, "cpu", torch.float32)
    assert head.cfg.draft_vocab_size == 96 and torch.equal(head.draft_to_target(), ids)
    prompts = [r["input_ids"][:PROMPT] for r in tr.rows[:4]]
    plain = [c.tokens for c in Generator(target, None).generate(prompts, GREEDY)]
    spec = Generator(target, None, Speculator(SpecConfig("eagle3", steps=3), head=head, head_embed=None))
    outs = spec.generate(prompts, GREEDY)
    assert [c.tokens for c in outs] == plain
    # the added rows do not outvote the kept ones (a plain least-squares fit here made them many times
    # larger and the head accepted nothing): drafts are still accepted
    assert sum(c.spec.accept_length for c in outs) / len(outs) > 1.2


def test_hard_labels_train(data, target, tmp_path):
    """--target-temperature 0: the cross-entropy against the target's argmax starts near log(64) a
    step (64 draft ids, an untrained head; 3 steps weighted 1, 0.8, 0.64) and 30 steps lower it and
    raise the first step's accuracy."""
    tr = make_trainer(config(data[0], tmp_path / "hard", max_steps=30, target_temperature=0.0), target)
    tr.train()
    losses = [h["loss"] for h in tr.history]
    assert abs(losses[0] - 2.44 * math.log(64)) < 2.0, losses
    assert sum(losses[:5]) / 5 - sum(losses[-5:]) / 5 > 1.0, losses
    assert min(h["acc"][0] for h in tr.history[-5:]) > 0.3
    with pytest.raises(InvalidInput, match="target-temperature"):
        config(data[0], tmp_path / "bad", target_temperature=-1.0)
    with pytest.raises(InvalidInput, match="draft-vocab must be positive"):
        config(data[0], tmp_path / "bad", draft_vocab=0)


def test_step_decay_weighs_the_steps(data, target, tmp_path):
    """--step-decay G: each step's loss is the G^k-weighted sum of its TTT steps' losses (the history
    keeps the per-step losses); G outside (0, 1] is refused."""
    tr = make_trainer(config(data[0], tmp_path / "decay", max_steps=3, decay=0.5), target)
    tr.train()
    for h in tr.history:
        assert len(h["step_loss"]) == 3 and min(h["step_loss"]) > 0.5
        assert h["loss"] == pytest.approx(sum(0.5 ** k * s for k, s in enumerate(h["step_loss"])), rel=1e-5)
        assert h["loss"] != pytest.approx(sum(0.8 ** k * s for k, s in enumerate(h["step_loss"])), rel=1e-3)
    for bad in (0.0, 1.5):
        with pytest.raises(InvalidInput, match="step-decay"):
            config(data[0], tmp_path / "bad", decay=bad)


def test_several_data_directories_are_read_together(data, target, tmp_path):
    """--data A B: the rows of both directories, in that order; a directory without shards is named."""
    d, rows = data
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "shard-00000.jsonl").write_text((d / "shard-00000.jsonl").read_text())
    (b / "shard-00000.jsonl").write_text((d / "shard-00001.jsonl").read_text())
    tr = make_trainer(TrainConfig(data=(str(a), str(b)), out=str(tmp_path / "out"), draft_vocab=64), target)
    assert tr.rows == rows
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidInput, match="empty: no shard"):
        make_trainer(TrainConfig(data=(str(a), str(empty)), out=str(tmp_path / "out2")), target)


def test_gradient_accumulation_averages_the_batches(data, target, tmp_path, monkeypatch):
    """--grad-accum 2: the first optimizer step gets the mean of batch 0's and batch 1's gradients,
    computed here batch by batch; the schedule counts optimizer steps."""
    from eaglet.runtime.timer import PhaseTimer

    # no clipping in reach: a clipped sum and a clipped mean point the same way and have one norm
    acc = make_trainer(config(data[0], tmp_path / "acc", grad_accum=2, grad_clip=1e6), target)
    ref = make_trainer(config(data[0], tmp_path / "ref"), target)  # same seed: same head, same plan
    assert acc.total == len(acc.plan) // 2 and ref.total == len(ref.plan)
    grads = []
    for i in (0, 1):
        ref.head.zero_grad()
        ids, mask = trainer_mod.collate(ref.rows, ref.plan[i], 1024, "cpu")
        ref.batch_loss(ids, mask, target.model.embed_tokens.weight, torch.float32, PhaseTimer(torch.device("cpu")),
                       False).loss.backward()
        grads.append([p.grad.clone() for p in ref.head.parameters()])
    want = [(a + b) / 2 for a, b in zip(*grads)]
    seen = []

    def capture_then_stop():
        seen.extend(p.grad.clone() for p in acc.head.parameters())
        raise Killed

    monkeypatch.setattr(acc.opt, "step", capture_then_stop)
    with pytest.raises(Killed):
        acc.train()
    assert len(seen) == len(want) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(seen, want))
    assert not all(torch.allclose(a, b) for a, b in zip(grads[0], grads[1]))  # two different batches
    with pytest.raises(InvalidInput, match="grad-accum"):
        config(data[0], tmp_path / "bad", grad_accum=0)
