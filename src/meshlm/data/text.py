"""Text corpora read, tokenized and packed in memory at start-up; the batch loader both kinds of data use.

Responsible for: reading a text file,
a folder of text files, a `.jsonl` with a `text` field, or the embedded default corpus (the `.py` files
of the running interpreter's standard library); a `.jsonl` of conversations ({"messages": [...]}, chat.py
renders and masks them); a deterministic train/validation split by document (or conversation);
packing the token stream into samples of `seq_len + 1` tokens, remembering where each document begins
(`PackedDataset.document_starts`) and, for conversations, which targets count in the loss (the others are
`IGNORE_INDEX`, which every loss here skips: `F.cross_entropy`'s default); and `BatchLoader`, which walks a seeded
shuffle of the samples one global batch per optimizer step, hands data-parallel rank r its contiguous slice,
splits it into micro-batches (`micro_batch`: inputs, targets and, under data.document_mask, the document ids of
`meshlm.models.documents`), counts the targets of the whole global batch that count in the loss (`loss_targets`:
what every rank divides its token losses by, so that the loss is the global batch's mean under any layout and
any number of micro-batches), and can save and restore its position.
`source_tokenizer` is the tokenizer training reads data.path with.
Not responsible for: tokenizers (`meshlm.tokenizer`), prepared token shards (dataset.py, loader.py), moving
batches to a device, or sharding the sequence dimension (context parallelism slices the micro-batches it is
given).
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from meshlm.config import DataConfig
from meshlm.data.chat import Conversation, encode_conversations, is_conversation_row, read_conversations
from meshlm.data.sources import is_chat_jsonl
from meshlm.messages import checked_text
from meshlm.models.documents import documents_from_starts
from meshlm.tokenizer import Tokenizer, conversation_tokenizer, load_tokenizer

# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------

PREPARE_ONLY = {".gz", ".zst", ".parquet", ".bz2", ".xz"}  # compressed or columnar: `meshlm data prepare` reads them
_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".toml", ".c", ".h", ".cpp", ".js",
                  ".ts", ".html", ".css", ".yaml", ".yml", ".sh", ".tex", ".csv", ""}
# Folders of the standard library that are not "the standard library" or are mostly generated tests.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The `.py` files of the running interpreter's standard library, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py")
             if not any(part in _STDLIB_SKIP for part in p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_documents(data: DataConfig) -> list[str]:
    """The documents of the configured source in a deterministic order, capped at `data.max_bytes`.

    A text file is one document, a folder gives one per text file (sorted by relative path), a
    `.jsonl` one per line (its `text` field), and no path means the standard-library sources.
    """
    if not data.path:
        paths = stdlib_files()
    else:
        source = Path(data.path)
        if not source.exists():
            raise ValueError(f"data.path={data.path!r} does not exist; pass a text file, a folder or a .jsonl")
        if source.is_dir():
            paths = sorted((p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES),
                           key=lambda p: p.relative_to(source).as_posix())
            if not paths:
                raise ValueError(f"data.path={data.path!r} holds no text files ({sorted(_TEXT_SUFFIXES - {''})})")
        elif source.suffix == ".jsonl":
            return _cap(_read_jsonl(source), data.max_bytes)
        elif source.suffix in PREPARE_ONLY:
            raise ValueError(f"data.path={data.path!r} is a {source.suffix} file, which training does not read as "
                             "text; tokenize it with `meshlm data prepare` and train on the folder it writes")
        else:
            paths = [source]
    docs, total = [], 0
    for p in paths:
        if total >= data.max_bytes:
            break
        if p.suffix == ".jsonl":  # a folder of JSONL shards: each line's `text` is a document
            for text in _cap(_read_jsonl(p), data.max_bytes - total):
                total += len(text.encode("utf-8"))
                docs.append(text)
            continue
        text = p.read_bytes()[: data.max_bytes - total].decode("utf-8", errors="replace")
        total += len(text.encode("utf-8"))
        docs.append(text)
    return docs


def _read_jsonl(path: Path) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); each line must be an object") from None
            if is_conversation_row(row) and "text" not in row:
                raise ValueError(f"{path}:{lineno} is a conversation: conversations are trained on from one .jsonl "
                                 "given as data.path, not mixed with texts (a folder of them: `meshlm data prepare` "
                                 "it)")
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{lineno} has no string field 'text'; each line must be "
                                 '{"text": "..."}')
            try:
                docs.append(checked_text(row["text"], "its 'text'"))
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}; fix or delete that line") from None
    return docs


def _cap(docs: list[str], max_bytes: int) -> list[str]:
    out, total = [], 0
    for d in docs:
        if total >= max_bytes:
            break
        b = d.encode("utf-8")[: max_bytes - total]
        total += len(b)
        out.append(b.decode("utf-8", errors="ignore"))
    return out


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Deterministic split by document: each document goes to validation when a hash of its content
    falls below `val_fraction` (stable when files are added). A single document is split by its tail."""
    if val_fraction <= 0 or not docs:
        return docs, []
    if len(docs) == 1:
        cut = int(len(docs[0]) * (1 - val_fraction))
        return [docs[0][:cut]], [docs[0][cut:]]
    return _split_by_hash(docs, docs, val_fraction)


