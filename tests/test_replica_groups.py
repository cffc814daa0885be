"""Replica groups on torchft (`meshlm train --replica-groups N`, `meshlm.train.replica`), as a user meets failures.

- The drill (slow tier): 2 replica groups x 2 ranks (tp2 inside each), float64; one rank of group 1 is SIGKILLed mid-run.
  Group 0 keeps stepping (its metrics.jsonl has every step once, no restart); group 1's launcher restarts it and it
  rejoins at its first quorum, copying the state from group 0; the run finishes; both groups' final weights equal
  (float64, 1e-9) those of the reference: one process that replays the quorum memberships the groups recorded
  (`replicas` of each step in metrics.jsonl: step s runs the slices of those groups only, gradients x N/P) --
  `meshlm.train.replica.MembershipReplay`.
- A lighthouse nobody runs: one line naming its address, before any rank starts.
- A group with another layout (dp2 instead of tp2) joining a running group: it is refused in one line, and the
  running group trains on.

Every process the test starts is a child of the test and is killed at the end whatever happens.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist import group_ranks
from meshlm.processes import free_port, stop_tree
from runs import SMALL_MODEL

# (not imported here: torchft's Rust logger reads RUST_LOG once, and `quiet_torchft` sets it before the first import)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft (extra ft)")

SETTINGS = [*SMALL_MODEL, "train.progress=false", "train.seq_len=16", "train.global_batch_size=4",
            "train.warmup_steps=1", "train.val_batches=0", "train.sample_tokens=0", "train.device=cpu",
            "train.precision=fp64", "data.val_fraction=0.1", "train.checkpoint_interval=0", "train.log_interval=1",
            "parallel.collective_timeout_s=20"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
STEPS = 200  # group 0 alone for ~80 steps while group 1 restarts (2 loaded cores): room to rejoin


def start(run_dir: Path, text_file: Path, *flags: str, extra=()) -> subprocess.Popen:
    sets = [*SETTINGS, f"data.path={text_file}", f"train.run_dir={run_dir}", *extra]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    # the launch's temporary files under the test's own directory: a group these tests kill cannot remove its own
    env.update(OMP_NUM_THREADS="1", RUST_LOG="warn", TMPDIR=str(run_dir.parent))
    argv = [sys.executable, "-m", "meshlm.cli", "train", *flags, *[a for s in sets for a in ("--set", s)]]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def rows(run_dir: Path, group: int) -> list[dict]:
    path = run_dir / f"replica_{group}" / "metrics.jsonl"
    found = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
    return found


def last_step(run_dir: Path, group: int) -> int:
    return max([r["step"] for r in rows(run_dir, group) if "loss" in r] or [0])


def memberships(run_dir: Path, groups: int) -> dict[int, list[int]]:
    """step -> the groups of its quorum, from every group's metrics.jsonl (groups that logged a step agree)."""
    seen: dict[int, list[int]] = {}
    for g in range(groups):
        for r in rows(run_dir, g):
            if "replicas" in r:
                assert seen.setdefault(r["step"], r["replicas"]) == r["replicas"], (g, r)
    return seen


def replay(tmp_path: Path, text_file: Path, members: dict[int, list[int]], *, groups: int):
    """The reference: one process replaying the memberships (tp=1; the groups' micro-batches in order)."""
    from meshlm.config import load_config
    from meshlm.train.replica import MembershipReplay

    cfg = load_config(overrides=[*SETTINGS, f"data.path={text_file}", f"train.run_dir={tmp_path / 'ref'}",
                                 f"train.steps={STEPS}"])
    trainer = MembershipReplay(cfg, members, replica_groups=groups, group_micro_batch_size=4 // groups)
    trainer.train()
    return trainer.base_model


def final_weights(run_dir: Path, like) -> dict:
    """A group's final checkpoint's full weights, in float64 (read into a copy of the reference's fp64 model)."""
    import copy

    from meshlm.checkpoint.load import load_weights

    model = copy.deepcopy(like)
    load_weights(run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip(), model)
    return model.state_dict()


@pytest.mark.slow  # in the slow tier (pytest -m slow): half a minute; DiLoCo's replay below runs groups by default
def test_a_killed_group_drops_out_rejoins_and_the_run_matches_its_membership_replay(tmp_path, text_file):
    run = tmp_path / "run"
    proc = start(run, text_file, "--replica-groups", "2", "--nproc", "2", "--max-restarts", "2",
                 extra=[f"train.steps={STEPS}", "parallel.tp=2"])
    killed_at = None
    try:
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline and killed_at is None:
            time.sleep(0.05)
            ranks = group_ranks(proc.pid, 1)
            if len(ranks) == 2 and last_step(run, 1) >= 3:
                os.kill(ranks[1], signal.SIGKILL)
                killed_at = last_step(run, 0)
        code = proc.wait(timeout=max(10, deadline - time.time()))
        out, err = proc.communicate()
    finally:
        stop_tree(proc, 0)
    assert killed_at is not None, "group 1 never reached step 3"
    assert code == 0, err[-3000:]
    g0, g1 = rows(run, 0), rows(run, 1)
    # group 0 never stopped: every step once, no restart
    assert [r["step"] for r in g0 if "loss" in r] == list(range(1, STEPS + 1))
    assert not [r for r in g0 if "restart" in r]
    # group 1 was restarted, and rejoined at its first quorum, copying group 0's state
    assert [r["restart"] for r in g1 if "restart" in r] == [1], g1[-3:]
    after = g1[[i for i, r in enumerate(g1) if "restart" in r][0] + 1:]
    first = after[0]
    assert first["replicas"] == [0, 1] and first["healed_at"] == first["step"] - 1 >= killed_at, first
    members = memberships(run, 2)
    # How many steps group 0 takes alone depends on how fast the launcher brings group 1 back: none when it is
    # back before the lighthouse drops it from the quorum (an idle machine), dozens under load.
    alone = [s for s, m in sorted(members.items()) if m == [0]]
    assert all(m == [0, 1] for s, m in members.items() if s >= first["step"]), members
    print(f"\nkilled at step {killed_at}; group 0 alone for {len(alone)} steps "
          f"{f'({alone[0]}..{alone[-1]})' if alone else ''}; group 1 back at step {first['step']} "
          f"(retried {first['retried']})")
    reference = replay(tmp_path, text_file, {s: members[s] for s in range(1, STEPS + 1)}, groups=2)
    want = reference.state_dict()
    for g in range(2):
        got = final_weights(run / f"replica_{g}", reference)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-9, msg=f"group {g}: {name}")


