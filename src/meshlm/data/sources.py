"""The sources `meshlm data prepare` reads: which files, texts or conversations, checked before any work starts, cut
into units.

Responsible for: turning the SOURCE arguments into an ordered list of files (a folder is walked recursively
in sorted order of relative paths, leaving out -- and counting, `Listing.note` -- what is not data: hidden
files and folders (a name starting with "."), the markers data jobs write beside their output (`JOB_MARKERS`),
and empty files; every other file is read, a code corpus's `_utils.py` too); checking what can be checked
without reading the data (the file exists and is not empty, the format is known, a parquet file has the text
column, the optional packages are there); which kind a file holds (`holds_conversations`: a `.jsonl`'s first line,
a parquet file's columns, `conversation_columns`; `is_chat_jsonl` for training's data.path);
cutting every file into `Unit`s in file order -- a text file is one unit (one document), a `.jsonl`,
`.jsonl.gz` or `.jsonl.zst` gives units of whole lines of about `block_bytes` (decompressed here, in the
reading process), a `.parquet` one unit per row group; and `documents(unit, field)`, the texts of one unit,
which the tokenizing worker processes call (`conversations(unit)` for a file of conversations).
Not responsible for: how units become shards, tokenizing or writing (prepare.py).

Documents: a text file (any other suffix) is one document, decoded as UTF-8 with invalid bytes replaced;
each non-blank `.jsonl` line is one document, the string under `field`; each non-null value of a parquet
file's `field` column is one document (read one row group and 1024 rows at a time, never the whole file). In a
file of conversations each line or row is one conversation (`meshlm.data.chat` reads it).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from meshlm.data.chat import is_conversation_row
from meshlm.data.manifest import MANIFEST
from meshlm.messages import checked_text
from meshlm.files import BINARY_SNIFF_BYTES, looks_binary

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_BATCH_ROWS = 1024
_COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd", ".bz2", ".xz")
# What Spark, Hadoop, Databricks and parquet writers leave beside a job's part files: file names matched exactly
# or by prefix ("_committed_<id>", "_started_<id>") or suffix (".crc" checksums), and folders whose files are
# none of the output's (a failed job's attempt copies under "_temporary", Delta Lake's JSON commit log).
JOB_MARKERS = {"names": ("_SUCCESS", "_metadata", "_common_metadata"), "prefixes": ("_committed_", "_started_"),
               "suffixes": (".crc",), "folders": ("_temporary", "_delta_log")}
NOTE_NAMES = 3  # names quoted per reason in `Listing.note`


@dataclass(frozen=True)
class Unit:
    """A piece of one file, the smallest thing a shard is made of.

    `input_bytes`: its size as read (decompressed lines, a parquet column chunk uncompressed, a text file);
    `disk_bytes`: its share of the file on disk (for progress); `first_line`/`data`: a `.jsonl` unit's
    first line number and its whole lines; `row_groups`: a parquet unit's row group.
    """

    kind: str  # "text" | "jsonl" | "parquet"
    path: str
    input_bytes: int
    disk_bytes: int
    first_line: int = 0
    data: bytes = b""
    row_groups: tuple[int, ...] = ()


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(_COMPRESSED_SUFFIXES):
        raise ValueError(f"{path}: compressed inputs must be {', '.join(JSONL_SUFFIXES[1:])}; "
                         "decompress it, or recompress it as JSON lines with a 'text' field")
    return "text"


@dataclass(frozen=True)
class Listing:
    """The files to read, in order, and the files of source folders left out: reason -> paths (as found, in
    order) for the reasons "hidden", "job markers", "empty" and "binary"; `found` counts the folders' files."""

    files: list[Path]
    left_out: dict[str, list[Path]]
    found: int

    def note(self) -> str:
        """One line saying how many files were left out and why, with a few names; "" when none were."""
        total = sum(len(paths) for paths in self.left_out.values())
        if not total:
            return ""
        parts = []
        for reason, paths in self.left_out.items():
            names = ", ".join(p.as_posix() for p in paths[:NOTE_NAMES]) + (", ..." if len(paths) > NOTE_NAMES else "")
            label = reason[:-1] if len(paths) == 1 and reason.endswith("s") else reason  # "1 job marker"
            parts.append(f"{len(paths)} {label} ({names})")
        return f"left out {total} of the {self.found} files in the source folders: {'; '.join(parts)}"


