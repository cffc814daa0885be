"""Prepared token shards as training samples: one prepared folder, or a weighted blend of several.

Responsible for: `PreparedDataset`, which opens a folder written by `prepare` (checks the manifest against
the files: every shard's size at every open, sha256 only with `checksums=True` -- reading every byte of a
large corpus at each start would take as long as a pass over it; checks the tokenizer's sha256 against a
given tokenizer.json), memory-maps its shards on first use (numpy memmap: pages are read when a sample
touches them, so resident memory does not grow with the corpus), and cuts them into samples of `seq_len + 1`
tokens with stride `seq_len` that never cross a shard boundary (the last `< seq_len + 1` tokens of a shard
are not used); where documents start inside samples (for document masking); `BlendedDataset`, which mixes
prepared datasets by weight; `open_dataset`, the one entry point for a path or a list of {path, weight}; what
training checks of prepared folders before opening them (`check_training_split`, `has_conversations`,
`check_prepared_chat`: the chat template their conversations were rendered with).
Both datasets also say in which order an epoch visits them (`order`): `PreparedLoader` asks for it.
A folder of conversations (manifest.py, version 2) is read as `meshlm.data.text` packs conversations in memory:
its targets that do not count in the loss (mask byte 0, the padding) are `IGNORE_INDEX`, `loss_targets` counts
the others, and unless `whole=False` (data.split_across_samples) no conversation crosses a sample's edge: each is
placed by `meshlm.data.chat.place` (computed at open, 24 bytes per conversation), the gaps filled with the
manifest's pad token, each gap a document of its own (per rank: every rank opens the folder). The same
conversations give the same samples, prepared or packed in memory, shard by shard (samples never cross a shard's
end), apart from the in-memory split's fallback for very few conversations (`text.split_conversations`).
Not responsible for: which rank reads which sample, micro-batches, prefetching (loader.py).

Sample i of a `PreparedDataset` lies in the shard s with cum[s] <= i < cum[s+1], where cum counts the samples
of the shards before, at token offset (i - cum[s]) * seq_len; inputs are its first seq_len tokens, targets
the last seq_len, as in `meshlm.data.text.PackedDataset`. An epoch visits the samples in the order of a
`SeededPermutation` keyed by (seed, epoch): nothing of size proportional to the corpus is built.

Blends: position g (counted over all epochs, g = epoch * len + position) goes to source pattern[g mod P], the
P = 65536-long pattern being the sources' weights laid out along a golden-ratio (Weyl) sequence: any run of
consecutive positions -- so every global batch -- holds each source in proportion to its weight up to a
few samples. It is the k-th position of that source, k = (g div P) * count + rank within the period, and
reads that source's sample at position k mod N of its pass k div N (a permutation keyed by the blend's seed,
the source's number and the pass). Same seed, same sources and weights: the same samples in the same order,
whatever the number of ranks. A blend's ids are offset per source (source s's samples come after those of
sources 0..s-1); its length, the sum of its sources', only sets how often the loader's epoch counter turns.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from meshlm.data import manifest
from meshlm.data.chat import place, with_padding_starts
from meshlm.data.permutation import SeededPermutation, derive_key
from meshlm.data.text import IGNORE_INDEX
from meshlm.files import sha256_file

BLEND_PERIOD = 1 << 16
_GOLDEN = (5**0.5 - 1) / 2


class PreparedDataset:
    """The samples of one split of a prepared folder (see the module docstring)."""

    def __init__(self, path: str | Path, *, seq_len: int, split: str = "train",
                 tokenizer_path: str | Path | None = None, checksums: bool = False, max_open_shards: int = 256,
                 assistant_only: bool = True, whole: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        self.path, self.seq_len, self.split = Path(path), int(seq_len), split
        self.manifest = manifest.read(self.path)
        splits = self.manifest["splits"]
        if split not in splits:
            raise ValueError(f"{self.path} has no split {split!r} (it has {', '.join(splits)}); prepare it with "
                             "--val-fraction F for a 'val' split")
        if tokenizer_path is not None:
            check_tokenizer(self.path, self.manifest, tokenizer_path)
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.vocab_size = self.manifest["tokenizer"]["vocab_size"]
        self._shards = splits[split]["shards"]
        for shard in self._shards:
            manifest.check_shard(self.path, shard, itemsize=self.dtype.itemsize, checksums=checksums)
        self.conversations = self.manifest.get("conversations")  # None: texts
        if self.conversations is not None and assistant_only and not self.conversations["assistant_only_loss"]:
            raise ValueError(f"{self.path} was prepared with --all-tokens (no loss masks): set "
                             "data.assistant_only_loss=false (every token counts), or prepare it again without")
        self._masked = self.conversations is not None and assistant_only
        if self._masked and any("mask" not in shard for shard in self._shards):
            raise ValueError(f"{self.path}/{manifest.MANIFEST} names a shard of {split!r} without its loss mask: it "
                             "is damaged; copy the whole prepared folder again or prepare it again")
        tokens = np.array([s["num_tokens"] for s in self._shards], dtype=np.int64)
        self.num_tokens = int(tokens.sum())
        self._open: OrderedDict[int, tuple] = OrderedDict()
        self._max_open = max_open_shards
        self._lock = threading.Lock()  # the loader's prefetch thread and the caller may read at once
        # conversations kept whole: per shard (where each conversation is placed, where it ends, document starts)
        self._placed, spans = None, tokens
        if self.conversations is not None and whole:
            self._placed = [self._place(s, whole_in=self.seq_len) for s in range(len(self._shards))]
            spans = np.array([ends[-1] for _, ends, _ in self._placed], dtype=np.int64)
        self._cum = np.concatenate([[0], np.cumsum(np.maximum(spans - 1, 0) // self.seq_len)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._cum[-1])

    def order(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The sample indices an epoch visits at `positions` (a seeded permutation of all samples)."""
        return SeededPermutation(len(self), derive_key(seed, epoch))(positions)

    def _shard(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(tokens, document starts, mask bytes or None) of shard s, memory-mapped; the least recently used are
        closed past a limit."""
        with self._lock:
            if s in self._open:
                self._open.move_to_end(s)
                return self._open[s]
            shard = self._shards[s]
            tokens = np.memmap(self.path / shard["bin"], dtype=self.dtype, mode="r", shape=(shard["num_tokens"],))
            starts = np.load(self.path / shard["idx"], mmap_mode="r")
            masks = np.memmap(self.path / shard["mask"], dtype=np.uint8, mode="r", shape=(shard["num_tokens"],)) \
                if self._masked else None
            self._open[s] = (tokens, starts, masks)
            if len(self._open) > self._max_open:
                self._open.popitem(last=False)
            return self._open[s]

    def _place(self, s: int, *, whole_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(where each conversation of shard s begins once placed whole, where it ends, the document starts:
        the conversations' and the padding's) -- `chat.place`, the rule of conversations packed in memory."""
        starts = np.asarray(self._shard(s)[1], dtype=np.int64)
        lengths = np.diff(np.append(starts, self._shards[s]["num_tokens"]))
        at = place(lengths, whole_in)
        return at, at + lengths, with_padding_starts(at, lengths)

    def _row(self, s: int, o: int, *, tokens: bool = True) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The seq_len + 1 tokens at offset o of shard s (`tokens=False`: None, only the counts are read), and whether
        predicting each counts in the loss (None for texts: all do)."""
        n = self.seq_len + 1
        ids, starts, masks = self._shard(s)
        if self._placed is None:
            if self.conversations is None:
                counts = None
            else:
                counts = np.ones(n, dtype=bool) if masks is None else masks[o:o + n].astype(bool)
            return (ids[o:o + n] if tokens else None), counts
        at, ends, _ = self._placed[s]
        row = np.full(n, self.conversations["pad_token_id"], dtype=np.int64) if tokens else None
        counts = np.zeros(n, dtype=bool)
        for c in range(int(np.searchsorted(ends, o, side="right")), int(np.searchsorted(at, o + n, side="left"))):
            a, b = max(int(at[c]), o), min(int(ends[c]), o + n)
            src = int(starts[c]) + a - int(at[c])
            if tokens:
                row[a - o:b - o] = ids[src:src + b - a]
            counts[a - o:b - o] = True if masks is None else masks[src:src + b - a]
        return row, counts

    def _locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(shard, token offset) of each sample index."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"sample indices {idx.min()}..{idx.max()} outside [0, {len(self)}) of {self.path}")
        shard = np.searchsorted(self._cum, idx, side="right") - 1
        return shard, (idx - self._cum[shard]) * self.seq_len

    def _rows(self, indices) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[len(indices), seq_len + 1] int64 tokens, and bool: whether predicting each counts (None for texts)."""
        shards, offsets = self._locate(indices)
        out = np.empty((len(shards), self.seq_len + 1), dtype=np.int64)
        counts = None if self.conversations is None else np.empty(out.shape, dtype=bool)
        for i, (s, o) in enumerate(zip(shards.tolist(), offsets.tolist())):
            out[i], row_counts = self._row(s, o)
            if counts is not None:
                counts[i] = row_counts
        return torch.from_numpy(out), None if counts is None else torch.from_numpy(counts)

    def samples(self, indices) -> torch.Tensor:
        """[len(indices), seq_len + 1] int64."""
        return self._rows(indices)[0]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), the targets that do not count in the loss (conversations) set to `IGNORE_INDEX`."""
        s, counts = self._rows(indices)
        targets = s[:, 1:] if counts is None else s[:, 1:].masked_fill(~counts[:, 1:], IGNORE_INDEX)
        return s[:, :-1], targets

    def loss_targets(self, indices) -> int:
        """How many targets of the samples `indices` count in the loss (conversations: their mask bytes read, not
        their tokens)."""
        if self.conversations is None:
            return len(np.asarray(indices).reshape(-1)) * self.seq_len
        shards, offsets = self._locate(indices)
        return sum(int(self._row(s, o, tokens=False)[1][1:].sum()) for s, o in zip(shards.tolist(), offsets.tolist()))

    def document_starts(self, indices) -> list[np.ndarray]:
        """Per sample, the positions in [0, seq_len] (within its seq_len + 1 tokens) where a document begins."""
        shards, offsets = self._locate(indices)
        out = []
        for s, o in zip(shards.tolist(), offsets.tolist()):
            starts = self._shard(s)[1] if self._placed is None else self._placed[s][2]
            lo, hi = np.searchsorted(starts, [o, o + self.seq_len + 1], side="left")
            out.append(np.asarray(starts[lo:hi], dtype=np.int64) - o)
        return out


def check_tokenizer(folder: Path, m: dict, tokenizer_path: str | Path) -> None:
    """A ValueError naming both when `tokenizer_path` is not the tokenizer the folder was prepared with."""
    p = Path(tokenizer_path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"tokenizer {p} does not exist; pass the tokenizer.json the data was prepared with "
                         f"({m['tokenizer']['path']})")
    have, want = sha256_file(p), m["tokenizer"]["sha256"]
    if have != want:
        raise ValueError(f"tokenizer {p} (sha256 {have[:16]}) is not the one {folder} was prepared with "
                         f"({m['tokenizer']['path']}, sha256 {want[:16]}); pass that tokenizer, or prepare the "
                         "data again with this one")


class BlendedDataset:
    """Prepared datasets mixed by weight (see the module docstring)."""

    def __init__(self, parts: list[tuple[PreparedDataset, float]]):
        if not parts:
            raise ValueError("a blend needs at least one source: [{path = ..., weight = ...}, ...]")
        first = parts[0][0]
        for ds, weight in parts:
            if not (np.isfinite(weight) and weight > 0):
                raise ValueError(f"blend weight {weight} of {ds.path} must be a positive number")
            if ds.seq_len != first.seq_len:
                raise ValueError(f"blend sources {first.path} and {ds.path} are cut for seq_len {first.seq_len} "
                                 f"and {ds.seq_len}; open them with the same seq_len")
            if ds.manifest["tokenizer"]["sha256"] != first.manifest["tokenizer"]["sha256"]:
                raise ValueError(f"blend sources {first.path} ({first.manifest['tokenizer']['path']}) and {ds.path} "
                                 f"({ds.manifest['tokenizer']['path']}) were prepared with different tokenizers; "
                                 "prepare them with the same tokenizer.json")
            if len(ds) == 0:
                raise ValueError(f"blend source {ds.path} has no sample of {ds.seq_len + 1} tokens; "
                                 "leave it out or prepare more text")
        chats = {json.dumps(ds.conversations["chat"], sort_keys=True): ds.path for ds, _ in parts
                 if ds.conversations is not None}
        if len(chats) > 1:
            a, b = list(chats.values())[:2]
            raise ValueError(f"blend sources {a} and {b} hold conversations rendered with different chat templates; "
                             "prepare them with the same model folder's tokenizer")
        self.sources = [ds for ds, _ in parts]
        self.seq_len, self.vocab_size = first.seq_len, first.vocab_size
        weights = np.array([w for _, w in parts], dtype=np.float64)
        self.weights = weights / weights.sum()
        self._sizes = np.array([len(ds) for ds in self.sources], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)]).astype(np.int64)
        self._pattern, self._rank, self._counts = _blend_pattern(self.weights, [str(ds.path) for ds in self.sources])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def order(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Blend ids at `positions` of this epoch (see the module docstring)."""
        g = epoch * len(self) + np.asarray(positions, dtype=np.int64)
        phase = g % BLEND_PERIOD
        source = self._pattern[phase]
        k = (g // BLEND_PERIOD) * self._counts[source] + self._rank[phase]
        passes, within = k // self._sizes[source], k % self._sizes[source]
        ids = np.empty_like(g)
        for s, p in set(zip(source.tolist(), passes.tolist())):
            mask = (source == s) & (passes == p)
            ids[mask] = self._offsets[s] + self.sources[s].order(derive_key(seed, s), p, within[mask])
        return ids

    def _split(self, ids) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"blend ids {ids.min()}..{ids.max()} outside [0, {len(self)})")
        source = np.searchsorted(self._offsets, ids, side="right") - 1
        return source, ids - self._offsets[source]

    def samples(self, ids) -> torch.Tensor:
        """[len(ids), seq_len + 1] int64."""
        source, local = self._split(ids)
        out = torch.empty((len(source), self.seq_len + 1), dtype=torch.int64)
        for s in np.unique(source).tolist():
            rows = np.flatnonzero(source == s)
            out[torch.from_numpy(rows)] = self.sources[s].samples(local[rows])
        return out

    def batch(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of each id from its source (a conversation folder's targets masked, `IGNORE_INDEX`)."""
        source, local = self._split(ids)
        inputs = torch.empty((len(source), self.seq_len), dtype=torch.int64)
        targets = torch.empty_like(inputs)
        for s in np.unique(source).tolist():
            rows = torch.from_numpy(np.flatnonzero(source == s))
            inputs[rows], targets[rows] = self.sources[s].batch(local[rows.numpy()])
        return inputs, targets

    def loss_targets(self, ids) -> int:
        """How many targets of the samples `ids` count in the loss (`PreparedDataset.loss_targets`)."""
        source, local = self._split(ids)
        return sum(self.sources[s].loss_targets(local[source == s]) for s in np.unique(source).tolist())

    def document_starts(self, ids) -> list[np.ndarray]:
        source, local = self._split(ids)
        return [self.sources[s].document_starts([i])[0] for s, i in zip(source.tolist(), local.tolist())]

    def realised_weights(self) -> np.ndarray:
        """The share of each source over one period of the pattern (the weights, up to 1/65536)."""
        return self._counts / BLEND_PERIOD


def _blend_pattern(weights: np.ndarray, names: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source of each phase, its rank among that source's phases, phases per source) over one period."""
    u = ((np.arange(BLEND_PERIOD) + 0.5) * _GOLDEN) % 1.0
    pattern = np.minimum(np.searchsorted(np.cumsum(weights), u, side="right"), len(weights) - 1)
    counts = np.bincount(pattern, minlength=len(weights)).astype(np.int64)
    if (counts == 0).any():
        name = names[int(np.flatnonzero(counts == 0)[0])]
        raise ValueError(f"blend weight of {name} is below 1/{BLEND_PERIOD} of the total; raise it or leave it out")
    order = np.argsort(pattern, kind="stable")
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(BLEND_PERIOD, dtype=np.int64)
    rank[order] = np.arange(BLEND_PERIOD) - first[pattern[order]]
    return pattern, rank, counts


def has_split(spec, split: str) -> bool:
    """Whether every prepared folder of `spec` (a folder, or a blend's entries) holds `split` -- read from the
    manifests, so that a damaged shard of a split that exists fails loudly when opened rather than looking absent."""
    folders = [spec] if isinstance(spec, (str, Path)) else [entry["path"] for entry in spec]
    return all(split in manifest.read(Path(folder))["splits"] for folder in folders)


def open_dataset(spec, *, seq_len: int, split: str = "train", tokenizer_path: str | Path | None = None,
                 checksums: bool = False, assistant_only: bool = True,
                 whole: bool = True) -> PreparedDataset | BlendedDataset:
    """A prepared folder (a path), or a blend (a list of {"path": ..., "weight": ...}); `assistant_only`
    (data.assistant_only_loss) and `whole` (not data.split_across_samples): how conversation folders are read."""
    options = dict(seq_len=seq_len, split=split, tokenizer_path=tokenizer_path, checksums=checksums,
                   assistant_only=assistant_only, whole=whole)
    if isinstance(spec, (str, Path)):
        return PreparedDataset(spec, **options)
    parts = []
    for entry in spec:
        if not isinstance(entry, dict) or set(entry) != {"path", "weight"}:
            raise ValueError(f"blend entry {entry!r} must be {{path = \"DIR\", weight = W}}")
        parts.append((PreparedDataset(entry["path"], **options), float(entry["weight"])))
    return BlendedDataset(parts)


def has_conversations(spec) -> bool:
    """Whether a prepared folder or blend (a DataConfig's data.path or data.sources) holds conversations."""
    return bool(_chats(spec))


def _chats(spec) -> dict[str, dict]:
    """folder -> the chat config its conversations were rendered with, for the folders of conversations."""
    return {f: m["conversations"]["chat"] or {} for f, m in ((f, manifest.read(Path(f))) for f in spec.folders)
            if m.get("conversations") is not None}


def check_training_split(spec) -> None:
    """A ValueError naming a prepared folder (of a DataConfig's) whose 'train' split training cannot learn from: empty
    (every document hashed into 'val'), or conversations none of whose tokens counts where only the assistant's do."""
    for folder in spec.folders:
        m = manifest.read(Path(folder))
        train = m["splits"]["train"]
        if not train["num_documents"]:
            raise ValueError(f"{folder}'s 'train' split is empty: all its "
                             f"{m['splits'].get('val', {}).get('num_documents', 0)} "
                             f"documents hashed into 'val' (--val-fraction {m['settings']['val_fraction']:g}); "
                             "prepare it with a smaller --val-fraction, or more documents")
        if m.get("conversations") and spec.assistant_only_loss and m["conversations"]["assistant_only_loss"] \
                and not train["num_loss_tokens"]:
            raise ValueError(f"{folder}: no token of the training conversations is an assistant's; each needs a "
                             "message with role 'assistant' (or set data.assistant_only_loss=false)")


def check_prepared_chat(spec, chat: dict | None, whose: str, fix: str) -> None:
    """A ValueError naming the prepared folders whose conversations were rendered with another chat template than
    `chat` (`whose` it is, e.g. data.tokenizer's; the checkpoint carries the training tokenizer's on to serving)."""
    others = [folder for folder, theirs in _chats(spec).items() if theirs != (chat or {})]
    if others:
        raise ValueError(f"{', '.join(others)} holds conversations rendered with another chat template than {whose}; "
                         f"{fix}")
