"""meshlm.processes on real processes: free ports, the tree read from /proc, and stop_tree's steps and counts."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from meshlm.processes import (LOWEST_PICKED_PORT, alive, children, cpu_seconds, descendants, ephemeral_ports, free_ports,
                              stop_tree)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads Linux /proc")

# A leader in a session of its own with a child in its process group (`sleep`) and one in a session of its own (`sh`,
# which forks a `sleep` of its own: a grandchild), as torch's launcher starts its ranks; prints the two children's ids.
TREE = ("import subprocess, time\n"
        "a = subprocess.Popen(['sleep', '60'])\n"
        "b = subprocess.Popen(['sh', '-c', 'sleep 60; :'], start_new_session=True)\n"
        "print(a.pid, b.pid, flush=True)\n"
        "time.sleep(60)\n")
# A leader that notes SIGTERM and goes on; one that ignores it
NOTES_TERM = ("import signal, time\n"
              "signal.signal(signal.SIGTERM, lambda *_: print('TERM', flush=True))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
IGNORES_TERM = ("import signal, time\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\n"
                "time.sleep(60)\n")


def start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(condition, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_free_ports_lie_below_the_kernels_own_so_no_socket_bound_to_port_0_takes_one():
    first, last = ephemeral_ports()
    assert 0 < first <= last < 65536
    ports = free_ports(20)
    assert all(LOWEST_PICKED_PORT <= p < first for p in ports), (ports, first)
    # what gloo's pairs and a store's clients do meanwhile: bind to port 0 -- never one of ours
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert first <= s.getsockname()[1] <= last
    # ports a process about to start binds itself are passed over; with none left below, the kernel chooses
    taken = range(LOWEST_PICKED_PORT, first)
    assert all(first <= p <= last for p in free_ports(3, avoid=taken))


def test_the_tree_from_proc_and_a_zombie():
    zombie = subprocess.Popen(["true"])  # exits at once; not reaped until wait()
    try:
        wait_for(lambda: not alive(zombie.pid), "`true` never exited")
        assert zombie.pid in children(os.getpid()) and zombie.pid in descendants(os.getpid())
    finally:
        zombie.wait()
    assert zombie.pid not in children(os.getpid())
    assert alive(os.getpid()) and cpu_seconds([os.getpid()]) > 0 and cpu_seconds([zombie.pid]) == 0


def test_stop_tree_terms_the_group_then_kills_what_is_left_below():
    procs = []
    try:
        procs.append(leader := start(TREE))
        a, b = (int(x) for x in leader.stdout.readline().split())
        wait_for(lambda: len(descendants(leader.pid)) == 3, "the tree never had 3 processes")
        grandchild = children(b)[0]
        assert children(leader.pid) == sorted([a, b])
        assert descendants(leader.pid) == [*sorted([a, b]), grandchild]  # level by level
        assert all(alive(p) for p in (a, b, grandchild))

        # `sleep` in the leader's group ends with it on SIGTERM; `sh` and its `sleep`, in a session of their own,
        # get nothing until the timeout, then SIGKILL
        assert stop_tree(leader, 0.5) == {"child_processes": 3, "killed_after_timeout": 2, "left_running": 0,
                                          "groups_killed": 0}
        assert leader.returncode == -signal.SIGTERM
        assert not any(alive(p) for p in (a, b, grandchild))

        # a leader that survives SIGTERM is SIGKILLed after the timeout; with timeout 0 it gets no SIGTERM at all
        procs += [noting := start(NOTES_TERM), ignoring := start(IGNORES_TERM)]
        assert noting.stdout.readline() == "ready\n" and ignoring.stdout.readline() == "ready\n"
        assert stop_tree([ignoring], 0.3) == {"child_processes": 0, "killed_after_timeout": 0, "left_running": 0,
                                              "groups_killed": 1}
        assert stop_tree(noting, 0)["groups_killed"] == 1
        assert ignoring.returncode == noting.returncode == -signal.SIGKILL
        assert noting.stdout.read() == ""  # no SIGTERM came first
    finally:
        stop_tree(procs, 0)