def list_files(sources: list[str | Path], *, out: Path | None = None) -> Listing:
    """Every input file, in the order of `sources` (folders: recursively, sorted by relative path, leaving out
    hidden files, job markers and empty files -- an empty file named as a source is refused)."""
    if not sources:
        raise ValueError("no SOURCE given; pass text files, folders, .jsonl(.gz/.zst) or .parquet files")
    out = out.resolve() if out is not None else None
    files: list[Path] = []
    left_out: dict[str, list[Path]] = {"hidden": [], "job markers": [], "empty": [], "binary": []}
    found = 0
    for source in sources:
        path = Path(source)
        if not path.exists():
            raise ValueError(f"source {str(source)!r} does not exist; pass a text file, a folder, "
                             "a .jsonl(.gz/.zst) or a .parquet file")
        if path.is_dir():
            if (path / MANIFEST).is_file() and any(path.glob("*.bin")):
                raise ValueError(f"source folder {path} is a prepared dataset (manifest.json and token shards), not "
                                 f"text; train on it with --set data.path={path}")
            if out is not None and (out == path.resolve() or path.resolve() in out.parents):
                raise ValueError(f"--out {out} lies inside source folder {path}; a rerun would read its own "
                                 "shards: pass an --out outside the sources")
            listed = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
            reasons = [_left_out_reason(p.relative_to(path)) or ("empty" if p.stat().st_size == 0 else None)
                       or ("binary" if _is_binary(p) else None) for p in listed]
            kept = [p for p, reason in zip(listed, reasons) if reason is None]
            if not kept:
                empty = reasons.count("empty")
                holds = ("no files" if not listed else f"only empty files ({empty})" if empty == len(listed)
                         else f"no data files (only {len(listed)} hidden, job-marker, empty or binary ones)")
                raise ValueError(f"source folder {path} holds {holds}; "
                                 "pass a folder with text, .jsonl(.gz/.zst) or .parquet files")
            for p, reason in zip(listed, reasons):
                if reason is not None:
                    left_out[reason].append(p)
            found += len(listed)
            files += kept
        elif not path.is_file():  # a pipe, socket or device: prepare reads a source more than once (units, resume)
            raise ValueError(f"source {path} is not a regular file (a pipe or a device); write it to a file first")
        elif path.stat().st_size == 0:
            raise ValueError(f"source file {path} is empty; remove it or leave it out of the sources")
        elif _is_binary(path):
            raise ValueError(f"source file {path} is binary (a NUL byte in its first 8 KiB), not text; leave it out "
                             "of the sources")
        else:
            files.append(path)
    seen: dict[Path, Path] = {}
    for f in files:
        first = seen.setdefault(f.resolve(), f)
        if first is not f:
            raise ValueError(f"source file {f} is given twice ({first} is the same file); each file is read once: "
                             "drop one of the sources")
    return Listing(files, {reason: paths for reason, paths in left_out.items() if paths}, found)


def _is_binary(path: Path) -> bool:
    """Whether a file read as plain text is not text (`files.looks_binary`). JSON lines, parquet and compressed
    files are judged by their readers."""
    if path.name.lower().endswith((".parquet", *JSONL_SUFFIXES, *_COMPRESSED_SUFFIXES)):
        return False
    with open(path, "rb") as f:
        return looks_binary(f.read(BINARY_SNIFF_BYTES))


def _left_out_reason(relative: Path) -> str | None:
    """"hidden", "job markers" or None (data) for a file at `relative` inside a source folder."""
    if any(part.startswith(".") for part in relative.parts):
        return "hidden"
    name = relative.name
    in_job_folder = any(part in JOB_MARKERS["folders"] for part in relative.parts[:-1])
    if (in_job_folder or name in JOB_MARKERS["names"] or name.startswith(JOB_MARKERS["prefixes"])
            or name.endswith(JOB_MARKERS["suffixes"])):
        return "job markers"
    return None


CONVERSATION_COLUMNS = ("messages", "tools", "prompt", "completion")  # what a parquet file of conversations holds


DEFAULT_FIELD = "text"  # --field's default: a file whose rows have conversations is read as conversations unless
# --field names another key (then its texts are read: an explicit field wins)


def conversation_columns(names, field: str = DEFAULT_FIELD) -> list[str] | None:
    """The columns of a parquet file of conversations (a "messages" column, or "prompt" and "completion"; "tools"
    too where it has one, as Hugging Face chat datasets store them), or None for a file of texts (also when `field`
    names another column than the default's: the texts asked for)."""
    if field != DEFAULT_FIELD or ("messages" not in names and not {"prompt", "completion"} <= set(names)):
        return None
    return [c for c in CONVERSATION_COLUMNS if c in names]


def check_files(files: list[Path], field: str) -> None:
    """What can be checked without reading the data, for every file (so a bad input fails before any work)."""
    kinds = {kind_of(f) for f in files}
    needs = {"parquet": "pyarrow"} if "parquet" in kinds else {}
    if any(f.name.lower().endswith(".zst") for f in files):
        needs["zst"] = "zstandard"
    for what, module in needs.items():
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"reading .{what} files needs the `{module}` package; pip install {module} "
                             "(the data extra: pip install -e \".[data]\")")
    for f in files:
        if kind_of(f) == "parquet":
            _check_parquet(f, field)


