"""The one compiled kernel of the engine: decode attention over the paged KV cache on a CPU, fp32.

`decode_attention.c` (next to this file, C99 with GCC/Clang vector extensions, no torch headers) is
compiled with the system's C compiler the first time a process asks for it and cached under
~/.cache/meshlm/kernels, one shared library per source, compiler, flags and CPU (it is built for the CPU
it runs on). Ranks that build it at once each write their own file and rename it into place, so none
ever loads a partial one.

Why: a decode step reads every cached key and value of every running sequence, far more than the CPU's
caches hold, and through torch ops (`DecodeBatch`'s embedding_bag path) that attention is a large share of
the step. So the kernel is built to stream them: each key and value read once, in address order, into
register tiles, the next decode's blocks prefetched, no index tensor. What it gained on the serving
benchmark's machine is in README.md (the paged KV cache paragraph); `benchmarks/serve.py` measures the
engine with it.

Threads: where the compiler has OpenMP, the (kv head, decode) pairs are split over
`torch.get_num_threads()` threads, in torch's own OpenMP runtime (the library links libgomp.so.1, which
torch has already loaded: one runtime, one thread pool); each pair is computed as by one thread, so the
output does not depend on the count. One thread per rank under a launcher, as torch's ops.

Without a C compiler, or where compiling fails, `decode_attention_kernel` returns None and the engine
keeps its torch path (the same numbers within fp32 rounding); `ModelRunner(..., native_attention=False)`
(also `Engine`/`LLM`) chooses the torch path explicitly.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
# Tried in order: with OpenMP (the kernel then splits its work over torch's intra-op threads; the library
# links libgomp.so.1, the runtime torch has already loaded), without it, without -march=native.
FLAGS = [["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"]]


def _cpu_identity() -> str:
    """What the library is built for: the CPU's model and feature flags (Linux), else the platform's word."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() + platform.machine()


def _compile(cc: str, flags: list[str], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *flags, "-std=c99", "-fPIC", "-shared", str(SOURCE), "-o", tmp, "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            os.replace(tmp, target)  # atomic: a concurrent loader sees the old file or the whole new one
            return True
        log.info("compiling %s failed: %s", SOURCE.name, done.stderr.strip()[-500:])
        return False
    except (OSError, subprocess.SubprocessError) as e:
        log.info("compiling %s failed: %s", SOURCE.name, e)
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def decode_attention_kernel() -> ctypes.CDLL | None:
    """The compiled library (`meshlm_decode_attention`, `meshlm_decode_attention_scratch`, ctypes-typed), or
    None where no C compiler builds it. Compiled once per machine, loaded once per process."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    source = SOURCE.read_bytes()
    for flags in FLAGS:
        key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(flags).encode(), _cpu_identity().encode(),
                                        platform.machine().encode()])).hexdigest()[:16]
        for root in (Path.home() / ".cache" / "meshlm" / "kernels", Path(tempfile.gettempdir()) / "meshlm-kernels"):
            target = root / f"decode_attention-{key}.so"
            try:
                if not target.exists() and not _compile(cc, flags, target):
                    break  # these flags fail; the next ones may not
                lib = ctypes.CDLL(str(target))
            except OSError:
                continue  # an unwritable cache or an unloadable file: the next place
            lib.meshlm_decode_attention.restype = None
            lib.meshlm_decode_attention.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 8
            lib.meshlm_decode_attention_scratch.restype = ctypes.c_int64
            lib.meshlm_decode_attention_scratch.argtypes = [ctypes.c_int64] * 4
            return lib
    return None


def native_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                            counts: torch.Tensor, *, with_lse: bool = False):
    """`DecodeBatch.attend` by the kernel. q [num_kv, batch, groups, dim] fp32, already scaled; caches fp32
    [num_kv, num_blocks, dim, block] (keys) and [num_kv, num_blocks, block, dim]; blocks/counts int32
    [batch, width]. Returns out [num_kv, batch, groups, dim] (and lse [num_kv, batch, groups])."""
    lib = decode_attention_kernel()
    assert lib is not None and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
    assert blocks.dtype == counts.dtype == torch.int32 and blocks.shape == counts.shape
    num_kv, batch, groups, dim = q.shape
    num_blocks, block = k_cache.shape[1], k_cache.shape[-1]
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    blocks, counts = blocks.contiguous(), counts.contiguous()
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:-1]) if with_lse else None
    width = blocks.shape[1]
    threads = torch.get_num_threads()  # as many as torch's own ops use (1 per rank under a launcher)
    scratch = q.new_empty(lib.meshlm_decode_attention_scratch(groups, width, block, threads))
    lib.meshlm_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(),
                                counts.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else None,
                                scratch.data_ptr(), num_kv, batch, groups, dim, block, num_blocks, width, threads)
    return (out, lse) if with_lse else out
