"""Every Triton kernel of the package compiles for the H200 (sm_90) with bfloat16 operands, here,
without a GPU. The other kernel tests run Triton's interpreter, which executes the kernels' Python
and never the compiler: a kernel it accepts can still fail to compile on the GPU, where the only
test that would notice costs device time. Skipped where Triton has no NVIDIA backend."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
try:
    import triton.backends.nvidia.compiler  # noqa: F401 (ships ptxas)
except ImportError:
    pytest.skip("this Triton has no NVIDIA backend", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-m", "tests.triton_compile_cases"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "FAILED" not in r.stdout, r.stdout + r.stderr[-3000:]
    assert len([ln for ln in lines if ln.startswith("ok ")]) == 66, r.stdout
