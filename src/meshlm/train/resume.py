"""The trainer's side of checkpoints: the run directory it owns, what it saves beside the weights, resuming.

Responsible for: checking the run directory on every rank before any work (each rank hashes its share of
a resumed checkpoint, every rank raises the same refusal), creating it and clearing an earlier run's files
from it for a fresh run (in checkpoints/ only what meshlm wrote); the per-rank extras a checkpoint carries
beside model and optimizer (RNG, the loader's position, the first validation loss, MoE router biases) and restoring them; the config's
optimizer settings over a checkpoint's; the notes a resume prints (another layout, changed optimizer
settings) and how far a restarted run had got (`last_logged_step`); `CheckpointWriter`, which keeps at most
one checkpoint being written in the background.
Not responsible for: the checkpoint format, verifying, writing or reading it (`meshlm.checkpoint`), or
when to save (the trainer's loop).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch import nn

from meshlm.checkpoint import (
    CheckpointError,
    begin_save,
    check_run_dir,
    checkpoints_root,
    finish_save,
    meshlm_entries,
    rng_state,
    set_rng_state,
)
from meshlm.config import Config, TrainConfig
from meshlm.dims import ParallelDims
from meshlm.mesh import Mesh
from meshlm.parallel.expert import router_biases, set_router_biases
from meshlm.data.text import BatchLoader
from meshlm.train.metrics import remove_tracker_files


# -- the run directory --------------------------------------------------------------------------
def check_run_dir_on_every_rank(run_dir: str, *, resume: bool, overwrite: bool, world_size: int) -> None:
    """`checkpoint.check_run_dir` with the checksums of a resumed checkpoint shared out: each rank hashes
    1/world of its files and every rank raises the first rank's refusal (collective)."""
    if world_size == 1:
        return check_run_dir(run_dir, resume=resume, overwrite=overwrite)
    error = None
    try:
        check_run_dir(run_dir, resume=resume, overwrite=overwrite, checksums=(dist.get_rank(), world_size))
    except CheckpointError as e:
        error = str(e)
    errors: list[str | None] = [None] * world_size
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def make_run_dir(run_dir: str) -> None:
    """Create `train.run_dir` (rank 0), or refuse naming it."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"train.run_dir={run_dir!r} cannot be created ({e.strerror}); "
                         "choose a writable directory") from None


def clear_run_dir(run_dir: Path) -> None:
    """A fresh run owns its run_dir (with overwrite=True when an earlier run left checkpoints there): the
    earlier run's checkpoints, metrics and tracker files go (rank 0). Only what meshlm wrote in checkpoints/
    (`meshlm_entries`): `check_run_dir` refused, naming them, if anything else is there."""
    own = meshlm_entries(checkpoints_root(run_dir))
    if own:
        print(f"meshlm: starting afresh in {run_dir}: deleting the checkpoints of an earlier run "
              "there (--overwrite)", flush=True)
    for entry in own:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    remove_tracker_files(run_dir)


def last_logged_step(run_dir: str | Path) -> int:
    """The last training step metrics.jsonl recorded (0 when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    last = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by the failure
                continue
            if "loss" in row:
                last = max(last, int(row["step"]))
    return last


# -- what a checkpoint carries beside model and optimizer ---------------------------------------
def rank_extra(loader: BatchLoader, model: nn.Module, *, first_val_loss: float | None) -> dict:
    """This rank's state that resuming needs beside weights and optimizer."""
    return {"rng": rng_state(), "loader": loader.state_dict(), "first_val_loss": first_val_loss,
            "router_bias": router_biases(model)}


def restore_rank_extra(extra: dict, loader: BatchLoader, model: nn.Module) -> float | None:
    """Put `rank_extra`'s state back; returns the run's first validation loss."""
    loader.load_state_dict(extra["loader"])
    set_rng_state(extra["rng"])
    first_val_loss = extra.get("first_val_loss")
    set_router_biases(model, extra.get("router_bias", {}))
    return first_val_loss


def use_config_optimizer_settings(optimizer, t: TrainConfig) -> str | None:
    """The optimizer's state dict carries its hyperparameters; the config is what the user asks for now
    (the learning rate is set every step anyway). Returns a note naming what changed, or None."""
    changed = set()
    for group in optimizer.param_groups:
        for key, now in (("betas", (t.beta1, t.beta2)), ("eps", t.eps)):
            current = tuple(group[key]) if key == "betas" else group[key]
            if current != now:
                changed.add(f"{key} {current} -> {now}")
                group[key] = now
    if not changed:
        return None
    return "optimizer settings differ from the checkpoint's; using the config's: " + ", ".join(sorted(changed))


def _degrees(dims: ParallelDims) -> str:
    """`tp=2, dp_shard=2`: the degrees above 1 of a resolved layout."""
    return ", ".join(f"{a}={getattr(dims, a)}" for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                     if getattr(dims, a) > 1) or "one process"


def layout_change_note(saved: ParallelDims, now: ParallelDims, world_size: int) -> str:
    """What a resume under another layout than the checkpoint's prints."""
    ranks = "1 process" if saved.world_size == 1 else f"{saved.world_size} ranks"
    return (f"the checkpoint was saved by {ranks} ({_degrees(saved)}), this "
            f"run has {world_size} ({_degrees(now)}): continuing from the "
            "global data position (not bit-identical)")


# -- writing ------------------------------------------------------------------------------------
class CheckpointWriter:
    """Saves a run's checkpoints through `meshlm.checkpoint`, at most one in flight: an asynchronous save
    (train.async_checkpoint) is staged and written in the background, and published by the next save or
    `finish`."""

    def __init__(self, run_dir: Path, *, config: Config, rank: int, world_size: int, mesh: Mesh,
                 barrier: Callable[[], None], files: dict[str, Path] | None):
        self.run_dir, self.config, self.files = run_dir, config, files
        self.rank, self.world_size, self.mesh, self.barrier = rank, world_size, mesh, barrier
        self.pending = None  # a checkpoint staged and being written in the background
        self.group = None  # the process group of that background writing, made on first use

    def save(self, *, step: int, model: nn.Module, optimizer, rank_extra: dict, asynchronous: bool) -> Path:
        """Checkpoint `step` (collective); the path it is (or, asynchronously, will be) published at."""
        self.finish()
        if asynchronous and self.group is None and self.world_size > 1:
            # DCP's background writer coordinates the ranks on a group of its own, never the training's.
            self.group = dist.new_group(backend="gloo")
        pending = begin_save(self.run_dir, step=step, model=model, optimizer=optimizer, config=self.config,
                             rank_extra=rank_extra, rank=self.rank, world_size=self.world_size,
                             keep=self.config.train.keep_checkpoints, barrier=self.barrier, files=self.files,
                             mesh=self.mesh, asynchronous=asynchronous, async_group=self.group)
        if asynchronous:
            self.pending = pending
            return pending.final
        return finish_save(pending)

    def finish(self) -> None:
        """Wait for the checkpoint being written in the background (if any) and publish it (collective)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            finish_save(pending)
