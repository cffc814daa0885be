"""`prepare`: tokenize text sources once, in parallel worker processes, into token shards with a manifest.

Responsible for: checking the arguments and the tokenizer before any work starts; cutting the inputs into
shards deterministically (units of the inputs, in source order, are gathered until they hold `shard_bytes`
of input: shard k is always the same stretch of input for the same settings); tokenizing each shard in a
worker process (`--workers N` processes, each loading the tokenizer once and calling `encode_batch` with
`add_special_tokens=False`; the EOS id follows every document when the tokenizer has one of "</s>",
"<|endoftext|>", "<|end_of_text|>", "<eos>", `meshlm.tokenizer.eos_by_name`, as training packs); the split of
documents between "train" and "val" (a document goes to validation when the first 8 bytes of its UTF-8
sha256, little-endian, over 2^64 fall below `val_fraction`: the per-document rule of
`meshlm.data.text.split_documents`, without its few-document fallbacks); writing each shard (temp file,
fsync, rename) and then its record; resuming; the manifest, written last; the progress bar.

Conversations: sources that are `.jsonl(.gz/.zst)` files of conversations (each file's first line says) or
parquet files with their columns ("messages", or "prompt" and "completion"; "tools": `sources.holds_conversations`;
texts and conversations are not mixed in one folder) are rendered by the chat
template they will be trained and served with and tokenized as training in memory does (`meshlm.data.chat`:
`conversation_tokens`, the tokenizer of `meshlm.tokenizer.conversation_tokenizer`), each conversation one
document ending in the separator, with one mask byte per token (1: predicting it counts, the assistant's turns;
`assistant_only=False`: no masks, every token counts -- for a template that rewrites earlier turns). A conversation
goes to validation by the hash of its line as read, as `meshlm.data.text.split_conversations` splits. How they are
packed into samples (whole, or split across samples) is training's choice, made when the folder is read
(`dataset.PreparedDataset`).
Not responsible for: reading the input formats (sources.py), the file format (manifest.py), training-time
reading (dataset.py).

Workers: each worker's tokenizer runs single-threaded (TOKENIZERS_PARALLELISM=false in that process), so
`--workers N` keeps N cores busy whatever the tokenizer library would otherwise start; the reading process
(this one) decompresses and cuts the inputs meanwhile. At most 2N shards are in flight, so memory is about
2N x shard_bytes plus the tokenizer's, whatever the corpus size.

Resuming: a rerun with the same settings (sources and their sizes, tokenizer sha256, field, val_fraction,
shard_bytes) skips every shard whose record exists and whose files have the recorded sizes. It still reads
(and decompresses) the inputs to find the shard boundaries, but tokenizes only the unfinished shards. A
temp file left by a killed run is overwritten; a completed folder is left alone.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from meshlm.data import manifest, sources
from meshlm.files import fsync_dir, sha256_file, write_atomic
from meshlm.tokenizer import eos_by_name

DEFAULT_SHARD_BYTES = 128 << 20
ENCODE_BATCH_BYTES = 1 << 20  # text per encode_batch call: bounds the memory of the Encoding objects
ENCODE_BATCH_DOCS = 1024
JSONL_BLOCK_BYTES = 4 << 20


def _to_stderr(line: str) -> None:
    print(f"meshlm data prepare: {line}", file=sys.stderr, flush=True)


def prepare(source_paths: list[str | Path], *, tokenizer_path: str | Path, out: str | Path, workers: int = 1,
            field: str = "text", val_fraction: float = 0.0, shard_bytes: int = DEFAULT_SHARD_BYTES,
            progress: bool = True, log: Callable[[str], None] | None = _to_stderr,
            assistant_only: bool = True) -> dict:
    """Tokenize `source_paths` into `out` (see the module docstring); returns a summary of the run.

    The summary: out, num_shards, shards_written and shards_skipped (this run), num_documents and num_tokens per
    split (conversations: num_loss_tokens too, what the loss counts), input_bytes, text_bytes, seconds,
    text_mb_per_s and tokens_per_s of the shards written, and left_out: how many files of the source folders were
    not read, by reason (hidden, job markers, empty, binary), which `log` hears of in one line before any work
    (default: on stderr; None: not at all).
    """
    _check_knobs(workers=workers, field=field, val_fraction=val_fraction, shard_bytes=shard_bytes)
    out = Path(out)
    tokenizer = tokenizer_info(tokenizer_path)
    listing = sources.list_files(list(source_paths), out=out)
    files = listing.files
    if listing.left_out and log is not None:
        log(listing.note())
    left_out = {reason: len(paths) for reason, paths in listing.left_out.items()}
    sources.check_files(files, field)
    conversations = _conversations(files, tokenizer_path, field=field, assistant_only=assistant_only)
    if conversations is not None:
        conversations, tokenizer["eos_token_id"] = conversations
    settings = {"dtype": manifest.dtype_for(tokenizer["vocab_size"]), "tokenizer": tokenizer,
                "settings": {"field": field, "val_fraction": float(val_fraction), "shard_bytes": int(shard_bytes)},
                "sources": [{"path": str(f.resolve()), "bytes": f.stat().st_size} for f in files],
                **({"conversations": conversations} if conversations is not None else {})}
    start, created = time.perf_counter(), not out.exists()
    done = _start_or_resume(out, settings)
    if done is None:  # already complete with these settings
        m = manifest.read(out)
        return _summary(out, m, written=[], skipped=manifest.num_shards(m), seconds=time.perf_counter() - start,
                        left_out=left_out)
    units = sources.iter_units(files, field=field, block_bytes=min(shard_bytes, JSONL_BLOCK_BYTES))
    task = _Task(index=-1, units=[], out=str(out), tokenizer_path=tokenizer["path"], dtype=settings["dtype"],
                 eos_token_id=tokenizer["eos_token_id"], field=field, val_fraction=float(val_fraction),
                 conversations=None if conversations is None else (str(tokenizer_path), assistant_only))
    total_disk = sum(s["bytes"] for s in settings["sources"])
    try:
        records, written = _run(_jobs(units, shard_bytes), task, done, workers=workers, total_disk=total_disk,
                                progress=progress)
    except ValueError:  # a bad input (named): a run that finished no shard leaves nothing behind, so the same
        if not list((out / manifest.PROGRESS_DIR).glob("[0-9]*.json")):  # command runs afresh once it is fixed
            shutil.rmtree(out / manifest.PROGRESS_DIR)
            for tmp in out.glob("*.tmp"):
                tmp.unlink()
            if created and not any(out.iterdir()):
                out.rmdir()
        raise
    manifest.write_json_atomic(out / manifest.MANIFEST, manifest.build(settings, records))
    shutil.rmtree(out / manifest.PROGRESS_DIR)
    for tmp in out.glob("*.tmp"):  # left by a killed run, for a shard finished since
        tmp.unlink()
    return _summary(out, manifest.read(out), written=written, skipped=len(records) - len(written),
                    seconds=time.perf_counter() - start, left_out=left_out)


def _check_knobs(*, workers: int, field: str, val_fraction: float, shard_bytes: int) -> None:
    if workers < 1:
        raise ValueError(f"--workers={workers} must be >= 1 (the number of tokenizing processes)")
    if not field:
        raise ValueError("--field must name the JSON key or parquet column that holds the text, e.g. text")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction={val_fraction} must be in [0, 1), e.g. 0.01")
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes={shard_bytes} must be >= 1 (input bytes per shard)")


def _conversations(files: list[Path], tokenizer_path: str | Path, *, field: str,
                   assistant_only: bool) -> tuple[dict, int | None] | None:
    """(the manifest's "conversations" entry, the id of the separator after each) when every source holds
    conversations, None when none does (or --field names a key: its texts are read); refused when texts and
    conversations are mixed, and --all-tokens for texts."""
    chats = [sources.holds_conversations(f, field) for f in files]
    if not any(chats):
        if not assistant_only:
            raise ValueError("--all-tokens is for conversations (no loss masks); every token of a text counts: "
                             "leave it out")
        return None
    if not all(chats):
        text, chat = files[chats.index(False)], files[chats.index(True)]
        raise ValueError(f"{chat} holds conversations and {text} texts; prepare each kind into a folder of its own "
                         "and train on a blend of them (data.sources)")
    from meshlm.data.chat import pad_token
    from meshlm.tokenizer import chat_config, conversation_tokenizer

    tokenizer = conversation_tokenizer(tokenizer_path)
    return ({"chat": chat_config(tokenizer), "assistant_only_loss": bool(assistant_only),
             "pad_token_id": pad_token(tokenizer)}, tokenizer.eos_token_id)


def tokenizer_info(path: str | Path) -> dict:
    """Path, sha256, vocabulary size and EOS id of a tokenizer.json (or a folder holding one), checked."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer {p} does not exist; pass the model's tokenizer.json (or its folder)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("`meshlm data prepare` needs the `tokenizers` package; pip install tokenizers "
                         "(the data extra: pip install -e \".[data]\")") from None
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # the library raises a bare Exception for unreadable files
        raise ValueError(f"--tokenizer {p} is not a readable tokenizer.json ({e}); pass the model's "
                         "tokenizer.json") from None
    return {"path": str(p.resolve()), "sha256": sha256_file(p),
            "vocab_size": tok.get_vocab_size(with_added_tokens=True), "eos_token_id": eos_by_name(tok)}


