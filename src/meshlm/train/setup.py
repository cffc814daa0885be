"""What a training rank runs on and with, from the `Config`: device, precision, seeds, tokenizer, parallel model.

Responsible for: resolving `train.device` and `train.precision` to a torch device, an autocast dtype and
the parameters' dtype; seeding every RNG a run draws from; loading the tokenizer and refusing one larger
than the model's vocabulary; the data and its loader (in memory, or prepared token shards), and train.epochs'
number of steps once the data is read; and building the model the way every layout starts -- on the meta device,
split over the ranks by `meshlm.parallel.parallelize`, each rank then initialising only what it holds.
Not responsible for: the mesh (`meshlm.mesh`), how a strategy splits the model (`meshlm.parallel`), or the
optimizer (`meshlm.train.optim`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from meshlm.config import Config, TrainConfig
from meshlm.mesh import Mesh
from meshlm.models import build_model
from meshlm.parallel.materialize import ShardInit
from meshlm.parallel.parallelize import ParallelModel, parallelize
from meshlm.tokenizer import CHAT_CONFIG_FILE, Tokenizer, chat_config, conversation_tokenizer
from meshlm.data.dataset import check_prepared_chat, check_training_split, has_conversations, has_split, open_dataset
from meshlm.data.text import BatchLoader, build_datasets, pack, source_tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is available; use train.device=auto or cpu")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for no autocast. Parameters and optimizer state stay fp32 (or all
    fp64 with train.precision=fp64, see `param_dtype`)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if name == "bf16" else None


def param_dtype(name: str) -> torch.dtype:
    """fp32 master weights, except train.precision=fp64: parameters, gradients, optimizer state and
    compute all in float64. Slow, and meant for proofs: two layouts agree to ~1e-12 there, so a parity
    check needs no tolerance tuned to a CPU's fp32 rounding (see `meshlm verify`)."""
    return torch.float64 if name == "fp64" else torch.float32


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_training_tokenizer(cfg: Config) -> Tokenizer:
    """`data.tokenizer`, refused when it has more tokens than the model has embeddings. For conversations (a
    `.jsonl` of them, `meshlm.data.chat`, or a folder `meshlm data prepare` made of one) the tokenizer of a Hugging
    Face model folder comes with its chat template (`meshlm.tokenizer.conversation_tokenizer`); a prepared folder's
    must be the template it was prepared with."""
    if cfg.data.prepared and has_conversations(cfg.data):
        tokenizer = conversation_tokenizer(cfg.data.tokenizer)
        check_prepared_chat(cfg.data, chat_config(tokenizer), f"data.tokenizer={cfg.data.tokenizer}'s",
                            "set data.tokenizer to the model folder they were prepared with (its tokenizer_config.json "
                            "/ chat_template.jinja), or prepare them again with this one")
    else:
        tokenizer = source_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                         f"{cfg.model.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")
    return tokenizer


def checkpoint_files(tokenizer: Tokenizer) -> dict[str, Path | str]:
    """What a checkpoint carries of the tokenizer: its tokenizer.json, and the chat template it trained with
    (conversations read through a model folder's) with its special tokens, which
    `meshlm.tokenizer.load_saved_tokenizer` reads back."""
    files: dict[str, Path | str] = {}
    if getattr(tokenizer, "path", None):
        files["tokenizer.json"] = Path(tokenizer.path)
    chat = chat_config(tokenizer)
    if chat is not None:
        files[CHAT_CONFIG_FILE] = json.dumps(chat, indent=1)
    return files


def build_parallel_model(cfg: Config, mesh: Mesh, *, device: torch.device, dtype: torch.dtype,
                         weights: Callable[[nn.Module], None] | None = None) -> tuple[nn.Module, ParallelModel]:
    """(the plain model, what `parallelize` made of it on this rank). Built on the meta device, split, then
    each rank initialises only what it holds (`parallel/materialize.py`: the values the single-device model
    has there). `weights(model)`, when given, fills the full model before it is split over the ranks (so
    every layout starts from the same tensors); that one is built whole."""
    t = cfg.train
    model = build_model(cfg.model, seed=t.seed, device=device, dtype=dtype, materialize=weights is not None)
    if weights is not None:
        weights(model)
    init = ShardInit(cfg.model, t.seed, mesh, device, dtype)
    return model, parallelize(model, mesh, cfg.parallel, seq_len=t.seq_len, init=init)


def set_steps_from_epochs(t: TrainConfig, num_samples: int) -> None:
    """With train.epochs > 0, train.steps becomes that many passes over the `num_samples` training samples: epochs x
    the whole global batches of one (a partial one at an epoch's end is dropped, as the loaders do), rounded half up,
    at least 1 -- and the learning-rate schedule spans them. A blend's pass is the loader's: as many samples as its
    sources hold together, drawn by weight."""
    if t.epochs > 0:
        t.steps = max(1, int(t.epochs * (num_samples // t.global_batch_size) + 0.5))


def build_data(cfg: Config, tokenizer: Tokenizer, *, micro_batch_size: int, dp_rank: int, dp_size: int):
    """(training set, validation set, loader) of `cfg.data`: token shards `meshlm data prepare` wrote
    (memory-mapped, one prepared folder or a weighted blend; read a step ahead in a thread), else a text
    source read, tokenized and packed in memory. Either loader gives this data rank its slice of each global
    batch, and the same samples whatever the number of ranks."""
    t, where = cfg.train, ", ".join(cfg.data.folders)
    if not cfg.data.prepared:
        train, val = build_datasets(cfg.data, seq_len=t.seq_len, tokenizer=tokenizer)
        loader = BatchLoader(train, global_batch_size=t.global_batch_size, micro_batch_size=micro_batch_size,
                             seq_len=t.seq_len, seed=t.seed, dp_rank=dp_rank, dp_size=dp_size,
                             documents=cfg.data.document_mask)
    else:
        from meshlm.data.loader import PreparedLoader

        spec = cfg.data.sources or cfg.data.path
        options = dict(seq_len=t.seq_len, tokenizer_path=cfg.data.tokenizer,
                       assistant_only=cfg.data.assistant_only_loss, whole=not cfg.data.split_across_samples)
        check_training_split(cfg.data)
        train = open_dataset(spec, split="train", **options)
        if train.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"{spec} was prepared with a vocabulary of {train.vocab_size} tokens but "
                             f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size >= {train.vocab_size}")
        if has_split(spec, "val"):
            val = open_dataset(spec, split="val", **options)
        else:  # prepared without --val-fraction: no validation
            val = pack(np.zeros(0, dtype=np.int32), t.seq_len)
        loader = PreparedLoader(train, global_batch_size=t.global_batch_size, micro_batch_size=micro_batch_size,
                                seq_len=t.seq_len, seed=t.seed, dp_rank=dp_rank, dp_size=dp_size,
                                documents=cfg.data.document_mask)
    shown = min(len(val), t.val_batches * t.global_batch_size)  # the samples validation reads (`evaluate`)
    if shown and val.loss_targets(torch.arange(shown)) == 0:
        held = "its 'val' split" if cfg.data.prepared else f"data.val_fraction={cfg.data.val_fraction:g}"
        fix = "prepare the folder again with other --val-fraction" if cfg.data.prepared \
            else "raise train.val_batches, or set data.val_fraction=0"
        raise ValueError(f"{where}: no token of the {shown} validation samples ({held} of the conversations, "
                         f"train.val_batches={t.val_batches}) is an assistant's, so no validation loss can be "
                         f"taken; give those conversations replies, {fix}, or set train.val_batches=0")
    return train, val, loader
