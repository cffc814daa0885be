"""Checkpoints of a training run: atomic, verified, resumable bit-identically, loadable for inference.

Responsible for: saving model + optimizer state with `torch.distributed.checkpoint` (DCP; it needs no
process group on one process and reshards under another layout when there is one), the weights again
as safetensors (what inference reads), a `meta.json` (format, step, world size, the config as a dict),
one `rank_XXXXX.json` per rank with that rank's extras (RNG states, data loader position: plain JSON;
which rank's file to read after a change of layout is the trainer's call), and `manifest.json`, written
last: the size and sha256 of every file. Publication is atomic and durable (every rank fsyncs what it
wrote; rank 0 writes the manifest, renames `step_N.tmp/` to `step_N/`, then atomically replaces the
`latest` pointer, and only then prunes, keeping the last `keep`). Loading verifies the manifest before
anything is parsed and refuses a damaged, incomplete or mismatched checkpoint (or a model config that
differs) with one line naming the file and the fix; `--resume` falls back to the newest complete
checkpoint when `latest` is damaged (`resume_checkpoint`), and `meshlm train --resume` checks all of that
before it starts any rank (`check_run_dir`), and each rank once more before it reads anything (checksums
cost a read of the checkpoint per check; `checksums=False` where the caller has just verified).
Not responsible for: deciding when to save or whether a run_dir may be reused (the trainer), or Hugging
Face formats (`models/hf.py`).

Nothing in a checkpoint runs code on inference: `generate`, `serve` and `LLM` read meta.json, the
manifest and the safetensors only. Resuming reads DCP's `.metadata`, which is a pickle, and only after
its checksum matched: that guards against damage, not against a crafted checkpoint -- resume only runs
you trust.

The state is always stored in the per-parameter layout of one unsharded model and `torch.optim.AdamW`,
and every rank writes only the pieces of it that it holds, each at its offsets in the full tensor
(`meshlm.train.shards`: tensor/expert-parallel shards from their `_meshlm_shard` tags, ZeRO's flat ranges
cut into rectangles of their parameters); a piece several ranks hold is written once. On load DCP reads
into each rank's pieces exactly the parts of the saved ones they overlap, so a checkpoint moves between
any two layouts (dp, ZeRO stage, tp, pp, ep, cp, world size; one process included) and no rank ever
builds a full tensor, saving or loading. The safetensors copy of the weights is written the same way, in
pieces (their places in its metadata); inference puts the full tensors together.

With several ranks every rank calls `save_checkpoint` (DCP's save is collective over the default
process group), all into the same directory, so a multi-node run needs a shared filesystem for
`run_dir`; rank 0 alone publishes, after a barrier.

Layout::

    <run_dir>/checkpoints/latest            text file: "step_000123"
    <run_dir>/checkpoints/step_000123/      .metadata + *.distcp (DCP), model_rank_*.safetensors (one per
                                            pipeline stage), meta.json, rank_00000.json, ..., manifest.json
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from safetensors import safe_open
from safetensors.torch import save_file

from meshlm.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from meshlm.files import sha256_file
from meshlm.mesh import ParallelDims
from meshlm.train.shards import (
    Piece,
    ShardedState,
    after_load,
    assemble,
    assign_writers,
    checkpoint_state,
    piece_name,
    weight_pieces,
)

FORMAT_VERSION = 3  # 3: every rank writes its own pieces; 2: full tensors (read too); 1: pickled rank files
_READABLE_FORMATS = (2, 3)
_META = "meta.json"
_MANIFEST = "manifest.json"
_PIECES = "meshlm.pieces"  # safetensors metadata: where each piece that is not a whole tensor belongs


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


# --------------------------------------------------------------------------------------------
# RNG state (per rank)
# --------------------------------------------------------------------------------------------


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


def set_rng_state(state: dict) -> None:
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if isinstance(cuda[0], list):  # written by earlier meshlm: every visible device's state; take ours
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(torch.tensor(cuda, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, in one line naming the file and the fix (the CLI prints it, exit 2)."""


