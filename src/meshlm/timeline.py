"""Measured pipeline timelines: what each rank did when, written during a run and compared with the simulator.

Responsible for: `TimedAction` (one executed action, host seconds from its step's start), writing a rank's
timeline of a step under the run directory (`write_timeline`, for the first steps of a pipelined run),
reading every rank's back as one `schedules.SimResult` (`load_timeline`, `measured_timeline`: drawn by
`schedules.plot_schedule`), and the simulator's prediction for a measured run (`measured_overheads`,
`simulate_measured`), which `meshlm plan schedule --from-run` and benchmarks/pp.py report beside it.
Torch-free, like the schedules, so the planner reads timelines without the training stack.
Not responsible for: running the actions (`meshlm.parallel.pipeline`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshlm.schedules import Action, Schedule, SimResult, Timed, build_schedule, simulate

@dataclass(frozen=True)
class TimedAction:
    """One executed action: host seconds from the start of the step, compute only (the wait for its
    input is before `start`)."""

    action: Action
    start: float
    end: float




TIMELINE_DIR = "timeline"  # under the run directory: one rank_XXXXX.jsonl per rank, a line per step


def write_timeline(run_dir: str | Path, *, rank: int, step: int, schedule: Schedule, pp_rank: int,
                   result) -> Path:
    """Append this rank's timeline of `step` (a `pipeline.PipelineStepResult`) to <run_dir>/timeline/rank_XXXXX.jsonl (step 1 starts the file)."""
    path = Path(run_dir) / TIMELINE_DIR / f"rank_{rank:05d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"step": step, "schedule": schedule.name, "pp": schedule.pp, "pp_chunks": schedule.pp_chunks,
           "num_microbatches": schedule.num_microbatches, "pp_rank": pp_rank, "t0": result.t0_wall,
           "actions": [[t.action.kind, t.action.microbatch, t.action.chunk, t.start, t.end] for t in result.timeline]}
    with open(path, "w" if step == 1 else "a") as f:
        f.write(json.dumps(row) + "\n")
    return path


def load_timeline(run_dir: str | Path, *, step: int | None = None) -> SimResult:
    """The measured timeline of one step (default: the last recorded) as a `SimResult`, in seconds, for
    `schedules.plot_schedule`; one rank per pipeline stage (the first data-parallel replica found).
    Ranks' clocks are aligned by their wall-clock step starts (the same host clock, or NTP across nodes)."""
    files = sorted((Path(run_dir) / TIMELINE_DIR).glob("rank_*.jsonl"))
    if not files:
        raise ValueError(f"{run_dir} has no {TIMELINE_DIR}/rank_*.jsonl: it is not a pipeline-parallel run "
                         "(parallel.pp > 1), or it stopped before its first step")
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    if step is None:
        step = max(r["step"] for r in rows)
    by_stage: dict[int, dict] = {}
    for r in rows:
        if r["step"] == step:
            by_stage.setdefault(r["pp_rank"], r)
    if not by_stage:
        raise ValueError(f"{run_dir}: no timeline recorded for step {step} (the first steps are recorded: "
                         f"{sorted({r['step'] for r in rows})})")
    first = by_stage[min(by_stage)]
    sched = build_schedule(first["schedule"], pp=first["pp"], num_microbatches=first["num_microbatches"],
                           pp_chunks=first["pp_chunks"])
    if sorted(by_stage) != list(range(sched.pp)):
        raise ValueError(f"{run_dir}: step {step} has timelines of pp ranks {sorted(by_stage)}, want 0..{sched.pp - 1}")
    origin = min(r["t0"] for r in by_stage.values())
    timeline = [[Timed(Action(k, mb, c), r["t0"] - origin + s, r["t0"] - origin + e) for k, mb, c, s, e in r["actions"]]
                for r in (by_stage[p] for p in range(sched.pp))]
    return _as_sim_result(sched, timeline)


