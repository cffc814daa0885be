"""Small file helpers shared by the checkpoint, prepared-data and retrieval-index code: checksums of files on
disk, writes that are atomic and durable (a reader sees the old file or the whole new one, never a part),
whether a file's bytes are text at all (`looks_binary`), and whether a picture can be written where asked
(`check_picture_path`, before the work that draws it).

Not responsible for: what a checksum guards (the manifest logic stays with its format)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


BINARY_SNIFF_BYTES = 8192  # how much of a file `looks_binary` reads


def looks_binary(head: bytes) -> bool:
    """Whether a file whose first bytes are `head` is not text: a NUL byte in its first 8 KiB (git's test: an image,
    an archive, a compiled file)."""
    return b"\0" in head[:BINARY_SNIFF_BYTES]


def check_picture_path(path: str | Path, flag: str, *, example: str = "plot.png") -> Path:
    """`path` as a picture to write, refused (ValueError naming `flag`) before any work where it cannot be: a folder,
    no suffix, a suffix matplotlib draws no format for, or a folder that does not exist."""
    out = Path(path)
    if out.is_dir() or not out.suffix:
        raise ValueError(f"{flag} {str(out)!r} is a folder or has no suffix; name the picture, e.g. "
                         f"{str(out / example) if out.is_dir() else str(out) + '.png'}")
    if not out.parent.is_dir():
        raise ValueError(f"{flag} {str(out)!r}: the folder {str(out.parent)!r} does not exist; create it first")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # the drawing code says what to install
        return out
    if out.suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        raise ValueError(f"{flag} {str(out)!r}: matplotlib draws no {out.suffix} files; use a .png file")
    return out


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file, read 1 MiB at a time (checkpoints and indexes can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data`: written to a temporary file, fsynced, renamed over it, the folder fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the renames inside `path` durable (a no-op where folders cannot be opened or synced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