# --------------------------------------------------------------------------------------------
# Output folder: start, or resume
# --------------------------------------------------------------------------------------------


def _comparable(settings: dict) -> dict:
    """What must match for a rerun to continue (the tokenizer's file may have moved; its content may not)."""
    return {**settings, "tokenizer": {k: v for k, v in settings["tokenizer"].items() if k != "path"}}


def _differences(old: dict, new: dict) -> str:
    a, b = _comparable(old), _comparable(new)
    keys = [k for k in b if k != "settings" and a.get(k) != b[k]]
    keys += [k for k in b["settings"] if a.get("settings", {}).get(k) != b["settings"][k]]
    return ", ".join(keys) or "the format"


def _start_or_resume(out: Path, settings: dict) -> dict[int, dict] | None:
    """The records of the shards finished by an earlier run (None when all is done); creates the folder."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a new or empty folder")
    if (out / manifest.MANIFEST).exists():
        old = manifest.read(out)
        if _comparable({k: old.get(k) for k in settings}) == _comparable(settings):
            return None
        raise ValueError(f"--out {out} already holds a dataset prepared with other settings (differing: "
                         f"{_differences(old, settings)}); pass another --out or delete that folder")
    settings_path = out / manifest.PROGRESS_DIR / manifest.SETTINGS
    if settings_path.exists():
        old = json.loads(settings_path.read_text())
        if _comparable(old) != _comparable(settings):
            raise ValueError(f"--out {out} holds an unfinished preparation with other settings (differing: "
                             f"{_differences(old, settings)}); rerun it with its own settings, or delete "
                             "that folder to start afresh")
        return _finished_shards(out, settings)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not a prepared dataset; pass a new or empty folder")
    (out / manifest.PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
    manifest.write_json_atomic(settings_path, settings)
    return {}


def _finished_shards(out: Path, settings: dict) -> dict[int, dict]:
    itemsize = np.dtype(settings["dtype"]).itemsize
    done = {}
    for path in sorted((out / manifest.PROGRESS_DIR).glob("[0-9]*.json")):
        record = json.loads(path.read_text())
        try:
            for split in manifest.SPLITS:
                if record.get(split):
                    manifest.check_shard(out, record[split], itemsize=itemsize, checksums=False)
        except ValueError:
            continue  # damaged since it was recorded: write it again
        done[record["index"]] = record
    return done


# --------------------------------------------------------------------------------------------
# Shards: cut in the reading process, written by the workers
# --------------------------------------------------------------------------------------------


@dataclass
class _Task:
    """What a worker needs for one shard (pickled to it)."""

    index: int
    units: list[sources.Unit]
    out: str
    tokenizer_path: str
    dtype: str
    eos_token_id: int | None
    field: str
    val_fraction: float
    conversations: tuple[str, bool] | None = None  # (--tokenizer as given, assistant_only) for conversations


def _jobs(units: Iterator[sources.Unit], shard_bytes: int) -> Iterator[list[sources.Unit]]:
    """Units gathered in order until they hold `shard_bytes` of input: one list per shard."""
    batch, size = [], 0
    for unit in units:
        batch.append(unit)
        size += unit.input_bytes
        if size >= shard_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _run(jobs: Iterator[list[sources.Unit]], task: _Task, done: dict[int, dict], *, workers: int, total_disk: int,
         progress: bool) -> tuple[list[dict], list[dict]]:
    """Every shard's record in shard order, and those written by this run."""
    records, written = dict(done), []
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    bar = _Progress(total_disk, enabled=progress)
    pending: set[Future] = set()

    def collect(finished: set[Future]) -> None:
        for future in finished:
            record = future.result()  # a worker's ValueError (a bad line) is raised here
            records[record["index"]] = record
            written.append(record)
            bar.advance(record, skipped=False)

    try:
        with bar:
            for index, units in enumerate(jobs):
                if index in done:
                    bar.advance(done[index], skipped=True)
                    continue
                while len(pending) >= 2 * workers:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    collect(finished)
                pending.add(pool.submit(_write_shard, replace(task, index=index, units=units)))
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                collect(finished)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [records[i] for i in sorted(records)], written


