"""`meshlm eval`: the loss and perplexity of a trained model on a dataset, on one process or under a layout.

Responsible for: the config of an evaluation (a meshlm checkpoint's own config, or a Hugging Face model
directory's, with `--set` overrides of the parallel/train/data sections), the dataset (the run's
validation split by default, or every document of `--data PATH` in any `data.path` form), and the
report: mean token loss, perplexity = exp(loss), and how many samples and tokens it covers.
Not responsible for: how a layout runs. `Evaluator` is a `Trainer` without data loader, optimizer or
run directory: it builds the mesh and the parallelized model through the trainer's own `setup_mesh` /
`setup_model` (the full weights are loaded before the model is split over the ranks) and sums the token
losses with the trainer's `loss_totals`, so every layout the trainer accepts evaluates the same way.
Launching ranks (`--nproc`) is the CLI's, through the same elastic launcher as `meshlm train`.

Which samples: the first whole global batches (`train.global_batch_size` samples each, split over the
data-parallel ranks as in training) of the dataset, so the set does not depend on the layout; fewer
than one global batch of samples left at the end is not evaluated, and the report says how many. Prepared folders
(the run's data.path or data.sources, or `--data`) give a dataset per folder and split, each evaluated so, their
token losses pooled.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from meshlm.config import Config, DataConfig, ModelConfig, load_config
from meshlm.train.trainer import Trainer


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    samples: int  # evaluated
    tokens: int  # predicted tokens evaluated
    skipped_samples: int  # the tail of the dataset (of each part), fewer than one global batch
    seq_len: int
    model: str
    step: int | None  # the checkpoint's step (None for a Hugging Face model)
    data: str  # what was evaluated, in words
    world_size: int
    parts: int = 1  # datasets evaluated each whole and pooled (prepared folders' splits)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with `section.field=value` overrides applied (and validated) exactly as `--set` does for train."""
    from meshlm.verify import config_toml

    for item in overrides:
        if item.strip().startswith("model."):
            raise ValueError(f"--set {item}: the model comes from the checkpoint; only parallel.*, train.* and "
                             "data.* can be set for eval")
    if not overrides:
        return cfg
    with tempfile.TemporaryDirectory(prefix="meshlm-eval-") as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(config_toml(cfg))
        return load_config(path, overrides)


def eval_config(*, checkpoint: str | None = None, hf: str | None = None, data: str | None = None,
                overrides: list[str] = (), checksums: bool = True) -> tuple[Config, dict]:
    """(the evaluation's config, where its weights come from) for a meshlm checkpoint or a HF directory.
    `checksums=False` checks the checkpoint's files by size only (the launcher's look at the config: the
    ranks verify it before they read the weights)."""
    from meshlm.checkpoint import config_from_dict, read_meta, resolve_checkpoint, verify_checkpoint

    if (checkpoint is None) == (hf is None):
        raise ValueError("give one of --checkpoint DIR or --hf DIR")
    if checkpoint is not None:
        path = resolve_checkpoint(checkpoint)
        listed = verify_checkpoint(path, checksums=checksums)["files"]  # before meta.json is parsed
        meta = read_meta(path)
        cfg = config_from_dict(meta["config"])
        source = {"checkpoint": path, "step": int(meta["step"]), "name": str(checkpoint), "files": list(listed)}
    else:
        path = Path(hf)
        model = ModelConfig.from_hf(path)
        tokenizer = path / "tokenizer.json"
        if not tokenizer.is_file():
            raise ValueError(f"--hf {hf}: no tokenizer.json there, so the text cannot be encoded; pass a Hugging "
                             "Face directory that has one")
        cfg = Config(model=model, data=DataConfig(tokenizer=str(tokenizer)))
        cfg.train.seq_len = min(cfg.train.seq_len, model.max_seq_len)
        source = {"hf": path, "step": None, "name": str(hf)}
    # Evaluation runs no training: no sample, no progress bar, and the run's data source stays unless --data.
    cfg.train.sample_tokens, cfg.train.progress = 0, False
    if data is not None:
        if not Path(data).exists():
            raise ValueError(f"--data {data!r} does not exist; pass a text file, a folder of text files, a .jsonl or a "
                             "folder `meshlm data prepare` wrote")
        cfg.data.path, cfg.data.sources = data, []
    if not any(o.strip().startswith("data.path") for o in overrides) and cfg.data.path \
            and not Path(cfg.data.path).exists():
        raise ValueError(f"data.path={cfg.data.path!r} (the run's data) does not exist here; pass --data PATH "
                         "(a text file, a folder of text files, a .jsonl or a prepared folder)")
    return _with_overrides(cfg, list(overrides)).validate(), source


