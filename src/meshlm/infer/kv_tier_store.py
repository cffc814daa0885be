"""One rank's KV tiers below its device cache: a host buffer of blocks and a directory of block files.

Responsible for: carrying out the moves rank 0's `kv_tiers.KVTiers` decided (`apply`) on this rank's own share
of each block (its kv heads under tp, its blocks under cp): copies between the device cache, the host buffer
(pinned when the cache is on a GPU, so the copies are DMA, on a side stream beside the compute) and files; checking a file before its bytes reach the
cache (size, checksum, header), so a truncated or corrupted file is reported and its tokens recomputed, never
served; surviving a full disk (a failed write turns this rank's disk tier off with a warning); and the
directory's signature -- model weights, KV layout, dtype, block size, tp x cp -- so that a server reads back only
files it wrote itself, or an earlier server with the same model and layout wrote (`disk_index`).
Not responsible for: deciding what moves (kv_tiers.py, on rank 0), or the cache's layout (attention.py: a block
is, per layer, keys [kv_heads, head_dim, block] and values [kv_heads, block, head_dim]).

A block's bytes, in host memory and in its file alike: [layer, keys|values, kv_heads * block * head_dim].
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

from meshlm.host_memory import host_memory_bytes
from meshlm.infer.kv_tiers import (KVTierConfig, file_bytes, file_name, header_bytes, move_group, pack_block,
                                   read_header, unpack_block)

log = logging.getLogger(__name__)
FORMAT = 1  # bump when the bytes of a block or its file change


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of a model's configuration and of a sample of every weight (names, shapes, dtypes, up to 1024
    evenly spaced values each): two different checkpoints differ in it. Taken from the full weights, before a
    tensor-parallel split, so every rank computes the same one."""
    h = hashlib.blake2b(digest_size=16)
    config = getattr(model, "config", None)
    h.update(json.dumps(config.to_dict() if hasattr(config, "to_dict") else repr(config), sort_keys=True,
                        default=str).encode())
    with torch.no_grad():
        for name, p in model.state_dict().items():
            flat = p.detach().reshape(-1)
            sample = flat[::max(1, flat.numel() // 1024)][:1024].to("cpu", torch.float64)
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def kv_signature(fingerprint: str, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block_size: int, tp: int, cp: int) -> dict:
    """What must be equal for a block file to be read back: the model, the KV layout and its sharding. (The chain
    hash keying the files is Python's hash of int tuples: the interpreter's version is part of it.)"""
    return {"format": FORMAT, "model": fingerprint, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(dtype), "block_size": block_size, "tp": tp, "cp": cp,
            "layout": "v[kv,blocks,block,dim] k[kv,blocks,dim,block]", "python": list(sys.version_info[:2])}


class KVTierStore:
    """The host buffer and block files of one rank, over its `ModelRunner`'s caches (one (k, v) per layer)."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], cfg: KVTierConfig, *,
                 block_size: int, signature: dict, tp_rank: int = 0, cp_rank: int = 0, cp: int = 1):
        self.k_caches, self.v_caches = k_caches, v_caches
        self.block_size, self.cp, self.cp_rank = block_size, cp, cp_rank
        k = k_caches[0]
        self.device, self.dtype = k.device, k.dtype
        self.numel = k[:, 0].numel()  # of one layer's keys (or values) of one block
        self.block_bytes = 2 * len(k_caches) * self.numel * k.element_size()
        self.host_slots = int(cfg.host_mb * (1 << 20)) // self.block_bytes
        if cfg.host_mb > 0 and not self.host_slots:
            raise ValueError(f"kv_host_mb={cfg.host_mb} (--kv-host-mb) holds no KV block of {self.block_bytes} bytes "
                             f"on a rank; give at least {self.block_bytes / (1 << 20):.4f} MiB, or 0 for no host tier")
        host = host_memory_bytes()
        if host is not None and self.host_slots * self.block_bytes > host:
            raise ValueError(f"kv_host_mb={cfg.host_mb:g} (--kv-host-mb) is more than this host's memory "
                             f"({host / (1 << 20):,.0f} MiB in all); give a share of it for each rank on the host")
        # Pinned on a GPU (page-locked: copies to and from the device are DMA, no staging copy); allocated once,
        # touched only as slots fill.
        self.host = torch.empty((self.host_slots, len(k_caches), 2, self.numel), dtype=self.dtype,
                                pin_memory=self.device.type == "cuda") if self.host_slots else None
        # On a GPU, copies between the cache and the host buffer run on a side stream, beside the compute (see
        # `_copy_run`); None elsewhere (CPU copies are plain memory copies, in order).
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.disk_blocks, self.disk_ok, self.root, self.dir = 0, False, None, None
        if cfg.disk_dir is not None:
            self._open_disk(cfg, signature, tp_rank)
        self.write_errors = 0

    def _open_disk(self, cfg: KVTierConfig, signature: dict, tp_rank: int) -> None:
        self.file_bytes = file_bytes(self.block_size, self.block_bytes)
        self.disk_blocks = int(cfg.disk_mb * (1 << 20)) // self.file_bytes
        if not self.disk_blocks:
            raise ValueError(f"kv_disk_mb={cfg.disk_mb} (--kv-disk-mb) holds no KV block file of {self.file_bytes} "
                             f"bytes on a rank; give at least {self.file_bytes / (1 << 20):.4f} MiB")
        text = json.dumps(signature, sort_keys=True)
        self.root = Path(cfg.disk_dir) / hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        self.dir = self.root / f"t{tp_rank}c{self.cp_rank}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            sig = self.root / "signature.json"
            if not sig.exists():
                tmp = self.dir / "signature.json.tmp"
                tmp.write_text(text + "\n")
                os.replace(tmp, sig)
        except OSError as e:
            raise ValueError(f"kv_disk_dir={cfg.disk_dir!r} (--kv-disk-dir): cannot create {self.dir} ({e}); give a "
                             "writable directory") from None
        self.disk_ok = True

    @property
    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size() if self.host is not None else 0

    def disk_bytes(self) -> int:
        """Bytes of this rank's block files now."""
        return sum(f.stat().st_size for f in self.dir.glob("*.kv")) if self.dir is not None else 0

    # ---- what an earlier server left ----------------------------------------------------------------------------

    def disk_index(self) -> list[list[tuple[int, int | None, tuple[int, ...]]]]:
        """Per group (cp rank), (key, parent, tokens) of the block files of tp rank 0, oldest first. Files of the
        wrong size or with a broken header are deleted with a warning (their checksums are checked when read)."""
        if self.root is None:
            return []
        index = []
        for g in range(self.cp):
            found = []
            for path in (self.root / f"t0c{g}").glob("*.kv"):
                try:
                    st = path.stat()
                    with open(path, "rb") as f:
                        head = read_header(f.read(header_bytes(self.block_size)), self.block_size)
                except OSError:
                    continue
                if st.st_size != self.file_bytes or head is None or file_name(head[0]) != path.name:
                    log.warning("KV disk tier: %s is not a whole block file (%d bytes, %d expected); ignored and "
                                "deleted, its tokens will be recomputed", path, st.st_size, self.file_bytes)
                    path.unlink(missing_ok=True)
                    continue
                found.append((st.st_mtime_ns, path.name, head))
            index.append([head for _, _, head in sorted(found)])
        return index

    # ---- moves ------------------------------------------------------------------------------------------------

    def apply(self, moves: list[list]) -> list[int]:
        """Carry out this rank's share of `moves` (`kv_tiers` lists them), in order; return the indices of the
        loads from disk that failed here (their device blocks hold nothing usable)."""
        failed = []
        i = 0
        while i < len(moves):
            op = moves[i][0]
            if op in ("d2h", "h2d"):  # a run of copies of one kind: one gather or scatter
                j = i
                while j < len(moves) and moves[j][0] == op:
                    j += 1
                self._copy_run(op, [m for m in moves[i:j] if move_group(m, self.cp) == self.cp_rank])
                i = j
                continue
            move = moves[i]
            if move_group(move, self.cp) == self.cp_rank and not self._file_move(move):
                failed.append(i)
            i += 1
        return failed

    def _copy_run(self, op: str, moves: list[list]) -> None:
        """Copies between the cache's blocks and host slots. On a GPU they run on `copy_stream` with the host never
        waiting: an eviction (d2h) gathers its blocks on the compute stream (so later writes to those blocks come
        after it) and copies them out beside the compute that follows; a load (h2d) copies in beside what is still
        running, and only the scatter into the cache waits for it. Host slots are written and read by this one
        stream, in order; the host itself reads a slot only after `_host_ready` (a disk write)."""
        if not moves:
            return
        cp = self.cp
        side = self.copy_stream
        if op == "d2h":
            data = self._gather([m[1] // cp for m in moves])
            if side is None:
                for row, m in zip(data, moves):
                    self.host[m[2] // cp].copy_(row)
                return
            side.wait_stream(torch.cuda.current_stream(self.device))  # the gather is done
            with torch.cuda.stream(side):
                for row, m in zip(data, moves):
                    self.host[m[2] // cp].copy_(row, non_blocking=True)
            data.record_stream(side)  # not reused by the compute stream before these copies end
        elif side is None:
            slots = torch.tensor([m[1] // cp for m in moves], dtype=torch.long)
            self._scatter([m[2] // cp for m in moves], self.host.index_select(0, slots))
        else:
            with torch.cuda.stream(side):
                data = torch.empty((len(moves), *self.host.shape[1:]), dtype=self.dtype, device=self.device)
                for row, m in zip(data, moves):
                    row.copy_(self.host[m[1] // cp], non_blocking=True)  # pinned: a DMA, the host goes on
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(side)
            data.record_stream(compute)
            self._scatter([m[2] // cp for m in moves], data)

    def _host_ready(self) -> None:
        """Before the host reads a slot: the side stream's copies into it are done."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def _file_move(self, move: list) -> bool:
        """A move that touches a file; False only for a load that failed."""
        op, cp = move[0], self.cp
        if op == "rm":
            if self.dir is not None:
                (self.dir / file_name(move[1])).unlink(missing_ok=True)
        elif op in ("h2f", "d2f"):
            _, src, key, parent, tokens = move
            if op == "h2f":
                self._host_ready()
            data = self.host[src // cp] if op == "h2f" else self._gather([src // cp])[0]
            self._write(key, parent, tokens, data)
        elif op == "f2d":
            return self._read(move[1], move[2] // cp)
        else:
            raise AssertionError(f"unknown KV tier move {move!r}")
        return True

    def _write(self, key: int, parent: int | None, tokens: list[int], data: torch.Tensor) -> None:
        if not self.disk_ok:
            return
        payload = data.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        path = self.dir / file_name(key)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(pack_block(key, parent, tokens, payload))
            os.replace(tmp, path)  # a crash leaves a .tmp, never a short block file under its name
        except OSError as e:
            self.write_errors += 1
            self.disk_ok = False
            tmp.unlink(missing_ok=True)
            log.warning("KV disk tier: writing %s failed (%s); the disk tier is off on this rank from now on "
                        "(serving goes on with the device and host tiers)", path, e)

    def _read(self, key: int, block: int) -> bool:
        path = self.dir / file_name(key) if self.dir is not None else None
        try:
            data = path.read_bytes() if path is not None else b""
        except OSError as e:
            data, why = None, f"unreadable ({e})"
        if data is not None:
            payload = unpack_block(data, key, self.block_size, self.block_bytes)
            if not isinstance(payload, str):
                flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype)
                self._scatter([block], flat.view(1, len(self.k_caches), 2, self.numel))
                os.utime(path)  # recently used, also for the next server's order
                return True
            why = payload
        log.warning("KV disk tier: block file %s is %s; ignored, its tokens will be recomputed", path, why)
        return False

    # ---- the cache's blocks as rows ----------------------------------------------------------------------------

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        """This rank's local `blocks` of every layer as [len(blocks), layers, 2, numel], on the cache's device."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        n = len(blocks)
        return torch.stack([torch.stack([k.index_select(1, idx).transpose(0, 1).reshape(n, -1),
                                         v.index_select(1, idx).transpose(0, 1).reshape(n, -1)], 1)
                            for k, v in zip(self.k_caches, self.v_caches)], 1)

    def _scatter(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write rows of `_gather`'s layout into this rank's local `blocks`."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        data = data.to(self.device)
        n = len(blocks)
        for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches)):
            k.index_copy_(1, idx, data[:, layer, 0].reshape(n, *k.shape[:1], *k.shape[2:]).transpose(0, 1))
            v.index_copy_(1, idx, data[:, layer, 1].reshape(n, *v.shape[:1], *v.shape[2:]).transpose(0, 1))
