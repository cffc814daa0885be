"""Checkpoints of a training run: atomic, resumable bit-identically, loadable for inference.

Responsible for: saving model + optimizer state with `torch.distributed.checkpoint` (DCP; it needs no
process group on one process and reshards under another layout when there is one), a `meta.json`
(step, the config as a dict), one `rank_XXXXX.pt` per rank with that rank's extras (RNG states, data
loader position; which rank's file to read after a change of world size is the trainer's call);
atomic publication (write `step_N.tmp/`, fsync, rename to `step_N/`, then atomically replace the
`latest` pointer); keeping the last `keep` checkpoints; refusing a checkpoint
whose model config differs; and loading a model alone for generation.
Not responsible for: deciding when to save (the trainer), or Hugging Face formats (`models/hf.py`).

The optimizer state is always stored in the per-parameter layout of an unsharded AdamW: a ZeRO
optimizer gathers its shards on save and takes its own shard on load (`meshlm.parallel.zero`), so a
checkpoint moves between zero stages and data-parallel sizes. Likewise under tensor parallelism
(parameters tagged `_meshlm_shard`, see `meshlm.parallel.tensor`) the parameters and their AdamW
moments are gathered over their mesh axis to the full tensors on save and sliced back on load, so a
checkpoint saved at one tp degree loads at any other (tp=1 in one process included).

With several ranks every rank calls `save_checkpoint` (DCP's save is collective over the default
process group; a replicated tensor is written once), all into the same directory, so a multi-node
run needs a shared filesystem for `run_dir`; rank 0 alone publishes, after a barrier.

Layout::

    <run_dir>/checkpoints/latest            text file: "step_000123"
    <run_dir>/checkpoints/step_000123/      .metadata + *.distcp (DCP), meta.json, rank_00000.pt, ...
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from meshlm.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from meshlm.mesh import ParallelDims

FORMAT_VERSION = 1
_META = "meta.json"


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


# --------------------------------------------------------------------------------------------
# RNG state (per rank)
# --------------------------------------------------------------------------------------------


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint the `latest` pointer names, or None when the run has none yet.

    Only the pointer counts: a `step_N.tmp/` left by a crash, or a renamed directory whose pointer
    update did not happen, is never picked up.
    """
    root = checkpoints_root(run_dir)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not _is_complete(path):
        raise ValueError(f"{pointer} names {name!r}, which is not a complete checkpoint; delete the pointer "
                         f"or point it at one of {sorted(p.name for p in _complete_checkpoints(root))}")
    return path


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory, its `checkpoints/` folder, or the checkpoint itself."""
    path = Path(path)
    if (path / _META).exists():
        return path
    for run_dir in (path, path.parent if path.name == "checkpoints" else None):
        if run_dir is not None and (checkpoints_root(run_dir) / "latest").exists():
            return latest_checkpoint(run_dir)
    raise ValueError(f"no checkpoint at {str(path)!r}: expected a run directory (with checkpoints/latest), "
                     f"its checkpoints/ folder, or a step_N checkpoint directory (with {_META})")


def _is_complete(path: Path) -> bool:
    """A published checkpoint: a step_N name (never step_N.tmp) holding both DCP metadata and meta.json."""
    return (re.fullmatch(r"step_\d+", path.name) is not None and (path / _META).is_file()
            and (path / ".metadata").is_file())


def _complete_checkpoints(root: Path) -> list[Path]:
    """Oldest first, by step number (as names, step_1000000 would sort before step_999999)."""
    return sorted((p for p in root.glob("step_*") if _is_complete(p)), key=lambda p: int(p.name[len("step_"):]))


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------


def save_checkpoint(run_dir: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: Config, rank_extra: dict, rank: int = 0, keep: int = 2,
                    barrier: Callable[[], None] = lambda: None, files: dict[str, Path] | None = None,
                    mesh=None) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it; return its directory.

    `rank_extra` (RNG states, loader position, ...) goes to this rank's own file. With several
    ranks every rank calls this (DCP's save is collective) and passes a `barrier` so rank 0
    publishes only after all ranks have written. `files` are copied in by rank 0 (e.g. the
    tokenizer.json, so the checkpoint is self-contained). `mesh` is needed when the model is tensor
    parallel (its shards are gathered over it, collectively).
    """
    root = checkpoints_root(run_dir)
    final = root / checkpoint_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier attempt at this step
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    with _full_params(optimizer):
        model_sd, optim_sd = _state_dicts(model, optimizer)
        if _shards(model):
            model_sd, optim_sd = _gather_shards(model, mesh, model_sd, optim_sd)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    torch.save(rank_extra, tmp / f"rank_{rank:05d}.pt")
    if rank == 0:
        meta = {"format": FORMAT_VERSION, "step": step, "config": config.to_dict()}
        (tmp / _META).write_text(json.dumps(meta, indent=1))
        for name, src in (files or {}).items():
            shutil.copyfile(src, tmp / name)
    barrier()
    if rank == 0:
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / "latest", final.name)
        _prune(root, keep=keep, protect=final)
    barrier()
    return final


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state in the per-parameter layout of an unsharded AdamW.

    A ZeRO optimizer (`meshlm.parallel.zero.ZeroAdamW`) gathers its shards into that layout
    (`full_state_dict`, collective) so the checkpoint loads under any zero stage and dp size.
    """
    if hasattr(optimizer, "full_state_dict"):
        return get_model_state_dict(model), optimizer.full_state_dict()
    return get_state_dict(model, optimizer)


def _shards(model: nn.Module) -> dict[str, tuple[str, int]]:
    """State-dict key -> (mesh axis, dim) of every tensor-parallel shard (empty for an unsharded model)."""
    return {k: t._meshlm_shard for k, t in model.state_dict(keep_vars=True).items()
            if getattr(t, "_meshlm_shard", None) is not None}


def _copy_optim(optim_sd: dict) -> dict:
    """A copy down to the per-parameter dicts: those of `get_state_dict` are the optimizer's live state."""
    return {**optim_sd, "state": {fqn: dict(v) for fqn, v in optim_sd.get("state", {}).items()}}