def split_conversations(convs: list[Conversation], val_fraction: float) -> tuple[list, list]:
    """`split_documents`' rule for conversations, each hashed by its line as read (a single one stays whole)."""
    if val_fraction <= 0 or len(convs) < 2:
        return convs, []
    return _split_by_hash(convs, [c.key for c in convs], val_fraction)


def _split_by_hash(items: list, keys: list[str], val_fraction: float) -> tuple[list, list]:
    train, val = [], []
    for item, key in zip(items, keys):
        h = int.from_bytes(hashlib.sha256(key.encode("utf-8", errors="replace")).digest()[:8], "little")
        (val if h / 2**64 < val_fraction else train).append(item)
    if not val:  # few documents: take the last one rather than have no validation at all
        train, val = train[:-1], train[-1:]
    return train, val


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------

IGNORE_INDEX = -100  # a target that does not count in the loss (F.cross_entropy's default ignore_index)


@dataclass
class PackedDataset:
    """A token stream cut into overlapping-by-one samples: sample i is tokens[i*s : i*s + s + 1].

    `inputs = sample[:-1]`, `targets = sample[1:]`, so every token is predicted exactly once.
    """

    tokens: torch.Tensor  # 1-D int32
    seq_len: int
    starts: np.ndarray | None = None  # int64, sorted: where each document begins in `tokens` (None: not known)
    # bool per token: whether predicting it counts in the loss (conversations: the assistant's turns); None: all do
    trainable: torch.Tensor | None = None

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_len)

    def _rows(self, values: torch.Tensor, indices) -> torch.Tensor:
        view = values[: len(self) * self.seq_len + 1].unfold(0, self.seq_len + 1, self.seq_len)
        return view[torch.as_tensor(indices).long()]

    def samples(self, indices: torch.Tensor) -> torch.Tensor:
        """[len(indices), seq_len + 1] int64."""
        return self._rows(self.tokens, indices).long()

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), the targets that do not count in the loss set to `IGNORE_INDEX`."""
        s = self.samples(indices)
        inputs, targets = s[:, :-1], s[:, 1:]
        if self.trainable is not None:
            targets = targets.masked_fill(~self._rows(self.trainable, indices)[:, 1:], IGNORE_INDEX)
        return inputs, targets

    def loss_targets(self, indices) -> int:
        """How many targets of the samples `indices` count in the loss."""
        if self.trainable is None:
            return len(indices) * self.seq_len
        return int(self._rows(self.trainable, indices)[:, 1:].sum())

    def document_starts(self, indices) -> list[np.ndarray]:
        """Per sample, the positions in [0, seq_len] (within its seq_len + 1 tokens) where a document begins."""
        if self.starts is None:
            raise ValueError("this dataset was packed without its document starts; pack it with "
                             "pack_documents (or pack(..., starts=)) to use data.document_mask")
        begins = torch.as_tensor(indices).long().numpy() * self.seq_len
        lo = np.searchsorted(self.starts, begins, side="left")
        hi = np.searchsorted(self.starts, begins + self.seq_len + 1, side="left")
        return [self.starts[a:b] - o for a, b, o in zip(lo, hi, begins)]


def pack(tokens: np.ndarray | torch.Tensor, seq_len: int, *, starts: np.ndarray | None = None,
         trainable: np.ndarray | None = None) -> PackedDataset:
    """`tokens` cut into samples; `starts`: where each document begins in them (for data.document_mask);
    `trainable`: per token, whether predicting it counts in the loss (None: every one)."""
    t = torch.as_tensor(np.asarray(tokens, dtype=np.int32)) if not isinstance(tokens, torch.Tensor) else tokens
    starts = None if starts is None else np.asarray(starts, dtype=np.int64)
    if trainable is not None:
        trainable = torch.as_tensor(np.asarray(trainable, dtype=bool))
        if trainable.shape != t.shape:
            raise ValueError(f"trainable has {tuple(trainable.shape)} flags for {tuple(t.shape)} tokens")
    return PackedDataset(tokens=t.to(torch.int32).contiguous(), seq_len=seq_len, starts=starts, trainable=trainable)


def pack_documents(texts: list[str], tokenizer: Tokenizer, seq_len: int) -> PackedDataset:
    """Tokenize and pack documents, remembering where each begins (`Tokenizer.encode_with_starts`)."""
    tokens, starts = tokenizer.encode_with_starts(texts)
    return pack(tokens, seq_len, starts=starts)


def micro_batch(dataset, indices: torch.Tensor, *, documents: bool = False) -> tuple[torch.Tensor, ...]:
    """(inputs, targets) of the samples `indices` of `dataset` (anything with `batch` and `document_starts`);
    with `documents` (data.document_mask) also their document ids, int64 [len(indices), seq_len]
    (`meshlm.models.documents`): (inputs, targets, documents)."""
    inputs, targets = dataset.batch(indices)
    if not documents:
        return inputs, targets
    return inputs, targets, documents_from_starts(dataset.document_starts(indices), inputs.shape[1])


def build_datasets(data: DataConfig, *, seq_len: int,
                   tokenizer: Tokenizer) -> tuple[PackedDataset, PackedDataset]:
    """Read, split, tokenize and pack: (train, validation). Cached in memory only, by the caller. A `.jsonl` of
    conversations (`sources.is_chat_jsonl`) is rendered by `tokenizer`'s chat template, its loss on the assistant's
    turns unless data.assistant_only_loss is false."""
    where = data.path or "the standard-library corpus"
    train_items, val_items, pack_items = split_source(data, seq_len=seq_len, tokenizer=tokenizer)
    train, val = pack_items(train_items), pack_items(val_items)
    if len(train) and train.trainable is not None and not bool(train.trainable.any()):
        raise ValueError(f"{where}: no token of the training conversations is an assistant's; each needs a "
                         "message with role 'assistant' (or set data.assistant_only_loss=false)")
    if len(train) == 0:
        raise ValueError(f"{where} gives {train.tokens.numel()} training tokens, fewer than one sample of "
                         f"train.seq_len+1={seq_len + 1}; use more text or a smaller train.seq_len")
    return train, val


def source_tokenizer(data: DataConfig) -> Tokenizer:
    """The tokenizer training reads data.path with in memory: for conversations a model folder's with its chat
    template (`meshlm.tokenizer.conversation_tokenizer`), else data.tokenizer's (bytes when empty)."""
    return conversation_tokenizer(data.tokenizer) if is_chat_jsonl(data.path) else load_tokenizer(data.tokenizer)


