"""Saving a checkpoint: every rank writes its pieces, rank 0 publishes atomically and durably.

Responsible for: the per-rank extras (RNG states), `save_checkpoint` and its two halves for saving in the
background (`begin_save` stages this rank's pieces on the host and writes them in a thread; `finish_save`
waits and publishes), the safetensors copy of the weights written in pieces, fsyncs, the manifest written
last, the rename of `step_N.tmp/` to `step_N/`, the atomic replacement of `latest`, then pruning.
Not responsible for: which pieces a rank holds (`checkpoint/shards.py`) or when to save (the trainer).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from meshlm.checkpoint.find import (
    FORMAT_VERSION,
    MANIFEST,
    META,
    PIECES,
    checkpoint_dir_name,
    checkpoints_root,
    complete_checkpoints,
    describe_files,
    one_line,
    peer_failed,
)
from meshlm.checkpoint.shards import (
    Piece,
    ShardedState,
    assign_writers,
    checkpoint_state,
    piece_name,
    weight_pieces,
)
from meshlm.config import Config
from meshlm.files import fsync_dir, fsync_file, write_atomic


def rng_state() -> dict:
    """This process's RNG states as plain JSON data (lists of ints): a rank file never holds a pickle."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(words), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this rank's device only: a resume may see fewer
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def save_checkpoint(run_dir: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: Config, rank_extra: dict, rank: int = 0, world_size: int = 1, keep: int = 2,
                    barrier: Callable[[], None] = lambda: None, files: dict[str, Path | str] | None = None,
                    mesh=None) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it; return its directory.

    `rank_extra` (RNG states, loader position, ...: plain JSON data) goes to this rank's own file. With
    several ranks every rank calls this (DCP's save is collective) and passes a `barrier` so rank 0
    publishes only after all ranks have written. `files` are copied in by rank 0 (e.g. the
    tokenizer.json, so the checkpoint is self-contained; a str is the file's text, e.g. the chat template).
    `mesh` is needed when the model is sharded (tensor/expert parallel: it places the shards in the full tensors).

    Durability: every rank fsyncs the files it wrote and records their sizes and checksums; after a
    barrier rank 0 merges those into `manifest.json`, written last, fsyncs, renames `step_N.tmp` to
    `step_N` and only then replaces `latest` (atomically) and prunes older checkpoints -- the one
    `latest` names is never removed before its successor is published.
    """
    return finish_save(begin_save(run_dir, step=step, model=model, optimizer=optimizer, config=config,
                                  rank_extra=rank_extra, rank=rank, world_size=world_size, keep=keep,
                                  barrier=barrier, files=files, mesh=mesh))


@dataclass
class PendingSave:
    """A checkpoint whose state is captured (staged in CPU memory when asynchronous) but not yet published."""

    tmp: Path
    final: Path
    rank: int
    world_size: int
    keep: int
    barrier: Callable[[], None]
    meta: dict
    files: dict[str, Path | str]  # a file to copy, or a text to write
    rank_extra: dict
    writes: list = field(default_factory=list)  # what is still writing: DCP's future, the weights' thread


def begin_save(run_dir: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               config: Config, rank_extra: dict, rank: int = 0, world_size: int = 1, keep: int = 2,
               barrier: Callable[[], None] = lambda: None, files: dict[str, Path | str] | None = None, mesh=None,
               async_group=None, asynchronous: bool = False) -> PendingSave:
    """The first half of `save_checkpoint` (collective): capture the state and start writing it.

    `asynchronous=True` copies this rank's pieces to CPU memory and writes them from a thread (DCP's save,
    its coordination on `async_group`, a process group of its own, so the training's collectives go on
    meanwhile; then the weights' safetensors); training may change the model as soon as this returns.
    `finish_save` waits for the writes and publishes."""
    root = checkpoints_root(run_dir)
    final = root / checkpoint_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier attempt at this step
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "config": config.to_dict()}
    pending = PendingSave(tmp=tmp, final=final, rank=rank, world_size=world_size, keep=keep,
                          barrier=barrier, meta=meta, files=dict(files or {}), rank_extra=rank_extra)
    state = checkpoint_state(model, optimizer, mesh, saving=True)  # this rank's pieces, views of the live tensors
    if asynchronous:
        # Staged: CPU copies of this rank's pieces (its shard, never a full tensor), then written by a
        # thread while training goes on; DCP's coordination runs on `async_group`, not the training's groups.
        state = _staged(state)
        copied = torch.cuda.Event() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        if copied is not None:
            copied.record()  # the writer thread waits for this point of the training stream, nothing later
    weights = _my_weights(state["model"], rank=rank)
    if asynchronous:
        one_process = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshlm-save")
        pending.writes.append(writer.submit(_write, state, weights, tmp, rank, group=async_group, no_dist=one_process,
                                            copied=copied))
        writer.shutdown(wait=False)  # its errors surface in finish_save
    else:
        _write(state, weights, tmp, rank)
    return pending


def finish_save(pending: PendingSave) -> Path:
    """The second half of `save_checkpoint` (collective): wait for the writes, fsync, manifest, publish."""
    p = pending
    for write in p.writes:
        write.result()
    mine = [p.tmp / f"rank_{p.rank:05d}.json"]
    mine[0].write_text(json.dumps(p.rank_extra))
    mine += sorted(p.tmp.glob(f"model_rank_{p.rank:05d}.safetensors"))
    mine += sorted(p.tmp.glob(f"__{p.rank}_*.distcp"))  # DCP's data files of this rank
    for f in mine:
        fsync_file(f)
    part = p.tmp / f"manifest_{p.rank:05d}.part"
    part.write_text(json.dumps(describe_files(mine)))
    fsync_file(part)
    if p.rank == 0:
        (p.tmp / META).write_text(json.dumps(p.meta, indent=1))
        for name, src in p.files.items():
            if isinstance(src, str):
                (p.tmp / name).write_text(src)
            else:
                shutil.copyfile(src, p.tmp / name)
    p.barrier()
    if p.rank == 0:
        _publish(p.tmp, p.final, world_size=p.world_size, keep=p.keep)
    p.barrier()
    return p.final


def _publish(tmp: Path, final: Path, *, world_size: int, keep: int) -> None:
    """Rank 0, after every rank wrote: the manifest, then the rename, then `latest`, then pruning."""
    root = final.parent
    files: dict[str, list] = {}
    parts = sorted(tmp.glob("manifest_*.part"))
    assert len(parts) == world_size, f"{len(parts)} manifest parts for {world_size} ranks"
    for part in parts:
        files.update(json.loads(part.read_text()))
        part.unlink()
    rest = [p for p in sorted(tmp.iterdir()) if p.is_file() and p.name not in files]  # meta, .metadata, tokenizer
    for p in rest:
        fsync_file(p)
    files.update(describe_files(rest))
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT_VERSION, "world_size": world_size, "files": files}, indent=1))
    fsync_file(manifest)
    fsync_dir(tmp)
    # Re-saving a step: set the old copy aside, and delete it only once `latest` names the new one. (A crash
    # between the two renames leaves the old copy in step_N.old, which --resume does not pick up; the trainer
    # re-saves a step only after resuming from an earlier one, so `latest` never names a complete old copy.)
    aside = root / f"{final.name}.old"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(root)
    write_atomic(root / "latest", final.name)
    shutil.rmtree(aside, ignore_errors=True)  # also one a crash left behind
    _prune(root, keep=keep, protect=final)


def _my_weights(state_model: dict, *, rank: int) -> dict[str, tuple[torch.Tensor, dict | None]]:
    """The pieces of the weights this rank writes to its safetensors file (name -> (tensor, where)): each
    piece that several ranks hold (replicas) is written by one of them (collective over the world)."""
    import torch.distributed as dist

    pieces = weight_pieces(state_model)
    everyone = [list(pieces)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(pieces))
    out = {}
    for key, shape, piece in assign_writers(pieces, everyone, rank if len(everyone) > 1 else 0):
        name = piece_name(key, shape, piece)
        where = None if name == key else {"key": key, "offsets": list(piece.offsets), "shape": list(shape)}
        out[name] = (piece.tensor, where)
    return out


def _staged(tree):
    """A copy of a `checkpoint_state` with every piece copied to CPU memory (asynchronous save). From a GPU the
    copies go into pinned memory without blocking the training thread; `_write` waits for them (a CUDA event)."""
    if isinstance(tree, ShardedState):
        return ShardedState(tree.shape, [Piece(p.offsets, _host_copy(p.tensor)) for p in tree.pieces],
                            dtype=tree.dtype, device=torch.device("cpu"))
    if isinstance(tree, dict):
        return {k: _staged(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_staged(v) for v in tree]
    return _host_copy(tree) if torch.is_tensor(tree) else tree


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.detach().to("cpu", copy=True)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t.detach(), non_blocking=True)


def _write(state: dict, weights: dict, tmp: Path, rank: int, *, group=None, no_dist: bool = False,
           copied=None) -> None:
    """DCP's files of this rank's pieces (collective over `group`), then its safetensors of the weights.
    `copied`: a CUDA event after the staging copies, waited for first."""
    if copied is not None:
        copied.synchronize()
    import time

    from meshlm.comm import CollectiveError

    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.save(state, checkpoint_id=tmp, process_group=group, no_dist=no_dist)
    # DCP gathers its plans over the world; a peer that died or stopped fails it (after the process group's
    # timeout, parallel.collective_timeout_s), wrapped in CheckpointException, a BaseException subclass.
    except (Exception, CheckpointException) as e:
        if not peer_failed(e):  # this rank's own failure (a full disk, ...): as it is
            raise
        raise CollectiveError(f"rank {rank}: saving checkpoint {tmp.name} (torch.distributed.checkpoint, over every "
                              f"rank) failed after {time.perf_counter() - start:.1f} s: {one_line(e, 160)} -- a peer "
                              "rank stopped, died or diverged (parallel.collective_timeout_s bounds the wait)") from e
    if weights:
        # One file per rank; pieces of one flat ZeRO shard share its storage, which safetensors refuses: copies.
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, (t, _) in weights.items()}
        where = {name: w for name, (_, w) in weights.items() if w is not None}
        save_file(tensors, str(tmp / f"model_rank_{rank:05d}.safetensors"),
                  metadata={PIECES: json.dumps(where)} if where else None)


def _prune(root: Path, *, keep: int, protect: Path) -> None:
    complete = complete_checkpoints(root)
    for old in complete[:-keep] if keep > 0 else []:
        if old != protect:
            shutil.rmtree(old, ignore_errors=True)
