"""An EAGLE-3 drafter with its own output rows, moved onto the target's output layer (the form with no
lm_head.weight that SGLang and vLLM load with the target's layer): its residual basis turned and its final
norm's weight re-fitted so its output lands as near the target's rows as a rotation and a scale allow
(eaglet/spec/drafters/eagle3_outmap.py, what `train-draft --shared-lm-head --init-from D` starts from).
Writes the moved export and a record of how near: the fit's relative residual over the draft ids, and the
least-squares bound of any linear map for comparison. CPU.

  .venv/bin/python bench/cpu/turn_drafter.py OUT [--draft DIR]
then, for what it drafts before any training:
  .venv/bin/python -m eaglet eval-draft --device cpu --dtype float32 --draft OUT --prompts mtbench ...
"""
import argparse

import torch

from eaglet.perf.record import write_record
from eaglet.spec.drafters.eagle3_ckpt import load_eagle3, save_eagle3
from eaglet.spec.drafters.eagle3_outmap import fit_output_map, onto_target_output
from eaglet.spec.speculator import bundled_drafter
from eaglet.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", help="directory for the moved drafter's export")
    ap.add_argument("--draft", help="drafter directory (default: the bundled one)")
    ap.add_argument("--records", default="bench/results")
    args = ap.parse_args()
    draft = args.draft or str(bundled_drafter())
    target = load_model(None, "float32", "cpu", tokenizer=False).model
    head, _ = load_eagle3(draft, target.config, "cpu", torch.float32)
    t = target.lm_head.weight.detach()
    ids = head.draft_to_target()
    rows = head.lm_head.weight.detach() * head.norm.weight.detach()  # the final norm's weight folded in
    q, s = fit_output_map(rows, t[ids])
    fit = float(((t[ids] * s) @ q - rows).norm() / rows.norm())
    linear = torch.linalg.lstsq(t[ids].double(), rows.double()).solution.float()  # any map, not one the format holds
    bound = float((t[ids] @ linear - rows).norm() / rows.norm())
    save_eagle3(onto_target_output(head, target.lm_head.weight, (q, s)), args.out)
    path = write_record("turn-drafter", {"draft": draft, "out": args.out},
                        {"draft_ids": len(ids), "relative_residual_rotation_and_scale": round(fit, 4),
                         "relative_residual_any_linear_map": round(bound, 4)},
                        args.records, models={"draft": draft, "moved": args.out})
    print(f"{len(ids)} draft ids: rows fitted by a rotation and a scale to within {fit:.1%} (any linear map: "
          f"{bound:.1%}); moved drafter in {args.out}\nrecord: {path}")


if __name__ == "__main__":
    main()
