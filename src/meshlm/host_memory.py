"""Host memory for CPU runs: reuse of freed memory between steps (glibc malloc's two thresholds, set once
per process), huge pages under the KV cache, and how much memory the host has (`host_memory_bytes`: the
train memory check's and the KV host tier's bound).

Each step of the engine (or of training) allocates and frees the same activations again (hundreds of KiB to a
few MiB each). With glibc's defaults, blocks that large are mapped fresh from the kernel
(`mmap`) or the heap's free top is handed back (`trim`) after each step, so the next step faults every
page in again, zero-filled, in kernel time. Raising the mmap threshold to glibc's largest (32 MiB) and the trim threshold to 256 MiB keeps
those blocks in the heap for the next step. The cost: the process
keeps up to 256 MiB of freed memory for reuse instead of returning it at once. Allocations over 32 MiB
are still mapped and unmapped as before.

The setting is process-wide (malloc is), so it is an explicit choice of whoever owns the process:
`LLM(..., reuse_host_memory=True)` (the default; `meshlm generate` and `meshlm serve` build an `LLM`) and
`train.reuse_host_memory = true` (the default; each rank of `meshlm train`, `meshlm eval` on a CPU) call
`reuse_freed_host_memory()`; False leaves malloc alone. Without glibc (macOS, musl) it does nothing.
The page faults and time it saved, serving and training, are in README.md (the paged KV cache paragraph).

`advise_huge_pages(t)` asks Linux for 2 MiB pages under one tensor (`madvise(MADV_HUGEPAGE)`), before its
memory is first touched: the KV cache's (`new_kv_cache`). Decode attention reads a few KiB from each of
thousands of blocks spread over the cache, every step; with 4 KiB pages nearly each block costs a TLB miss
(a page walk, nested under a hypervisor). It changes no value and nothing outside that tensor; where the
kernel's transparent huge pages are off, or off Linux, it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

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


MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of a CPU tensor's memory (see the module docstring);
    True when the kernel took the advice. Call it before the memory is first written."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False  # smaller than a huge page once aligned
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise(start, end - start, MADV_HUGEPAGE) == 0


def host_memory_bytes() -> int | None:
    """This host's memory: MemTotal, or the cgroup's limit where it is smaller (a container); None if unknown."""
    sizes = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                sizes.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        try:
            sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" / a huge number: no limit
            sizes.append(int(text))
    return min(sizes) if sizes else None
