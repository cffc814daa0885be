"""Multi-rank test harness: run a function on N local gloo ranks and collect what each returns.

`run_distributed(fn, world_size, *args, timeout=60, **kwargs)` spawns `world_size` processes, each
with a default gloo process group (MASTER_ADDR=127.0.0.1, a free port, retried if another job takes
it first) and one intra-op thread, calls `fn(rank, world_size, *args, **kwargs)` and returns the list
of return values by rank (they must be picklable). `run_distributed_with(fn, world_size, args,
before_init=f, master_addr=A, timeout=...)` is the same with `f(rank)` called in each rank before its
process group starts (e.g. to enter an emulated node's network namespace) and the rendezvous at A.
If a rank raises, crashes or the whole run exceeds `timeout` seconds, the test fails with every failed
rank's traceback, the current stack of every rank still running (dumped by faulthandler before it is killed), and which ranks those were.
`fn` must be importable by name (a module-level function of a test module).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from pathlib import Path

from meshlm.processes import children, free_port

_PORT_TRIES = 4
_GRACE_AFTER_ERROR_S = 5.0  # after one rank fails, the others get this long to report before the kill


class DistributedTestError(AssertionError):
    """A multi-rank run failed: the message holds each rank's traceback."""


def _is_port_collision(text: str) -> bool:
    """An init failure that a fresh port fixes: the port was taken, or another job's processes on this
    machine reached our rendezvous first (gloo's full-mesh connect then fails). Nothing of the test ran."""
    text = text.lower()
    return "address already in use" in text or "eaddrinuse" in text or "connectfullmesh failed" in text


def _worker(rank, world_size, port, stack_dir, fn, args, kwargs, results, before_init=None, master_addr="127.0.0.1"):
    import torch
    import torch.distributed as dist

    # On a hang, the parent sends SIGUSR1 and reads where this rank is stuck from this file.
    stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if before_init is not None:
            before_init(rank)
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=world_size)
    except Exception:  # noqa: BLE001 -- reported to the parent, which may retry on another port
        results.put(("init_error", rank, traceback.format_exc()))
        return
    try:
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle bytes: the queue's own pickler would pass tensors as shared-memory handles
        # that die with this process before the parent reads them.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 -- everything goes back to the test
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 -- a peer may be gone already
                pass


def run_distributed(fn, world_size: int, *args, timeout: float = 60.0, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return results by rank."""
    return run_distributed_with(fn, world_size, args, kwargs, timeout=timeout)


def run_distributed_with(fn, world_size: int, args: tuple = (), kwargs: dict | None = None, *,
                         timeout: float = 60.0, before_init=None, master_addr: str = "127.0.0.1") -> list:
    """`run_distributed` with `before_init(rank)` run in each rank first, and the rendezvous at `master_addr`."""
    for attempt in range(_PORT_TRIES):
        outcome = _launch(fn, world_size, args, kwargs or {}, timeout, free_port(), before_init, master_addr)
        if outcome != "port_collision":
            return outcome
    raise DistributedTestError(f"could not find a free port in {_PORT_TRIES} tries")


def _context():
    """forkserver with torch preloaded: a rank starts in milliseconds instead of re-importing torch
    (seconds each on a shared 2-core machine); the server forks before any torch thread pool exists."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # torch._dynamo: the first meta-device init in build_model imports it (and sympy), ~1 s per rank otherwise
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "meshlm.models.transformer"])
    return ctx


def _launch(fn, world_size, args, kwargs, timeout, port, before_init=None, master_addr="127.0.0.1"):
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="meshlm-dist-") as stack_dir:
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, stack_dir, fn, args, kwargs, results,
                                                   before_init, master_addr),
                             daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        ok: dict[int, object] = {}
        errors: dict[int, str] = {}
        init_errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error_at = None
        first_failed = None
        timed_out = False
        while len(ok) + len(errors) + len(init_errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if first_error_at is not None and now > first_error_at + _GRACE_AFTER_ERROR_S:
                break
            try:
                kind, rank, payload = results.get(timeout=0.1)
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit, OOM kill) counts as failed.
                for r, p in enumerate(procs):
                    if r not in ok and r not in errors and r not in init_errors and not p.is_alive() \
                            and p.exitcode is not None and results.empty():
                        errors[r] = f"rank {r} exited with code {p.exitcode} without reporting"
                        first_error_at = first_error_at or time.monotonic()
                        first_failed = r if first_failed is None else first_failed
                continue
            if kind == "ok":
                ok[rank] = pickle.loads(payload)
            else:
                (errors if kind == "error" else init_errors)[rank] = payload
                first_error_at = first_error_at or time.monotonic()
                first_failed = rank if first_failed is None else first_failed

        running = [r for r, p in enumerate(procs) if r not in ok and r not in errors and r not in init_errors
                   and p.is_alive()]
        stacks = _dump_stacks(procs, running, stack_dir)
        for r, p in enumerate(procs):
            if r not in running:
                p.join(timeout=2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)

    if init_errors and not errors and any(_is_port_collision(t) for t in init_errors.values()):
        return "port_collision"
    if not errors and not init_errors and not timed_out and not running:
        return [ok[r] for r in range(world_size)]
    lines = []
    if timed_out:
        lines.append(f"timed out after {timeout:.0f} s; ranks still running: {running}")
    elif running:
        lines.append(f"ranks still running after another rank failed: {running}")
    if first_failed is not None:
        lines.append(f"first to fail: rank {first_failed}")
    for r in sorted({**errors, **init_errors}):
        lines.append(f"----- rank {r} failed -----\n{errors.get(r) or init_errors[r]}")
    for r in running:
        lines.append(f"----- rank {r} still running; its stack -----\n{stacks.get(r, '(no stack dumped)')}")
    raise DistributedTestError("\n".join(lines))


def _dump_stacks(procs, running, stack_dir) -> dict[int, str]:
    for r in running:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if running:
        time.sleep(0.5)
    stacks = {}
    for r in running:
        path = Path(stack_dir) / f"rank{r}.txt"
        stacks[r] = path.read_text() if path.exists() else ""
    return stacks


def group_ranks(pid: int, group: int) -> list[int]:
    """The ranks of replica group `group` under `meshlm train --replica-groups` (process `pid`): the children of the
    group's launcher job, the child of `pid` whose command line sets parallel.replica_group={group}."""
    for child in children(pid):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"parallel.replica_group={group}".encode() in argv:
            return children(child)
    return []
