"""An emulated two-tier cluster on this one machine: nodes as Linux network namespaces, one shaped link each.

Responsible for: `EmulatedCluster`, a context manager that creates one network namespace per node (its
ranks talk to each other over that namespace's loopback, at memory speed) and joins the nodes through a
bridge in a "switch" namespace of its own, every node on it by one veth pair whose two ends are shaped
with `tc` (tbf, or netem where the kernel has it and a latency is asked for) to the inter-node rate:
each node's link carries at most that rate in each direction, like one NIC per node (64 KiB packets, as
a NIC's segmentation offload hands the stack, and a queue deep enough that TCP is never dropped). Also: parsing the
rates and durations users give (`parse_rate`, `parse_duration`), refusing where the host cannot do it
(not root, `ip` or `tc` missing, no netem for a latency), entering a node from a process about to
start a rank (`enter_node`), running one command per node (`run_on_nodes`), and the bytes each node's link
carried (`link_bytes`). Everything created (namespaces, and with them their links and qdiscs) is removed on
exit, on Ctrl-C, SIGTERM and on failure.
Not responsible for: launching ranks (each node runs `meshlm train|generate|serve --nnodes ... --node-rank i`,
i.e. torch's launcher) or measuring links (`planner/calibrate.py`).

Addresses: 10.213.0.<node + 1>/24, only inside the namespaces created here (each has its own routing
table), so nothing of the host's network is touched. Ranks bind gloo to the node's link interface
(GLOO_SOCKET_IFNAME, torch's setting): a peer on the same node is then reached through the local route
(loopback, unshaped), a peer on another node through the shaped link.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshlm.processes import stop_tree

IFNAME = "eth0"  # the link interface inside each node's namespace
SUBNET = "10.213.0"
MAX_NODES = 200  # addresses .1 .. .200 of the /24
_CLONE_NEWNET = 0x40000000
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}  # tc's spelling: "bps" = bytes/s
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_CMD_TIMEOUT_S = 30  # one `ip`/`tc` call; they return in milliseconds
# Stopping the nodes' commands: SIGTERM, then SIGKILL to what is left after one grace period shared by all
# (`processes.stop_tree`; not one per node: Ctrl-C of many nodes must not take nodes x grace)
_STOP_GRACE_S = 5.0


MIN_RATE_BPS, MAX_RATE_BPS = 1e6, 1e12  # bits/s an emulated link may have (parse_rate)
MAX_LATENCY_S = 10.0  # the longest one-way delay it may add (parse_duration)


def parse_rate(text: str) -> float:
    """'1gbit' / '100mbit' / '125mbps' (tc's units; bps = bytes per second) -> bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"inter-node bandwidth {text!r} is not a rate; write e.g. 1gbit, 100mbit or 125mbps "
                         f"(units: {', '.join(_RATE_UNITS)})")
    rate = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if not MIN_RATE_BPS <= rate <= MAX_RATE_BPS:
        raise ValueError(f"inter-node bandwidth {text!r} is outside 1mbit..1tbit: below it a rendezvous outlasts its "
                         "timeouts, above it tc cannot size the link's bucket; write e.g. 1gbit or 100mbit")
    return rate


