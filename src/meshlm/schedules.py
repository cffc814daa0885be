"""Pipeline schedules as data, and a simulator that executes them (torch-free).

Responsible for: the ordered list of actions each pipeline rank runs in one training step for
GPipe, 1F1B, interleaved 1F1B (Megatron order) and zero-bubble ZB-H1 (`build_schedule`); checking
that a schedule runs every (microbatch, stage) exactly once and cannot deadlock; the layer split over stages
(`split_layers`, and `balanced_split`: the one default split of the planner and the runtime); simulating it with
given per-action times (`simulate`: per-rank busy and idle time, makespan, bubble, peak activations
held); and drawing the timeline (`plot_schedule`, matplotlib imported lazily).
Not responsible for: running a model (the pipeline runtime executes these action lists, sending
and receiving where the stage of the next action lives on another rank), or choosing the schedule
(the planner, whose closed-form bubble formulas `tests/test_schedules.py` checks against `simulate`).

Conventions. There are S = pp * pp_chunks stages; rank r holds chunks c = 0..v-1, i.e. stages
c * pp + r (Megatron's interleaving; v = 1 is the plain split). Actions:
  F  forward of one microbatch through one chunk
  B  backward: for GPipe/1F1B/interleaved the full backward (input and weight gradients, fused);
     for zero_bubble only the input gradient, which is all the previous stage waits for
  W  weight gradient (zero_bubble only), deferred to fill what would be bubble
Dependencies (sends and receives are implied by stage adjacency): F(mb, s) after F(mb, s-1);
B(mb, s) after B(mb, s+1) and after F(mb, s); W(mb, s) after B(mb, s). A rank runs its list in
order, one action at a time. Activations of (mb, chunk) are held from F until the backward that
frees them (B when fused, W when split, as W still reads them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from meshlm.rules import PP_SCHEDULES, check_schedule

SCHEDULES = PP_SCHEDULES  # parallel.pp_schedule (`meshlm.rules`)
KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" | "B" | "W"
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists of one training step."""

    name: str
    pp: int
    num_microbatches: int
    pp_chunks: int
    split_backward: bool  # True: B is the input gradient only and W runs separately
    ranks: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return self.pp * self.pp_chunks

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def validate(self) -> None:
        """Raise ValueError unless every (microbatch, stage) has exactly one F and one B (and one W
        when the backward is split) and each rank runs only its own chunks."""
        if len(self.ranks) != self.pp:
            raise ValueError(f"schedule {self.name!r} has {len(self.ranks)} rank lists for pp={self.pp}")
        kinds = KINDS if self.split_backward else ("F", "B")
        seen: dict[tuple[str, int, int], int] = {}
        for rank, actions in enumerate(self.ranks):
            for a in actions:
                if a.kind not in kinds:
                    raise ValueError(f"schedule {self.name!r} rank {rank}: action {a} has kind {a.kind!r}; "
                                     f"allowed {list(kinds)}")
                if not (0 <= a.microbatch < self.num_microbatches and 0 <= a.chunk < self.pp_chunks):
                    raise ValueError(f"schedule {self.name!r} rank {rank}: action {a} is out of range "
                                     f"(microbatches {self.num_microbatches}, chunks {self.pp_chunks})")
                key = (a.kind, a.microbatch, self.stage(rank, a.chunk))
                seen[key] = seen.get(key, 0) + 1
        for kind in kinds:
            for mb in range(self.num_microbatches):
                for s in range(self.num_stages):
                    n = seen.get((kind, mb, s), 0)
                    if n != 1:
                        raise ValueError(f"schedule {self.name!r}: {kind} of microbatch {mb} on stage {s} "
                                         f"runs {n} times; every one must run exactly once")

    def steady_pairs(self, rank: int) -> range:
        """Indices in rank `rank`'s list where a forward-backward pair of the steady state starts, whose
        outputs and next inputs travel in one four-way group (interleaved only; empty otherwise)."""
        if self.name != "interleaved":
            return range(0)
        warmup = interleaved_warmup(self.pp, self.num_microbatches, self.pp_chunks, rank)
        return range(warmup, warmup + 2 * (self.num_microbatches * self.pp_chunks - warmup), 2)

    def peak_activations(self) -> list[int]:
        """Per rank, the most (microbatch, chunk) activations held at once (order only, not timing)."""
        free_kind = "W" if self.split_backward else "B"
        peaks = []
        for actions in self.ranks:
            held = peak = 0
            for a in actions:
                if a.kind == "F":
                    held += 1
                    peak = max(peak, held)
                elif a.kind == free_kind:
                    held -= 1
            peaks.append(peak)
        return peaks