def _step_of(path: Path) -> int:
    return int(path.name[len("step_"):])


def _is_complete(path: Path) -> bool:
    """A published checkpoint: a step_N name (never step_N.tmp) holding its manifest, which is written last."""
    return re.fullmatch(r"step_\d+", path.name) is not None and (path / _MANIFEST).is_file()


def _complete_checkpoints(root: Path) -> list[Path]:
    """Oldest first, by step number (as names, step_1000000 would sort before step_999999)."""
    return sorted((p for p in root.glob("step_*") if _is_complete(p)), key=_step_of)


def _read_pointer(root: Path) -> tuple[Path | None, str | None]:
    """(the checkpoint `latest` names, None) if it is a complete one; else (None, what is wrong with it)."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None, f"{pointer} is missing"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None, f"{pointer} cannot be read"
    if re.fullmatch(r"step_\d+", name) is None:
        return None, f"{pointer} does not name a checkpoint ({name[:40]!r})"
    if not _is_complete(root / name):
        return None, f"{pointer} names {name}, which is not a complete checkpoint"
    return root / name, None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint the `latest` pointer names; None when the run has no checkpoint at all.

    Strict (inference, `meshlm verify`): a damaged pointer next to complete checkpoints raises
    CheckpointError naming it and the newest complete one. A `step_N.tmp/` left by a crash is never
    picked up. `--resume` is lenient instead: `resume_checkpoint`.
    """
    root = checkpoints_root(run_dir)
    complete = _complete_checkpoints(root) if root.is_dir() else []
    path, problem = _read_pointer(root)
    if path is not None:
        return path
    if not complete:
        return None
    newest = complete[-1].name
    raise CheckpointError(f"{problem}; the newest complete checkpoint is {newest}: pass {root / newest}, or "
                          f"write {newest} into {root / 'latest'}")


def resume_checkpoint(run_dir: str | Path) -> tuple[Path, str | None]:
    """(the checkpoint `--resume` continues from, a note when it is not the one `latest` names).

    `latest`, or when that pointer is damaged the newest complete checkpoint. Raises CheckpointError
    when there is none (`--resume` never starts afresh by itself, and never deletes anything)."""
    root = checkpoints_root(run_dir)
    path, problem = _read_pointer(root)
    if path is not None:
        return path, None
    complete = _complete_checkpoints(root) if root.is_dir() else []
    if complete:
        return complete[-1], f"{problem}: resuming from the newest complete checkpoint, {complete[-1].name}"
    found = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
    if found:
        raise CheckpointError(f"--resume: {root} holds no complete checkpoint, only incomplete ones without "
                              f"{_MANIFEST} ({', '.join(found[:4])}: a crash during their save?); start afresh "
                              "with --overwrite instead of --resume (this deletes them)")
    raise CheckpointError(f"--resume: {root} holds no checkpoint; run without --resume to start afresh")


