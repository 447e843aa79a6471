"""`eaglet train-draft`: EAGLE-3 training against a frozen target whose taps and logits are
computed online, batch by batch (no feature cache on disk).

The batch plan (which rows form step i, every epoch reshuffled) is a pure function of the seed,
so a checkpoint needs only the step number besides weights, optimizer, scheduler and RNG states
to resume exactly. Checkpoints are written to a temporary file and renamed: a crash never leaves
a half-written `latest.pt`.

An optimizer step averages the gradients of world x grad_accum consecutive batches of the plan:
under torchrun rank r accumulates batches (step*world + r)*grad_accum .. + grad_accum-1, then an
all-reduce sums over ranks. So 2 ranks compute exactly what one process with --grad-accum 2 does.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..errors import InvalidInput, ModelLoadError
from ..kvcache import AppendKV, Causal
from ..models.attention import AttnMeta
from ..spec.drafters.eagle3_ckpt import load_eagle3, save_eagle3
from ..spec.drafters.eagle3_head import Eagle3Config, Eagle3Head
from ..spec.drafters.eagle3_outmap import onto_target_output
from .regen import read_shards
from .ttt import Targets, ttt_loss
from .vocab import coverage, most_frequent, token_counts


@dataclass(frozen=True)
class TrainConfig:
    data: str | tuple[str, ...]  # one `eaglet data` directory, or several read together
    out: str
    epochs: float = 1.0
    lr: float = 1e-4
    warmup: float = 0.015  # fraction of steps
    grad_clip: float = 0.5
    batch_tokens: int = 8192  # padded tokens per batch (per rank)
    length_window: int = 256  # rows shuffled, then sorted by length this many at a time: larger pads less
    grad_accum: int = 1  # batches per rank per optimizer step
    max_len: int = 1024
    ttt_steps: int = 7
    decay: float = 0.8  # step k's loss weighs decay^k (EAGLE-3: 0.8)
    draft_vocab: int | None = None  # fresh heads: 16384; with init_from: None keeps the drafter's, N re-chooses
    target_temperature: float = 1.0  # soft labels softmax(z / T); 0: the target's argmax (ttt.sharpen)
    intermediate_size: int | None = None
    num_heads: int | None = None  # the head's query heads (default: the target's); with init_from, widened to it
    num_kv_heads: int | None = None  # its key/value heads, likewise
    num_layers: int | None = None  # the head's decoder layers (default 1); with init_from, deepened to it
    init_from: str | None = None
    shared_lm_head: bool = False  # draft through the target's output layer (frozen, whole vocabulary)
    seed: int = 0
    save_every: int = 200
    max_steps: int | None = None  # stop early (after this many steps) — for tests and smoke runs
    time_limit: float | None = None  # seconds: then checkpoint, export and stop; a rerun resumes the schedule

    def __post_init__(self):
        if (self.lr <= 0 or self.epochs <= 0 or self.batch_tokens < 1 or self.ttt_steps < 1 or self.grad_accum < 1
                or self.length_window < 1):
            raise InvalidInput("lr, epochs, batch-tokens, ttt-steps, grad-accum and length-window must be positive")
        if not 0 <= self.target_temperature <= 10:
            raise InvalidInput(f"target-temperature must be in [0, 10], got {self.target_temperature}")
        if not 0 < self.decay <= 1:
            raise InvalidInput(f"step-decay must be in (0, 1], got {self.decay}")
        if any(n is not None and n < 1 for n in (self.num_heads, self.num_kv_heads, self.intermediate_size,
                                                 self.num_layers)):
            raise InvalidInput("num-attention-heads, num-key-value-heads, intermediate-size and num-layers must be positive")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise InvalidInput(f"draft-vocab must be positive, got {self.draft_vocab}")
        if self.shared_lm_head and self.draft_vocab is not None:
            raise InvalidInput("--shared-lm-head drafts over the whole vocabulary: leave out --draft-vocab")


def batch_plan(lengths: list[int], cfg: TrainConfig) -> list[list[int]]:
    """Batches of row indices for all epochs: shuffled per epoch, sorted by length within windows of
    cfg.length_window rows (similar lengths share a batch, so less padding; batches are shuffled
    again), at most cfg.batch_tokens padded tokens each. Deterministic in cfg.seed."""
    plan: list[list[int]] = []
    epochs = math.ceil(cfg.epochs)
    for e in range(epochs):
        rng = random.Random(cfg.seed * 1000 + e)
        idx = list(range(len(lengths)))
        rng.shuffle(idx)
        batches = []
        for c in range(0, len(idx), cfg.length_window):
            window = sorted(idx[c:c + cfg.length_window], key=lambda i: lengths[i])
            cur: list[int] = []
            for i in window:
                if cur and (len(cur) + 1) * max(lengths[j] for j in cur + [i]) > cfg.batch_tokens:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        rng.shuffle(batches)
        if e == epochs - 1 and cfg.epochs < epochs:  # a fractional last epoch
            batches = batches[: int(len(batches) * (cfg.epochs - e))]
        plan.extend(batches)
    return plan


def row_lengths(rows: list[dict], max_len: int) -> list[int]:
    """Each row's length as trained: prompt and reply, cut at max_len (what collate keeps)."""
    return [min(len(r["input_ids"]), max_len) for r in rows]