def _as_sim_result(schedule: Schedule, timeline: list[list[Timed]]) -> SimResult:
    start = min(tl[0].start for tl in timeline if tl)
    timeline = [[Timed(t.action, t.start - start, t.end - start) for t in tl] for tl in timeline]
    makespan = max(tl[-1].end for tl in timeline if tl)
    busy = [sum(t.end - t.start for t in tl) for tl in timeline]
    top = max(busy)
    peaks = schedule.peak_activations()
    return SimResult(schedule=schedule, timeline=timeline, busy=busy, idle=[makespan - b for b in busy],
                     makespan=makespan, bubble=makespan - top, bubble_fraction=(makespan - top) / top if top else 0.0,
                     peak_activations=peaks, peak_inflight=[p / schedule.pp_chunks for p in peaks])


def measured_timeline(schedule: Schedule, timelines: Sequence[Sequence[TimedAction]],
                      t0_walls: Sequence[float] | None = None) -> SimResult:
    """Every pp rank's `PipelineStepResult.timeline` of one step (rank order) as a `SimResult`, in
    seconds from the first action's start; `t0_walls` (their `t0_wall`) aligns the ranks' clocks
    (default: the ranks started their steps together)."""
    offsets = [w - min(t0_walls) for w in t0_walls] if t0_walls is not None else [0.0] * len(timelines)
    return _as_sim_result(schedule, [[Timed(t.action, o + t.start, o + t.end) for t in tl]
                                     for tl, o in zip(timelines, offsets)])


def _dependencies(schedule: Schedule, a: Action, s: int) -> list[tuple[str, int, int]]:
    S = schedule.num_stages
    if a.kind == "F":
        return [("F", a.microbatch, s - 1)] if s > 0 else []
    if a.kind == "B":
        return [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < S - 1 else [])
    return [("B", a.microbatch, s)]


def measured_overheads(measured: SimResult) -> tuple[float, float]:
    """(t_comm, t_gap) of a measured timeline, in seconds, for `schedules.simulate`: medians of
    - t_comm: over actions whose rank sat idle waiting for an input from another rank (the producer
      ended after this rank's previous action), this action's start minus the producer's end: transfer
      plus the receive's wait and the host time to the action's start;
    - t_gap: over actions that waited for nothing (every input was there when the previous action of
      the rank ended), start minus the previous action's end: the executor's bookkeeping between two
      actions (reaping sends, posting receives), which no action's span includes.
    0.0 where no action is of the kind."""
    sched = measured.schedule
    end: dict[tuple[str, int, int], float] = {}
    for r, tl in enumerate(measured.timeline):
        for t in tl:
            end[(t.action.kind, t.action.microbatch, sched.stage(r, t.action.chunk))] = t.end
    comm, gaps = [], []
    for r, tl in enumerate(measured.timeline):
        for k, t in enumerate(tl):
            prev_end = tl[k - 1].end if k else None
            deps = _dependencies(sched, t.action, sched.stage(r, t.action.chunk))
            remote = [end[d] for d in deps if sched.rank_of(d[2]) != r]
            local = [end[d] for d in deps if sched.rank_of(d[2]) == r] + ([prev_end] if k else [])
            if remote and (not local or max(remote) >= max(local)):
                comm.append(max(0.0, t.start - max(remote)))
            elif k:
                gaps.append(max(0.0, t.start - prev_end))

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return 0.0 if not xs else (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2

    return median(comm), median(gaps)


def simulate_measured(measured: SimResult, *, t_comm: float | None = None, t_gap: float | None = None) -> SimResult:
    """The simulator's prediction for the measured run: the same schedule, every action taking its own
    measured time on its own rank (so the busy time per rank is the measured one and only the idle time
    is predicted), cross-rank dependencies delayed by `t_comm` and consecutive actions of a rank
    separated by `t_gap` (default: `measured_overheads` of the run)."""
    comm_s, gap_s = measured_overheads(measured)
    durations = {(r, t.action): t.end - t.start for r, tl in enumerate(measured.timeline) for t in tl}
    return simulate(measured.schedule, durations=durations, t_comm=comm_s if t_comm is None else t_comm,
                    t_gap=gap_s if t_gap is None else t_gap)