def has_complete_checkpoint(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a published checkpoint (one `--resume` could continue from)."""
    root = checkpoints_root(run_dir)
    return root.is_dir() and bool(_complete_checkpoints(root))


def check_run_dir(run_dir: str | Path, *, resume: bool, overwrite: bool, model: ModelConfig | None = None,
                  checksums: bool | tuple[int, int] = True) -> None:
    """Raise CheckpointError unless a run may start in `run_dir` as asked (the launcher calls it before
    starting ranks, so a refusal is one line, once). A fresh run must not silently replace an earlier run's
    checkpoints: it needs `overwrite`; `resume` needs a complete checkpoint (`resume_checkpoint`) that is
    intact (`verify_checkpoint`: its checksums, computed here once for every rank), whose meta.json and
    rank files parse and, given `model`, that was trained with that model config."""
    if resume and overwrite:
        raise CheckpointError("--resume continues the run in train.run_dir and --overwrite replaces it; pass one")
    root = checkpoints_root(run_dir)
    if resume:
        path = resume_checkpoint(run_dir)[0]
        verify_checkpoint(path, checksums=checksums)
        meta = read_meta(path)
        if model is not None:
            check_model_config(meta["config"].get("model") or {}, model, where=f"{path} ({_META})")
        for r in range(int(meta["world_size"])):  # every rank's file parses (small files), not just this one's
            _read_rank_file(path / f"rank_{r:05d}.json")
        return
    held = sorted(p.name for p in root.glob("*")) if root.is_dir() else []
    if held and not overwrite:
        complete = _complete_checkpoints(root)
        if complete:
            raise CheckpointError(f"train.run_dir={str(run_dir)!r} holds the checkpoints of an earlier run (newest: "
                                  f"{complete[-1].name}); pass --resume to continue it, --overwrite to replace it, "
                                  "or choose another train.run_dir")
        raise CheckpointError(f"train.run_dir={str(run_dir)!r} holds what an earlier run left in {root.name}/ (no "
                              f"complete checkpoint: {', '.join(held[:3])}); pass --overwrite to replace it, or "
                              "choose another train.run_dir")


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory, its `checkpoints/` folder, or the checkpoint itself."""
    path = Path(path)
    if (path / _META).exists() or (path / _MANIFEST).exists():
        return path
    for run_dir in (path, path.parent if path.name == "checkpoints" else None):
        if run_dir is not None and checkpoints_root(run_dir).is_dir():
            found = latest_checkpoint(run_dir)
            if found is not None:
                return found
            root = checkpoints_root(run_dir)
            _, problem = _read_pointer(root)
            incomplete = sorted(p.name for p in root.glob("step_*"))
            if incomplete or (root / "latest").exists():
                raise CheckpointError(f"{problem}, and {root} holds no complete checkpoint (none with "
                                      f"{_MANIFEST}: {', '.join(incomplete[:4]) or 'no step_N at all'}); the "
                                      "run never finished a save: train it again (--overwrite)")
    raise CheckpointError(f"no checkpoint at {str(path)!r}: expected a run directory (with checkpoints/latest), "
                          f"its checkpoints/ folder, or a step_N checkpoint directory (with {_META})")


def _other_checkpoint_hint(path: Path) -> str:
    """The fix for a damaged checkpoint: the newest complete one before it, if any."""
    older = [p for p in _complete_checkpoints(path.parent) if _step_of(p) < _step_of(path)] \
        if re.fullmatch(r"step_\d+", path.name) else []
    if older:
        return f"resume from {older[-1].name} instead (write {older[-1].name} into {path.parent / 'latest'})"
    return "no earlier checkpoint is left: start afresh (--overwrite) or restore the file from a copy"


# --------------------------------------------------------------------------------------------
# Integrity: the manifest
# --------------------------------------------------------------------------------------------


def _describe(paths: list[Path]) -> dict[str, list]:
    """{file name: [size, sha256]}: what the manifest records of each file."""
    return {p.name: [p.stat().st_size, sha256_file(p)] for p in paths}


def verify_checkpoint(path: str | Path, *, checksums: bool | tuple[int, int] = True) -> dict:
    """Check every file of checkpoint `path` against its manifest (present, size, and with `checksums` its
    sha256) and that every rank's file is there; return the manifest. Raises CheckpointError naming the first
    bad file and the fix. `checksums=False` is for a caller that verified them already (reading a large
    checkpoint once per check costs what reading it costs): the trainer checks the run_dir first.
    `checksums=(part, parts)` hashes only every parts-th file from the part-th (sorted by name): the ranks
    of a job share the reading and combine their verdicts (`Trainer`).

    Run before anything of the checkpoint is parsed: DCP's `.metadata` is a pickle, read only once its
    checksum matches what the saving run recorded (which protects against damage, not against a crafted
    checkpoint: resume only runs you trust; inference reads safetensors and JSON only)."""
    path = Path(path)
    manifest_file = path / _MANIFEST
    hint = _other_checkpoint_hint(path)
    if not manifest_file.is_file():
        raise CheckpointError(f"{manifest_file} is missing: the checkpoint was never completely published "
                              f"(a crash during its save?); {hint}")
    try:
        manifest = json.loads(manifest_file.read_text())
        files, world_size = manifest["files"], int(manifest["world_size"])
        files = {str(name): (int(size), str(digest)) for name, (size, digest) in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{manifest_file} is corrupt (not the manifest JSON meshlm writes); {hint}") from None
    for name in files:
        if Path(name).name != name or name in (".", ".."):  # a manifest names files of its own directory only
            raise CheckpointError(f"{manifest_file} is corrupt (it names {name!r}, not a file of the checkpoint); "
                                  f"{hint}")
    for name in (_META, *(f"rank_{r:05d}.json" for r in range(world_size))):
        if name not in files:
            raise CheckpointError(f"{manifest_file} lists no {name} (it was saved by {world_size} ranks); {hint}")
    for name, (size, digest) in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing; {hint}")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, the manifest {size} (truncated or "
                                  f"overwritten); {hint}")
    names = sorted(files)
    if isinstance(checksums, tuple):
        part, parts = checksums
        names = names[part::parts]
    for name in names if checksums is not False else []:
        digest = files[name][1]
        f = path / name
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f} does not match its checksum in {_MANIFEST} (corrupt); {hint}")
    return manifest


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------


