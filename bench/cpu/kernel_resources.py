"""Registers and stack (register spills) a thread of the MLA attention kernel takes on the H200,
compiled here for sm_90 without a GPU (Triton's compiler and ptxas, `cuobjdump --dump-resource-usage`
on the cubin), at each tile it could run with: entries a block x warps, for a decode and a 16-token
tree verify at DeepSeek's widths (512 + 64). Stack is local memory a spilled value goes through on
every use. A probe, CPU.

  env -u TRITON_INTERPRET PYTHONPATH=. .venv/bin/python bench/cpu/kernel_resources.py [--out bench/results]
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.triton_compile_cases import compile_for_h200  # noqa: E402

from eaglet.models import mla_attention  # noqa: E402
from eaglet.perf.record import write_record  # noqa: E402


def resources(cubin: bytes) -> dict:
    """REG, STACK, SHARED of the cubin's kernel, from cuobjdump (shipped with Triton's NVIDIA backend)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", out)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    rows = []
    for block in (16, 32, 64):
        for warps in (4, 8):
            for tokens, tree, split in [(1, False, False), (16, True, True)]:
                const = dict(NH=16, C=512, R=64, RP=64, ROWS=mla_attention.ROWS, TP=16, PP=16, BLOCK=block,
                             CK=mla_attention.CHUNK, TREE=tree, SPLIT=split, INTERLEAVED=True)
                r = resources(compile_for_h200(mla_attention.mla_kernel, const, warps))
                rows.append({"block": block, "warps": warps, "tokens": tokens, **r,
                             "shipped": block == mla_attention.BLOCK and warps == 8})
                print(f"MLA attention, {block} entries a block, {warps} warps, {tokens} tokens: "
                      f"{r['reg']} registers, {r['stack']} B stack{'  (shipped)' if rows[-1]['shipped'] else ''}",
                      flush=True)
    print("record:", write_record("kernel-resources", vars(args), {"mla_attention": rows}, args.out))


if __name__ == "__main__":
    main()
