"""The on-disk format of a prepared dataset: its manifest, the per-shard records, and checking files against them.

Responsible for: the names of everything in an output folder, writing JSON atomically (temp file, fsync,
rename), the manifest that `prepare` writes last and `PreparedDataset` reads first, and
`check_shard(...)`, which compares a shard's files with its record (sizes always; sha256 only when asked).
Not responsible for: producing the shards (prepare.py) or reading tokens (dataset.py).

An output folder holds, per split ("train", and "val" when a validation fraction was asked for) and per
shard k: `{split}-{k:06d}.bin`, the tokens of its documents back to back as a flat little-endian array of
`dtype` (uint16 when the vocabulary has at most 65536 entries, else uint32), and `{split}-{k:06d}.idx`, a
NumPy `.npy` array of int64: the offset of each document's first token in the `.bin`. Shard k of every
split comes from the same stretch of input; a split's shard with no documents has no files.
While `prepare` runs, `progress/settings.json` holds the settings and `progress/{k:06d}.json` the record of
every finished shard (written after its files were renamed into place); `manifest.json` replaces them at
the end. The manifest:

    {"format": "meshlm-prepared-tokens", "version": 1,
     "dtype": "uint16",
     "tokenizer": {"path": ..., "sha256": ..., "vocab_size": ..., "eos_token_id": ... or null},
     "settings": {"field": "text", "val_fraction": 0.0, "shard_bytes": ...},
     "sources": [{"path": absolute path, "bytes": size on disk}, ...],
     "input_bytes": ..., "text_bytes": ...,
     "splits": {"train": {"num_tokens": ..., "num_documents": ..., "shards": [
                    {"index": k, "bin": "train-000000.bin", "idx": "train-000000.idx",
                     "num_tokens": ..., "num_documents": ..., "sha256": ..., "idx_sha256": ...}, ...]},
                "val": {...}}}
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshlm.files import sha256_file, write_atomic

FORMAT = "meshlm-prepared-tokens"
VERSION = 1
MANIFEST = "manifest.json"
PROGRESS_DIR = "progress"
SETTINGS = "settings.json"
SPLITS = ("train", "val")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}"


def record_path(out: Path, index: int) -> Path:
    return out / PROGRESS_DIR / f"{index:06d}.json"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_json_atomic(path: Path, obj) -> None:
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode())


def build(settings: dict, records: list[dict]) -> dict:
    """The manifest from the run's settings and every shard's record (in shard order)."""
    splits = {}
    for split in SPLITS:
        shards = [{"index": r["index"], **r[split]} for r in records if r.get(split)]
        if split == "train" or settings["settings"]["val_fraction"] > 0:
            splits[split] = {"num_tokens": sum(s["num_tokens"] for s in shards),
                             "num_documents": sum(s["num_documents"] for s in shards), "shards": shards}
    return {"format": FORMAT, "version": VERSION, **settings,
            "input_bytes": sum(r["input_bytes"] for r in records),
            "text_bytes": sum(r["text_bytes"] for r in records), "splits": splits}


def num_shards(m: dict) -> int:
    """Shards of the run (shard k of every split comes from the same input; a split may lack some k)."""
    return len({s["index"] for split in m["splits"].values() for s in split["shards"]})


def read(folder: Path) -> dict:
    """The manifest of a prepared dataset, or a ValueError saying what the folder is instead."""
    path = folder / MANIFEST
    if not path.exists():
        if (folder / PROGRESS_DIR).exists():
            raise ValueError(f"{folder}: `meshlm data prepare` did not finish there (no {MANIFEST}); "
                             "rerun the same command to complete it")
        raise ValueError(f"{folder} is not a prepared dataset (no {MANIFEST}); "
                         "make one with `meshlm data prepare SOURCE... --tokenizer T --out DIR`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e}); prepare the dataset again") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path} is format {manifest.get('format')!r} version {manifest.get('version')!r}; this "
                         f"meshlm reads {FORMAT!r} version {VERSION}: prepare the dataset again with it")
    return manifest


def check_shard(folder: Path, shard: dict, *, itemsize: int, checksums: bool) -> None:
    """Raise a ValueError naming the file when a shard's files do not match its record."""
    bin_path, idx_path = folder / shard["bin"], folder / shard["idx"]
    for p in (bin_path, idx_path):
        if not p.exists():
            raise ValueError(f"{p} is missing; copy the whole prepared folder again or prepare it again")
    size, want = bin_path.stat().st_size, shard["num_tokens"] * itemsize
    if size != want:
        raise ValueError(f"{bin_path} has {size} bytes, the manifest says {shard['num_tokens']} tokens = {want} "
                         "bytes: it is truncated or damaged; copy it again or prepare the dataset again")
    try:
        starts = np.load(idx_path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"{idx_path} is unreadable ({e}); copy it again or prepare the dataset again") from None
    if starts.shape != (shard["num_documents"],) or starts.dtype != np.int64:
        raise ValueError(f"{idx_path} holds {starts.dtype} {starts.shape}, the manifest says "
                         f"{shard['num_documents']} int64 document starts; copy it again or prepare again")
    if checksums:
        for p, key in ((bin_path, "sha256"), (idx_path, "idx_sha256")):
            if sha256_file(p) != shard[key]:
                raise ValueError(f"{p} does not match its sha256 in the manifest: it is damaged; "
                                 "copy it again or prepare the dataset again")
