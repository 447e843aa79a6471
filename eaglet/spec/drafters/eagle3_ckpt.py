"""EAGLE-3 checkpoints: read the SGLang / SpecForge / EAGLE format and vLLM's speculators variant,
check them against the target, and write the SGLang format.

Layer-id conventions (docs/eagle3.md): SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
name the *output* of layer k, i.e. the input of k+1; the speculators' top-level
`eagle_aux_hidden_state_layer_ids` name inputs as-is. eaglet stores inputs (Eagle3Config.aux_layers).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ...config import ModelConfig
from ...errors import ModelLoadError
from ...kernels import EAGER, Kernels
from ...weights.safetensors_dir import iter_tensors, read_config
from .eagle3_head import Eagle3Config, Eagle3Head

SGLANG_ARCHS = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCH = "Eagle3Speculator"
RENAMES = [(re.compile(r"^model\."), ""), (re.compile(r"^layers\.0\."), "midlayer."),
           (re.compile(r"^draft_id_to_target_id$"), "d2t"), (re.compile(r"^target_id_to_draft_id$"), "t2d")]


def parse_config(cfg: dict, target: ModelConfig, num_layers: int = 1) -> Eagle3Config:
    """The head's config from its config.json; `num_layers` from its weights (head_layers)."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch == SPECULATORS_ARCH:
        layer_cfg = dict(cfg.get("transformer_layer_config") or {})
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(ids) if ids else target.default_eagle_layers
        norm_before_residual = bool(cfg.get("norm_before_residual", False))  # vLLM's and speculators' default
        draft_vocab = cfg.get("draft_vocab_size") or layer_cfg.get("vocab_size")
    elif arch in SGLANG_ARCHS:
        layer_cfg = dict(cfg)
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(i + 1 for i in ids) if ids else target.default_eagle_layers
        norm_before_residual = bool(cfg.get("norm_before_residual", False))
        draft_vocab = cfg.get("draft_vocab_size") or cfg.get("vocab_size")
    else:
        raise ModelLoadError(f"unknown EAGLE-3 drafter architecture {arch!r} "
                             f"(expected one of {', '.join(SGLANG_ARCHS + (SPECULATORS_ARCH,))})")
    layer_cfg.update(model_type="llama", num_hidden_layers=num_layers)
    layer_cfg.setdefault("vocab_size", target.vocab_size)
    layer = ModelConfig.from_hf(layer_cfg)
    return Eagle3Config(layer=layer, draft_vocab_size=int(draft_vocab),
                        target_hidden_size=int(cfg.get("target_hidden_size") or layer.hidden_size),
                        aux_layers=tuple(int(i) for i in aux), norm_before_residual=norm_before_residual)


def check_fits(cfg: Eagle3Config, target: ModelConfig, has_embed: bool, where: str) -> None:
    """Refuse a drafter whose shapes or taps do not fit the target, naming the mismatch."""
    if cfg.target_hidden_size != target.hidden_size:
        raise ModelLoadError(f"{where}: drafter expects target hidden size {cfg.target_hidden_size}, "
                             f"the target has {target.hidden_size}")
    if cfg.layer.vocab_size != target.vocab_size:
        raise ModelLoadError(f"{where}: drafter vocabulary {cfg.layer.vocab_size} does not match the "
                             f"target's {target.vocab_size}")
    if cfg.draft_vocab_size > target.vocab_size:
        raise ModelLoadError(f"{where}: draft vocabulary {cfg.draft_vocab_size} exceeds the target's {target.vocab_size}")
    bad = [i for i in cfg.aux_layers if not 0 <= i < target.num_layers]
    if bad or len(cfg.aux_layers) != 3:
        raise ModelLoadError(f"{where}: drafter taps target layers {list(cfg.aux_layers)}, but the target has "
                             f"{target.num_layers} layers (three taps in 0..{target.num_layers - 1} needed)")
    if not has_embed and cfg.layer.hidden_size != target.hidden_size:
        raise ModelLoadError(f"{where}: drafter hidden size {cfg.layer.hidden_size} differs from the target's "
                             f"{target.hidden_size} and the checkpoint has no embed_tokens of its own")


def head_layers(tensors: dict, cfg: dict, path) -> int:
    """The head's decoder layers: the midlayer and vLLM's layers.1, layers.2, ... in the checkpoint,
    numbered without a gap; an SGLang-style config's num_hidden_layers must agree."""
    later = sorted({int(m.group(1)) for m in map(re.compile(r"^layers\.(\d+)\.").match, tensors) if m})
    n = 1 + len(later)
    if later != list(range(1, n)):
        raise ModelLoadError(f"{path}: the drafter's later layers are numbered {later}, not 1..{n - 1}")
    # the speculators' transformer_layer_config describes one layer's shape, not the head's depth
    said = cfg.get("num_hidden_layers") if "transformer_layer_config" not in cfg else None
    if said is not None and int(said) != n:
        raise ModelLoadError(f"{path}: config.json says num_hidden_layers {said}, the weights hold {n} layers")
    return n