@lru_cache(maxsize=2)
def _worker_tokenizer(path: str, *, chat: bool = False):
    """The tokenizer of this worker process, loaded once, single-threaded (see the module docstring): the
    `tokenizers` one of a tokenizer.json, or with `chat` meshlm's with the chat template conversations are rendered
    with (`meshlm.tokenizer.conversation_tokenizer`)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if chat:
        from meshlm.tokenizer import conversation_tokenizer

        return conversation_tokenizer(path)
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _split_of(text: bytes, val_fraction: float) -> str:
    """"val" when the first 8 bytes of the text's sha256 fall below `val_fraction` (the module docstring's rule)."""
    h = int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
    return "val" if val_fraction > 0 and h / 2**64 < val_fraction else "train"


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= ENCODE_BATCH_BYTES or len(batch) >= ENCODE_BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_shard(task: _Task) -> dict:
    """Tokenize one shard's documents into its files, then write its record (in a worker process)."""
    out = Path(task.out)
    splits = manifest.SPLITS if task.val_fraction > 0 else ("train",)
    masks = task.conversations is not None and task.conversations[1]
    writers = {s: _ShardWriter(out, manifest.shard_name(s, task.index), task.dtype, task.eos_token_id, masks=masks)
               for s in splits}
    if task.conversations is not None:
        text_bytes = _write_conversations(task, writers)
    else:
        text_bytes = _write_texts(task, writers)
    record = {"index": task.index, "input_bytes": sum(u.input_bytes for u in task.units),
              "disk_bytes": sum(u.disk_bytes for u in task.units), "text_bytes": text_bytes,
              **{s: w.finish() for s, w in writers.items()}}
    fsync_dir(out)
    manifest.write_json_atomic(manifest.record_path(out, task.index), record)
    return record