def test_an_unreachable_lighthouse_is_one_line_naming_it(tmp_path, text_file):
    address = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    proc = start(tmp_path / "run", text_file, "--nproc", "2",
                 extra=["parallel.fault_tolerance=replica", f"parallel.lighthouse={address}", "parallel.tp=2"])
    try:
        code = proc.wait(timeout=120)
        _, err = proc.communicate()
    finally:
        stop_tree(proc, 0)
    assert code == 2, err[-2000:]
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and address in lines[0] and "lighthouse" in lines[0], err[-2000:]


@pytest.mark.slow  # in the slow tier (pytest -m slow): a drill of half a minute and more
def test_a_group_of_another_layout_is_refused_and_the_running_group_trains_on(tmp_path, text_file):
    from meshlm.replica_launch import start_lighthouse

    server, address = start_lighthouse(1)
    run = tmp_path / "run"
    sets = ["parallel.fault_tolerance=replica", "parallel.replica_groups=2", f"parallel.lighthouse={address}"]
    steps = ["train.steps=5000"]  # the running group must outlast the other's start and refusal, however slow
    good = start(run, text_file, "--nproc", "2", extra=[*sets, "parallel.replica_group=0", "parallel.tp=2", *steps,
                                                        "parallel.replica_start_wait_s=0"])
    other = None
    try:
        deadline = time.time() + 180
        while good.poll() is None and time.time() < deadline and last_step(run, 0) < 2:
            time.sleep(0.1)
        other = start(run, text_file, "--nproc", "2", extra=[*sets, "parallel.replica_group=1", *steps])  # dp2
        code = other.wait(timeout=180)
        _, err = other.communicate()
        reached, until = last_step(run, 0), time.time() + 60  # (its next quorum waits out the refused group)
        while good.poll() is None and time.time() < until and last_step(run, 0) <= reached:
            time.sleep(0.2)
        assert good.poll() is None and last_step(run, 0) > reached, "the running group stopped"
    finally:
        stop_tree(good, 0)
        if other is not None:
            stop_tree(other, 0)
        server.shutdown()
    assert code != 0
    refused = [line for line in err.splitlines() if "refused" in line]
    assert refused and "replica group 1 refused" in refused[-1] and "layout=" in refused[-1], err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "refused" in last, last
    print(f"\n{refused[-1]}\n{last}")


@pytest.mark.parametrize("outer", [pytest.param("average", marks=pytest.mark.slow), "diloco"])  # LocalSGD: slow tier
def test_semi_synchronous_groups_match_their_replay(tmp_path, text_file, outer):
    """parallel.replica_sync_every=3: each group steps alone on its slice, every 3rd step torchft's LocalSGD averages
    the weights (DiLoCo: the moves since the last sync, through an outer Nesterov SGD); the reference is two
    one-process trainers, one per slice, synchronised the same way."""
    run, steps, every = tmp_path / "run", 9, 3
    sync = [f"parallel.replica_sync_every={every}", f"parallel.replica_outer={outer}"]
    proc = start(run, text_file, "--replica-groups", "2", "--nproc", "1", extra=[f"train.steps={steps}", *sync])
    try:
        code = proc.wait(timeout=240)
        _, err = proc.communicate()
    finally:
        stop_tree(proc, 0)
    assert code == 0, err[-3000:]
    for g in range(2):
        synced = [(r["step"], r["replicas"], r["synced"]) for r in rows(run, g) if "synced" in r]
        assert synced == [(s, [0, 1], True) for s in range(every, steps + 1, every)], synced
    want = semi_synchronous_replay(tmp_path, text_file, steps=steps, every=every, outer=outer)
    for g in range(2):
        got = final_weights(run / f"replica_{g}", want)
        for name, value in want.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-9, atol=1e-9, msg=f"group {g}: {name}")