def _check_parquet(path: Path, field: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ValueError(f"{path} is not a readable parquet file ({e}); replace or remove it") from None
    schema = pf.schema_arrow
    if pf.metadata.num_rows == 0:
        raise ValueError(f"source file {path} has no rows; remove it or leave it out of the sources")
    if conversation_columns(schema.names, field) is not None:
        return
    if schema.get_field_index(field) < 0:
        raise ValueError(f"{path} has no column {field!r} (columns: {', '.join(schema.names)}); "
                         "pass --field NAME for the column that holds the text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: column {field!r} holds {kind}, not strings; "
                         "pass --field NAME for the column that holds the text")


# --------------------------------------------------------------------------------------------
# Units, in file order (the reading process)
# --------------------------------------------------------------------------------------------


def iter_units(files: list[Path], *, field: str, block_bytes: int) -> Iterator[Unit]:
    for f in files:
        kind = kind_of(f)
        if kind == "text":
            size = f.stat().st_size
            yield Unit("text", str(f), input_bytes=size, disk_bytes=size)
        elif kind == "jsonl":
            yield from _jsonl_units(f, block_bytes)
        else:
            yield from _parquet_units(f, field)


def _open_decompressed(path: Path, raw: BinaryIO) -> BinaryIO:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        return _ZstdFrames(raw)
    return raw


class _ZstdFrames:
    """A .zst file's frames, one after another, decompressed (`read(n)`); a file that ends inside a frame raises
    EOFError, as gzip's reader does. zstandard's own stream reader returns what it has there and stops, as if the file
    were whole: a truncated download would then read as a last line cut short."""

    def __init__(self, raw: BinaryIO):
        import zstandard

        self._new = zstandard.ZstdDecompressor().decompressobj
        self._raw, self._frame = raw, None
        self._rest = b""  # compressed bytes of the next frame, read with the end of the one before
        self._buf, self._pos = b"", 0  # the last decompressed piece, and how much of it was read

    def read(self, n: int) -> bytes:
        pieces = []
        while n > 0:
            if self._pos == len(self._buf):
                self._buf, self._pos = self._next_piece(), 0
                if not self._buf:
                    break
            take = self._buf[self._pos:self._pos + n]
            self._pos += len(take)
            n -= len(take)
            pieces.append(take)
        return b"".join(pieces)

    def _next_piece(self) -> bytes:
        """The next decompressed bytes (b"" at the file's end)."""
        while True:
            chunk, self._rest = (self._rest or self._raw.read(1 << 16)), b""  # small: a call's output is the
            if not chunk:  # frame's ratio times it
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                return b""
            if self._frame is None or self._frame.eof:
                self._frame = self._new()
            piece = self._frame.decompress(chunk)
            if self._frame.eof:
                self._rest = self._frame.unused_data
            if piece:
                return piece


def _jsonl_units(path: Path, block_bytes: int) -> Iterator[Unit]:
    """Blocks of whole lines; a unit ends at the last newline of ~block_bytes read (a longer line stays whole)."""
    size = path.stat().st_size
    line, disk_done, carry, any_text = 1, 0, b"", False
    with open(path, "rb") as raw:
        stream = _open_decompressed(path, raw)
        while True:
            try:
                block = stream.read(block_bytes)
            except Exception as e:  # noqa: BLE001 -- damaged input: gzip's OSError / EOFError, zstandard.ZstdError
                raise ValueError(f"{path}: cannot decompress ({e}); replace or remove the file") from None
            data = carry + block
            if block:
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    carry = data
                    continue
                data, carry = data[:cut], data[cut:]
            if data:
                any_text = any_text or bool(data.strip())
                disk = (raw.tell() if block else size) - disk_done
                yield Unit("jsonl", str(path), input_bytes=len(data), disk_bytes=disk, first_line=line, data=data)
                line += data.count(b"\n")
                disk_done += disk
            if not block:
                break
    if not any_text:
        raise ValueError(f"source file {path} holds no JSON lines; remove it or leave it out of the sources")


def _parquet_units(path: Path, field: str) -> Iterator[Unit]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    meta = pf.metadata
    read = conversation_columns(pf.schema_arrow.names, field) or [field]
    size, disk_done, row = path.stat().st_size, 0, 1
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        columns = [group.column(c) for c in range(group.num_columns)]
        text = [c for c in columns if any(c.path_in_schema == r or c.path_in_schema.startswith(f"{r}.") for r in read)]
        disk = sum(c.total_compressed_size for c in columns)
        if i == meta.num_row_groups - 1:
            disk = size - disk_done  # the footer and headers go with the last group
        disk_done += disk
        yield Unit("parquet", str(path), input_bytes=sum(c.total_uncompressed_size for c in text),
                   disk_bytes=disk, first_line=row, row_groups=(i,))
        row += group.num_rows


# --------------------------------------------------------------------------------------------
# Documents of a unit (the worker processes)
# --------------------------------------------------------------------------------------------


def documents(unit: Unit, field: str) -> Iterator[str]:
    if unit.kind == "text":
        yield Path(unit.path).read_bytes().decode("utf-8", errors="replace")
    elif unit.kind == "jsonl":
        yield from _jsonl_documents(unit, field)
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=list(unit.row_groups),
                                     columns=[field]):
            yield from (text for text in batch.column(0).to_pylist() if text is not None)