def _write_conversations(task: _Task, writers: dict[str, _ShardWriter]) -> int:
    """Every conversation of the shard, rendered, tokenized and masked as training in memory does; its text bytes."""
    from meshlm.data.chat import conversation_of_line, conversation_of_row, conversation_tokens

    tokenizer, assistant_only = _worker_tokenizer(task.conversations[0], chat=True), task.conversations[1]
    text_bytes = 0
    for unit in task.units:
        for item, where in sources.conversations(unit):
            conv = conversation_of_line(item, where) if isinstance(item, bytes) else conversation_of_row(item, where)
            raw = conv.key.encode("utf-8", errors="replace")
            text_bytes += len(raw)
            ids, counts = conversation_tokens(conv, tokenizer, assistant_only=assistant_only)
            writers[_split_of(raw, task.val_fraction)].add_tokens(ids, counts)
    return text_bytes


def _write_texts(task: _Task, writers: dict[str, _ShardWriter]) -> int:
    """Every document of the shard, tokenized, each followed by EOS; its text bytes."""
    tok = _worker_tokenizer(task.tokenizer_path)
    splits = list(writers)
    texts = itertools.chain.from_iterable(sources.documents(u, task.field) for u in task.units)
    text_bytes = 0
    for batch in _batches(texts):
        by_split: dict[str, list[str]] = {s: [] for s in splits}
        for text in batch:
            raw = text.encode("utf-8", errors="replace")
            text_bytes += len(raw)
            by_split[_split_of(raw, task.val_fraction)].append(text)
        for split, docs in by_split.items():
            if docs:
                writers[split].add(tok.encode_batch(docs, add_special_tokens=False))
    return text_bytes