def save_checkpoint(run_dir: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    config: Config, rank_extra: dict, rank: int = 0, world_size: int = 1, keep: int = 2,
                    barrier: Callable[[], None] = lambda: None, files: dict[str, Path] | None = None,
                    mesh=None) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it; return its directory.

    `rank_extra` (RNG states, loader position, ...: plain JSON data) goes to this rank's own file. With
    several ranks every rank calls this (DCP's save is collective) and passes a `barrier` so rank 0
    publishes only after all ranks have written. `files` are copied in by rank 0 (e.g. the
    tokenizer.json, so the checkpoint is self-contained). `mesh` is needed when the model is sharded
    (tensor/expert parallel: it places the shards in the full tensors).

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
    files: dict[str, Path]
    rank_extra: dict
    writes: list = field(default_factory=list)  # what is still writing: DCP's future, the weights' thread


def begin_save(run_dir: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
               config: Config, rank_extra: dict, rank: int = 0, world_size: int = 1, keep: int = 2,
               barrier: Callable[[], None] = lambda: None, files: dict[str, Path] | None = None, mesh=None,
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
        _fsync_file(f)
    part = p.tmp / f"manifest_{p.rank:05d}.part"
    part.write_text(json.dumps(_describe(mine)))
    _fsync_file(part)
    if p.rank == 0:
        (p.tmp / _META).write_text(json.dumps(p.meta, indent=1))
        for name, src in p.files.items():
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
        _fsync_file(p)
    files.update(_describe(rest))
    manifest = tmp / _MANIFEST
    manifest.write_text(json.dumps({"format": FORMAT_VERSION, "world_size": world_size, "files": files}, indent=1))
    _fsync_file(manifest)
    _fsync_dir(tmp)
    # Re-saving a step: set the old copy aside, and delete it only once `latest` names the new one. (A crash
    # between the two renames leaves the old copy in step_N.old, which --resume does not pick up; the trainer
    # re-saves a step only after resuming from an earlier one, so `latest` never names a complete old copy.)
    aside = root / f"{final.name}.old"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / "latest", final.name)
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
        if not _peer_failed(e):  # this rank's own failure (a full disk, ...): as it is
            raise
        raise CollectiveError(f"rank {rank}: saving checkpoint {tmp.name} (torch.distributed.checkpoint, over every "
                              f"rank) failed after {time.perf_counter() - start:.1f} s: {_one_line(e, 160)} -- a peer "
                              "rank stopped, died or diverged (parallel.collective_timeout_s bounds the wait)") from e
    if weights:
        # One file per rank; pieces of one flat ZeRO shard share its storage, which safetensors refuses: copies.
        tensors = {name: t.detach().to("cpu").contiguous().clone() for name, (t, _) in weights.items()}
        where = {name: w for name, (_, w) in weights.items() if w is not None}
        save_file(tensors, str(tmp / f"model_rank_{rank:05d}.safetensors"),
                  metadata={_PIECES: json.dumps(where)} if where else None)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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


def saved_layout(path: str | Path, *, checksums: bool = True) -> ParallelDims:
    """The parallel degrees checkpoint `path` was saved under (its config, resolved against its ranks).

    The first thing a resume reads of a checkpoint: verified against its manifest first."""
    verify_checkpoint(path, checksums=checksums)
    meta = read_meta(path)
    try:
        parallel = config_from_dict(meta["config"]).parallel
        return ParallelDims.from_config(parallel).resolve(int(meta["world_size"]))
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{Path(path) / _META} holds a parallel layout this meshlm cannot read ({e}); "
                              f"{_other_checkpoint_hint(Path(path))}") from None


