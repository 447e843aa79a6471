"""Loading a drafter once (weights) and making a fresh drafter per generate call (caches)."""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SpecConfig
from ..errors import ModelLoadError
from ..kernels import Kernels
from ..models.llama import CausalLM, compile_elementwise
from .drafters.base import Drafter
from .drafters.draft_model import DraftModelDrafter
from .drafters.eagle3 import Eagle3Drafter
from .drafters.eagle3_head import Eagle3Head
from .drafters.ngram import NgramDrafter

BUNDLED = Path(__file__).resolve().parents[1] / "drafters"  # eaglet/drafters/<name>/ (trained defaults)


@dataclass
class Speculator:
    spec: SpecConfig
    head: Eagle3Head | None = None
    head_embed: torch.Tensor | None = None
    draft_model: CausalLM | None = None
    draft_path: str | None = None

    def make(self, target: CausalLM, batch: int, max_len: int) -> Drafter:
        # a drafter's cache also holds the block absorbed each step and the drafted nodes
        room = max_len + self.spec.steps + 2 + self.spec.steps * self.spec.topk + self.spec.draft_tokens
        if self.spec.method == "ngram":
            return NgramDrafter(self.spec, batch, room, next(target.parameters()).device, target.kernels)
        if self.spec.method == "draft":
            return DraftModelDrafter(self.draft_model, target, self.spec, batch, room)
        return Eagle3Drafter(self.head, target, self.spec, batch, room, self.head_embed)


def bundled_drafter() -> Path | None:
    """The EAGLE-3 drafter shipped for the embedded default model, if it is there."""
    d = BUNDLED / "smollm2-135m-instruct-eagle3"
    return d if (d / "config.json").exists() else None


def load_speculator(spec: SpecConfig, target: CausalLM, target_path: Path | None = None,
                    device=None, dtype=None) -> Speculator:
    """target_path None means the embedded default model (which has a bundled EAGLE-3 drafter). The
    drafter runs the target's kernels, but for `exact`: its drafts change only how many tokens a
    verify accepts, never which, so it keeps the faster kernels (on the GPU those an exact target
    leaves out: the GEMVs, the cache-attention kernel, torch.compile)."""
    p = next(target.parameters())
    kernels = dataclasses.replace(target.kernels, exact=False)
    if target.kernels.exact and p.is_cuda:
        kernels = Kernels.choose(p.device)
    device, dtype = device or p.device, dtype or p.dtype
    if spec.method == "ngram":
        return Speculator(spec)
    if spec.method == "draft":
        if not spec.draft:
            raise ModelLoadError("--spec draft needs --draft PATH (a smaller model with the same tokenizer)")
        from ..weights.loader import load_model

        dm = load_model(spec.draft, dtype, device, tokenizer=False, kernels=kernels).model
        if dm.config.vocab_size != target.config.vocab_size:
            raise ModelLoadError(f"draft model vocabulary {dm.config.vocab_size} does not match the target's "
                                 f"{target.config.vocab_size}")
        return Speculator(spec, draft_model=dm, draft_path=spec.draft)
    from .drafters.eagle3_ckpt import load_eagle3

    path = spec.draft or (bundled_drafter() if target_path is None else None)
    if path is None:
        raise ModelLoadError("--spec eagle3 needs --draft PATH (an EAGLE-3 drafter directory) for this model")
    head, embed = load_eagle3(path, target.config, device, dtype, target.output_weight(), kernels)
    head.fuse_projections()
    if head.kernels.compile:
        compile_elementwise(head)
    return Speculator(spec, head=head, head_embed=embed, draft_path=str(path))
