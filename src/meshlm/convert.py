"""`meshlm convert`: meshlm training checkpoints <-> Hugging Face model directories.

Responsible for:
  * `to_hf`: a meshlm checkpoint (a run directory, its `checkpoints/` folder or one `step_N/`; trained
    under any layout -- its `model_rank_*.safetensors` hold the full weights) -> a Hugging Face folder:
    `config.json` (model type chosen by `ModelConfig.to_hf_dict`: llama / qwen2 / qwen3 when dense,
    mixtral / qwen2_moe / qwen3_moe for MoE), `model.safetensors` (`meshlm.models.hf.save_pretrained`)
    and the checkpoint's `tokenizer.json` when it has one (with the chat template the run trained on
    conversations with, in `tokenizer_config.json`). Only safetensors and JSON are read.
  * `to_meshlm`: a Hugging Face folder -> a complete meshlm run directory holding a checkpoint at step 0
    (the weights, a fresh AdamW state, the data loader at its start, the tokenizer), written by the
    trainer itself (`Trainer.save` -> `save_checkpoint`), plus `RUN_DIR/config.toml` holding the run's
    full config, so `meshlm train --config RUN_DIR/config.toml --resume` fine-tunes from those weights.
  * refusing missing inputs, a non-empty output (unless `overwrite`), and models without an
    equivalent on the other side, with a ValueError of one line (the CLI prints it, exit 2).
Not responsible for: the name mapping and config mapping themselves (`meshlm.models.hf`,
`ModelConfig.from_hf_dict` / `to_hf_dict`), or downloading anything.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from meshlm.config_doc import toml_value
from meshlm.tokenizer import CHAT_CONFIG_FILE

# What a Hugging Face folder keeps of its tokenizer beside tokenizer.json (`HFTokenizer.from_dir` reads them; not
# generation_config.json, whose sampling defaults `meshlm serve` would then take for the run's)
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "chat_template.jinja")

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def _nonempty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _check_output(out: Path, *, overwrite: bool, inputs: list[Path], flag: str) -> None:
    """Refuse an output that is a file, holds something (unless `overwrite`), or that holds or lies inside
    an input (replacing it would delete the input)."""
    out_r = out.resolve()
    for path in inputs:
        in_r = path.resolve()
        if out_r == in_r or out_r in in_r.parents or in_r in out_r.parents:
            raise ValueError(f"{flag} {str(out)!r} overlaps the input {str(path)!r}; write to another directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {str(out)!r} is a file; give a directory")
    if _nonempty(out) and not overwrite:
        raise ValueError(f"{flag} {str(out)!r} is not empty; choose another directory or pass --overwrite "
                         "(which replaces what is there)")


# --------------------------------------------------------------------------------------------
# meshlm -> Hugging Face
# --------------------------------------------------------------------------------------------


def to_hf(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False,
          dtype: str | None = None) -> dict[str, Any]:
    """Write checkpoint `checkpoint` as a Hugging Face directory `out_dir`; return a summary dict.

    `dtype` (float32, bfloat16, float16; default: the dtype the checkpoint stores) is the dtype of the
    written weights. Raises ValueError (one line) for a missing input, a non-empty `out_dir` without
    `overwrite`, or a model no Hugging Face type expresses (naming the model field)."""
    import torch
    from safetensors import safe_open

    from meshlm.models import build_model
    from meshlm.models.hf import save_pretrained
    from meshlm.checkpoint import (config_from_dict, load_weights, read_meta, resolve_checkpoint,
                                         verify_checkpoint)

    src, out = Path(checkpoint), Path(out_dir)
    if not src.exists():
        raise ValueError(f"checkpoint {str(src)!r} does not exist; give a meshlm run directory or a step_N "
                         "checkpoint directory")
    if (src / "config.json").is_file() and not (src / "meta.json").is_file():
        raise ValueError(f"{str(src)!r} is a Hugging Face directory (config.json), not a meshlm checkpoint; "
                         "use --to-meshlm to convert it the other way")
    ckpt = resolve_checkpoint(src)
    _check_output(out, overwrite=overwrite, inputs=[src, ckpt], flag="--to-hf")
    listed = verify_checkpoint(ckpt)["files"]  # before anything is parsed
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"])
    model_cfg = cfg.model
    model_cfg.validate()
    hf_config = model_cfg.to_hf_dict()  # ConfigError naming the field when no HF type expresses it
    _check_router_biases(ckpt, model_cfg)
    notes = []
    if model_cfg.is_moe and model_cfg.capacity_factor > 0:
        notes.append(f"model.capacity_factor={model_cfg.capacity_factor}: Hugging Face MoEs are dropless; the "
                     "exported model equals this one run with model.capacity_factor=0")
    weight_files = sorted(n for n in listed if n.startswith("model_rank_") and n.endswith(".safetensors"))
    if not weight_files:
        raise ValueError(f"checkpoint {str(ckpt)!r} holds no model_rank_*.safetensors; it cannot be converted")
    if dtype is None:
        try:
            handle = safe_open(str(ckpt / weight_files[0]), framework="pt")
        except Exception:  # noqa: BLE001 -- safetensors' own error: load_weights below names the file
            stored = "F32"
        else:
            with handle as f:
                first = next(iter(f.keys()), None)
                stored = f.get_slice(first).get_dtype() if first is not None else "F32"
        dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}.get(stored, "float32")
    elif dtype not in _DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of float32, bfloat16, float16")
    torch_dtype = getattr(torch, _DTYPES.get(dtype, dtype))

    model = build_model(model_cfg, seed=cfg.train.seed)
    model = model.to(torch.float64 if torch_dtype == torch.float64 else torch.float32)
    load_weights(ckpt, model, checksums=False)  # verified just above
    model = model.to(torch_dtype).eval()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.convert-{os.getpid()}.tmp"  # filled, then renamed to OUT_DIR
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_pretrained(model, tmp)
        if "tokenizer.json" in listed:  # the copy the run saved (listed in, and verified by, the manifest)
            shutil.copyfile(ckpt / "tokenizer.json", tmp / "tokenizer.json")
            tokenizer = "tokenizer.json"
        elif not cfg.data.tokenizer and model_cfg.vocab_size >= 256:
            tokenizer = "bytes" if write_byte_tokenizer(tmp / "tokenizer.json") else None
            if tokenizer is None:
                notes.append("the run used meshlm's byte tokenizer (ids = UTF-8 bytes); no tokenizer.json was "
                             "written (that needs the `tokenizers` package)")
        else:
            tokenizer = None
            notes.append(f"the checkpoint holds no tokenizer.json (data.tokenizer={cfg.data.tokenizer!r}); "
                         "none was written")
        if tokenizer is not None:  # a plain fast tokenizer: the model type's own class may add a BOS
            # with the chat template (and its special tokens) the run trained with, where it saved one
            chat = json.loads((ckpt / CHAT_CONFIG_FILE).read_text()) if CHAT_CONFIG_FILE in listed else {}
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **chat},
                indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"from": str(ckpt), "to": str(out), "step": int(meta["step"]), "model_type": hf_config["model_type"],
            "architecture": hf_config["architectures"][0], "dtype": str(torch_dtype).removeprefix("torch."),
            "tokenizer": tokenizer, "notes": notes}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte, as the `tokenizers` ByteLevel pre-tokenizer uses."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def write_byte_tokenizer(path: Path) -> bool:
    """Write a tokenizer.json equal to meshlm's ByteTokenizer (token id = UTF-8 byte, no special tokens):
    byte-level BPE without merges. False when the `tokenizers` package is missing."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return True