class _ShardWriter:
    """Appends documents' tokens to `{name}.bin.tmp` (with `masks`, their mask bytes to `{name}.mask.tmp`); `finish`
    writes the `.idx` and renames them into place."""

    def __init__(self, out: Path, name: str, dtype: str, eos_token_id: int | None, *, masks: bool = False):
        self.out, self.name, self.dtype, self.eos = out, name, np.dtype(dtype), eos_token_id
        self._file = None
        self._sha = hashlib.sha256()
        self.num_tokens = 0
        self._starts: list[np.ndarray] = []
        self._masks, self._mask_sha, self._mask_file = masks, hashlib.sha256(), None
        self.num_loss_tokens: int | None = None  # counted for conversations (`add_tokens`)

    def add_tokens(self, ids: np.ndarray, counts: np.ndarray) -> None:
        """One conversation's tokens (its separator included) and whether predicting each counts in the loss."""
        self._starts.append(np.asarray([self.num_tokens], dtype=np.int64))
        self._append(np.asarray(ids))
        self.num_loss_tokens = (self.num_loss_tokens or 0) + int(np.count_nonzero(counts))
        if self._masks:
            data = np.asarray(counts, dtype=np.uint8).tobytes()
            if self._mask_file is None:
                self._mask_file = open(self.out / f"{self.name}.mask.tmp", "wb")
            self._mask_sha.update(data)
            self._mask_file.write(data)

    def add(self, encodings) -> None:
        ids = [e.ids for e in encodings]
        if self.eos is not None:
            for doc in ids:
                doc.append(self.eos)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum()))
        self._starts.append(self.num_tokens + np.cumsum(lengths) - lengths)
        self._append(flat)

    def _append(self, flat: np.ndarray) -> None:
        data = flat.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        if self._file is None:
            self._file = open(self.out / f"{self.name}.bin.tmp", "wb")
        self._file.write(data)
        self._sha.update(data)
        self.num_tokens += len(flat)

    def finish(self) -> dict | None:
        """The shard's entry of the manifest, or None when no document went to it (then it has no files)."""
        if self._file is None:
            return None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        starts = np.concatenate(self._starts).astype(np.int64)
        buffer = io.BytesIO()
        np.save(buffer, starts)
        idx = buffer.getvalue()
        bin_name, idx_name = f"{self.name}.bin", f"{self.name}.idx"
        write_atomic(self.out / idx_name, idx)
        record = {"bin": bin_name, "idx": idx_name, "num_tokens": self.num_tokens, "num_documents": len(starts),
                  "sha256": self._sha.hexdigest(), "idx_sha256": hashlib.sha256(idx).hexdigest()}
        if self.num_loss_tokens is not None:
            record["num_loss_tokens"] = self.num_loss_tokens
        if self._mask_file is not None:
            self._mask_file.flush()
            os.fsync(self._mask_file.fileno())
            self._mask_file.close()
            os.replace(self.out / f"{self.name}.mask.tmp", self.out / f"{self.name}.mask")
            record.update(mask=f"{self.name}.mask", mask_sha256=self._mask_sha.hexdigest())
        os.replace(self.out / f"{bin_name}.tmp", self.out / bin_name)
        return record


# --------------------------------------------------------------------------------------------
# Progress and the summary
# --------------------------------------------------------------------------------------------


class _Progress:
    """A rich bar over the inputs' bytes on disk, with this run's text MB/s and tokens/s."""

    def __init__(self, total_disk: int, *, enabled: bool):
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(),
                             TextColumn("{task.fields[rates]}"), TimeRemainingColumn(), disable=not enabled)
        self._task = self._bar.add_task("prepare", total=total_disk, rates="")
        self._start = time.perf_counter()
        self._text_bytes = self._tokens = 0

    def __enter__(self):
        self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)

    def advance(self, record: dict, *, skipped: bool) -> None:
        if not skipped:
            self._text_bytes += record["text_bytes"]
            self._tokens += sum(record[s]["num_tokens"] for s in manifest.SPLITS if record.get(s))
        seconds = max(time.perf_counter() - self._start, 1e-9)
        rates = f"{self._text_bytes / seconds / 1e6:.1f} MB/s  {self._tokens / seconds / 1e3:.0f}k tok/s"
        self._bar.update(self._task, advance=record["disk_bytes"], rates=rates)


def _summary(out: Path, m: dict, *, written: list[dict], skipped: int, seconds: float, left_out: dict) -> dict:
    tokens = sum(r[s]["num_tokens"] for r in written for s in manifest.SPLITS if r.get(s))
    text = sum(r["text_bytes"] for r in written)
    return {"out": str(out), "num_shards": len(written) + skipped, "shards_written": len(written),
            "shards_skipped": skipped,
            "num_documents": {s: v["num_documents"] for s, v in m["splits"].items()},
            "num_tokens": {s: v["num_tokens"] for s, v in m["splits"].items()},
            **({"num_loss_tokens": {s: v["num_loss_tokens"] for s, v in m["splits"].items()}}
               if m.get("conversations") is not None else {}),
            "input_bytes": m["input_bytes"], "text_bytes": m["text_bytes"], "seconds": round(seconds, 3),
            "text_mb_per_s": round(text / seconds / 1e6, 3) if written else 0.0,
            "tokens_per_s": round(tokens / seconds) if written else 0, "left_out": left_out}
