"""Small file helpers shared by the checkpoint and retrieval-index code: checksums of files on disk.

Not responsible for: what a checksum guards (the manifest logic stays with its format)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file, read 1 MiB at a time (checkpoints and indexes can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