def load_eagle3(path: str | Path, target: ModelConfig, device, dtype, lm_head: torch.Tensor | None = None,
                kernels: Kernels = EAGER) -> tuple[Eagle3Head, torch.Tensor | None]:
    """Load a drafter directory; returns (head, its own embedding weight or None to use the target's).
    A checkpoint without lm_head.weight drafts over the whole vocabulary through the target's output
    layer, `lm_head` (V, H), as SGLang (no draft_vocab_size: the target's head) and vLLM load it.
    The head runs `kernels` (the target's, when it drafts for one)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"drafter path {str(path)!r} is not a directory")
    raw = read_config(path)
    tensors = {}
    for name, t in iter_tensors(path):
        for pat, rep in RENAMES:
            name = pat.sub(rep, name)
        tensors[name] = t
    embed = tensors.pop("embed_tokens.weight", None)
    cfg = parse_config(raw, target, head_layers(tensors, raw, path))
    check_fits(cfg, target, embed is not None, str(path))
    if "lm_head.weight" not in tensors:  # the target's output layer (Eagle3Config.shared_lm_head)
        if cfg.draft_vocab_size != target.vocab_size:
            raise ModelLoadError(f"{path}: no lm_head.weight, yet a draft vocabulary of {cfg.draft_vocab_size} "
                                 f"ids (a head without one drafts through the target's {target.vocab_size})")
        if lm_head is None:
            raise ModelLoadError(f"{path}: the drafter has no lm_head.weight: it drafts through the target's "
                                 f"output layer, and none was given")
        cfg = replace(cfg, shared_lm_head=True)
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[1] != len(cfg.aux_layers) * target.hidden_size:
        raise ModelLoadError(f"{path}: fc.weight takes {fc.shape[1]} features, the target gives "
                             f"{len(cfg.aux_layers)} x {target.hidden_size}")
    from ...weights.loader import OPTIONAL, load_state

    with torch.device("meta"):
        head = Eagle3Head(cfg, kernels)
    head = head.to_empty(device=device)
    head.post_materialize()
    head.d2t.zero_()
    head.t2d.fill_(True)
    # the maps are omitted when the draft vocabulary is the target's (d2t = 0, t2d = all true)
    optional = OPTIONAL | ({"d2t", "t2d"} if cfg.draft_vocab_size == target.vocab_size else set())
    if cfg.shared_lm_head:
        optional |= {"lm_head.weight"}
    load_state(head, tensors.items(), str(path), optional=optional)
    head = head.to(dtype)  # floating tensors only: d2t stays int64, t2d bool
    if cfg.shared_lm_head:  # the target's own tensor where device and dtype agree, no copy
        head.share_lm_head(lm_head.detach().to(head.fc.weight.device, dtype))
    return head.eval().requires_grad_(False), embed


def save_eagle3(head: Eagle3Head, out: str | Path, dtype: torch.dtype = torch.bfloat16,
                embed: torch.Tensor | None = None) -> Path:
    """Write `head` in the SGLang format (config.json + model.safetensors), atomically; a head of
    several layers writes its later ones as vLLM names them (layers.1.*, ...); `embed`: the
    drafter's own embedding table (embed_tokens.weight), when it has one."""
    cfg, c = head.cfg, head.cfg.layer
    hf = c.to_hf()
    for k in ("sliding_window", "bos_token_id", "eos_token_id"):
        hf.pop(k, None)
    hf.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=c.num_layers, vocab_size=c.vocab_size,
              draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.target_hidden_size,
              tie_word_embeddings=False, torch_dtype=str(dtype).split(".")[-1],
              eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers],
                            "use_aux_hidden_state": True})
    if cfg.norm_before_residual:
        hf["norm_before_residual"] = True
    if cfg.shared_lm_head:  # without draft_vocab_size SGLang takes the target's lm_head
        del hf["draft_vocab_size"]
    own = {k: v for k, v in head.state_dict().items()
           if not (cfg.shared_lm_head and k in ("lm_head.weight", "d2t", "t2d"))}  # the target's, not written
    if embed is not None:
        own["embed_tokens.weight"] = embed
    state = {}
    for k, v in own.items():
        state[k] = v.detach().to("cpu").contiguous()
        if v.is_floating_point():
            state[k] = state[k].to(dtype)
    return write_export(out, hf, state)


def write_export(out: str | Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors into directory `out`, atomically: readers see the old export
    or the whole new one, never a half-written one."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is for others to read
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        (tmp / "model.safetensors").chmod(0o644)  # safetensors writes it private; a checkpoint is for others to read
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