def split_source(data: DataConfig, *, seq_len: int, tokenizer: Tokenizer) -> tuple[list, list, Callable]:
    """The configured source read and split: (training items, validation items) -- documents, or conversations
    (`sources.is_chat_jsonl`) -- and the function that packs a list of either (nothing is tokenized yet)."""
    if is_chat_jsonl(data.path):
        train, val = split_conversations(read_conversations(data.path, max_bytes=data.max_bytes), data.val_fraction)
        return train, val, lambda convs: pack_conversations(convs, tokenizer, seq_len,
                                                            assistant_only=data.assistant_only_loss,
                                                            whole=not data.split_across_samples)
    train, val = split_documents(read_documents(data), data.val_fraction)
    return train, val, lambda docs: pack_documents(docs, tokenizer, seq_len)


def pack_conversations(convs: list[Conversation], tokenizer: Tokenizer, seq_len: int, *,
                       assistant_only: bool, whole: bool = True) -> PackedDataset:
    """Render, tokenize and pack conversations (`chat.encode_conversations`), with their starts and loss flags;
    `whole`: none crosses a sample's edge (padding)."""
    tokens, starts, trainable = encode_conversations(convs, tokenizer, assistant_only=assistant_only,
                                                     whole_in=seq_len if whole else None)
    return pack(tokens, seq_len, starts=starts, trainable=trainable)


