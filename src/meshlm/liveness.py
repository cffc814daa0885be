"""Which rank stopped: a heartbeat per rank in the launch's store, read when a collective times out.

Responsible for: `Heartbeat`, a daemon thread per training rank that bumps a counter of its own in the
rendezvous store (torch's TCPStore, through a client connection of its own) every `interval_s`, and
`stalled()`, which reads every rank's counter twice a few intervals apart and returns the ranks whose counter
did not move: killed, stopped (SIGSTOP, a debugger), wedged in the kernel. A collective that times out
names only this rank and the group; the trainer adds these -- on gloo and NCCL alike, since the store is not
the collectives' transport. On CUDA the same thread is the step watchdog: NCCL's host-side calls do not time
out (its own watchdog aborts the process at the process group's timeout, which `init_distributed` sets past
ours), so when no step has finished for `timeout_s` it prints the same one-line error, naming the stalled
ranks and the last collective issued, and ends the process.
`blamed_ranks` reads the ranks such an error blames back out of its text (the launcher's last line names them).
Not responsible for: timeouts of gloo's collectives (gloo raises: `comm.CollectiveError`), restarting
anything (the launcher), or serving (its ranks wait for work with a keepalive, `infer/parallel.py`).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from datetime import timedelta

_PREFIX = "meshlm/heartbeat/"
# The clauses that name the ranks to blame in a failed collective's error (this heartbeat's, and the arrival
# record's, `meshlm.stragglers`); the launcher's last line names those ranks rather than the one that noticed.
_BLAME = re.compile(r"(?:not responding|never reached step \d+'s first collective): ranks? (\d+(?:, \d+)*)")


def ranks_clause(ranks: list[int]) -> str:
    """`rank 1` / `ranks 1, 3`: how the clauses above list ranks."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def blamed_ranks(text: str) -> list[int]:
    """The ranks an error names as not responding or never arriving (in order of first mention)."""
    found: list[int] = []
    for match in _BLAME.finditer(text):
        found += [int(r) for r in match.group(1).split(", ") if int(r) not in found]
    return found


class Heartbeat:
    """`Heartbeat(rank, world_size)` under a launcher (MASTER_ADDR/MASTER_PORT name the store); `close()` stops it.

    `store`: the store to beat into (default: a new client of the launch's store, under this attempt's prefix).
    `watchdog_s`: end the process when `progress()` has not been called for that long (None: never)."""

    def __init__(self, rank: int, world_size: int, *, store=None, interval_s: float = 0.5,
                 watchdog_s: float | None = None, describe=lambda: ""):
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self.store = store if store is not None else store_client()
        self.watchdog_s, self.describe = watchdog_s, describe
        self._last_progress = time.monotonic()
        self._closing = threading.Event()
        self._lock = threading.Lock()  # the client serves this thread and the caller's, one request at a time
        self._beat()
        self._thread = threading.Thread(target=self._run, name="meshlm-heartbeat", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        """The main thread got somewhere (a step finished): the watchdog starts counting again."""
        self._last_progress = time.monotonic()

    def counts(self) -> list[int]:
        with self._lock:
            return [int(self.store.add(_PREFIX + str(r), 0)) for r in range(self.world_size)]

    def _beat(self) -> None:
        with self._lock:
            self.store.add(_PREFIX + str(self.rank), 1)

    def stalled(self) -> list[int]:
        """The ranks whose heartbeat did not move over four intervals (this one's always moves)."""
        before = self.counts()
        time.sleep(4 * self.interval_s)
        return [r for r, (a, b) in enumerate(zip(before, self.counts())) if a == b]

    def explain(self) -> str:
        """A clause for an error: which ranks stopped answering, or that all still do."""
        try:
            stalled = self.stalled()
        except Exception as e:  # noqa: BLE001 -- the store itself is gone (rank 0 hosted it): say so
            return f"the ranks' store does not answer ({type(e).__name__}): rank 0's process is gone"
        if not stalled:
            return "every rank's heartbeat still moves: a rank is waiting in another collective (diverged)"
        return f"not responding: {ranks_clause(stalled)}"

    def close(self) -> None:
        self._closing.set()

    def _run(self) -> None:
        while not self._closing.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 -- the store's host is gone; the collectives will say so
                return
            if self.watchdog_s is not None and time.monotonic() - self._last_progress > self.watchdog_s:
                what = self.describe()
                print(f"meshlm: rank {self.rank}: no step finished in {self.watchdog_s:.0f} s{what}; "
                      f"{self.explain()} (parallel.collective_timeout_s bounds the wait)", file=sys.stderr, flush=True)
                os._exit(1)


def store_client():
    """A connection of this thread's own to the launch's store (a client is not shared between threads)."""
    import torch.distributed as dist

    from meshlm.distributed import restart_count

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=30), wait_for_workers=False)
    return dist.PrefixStore(f"meshlm/attempt_{restart_count()}", store)
