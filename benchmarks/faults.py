"""Failure recovery, three ways: the steps and wall time one failure costs a small job, measured, beside the planner.

    python benchmarks/faults.py                        # storage, memory, replica: a reference and a faulty run each
    python benchmarks/faults.py --paths storage,memory --steps 40 --kill-at 17
    python benchmarks/faults.py --smoke                # the memory path's faulty run only, 8 steps (CI)

The job: tests/runs.py's SMALL_MODEL (2 layers of width 32) on CPU, sequences of 16 tokens, a global batch of 4,
`--steps` steps, two ranks: dp2 under `meshlm train --nproc 2`, or two torchft replica groups of one rank each.
Every path runs twice, once uninterrupted (the reference) and once with one rank SIGKILLed as soon as the run has
logged step `--kill-at`:
  storage  `--max-restarts 1`, train.checkpoint_interval = `--checkpoint-every`: every rank restarts from storage;
  memory   the same + train.memory_checkpoint_interval = `--memory-every` (blobs in a folder of this run): every
           rank restarts from the in-memory checkpoint;
  replica  `--replica-groups 2 --nproc 1 --max-restarts 1`: group 1's rank is killed, its launcher restarts it and it
           copies the state from group 0, which steps on alone meanwhile.
Measured, per path: `lost_steps` (storage, memory: the restart row's; replica: the steps group 0 took alone, each
missing 1/2 of its work, plus the steps it retried, in whole-job steps), `recovery_s` (the kill to the first step the
restarted rank logged), `caught_up_s` (the kill to the first step past the one it was killed after), `wall_cost_s`
(faulty wall - reference wall: on a shared machine the load of other work moves it by more than a restart),
`lost_s` (storage, memory: caught_up_s less one step, the restart and the steps done again; replica, where the job
kept going: each step of group 0 the failure touched -- taken alone, or retried -- its wall time less the work it
did, a reference step x the groups in it / 2) and `step_s` (the reference's median step). The run is long enough
(`--steps`) for group 0 to be still training when group 1 is back: a group that comes back to no live peer waits
parallel.replica_start_wait_s for one, then trains alone from its own checkpoint.
Predicted (`meshlm.planner.recovery`): each path's mean time lost per failure with this machine's measured figures:
the step, the checkpoint intervals as set, and the restart measured on the storage path (the kill to the restart
row: the launcher noticing, new processes, rendezvous, the checkpoint read), for every path; the state (KBs) is
copied in well under a millisecond and counted as 0. The planner's figure is a mean over failure times (half an
interval lost); the kill here is at a fixed step, so the measured steps lost are `kill step mod interval`.
--smoke: the memory path's faulty run only (no reference, so no wall cost), 8 steps, killed after step 3; the replica
path is in the full mode only (a lighthouse and a quorum per step: over the smoke's time on two loaded cores).
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import missing_extras, parse_args_smoke  # benchmarks/ is on sys.path when run as a script
from meshlm.processes import children, stop_tree

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the fault tests' helpers: a replica group's ranks, the small model
from dist import group_ranks  # noqa: E402
from runs import SMALL_MODEL, write_corpus  # noqa: E402

SETTINGS = [*SMALL_MODEL, "train.progress=false", "train.seq_len=16", "train.global_batch_size=4",
            "train.warmup_steps=1", "train.val_batches=0", "train.sample_tokens=0", "train.device=cpu",
            "train.log_interval=1", "data.val_fraction=0.1", "parallel.collective_timeout_s=20"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
PATHS = ("storage", "memory", "replica")
GROUPS = 2


def path_command(path: str, args, run_dir: Path, corpus: Path) -> list[str]:
    """The `meshlm train` command of one path's run."""
    sets = [*SETTINGS, f"data.path={corpus}", f"train.run_dir={run_dir}", f"train.steps={args.steps}",
            f"train.checkpoint_interval={args.checkpoint_every}"]
    flags = ["--nproc", "2", "--max-restarts", "1"]
    if path == "memory":
        sets += [f"train.memory_checkpoint_interval={args.memory_every}",
                 f"train.memory_checkpoint_dir={run_dir.parent / (run_dir.name + '_shm')}"]
    elif path == "replica":
        flags = ["--replica-groups", str(GROUPS), "--nproc", "1", "--max-restarts", "1"]
        sets += ["train.checkpoint_interval=0"]
    return [sys.executable, "-m", "meshlm.cli", "train", *flags, *[a for s in sets for a in ("--set", s)]]


