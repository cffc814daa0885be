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
from meshlm.data.text import IGNORE_INDEX, build_datasets
from meshlm.tokenizer import Tokenizer, conversation_tokenizer, load_tokenizer


def open_samples(path: str | Path, *, tokenizer: str | None, seq_len: int, split: str = "train",
                 assistant_only: bool = True, whole: bool = True) -> tuple[object, Tokenizer]:
    """(the samples training would read from `path`, the tokenizer that decodes them). A prepared folder's split,
    decoded with `tokenizer` or the tokenizer.json it was prepared with; else `path` packed in memory whole (no
    validation split held out), with `tokenizer` (a model folder: its chat template for conversations)."""
    if is_prepared(str(path)):
        samples = PreparedDataset(path, seq_len=seq_len, split=split, tokenizer_path=tokenizer,
                                  assistant_only=assistant_only, whole=whole)
        return samples, load_tokenizer(tokenizer or samples.manifest["tokenizer"]["path"])
    data = DataConfig(path=str(path), tokenizer=tokenizer or "", val_fraction=0.0, max_bytes=1 << 62,
                      assistant_only_loss=assistant_only, split_across_samples=not whole)
    data.validate()
    decoder = conversation_tokenizer(data.tokenizer)
    return build_datasets(data, seq_len=seq_len, tokenizer=decoder)[0], decoder


def sample_runs(samples, index: int, tokenizer: Tokenizer) -> tuple[list[tuple[str, bool]], int]:
    """(sample `index` as (text, counts) runs -- the first token, an input only, in a run that does not count --,
    how many of its targets count in the loss)."""
    inputs, targets = samples.batch(np.asarray([index]))
    ids = [int(inputs[0, 0])] + [int(t) for t in samples.samples(np.asarray([index]))[0, 1:]]
    counts = [False] + [int(t) != IGNORE_INDEX for t in targets[0]]
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or counts[i] != counts[start]:
            runs.append((tokenizer.decode(ids[start:i], skip_special_tokens=False), counts[start]))
            start = i
    return runs, sum(counts)
