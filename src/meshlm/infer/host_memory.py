"""Reuse of freed host memory between engine steps: glibc malloc's two thresholds, set once per process.

Each step of the engine allocates and frees the same activations again (hundreds of KiB to a few MiB on
the benchmark's model). With glibc's defaults, blocks that large are mapped fresh from the kernel
(`mmap`) or the heap's free top is handed back (`trim`) after each step, so the next step faults every
page in again, zero-filled: ~10^5 page faults and ~0.2 s of kernel time per `benchmarks/serve.py` run,
~10% of it. Raising the mmap threshold to glibc's largest (32 MiB) and the trim threshold to 256 MiB keeps
those blocks in the heap for the next step (a few hundred page faults per run). The cost: the process
keeps up to 256 MiB of freed memory for reuse instead of returning it at once. Allocations over 32 MiB
are still mapped and unmapped as before.

The setting is process-wide (malloc is), so it is an explicit choice of whoever owns the process:
`LLM(..., reuse_host_memory=True)` (the default; `meshlm generate` and `meshlm serve` build an `LLM`)
calls `reuse_freed_host_memory()`; False leaves malloc alone. Without glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20


def reuse_freed_host_memory() -> bool:
    """Set glibc malloc's mmap and trim thresholds (see the module docstring); True when both were set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
