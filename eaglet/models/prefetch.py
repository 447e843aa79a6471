"""L2 prefetches from inside a kernel: a kernel that leaves DRAM idle (attention over a short cache
waits on its own chain of dependent steps; the MoE gate-up at one token runs on fewer programs
than the GPU has SMs) asks L2 for the weights the next kernel will stream, so their DRAM reads
overlap this kernel's work and the next one reads from L2. A prefetch (PTX `prefetch.global.L2`)
moves a 128-byte line into L2 and nothing into the SM's registers: it changes no result, only
when the bytes arrive.

Only compiled for the GPU: under TRITON_INTERPRET=1 callers pass PREFETCH=False (the interpreter
cannot run PTX).
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without Triton
    triton = None


if triton is not None:
    @triton.jit
    def fetch_lines(ptrs, LAST: tl.constexpr):
        """L2 fetches the line of each pointer in `ptrs` (any shape); LAST: with evict-last priority
        (it must outlive a stream of evict-first loads before its reader comes)."""
        if LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def fetch_share(ptr, n, program, programs, BLOCK: tl.constexpr):
        """This program's share of the n two-byte elements at `ptr`, line by line, BLOCK lines a step:
        `programs` programs together fetch the whole tensor once."""
        lines = tl.cdiv(n, 64)  # 128-byte lines of two-byte elements
        per = tl.cdiv(lines, programs)
        for l0 in range(program * per, tl.minimum(lines, (program + 1) * per), BLOCK):
            ln = tl.minimum(l0 + tl.arange(0, BLOCK), lines - 1).to(tl.int64)
            fetch_lines(ptr + ln * 64, False)

    @triton.jit
    def fetch_rows(w, rows, c0, n, LINES: tl.constexpr):
        """L2 fetches (evict-last) the two-byte elements c0 .. c0 + n - 1 of the rows at w + rows (rows:
        (R,) int64 element offsets of each row's start): a line every 128 bytes and the last element's
        (LINES >= n / 64 + 2 covers them)."""
        co = tl.minimum(tl.arange(0, LINES) * 64, n - 1)
        fetch_lines(w + rows[:, None] + c0 + co[None, :], True)