def _check_router_biases(ckpt: Path, model_cfg) -> None:
    """Aux-loss-free balancing learns a per-expert selection bias (kept in the rank files, not the weights):
    Hugging Face routers have none, so a model whose biases moved has no equivalent there."""
    if model_cfg.router_bias_update_rate <= 0:
        return
    try:
        biases = json.loads((ckpt / "rank_00000.json").read_text()).get("router_bias") or {}
    except (OSError, ValueError, AttributeError):
        biases = {}
    if any(any(v != 0 for v in values) for values in biases.values()):
        raise ValueError(f"model.router_bias_update_rate={model_cfg.router_bias_update_rate}: the per-expert "
                         "selection biases this run learnt (aux-loss-free balancing) have no Hugging Face "
                         "equivalent; the exported routers would pick other experts")


# --------------------------------------------------------------------------------------------
# Hugging Face -> meshlm
# --------------------------------------------------------------------------------------------


def to_meshlm(hf_dir: str | Path, run_dir: str | Path, *, overwrite: bool = False,
              overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Write Hugging Face directory `hf_dir` as a meshlm run directory `run_dir`; return a summary dict.

    The run directory gets a complete checkpoint at step 0 (weights, fresh optimizer state, data loader
    at its start, the tokenizer.json when `hf_dir` has one, beside it `TOKENIZER_SIDE_FILES`: its chat template
    and end-of-turn ids, which training on conversations reads) and `config.toml`: the run's config with the
    model from `hf_dir`, `train.run_dir` = `run_dir`, and `overrides` (`section.field=value`, as for
    `meshlm train --set`; the data, seed and batch size fixed here must be the ones training resumes with).
    Continue with `meshlm train --config RUN_DIR/config.toml --resume`."""
    from meshlm.config import ModelConfig, load_config
    from meshlm.models.hf import load_pretrained

    src, out = Path(hf_dir), Path(run_dir)
    if not src.exists():
        raise ValueError(f"Hugging Face directory {str(src)!r} does not exist (downloads are not done here)")
    if not (src / "config.json").is_file():
        hint = (" (it is a meshlm checkpoint: use --to-hf to convert it the other way)"
                if (src / "meta.json").is_file() or (src / "checkpoints").is_dir() else "")
        raise ValueError(f"{str(src)!r} has no config.json; give a Hugging Face model directory{hint}")
    _check_output(out, overwrite=overwrite, inputs=[src], flag="--to-meshlm")
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.startswith("model."):
            raise ValueError(f"--set {item!r}: the model comes from {str(src)!r}'s config.json; only parallel, "
                             "train and data fields may be set")
        if key == "train.run_dir":
            raise ValueError(f"--set {item!r}: the run directory is the --to-meshlm argument")
    model_cfg = ModelConfig.from_hf(src)  # ConfigError naming the field for an unsupported model
    hf_model = load_pretrained(src)  # refuses missing / unexpected / misshapen tensors, naming them

    tokenizer_src = src / "tokenizer.json"
    user_keys = {item.partition("=")[0].strip() for item in overrides}
    cfg = load_config(None, [*overrides, f"train.run_dir={out.resolve()}"])  # absolute: config.toml works anywhere
    cfg.model = model_cfg
    if "train.seq_len" not in user_keys:
        cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    for name in ("path", "tokenizer"):  # absolute, so config.toml works from any working directory
        if getattr(cfg.data, name):
            setattr(cfg.data, name, str(Path(getattr(cfg.data, name)).resolve()))
    copy_tokenizer = tokenizer_src.is_file() and "data.tokenizer" not in user_keys
    if copy_tokenizer:
        cfg.data.tokenizer = str(tokenizer_src.resolve())  # for the checks below; the run's copy after them
    elif not cfg.data.tokenizer and model_cfg.vocab_size < 256:
        raise ValueError(f"{str(src)!r} has no tokenizer.json, and its vocab_size={model_cfg.vocab_size} is too "
                         "small for meshlm's byte tokenizer (256); add its tokenizer.json or --set data.tokenizer")
    cfg.validate()

    from meshlm.train.trainer import Trainer

    fresh = not _nonempty(out)  # on failure, remove what this call wrote (an earlier run's files are kept)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if copy_tokenizer:  # the run reads its own copy: RUN_DIR stands alone
            shutil.copyfile(tokenizer_src, out / "tokenizer.json")
            for name in TOKENIZER_SIDE_FILES:  # its chat template and end-of-turn ids, for fine-tuning on chats
                if (src / name).is_file():
                    shutil.copyfile(src / name, out / name)
            cfg.data.tokenizer = str((out / "tokenizer.json").resolve())
        trainer = Trainer(cfg, resume=False, overwrite=overwrite)
        import torch

        with torch.no_grad():
            state = hf_model.state_dict()
            for name, p in trainer.base_model.state_dict().items():
                p.copy_(state[name].to(device=p.device, dtype=p.dtype))
        ckpt = trainer.save()
        (out / "config.toml").write_text(config_toml(cfg))
    except BaseException:
        if fresh:
            for child in out.iterdir() if out.is_dir() else []:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        raise
    return {"from": str(src), "to": str(out), "checkpoint": str(ckpt), "config": str(out / "config.toml"),
            "tokenizer": cfg.data.tokenizer or "bytes", "model_type": json.loads(
                (src / "config.json").read_text()).get("model_type")}


def config_toml(cfg) -> str:
    """`cfg` as a TOML file `load_config` reads back to the same config (None fields left at their default)."""
    lines = ["# Written by `meshlm convert --to-meshlm`. Continue training with:",
             "#   meshlm train --config <this file> --resume",
             "# (the data, train.seed and train.global_batch_size must stay as they are: the checkpoint's",
             "#  data loader position refers to them; model fields must match the checkpoint)", ""]
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if section == "model" and key == "preset":
                value = ""  # not a preset: every field below
            if value is None:
                continue
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