def read_meta(path: str | Path) -> dict:
    """meta.json of checkpoint `path` (format, step, world_size, config); CheckpointError if it is unusable.
    Callers verify the checkpoint first (`verify_checkpoint`): this only parses."""
    path = Path(path)
    meta_file = path / _META
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} is not a checkpoint (no {_META}); pass a step_N directory "
                              "or a run directory") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{meta_file} is corrupt ({_one_line(e)}); {_other_checkpoint_hint(path)}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_file} is corrupt (not a JSON object); {_other_checkpoint_hint(path)}")
    if meta.get("format") not in _READABLE_FORMATS or not {"config", "step", "world_size"} <= set(meta) \
            or not isinstance(meta["config"], dict):
        raise CheckpointError(f"{meta_file} has format {meta.get('format')!r}; this meshlm reads "
                              f"formats {list(_READABLE_FORMATS)} (older checkpoints: resume them with the meshlm that wrote "
                              "them, or start afresh)")
    return meta


def _one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line (DCP and JSON errors can span many)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


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
    keys = [k for k in sorted(set(saved) | set(now)) if k != "preset" and saved.get(k) != now.get(k)]
    if keys:
        diffs = "; ".join(f"model.{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys)
        sets = " ".join(f"--set model.{k}={json.dumps(saved.get(k))}" for k in keys[:3])
        raise CheckpointError(f"checkpoint {where} was trained with a different model config ({diffs}); use the "
                              f"checkpoint's model settings ({sets}{' ...' if len(keys) > 3 else ''}) or start "
                              "a new run_dir")


def _dcp_load(state: dict, path: Path) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.load(state, checkpoint_id=path)
    # DCP wraps reader failures in CheckpointException, a BaseException subclass, so name it.
    except (Exception, CheckpointException) as e:
        if _peer_failed(e):  # the files were verified: another rank stopped (and said why), not this checkpoint
            raise CheckpointError(f"loading checkpoint {str(path)!r} stopped because another rank did (see its "
                                  f"error; {_one_line(e, 80)})") from e
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded ({_one_line(e)}); "
                              f"{_other_checkpoint_hint(path)}") from e