def lr_lambda(total: int, warmup: float):
    w = max(1, int(total * warmup))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))
    return f


def collate(rows: list[dict], idx: list[int], max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [rows[i]["input_ids"][:max_len] for i in idx]
    t = max(map(len, seqs))
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for r, (i, s) in enumerate(zip(idx, seqs)):
        ids[r, :len(s)] = torch.tensor(s)
        mask[r, rows[i]["prompt_len"]:len(s)] = True
    return ids.to(device), mask.to(device)


def rng_state() -> dict:
    st = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(path: Path, **state) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: the previous latest.pt stays whole until this instant


class Trainer:
    def __init__(self, cfg: TrainConfig, target, progress: bool = True, log=print):
        self.cfg, self.target, self.progress, self.log = cfg, target, progress, log
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        from ..dist.workers import GROUP

        self.writer = self.rank == 0 and not GROUP.get("rank")  # tensor-parallel ranks: the head is rank 0's
        p = next(target.parameters())
        self.device = p.device
        self.target_out = target.output_weight()  # (V, H) whole, also where the target's ranks split it
        rows = []
        for d in (cfg.data,) if isinstance(cfg.data, str) else cfg.data:
            got = read_shards(d)
            if not got:
                raise InvalidInput(f"{d}: no shard-*.jsonl training data (run `eaglet data` first)")
            rows += got
        self.rows, self.lengths = rows, row_lengths(rows, cfg.max_len)
        self.plan = batch_plan(self.lengths, cfg)
        self.per_step = self.world * cfg.grad_accum  # batches of the plan per optimizer step
        self.total = len(self.plan) // self.per_step
        if cfg.max_steps:
            self.total = min(self.total, cfg.max_steps)
        self.head_embed: torch.Tensor | None = None  # a drafter's own embedding (--init-from), kept frozen
        self.head = self.build_head()
        self.params = [p for p in self.head.parameters() if p.requires_grad]  # not a shared (target's) lm_head
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.total, cfg.warmup))
        self.step = 0
        self.history: list[dict] = []
        self.ckpt = Path(cfg.out) / "checkpoints" / "latest.pt"
        if self.ckpt.exists():
            self.resume()

    def build_head(self) -> Eagle3Head:
        head = self.new_head()
        if self.cfg.shared_lm_head and not head.cfg.shared_lm_head:  # turned to land near the target's rows
            try:
                head = onto_target_output(head, self.target_out.detach().float())
            except ValueError as e:
                raise InvalidInput(f"--shared-lm-head: {e} ({self.cfg.init_from})") from None
            self.log(f"drafting through the target's output layer ({head.cfg.draft_vocab_size} ids) from now on")
        if head.cfg.shared_lm_head:
            head.lm_head.weight.requires_grad_(False)  # the target's, frozen (float32, as load_eagle3 gave it)
        return head

    def new_head(self) -> Eagle3Head:
        tcfg = self.target.config
        counts = token_counts(self.rows, tcfg.vocab_size)
        if self.cfg.init_from:  # fine-tune an existing drafter (e.g. one trained for an older target)
            head, self.head_embed = load_eagle3(self.cfg.init_from, tcfg, self.device, torch.float32,
                                                self.target_out)
            size, had = self.cfg.intermediate_size, head.cfg.layer.intermediate_size
            if size and size != had:  # the same function in a wider MLP (Eagle3Head.widen_mlp)
                try:
                    head = head.widen_mlp(size, torch.Generator().manual_seed(self.cfg.seed))
                except ValueError as e:
                    raise InvalidInput(f"--intermediate-size: {e} ({self.cfg.init_from})") from None
                self.log(f"MLP widened from {had} to {size}")
            head = self.widen_attention(head)
            head = self.deepen(head)
            had = head.draft_to_target()
            if self.cfg.draft_vocab and head.cfg.shared_lm_head:
                raise InvalidInput(f"--draft-vocab: {self.cfg.init_from} drafts through the target's output layer")
            ids = most_frequent(counts, self.cfg.draft_vocab).to(had.device) if self.cfg.draft_vocab else had
            if not torch.equal(ids, had):  # re-chosen from this data (Eagle3Head.with_vocab)
                head = head.with_vocab(ids, self.target_out)
                self.log(f"draft vocabulary re-chosen: {len(ids)} ids, {int(torch.isin(ids, had).sum())} of the "
                         f"drafter's {len(had)} kept, covering {coverage(counts, had):.2%} of assistant tokens before")
            self.log(f"initialised from {self.cfg.init_from}; its draft vocabulary of {len(ids)} ids covers "
                     f"{coverage(counts, ids):.2%} of assistant tokens")
            return head.requires_grad_(True).train()
        torch.manual_seed(self.cfg.seed)
        vocab = tcfg.vocab_size if self.cfg.shared_lm_head else self.cfg.draft_vocab or 16384
        try:
            hcfg = Eagle3Config.for_target(tcfg, vocab, self.cfg.intermediate_size, self.cfg.num_heads,
                                           self.cfg.num_kv_heads, self.cfg.num_layers or 1)
        except ModelLoadError as e:  # head counts that do not divide
            raise InvalidInput(f"--num-attention-heads/--num-key-value-heads: {e}") from None
        head = Eagle3Head(replace(hcfg, shared_lm_head=self.cfg.shared_lm_head)).to(self.device)
        if self.cfg.shared_lm_head:  # nothing learned to turn: the target's layer in place of random rows
            head.share_lm_head(self.target_out.detach().float())
        ids = most_frequent(counts, hcfg.draft_vocab_size)
        head.set_vocab(ids.to(self.device))
        self.log(f"draft vocabulary {len(ids)} ids covers {coverage(counts, ids):.2%} of assistant tokens")
        return head.train()

    def widen_attention(self, head: Eagle3Head) -> Eagle3Head:
        """--num-attention-heads / --num-key-value-heads on an --init-from drafter: the same function with
        more heads (Eagle3Head.widen_attention)."""
        c = head.cfg.layer
        nh, nkv = self.cfg.num_heads or c.num_heads, self.cfg.num_kv_heads or c.num_kv_heads
        if (nh, nkv) == (c.num_heads, c.num_kv_heads):
            return head
        try:
            head = head.widen_attention(nh, nkv, torch.Generator().manual_seed(self.cfg.seed))
        except ValueError as e:
            raise InvalidInput(f"--num-attention-heads/--num-key-value-heads: {e} ({self.cfg.init_from})") from None
        self.log(f"attention widened from {c.num_heads} query / {c.num_kv_heads} key-value heads to {nh} / {nkv}")
        return head

    def deepen(self, head: Eagle3Head) -> Eagle3Head:
        """--num-layers on an --init-from drafter: the same function with more layers after its last
        (Eagle3Head.deepen); widening comes first, so the new layers take the widened shape."""
        had, n = head.cfg.layer.num_layers, self.cfg.num_layers
        if n is None or n == had:
            return head
        try:
            head = head.deepen(n, torch.Generator().manual_seed(self.cfg.seed))
        except ValueError as e:
            raise InvalidInput(f"--num-layers: {e} ({self.cfg.init_from})") from None
        self.log(f"deepened from {had} to {n} layers (the added ones write nothing yet)")
        return head

    def resume(self) -> None:
        st = torch.load(self.ckpt, map_location="cpu", weights_only=False)  # RNG states must stay on the CPU
        self.head.load_state_dict(st["head"])
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.step, self.history = st["step"], st["history"]
        set_rng_state(st["rng"])
        self.log(f"resumed from {self.ckpt} at step {self.step}")

    def checkpoint(self) -> None:
        if self.writer:
            self.ckpt.parent.mkdir(parents=True, exist_ok=True)
            save_checkpoint(self.ckpt, head=self.head.state_dict(), optimizer=self.opt.state_dict(),
                            scheduler=self.sched.state_dict(), step=self.step, history=self.history,
                            rng=rng_state(), config=asdict(self.cfg))

    def out_of_time(self, t0: float) -> bool:
        if self.cfg.time_limit is None:
            return False
        flag = torch.tensor(float(time.perf_counter() - t0 > self.cfg.time_limit), device=self.device)
        if torch.distributed.is_initialized():  # every rank (data or tensor parallel) stops after the same step
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag)

    @torch.no_grad()
    def target_pass(self, ids, hdtype):
        """The frozen target on one batch: its taps (in the head's dtype) and its distribution over
        the draft vocabulary, computed online."""
        pos = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        window = self.target.config.sliding_window
        if window is None:  # no mask tensor: SDPA's causal kernel
            cache, meta = Causal(), None
        else:
            zeros = torch.zeros(ids.shape[0], dtype=torch.long, device=self.device)
            cache, meta = AppendKV(self.target.config.num_layers), AttnMeta.build(zeros, pos, ids.shape[1],
                                                                                   sliding_window=window)
        hidden, taps = self.target(ids, pos, cache, meta, capture=self.head.cfg.aux_layers)
        target = Targets.from_hidden(self.head, hidden, self.target_out, self.cfg.target_temperature)
        return taps.to(hdtype), target  # no (B, T, V) logits

    def head_loss(self, ids, mask, embed, taps, target, cuda):
        """The TTT loss of the head on one batch (autocast to bfloat16 on the GPU)."""
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            return ttt_loss(self.head, embed, taps, target, ids, mask, self.cfg.ttt_steps, self.cfg.decay)

    def batch_loss(self, ids, mask, embed, hdtype, timer, cuda):
        """The TTT loss of one batch: the frozen target's taps and logits online, then the head."""
        with timer.phase("target"):
            taps, target = self.target_pass(ids, hdtype)
        with timer.phase("ttt_forward"):
            return self.head_loss(ids, mask, embed, taps, target, cuda)

    def optimizer_step(self) -> None:
        """The step's gradients (summed over its batches and, under torchrun, over the ranks) averaged,
        clipped, applied; then the schedule's next learning rate."""
        for p in self.params:
            if self.world > 1:  # data parallel: sum over ranks
                torch.distributed.all_reduce(p.grad)
            if self.per_step > 1:
                p.grad /= self.per_step
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()

    def train(self) -> dict:
        """Train to the end of the schedule (or the time limit); returns the run's figures. On the
        GPU, float32 matmuls that remain (a float32 target) use TF32 for the run, then as before."""
        tf32 = torch.backends.cuda.matmul.allow_tf32
        try:
            return self._train()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    def _train(self) -> dict:
        from tqdm import tqdm

        from ..runtime.timer import PhaseTimer

        cuda = self.device.type == "cuda"
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True  # restored by train()
        hdtype = next(self.head.parameters()).dtype  # float32; the target may be bfloat16 (its inputs follow the head)
        # the drafter's own embedding where it brings one (it drafts with it), else the target's
        embed = (self.target.input_weight() if self.head_embed is None else self.head_embed).to(hdtype)
        timer = PhaseTimer(self.device)
        bar = tqdm(total=self.total, initial=self.step, desc="train-draft", disable=not self.progress or self.rank)
        t0, tokens, real, padded, first = time.perf_counter(), 0, 0, 0, self.step
        while self.step < self.total:
            self.opt.zero_grad(set_to_none=True)
            losses, accs, step_losses = [], [], []
            for m in range(self.cfg.grad_accum):
                batch = self.plan[(self.step * self.world + self.rank) * self.cfg.grad_accum + m]
                ids, mask = collate(self.rows, batch, self.cfg.max_len, self.device)
                out = self.batch_loss(ids, mask, embed, hdtype, timer, cuda)
                with timer.phase("backward_step"):
                    out.loss.backward()  # gradients add up over the step's batches
                tokens += int(mask.sum())  # assistant tokens
                real += sum(self.lengths[i] for i in batch)  # prompt + reply, no padding
                padded += ids.numel()
                losses.append(float(out.loss.detach()))  # sync (ttt_loss already synced once for its statistics)
                accs.append(out.step_acc)
                step_losses.append(out.step_loss)
            with timer.phase("backward_step"):
                self.optimizer_step()
            self.step += 1
            loss = sum(losses) / len(losses)
            acc = [sum(a) / len(a) for a in zip(*accs)]
            step_loss = [sum(s) / len(s) for s in zip(*step_losses)]
            self.history.append({"step": self.step, "loss": loss, "acc": acc, "step_loss": step_loss,
                                 "lr": self.sched.get_last_lr()[0]})
            bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{acc[0]:.2f}", acc_last=f"{acc[-1]:.2f}")
            bar.update(1)
            out_of_time = self.out_of_time(t0)
            if self.step % self.cfg.save_every == 0 or self.step == self.total or out_of_time:
                self.checkpoint()
                timer.totals()  # fold the CUDA events so far into sums (they would pile up otherwise)
            if out_of_time:
                self.log(f"time limit reached at step {self.step} of {self.total}: checkpointed; rerun to resume")
                break
        bar.close()
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        if self.world > 1:  # every rank's tokens
            counts = torch.tensor([tokens, real, padded], device=self.device)
            torch.distributed.all_reduce(counts)
            tokens, real, padded = counts.tolist()
        export = None
        if self.writer:
            export = save_eagle3(self.head, Path(self.cfg.out) / "drafter", torch.bfloat16 if cuda else torch.float32,
                                 embed=self.head_embed)
            (Path(self.cfg.out) / "history.json").write_text(json.dumps(self.history))
        phases = timer.totals()
        return {"steps": self.step, "finished": self.step == self.total, "world_size": self.world,
                "steps_this_run": self.step - first, "seconds_this_run": secs,
                "assistant_tokens_this_run": tokens, "tokens_this_run": real, "padded_tokens_this_run": padded,
                "tokens_per_s": tokens / max(secs, 1e-9),
                "ms_per_step": {k: v["ms"] / max(1, self.step - first) for k, v in phases.items()}, "export": export and str(export),
                "final_loss": self.history[-1]["loss"] if self.history else None}
