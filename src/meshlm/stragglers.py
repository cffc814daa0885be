"""Stragglers: when each rank reaches each step's first collective, and which rank holds the others up.

Responsible for: `ArrivalRecord`, which writes, the moment this rank issues a step's first collective (not a
pipeline's point-to-point sends), how long it worked alone since its previous call completed -- when every
rank was even -- into the launch's store (one key per rank in a ring of a few steps, so the store stays
small); rank 0 reads a step's records after the step (`read`), and a rank whose collective failed reads which
ranks never arrived (`missing`): the rank to blame, not the one that noticed. `StragglerWatch` (plain
arithmetic): per step the spread (slowest minus fastest) and the slowest rank; a rank that took more than
`factor` x the median of the other ranks of its pipeline stage (and `MIN_LATE_S` more) for `patience`
steps in a row is named once in a warning line, and again only after it caught up.
Not responsible for: noting the first collective (`comm_stats.CommStats.begin`), heartbeats (`liveness.py`),
or acting on a straggler (that is the operator's call).

Why time worked alone: wall time alone cannot show a straggler, as the collective evens everyone out (the
fast ranks wait in it); and durations measured on each rank need no clocks that agree across nodes.
"""

from __future__ import annotations

import json
import statistics

from meshlm.liveness import ranks_clause

_KEY = "meshlm/arrival/"
_RING = 8  # steps kept per rank: ranks are never more than a step apart (they meet in every step's collectives)
MIN_LATE_S = 0.05  # below this a rank's lateness is scheduling noise, not a straggler worth a line


def _key(step: int, rank: int) -> str:
    return f"{_KEY}{step % _RING}/{rank}"


class ArrivalRecord:
    """This rank's arrivals in `store` (the launch's; a client of this thread's own), read back by rank 0.

    Store failures never stop training: the record goes quiet instead (metrics then lack the fields)."""

    def __init__(self, store, *, rank: int, world_size: int, stage: int):
        self.store, self.rank, self.world_size, self.stage = store, rank, world_size, stage
        self.step: int | None = None  # the step being run (None between steps: no arrival to note)

    def arrive(self, seconds: float | None) -> None:
        """`CommStats.on_first`: this rank issues the step's first collective, `seconds` after its last call."""
        if self.step is None or self.store is None:
            return
        try:
            self.store.set(_key(self.step, self.rank), json.dumps([self.step, seconds, self.stage]))
        except Exception:  # noqa: BLE001 -- the store's host is gone; the collective will say so
            self.store = None

    def _records(self, step: int, ranks) -> dict[int, tuple[float | None, int]] | None:
        keys = [_key(step, r) for r in ranks]
        if self.store is None or not self.store.check(keys):
            return None
        out = {}
        for r, raw in zip(ranks, self.store.multi_get(keys)):
            got, seconds, stage = json.loads(bytes(raw).decode())
            if got != step:
                return None
            out[r] = (seconds, stage)
        return out

    def read(self, step: int) -> dict[int, tuple[float | None, int]] | None:
        """{rank: (seconds worked alone, pipeline stage)} of `step` once every rank noted it; else None."""
        try:
            return self._records(step, range(self.world_size))
        except Exception:  # noqa: BLE001 -- as in arrive
            self.store = None
            return None

    def explain(self) -> str:
        """A clause for the error of a collective that failed during the step being run: the ranks that never
        reached its first collective (to blame: not the rank that noticed); "" when all did or none can say."""
        missing = self.missing(self.step) if self.step is not None else None
        return f"never reached step {self.step}'s first collective: {ranks_clause(missing)}" if missing else ""

    def missing(self, step: int) -> list[int] | None:
        """The ranks that never reached `step`'s first collective; None when the store cannot say."""
        try:
            return [r for r in range(self.world_size) if self._records(step, [r]) is None]
        except Exception:  # noqa: BLE001 -- as in arrive
            return None


class StragglerWatch:
    """Rank 0's view of the arrivals, step after step: `observe(step, records)` -> (metrics, warning or None)."""

    def __init__(self, *, factor: float, patience: int):
        self.factor, self.patience = factor, patience
        self.late_steps: dict[int, int] = {}  # rank -> consecutive steps it was late
        self.named: set[int] = set()  # ranks named and not caught up since

    def observe(self, step: int, records: dict[int, tuple[float | None, int]]) -> tuple[dict, str | None]:
        seconds = {r: s for r, (s, _) in records.items() if s is not None}
        if len(seconds) < 2 or len(seconds) < len(records):
            return {}, None
        stages: dict[int, list[int]] = {}
        for r, (_, stage) in records.items():
            stages.setdefault(stage, []).append(r)
        spread = max(max(seconds[r] for r in rs) - min(seconds[r] for r in rs) for rs in stages.values())
        slowest = max(seconds, key=lambda r: (seconds[r], -r))
        late = {r: self._late(seconds[r], [seconds[o] for o in rs if o != r])
                for rs in stages.values() for r in rs}
        for r, is_late in late.items():
            self.late_steps[r] = self.late_steps.get(r, 0) + 1 if is_late else 0
            if not is_late:
                self.named.discard(r)
        new = sorted(r for r, n in self.late_steps.items()
                     if self.factor and n >= self.patience and r not in self.named)
        self.named.update(new)
        return {"arrival_spread_s": spread, "slowest_rank": slowest}, self._warning(step, new, records)

    def _late(self, mine: float, others: list[float]) -> bool:
        if not others:
            return False
        median = statistics.median(others)
        return mine > self.factor * median and mine - median > MIN_LATE_S

    def _warning(self, step: int, ranks: list[int], records) -> str | None:
        if not ranks:
            return None
        each = []
        for r in ranks:
            stage = records[r][1]
            others = [s for o, (s, st) in records.items() if st == stage and o != r]
            each.append(f"rank {r} ({records[r][0]:.3f} s, the others' median {statistics.median(others):.3f} s)")
        return (f"meshlm: straggler at step {step}: {', '.join(each)} worked alone before the step's first "
                f"collective more than {self.factor:g}x as long as the others for {self.patience} steps in a row; "
                "every rank waits for it (parallel.straggler_factor / straggler_steps)")
