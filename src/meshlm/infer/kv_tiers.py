"""KV cache tiers below the device pool: which prefix blocks live in host memory and on disk (rank 0's decisions).

Responsible for: the settings of the tiers (`KVTierConfig`: host memory, a disk directory and its size, with the
errors that name the flag to fix); rank 0's directory of the blocks each tier holds (`KVTiers`), keyed by the
block manager's chained content hash, least recently used first in each tier and each group (a cp rank); and
the moves that realise its decisions -- plain lists that travel to every rank with the step, where
`infer/kv_tier_store.py` copies the tensors. The disk file format (a fixed header with the block's hash, its
parent's hash and its tokens, then the KV bytes, then a checksum over both) is here too, torch-free, so rank 0
can read the headers of a directory left by an earlier server.
Not responsible for: tensors or files' contents (kv_tier_store.py), or when a block leaves the device pool
(block_manager.py decides that and tells this directory). No torch import here.

The tiers are inclusive: a block loaded back to the device keeps its host or disk copy (a later eviction of the
same block then copies nothing). When the device pool evicts a cached block it goes to the host tier (the host
tier's least recently used block, if the tier is full, goes to disk first); with no host tier straight to disk.
The disk tier drops its least recently used file when full. A block in a group (cp rank g) stays in group g in
every tier: a sequence's j-th block always lives on cp rank j % cp.

Moves (executed in order on every rank whose cp coordinate is the move's group):
  ["d2h", block, slot]                   device block -> host slot
  ["h2f", slot, key, parent, tokens]     host slot -> disk file of `key`
  ["d2f", block, key, parent, tokens]    device block -> disk file (no host tier)
  ["rm", key, group]                     delete the disk file of `key`
  ["h2d", slot, block]                   host slot -> device block
  ["f2d", key, block]                    disk file -> device block, checked: the one move that can fail
Device blocks and host slots are global ids: block b (slot s) lives on group b % groups (s % groups), as
local index b // groups.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"MLMKV001"
_HEAD = struct.Struct("<qq?i")  # hash, parent hash, parent is None, number of tokens
DIGEST_BYTES = 16
# what `KVTiers.counts` counts: blocks copied down (saved) and back (loaded) per tier, disk files that did not check
# out, blocks no tier had room for, files deleted to make room
TIER_COUNTS = ("host_saved_blocks", "disk_saved_blocks", "host_loaded_blocks", "disk_loaded_blocks",
               "disk_failed_loads", "dropped_blocks", "disk_evicted_blocks")


@dataclass(frozen=True)
class KVTierConfig:
    """The tiers' sizes, per rank (as the device pool's `--kv-cache-mb`): `host_mb` MiB of host memory, and
    `disk_mb` MiB of files under `disk_dir`. The disk directory must be visible to every rank of a server
    (one node, or a shared filesystem)."""

    host_mb: float = 0.0
    disk_dir: str | None = None
    disk_mb: float = 0.0

    @classmethod
    def of(cls, host_mb: float | None = None, disk_dir: str | Path | None = None,
           disk_mb: float | None = None) -> "KVTierConfig | None":
        """The checked settings, or None when no tier is asked for."""
        cfg = cls(float(host_mb or 0.0), None if disk_dir is None else str(disk_dir), float(disk_mb or 0.0))
        cfg.check()
        return cfg if cfg.host_mb > 0 or cfg.disk_dir is not None else None

    def check(self) -> None:
        if not (math.isfinite(self.host_mb) and self.host_mb >= 0):
            raise ValueError(f"kv_host_mb={self.host_mb} (--kv-host-mb) must be a finite number >= 0 of MiB of host "
                             "memory per rank; 0 turns the host tier off")
        if not (math.isfinite(self.disk_mb) and self.disk_mb >= 0):
            raise ValueError(f"kv_disk_mb={self.disk_mb} (--kv-disk-mb) must be a finite number >= 0 of MiB "
                             "of disk per rank")
        if self.disk_dir is None:
            if self.disk_mb > 0:
                raise ValueError(f"kv_disk_mb={self.disk_mb} (--kv-disk-mb) needs a directory: give kv_disk_dir "
                                 "(--kv-disk-dir DIR)")
            return
        if self.disk_mb <= 0:
            raise ValueError(f"kv_disk_dir={self.disk_dir!r} (--kv-disk-dir) needs the tier's size: give "
                             "kv_disk_mb > 0 (--kv-disk-mb MB, per rank)")
        path = Path(self.disk_dir)
        if path.exists() and not path.is_dir():
            raise ValueError(f"kv_disk_dir={self.disk_dir!r} (--kv-disk-dir) is a file, not a directory; give a "
                             "directory (it is created if missing)")


# ---- the disk file format (torch-free: bytes in, bytes out) ---------------------------------------------------

def header_bytes(block_size: int) -> int:
    return len(MAGIC) + _HEAD.size + 8 * block_size


def file_bytes(block_size: int, payload_bytes: int) -> int:
    """The size of every block's file: header, the KV bytes of one rank's share of the block, checksum."""
    return header_bytes(block_size) + payload_bytes + DIGEST_BYTES


def file_name(key: int) -> str:
    return f"{key & 0xFFFFFFFFFFFFFFFF:016x}.kv"


def pack_block(key: int, parent: int | None, tokens: list[int] | tuple[int, ...], payload: bytes) -> bytes:
    head = MAGIC + _HEAD.pack(key, parent or 0, parent is None, len(tokens)) + struct.pack(f"<{len(tokens)}q", *tokens)
    body = head + payload
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def read_header(data: bytes, block_size: int) -> tuple[int, int | None, tuple[int, ...]] | None:
    """(key, parent, tokens) of a file's first `header_bytes(block_size)` bytes, or None if they are not a header."""
    if len(data) < header_bytes(block_size) or not data.startswith(MAGIC):
        return None
    key, parent, no_parent, n = _HEAD.unpack_from(data, len(MAGIC))
    if n != block_size:
        return None
    tokens = struct.unpack_from(f"<{n}q", data, len(MAGIC) + _HEAD.size)
    return key, None if no_parent else parent, tokens


