"""Reading DCP's files of a checkpoint without running anything from them (resuming, restarts).

Responsible for: DCP's `.metadata`, which is a pickle, read by an unpickler that admits only the classes
DCP's metadata is made of (its dataclasses, `torch.Size`, dtypes, layouts, paths) and refuses any other
global -- so a `__reduce__` planted in a checkpoint (its manifest rewritten to match) is refused before it
can run, with one line naming the file; the metadata's pieces must lie in files the manifest lists; and the
non-tensor values DCP stores (the optimizer's hyperparameters) read with torch's `weights_only` unpickler
(DCP's own planner reads them with the full one). `SafeReader` and `SafePlanner` hand these to `dcp.load`.
Not responsible for: verifying the files (`find.verify_checkpoint`, first) or what is loaded (`load.py`).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP = "torch.distributed.checkpoint.metadata"
# Every global a genuine `.metadata` names (torch 2.6 .. 2.13): DCP's metadata dataclasses, the storage
# info of its file system writer, and what they hold. Dtypes (`torch.float32`, ...) are admitted by type.
_ALLOWED = {
    (_DCP, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                              "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                              "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name (torch.strided)
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(ValueError):
    """Something in a checkpoint's DCP files that meshlm does not read (it would run code, or is foreign)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(f"it names {module}.{name}, which DCP's metadata never holds")


def read_metadata(path: Path, *, listed: set[str]) -> Metadata:
    """DCP's `.metadata` of checkpoint `path`, unpickled admitting only DCP's metadata classes; its pieces
    must lie in files of `listed` (the manifest's). Raises UnsafeCheckpoint saying what is wrong."""
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 -- any malformed pickle: refused as such
        raise UnsafeCheckpoint(f"it is not DCP's metadata ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    for info in metadata.storage_data.values():
        where = getattr(info, "relative_path", None)
        if not isinstance(where, str) or where not in listed:
            raise UnsafeCheckpoint(f"it places a piece in {where!r}, not a file of the checkpoint's manifest")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file system reader, handed metadata that `read_metadata` above has read."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with its plain values (hyperparameters, stored by torch.save) read `weights_only`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)  # plain data only; anything else is refused
        except Exception as e:  # noqa: BLE001 -- pickle's errors vary
            raise UnsafeCheckpoint(f"{read_item.dest_index.fqn} is not plain data ({str(e).splitlines()[0][:80]})") \
                from None
        clean = io.BytesIO()
        torch.save(obj, clean)  # what DCP's planner reads back: plain data written here, not the checkpoint's bytes
        clean.seek(0)
        super().load_bytes(read_item, clean)
