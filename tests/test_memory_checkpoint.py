"""In-memory checkpoints (train.memory_checkpoint_interval): a restart-all resumes from host memory.

The drill, on two gloo ranks of the test harness: a run with in-memory checkpoints every 2 steps and storage
ones every 4 "crashes" -- every rank raises at the start of step 8, after step 7 -- and new processes start as
the launcher's restart starts them (restarts=1: `Trainer(cfg, resume=..., restarts=1)`). They resume from the
in-memory checkpoint of step 6 (newer than storage's step 4): the lost steps are at most the interval, the
continuation is bit-identical to the uninterrupted run (every later loss, every final weight), and storage is
neither read for the recovery nor changed by it. Each rank keeps its blobs in a folder of its own, as if each
were a node: when one rank's folder is gone its peer's copy serves it (sent over the network); when both copies
are gone the restart falls back to storage.
"""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from dist import run_distributed
from runs import TRAIN, rows, train_config, weights

STEPS, CRASH_AT, MEMORY_EVERY, STORAGE_EVERY = 12, 8, 2, 4
SETTINGS = [*TRAIN, "train.progress=false", "train.global_batch_size=4", "train.val_batches=0",
            "train.sample_tokens=0", "train.lr_schedule=constant", f"train.memory_checkpoint_interval={MEMORY_EVERY}",
            f"train.checkpoint_interval={STORAGE_EVERY}", "train.keep_checkpoints=5"]


def make_cfg(run_dir, text_file, memory_dirs, rank):
    # one folder per rank: two "nodes" on this machine, so a lost folder is a lost node's memory
    return train_config(run_dir, text_file, f"train.memory_checkpoint_dir={memory_dirs / f'node{rank}'}",
                        settings=SETTINGS, steps=STEPS)


class Crash(Exception):
    pass


def storage_digest(run_dir: Path) -> dict:
    root = run_dir / "checkpoints"
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def first_attempt(rank, world_size, run_dir, text_file, memory_dirs):
    """Trains until every rank "crashes" at the start of step CRASH_AT (no collective half done)."""
    from meshlm.train.trainer import Trainer

    class Crashing(Trainer):
        def train_step(self):
            if self.step + 1 == CRASH_AT:
                raise Crash()
            return super().train_step()

    try:
        Crashing(make_cfg(run_dir, text_file, memory_dirs, rank)).train()
    except Crash:
        return None
    raise AssertionError("no crash")


def restarted(rank, world_size, run_dir, text_file, memory_dirs):
    """What the launcher's restart runs (cli/train.py: resume when storage holds a checkpoint, restarts=1)."""
    from meshlm.checkpoint import has_complete_checkpoint
    from meshlm.train.trainer import Trainer

    before = storage_digest(run_dir) if rank == 0 else None
    resume = has_complete_checkpoint(run_dir)
    trainer = Trainer(make_cfg(run_dir, text_file, memory_dirs, rank), resume=resume, overwrite=not resume,
                      restarts=1)
    after = storage_digest(run_dir) if rank == 0 else None
    restart = dict(trainer.restart_row)
    trainer.train()
    return {"restart": restart, "storage_unchanged": before == after, "weights": weights(trainer)}


def uninterrupted(rank, world_size, run_dir, text_file, memory_dirs):
    from meshlm.train.trainer import Trainer

    trainer = Trainer(make_cfg(run_dir, text_file, memory_dirs, rank))
    trainer.train()
    return weights(trainer)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("reference")
    out = run_distributed(uninterrupted, 2, root / "run", text_file, root / "memory", timeout=240)
    return {"weights": out, "losses": [r["loss"] for r in rows(root / "run") if "loss" in r]}


def crash(tmp_path, text_file) -> tuple[Path, Path]:
    run_dir, memory_dirs = tmp_path / "run", tmp_path / "memory"
    run_distributed(first_attempt, 2, run_dir, text_file, memory_dirs, timeout=240)
    return run_dir, memory_dirs


def assert_same_run(run_dir, out, reference):
    losses = [r["loss"] for r in rows(run_dir) if "loss" in r]
    assert losses[-(STEPS - CRASH_AT + 2):] == reference["losses"][-(STEPS - CRASH_AT + 2):]  # bit for bit
    for got, want in zip(out, reference["weights"]):
        for name in want:
            assert torch.equal(got["weights"][name], want[name]), name


@pytest.mark.parametrize("lost", ["nothing", "one node's memory"])
def test_a_restart_resumes_from_memory_bit_identically_without_touching_storage(tmp_path, text_file, reference,
                                                                                lost):
    run_dir, memory_dirs = crash(tmp_path, text_file)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000004"]
    if lost != "nothing":
        shutil.rmtree(memory_dirs / "node1")  # rank 1's own blobs: its peer's copy (on node 0) serves it
    out = run_distributed(restarted, 2, run_dir, text_file, memory_dirs, timeout=240)
    restart = out[0]["restart"]
    assert restart["from"] == "memory" and restart["step"] == 6, restart
    assert restart["lost_steps"] <= MEMORY_EVERY, restart
    assert out[0]["storage_unchanged"]
    assert_same_run(run_dir, out, reference)
    assert not any(memory_dirs.rglob("*.st")), "a finished run's in-memory checkpoints are removed"


def test_with_both_copies_gone_a_restart_falls_back_to_storage(tmp_path, text_file, reference):
    run_dir, memory_dirs = crash(tmp_path, text_file)
    for node in ("node0", "node1"):  # rank 0's own blob and the copy of it rank 1 kept
        for blob in (memory_dirs / node).rglob("*_00000.st"):
            blob.unlink()
    out = run_distributed(restarted, 2, run_dir, text_file, memory_dirs, timeout=240)
    restart = out[0]["restart"]
    assert restart["from"] == "storage" and restart["step"] == STORAGE_EVERY, restart
    assert_same_run(run_dir, out, reference)


def test_a_blob_holds_only_plain_data_and_refuses_another_layout(tmp_path):
    from meshlm.checkpoint.memory import restore, snapshot

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    blob = snapshot(model, optimizer, None, meta={"step": 1})
    copy = torch.nn.Linear(3, 2)
    copy_optimizer = torch.optim.AdamW(copy.parameters())
    assert restore(blob, copy, copy_optimizer, None) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), copy.state_dict().values()))
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], copy_optimizer.state_dict()["state"][0]["exp_avg"])
    other = torch.nn.Linear(3, 4)
    with pytest.raises(ValueError, match="another layout or model"):
        restore(blob, other, torch.optim.AdamW(other.parameters()), None)
    assert b"__reduce__" not in blob and blob[8:9] == b"{"  # a safetensors header: JSON, then raw tensor bytes