def unpack_block(data: bytes, key: int, block_size: int, payload_bytes: int) -> bytes | str:
    """The KV bytes of a whole file, or why it is not usable (a string): wrong size, header or checksum."""
    if len(data) != file_bytes(block_size, payload_bytes):
        return f"{len(data)} bytes instead of {file_bytes(block_size, payload_bytes)} (truncated?)"
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        return "checksum mismatch (corrupted)"
    head = read_header(data, block_size)
    if head is None or head[0] != key:
        return "not the block its name says"
    return body[header_bytes(block_size):]


# ---- rank 0's directory --------------------------------------------------------------------------------------

class KVTiers:
    """Which blocks the host and disk tiers hold, per group, in least-recently-used order; the moves to realise.

    `host_slots` / `disk_blocks`: per group (a cp rank's share). `disk_index`: per group, (key, parent,
    tokens) of the files an earlier server left, oldest first (kept up to `disk_blocks`, the rest deleted)."""

    def __init__(self, *, host_slots: int, disk_blocks: int, num_groups: int = 1,
                 disk_index: list[list[tuple[int, int | None, tuple[int, ...]]]] | None = None):
        assert host_slots >= 0 and disk_blocks >= 0 and num_groups >= 1
        self.num_groups, self.host_slots, self.disk_blocks = num_groups, host_slots, disk_blocks
        # per group: key -> (slot, parent, tokens) / key -> (parent, tokens), least recently used first
        self.host: list[OrderedDict] = [OrderedDict() for _ in range(num_groups)]
        self.disk: list[OrderedDict] = [OrderedDict() for _ in range(num_groups)]
        self.free_slots = [list(range(g, host_slots * num_groups, num_groups))[::-1] for g in range(num_groups)]
        self.moves: list[list] = []
        self._claimed: tuple[int, int, str, tuple] | None = None  # (group, key, tier, entry) between claim and load
        self.counts = dict.fromkeys(TIER_COUNTS, 0)
        for g, entries in enumerate(disk_index or []):
            for key, parent, tokens in entries:
                self.disk[g][key] = (parent, tuple(tokens))
            while len(self.disk[g]) > disk_blocks:
                self._evict_disk(g)

    # ---- queries ----------------------------------------------------------------------------------------

    @property
    def has_disk(self) -> bool:
        return self.disk_blocks > 0

    def num_blocks(self, tier: str) -> int:
        return sum(map(len, self.host if tier == "host" else self.disk))

    def is_empty(self) -> bool:
        return not any(self.host) and not any(self.disk)

    def take_moves(self) -> list[list]:
        moves, self.moves = self.moves, []
        return moves

    # ---- the device pool evicts a cached block ------------------------------------------------------------

    def evicted(self, group: int, key: int, parent: int | None, tokens: tuple[int, ...], block: int) -> None:
        """The device pool is about to reuse `block`, which holds the cached block `key`: keep it below."""
        host = self.host[group]
        if key in host:
            host.move_to_end(key)
            return
        slot = self._host_slot(group) if self.host_slots else None
        if slot is not None:
            self.moves.append(["d2h", block, slot])
            host[key] = (slot, parent, tokens)
            self.counts["host_saved_blocks"] += 1
        else:
            self._to_disk(group, "d2f", block, key, parent, tokens)

    def _host_slot(self, group: int) -> int | None:
        """A host slot of `group` to write into: a free one, or the least recently used one's, spilled first."""
        if self.free_slots[group]:
            return self.free_slots[group].pop()
        host = self.host[group]
        if not host:
            return None  # the group's only slot is claimed by a load under way
        key, (slot, parent, tokens) = host.popitem(last=False)
        self._to_disk(group, "h2f", slot, key, parent, tokens)
        return slot

    def _to_disk(self, group: int, op: str, src: int, key: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        """Keep block `key` on disk, written from `src` (a device block: "d2f", a host slot: "h2f") unless a file
        has it already; dropped when the disk tier is off or has no room."""
        disk = self.disk[group]
        if key in disk:
            disk.move_to_end(key)
        elif self._disk_room(group):
            self.moves.append([op, src, key, parent, list(tokens)])
            disk[key] = (parent, tokens)
            self.counts["disk_saved_blocks"] += 1
        else:
            self.counts["dropped_blocks"] += 1

    def _disk_room(self, group: int) -> bool:
        """Room for one more file in `group` (the least recently used one deleted if the tier is full)."""
        if not self.disk_blocks:
            return False
        claimed = self._claimed is not None and self._claimed[0] == group and self._claimed[2] == "disk"
        while len(self.disk[group]) + claimed >= self.disk_blocks:
            if not self.disk[group]:
                return False
            self._evict_disk(group)
        return True

    def _evict_disk(self, group: int) -> None:
        key, _ = self.disk[group].popitem(last=False)
        self.moves.append(["rm", key, group])
        self.counts["disk_evicted_blocks"] += 1

    # ---- loading a block back -----------------------------------------------------------------------------

    def claim(self, group: int, key: int, parent: int | None, tokens: tuple[int, ...]) -> str | None:
        """The tier ("host" or "disk") holding the block `key` with this parent and these tokens, taken out of
        eviction's reach until `load` (the device block it goes to may first evict another block); None: none."""
        assert self._claimed is None
        for tier, entries in (("host", self.host[group]), ("disk", self.disk[group])):
            entry = entries.get(key)
            if entry is not None and tuple(entry[-2:]) == (parent, tokens):
                del entries[key]
                self._claimed = (group, key, tier, entry)
                return tier
        return None

    def load(self, block: int) -> str:
        """Copy the claimed block into device `block`; it stays in its tier, as the most recently used."""
        group, key, tier, entry = self._claimed
        self._claimed = None
        if tier == "host":
            self.moves.append(["h2d", entry[0], block])
            self.host[group][key] = entry
        else:
            self.moves.append(["f2d", key, block])
            self.disk[group][key] = entry
        self.counts[f"{tier}_loaded_blocks"] += 1
        return tier

    def load_failed(self, group: int, key: int) -> None:
        """A disk file did not check out on some rank: forget it (and delete it)."""
        self.counts["disk_failed_loads"] += 1
        if self.disk[group].pop(key, None) is not None:
            self.moves.append(["rm", key, group])

    def disable_disk(self) -> None:
        """Writing to the disk tier failed on this rank: the tier is off from now on (its files are left)."""
        self.disk_blocks = 0
        for entries in self.disk:
            entries.clear()
        self.moves = [m for m in self.moves if m[0] not in ("h2f", "d2f", "rm")]

    def check_invariants(self) -> None:
        """Each tier within its size; host slots in their group and used once (for tests)."""
        for g in range(self.num_groups):
            assert len(self.disk[g]) <= self.disk_blocks
            slots = [s for s, _, _ in self.host[g].values()] + self.free_slots[g]
            assert sorted(slots) == list(range(g, self.host_slots * self.num_groups, self.num_groups)), (g, slots)


def move_group(move: list, num_groups: int) -> int:
    """The group (cp rank) whose ranks carry out `move`."""
    op = move[0]
    if op == "rm":
        return move[2]
    if op in ("d2h", "d2f", "h2f"):
        return move[1] % num_groups
    return move[2] % num_groups  # h2d, f2d: where the device block is
