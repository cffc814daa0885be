"""In-memory checkpoints of a run (train.memory_checkpoint_interval): taking them, the copy a peer keeps, and
which one a restart resumes from.

What survives a restart: torch elastic's restart (--max-restarts) ends every rank's process, and its memory
with it, then starts new ones; its agent lives on but keeps nothing for them. Files on a tmpfs do survive:
/dev/shm is host memory, written and read at memory speed, gone only with the machine (or when removed). So
every N steps each rank writes its blob (`checkpoint/memory.py`: its own pieces, never a full tensor) into
this run's folder there, and sends a copy to its peer -- the rank `ranks per node` further on, on another
node when there is one -- which keeps it in its own machine's folder. A restart agrees on the newest step
whose blobs all survived somewhere (each rank's own or its peer's copy), has each missing blob sent from where
it survived, and resumes from it when it is at least as new as the newest storage checkpoint; storage is then
neither loaded nor changed. The launcher removes the folder when the job ends, a run that starts afresh removes
what an earlier one left, and a finished run its own.
Not responsible for: the blob format (`checkpoint/memory.py`) or storage checkpoints (`resume.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshlm.checkpoint import resume_checkpoint
from meshlm.checkpoint.memory import SnapshotFiles, memory_root, restore, snapshot
from meshlm.config import Config


def memory_checkpoints(cfg: Config, world_size: int) -> "MemoryCheckpoints | None":
    """This rank's in-memory checkpoints when train.memory_checkpoint_interval asks for them."""
    if not cfg.train.memory_checkpoint_interval:
        return None
    return MemoryCheckpoints(cfg, rank=dist.get_rank() if world_size > 1 else 0, world_size=world_size)


def storage_step(run_dir: str | Path) -> int:
    """The step of the checkpoint on storage a resume would take (reading only the `latest` pointer and the
    names: nothing of it is loaded or verified here)."""
    return int(resume_checkpoint(run_dir)[0].name[len("step_"):])


def peer_of(rank: int, world_size: int, per_node: int) -> int:
    """The rank that keeps `rank`'s copy: on the next node (same local rank) when there are several, else the
    next rank."""
    step = per_node if world_size > per_node else 1
    return (rank + step) % world_size


class MemoryCheckpoints:
    """This rank's in-memory checkpoints. Every method is collective when there are several ranks."""

    def __init__(self, cfg: Config, *, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.files = SnapshotFiles(memory_root(cfg.train.run_dir, cfg.train.memory_checkpoint_dir))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
        self.peer = peer_of(rank, world_size, per_node)
        self.source = next(r for r in range(world_size) if peer_of(r, world_size, per_node) == rank)

    def _meta(self, step: int, extra: dict) -> dict:
        return {"step": step, "rank": self.rank, "world_size": self.world_size, "config": self.cfg.to_dict(),
                "extra": extra}

    def save(self, step: int, *, model: nn.Module, optimizer, mesh, extra: dict) -> None:
        """Take this rank's blob of `step`, keep it and the copy of `source`'s, then drop older steps."""
        blob = snapshot(model, optimizer, mesh, meta=self._meta(step, extra))
        self.files.write(step, self.rank, blob, copy=False)
        if self.world_size > 1:
            theirs = _transfer([(self.peer, blob)], [self.source])
            self.files.write(step, self.source, theirs[self.source], copy=True)
            dist.barrier()  # every rank's blob and copy of `step` are in place: older ones may go
        self.files.prune(step, self.rank, self.source)

    def newest(self, *, at_least: int) -> int | None:
        """The newest step >= `at_least` whose blobs survived for every rank (here or on another rank) and were
        taken by this job's config; None when there is none."""
        held = self.files.held()
        everyone = [held]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, held)
        covered: dict[int, set[int]] = {}
        for found in everyone:
            for step, rank in found:
                covered.setdefault(step, set()).add(rank)
        steps = sorted((s for s, ranks in covered.items() if len(ranks) == self.world_size and s >= at_least),
                       reverse=True)
        for step in steps:
            fits = self._fits(step)
            if self.world_size > 1:
                verdicts = [None] * self.world_size
                dist.all_gather_object(verdicts, fits)
                fits = all(verdicts)
            if fits:
                return step
        return None

    def _fits(self, step: int) -> bool:
        """Whether this rank's blob of `step` (else any blob of it here) was taken with this config and world size
        (a rank with none here leaves it to the others: the blobs of one step come from one job)."""
        for rank in [self.rank, *range(self.world_size)]:
            meta = self.files.meta(step, rank)
            if meta is not None:
                return meta["config"] == json.loads(json.dumps(self.cfg.to_dict())) \
                    and meta["world_size"] == self.world_size
        return True

    def restore(self, step: int, *, model: nn.Module, optimizer, mesh) -> dict:
        """Load this rank's blob of `step` (sent by a rank that holds it when it is not here) into the live
        state; return its extras."""
        mine = self.files.read(step, self.rank)
        if self.world_size > 1:
            missing = [None] * self.world_size
            dist.all_gather_object(missing, mine is None)
            if any(missing):
                senders = self._senders(step, missing)
                sends = [(r, self.files.read(step, r)) for r, h in senders.items() if h == self.rank]
                receives = [self.rank] if missing[self.rank] else []
                received = _transfer(sends, receives, sources={r: senders[r] for r in receives})
                mine = received.get(self.rank, mine)
        meta = restore(mine, model, optimizer, mesh)
        assert meta["step"] == step and meta["rank"] == self.rank, (meta["step"], meta["rank"])
        return meta["extra"]

    def _senders(self, step: int, missing: list) -> dict[int, int]:
        """{rank without its blob here: the lowest-numbered other rank that holds it} (collective)."""
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, self.files.held())
        return {r: min(h for h, found in enumerate(everyone) if (step, r) in found and h != r)
                for r in range(self.world_size) if missing[r]}


def _transfer(sends: list[tuple[int, bytes]], receives: list[int], *, sources: dict[int, int] | None = None
              ) -> dict[int, bytes]:
    """Send each (rank, blob) of `sends`; receive one blob from each rank's sender (`sources`, or the rank
    itself) for each rank of `receives`; returns {rank: blob received}. Sizes first, then the bytes."""
    sources = sources if sources is not None else {r: r for r in receives}
    sizes = {r: torch.zeros(1, dtype=torch.int64) for r in receives}
    ops = [dist.P2POp(dist.isend, torch.tensor([len(b)], dtype=torch.int64), dst) for dst, b in sends]
    ops += [dist.P2POp(dist.irecv, sizes[r], sources[r]) for r in receives]
    _wait(ops)
    buffers = {r: torch.empty(int(sizes[r]), dtype=torch.uint8) for r in receives}
    ops = [dist.P2POp(dist.isend, torch.frombuffer(bytearray(b), dtype=torch.uint8), dst) for dst, b in sends]
    ops += [dist.P2POp(dist.irecv, buffers[r], sources[r]) for r in receives]
    _wait(ops)
    return {r: buffers[r].numpy().tobytes() for r in receives}


def _wait(ops: list) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