def rows(metrics: Path) -> list[dict]:
    found = []
    for line in (metrics.read_text().splitlines() if metrics.is_file() else []):
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return found


def last_step(found: list[dict]) -> int:
    return max([r["step"] for r in found if "loss" in r] or [0])


def victims(proc: subprocess.Popen, path: str) -> list[int]:
    """The ranks a kill may hit: the launcher's two (storage, memory), or group 1's one (replica)."""
    if path == "replica":
        return group_ranks(proc.pid, GROUPS - 1)
    ranks = children(proc.pid)
    return ranks if len(ranks) == 2 else []


def run_once(path: str, args, run_dir: Path, corpus: Path, *, kill_at: int | None) -> dict:
    """One run of a path; with `kill_at`, the kill and the times from it to the restart row and the first new
    step of the restarted rank(s)."""
    metrics = run_dir / (f"replica_{GROUPS - 1}" if path == "replica" else "") / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(OMP_NUM_THREADS="1", RUST_LOG="warn")
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(path_command(path, args, run_dir, corpus), env=env, stdout=out, stderr=out,
                                start_new_session=True)
    t0, killed, seen = time.perf_counter(), None, {}
    try:
        deadline = t0 + args.timeout
        while proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.02)
            if kill_at is None or "caught_up" in seen:
                continue
            found = rows(metrics)
            if killed is None:
                ranks = victims(proc, path)
                if ranks and last_step(found) >= kill_at:
                    os.kill(ranks[-1], signal.SIGKILL)
                    killed = (time.perf_counter(), last_step(found))
                continue
            restart = [i for i, r in enumerate(found) if "restart" in r]
            if restart and "restart" not in seen:
                seen["restart"] = time.perf_counter()
            if restart and "back" not in seen and any("loss" in r for r in found[restart[0] + 1:]):
                seen["back"] = time.perf_counter()
            if restart and any(r.get("step", 0) > killed[1] for r in found[restart[0] + 1:] if "loss" in r):
                seen["caught_up"] = time.perf_counter()
        code = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    finally:
        stop_tree(proc, 0)  # SIGKILL to what is left of it: a rank the launcher did not reap
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"{path} run exited {code}: {log.read_text()[-3000:]}")
    out = {"wall_s": wall}
    if killed is not None:
        out.update(killed_after_step=killed[1], restart_row_s=seen.get("restart", math.nan) - killed[0],
                   recovery_s=seen.get("back", math.nan) - killed[0],
                   caught_up_s=seen.get("caught_up", math.nan) - killed[0])
    return out


def step_s(found: list[dict]) -> float:
    """The median step time of a run's rows (its first step, with the warm-up of every kernel, left out)."""
    times = [r["step_time_s"] for r in found if "step_time_s" in r and r["step"] > 1]
    return statistics.median(times) if times else math.nan


def lost_work(path: str, run_dir: Path) -> dict:
    """What the faulty run's rows say it lost."""
    if path != "replica":
        restart = [r for r in rows(run_dir / "metrics.jsonl") if "restart" in r]
        return {"lost_steps": restart[0]["lost_steps"], "restarted_from": restart[0]["from"]} if restart else {}
    g0 = rows(run_dir / "replica_0" / "metrics.jsonl")
    alone = [r["step"] for r in g0 if r.get("replicas") == [0]]
    retried = [r for r in g0 if r.get("retried")]
    hit = [r for r in g0 if "loss" in r and (r.get("retried") or r.get("replicas") == [0])]
    return {"steps_group_0_alone": len(alone), "retried_steps": sum(r["retried"] for r in retried),
            "lost_steps": len(alone) / GROUPS + sum(r["retried"] for r in retried),
            "hit_steps": [(r["step_time_s"], len(r["replicas"])) for r in hit]}


