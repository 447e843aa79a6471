"""Moving a head onto the target's output layer (eaglet/spec/drafters/eagle3_outmap.py): an orthogonal
change of the head's residual basis leaves every draft as it was, and when the head's rows are a rotation
and scaling of the target's, the head moved onto the target's layer drafts exactly as before."""
import dataclasses

import pytest
import torch

from eaglet.spec.drafters.eagle3_head import Eagle3Config
from eaglet.spec.drafters.eagle3_outmap import fit_output_map, onto_target_output, rotate_residual

from .test_eagle3_ckpt import VD, drafts, head_logits, plain, random_head, target  # noqa: F401 (fixtures)


def orthogonal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))
    return q


def test_rotating_the_residual_changes_no_draft(target):
    head = random_head(Eagle3Config.for_target(target.config, draft_vocab_size=VD))
    before = head_logits(head, target)
    rotate_residual(head, orthogonal(64, 1))
    for name in ("midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        assert torch.equal(head.get_submodule(name).weight, torch.ones(64)), name  # folded into the readers
    assert torch.allclose(head_logits(head, target), before, atol=1e-4)
    assert (head_logits(random_head(head.cfg, seed=5), target) - before).abs().max() > 0.1  # the check can fail


def test_rotation_keeps_the_speculation(target, plain):
    head = random_head(Eagle3Config.for_target(target.config, draft_vocab_size=VD))
    want = drafts(head, target)
    rotate_residual(head, orthogonal(64, 2))
    assert drafts(head, target) == want  # the same drafts accepted at every step of every prompt


def test_what_cannot_turn_is_refused_or_moved_unturned(target):
    cfg = Eagle3Config.for_target(target.config)
    with pytest.raises(ValueError, match="norm_before_residual"):
        rotate_residual(random_head(dataclasses.replace(cfg, norm_before_residual=True)), orthogonal(64, 0))
    shared = random_head(cfg).with_shared_lm_head(target.lm_head.weight)
    with pytest.raises(ValueError, match="cannot turn"):
        rotate_residual(shared, orthogonal(64, 0))
    nbr = random_head(dataclasses.replace(cfg, norm_before_residual=True))  # moved unturned, rows dropped
    moved, dropped = onto_target_output(nbr, target.lm_head.weight), nbr.with_shared_lm_head(target.lm_head.weight)
    assert torch.equal(head_logits(moved, target), head_logits(dropped, target))


def test_a_head_whose_rows_are_the_targets_turned_moves_onto_them_exactly(target):
    """Rows (final norm folded in) = target rows · diag(s) · Q over the draft ids: the fit finds that map
    and the head drafting through the target's whole layer gives the same logits on its draft ids (more
    draft ids than dimensions, as in any real head: the map is then the only one)."""
    head = random_head(Eagle3Config.for_target(target.config, draft_vocab_size=100))
    ids, t = head.draft_to_target(), target.lm_head.weight.detach()
    s = 0.5 + torch.rand(64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        head.lm_head.weight.copy_((t[ids] * s) @ orthogonal(64, 3) / head.norm.weight)
    q, s_fit = fit_output_map(head.lm_head.weight * head.norm.weight, t[ids])
    assert torch.allclose((t[ids] * s_fit) @ q, head.lm_head.weight * head.norm.weight, atol=1e-4)
    moved = onto_target_output(head, target.lm_head.weight)
    assert moved.cfg.shared_lm_head and moved.cfg.draft_vocab_size == 128
    assert moved.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert torch.allclose(head_logits(moved, target)[..., ids], head_logits(head, target), atol=1e-3)
    plainly = head.with_shared_lm_head(target.lm_head.weight)  # the rows dropped without the turn
    assert (head_logits(plainly, target)[..., ids] - head_logits(head, target)).abs().max() > 0.1
