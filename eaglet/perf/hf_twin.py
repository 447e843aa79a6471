"""transformers' own model holding an eaglet model's weights, for side-by-side runs of random-weight
shapes: built on the meta device from the same config and given eaglet's tensors themselves (no
copy, so it fits wherever eaglet's model fits). transformers keeps routed experts stacked under
`mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj` (E, H, I), eaglet's fused stacks,
and calls Mixtral's block `mlp` where its checkpoints say `block_sparse_moe`."""
from __future__ import annotations

import torch

from ..models.llama import CausalLM
from ..models.moe import NAMES, SparseMoE


def hf_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """eaglet's state dict under transformers' module names, sharing its tensors."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.rotary.")}  # computed, not loaded
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.ffn, SparseMoE):
            continue
        name = NAMES[model.config.model_type][0]
        ours, theirs = f"model.layers.{i}.{name}.", f"model.layers.{i}.mlp."
        for key in [k for k in state if k.startswith(ours + "experts.")]:
            del state[key]
        for key in [k for k in state if k.startswith(ours)]:
            state[theirs + key[len(ours):]] = state.pop(key)
        gate_up, down = layer.ffn.stacks()
        state[theirs + "experts.gate_up_proj"], state[theirs + "experts.down_proj"] = gate_up, down
    return state


def hf_twin(model: CausalLM):
    """transformers' model of `model`'s config holding `model`'s tensors (eval, no gradients)."""
    import transformers

    p = next(model.parameters())
    cfg = transformers.AutoConfig.for_model(**model.config.to_hf())
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=p.dtype)
    hf.load_state_dict(hf_state(model), strict=True, assign=True)
    rotary = hf.model.rotary_emb  # its frequencies are buffers computed when built: built again here
    with torch.device(p.device):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"transformers' twin: {left[0]} has no tensor")
    return hf.eval().requires_grad_(False)