def split_layers(num_layers: int, num_stages: int, *, last_stage_layers: int | None = None) -> list[int]:
    """Layers of each of `num_stages` contiguous stages (stage s = chunk * pp + rank).

    Uneven counts are spread, the earlier stages taking one more: the later ones hold fewer
    activations' worth of work anyway and the last one also runs the output head. `last_stage_layers`
    pins the last stage (the planner lightens it to balance the head); the rest is spread the same way.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"num_layers={num_layers} must be >= num_stages={num_stages} >= 1 (pp * pp_chunks); "
                         "use fewer stages")
    if last_stage_layers is None:
        base, extra = divmod(num_layers, num_stages)
        return [base + (s < extra) for s in range(num_stages)]
    if num_stages == 1:
        if last_stage_layers != num_layers:
            raise ValueError(f"last_stage_layers={last_stage_layers} must equal num_layers={num_layers} "
                             "with one stage")
        return [num_layers]
    rest = num_layers - last_stage_layers
    if last_stage_layers < 0 or rest < num_stages - 1:
        raise ValueError(f"last_stage_layers={last_stage_layers} must leave at least one of num_layers="
                         f"{num_layers} layers for each of the other {num_stages - 1} stages")
    return split_layers(rest, num_stages - 1) + [last_stage_layers]


def stage_loads(counts: list[int], *, pp: int, pp_chunks: int = 1, head_units: float = 0.0,
                embed_units: float = 0.0) -> tuple[list[int], float]:
    """(blocks per rank, the busiest rank's load in block units) of per-stage `counts` (stage order,
    stage s = chunk * pp + rank): rank 0 also runs the embedding (`embed_units`), rank pp - 1 the final
    norm, output head and loss (`head_units`)."""
    assert len(counts) == pp * pp_chunks, (counts, pp, pp_chunks)
    per_rank = [sum(counts[c * pp + r] for c in range(pp_chunks)) for r in range(pp)]
    loads = [float(n) for n in per_rank]
    loads[0] += embed_units
    loads[-1] += head_units
    return per_rank, max(loads)


def balanced_split(num_layers: int, *, pp: int, pp_chunks: int = 1, head_units: float = 0.0,
                   embed_units: float = 0.0, min_blocks: int = 1) -> list[int]:
    """The default blocks per stage (stage order), for the planner and the runtime alike.

    The rule: every stage keeps at least `min_blocks` = 1 block (the runtime does not run a stage
    without blocks, so neither the runtime nor the planner passes 0; 0 lets the last stage hold the
    head alone, the planner's choice before this rule was shared). The last stage (which also runs
    the output head, worth `head_units` blocks of compute) takes the block count that minimises the
    busiest rank's load; with `embed_units` > 0 (and >= 3 stages) the first stage's count is chosen
    the same way; the other stages share the rest as `split_layers` does, earlier stages taking the
    extra blocks. Ties go to the fewest blocks on any rank (memory follows blocks), then to the
    lightest last (and first) stage, which also holds the head's parameters and logits (so 10 blocks
    over 4 stages with no head cost: [3, 3, 3, 1], not [3, 3, 2, 2]; the busiest rank runs 3 either
    way). Units are compute relative to one average block: forward FLOPs per token at the training
    sequence length (`meshlm.models.stats.pipeline_units`).
    """
    stages = pp * pp_chunks
    if stages < 1 or num_layers < stages:
        raise ValueError(f"num_layers={num_layers} must be >= num_stages={stages} >= 1 (pp * pp_chunks); "
                         "use fewer stages")
    if head_units < 0 or embed_units < 0:
        raise ValueError(f"head_units={head_units} and embed_units={embed_units} must be >= 0")
    if stages == 1:
        return [num_layers]
    top = -(-num_layers // stages)  # ceil: a lightened end stage never needs more than the even share
    firsts: list[int | None] = list(range(min_blocks, top + 1)) if embed_units > 0 and stages >= 3 else [None]
    if min_blocks not in (0, 1):
        raise ValueError(f"min_blocks={min_blocks} must be 0 or 1")
    best = None
    for last in range(min_blocks, top + 1):
        for first in firsts:
            rest = num_layers - last - (first or 0)
            middle = stages - 1 - (first is not None)
            if rest < middle:
                continue
            counts = ([first] if first is not None else []) + split_layers(rest, middle) + [last]
            per_rank, load = stage_loads(counts, pp=pp, pp_chunks=pp_chunks, head_units=head_units,
                                         embed_units=embed_units)
            key = (round(load, 9), max(per_rank))
            if best is None or key < best[0]:
                best = (key, counts)
    assert best is not None
    return best[1]


def _gpipe(pp: int, m: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(pp)]


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    return [_warmup_steady_cooldown(m, min(pp - r - 1, m), Action) for r in range(pp)]


def _warmup_steady_cooldown(total: int, warmup: int, action) -> list[Action]:
    """`warmup` forwards, then one forward and one backward at a time, then the remaining backwards:
    1F1B's order over `total` (virtual) microbatches, `action(kind, k)` naming the k-th of each kind."""
    acts = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        acts += [action("F", warmup + k), action("B", k)]
    return acts + [action("B", k) for k in range(total - warmup, total)]