def measure(path: str, args, tmp: Path, corpus: Path) -> dict:
    """A path's reference and faulty runs (the reference skipped under --smoke) and what they measured."""
    out = {}
    if not args.smoke:
        ref = run_once(path, args, tmp / f"{path}_ref", corpus, kill_at=None)
        ref_rows = rows(tmp / f"{path}_ref" / ("replica_0" if path == "replica" else "") / "metrics.jsonl")
        out.update(reference_wall_s=ref["wall_s"], step_s=step_s(ref_rows))
    faulty = run_once(path, args, tmp / f"{path}_faulty", corpus, kill_at=args.kill_at)
    out.update(faulty_wall_s=faulty.pop("wall_s"), **faulty, **lost_work(path, tmp / f"{path}_faulty"))
    if "step_s" not in out:
        faulty_dir = tmp / f"{path}_faulty" / ("replica_0" if path == "replica" else "")
        out["step_s"] = step_s(rows(faulty_dir / "metrics.jsonl"))
    if "reference_wall_s" in out:
        out["wall_cost_s"] = out["faulty_wall_s"] - out["reference_wall_s"]
        # replica: the job went on; half the work of each step group 0 took alone, and the wait of the retried step
    if path == "replica":  # each step the failure touched (alone or retried): its wall less the work it did
        out["lost_s"] = sum(wall - out["step_s"] * n / GROUPS for wall, n in out.pop("hit_steps"))
    else:
        out["lost_s"] = out["caught_up_s"] - out["step_s"]
    return out


def predict(measured: dict, args) -> tuple[dict, dict]:
    """The planner's mean time lost per failure for each path, from the measured step and restart."""
    from meshlm.planner.recovery import checkpoint_restart, replica_recovery

    source = "storage" if "storage" in measured else next(iter(measured))
    restart = measured[source]["restart_row_s"]
    step = measured[source]["step_s"]
    inputs = {"restart_s": restart, "restart_from": f"measured on the {source} path (kill to restart row)",
              "step_s": step, "step_from": f"the {source} path's median step", "state_copy_s": 0.0}
    common = dict(mtbf_s=math.inf, step_s=step, write_s=0.0, reload_s=0.0, restart_s=restart)
    predicted = {
        "storage": checkpoint_restart(**common, interval_s=args.checkpoint_every * step)["lost_s_per_failure"],
        "memory": checkpoint_restart(**common, interval_s=args.memory_every * step)["lost_s_per_failure"],
        "replica": replica_recovery(mtbf_s=math.inf, step_s=step, groups=GROUPS, state_bytes=0.0, peer_bw=1.0,
                                    restart_s=restart)["lost_s_per_failure"],
    }
    return inputs, predicted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated: storage, memory, replica")
    ap.add_argument("--steps", type=int, default=400, help="training steps of every run")
    ap.add_argument("--kill-at", type=int, default=13, help="kill a rank once this step is logged")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="train.checkpoint_interval (steps)")
    ap.add_argument("--memory-every", type=int, default=2, help="train.memory_checkpoint_interval (steps)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    args = parse_args_smoke(ap, dict(paths="memory", steps=8, kill_at=3, checkpoint_every=4, timeout=60.0), argv)
    asked = [p for p in args.paths.split(",") if p]
    unknown, paths = sorted(set(asked) - set(PATHS)), list(asked)
    if unknown:
        ap.error(f"--paths {unknown} not among {', '.join(PATHS)}")
    if "replica" in paths and missing_extras("torchft"):
        paths.remove("replica")
    with tempfile.TemporaryDirectory(prefix="meshlm_faults_") as tmp:
        corpus = write_corpus(Path(tmp) / "corpus.txt", 400)
        measured = {p: measure(p, args, Path(tmp), corpus) for p in paths}
    inputs, predicted = predict(measured, args)
    print(json.dumps({
        "benchmark": "faults", "smoke": args.smoke, "steps": args.steps, "kill_at": args.kill_at,
        "checkpoint_every": args.checkpoint_every, "memory_every": args.memory_every, "measured": measured,
        "predicted_lost_s_per_failure": predicted, "prediction_inputs": inputs,
        "not_run": {p: ("full mode only (torchft's lighthouse and a quorum per step take longer than a smoke run)"
                        if args.smoke and p == "replica" else "not asked for (--paths)" if p not in asked
                        else "torchft is not installed (extra ft)") for p in PATHS if p not in paths},
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
