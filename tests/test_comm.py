"""comm.py on 2 and 4 gloo ranks: values and gradients against one-process computations, exact bytes."""

import pytest
import torch

from dist import run_distributed
from meshlm import comm
from meshlm.comm_stats import CommEvent, CommStats
from meshlm.mesh import Mesh, ParallelDims, build_mesh

ATOL = 1e-6


def _x(i: int, *shape) -> torch.Tensor:
    """The tensor that member i of an axis contributes (every rank can rebuild every member's)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + i))


def _nb(*shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return 4 * n  # float32


def _expect(mesh: Mesh, events: list[tuple[str, str, int]]) -> None:
    got = mesh.stats.events
    assert got == [CommEvent(*e) for e in events], f"{got} != {events}"
    mesh.stats.reset()


def _split(i: int, j: int) -> int:
    """Rows member i sends to member j in the uneven all-to-all (1..3, never symmetric)."""
    return (i + 2 * j) % 3 + 1


def _a2a_input(i: int, n: int, width: int) -> torch.Tensor:
    # row content encodes (sender, receiver, row) so misrouting shows
    rows = []
    for j in range(n):
        for k in range(_split(i, j)):
            rows.append(torch.full((width,), 100.0 * i + 10.0 * j + k))
    return torch.stack(rows)


def check_axis(mesh: Mesh, axis: str) -> dict:
    n, c = mesh.size(axis), mesh.local_rank(axis)
    close = lambda a, b: torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)  # noqa: E731
    mesh.stats.reset()

    # all_reduce, sync and async, sum and max
    xs = [_x(i, 4, 6) for i in range(n)]
    t = xs[c].clone()
    assert comm.all_reduce(t, mesh, axis) is t
    close(t, sum(xs))
    t = xs[c].clone()
    h = comm.all_reduce(t, mesh, axis, op="max", async_op=True)
    close(h.wait(), torch.stack(xs).amax(0))
    _expect(mesh, [("all_reduce", axis, _nb(4, 6))] * 2)

    # all-gather along dims 0 and 1, into a tensor, async
    close(comm.all_gather(xs[c], mesh, axis, dim=1), torch.cat(xs, dim=1))
    close(comm.all_gather(xs[c], mesh, axis, dim=0, async_op=True).wait(), torch.cat(xs, dim=0))
    out = torch.empty(n * 4, 6)
    comm.all_gather_into_tensor(out, xs[c], mesh, axis)
    close(out, torch.cat(xs))
    _expect(mesh, [("all_gather", axis, n * _nb(4, 6))] * 3)

    # reduce-scatter along dims 0 and 1 (input n times the output)
    ys = [_x(10 + i, 2 * n, 3 * n) for i in range(n)]
    close(comm.reduce_scatter(ys[c], mesh, axis, dim=0), sum(ys).chunk(n, dim=0)[c])
    close(comm.reduce_scatter(ys[c], mesh, axis, dim=1, async_op=True).wait(), sum(ys).chunk(n, dim=1)[c])
    out = torch.empty(2, 3 * n)
    comm.reduce_scatter_tensor(out, ys[c], mesh, axis)
    close(out, sum(ys).chunk(n, dim=0)[c])
    _expect(mesh, [("reduce_scatter", axis, _nb(2 * n, 3 * n))] * 3)

    # broadcast from coordinate 1
    t = xs[c].clone()
    comm.broadcast(t, mesh, axis, src=1)
    close(t, xs[1])
    _expect(mesh, [("broadcast", axis, _nb(4, 6))])

    # all-to-all with uneven splits (and the counted exchange of the split sizes first)
    width = 5
    send_sizes = [_split(c, j) for j in range(n)]
    recv_sizes = comm.exchange_split_sizes(send_sizes, mesh, axis)
    assert recv_sizes == [_split(i, c) for i in range(n)]
    inp = _a2a_input(c, n, width)
    got = comm.all_to_all_single(inp, mesh, axis, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
    want = torch.cat([_a2a_input(i, n, width).split([_split(i, j) for j in range(n)])[c] for i in range(n)])
    close(got, want)
    _expect(mesh, [("all_to_all", axis, 8 * n), ("all_to_all", axis, 4 * width * sum(send_sizes))])

    # send/recv around the ring (even coordinates send first so blocking calls cannot deadlock)
    nxt, prv = (c + 1) % n, (c - 1) % n
    buf = torch.empty(3, 2)
    if c % 2 == 0:
        comm.send(_x(20 + c, 3, 2), mesh, axis, dst=nxt)
        comm.recv(buf, mesh, axis, src=prv)
    else:
        comm.recv(buf, mesh, axis, src=prv)
        comm.send(_x(20 + c, 3, 2), mesh, axis, dst=nxt)
    close(buf, _x(20 + prv, 3, 2))
    order = [("send", axis, _nb(3, 2)), ("recv", axis, _nb(3, 2))]
    _expect(mesh, order if c % 2 == 0 else order[::-1])
    buf = torch.empty(3, 2)
    h = comm.batch_isend_irecv([comm.P2P("send", _x(30 + c, 3, 2), nxt), comm.P2P("recv", buf, prv)], mesh, axis)
    h.wait()
    close(buf, _x(30 + prv, 3, 2))
    _expect(mesh, [("send", axis, _nb(3, 2)), ("recv", axis, _nb(3, 2))])
    # the same ring with async send/recv handles
    buf = torch.empty(3, 2)
    handles = [comm.send(_x(35 + c, 3, 2), mesh, axis, dst=nxt, async_op=True),
               comm.recv(buf, mesh, axis, src=prv, async_op=True)]
    assert handles[1].wait() is buf and handles[0].wait() is None
    close(buf, _x(35 + prv, 3, 2))
    got = comm.all_to_all_single(inp, mesh, axis, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                                 async_op=True).wait()
    close(got, want)
    _expect(mesh, [("send", axis, _nb(3, 2)), ("recv", axis, _nb(3, 2)),
                   ("all_to_all", axis, 4 * width * sum(send_sizes))])
    with pytest.raises(ValueError, match="another member"):
        comm.send(buf, mesh, axis, dst=c)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.zeros(4, 6).t(), mesh, axis)

    check_autograd(mesh, axis)
    return {k: v.calls for k, v in mesh.stats.snapshot().items()}


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def check_autograd(mesh: Mesh, axis: str) -> None:
    n, c = mesh.size(axis), mesh.local_rank(axis)
    close = lambda a, b: torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)  # noqa: E731
    ws = [_x(40 + i, 4, 6) for i in range(n)]  # a different upstream weight on each member
    xs = [_x(50 + i, 4, 6) for i in range(n)]

    # copy_to_group: identity forward; the gradient is the sum of every member's
    x = _leaf(xs[0])
    y = comm.copy_to_group(x, mesh, axis)
    close(y, xs[0])
    (y * ws[c]).sum().backward()
    close(x.grad, sum(ws))
    _expect(mesh, [("all_reduce", axis, _nb(4, 6))])

    # reduce_from_group: the sum forward; the gradient passes through unchanged
    x = _leaf(xs[c])
    y = comm.reduce_from_group(x, mesh, axis)
    close(y, sum(xs))
    (y * ws[0]).sum().backward()
    close(x.grad, ws[0])
    _expect(mesh, [("all_reduce", axis, _nb(4, 6))])

    # gather_along_dim, split backward: the consumer is replicated (same weight everywhere)
    x = _leaf(xs[c])
    full = _leaf(torch.cat(xs, dim=1))
    y = comm.gather_along_dim(x, mesh, axis, dim=1)
    close(y, full.detach())
    w_full = _x(60, 4, 6 * n)
    (y * w_full).sum().backward()
    (full * w_full).sum().backward()
    close(x.grad, full.grad.chunk(n, dim=1)[c])
    _expect(mesh, [("all_gather", axis, n * _nb(4, 6))])

    # gather_along_dim, reduce-scatter backward: every member's consumer adds a partial gradient
    x = _leaf(xs[c])
    y = comm.gather_along_dim(x, mesh, axis, dim=0, grad_op="reduce_scatter")
    w_mine = _x(70 + c, 4 * n, 6)
    (y * w_mine).sum().backward()
    total = sum(_x(70 + i, 4 * n, 6) for i in range(n))  # d(sum of all members' losses)/d(gathered)
    close(x.grad, total.chunk(n, dim=0)[c])
    _expect(mesh, [("all_gather", axis, n * _nb(4, 6)), ("reduce_scatter", axis, n * _nb(4, 6))])

    # scatter_along_dim: keep my chunk; the replicated input's gradient is every member's chunk gradient
    full_val = _x(80, 4, 6 * n)
    x = _leaf(full_val)
    y = comm.scatter_along_dim(x, mesh, axis, dim=1)
    close(y, full_val.chunk(n, dim=1)[c])
    (y * ws[c]).sum().backward()
    close(x.grad, torch.cat(ws, dim=1))
    _expect(mesh, [("all_gather", axis, n * _nb(4, 6))])

    # reduce_scatter_along_dim: sum then keep my chunk; backward gathers the chunk gradients
    x = _leaf(_x(90 + c, 4 * n, 6))
    y = comm.reduce_scatter_along_dim(x, mesh, axis, dim=0)
    close(y, sum(_x(90 + i, 4 * n, 6) for i in range(n)).chunk(n, dim=0)[c])
    (y * ws[c]).sum().backward()
    close(x.grad, torch.cat(ws, dim=0))
    _expect(mesh, [("reduce_scatter", axis, n * _nb(4, 6)), ("all_gather", axis, n * _nb(4, 6))])

    # all_to_all with uneven splits: gradients come back to where the rows came from
    width = 3
    send_sizes = [_split(c, j) for j in range(n)]
    recv_sizes = [_split(i, c) for i in range(n)]
    x = _leaf(_x(100 + c, sum(send_sizes), width))
    y = comm.all_to_all(x, mesh, axis, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
    w = lambda j: _x(110 + j, sum(_split(i, j) for i in range(n)), width)  # noqa: E731
    (y * w(c)).sum().backward()
    # rows of mine sent to member j landed after the rows of members < c in j's output
    want = torch.cat([w(j)[sum(_split(i, j) for i in range(c)):][:_split(c, j)] for j in range(n)])
    close(x.grad, want)
    _expect(mesh, [("all_to_all", axis, 4 * width * sum(send_sizes)),
                   ("all_to_all", axis, 4 * width * sum(recv_sizes))])


def check_size_one_axis(mesh: Mesh, axis: str) -> None:
    """One-rank axes move nothing: values pass through and nothing is counted."""
    x = _x(0, 2, 3)
    assert torch.equal(comm.all_reduce(x.clone(), mesh, axis), x)
    assert torch.equal(comm.all_gather(x, mesh, axis, dim=1), x)
    assert torch.equal(comm.reduce_scatter(x, mesh, axis, dim=0), x)
    assert torch.equal(comm.all_reduce(x.clone(), mesh, axis, async_op=True).wait(), x)
    leaf = _leaf(x)
    comm.gather_along_dim(comm.copy_to_group(leaf, mesh, axis), mesh, axis, dim=0).sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(x))
    assert mesh.stats.events == [] and mesh.stats.total().calls == 0


def comm_worker(rank, world_size, layouts):
    out = {}
    for kwargs, axes in layouts:
        mesh = build_mesh(ParallelDims(**kwargs), device_type="cpu", stats=CommStats(keep_events=True))
        check_size_one_axis(mesh, "pp")
        for axis in axes:
            out[(tuple(sorted(kwargs.items())), axis)] = check_axis(mesh, axis)
    return out


def test_comm_two_ranks():
    results = run_distributed(comm_worker, 2, [({"tp": 2}, ["tp"]), ({}, ["dp"])], timeout=90)
    assert len(results) == 2


def test_comm_four_ranks():
    # a 4-member group, and 2-member groups of non-consecutive ranks (dp with tp inside)
    results = run_distributed(comm_worker, 4, [({"tp": 4}, ["tp"]), ({"tp": 2}, ["dp", "tp"])], timeout=120)
    assert len(results) == 4


def test_stats_accounting_without_processes():
    stats = CommStats(keep_events=True)
    stats.record("all_reduce", "dp", 100, 0.5)
    stats.record("all_reduce", "dp", 20, 0.25)
    stats.record("all_gather", "tp", 8)
    snap = stats.snapshot()
    stats.record("all_gather", "tp", 8)
    assert snap[("all_reduce", "dp")].bytes == 120 and snap[("all_gather", "tp")].calls == 1
    assert stats.by_axis()["tp"].bytes == 16
    assert stats.total(op="all_reduce").calls == 2
    assert stats.summary()["dp"] == {"calls": 2, "mb": 120 / 2**20, "seconds": 0.75}
    assert "dp: 2 calls" in stats.format()
    stats.reset()
    assert stats.total().calls == 0 and stats.events == [] and stats.format() == "no communication"


def test_one_process_mesh_needs_no_process_group():
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    assert mesh.world_size == 1 and mesh.group("dp") is None and mesh.size("dp") == 1
    check_size_one_axis(mesh, "tp")


class _Marker:
    """A stand-in device clock (what a CUDA event is to `CommStats.device_clock`): each marker is one second after
    the previous one."""

    now = 0.0

    def __init__(self):
        _Marker.now += 1.0
        self.t = _Marker.now

    def synchronize(self):
        pass

    def elapsed_time(self, later) -> float:
        return (later.t - self.t) * 1e3  # ms, as CUDA's


def _device_clock_worker(rank, world_size):
    from meshlm.comm_stats import CommStats
    from meshlm.mesh import ParallelDims, build_mesh

    stats = CommStats(device_clock=_Marker)
    mesh = build_mesh(ParallelDims(), device_type="cpu", stats=stats)
    t = torch.ones(4)
    comm.all_reduce(t, mesh, "dp")  # markers 1 and 2: a second
    comm.all_reduce(t, mesh, "dp", async_op=True).wait()  # markers 3 and 4: a second
    peer = 1 - rank
    comm.batch_isend_irecv([comm.P2P("send", t, peer), comm.P2P("recv", torch.empty(4), peer)], mesh, "dp").wait()
    pending = len(stats.spans)
    return pending, stats.total(op="all_reduce").seconds, stats.total(op="recv").seconds, stats.total(op="send").seconds


def test_on_a_device_clock_collective_seconds_are_the_devices_spans_read_once_per_summary():
    for pending, all_reduce, recv, send in run_distributed(_device_clock_worker, 2):
        assert pending == 3  # nothing read in the hot loop
        assert (all_reduce, recv, send) == (2.0, 1.0, 0.0)  # the markers' spans, no host time beside


class _StuckMarker(_Marker):
    """A device marker the device never passes once `stuck` is set (a collective a peer never joined, on NCCL)."""

    stuck = False

    def query(self) -> bool:
        return not _StuckMarker.stuck


def _blocking_wait_worker(rank, world_size):
    import time

    from meshlm.comm_stats import CommStats
    from meshlm.mesh import ParallelDims, build_mesh

    t = torch.ones(4)
    runs_ahead = build_mesh(ParallelDims(), device_type="cpu", stats=CommStats(device_clock=_StuckMarker))
    blocking = build_mesh(ParallelDims(), device_type="cpu", stats=CommStats(device_clock=_StuckMarker),
                          wait_timeout_s=0.5)
    comm.all_reduce(t, blocking, "dp")  # the device passes the marker: no wait, no error
    comm.all_reduce(t, blocking, "dp", async_op=True).wait()
    _StuckMarker.stuck = True
    comm.all_reduce(t, runs_ahead, "dp")  # "stream": the host does not wait for the device
    errors = []
    for call in (lambda: comm.all_reduce(t, blocking, "dp"),
                 lambda: comm.all_reduce(t, blocking.duplicate("dp"), "dp", async_op=True).wait(),
                 lambda: comm.batch_isend_irecv([comm.P2P("send", t, 1 - rank), comm.P2P("recv", torch.empty(4), 1 - rank)],
                                                blocking, "dp").wait()):
        start = time.monotonic()
        with pytest.raises(comm.CollectiveError) as info:
            call()
        errors.append((str(info.value), time.monotonic() - start))
    return errors


def test_blocking_collective_wait_raises_at_the_collective_the_device_never_finishes():
    """parallel.collective_wait = "blocking" on a GPU (here a stand-in device clock): the host waits for each
    collective's marker on the device stream and raises CollectiveError, naming the op and mesh axis, once
    collective_timeout_s has passed -- sync, async and point-to-point alike; "stream" does not wait."""
    for rank, errors in enumerate(run_distributed(_blocking_wait_worker, 2)):
        for (text, waited), op in zip(errors, ("all_reduce", "all_reduce", "recv")):
            assert text.startswith(f"rank {rank}: {op} on mesh axis 'dp' (global ranks [0, 1])"), text
            assert "not complete on the device after 0.5 s (parallel.collective_wait=blocking)" in text, text
            assert waited >= 0.5, waited  # never before the timeout
