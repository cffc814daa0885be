"""What moved over each mesh axis: calls, bytes and seconds per (op, axis), and optionally every call.

Responsible for: `CommStats`, which a `Mesh` owns and every collective of `meshlm.comm` records into (the
byte convention is documented there), its per-axis summaries for the logs, and the traces that
`meshlm.nccl_order` replays under NCCL's ordering rules.
Not responsible for: communicating (`meshlm.comm`) or building groups (`meshlm.mesh`).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from meshlm.nccl_order import TracedOp, TracedWait


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, other: "OpStats") -> None:
        self.calls += other.calls
        self.bytes += other.bytes
        self.seconds += other.seconds


@dataclass(frozen=True)
class CommEvent:
    """One counted call (kept only when `CommStats(keep_events=True)`)."""

    op: str
    axis: str
    bytes: int


@dataclass
class CommStats:
    """Calls, bytes and seconds per (op, axis). Owned by its creator (a `Mesh` holds one as `.stats`).

    `keep_events=True` also keeps the ordered list of calls (tests assert exact per-call sizes);
    `keep_trace=True` keeps what NCCL would run -- every op with its communicator, peers and tags, and every
    wait -- for `meshlm.nccl_order.replay` (a GPU's ordering rules checked on CPU).
    """

    keep_events: bool = False
    keep_trace: bool = False
    ops: dict[tuple[str, str], OpStats] = field(default_factory=lambda: defaultdict(OpStats))
    events: list[CommEvent] = field(default_factory=list)
    trace: list[TracedOp | TracedWait] = field(default_factory=list)
    num_traced: int = field(default=0, repr=False)  # TracedOps in `trace`
    last: tuple[str, str] | None = field(default=None, repr=False)  # (op, axis) of the latest call, for errors
    # Arrivals (`meshlm.stragglers`): when the first collective since `reset` (a step's) began, when the latest
    # call completed (perf_counter), and who to tell, at that first one, how long this rank worked since then.
    first_at: float | None = field(default=None, repr=False)
    done_at: float | None = field(default=None, repr=False)
    on_first: Callable[[float | None], None] | None = field(default=None, repr=False)

    # On a GPU the host only queues a collective, so host time says nothing of its duration: there a
    # `device_clock()` records a marker on the current stream and returns it (a CUDA event: `.synchronize()`,
    # `.elapsed_time(later)` in ms), each call's seconds are the span between a marker before it is issued and one
    # after its wait, and the spans are read when the counts are (once per step), not in the hot loop.
    device_clock: Callable[[], object] | None = field(default=None, repr=False)
    spans: list = field(default_factory=list, repr=False)
    # Several threads of one rank may count at once (disaggregated serving's prefill and decode on rank 0).
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def mark(self):
        """A device marker now (None without a device clock: host time is counted instead)."""
        return self.device_clock() if self.device_clock is not None else None

    def add_span(self, op: str, axis: str, start, end) -> None:
        self.spans.append((op, axis, start, end))
        self.done_at = time.perf_counter()

    def _settle(self) -> None:
        for op, axis, start, end in self.spans:
            end.synchronize()
            self.ops[(op, axis)].seconds += start.elapsed_time(end) / 1e3
        self.spans.clear()

    def begin(self, *, collective: bool) -> None:
        """A call is about to be issued (`collective`: not a point-to-point send or receive); the first
        collective since `reset` tells `on_first` the seconds since the latest call completed (None: none has)."""
        if not collective or self.first_at is not None:
            return
        self.first_at = time.perf_counter()
        if self.on_first is not None:
            self.on_first(None if self.done_at is None else self.first_at - self.done_at)

    def record(self, op: str, axis: str, nbytes: int, seconds: float = 0.0) -> None:
        self.last = (op, axis)
        self.done_at = time.perf_counter()  # a synchronous call completed (an asynchronous one: again at its wait)
        with self._lock:
            s = self.ops[(op, axis)]
            s.calls += 1
            s.bytes += nbytes
            s.seconds += seconds
            if self.keep_events:
                self.events.append(CommEvent(op, axis, nbytes))

    def add_seconds(self, op: str, axis: str, seconds: float) -> None:
        self.ops[(op, axis)].seconds += seconds
        self.done_at = time.perf_counter()  # an asynchronous call's wait returned

    def trace_op(self, op: TracedOp) -> int | None:
        """Keep `op` (when keep_trace); returns its number, for `trace_wait`."""
        if not self.keep_trace:
            return None
        with self._lock:
            self.trace.append(op)
            self.num_traced += 1
            return self.num_traced - 1

    def trace_wait(self, index: int | None) -> None:
        if self.keep_trace and index is not None:
            self.trace.append(TracedWait(index))

    def reset(self) -> None:
        self.first_at = None  # the next collective is the next step's first (done_at stays: its reference)
        self.ops.clear()
        self.spans.clear()
        self.events.clear()
        self.trace.clear()
        self.num_traced = 0

    def snapshot(self) -> dict[tuple[str, str], OpStats]:
        """A copy, safe to keep while counting goes on (e.g. to diff two steps)."""
        self._settle()
        return {k: OpStats(v.calls, v.bytes, v.seconds) for k, v in self.ops.items()}

    def total(self, *, op: str | None = None, axis: str | None = None) -> OpStats:
        self._settle()
        out = OpStats()
        for (o, a), s in self.ops.items():
            if (op is None or o == op) and (axis is None or a == axis):
                out.add(s)
        return out

    def by_axis(self) -> dict[str, OpStats]:
        self._settle()
        out: dict[str, OpStats] = defaultdict(OpStats)
        for (_, axis), s in self.ops.items():
            out[axis].add(s)
        return dict(out)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per axis: {"calls", "mb", "seconds"} -- flat numbers for a metrics log line."""
        return {axis: {"calls": s.calls, "mb": s.bytes / 2**20, "seconds": s.seconds}
                for axis, s in sorted(self.by_axis().items())}

    def format(self) -> str:
        parts = [f"{axis}: {v['calls']} calls {v['mb']:.2f} MB {v['seconds'] * 1e3:.1f} ms"
                 for axis, v in self.summary().items()]
        return " | ".join(parts) if parts else "no communication"