def interleaved_warmup(pp: int, m: int, v: int, rank: int) -> int:
    """Forwards rank `rank` runs before its first backward in the interleaved schedule."""
    return min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: virtual microbatch k runs microbatch (k // (p v)) p + k % p on
    chunk (k // p) % v (backward: chunks in reverse). Rank r warms up with 2 (p - r - 1) + (v - 1) p
    forwards so the first backward's inputs have arrived by the time it is needed."""
    total = m * v

    def action(kind: str, k: int) -> Action:
        group, pos = divmod(k, pp * v)
        chunk = pos // pp
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, group * pp + pos % pp, chunk)

    return [_warmup_steady_cooldown(total, interleaved_warmup(pp, m, v, r), action) for r in range(pp)]


def _zero_bubble_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B's order with the backward split, and rank r running the weight
    gradient W of microbatch k only after the input gradient B of microbatch k + r. The B chain that
    the upstream ranks wait for then runs without W in its way, and the deferred W's fill what 1F1B
    leaves idle in the cool-down. Rank r holds at most (p - r) + r = p microbatches: 1F1B's peak
    (rank 0's), now on every rank. Bubble (p - 1)(F + B - W) when W <= min(F, B) and m >= p."""
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        next_w = 0

        def weights_up_to(k: int) -> list[Action]:
            nonlocal next_w
            out = []
            while next_w <= k - r:
                out.append(Action("W", next_w))
                next_w += 1
            return out

        for k in range(m - warmup):
            acts += [Action("F", warmup + k), Action("B", k)] + weights_up_to(k)
        for k in range(m - warmup, m):
            acts += [Action("B", k)] + weights_up_to(k)
        acts += [Action("W", k) for k in range(next_w, m)]
        ranks.append(acts)
    return ranks


def build_schedule(name: str, *, pp: int, num_microbatches: int, pp_chunks: int = 1) -> Schedule:
    """The per-rank action lists of schedule `name` (one of SCHEDULES), validated."""
    check_schedule(name, pp, num_microbatches, pp_chunks)  # the refusals live in `meshlm.rules`
    m = num_microbatches
    if name == "gpipe":
        ranks = _gpipe(pp, m)
    elif name == "1f1b":
        ranks = _one_f_one_b(pp, m)
    elif name == "interleaved":
        ranks = _interleaved(pp, m, pp_chunks)
    else:
        ranks = _zero_bubble_h1(pp, m)
    sched = Schedule(name=name, pp=pp, num_microbatches=m, pp_chunks=pp_chunks,
                     split_backward=name == "zero_bubble", ranks=tuple(tuple(r) for r in ranks))
    sched.validate()
    return sched


# --------------------------------------------------------------------------------------------
# Point to point: which sends and receives go together
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One send or receive between pipeline ranks of one microbatch: the activation ("act") going into
    `stage`, or the gradient ("grad") of the output of `stage` coming back to it."""

    kind: str  # "send" | "recv"
    peer: int  # the other pipeline rank
    payload: str  # "act" | "grad"
    stage: int  # the stage that receives it
    microbatch: int


def forward_only_actions(pp: int, pp_chunks: int, num_microbatches: int) -> tuple[Action, ...]:
    """A rank's actions when only forwards run (validation): the interleaved schedule's order without its
    backwards -- pp microbatches at a time through one chunk, then the same through the next -- which keeps
    every rank busy and never makes a send wait on its own rank's later receive."""
    return tuple(Action("F", mb, c) for first in range(0, num_microbatches, pp) for c in range(pp_chunks)
                 for mb in range(first, min(first + pp, num_microbatches)))


def exchanges(actions: tuple[Action, ...], *, rank: int, pp: int, num_stages: int,
              pairs: range = range(0)) -> list[list[Message]]:
    """The point-to-point groups one rank issues around its `actions`: group i (0 <= i <= len(actions)) goes
    out after action i-1 and before action i, and holds the output of action i-1 (sent on) together with
    the input of action i (received) -- Megatron's send_forward_recv_backward pairing, which interleaved
    schedules make a send and a receive to different neighbours. Both in ONE group is what NCCL needs: a
    send completes only once its receive runs, and each communicator runs a rank's groups in order, so a
    send issued in a group of its own, or behind a receive of a later action, can wait on a peer that
    waits on it (`tests/test_nccl_order.py` replays every schedule under these rules)."""

    def stage(a: Action) -> int:
        return a.chunk * pp + rank

    def output(a: Action) -> Message | None:
        s = stage(a)
        if a.kind == "F" and s < num_stages - 1:
            return Message("send", (s + 1) % pp, "act", s + 1, a.microbatch)
        if a.kind == "B" and s > 0:
            return Message("send", (s - 1) % pp, "grad", s - 1, a.microbatch)
        return None

    def input_of(a: Action) -> Message | None:
        s = stage(a)
        if a.kind == "F" and s > 0:
            return Message("recv", (s - 1) % pp, "act", s, a.microbatch)
        if a.kind == "B" and s < num_stages - 1:
            return Message("recv", (s + 1) % pp, "grad", s, a.microbatch)
        return None

    # Units: one action, or a forward and a backward of the steady state (`pairs`: where each starts; the
    # interleaved schedule's, where Megatron exchanges both outputs and both next inputs in one group).
    units, i = [], 0
    while i < len(actions):
        n = 2 if i in pairs else 1
        units.append(list(range(i, i + n)))
        i += n
    groups: list[list[Message]] = [[] for _ in range(len(actions) + 1)]
    for u, unit in enumerate(units):
        before = units[u - 1] if u > 0 else []
        sent = [output(actions[j]) for j in before]
        received = [input_of(actions[j]) for j in unit]
        groups[unit[0]] = [m for m in (*sent, *received) if m is not None]
    groups[-1] = [m for m in (output(actions[j]) for j in units[-1]) if m is not None] if units else []
    return groups


# --------------------------------------------------------------------------------------------
# Simulation
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """What one simulated step looks like. Times are in the units of the per-action times."""

    schedule: Schedule
    timeline: list[list[Timed]]  # per rank, in execution order
    busy: list[float]  # per rank
    idle: list[float]  # per rank: makespan - busy
    makespan: float
    bubble: float  # idle time of the busiest rank (the planner's `pipeline_bubble`)
    bubble_fraction: float  # bubble / busy time of the busiest rank ((p-1)/m for 1F1B)
    peak_activations: list[int]  # per rank, (microbatch, chunk) activations held at once
    peak_inflight: list[float] = field(default_factory=list)  # the same in whole microbatches (/ v)
    bubble_slots: list[int] | None = None  # per-rank idle as whole slots when every time is an integer


def simulate(schedule: Schedule, *, t_fwd: float = 1.0, t_bwd_input: float = 1.0, t_bwd_weight: float = 1.0,
             t_comm: float = 0.0, t_gap: float = 0.0,
             durations: Mapping[tuple[int, Action], float] | None = None) -> SimResult:
    """Execute `schedule` with the given times of one action (one microbatch through one chunk).

    A fused backward (every schedule but zero_bubble) takes t_bwd_input + t_bwd_weight. `t_comm` is
    added to a dependency whose producer is on another rank. `t_gap` is host time between two actions
    of one rank (bookkeeping outside the actions: it delays the next action but is not busy time).
    `durations` maps (rank, action) to that action's own time (a measured run), overriding the three
    per-kind times for the actions it names. Raises ValueError on a deadlock (no rank can start its
    next action) or an invalid schedule.
    """
    schedule.validate()
    durations = dict(durations or {})
    for name, value in (("t_fwd", t_fwd), ("t_bwd_input", t_bwd_input), ("t_bwd_weight", t_bwd_weight),
                        ("t_comm", t_comm), ("t_gap", t_gap), *((f"durations[{k}]", x) for k, x in durations.items())):
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    pp, S = schedule.pp, schedule.num_stages
    duration = {"F": t_fwd, "W": t_bwd_weight,
                "B": t_bwd_input if schedule.split_backward else t_bwd_input + t_bwd_weight}
    finish: dict[tuple[str, int, int], float] = {}
    pos = [0] * pp
    free_at = [0.0] * pp
    timeline: list[list[Timed]] = [[] for _ in range(pp)]

    def deps(a: Action, s: int) -> list[tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.microbatch, s - 1)] if s > 0 else []
        if a.kind == "B":
            return [("F", a.microbatch, s)] + ([("B", a.microbatch, s + 1)] if s < S - 1 else [])
        return [("B", a.microbatch, s)]

    # Each rank runs its list in order, so an action's start is fixed as soon as its dependencies
    # have finish times: sweep the ranks until all lists are done, or no rank can move (deadlock).
    remaining = sum(len(acts) for acts in schedule.ranks)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(schedule.ranks[r]):
                a = schedule.ranks[r][pos[r]]
                s = schedule.stage(r, a.chunk)
                needed = deps(a, s)
                if any(d not in finish for d in needed):
                    break
                start = max([free_at[r] + (t_gap if pos[r] else 0.0)]
                            + [finish[d] + (t_comm if schedule.rank_of(d[2]) != r else 0.0) for d in needed])
                end = start + durations.get((r, a), duration[a.kind])
                finish[(a.kind, a.microbatch, s)] = end
                timeline[r].append(Timed(a, start, end))
                free_at[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {schedule.ranks[r][pos[r]]}" for r in range(pp)
                              if pos[r] < len(schedule.ranks[r]))
            raise ValueError(f"schedule {schedule.name!r} deadlocks: {stuck} wait on each other")

    makespan = max(free_at)
    busy = [sum(t.end - t.start for t in tl) for tl in timeline]
    idle = [makespan - b for b in busy]
    top = max(busy)
    peaks = schedule.peak_activations()
    times = (t_fwd, t_bwd_input, t_bwd_weight, t_comm, t_gap, *durations.values())
    slots = [round(i) for i in idle] if all(float(x).is_integer() for x in times) else None
    return SimResult(schedule=schedule, timeline=timeline, busy=busy, idle=idle, makespan=makespan,
                     bubble=makespan - top, bubble_fraction=(makespan - top) / top if top else 0.0,
                     peak_activations=peaks, peak_inflight=[p / schedule.pp_chunks for p in peaks],
                     bubble_slots=slots)


# --------------------------------------------------------------------------------------------
# Picture
# --------------------------------------------------------------------------------------------

_COLORS = {"F": "#4c8be0", "B": "#5cb85c", "W": "#f0a030"}


def plot_schedule(sim: SimResult, path: str, *, title: str | None = None) -> str:
    """Write a PNG timeline: one row per rank, a box per action labelled with its microbatch (and
    chunk, lighter shades for later chunks). Needs matplotlib (the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError("plotting a schedule needs matplotlib: pip install matplotlib") from exc
    sch = sim.schedule
    fig, ax = plt.subplots(figsize=(max(6.0, sim.makespan * 0.35), 0.6 * sch.pp + 1.4))
    for r, tl in enumerate(sim.timeline):
        for t in tl:
            a = t.action
            alpha = 1.0 - 0.45 * a.chunk / max(1, sch.pp_chunks - 1) if sch.pp_chunks > 1 else 1.0
            ax.barh(r, t.end - t.start, left=t.start, height=0.8, color=_COLORS[a.kind], alpha=alpha,
                    edgecolor="black", linewidth=0.5)
            label = str(a.microbatch) + (f".{a.chunk}" if sch.pp_chunks > 1 else "")
            ax.text((t.start + t.end) / 2, r, label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(sch.pp), [f"rank {r}" for r in range(sch.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, sim.makespan)
    ax.set_xlabel("time")
    name = sch.name + (f" v={sch.pp_chunks}" if sch.pp_chunks > 1 else "")
    ax.set_title(title or f"{name}: pp={sch.pp}, m={sch.num_microbatches}, bubble {sim.bubble:g} "
                          f"({sim.bubble_fraction:.1%}), peak in flight {max(sim.peak_inflight):g}")
    kinds = KINDS if sch.split_backward else ("F", "B")
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)  # outside the axes: never hides a box
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