class Evaluator(Trainer):
    """The trainer's mesh, parallelized model and loss sums, without data loader, optimizer or run_dir."""

    def __init__(self, cfg: Config, *, weights):
        # Trainer.__init__ is not called: it would read the training data, build an optimizer and own a run_dir.
        import torch.distributed as dist

        from meshlm.parallel.parallelize import check_layout

        self.cfg = cfg
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.setup_mesh(check_layout(cfg, world_size))
        self.setup_model(weights=weights)
        self.model.eval()


def _weights_loader(source: dict):
    """A function that fills a full model with the source's weights (safetensors only, no pickle)."""
    def load(model) -> None:
        import torch

        if "checkpoint" in source:
            from meshlm.checkpoint import load_weights

            load_weights(source["checkpoint"], model, checksums=False)  # verified by eval_config
        else:
            from meshlm.models.hf import load_pretrained

            state = load_pretrained(source["hf"]).state_dict()
            with torch.no_grad():
                model.load_state_dict(state)

    return load


def _eval_datasets(cfg: Config, tokenizer, *, whole: bool) -> tuple[list, str]:
    """(datasets, their description): every document of data.path given with --data (`whole`), else the validation
    split. Conversations (a .jsonl of "messages") as training reads them: the loss on the assistant's turns unless
    data.assistant_only_loss is false. Prepared folders (data.path, or each of data.sources) are opened as training
    opens them: their 'val' split, or with --data every split; checked against the tokenizer's tokenizer.json."""
    if cfg.data.prepared:
        return _prepared_datasets(cfg, tokenizer, whole=whole)
    from meshlm.data.text import split_source

    where = cfg.data.path or "the standard-library corpus"
    every, held_out, pack = split_source(cfg.data, seq_len=cfg.train.seq_len, tokenizer=tokenizer)
    if cfg.data.val_fraction > 0:
        where = f"the validation split of {where} (data.val_fraction={cfg.data.val_fraction:g})"
        return [pack(held_out)], where
    return [pack(every)], where


def _prepared_datasets(cfg: Config, tokenizer, *, whole: bool) -> tuple[list, str]:
    """Each prepared folder's 'val' split, or with `whole` every split, each evaluated whole and pooled by tokens (not
    by a blend's weights); refused when the model's tokenizer is not the one the folder was prepared with."""
    from meshlm.data import manifest
    from meshlm.data.dataset import PreparedDataset, check_prepared_chat
    from meshlm.files import sha256_file
    from meshlm.tokenizer import chat_config

    check_prepared_chat(cfg.data, chat_config(tokenizer), "the model's own",  # the template it serves with
                        "prepare them again with --tokenizer the model's folder (a checkpoint's step folder holds its "
                        "tokenizer and template)")
    out = []
    for folder in cfg.data.folders:
        m = manifest.read(Path(folder))
        mine = getattr(tokenizer, "path", None)
        if mine is None or sha256_file(Path(mine)) != m["tokenizer"]["sha256"]:
            raise ValueError(f"{folder} holds the tokens of {m['tokenizer']['path']}, and this model reads "
                             f"{mine or 'bytes'}; prepare the data with the model's tokenizer.json (a checkpoint "
                             "carries it) to evaluate it")
        if m["tokenizer"]["vocab_size"] > cfg.model.vocab_size:
            raise ValueError(f"{folder} was prepared with a vocabulary of {m['tokenizer']['vocab_size']} tokens, "
                             f"more than the model's {cfg.model.vocab_size}; prepare it with the model's tokenizer")
        if not whole and "val" not in m["splits"]:
            raise ValueError(f"{folder} holds no 'val' split (prepared without --val-fraction); evaluate all of it "
                             f"with --data {folder}, or prepare it again with --val-fraction F")
        out += [PreparedDataset(folder, seq_len=cfg.train.seq_len, split=split,
                                assistant_only=cfg.data.assistant_only_loss, whole=not cfg.data.split_across_samples)
                for split in (manifest.SPLITS if whole else ("val",)) if split in m["splits"]]
    what = "every split" if whole else "the 'val' split"
    return out, f"{what} of {', '.join(cfg.data.folders)} (prepared)"