def _optim_items(optim_sd: dict, shards: dict[str, tuple[str, int]]):
    """(state dict of one parameter, key, (axis, dim)) for every sharded moment tensor of an AdamW state dict."""
    for fqn, per_param in optim_sd.get("state", {}).items():
        if fqn in shards:
            for key, value in per_param.items():
                if torch.is_tensor(value) and value.dim() > 0:  # exp_avg, exp_avg_sq; not the scalar step
                    yield per_param, key, shards[fqn]


@torch.no_grad()
def _gather_shards(model: nn.Module, mesh, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """Model and optimizer state dicts with every tensor-parallel shard replaced by the full tensor (collective)."""
    from meshlm import comm

    assert mesh is not None, "a tensor-parallel model needs the mesh to save or load a checkpoint"
    shards = _shards(model)
    model_sd, optim_sd = dict(model_sd), _copy_optim(optim_sd)
    for key, (axis, dim) in shards.items():
        if key in model_sd:
            model_sd[key] = comm.all_gather(model_sd[key].detach().contiguous(), mesh, axis, dim=dim).clone()
    for per_param, key, (axis, dim) in _optim_items(optim_sd, shards):
        per_param[key] = comm.all_gather(per_param[key].contiguous(), mesh, axis, dim=dim).clone()
    return model_sd, optim_sd


def _full_placeholders(model: nn.Module, mesh, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """Full-shape tensors for DCP to load into, in place of this rank's shards (no communication)."""
    shards = _shards(model)

    def full(t: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] *= mesh.size(axis)
        return torch.empty(shape, dtype=t.dtype, device=t.device)

    model_sd, optim_sd = dict(model_sd), _copy_optim(optim_sd)
    for key, (axis, dim) in shards.items():
        if key in model_sd:
            model_sd[key] = full(model_sd[key], axis, dim)
    for per_param, key, (axis, dim) in _optim_items(optim_sd, shards):
        per_param[key] = full(per_param[key], axis, dim)
    return model_sd, optim_sd


def _slice_shards(model: nn.Module, mesh, model_sd: dict, optim_sd: dict) -> None:
    """Replace the loaded full tensors by this rank's shards, in place (no communication)."""
    shards = _shards(model)

    def mine(t: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
        return t.chunk(mesh.size(axis), dim=dim)[mesh.local_rank(axis)].clone()

    for key, (axis, dim) in shards.items():
        if key in model_sd:
            model_sd[key] = mine(model_sd[key], axis, dim)
    for per_param, key, (axis, dim) in _optim_items(optim_sd, shards):
        per_param[key] = mine(per_param[key], axis, dim)


def _full_params(optimizer: torch.optim.Optimizer | None):
    """ZeRO-3 frees the full parameters between uses: hold them for the duration of a save or load."""
    zero = getattr(optimizer, "zero", None)
    return zero.full_params() if zero is not None else contextlib.nullcontext()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
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


def _prune(root: Path, *, keep: int, protect: Path) -> None:
    complete = _complete_checkpoints(root)
    for old in complete[:-keep] if keep > 0 else []:
        if old != protect:
            shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------


def saved_world_size(path: str | Path) -> int:
    """How many ranks saved checkpoint `path` (one `rank_XXXXX.pt` each)."""
    return len(list(Path(path).glob("rank_*.pt")))


def saved_layout(path: str | Path) -> ParallelDims:
    """The parallel degrees checkpoint `path` was saved under (its config, resolved against its ranks)."""
    parallel = config_from_dict(read_meta(path)["config"]).parallel
    return ParallelDims.from_config(parallel).resolve(saved_world_size(path))


def read_meta(path: str | Path) -> dict:
    path = Path(path)
    try:
        meta = json.loads((path / _META).read_text())
    except FileNotFoundError:
        raise ValueError(f"{str(path)!r} is not a checkpoint (no {_META}); pass a step_N directory "
                         "or a run directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt: {_META} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT_VERSION or "config" not in meta or "step" not in meta:
        raise ValueError(f"checkpoint {str(path)!r} has an unknown format {meta.get('format')!r} "
                         f"(this meshlm reads format {FORMAT_VERSION})")
    if not (path / ".metadata").exists():
        raise ValueError(f"checkpoint {str(path)!r} is corrupt: the DCP .metadata file is missing")
    return meta


def config_from_dict(d: dict) -> Config:
    """Rebuild a `Config` from `Config.to_dict()` (as stored in a checkpoint), not re-validating data paths."""
    def pick(cls, values):
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in (values or {}).items() if k in names})

    return Config(model=pick(ModelConfig, d.get("model")), parallel=pick(ParallelConfig, d.get("parallel")),
                  train=pick(TrainConfig, d.get("train")), data=pick(DataConfig, d.get("data")))


def check_model_config(saved: dict, current: ModelConfig, *, where: str) -> None:
    """Raise ValueError naming every model field whose value differs from the checkpoint's."""
    now = json.loads(json.dumps(current.__dict__))
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
             for k in sorted(set(saved) | set(now)) if k != "preset" and saved.get(k) != now.get(k)]
    if diffs:
        raise ValueError(f"checkpoint {where} was trained with a different model config: " + "; ".join(diffs)
                         + ". Use the checkpoint's model settings or start a new run_dir.")


def _dcp_load(state: dict, path: Path) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.load(state, checkpoint_id=path)
    # DCP wraps reader failures in CheckpointException, a BaseException subclass, so name it.
    except (Exception, CheckpointException) as e:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt or incomplete and cannot be loaded: "
                         f"{type(e).__name__}: {str(e)[:300]}") from e


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    config: Config, rank: int = 0, mesh=None) -> dict:
    """Load model (+ optimizer) state in place; return {"step", "config", "rank_extra"}.

    A tensor-parallel model (see `save_checkpoint`) needs `mesh`; it loads the full tensors and keeps
    its own slices."""
    path = Path(path)
    meta = read_meta(path)
    check_model_config(meta["config"].get("model", {}), config.model, where=str(path))
    if optimizer is not None and hasattr(optimizer, "load_full_state_dict"):
        with _full_params(optimizer):
            model_sd, optim_sd = _state_dicts(model, optimizer)
            if _shards(model):  # ZeRO over tensor-parallel shards: load full tensors, keep this rank's slices
                assert mesh is not None, "a tensor-parallel model needs the mesh to load a checkpoint"
                model_sd, optim_sd = _full_placeholders(model, mesh, model_sd, optim_sd)
            state = {"model": model_sd, "optim": optim_sd}
            _dcp_load(state, path)
            if _shards(model):
                _slice_shards(model, mesh, state["model"], state["optim"])
            set_model_state_dict(model, state["model"])
            optimizer.load_full_state_dict(state["optim"])  # after the model: it re-reads the master shard
    elif optimizer is not None and _shards(model):
        assert mesh is not None, "a tensor-parallel model needs the mesh to load a checkpoint"
        model_sd, optim_sd = _full_placeholders(model, mesh, *get_state_dict(model, optimizer))
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path)
        _slice_shards(model, mesh, state["model"], state["optim"])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    elif optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = {"model": get_model_state_dict(model)}
        _dcp_load(state, path)
        set_model_state_dict(model, state["model"])
    rank_file = path / f"rank_{rank:05d}.pt"
    if not rank_file.exists():
        raise ValueError(f"checkpoint {str(path)!r} has no {rank_file.name}; it was saved by fewer ranks "
                         "(the RNG and data position of this rank are unknown)")
    try:
        rank_extra = torch.load(rank_file, weights_only=False)  # our own file: RNG states hold numpy arrays
    except Exception as e:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt: {rank_file.name} cannot be read ({e})") from e
    return {"step": int(meta["step"]), "config": meta["config"], "rank_extra": rank_extra}


def load_checkpoint_for_inference(path: str | Path, *, device: str | torch.device = "cpu",
                                  dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Config, Any]:
    """(model in eval mode, config, tokenizer) from a run directory or a checkpoint; no optimizer state."""
    from meshlm.models import build_model
    from meshlm.train.data import ByteTokenizer, HFTokenizer

    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"])
    model = build_model(cfg.model, seed=cfg.train.seed)
    load_checkpoint(ckpt, model=model, optimizer=None, config=cfg)
    if (ckpt / "tokenizer.json").exists():
        tokenizer = HFTokenizer(ckpt / "tokenizer.json")
    elif cfg.data.tokenizer:
        tokenizer = HFTokenizer(cfg.data.tokenizer)
    else:
        tokenizer = ByteTokenizer()
    return model.to(device=device, dtype=dtype).eval(), cfg, tokenizer
