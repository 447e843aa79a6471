"""An EAGLE-3 drafter with its own output rows, moved onto the target's output layer (the form with no
lm_head.weight that SGLang and vLLM load with the target's layer): its residual basis turned and its final
norm's weight re-fitted so its output lands as near the target's rows as a rotation and a scale allow
(eaglet/spec/drafters/eagle3_outmap.py, what `train-draft --shared-lm-head --init-from D` starts from).
Writes the moved export and a record of how near: the fit's relative residual over the draft ids, and the
least-squares bound of any linear map for comparison, and the export's size (with --intermediate-size N, of the
moved head widened to N: what the freed bytes hold). CPU.

  .venv/bin/python bench/cpu/turn_drafter.py OUT [--draft DIR] [--intermediate-size N]
then, for what it drafts before any training:
  .venv/bin/python -m eaglet eval-draft --device cpu --dtype float32 --draft OUT --prompts mtbench ...
"""
import argparse

import torch

from eaglet.perf.record import write_record
from eaglet.spec.drafters.eagle3_ckpt import load_eagle3, save_eagle3
from eaglet.spec.drafters.eagle3_outmap import fit_output_map, onto_target_output, output_rows
from eaglet.spec.speculator import bundled_drafter
from eaglet.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="directory for the moved drafter's export")
    ap.add_argument("--draft", help="drafter directory (default: the bundled one)")
    ap.add_argument("--intermediate-size", type=int, help="widen the moved head's MLP to this (Eagle3Head.widen_mlp)")
    ap.add_argument("--records", default="bench/results")
    args = ap.parse_args()
    draft = args.draft or str(bundled_drafter())
    target = load_model(None, "float32", "cpu", tokenizer=False).model
    head, _ = load_eagle3(draft, target.config, "cpu", torch.float32)
    t = target.lm_head.weight.detach()
    ids = head.draft_to_target()
    rows = output_rows(head)
    q, s = fit_output_map(rows, t[ids])
    fit = float(((t[ids] * s) @ q - rows).norm() / rows.norm())
    linear = torch.linalg.lstsq(t[ids].double(), rows.double()).solution.float()  # any map, not one the format holds
    bound = float((t[ids] @ linear - rows).norm() / rows.norm())
    moved = onto_target_output(head, target.lm_head.weight, (q, s))
    if args.intermediate_size:
        moved = moved.widen_mlp(args.intermediate_size, torch.Generator().manual_seed(0))
    size = (save_eagle3(moved, args.out) / "model.safetensors").stat().st_size
    path = write_record("turn-drafter", {"draft": draft, "out": args.out, "intermediate_size": args.intermediate_size},
                        {"draft_ids": len(ids), "relative_residual_rotation_and_scale": round(fit, 4),
                         "relative_residual_any_linear_map": round(bound, 4), "export_bytes": size},
                        args.records, models={"draft": draft, "moved": args.out})
    print(f"{len(ids)} draft ids: rows fitted by a rotation and a scale to within {fit:.1%} (any linear map: "
          f"{bound:.1%}); moved drafter in {args.out}, {size:,} bytes\nrecord: {path}")


if __name__ == "__main__":
    main()
