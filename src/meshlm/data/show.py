"""`meshlm data show`: training samples as the model will see them, with the targets that count in the loss marked.

Responsible for: opening what training would read -- a prepared folder (`dataset.PreparedDataset`, a split of it), or
any `data.path` training packs in memory (`text.build_datasets`, a `.jsonl` of conversations rendered by its chat
template) -- with the options that change a sample (seq_len, data.assistant_only_loss, data.split_across_samples);
and `sample_runs`, one sample's text as runs of tokens decoded together, each run's targets counted or not. A token
is marked by whether predicting it counts (its target flag): the sample's first token is an input only.
Not responsible for: printing (the CLI, `meshlm.cli.data`), or how samples are made (text.py, dataset.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshlm.config import DataConfig, is_prepared
from meshlm.data.dataset import PreparedDataset
from meshlm.data.text import IGNORE_INDEX, PackedDataset, build_datasets, source_tokenizer
from meshlm.tokenizer import Tokenizer, load_tokenizer


def open_samples(path: str | Path, *, tokenizer: str | None, seq_len: int, split: str = "train",
                 assistant_only: bool = True, whole: bool = True) -> tuple[PreparedDataset | PackedDataset, Tokenizer]:
    """(the samples training would read from `path`, the tokenizer that decodes them). A prepared folder's split,
    decoded with `tokenizer` or the tokenizer.json it was prepared with; else `path` packed in memory whole (no
    validation split held out, the first data.max_bytes of it as training reads), with `tokenizer` (a model folder:
    its chat template for conversations)."""
    if is_prepared(str(path)):
        samples = PreparedDataset(path, seq_len=seq_len, split=split, tokenizer_path=tokenizer,
                                  assistant_only=assistant_only, whole=whole)
        recorded = Path(samples.manifest["tokenizer"]["path"])
        if tokenizer is None and not recorded.is_file():
            raise ValueError(f"{path} was prepared with {recorded}, which is not there any more; pass --tokenizer "
                             "with that tokenizer.json (or its folder)")
        return samples, load_tokenizer(tokenizer or recorded)
    if split != "train":
        raise ValueError(f"{path} is not a prepared folder: it is shown whole, as packed for training (no split); "
                         "leave --split out")
    data = DataConfig(path=str(path), tokenizer=tokenizer or "", val_fraction=0.0,
                      assistant_only_loss=assistant_only, split_across_samples=not whole)
    data.validate()
    decoder = source_tokenizer(data)
    return build_datasets(data, seq_len=seq_len, tokenizer=decoder)[0], decoder


def sample_runs(samples, index: int, tokenizer: Tokenizer) -> tuple[list[tuple[str, bool]], int]:
    """(sample `index` as (text, counts) runs -- the first token, an input only, in a run that does not count --,
    how many of its targets count in the loss). Each run is what decoding the sample up to its end adds to the text
    before it, so a character whose bytes two runs share, or a space a decoder writes only between tokens
    (SentencePiece's), is printed once, where it ends."""
    ids = [int(t) for t in samples.samples(np.asarray([index]))[0]]
    counts = [False] + [int(t) != IGNORE_INDEX for t in samples.batch(np.asarray([index]))[1][0]]
    runs, start, before = [], 0, ""
    for i in range(1, len(ids) + 1):
        if i == len(ids) or counts[i] != counts[start]:
            text = tokenizer.decode(ids[:i], skip_special_tokens=False)
            kept = before.rstrip("\ufffd")  # a character cut at the run's end is whole in the longer text
            while not text.startswith(kept):
                kept = kept[:-1]
            runs.append((text[len(kept):], counts[start]))
            start, before = i, text
    return runs, sum(counts)
