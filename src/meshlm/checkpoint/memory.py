"""In-memory checkpoints: one rank's state as one blob, for a restart of the same job under the same layout.

Responsible for: `snapshot` -- this rank's pieces of the checkpoint state (`shards.checkpoint_state`: exactly
what it holds, never a full tensor) copied into one safetensors blob, its plain values (the optimizer's
hyperparameters, the RNG states, the loader's position: `extra`) as JSON in the blob's metadata -- and
`restore`, which copies a blob back into the live state (then `shards.after_load`), refusing one that does
not fit it exactly; and the blobs' files (`SnapshotFiles`): per step a folder of `rank_R.st` (a rank's own) and
`copy_R.st` (the copy a peer keeps), each written whole under a temporary name and renamed into place.
Nothing in a blob runs code (safetensors and JSON). Not a storage checkpoint: no resharding (a restart keeps the
layout; a blob names the layout and config it fits), no manifest, no durability beyond the machine.
Not responsible for: when to take one, the peer exchange, or choosing one on a restart (`train/memory.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load as load_blob
from safetensors.torch import save as save_blob
from torch import nn

from meshlm.checkpoint.shards import ShardedState, after_load, checkpoint_state

_META = "meshlm.snapshot"


def _flatten(tree, path: str, tensors: dict, values: dict) -> None:
    """Every tensor of `tree` (a ShardedState: each piece) into `tensors`, every plain value into `values`."""
    if isinstance(tree, ShardedState):
        for i, piece in enumerate(tree.pieces):
            tensors[f"{path}#{i}"] = piece.tensor
    elif torch.is_tensor(tree):
        tensors[path] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _flatten(v, f"{path}/{k}", tensors, values)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _flatten(v, f"{path}[{i}]", tensors, values)
    else:
        values[path] = tree


def _fill(tree, path: str, tensors: dict, values: dict):
    """`tree` with its tensors copied from `tensors` in place and its plain values replaced from `values`."""
    if isinstance(tree, ShardedState):
        for i, piece in enumerate(tree.pieces):
            piece.tensor.copy_(tensors[f"{path}#{i}"])
        return tree
    if torch.is_tensor(tree):
        return tree.copy_(tensors[path])
    if isinstance(tree, dict):
        return {k: _fill(v, f"{path}/{k}", tensors, values) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fill(v, f"{path}[{i}]", tensors, values) for i, v in enumerate(tree))
    value = values[path]
    return tuple(value) if isinstance(tree, tuple) and isinstance(value, list) else value


def snapshot(model: nn.Module, optimizer, mesh, *, meta: dict) -> bytes:
    """This rank's state as one blob (host memory): its pieces, their plain values, and `meta` (JSON data: the
    step, layout, config and the rank's extras)."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict = {}
    _flatten(checkpoint_state(model, optimizer, mesh), "", tensors, values)
    copies = {k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}  # shared storage: copies
    return save_blob(copies, metadata={_META: json.dumps({"meta": meta, "values": values})})


def _header(blob: bytes) -> dict:
    """What the blob's safetensors header carries in its metadata: {"meta", "values"}."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(json.loads(blob[8:8 + size])["__metadata__"][_META])


def restore(blob: bytes, model: nn.Module, optimizer, mesh) -> dict:
    """Copy a blob back into this rank's live state; return its `meta`. ValueError when the blob does not hold
    exactly the pieces and values of this state (another layout or model: nothing is changed then)."""
    tensors = load_blob(blob)
    saved = _header(blob)
    state = checkpoint_state(model, optimizer, mesh)
    want_tensors: dict = {}
    want_values: dict = {}
    _flatten(state, "", want_tensors, want_values)
    if set(want_tensors) != set(tensors) or set(want_values) != set(saved["values"]) or any(
            tensors[k].shape != t.shape or tensors[k].dtype != t.dtype for k, t in want_tensors.items()):
        raise ValueError("the in-memory checkpoint does not hold this rank's pieces (another layout or model)")
    with torch.no_grad():
        state = _fill(state, "", tensors, saved["values"])
    after_load(state, model=model, optimizer=optimizer)
    return saved["meta"]


def memory_root(run_dir: str | Path, base: str | Path) -> Path:
    """This run's folder of blobs under `base` (train.memory_checkpoint_dir): one per run directory, so a
    restart finds what its job wrote and another run's never."""
    import hashlib

    return Path(base) / f"meshlm-{hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]}"


class SnapshotFiles:
    """The blobs in `root` (a folder of this job on a tmpfs): `step_N/rank_R.st` and `step_N/copy_R.st`."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, step: int, rank: int, *, copy: bool) -> Path:
        return self.root / f"step_{step:06d}" / f"{'copy' if copy else 'rank'}_{rank:05d}.st"

    def write(self, step: int, rank: int, blob: bytes, *, copy: bool) -> None:
        path = self.path(step, rank, copy=copy)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)  # whole or absent: a rank killed mid-write leaves only a .tmp

    def meta(self, step: int, rank: int) -> dict | None:
        """The `meta` of a blob here (own or copy), read from its header only; None when there is none."""
        for copy in (False, True):
            path = self.path(step, rank, copy=copy)
            if path.is_file():
                with open(path, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    return _header(size.to_bytes(8, "little") + f.read(size))["meta"]
        return None

    def held(self) -> list[tuple[int, int]]:
        """(step, rank) of every blob readable here, own or copy."""
        found = set()
        for f in self.root.glob("step_*/*.st") if self.root.is_dir() else []:
            m = re.fullmatch(r"(?:rank|copy)_(\d+)\.st", f.name)
            if m and re.fullmatch(r"step_\d+", f.parent.name):
                found.add((int(f.parent.name[len("step_"):]), int(m.group(1))))
        return sorted(found)

    def read(self, step: int, rank: int) -> bytes | None:
        for copy in (False, True):
            path = self.path(step, rank, copy=copy)
            if path.is_file():
                return path.read_bytes()
        return None

    def prune(self, keep_from: int, rank: int, source: int) -> None:
        """Remove this rank's blob and the copy it keeps of `source`'s, of the steps before `keep_from`, and
        folders left empty."""
        for folder in self.root.glob("step_*") if self.root.is_dir() else []:
            if re.fullmatch(r"step_\d+", folder.name) and int(folder.name[len("step_"):]) < keep_from:
                for f in [*folder.glob(f"rank_{rank:05d}.st*"), *folder.glob(f"copy_{source:05d}.st*")]:
                    f.unlink(missing_ok=True)
                try:
                    folder.rmdir()
                except OSError:  # another rank's blobs are still there
                    pass

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