def jsonl_lines(unit: Unit) -> Iterator[tuple[bytes, str]]:
    """The non-blank lines of a `.jsonl` unit, each with its file:line."""
    for offset, line in enumerate(unit.data.split(b"\n")):
        if line.strip():
            yield line, f"{unit.path}:{unit.first_line + offset}"


def conversations(unit: Unit) -> Iterator[tuple[bytes | dict, str]]:
    """The conversations of a unit of a conversation file, each with where it is (file:line, or file:row N): a
    `.jsonl` line as read, or a parquet row's conversation columns as a dict."""
    if unit.kind == "jsonl":
        yield from jsonl_lines(unit)
        return
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(unit.path)
    row = unit.first_line
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=list(unit.row_groups),
                                 columns=conversation_columns(pf.schema_arrow.names)):
        for item in batch.to_pylist():
            yield item, f"{unit.path}:row {row}"
            row += 1


def holds_conversations(path: Path, field: str = DEFAULT_FIELD) -> bool:
    """Whether a source holds conversations (`meshlm.data.chat`): a `.jsonl(.gz/.zst)` whose first non-blank line
    is one (`chat.is_conversation_row`; a line that is not JSON is refused, naming it), or a parquet file with their
    columns (`conversation_columns`). Texts otherwise."""
    if kind_of(path) == "parquet":
        import pyarrow.parquet as pq

        try:
            return conversation_columns(pq.ParquetFile(path).schema_arrow.names, field) is not None
        except Exception:  # noqa: BLE001 -- damaged: check_files names it
            return False
    first = _first_line(path) if kind_of(path) == "jsonl" and field == DEFAULT_FIELD else None
    if first is None:
        return False
    try:
        return is_conversation_row(json.loads(first[1]))
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        raise ValueError(f"{path}:{first[0]} is not valid JSON ({e}); fix or delete that line") from None


def is_chat_jsonl(path: str | Path) -> bool:
    """Whether `path` (data.path) is a `.jsonl` of conversations, which training reads in memory."""
    path = Path(path)
    return path.suffix == ".jsonl" and path.is_file() and holds_conversations(path)


def _first_line(path: Path) -> tuple[int, bytes] | None:
    """(line number, bytes) of a `.jsonl(.gz/.zst)`'s first non-blank line, decompressed; None when it has none, or
    when it cannot be decompressed (the units' reader names that)."""
    with open(path, "rb") as raw:
        stream, carry, lineno = _open_decompressed(path, raw), b"", 1
        while True:
            try:
                block = stream.read(1 << 16)
            except Exception:  # noqa: BLE001 -- gzip's OSError / EOFError, zstandard.ZstdError
                return None
            lines = (carry + block).split(b"\n")
            for line in lines[:-1]:
                if line.strip():
                    return lineno, line
                lineno += 1
            carry = lines[-1]
            if not block:
                return (lineno, carry) if carry.strip() else None


def _jsonl_documents(unit: Unit, field: str) -> Iterator[str]:
    for line, where in jsonl_lines(unit):
        try:
            row = json.loads(line)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
            raise ValueError(f"{where} is not valid JSON ({e}); fix or delete that line") from None
        if is_conversation_row(row) and field not in row:
            raise ValueError(f"{where} is a conversation with no field {field!r}, in a file read as texts (its first "
                             "line, or --field, says so); put conversations in files of their own and prepare them, "
                             "--field left out, into a folder of their own")
        if not isinstance(row, dict) or field not in row:
            raise ValueError(f"{where} has no field {field!r}; pass --field NAME for the key that holds the text")
        if not isinstance(row[field], str):
            raise ValueError(f"{where}: field {field!r} is {type(row[field]).__name__}, not a string; "
                             "pass --field NAME for the key that holds the text")
        try:
            text = checked_text(row[field], f"field {field!r}")
        except ValueError as e:
            raise ValueError(f"{where}: {e}; fix or delete that line") from None
        yield text