def semi_synchronous_replay(tmp_path: Path, text_file: Path, *, steps: int, every: int, outer: str):
    """Two one-process trainers (group g: slice g alone, gradients x 2) synchronised every `every` steps as torchft's
    LocalSGD (the mean of the weights) or DiLoCo (the mean move since the last sync, as the gradient of an outer
    Nesterov SGD from the last sync's weights) do; returns group 0's model."""
    from meshlm.config import load_config
    from meshlm.train.replica import MembershipReplay

    trainers = []
    for g in range(2):
        cfg = load_config(overrides=[*SETTINGS, f"data.path={text_file}", f"train.run_dir={tmp_path / f'ref{g}'}",
                                     f"train.steps={steps}"])
        trainers.append(MembershipReplay(cfg, {s: [g] for s in range(1, steps + 1)}, replica_groups=2,
                                         group_micro_batch_size=2))
    params = [list(t.base_model.parameters()) for t in trainers]
    start = [torch.nn.Parameter(q.detach().clone()) for q in params[0]]
    sgd = torch.optim.SGD(start, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(1, steps + 1):
        for t in trainers:
            t.train_step()
        if step % every:
            continue
        with torch.no_grad():
            for i, q in enumerate(start):
                if outer == "average":
                    q.copy_((params[0][i] + params[1][i]) / 2)
                else:
                    q.grad = ((q - params[0][i]) + (q - params[1][i])) / 2
            if outer == "diloco":
                sgd.step()
            for group in params:
                for i, q in enumerate(group):
                    q.copy_(start[i])
    return trainers[0].base_model


@pytest.mark.slow  # in the slow tier (pytest -m slow): a drill of half a minute and more
def test_a_dead_lighthouse_stops_the_group_with_a_line_naming_it_and_its_checkpoints_intact(tmp_path, text_file):
    """The lighthouse (its own process here) is SIGKILLed mid-run: the group's next quorum fails, its launcher's
    restart finds no lighthouse, and the run ends non-zero with a last line naming the address; the checkpoints
    written before are complete."""
    from meshlm.checkpoint import verify_checkpoint

    serve = ("import sys, time\nfrom meshlm.replica_launch import start_lighthouse\n"
             "server, address = start_lighthouse(1)\nprint(address, flush=True)\ntime.sleep(3600)\n")
    lighthouse = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "RUST_LOG": "warn"}, start_new_session=True)
    run = tmp_path / "run"
    group = None
    try:
        address = lighthouse.stdout.readline().strip()
        group = start(run, text_file, "--nproc", "1", "--max-restarts", "1",
                      extra=["parallel.fault_tolerance=replica", f"parallel.lighthouse={address}", "train.steps=5000",
                             "parallel.replica_start_wait_s=0", "train.checkpoint_interval=5"])
        deadline = time.time() + 120
        while group.poll() is None and time.time() < deadline and last_step(run, 0) < 12:
            time.sleep(0.1)
        assert last_step(run, 0) >= 12, "the group never reached step 12"
        lighthouse.kill()
        code = group.wait(timeout=180)
        _, err = group.communicate()
    finally:
        stop_tree(lighthouse, 0)
        if group is not None:
            stop_tree(group, 0)
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert "lighthouse" in last and address in last, err[-3000:]
    latest = run / "replica_0" / "checkpoints" / (run / "replica_0" / "checkpoints" / "latest").read_text().strip()
    verify_checkpoint(latest)
    print(f"\n{last}")


@pytest.mark.parametrize("layout, what", [(["parallel.pp=2"], "parallel.pp=2"), (["parallel.zero_stage=1"], "zero_stage=1"),
                                          (["parallel.dp_replicate=2"], "dp_replicate=2"),
                                          (["parallel.cp=2"], "parallel.cp=2")])
def test_layouts_a_replica_group_does_not_run_are_refused_in_one_line(text_file, layout, what):
    from meshlm.config import load_config
    from meshlm.parallel.parallelize import check_layout

    cfg = load_config(overrides=[*SETTINGS, f"data.path={text_file}", "parallel.fault_tolerance=replica",
                                 "parallel.replica_groups=2", *layout])
    with pytest.raises(ValueError, match="runs plain data parallelism and tp inside a replica group") as e:
        check_layout(cfg, 2)
    assert what in str(e.value) and "\n" not in str(e.value)
    check_layout(load_config(overrides=[*SETTINGS, f"data.path={text_file}", "parallel.fault_tolerance=replica",
                                        "parallel.replica_groups=2", "parallel.tp=2"]), 2)  # tp2: runs
