"""Processes on this machine: free ports, the tree of processes below one, and stopping such a tree.

Responsible for: ports of 127.0.0.1 that were free a moment ago, below the kernel's own range (`free_ports`,
`free_port`); the process tree as Linux's /proc shows it (`children`, `descendants`, `alive`, `cpu_seconds`); and
`stop_tree`, which stops processes started in sessions of their own together with everything below them -- the
router's replicas, the emulated cluster's node commands, and the servers and launchers the tests and benchmarks
start.
Not responsible for: starting processes or ranks (torch's launcher, `launch.py`).

Why the tree and not only the process group: torch's launcher starts each rank in a session of its own, so a
signal to the launcher's process group does not reach its ranks. Without /proc (not Linux) the tree readers
find nothing (`children` [], `alive` False, `cpu_seconds` 0) and `stop_tree` signals the process groups only.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

KILL_WAIT_S = 30.0  # after SIGKILL, how long `stop_tree` waits for each process it started to be reaped


def ephemeral_ports() -> tuple[int, int]:
    """The ports the kernel hands out itself (to a bind to port 0 and to a connect's own end), first and last:
    /proc/sys/net/ipv4/ip_local_port_range, else Linux's default."""
    try:
        first, last = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


LOWEST_PICKED_PORT = 10000  # `free_ports` picks at or above this, below the kernel's own ports


def free_ports(count: int, *, avoid: Iterable[int] = ()) -> list[int]:
    """`count` distinct TCP ports of 127.0.0.1 that were free a moment ago, none in `avoid` (ports a process about
    to start will bind itself): bound together, so no two are equal, then released. They are drawn at random below
    the ports the kernel hands out itself (`ephemeral_ports`): a port is chosen now and bound later (a replica's
    HTTP port, a rendezvous), and in between every process starting ranks binds and connects sockets of its own
    (gloo's pairs, stores' clients); from the kernel's range one of those could take it. Another process picking
    ports the same way could still take one before the caller binds it. Where that range leaves no room below it,
    the kernel chooses (bind to port 0)."""
    avoid = frozenset(avoid)
    first = ephemeral_ports()[0]
    draw = random.SystemRandom()  # not the seeded global generator: two processes must not draw alike
    tries = 50 * count if first - LOWEST_PICKED_PORT >= 100 * count else 0  # bounded: bound ports are passed over
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count and tries:
            tries -= 1
            port = draw.randrange(LOWEST_PICKED_PORT, first)
            if port in avoid:
                continue
            s = stack.enter_context(socket.socket())
            with contextlib.suppress(OSError):  # in use (our own picks included: they stay bound until the end)
                s.bind(("127.0.0.1", port))
                ports.append(port)
        while len(ports) < count:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] not in avoid:  # one in `avoid` stays bound, so the next bind gets another
                ports.append(s.getsockname()[1])
        return ports


def free_port() -> int:
    """One TCP port of 127.0.0.1 that was free a moment ago (`free_ports(1)`)."""
    return free_ports(1)[0]


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name -- state, parent id, ... (`man 5 proc`) -- or None where
    the process is gone. The name is in parentheses and may itself hold spaces and ')': the last ')' ends it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children_of_all() -> dict[int, list[int]]:
    """{parent id: the ids of its children, ascending} of every process, from one scan of /proc."""
    out: dict[int, list[int]] = {}
    for entry in sorted((int(e) for e in os.listdir("/proc") if e.isdigit()) if os.path.isdir("/proc") else []):
        fields = _stat(entry)
        if fields is not None and len(fields) > 1:
            out.setdefault(int(fields[1]), []).append(entry)
    return out


def children(pid: int) -> list[int]:
    """The ids of the processes whose parent is `pid`, ascending, zombies included (e.g. a launcher's ranks)."""
    return _children_of_all().get(pid, [])


def descendants(pid: int) -> list[int]:
    """The ids of every process below `pid` -- its children, theirs, and so on -- level by level, each level
    ascending, zombies included. From one scan of /proc: a snapshot of one moment."""
    tree = _children_of_all()
    out, level = [], [pid]
    while level:
        level = [c for p in level for c in tree.get(p, [])]
        out += level
    return out


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (one that has exited and waits for its parent to reap it)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def cpu_seconds(pids: Iterable[int]) -> float:
    """The CPU seconds (user + system) the processes `pids` have used so far; those gone count 0."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None and len(fields) > 12:
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)
    return total


def _signal(pid: int, sig: int) -> None:
    """`os.kill(pid, sig)` (a negative `pid`: that process group), where nothing is there to signal doing nothing."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop_tree(procs: subprocess.Popen | Sequence[subprocess.Popen], timeout_s: float) -> dict:
    """Stop `procs` -- one `subprocess.Popen` or several, each started with start_new_session=True, so that its id
    is its process group's -- and every process below them. In order:

    1. notes the processes below each of `procs` that still runs (`descendants`);
    2. with `timeout_s` > 0: SIGTERM to each process group (whether or not its leader still runs: it also reaches
       what a leader left behind in its group), then waits until all of `procs` and of the noted processes have
       ended, `timeout_s` at most for all of them together;
    3. SIGKILL to each process group and to each noted process still running (with `timeout_s` 0 at once, no
       SIGTERM first); waits for each of `procs` (KILL_WAIT_S at most each: only a process stuck in the kernel
       takes longer) and up to 1 s for the noted processes to end.

    Returns {"child_processes": how many processes step 1 noted, "killed_after_timeout": how many of those step 3
    killed, "left_running": how many of those still run at the end (0 unless stuck in the kernel),
    "groups_killed": how many of `procs` were still running at step 3}.
    """
    procs = [procs] if isinstance(procs, subprocess.Popen) else list(procs)
    below = [pid for p in procs if p.poll() is None for pid in descendants(p.pid)]
    if timeout_s > 0:
        for p in procs:
            _signal(-p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        while any(alive(pid) for pid in below) and time.monotonic() < deadline:
            time.sleep(0.05)
    leaders = [p for p in procs if p.poll() is None]
    stragglers = [pid for pid in below if alive(pid)]
    for pid in [*(-p.pid for p in procs), *stragglers]:
        _signal(pid, signal.SIGKILL)
    for p in leaders:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=KILL_WAIT_S)
    gone_by = time.monotonic() + 1.0
    while any(alive(pid) for pid in stragglers) and time.monotonic() < gone_by:
        time.sleep(0.02)
    return {"child_processes": len(below), "killed_after_timeout": len(stragglers),
            "left_running": sum(alive(pid) for pid in stragglers), "groups_killed": len(leaders)}
