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
A folder of conversations (`meshlm.data.chat`; version 2) also holds per shard `{split}-{k:06d}.mask`, one byte
per token: 1 where predicting that token counts in the loss (the assistant's turns), and its manifest says how
they were rendered: "conversations": {"chat": the template and special tokens (`meshlm.tokenizer.chat_config`;
null: the fallback template), "assistant_only_loss": whether the masks were written (false: every token counts),
"pad_token_id": what fills a sample no conversation fits}; its shards and splits count "num_loss_tokens".
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
CONVERSATIONS_VERSION = 2  # texts are version 1: a meshlm of before reads them, and refuses conversations by name
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
    conversations = settings.get("conversations") is not None
    for split in SPLITS:
        shards = [{"index": r["index"], **r[split]} for r in records if r.get(split)]
        if split == "train" or settings["settings"]["val_fraction"] > 0:
            splits[split] = {"num_tokens": sum(s["num_tokens"] for s in shards),
                             "num_documents": sum(s["num_documents"] for s in shards), "shards": shards}
            if conversations:
                splits[split]["num_loss_tokens"] = sum(s["num_loss_tokens"] for s in shards)
    return {"format": FORMAT, "version": CONVERSATIONS_VERSION if conversations else VERSION, **settings,
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
    if manifest.get("format") != FORMAT or manifest.get("version") not in (VERSION, CONVERSATIONS_VERSION):
        raise ValueError(f"{path} is format {manifest.get('format')!r} version {manifest.get('version')!r}; this "
                         f"meshlm reads {FORMAT!r} versions {VERSION} and {CONVERSATIONS_VERSION}: prepare the "
                         "dataset again with it")
    return manifest


def check_shard(folder: Path, shard: dict, *, itemsize: int, checksums: bool) -> None:
    """Raise a ValueError naming the file when a shard's files do not match its record."""
    bin_path, idx_path = folder / shard["bin"], folder / shard["idx"]
    mask_path = folder / shard["mask"] if "mask" in shard else None
    for p in (bin_path, idx_path, *([mask_path] if mask_path else [])):
        if not p.exists():
            raise ValueError(f"{p} is missing; copy the whole prepared folder again or prepare it again")
    size, want = bin_path.stat().st_size, shard["num_tokens"] * itemsize
    if size != want:
        raise ValueError(f"{bin_path} has {size} bytes, the manifest says {shard['num_tokens']} tokens = {want} "
                         "bytes: it is truncated or damaged; copy it again or prepare the dataset again")
    if mask_path is not None and mask_path.stat().st_size != shard["num_tokens"]:
        raise ValueError(f"{mask_path} has {mask_path.stat().st_size} bytes, the manifest says one per token, "
                         f"{shard['num_tokens']}: it is truncated or damaged; copy it again or prepare the dataset "
                         "again")
    try:
        starts = np.load(idx_path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(f"{idx_path} is unreadable ({e}); copy it again or prepare the dataset again") from None
    if starts.shape != (shard["num_documents"],) or starts.dtype != np.int64:
        raise ValueError(f"{idx_path} holds {starts.dtype} {starts.shape}, the manifest says "
                         f"{shard['num_documents']} int64 document starts; copy it again or prepare again")
    if checksums:
        for p, key in ((bin_path, "sha256"), (idx_path, "idx_sha256"), *([(mask_path, "mask_sha256")] if mask_path
                                                                          else [])):
            if sha256_file(p) != shard[key]:
                raise ValueError(f"{p} does not match its sha256 in the manifest: it is damaged; "
                                 "copy it again or prepare the dataset again")