# --------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------


class BatchLoader:
    """One global batch per optimizer step, from a seeded shuffle reshuffled every epoch.

    Rank `dp_rank` of `dp_size` takes the contiguous slice `[r*B/dp, (r+1)*B/dp)` of each global
    batch (B = global_batch_size) and gets it as a list of micro-batches `(inputs, targets)`, or with
    `documents` (data.document_mask) `(inputs, targets, documents)` (`micro_batch`).
    Concatenating every rank's slices gives the global batch, so any data-parallel layout sees
    exactly the samples of the single-process run. A partial batch at an epoch's end is dropped.
    """

    def __init__(self, dataset: PackedDataset, *, global_batch_size: int, micro_batch_size: int,
                 seq_len: int, seed: int, dp_rank: int = 0, dp_size: int = 1, documents: bool = False):
        if dataset.seq_len != seq_len:
            raise ValueError(f"dataset is packed for seq_len={dataset.seq_len}, loader asked for {seq_len}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in 0..dp_size-1={dp_size - 1}")
        if global_batch_size % dp_size:
            raise ValueError(f"train.global_batch_size={global_batch_size} must be divisible by the "
                             f"data-parallel size {dp_size}")
        local = global_batch_size // dp_size
        if local % micro_batch_size:
            raise ValueError(f"per-rank batch global_batch_size/dp_size={global_batch_size}/{dp_size}={local} "
                             f"must be divisible by train.micro_batch_size={micro_batch_size}")
        if len(dataset) < global_batch_size:
            raise ValueError(f"the training set has {len(dataset)} samples of {seq_len + 1} tokens, fewer than "
                             f"train.global_batch_size={global_batch_size}; use more data or a smaller batch")
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.documents = documents
        # the targets of the last global batch (all ranks) that count in the loss: every one, unless the data
        # masks some (conversations)
        self.loss_targets = global_batch_size * seq_len
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _order(self) -> torch.Tensor:
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=g), self.epoch
        return self._perm

    def next_global_indices(self) -> torch.Tensor:
        """Sample indices of the next global batch (all ranks), advancing the position."""
        if self.position + self.global_batch_size > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order()[self.position: self.position + self.global_batch_size]
        self.position += self.global_batch_size
        return idx

    @property
    def loss_divisor(self) -> int:
        """What every rank divides its token losses by: the last global batch's counted targets (1 where none
        count: their losses are all 0)."""
        return max(1, self.loss_targets)

    def next_batch(self) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches of the next global batch (`loss_targets`: its targets that count)."""
        idx = self.next_global_indices()
        self.loss_targets = self.dataset.loss_targets(idx)
        local = self.global_batch_size // self.dp_size
        mine = idx[self.dp_rank * local: (self.dp_rank + 1) * local]
        return [micro_batch(self.dataset, chunk, documents=self.documents)
                for chunk in mine.split(self.micro_batch_size)]

    def __iter__(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_samples": len(self.dataset), "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples", "global_batch_size"):
            mine = self.seed if key == "seed" else len(self.dataset) if key == "num_samples" else self.global_batch_size
            if state[key] != mine:
                raise ValueError(f"cannot resume the data loader: saved {key}={state[key]}, now {mine}; "
                                 "the data, seed and global batch size must match the checkpoint")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def validation_batches(dataset: PackedDataset, *, num_batches: int, micro_batch_size: int,
                       dp_rank: int = 0, dp_size: int = 1, documents: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """A fixed set (the first samples, in order, wrapping if the split is small) for comparable val losses.

    Rank r takes every dp_size-th micro-batch so data-parallel ranks split the work. `documents`: as
    `BatchLoader`'s.
    """
    n = len(dataset)
    if n == 0 or num_batches == 0:
        return []
    total = num_batches * micro_batch_size
    idx = torch.arange(total) % n
    chunks = list(idx.split(micro_batch_size))
    return [micro_batch(dataset, c, documents=documents) for c in chunks[dp_rank::dp_size]]