def evaluate(*, checkpoint: str | None = None, hf: str | None = None, data: str | None = None,
             overrides: list[str] = (), prepared: tuple[Config, dict] | None = None) -> EvalResult:
    """Evaluate on this process, or as one rank of the default process group (every rank calls it;
    every rank gets the same result). `data` given: all of it; else the run's validation split.
    `prepared`: what `eval_config` returned for these arguments (it is not done twice)."""
    from meshlm.tokenizer import load_saved_tokenizer
    from meshlm.train.setup import load_training_tokenizer

    cfg, source = prepared or eval_config(checkpoint=checkpoint, hf=hf, data=data, overrides=overrides)
    if data is not None:
        cfg.data.val_fraction = 0.0  # a dataset given for evaluation is evaluated whole
    evaluator = Evaluator(cfg, weights=_weights_loader(source))
    saved = source.get("checkpoint")
    if saved is not None:  # the copies the run saved (listed in its manifest, verified), else data.tokenizer or bytes
        if cfg.data.prepared and "tokenizer.json" not in source["files"]:
            raise ValueError(f"{source['name']} was trained on bytes (its checkpoint holds no tokenizer.json), and "
                             f"{', '.join(cfg.data.folders)} holds a tokenizer's tokens; evaluate a text file or "
                             "folder with --data")
        tokenizer = load_saved_tokenizer(saved, source["files"], cfg.data.tokenizer)
    else:  # data.tokenizer (a HF folder's, with its chat template for conversations, as training takes it)
        tokenizer = load_training_tokenizer(cfg)
    datasets, where = _eval_datasets(cfg, tokenizer, whole=data is not None)
    batch = cfg.train.global_batch_size
    sizes = [len(dataset) for dataset in datasets]
    num_batches = sum(n // batch for n in sizes)
    if num_batches == 0:
        most = max(sizes, default=0)
        each = f" (the most in one split: {most})" if len(sizes) > 1 else ""
        fix = f"--set train.global_batch_size={most}" if most else "a smaller train.seq_len"
        raise ValueError(f"{where} gives {sum(sizes)} samples of {cfg.train.seq_len + 1} tokens{each}, fewer than "
                         f"one global batch (train.global_batch_size={batch}); use more data, or {fix}")
    totals = [evaluator.loss_totals(dataset, num_global_batches=n // batch)
              for dataset, n in zip(datasets, sizes) if n >= batch]  # every rank evaluates the same datasets
    loss_sum, tokens = sum(t[0] for t in totals), sum(t[1] for t in totals)
    if tokens == 0:
        raise ValueError(f"{where}: no target of its first {num_batches * batch} samples counts in the loss (no "
                         "assistant's turn in those conversations); evaluate other data, or --set "
                         "data.assistant_only_loss=false")
    loss = loss_sum / tokens
    return EvalResult(loss=loss, perplexity=math.exp(loss) if loss < 700 else math.inf,
                      samples=num_batches * batch, tokens=tokens, skipped_samples=sum(sizes) - num_batches * batch,
                      seq_len=cfg.train.seq_len, model=source["name"], step=source["step"], data=where,
                      world_size=evaluator.world_size, parts=len(sizes))


def format_result(r: EvalResult, *, as_json: bool) -> str:
    if as_json:
        return json.dumps(r.to_dict(), indent=1)
    step = f" (step {r.step})" if r.step is not None else ""
    ranks = f", {r.world_size} ranks" if r.world_size > 1 else ""
    tail = "the last" if r.parts == 1 else f"the ends of its {r.parts} splits:"
    skipped = (f"; {tail} {r.skipped_samples} samples (less than one global batch{' each' * (r.parts > 1)}) not "
               "evaluated" if r.skipped_samples else "")
    return (f"meshlm eval: {r.model}{step} on {r.data}: {r.samples} samples of {r.seq_len} tokens "
            f"({r.tokens:,} tokens){ranks}{skipped}\n"
            f"loss {r.loss:.4f}  perplexity {r.perplexity:.3f}")