def parse_duration(text: str) -> float:
    """'1ms' / '200us' / '0.5s' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", str(text))
    if not m or m.group(2) not in _TIME_UNITS:
        raise ValueError(f"inter-node latency {text!r} is not a duration; write e.g. 1ms or 200us")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if seconds > MAX_LATENCY_S:
        raise ValueError(f"inter-node latency {text!r} is above {MAX_LATENCY_S:g} s, which every rendezvous and "
                         "collective would time out on; write e.g. 1ms or 200us")
    return seconds


def check_host() -> None:
    """Raise ValueError (one line) where this host cannot emulate nodes: not root, or no `ip` / `tc`."""
    if not sys.platform.startswith("linux"):
        raise ValueError("emulating nodes needs Linux network namespaces; run on Linux")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ValueError(f"emulating nodes needs {' and '.join(missing)} (iproute2); install iproute2")
    if os.geteuid() != 0:
        raise ValueError("emulating nodes creates network namespaces, which needs root; run as root "
                         "(e.g. in a container) or leave out the emulation")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)


def _must(*args: str) -> None:
    done = _run(*args)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.strip()[:300]}")


@dataclass
class EmulatedCluster:
    """`with EmulatedCluster(nodes=2, rate_bps=1e9) as c:` -- c.namespaces[i], c.addresses[i] of node i.

    `latency_s`: one-way delay added on each node's link; needs the netem qdisc (refused where missing).
    """

    nodes: int
    rate_bps: float
    latency_s: float = 0.0
    # Bytes per packet on the node links. A real NIC segments and coalesces in hardware (TSO/GRO: the stack
    # sees 64 KiB segments); here every packet costs the shared CPUs a trip through two veths, a bridge and
    # two qdiscs, and at 1500 bytes that CPU work, not the shaped rate, bounded the link (~45 of 125 MB/s
    # at 1gbit on 2 busy cores). 64 KiB packets give the rate back (a 4 MiB all-reduce at the shaped rate).
    mtu: int = 65000
    tag: str = ""  # names the namespaces; default from this process id (unique among live processes)
    namespaces: list = field(default_factory=list, init=False)
    addresses: list = field(default_factory=list, init=False)
    switch: str = field(default="", init=False)
    _created: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes={self.nodes} must be between 2 and {MAX_NODES}")
        if not 1280 <= self.mtu <= 65535:
            raise ValueError(f"mtu={self.mtu} must be between 1280 and 65535 bytes")
        if self.rate_bps <= 0:
            raise ValueError(f"inter-node rate {self.rate_bps} bit/s must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"inter-node latency {self.latency_s} s must be >= 0")
        tag = self.tag or f"meshlm{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.namespaces = [f"{tag}-n{i}" for i in range(self.nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(self.nodes)]

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        check_host()
        # SIGTERM (a job scheduler, `kill`) must tear down too: turn it into an exception while we live.
        self._old_term = signal.getsignal(signal.SIGTERM) if _main_thread() else None
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace created (their links and qdiscs go with them). Safe to call twice; a
        Ctrl-C or SIGTERM arriving meanwhile is raised once everything is deleted, not halfway."""
        with _signals_deferred():
            for ns in reversed(self._created):
                delete_namespace(ns)
            self._created.clear()
            if getattr(self, "_old_term", None) is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None

    def _create(self) -> None:
        for ns in (self.switch, *self.namespaces):
            if _run("ip", "netns", "add", ns).returncode != 0:
                raise ValueError(f"network namespace {ns!r} exists already (left by a run that was killed?); "
                                 f"delete it with `ip netns del {ns}`")
            self._created.append(ns)
        sw = self.switch
        _must("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _must("ip", "-n", sw, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.namespaces, self.addresses)):
            port = f"p{i}"
            _must("ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
            _must("ip", "-n", sw, "link", "set", port, "master", "br0")
            _must("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            for where, dev in ((ns, IFNAME), (sw, port)):  # what the node sends, and what it receives
                _must("ip", "-n", where, "link", "set", dev, "mtu", str(self.mtu))
                self._shape(where, dev)
                _must("ip", "-n", where, "link", "set", dev, "up")
            _must("ip", "-n", ns, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        rate = f"{int(self.rate_bps)}bit"
        if self.latency_s > 0:
            done = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem",
                        "delay", f"{int(round(self.latency_s * 1e6))}us", "rate", rate)
            if done.returncode != 0:
                raise ValueError("--inter-node-latency needs the kernel's netem qdisc (sch_netem), which this "
                                 f"host lacks ({done.stderr.strip()[:80]}); leave the latency out")
            return
        # Token bucket: a burst of 100 us at the rate, at least one full-size packet and a header more (tbf
        # drops a packet larger than its bucket): a larger bucket lets every message of up to its size
        # through at memory speed, so the link would look faster than its rate to anything that pauses
        # between messages (a calibration, a training step's collectives). The queue holds 100 ms at the
        # rate and at least 8 MiB: a drop makes TCP wait for a retransmission timeout (200 ms and more),
        # and at low rates 100 ms is less than what TCP's socket buffers (megabytes) send at once.
        burst = max(16 * 1024, self.mtu + 1500, int(self.rate_bps / 8 * 1e-4))
        limit = max(8 * 2**20, int(self.rate_bps / 8 * 0.1))
        _must("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
              "burst", str(burst), "limit", str(limit))

    # -- using it ---------------------------------------------------------------------------------
    def rank_env(self) -> dict:
        """Environment for a rank on any node: gloo on the node's link interface (torch's setting)."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    def link_bytes(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) so far on each node's link (its end of the veth pair: what crossed to
        other nodes, headers included; a node's loopback traffic is not on it)."""
        import json

        counts = []
        for ns in self.namespaces:
            done = _run("ip", "-n", ns, "-s", "-j", "link", "show", "dev", IFNAME)
            if done.returncode != 0:
                raise RuntimeError(f"`ip -n {ns} -s -j link show dev {IFNAME}` failed: {done.stderr.strip()[:300]}")
            stats = json.loads(done.stdout)[0]["stats64"]
            counts.append((int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])))
        return counts

    def run_on_nodes(self, argv_for_node: Callable[[int], Sequence[str]], *, env: dict | None = None) -> int:
        """Run `argv_for_node(i)` inside node i's namespace, all at once; wait for all. Exit code: 0, or
        the first nonzero one (the others are stopped when one fails). Ctrl-C stops them all."""
        child_env = {**os.environ, **self.rank_env(), **(env or {})}
        procs = []
        try:
            # A Ctrl-C inside Popen (the child started, its handle not yet returned) would leave that node's
            # command running, unknown to us: signals wait until every node's process is in `procs`.
            with _signals_deferred():
                for i, ns in enumerate(self.namespaces):
                    procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *argv_for_node(i)], env=child_env,
                                                  start_new_session=True))
            code = 0
            pending = list(procs)
            while pending:
                for p in list(pending):
                    try:
                        rc = p.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        continue
                    pending.remove(p)
                    if rc != 0 and code == 0:
                        code = rc if rc > 0 else 1
                        # one node failed: the others would wait for it until their timeout
                        stop_tree(pending, _STOP_GRACE_S)
            return code
        finally:
            stop_tree([p for p in procs if p.poll() is None], _STOP_GRACE_S)


class _signals_deferred:
    """Within it, SIGINT and SIGTERM are noted instead of raised; on leaving, the first one noted is raised
    (KeyboardInterrupt), so a block that must finish (starting the nodes' processes, tearing down) finishes.
    Only the main thread can set handlers; elsewhere it does nothing."""

    def __enter__(self):
        self.noted, self.old = [], {}
        if _main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, lambda signum, frame: self.noted.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        if self.noted and exc[0] is None:
            raise KeyboardInterrupt


def delete_namespace(name: str) -> None:
    """What `ip netns del NAME` does -- detach the namespace's bind mount, remove its file -- without starting
    a process (teardown must not wait for a fork and an exec on a loaded machine). Missing: nothing to do."""
    path = f"/run/netns/{name}"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(path.encode(), 2)  # MNT_DETACH; fails harmlessly where it is not mounted
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def enter_node(namespace: str) -> None:
    """Move this process into a node's network namespace (before it opens any socket): what `ip netns exec`
    does, for a rank started by multiprocessing. Threads created afterwards inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)
