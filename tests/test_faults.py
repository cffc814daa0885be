"""Fault drills through `meshlm train --nproc 2`, as a user meets failures.

- `--max-restarts 3` with a rank SIGKILLed three times at random steps (slow tier): the launcher restarts the ranks,
  they resume from the newest complete checkpoint by themselves, the run finishes, and its final weights
  equal the uninterrupted run's bit for bit (same layout); metrics.jsonl records each restart and the
  steps it lost.
- A SIGSTOPped rank: its peer's collective fails after `parallel.collective_timeout_s` with an error
  naming the rank, the op and the mesh axis, and the stopped rank; the run's last line blames the stopped
  rank, and the launcher exits a few seconds after the timeout.
- A launcher killed with SIGKILL takes its ranks with it (no orphans training on).

Every process the test starts is a child of the test (and its ranks, children of the launcher) and is
killed at the end whatever happens.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshlm.processes import alive, children, stop_tree
from runs import SMALL_MODEL, ranks_when

SETTINGS = [*SMALL_MODEL, "train.progress=false", "train.seq_len=16", "train.global_batch_size=4",
            "train.warmup_steps=1", "train.val_batches=0", "train.sample_tokens=0", "train.device=cpu",
            "data.val_fraction=0.1", "train.checkpoint_interval=1", "train.keep_checkpoints=2"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")


def start(run_dir: Path, text_file: Path, *flags: str, extra=()) -> subprocess.Popen:
    sets = [*SETTINGS, f"data.path={text_file}", f"train.run_dir={run_dir}", *extra]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    # the launch's temporary files under the test's own directory: a launcher these tests SIGKILL cannot remove its own
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(run_dir.parent))
    argv = [sys.executable, "-m", "meshlm.cli", "train", "--nproc", "2", *flags,
            *[a for s in sets for a in ("--set", s)]]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def logged_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def last_step(run_dir: Path) -> int:
    """The last training step the run has logged (0 before any)."""
    return max([r["step"] for r in logged_steps(run_dir) if "loss" in r] or [0])


def final_weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model_rank_00000.safetensors"))


STEPS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file) -> dict:
    """The uninterrupted run's final weights: both restart drills must end on them bit for bit (how often a run
    checkpoints, to storage or memory, does not change its numbers)."""
    run = tmp_path_factory.mktemp("faults") / "ref"
    ref = start(run, text_file, extra=[f"train.steps={STEPS}", f"train.checkpoint_interval={STEPS}"])  # its last step
    try:
        assert ref.wait(timeout=240) == 0, ref.communicate()[1][-2000:]
    finally:
        stop_tree(ref, 0)
    return final_weights(run)


@pytest.mark.slow  # in the slow tier (pytest -m slow); the in-memory drill below restarts after a kill too
def test_killed_ranks_restart_and_finish_bit_identically(tmp_path, text_file, reference):
    steps = [f"train.steps={STEPS}"]  # three kills, each 1 to 5 steps past its attempt's resume: by step 14
    rng = random.Random(7)
    run = tmp_path / "faulty"
    proc = start(run, text_file, "--max-restarts", "3", extra=steps)
    kills = []
    try:
        deadline = time.time() + 400
        attempt_ranks, resume_step = None, 0
        trigger = rng.randint(2, 5)
        while proc.poll() is None and time.time() < deadline and len(kills) < 3:
            time.sleep(0.05)
            ranks = children(proc.pid)
            if len(ranks) != 2:
                continue
            if ranks != attempt_ranks:  # a new attempt: count its steps from where it resumed
                attempt_ranks = ranks
                resume_step = last_step(run)
            done = last_step(run)
            if done >= resume_step + trigger:
                victim = rng.choice(ranks)
                os.kill(victim, signal.SIGKILL)
                kills.append((done, victim))
                trigger = rng.randint(1, 4)
                while proc.poll() is None and children(proc.pid) == ranks and time.time() < deadline:
                    time.sleep(0.05)
        code = proc.wait(timeout=max(10, deadline - time.time()))
        out, err = proc.communicate()
    finally:
        stop_tree(proc, 0)
    assert len(kills) == 3, (kills, err[-3000:])
    assert code == 0, err[-3000:]
    restarts = [r for r in logged_steps(run) if "restart" in r]
    assert [r["restart"] for r in restarts] == [1, 2, 3], restarts
    assert all(r["lost_steps"] >= 0 for r in restarts)
    print("\nkilled (step, pid):", kills, "restart rows:", restarts)
    got, want = final_weights(run), reference
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_restart_resumes_from_in_memory_checkpoints(tmp_path, text_file, reference):
    """`--max-restarts 1` with in-memory checkpoints every 2 steps and storage ones every 6: a rank SIGKILLed
    after step 8 is restarted with every rank, they resume from the newest in-memory checkpoint (at most 2 steps
    lost), the run ends bit-identical to the uninterrupted one, and the launcher removes the in-memory copies."""
    memory = tmp_path / "shm"
    steps = [f"train.steps={STEPS}", "train.checkpoint_interval=6", "train.memory_checkpoint_interval=2",
             f"train.memory_checkpoint_dir={memory}"]
    run = tmp_path / "faulty"
    proc = start(run, text_file, "--max-restarts", "1", extra=steps)
    killed = None
    try:
        deadline = time.time() + 300
        ranks = ranks_when(proc, lambda: last_step(run) >= 8, timeout_s=300, every_s=0.02)
        if ranks:
            killed = ranks[1]
            os.kill(killed, signal.SIGKILL)
        code = proc.wait(timeout=max(10, deadline - time.time()))
        _, err = proc.communicate()
    finally:
        stop_tree(proc, 0)
    assert killed is not None and code == 0, err[-3000:]
    restarts = [r for r in logged_steps(run) if "restart" in r]
    assert len(restarts) == 1 and restarts[0]["from"] == "memory", restarts
    assert restarts[0]["lost_steps"] <= 2 and restarts[0]["step"] >= 6, restarts
    got, want = final_weights(run), reference
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not any(memory.rglob("*.st")), sorted(memory.rglob("*"))


def test_a_stopped_rank_is_named_and_the_launcher_exits_within_the_timeout(tmp_path, text_file):
    """Rank 1 is SIGSTOPped mid-run (and left stopped): rank 0's collective gives up after the timeout with one
    line naming itself, the op and the mesh axis, and rank 1 as not responding (`meshlm.liveness`); the
    launcher's last line blames rank 1, not rank 0 which noticed, and it exits a few seconds after the timeout
    (its SIGTERM grace is capped: the stopped rank cannot act on SIGTERM, only SIGKILL ends it)."""
    run = tmp_path / "run"
    timeout = 4
    # no checkpoints: the stop then falls in one of meshlm's own collectives (DCP's saves use torch's)
    proc = start(run, text_file, extra=["train.steps=400", f"parallel.collective_timeout_s={timeout}",
                                        "train.checkpoint_interval=0"])
    stopped = None
    try:
        ranks = ranks_when(proc, lambda: last_step(run) >= 2, timeout_s=120)
        if ranks:
            stopped = ranks[1]
            os.kill(stopped, signal.SIGSTOP)
            stopped_at = time.time()
        assert stopped is not None, "the run never reached step 2"
        code = proc.wait(timeout=120)
        elapsed = time.time() - stopped_at
        _, err = proc.communicate()
    finally:
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGCONT)
        stop_tree(proc, 0)
    assert code != 0
    assert not alive(stopped)  # the launcher ended it
    print(f"\nstopped -> launcher exit: {elapsed:.1f} s (timeout {timeout} s); last line: {err.strip().splitlines()[-1]}")
    assert elapsed < timeout + 10, (elapsed, err[-3000:])
    named = [line for line in err.splitlines() if "on mesh axis" in line and "failed after" in line]
    assert named, err[-3000:]
    assert "rank 0:" in named[0] and "parallel.collective_timeout_s" in named[0], named[0]
    assert "not responding: rank 1" in named[-1], named  # the stopped rank, named by its silent heartbeat
    last = err.strip().splitlines()[-1]
    assert last.startswith("meshlm train: rank 1 stopped answering; rank 0 noticed first"), last


def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path, text_file):
    run = tmp_path / "run"
    proc = start(run, text_file, extra=["train.steps=400"])
    ranks = []
    try:
        ranks = ranks_when(proc, lambda: bool(logged_steps(run)), timeout_s=120)
        assert len(ranks) == 2, "the ranks never started"
        proc.send_signal(signal.SIGKILL)  # the launcher alone
        proc.wait(timeout=30)
        gone_by = time.time() + 15
        while time.time() < gone_by and any(alive(p) for p in ranks):
            time.sleep(0.1)
        assert not any(alive(p) for p in ranks), "ranks kept running after their launcher died"
    finally:
        for pid in ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        stop_tree(proc, 0)