def _peer_failed(e: BaseException) -> bool:
    """Whether a collective DCP load failed because another rank went away (gloo/NCCL lost the peer)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(e).lower()
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        s in text for s in ("closed by peer", "reset by peer", "remote worker", "connection refused", "nccl"))


def _read_rank_file(rank_file: Path) -> dict:
    """A rank's extras: plain JSON data (nothing in a rank file runs code)."""
    try:
        rank_extra = json.loads(rank_file.read_text())
        if not isinstance(rank_extra, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{rank_file} is not the JSON meshlm writes ({_one_line(e, 80)}); "
                              f"{_other_checkpoint_hint(rank_file.parent)}") from None
    return rank_extra


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    config: Config, rank: int = 0, mesh=None, checksums: bool = True) -> dict:
    """Load model (+ optimizer) state in place; return {"step", "config", "rank_extra"}.

    Each rank reads only the parts of the saved pieces that overlap its own (any layout saved it); a
    sharded model needs `mesh`. `checksums=False`: the caller verified them (`verify_checkpoint`)."""
    path = Path(path)
    verify_checkpoint(path, checksums=checksums)  # before any of it is parsed (DCP's .metadata is a pickle)
    meta = read_meta(path)
    check_model_config(meta["config"].get("model") or {}, config.model, where=f"{path} ({_META})")
    rank_file = path / f"rank_{rank:05d}.json"
    if rank >= int(meta["world_size"]):
        raise CheckpointError(f"checkpoint {str(path)!r} was saved by {meta['world_size']} ranks and has no "
                              f"{rank_file.name} (this rank's RNG and data position are unknown)")
    rank_extra = _read_rank_file(rank_file)  # before DCP reads anything
    state = checkpoint_state(model, optimizer, mesh)  # this rank's pieces: DCP reads only what overlaps them
    _dcp_load(state, path)
    after_load(state, model=model, optimizer=optimizer)
    return {"step": int(meta["step"]), "config": meta["config"], "rank_extra": rank_extra}


def load_weights(path: str | Path, model: nn.Module, *, checksums: bool = True) -> None:
    """The weights of checkpoint `path` into `model` (the full, unsharded model), from its safetensors
    files only -- no pickle is read, so a checkpoint from anywhere is safe to generate from. Only the files
    its manifest lists (and verified) are read: a stray file next to them is ignored."""
    path = Path(path)
    listed = verify_checkpoint(path, checksums=checksums)["files"]
    named: dict[str, torch.Tensor] = {}
    layout: dict[str, dict] = {}
    for f in sorted(path / name for name in listed if re.fullmatch(r"model_rank_\d+\.safetensors", name)):
        try:
            with safe_open(str(f), framework="pt") as st:
                layout.update(json.loads((st.metadata() or {}).get(_PIECES, "{}")))
                named.update({name: st.get_tensor(name) for name in st.keys()})
        except Exception as e:  # safetensors' own error type is no ValueError
            raise CheckpointError(f"{f} cannot be read ({_one_line(e, 80)}); {_other_checkpoint_hint(path)}") from None
    try:
        state = assemble(named, layout)  # a sharded run wrote pieces (each once); put the full tensors together
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {e}; {_other_checkpoint_hint(path)}") from None
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no weights for {missing[:3]}"
                              f"{' ...' if len(missing) > 3 else ''}; {_other_checkpoint_hint(path)}")
    model.load_state_dict(state)


def load_checkpoint_for_inference(path: str | Path, *, device: str | torch.device = "cpu",
                                  dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Config, Any]:
    """(model in eval mode, config, tokenizer) from a run directory or a checkpoint; no optimizer state."""
    from meshlm.models import build_model
    from meshlm.tokenizer import load_tokenizer

    ckpt = resolve_checkpoint(path)
    listed = verify_checkpoint(ckpt)["files"]  # before meta.json is parsed
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"])
    model = build_model(cfg.model, seed=cfg.train.seed)
    load_weights(ckpt, model, checksums=False)  # verified just above
    # The copy the run saved (verified), never a stray file; else data.tokenizer, or bytes.
    tokenizer = load_tokenizer(ckpt / "tokenizer.json" if "tokenizer.json" in listed else cfg.data.tokenizer)
    return model.to(device=device, dtype=dtype).eval(), cfg, tokenizer
