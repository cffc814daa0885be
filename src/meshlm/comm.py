"""Every collective of meshlm, on a named mesh axis, counted.

Responsible for: the plain collectives (all_reduce, all_gather, reduce_scatter, broadcast,
all_to_all_single with uneven splits, send/recv, batch_isend_irecv), each taking
`(tensor, mesh, axis)` and optionally asynchronous; the autograd-aware ops that tensor, sequence,
expert and context parallelism compose (copy_to_group, reduce_from_group, gather_along_dim,
scatter_along_dim, reduce_scatter_along_dim, all_to_all), each counted in the mesh's `CommStats`
(`meshlm.comm_stats`) by the convention below.
Not responsible for: building groups (`meshlm.mesh`), deciding what to communicate (the strategies
in `meshlm.parallel`), or timing on the device (seconds are host time, see below).

Byte convention (what `CommStats` counts; the planner applies algorithm factors such as the
2(n-1)/n of a ring all-reduce on top). Bytes are the logical payload of one rank's call:
  all_reduce          N bytes of the tensor reduced (the same on every rank).
  all_gather          the OUTPUT size: n x the input of one rank.
  reduce_scatter      the INPUT size: n x the output of one rank.
  broadcast           N bytes of the tensor, on the source and on every receiver.
  all_to_all          the bytes this rank sends (its whole input, its own slice included).
  send / recv         the tensor sent / received, counted under op "send" / "recv".
A call on an axis of size 1 moves nothing: it returns at once (possibly the input tensor itself,
not a copy) and is not counted at all -- so a one-process Mesh needs no process group.

Seconds are the host time spent inside the call plus, for `async_op=True`, inside `wait()`. On CPU
(gloo) that is the time the collective took; on CUDA it is launch time unless the caller synchronises.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshlm.comm_stats import CommStats
from meshlm.mesh import Mesh
from meshlm.nccl_order import TracedOp

# torch 2.13 renamed the single-tensor collectives and deprecates the old names; older torch
# (>= 2.6 is supported) only has the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


# --------------------------------------------------------------------------------------------
# Plain collectives
# --------------------------------------------------------------------------------------------


class CollectiveError(RuntimeError):
    """A collective that did not complete -- a peer rank stopped, died or diverged, or the wait exceeded the
    process group's timeout (parallel.collective_timeout_s) -- named by rank, op and mesh axis."""


def _failed(error: Exception, where: tuple[int, list[int]] | None, op: str, axis: str,
            seconds: float) -> CollectiveError:
    text = str(error).strip()
    first = text.splitlines()[0][:200] if text else type(error).__name__
    rank, ranks = where if where is not None else ("?", "?")
    return CollectiveError(f"rank {rank}: {op} on mesh axis {axis!r} (global ranks {ranks}) failed after "
                           f"{seconds:.1f} s: {first} -- a peer rank stopped, died or diverged "
                           "(parallel.collective_timeout_s bounds the wait)")


class CommHandle:
    """An in-flight asynchronous collective. `wait()` blocks, counts the wait, returns the result."""

    def __init__(self, works: Sequence, stats: CommStats, op: str, axis: str, result=None,
                 finalize: Callable | None = None, where: tuple[int, list[int]] | None = None,
                 traced: int | None = None, issued=None, wait_timeout_s: float | None = None):
        self._works = [w for w in works if w is not None]
        self._wait_timeout_s = wait_timeout_s  # `Mesh.wait_timeout_s`: the blocking wait on a GPU
        self._issued = issued  # a device marker before the call was issued (`CommStats.device_clock`), or None
        self._stats, self._op, self._axis = stats, op, axis
        self._result, self._finalize = result, finalize
        self._where = where  # (this rank, the group's global ranks), for an error that names them
        self._traced = traced  # its number in stats.trace
        self._done = False

    def wait(self):
        if not self._done:
            start = time.perf_counter()
            try:
                for w in self._works:
                    w.wait()
            except RuntimeError as e:  # torch's DistBackendError is one
                raise _failed(e, self._where, self._op, self._axis, time.perf_counter() - start) from e
            if self._issued is not None:  # a GPU: the device's span from the issue to the end of the wait
                _end_span(self._stats, self._op, self._axis, self._issued, self._wait_timeout_s, self._where)
            else:
                self._stats.add_seconds(self._op, self._axis, time.perf_counter() - start)
            self._stats.trace_wait(self._traced)
            if self._finalize is not None:
                self._result = self._finalize()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


def _end_span(stats, op: str, axis: str, issued, timeout_s: float | None, where) -> None:
    """On a GPU, where a collective's work stands on the current stream: its span from `issued` to an event marked
    now, counted in `stats`, and (collective_wait=blocking) the host's wait for that event (`_await_device`)."""
    end = stats.mark()
    stats.add_span(op, axis, issued, end)
    _await_device(end, timeout_s, where, op, axis)


def _await_device(marker, timeout_s: float | None, where: tuple[int, list[int]] | None, op: str,
                  axis: str) -> None:
    """`parallel.collective_wait = "blocking"` on a GPU (`Mesh.wait_timeout_s`): the host waits until the device
    has passed `marker` (recorded on the current stream after the collective, which the stream was made to wait
    for), up to `timeout_s`, and raises CollectiveError past it -- at the collective that did not complete, as
    gloo raises, instead of NCCL's watchdog aborting the process later. It costs the host's run-ahead."""
    if timeout_s is None or marker is None:
        return
    start = time.monotonic()
    while not marker.query():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise _failed(TimeoutError(f"not complete on the device after {timeout_s:g} s "
                                       "(parallel.collective_wait=blocking)"), where, op, axis, waited)
        time.sleep(1e-4)


def _done(result, async_op: bool):
    """Result of a call that moved nothing, in the form the caller asked for."""
    if not async_op:
        return result
    handle = CommHandle([], CommStats(), "none", "none", result)
    handle._done = True  # nothing to wait for, nothing to count
    return handle


def _require_contiguous(t: torch.Tensor, what: str) -> None:
    # In-place collectives write through the tensor's storage; a strided view would be copied and lost.
    if not t.is_contiguous():
        raise ValueError(f"{what} needs a contiguous tensor (got strides {t.stride()} for shape "
                         f"{tuple(t.shape)}); pass t.contiguous() and use the returned tensor")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduce_op(op):
    if isinstance(op, str):
        if op not in _REDUCE_OPS:
            raise ValueError(f"reduce op {op!r} is unknown; choose one of {sorted(_REDUCE_OPS)}")
        return _REDUCE_OPS[op]
    return op


def _traced(mesh: Mesh, axis: str, group, op: str, nbytes: int = 0, p2p: tuple = ()) -> int | None:
    """Keep the op for the NCCL-order replay when the mesh's CommStats trace (see `CommStats`)."""
    if not mesh.stats.keep_trace:
        return None
    ranks = tuple(mesh.ranks(axis))
    name = f"{getattr(group, 'group_name', '')}:{','.join(map(str, ranks))}"  # the same on every member
    return mesh.stats.trace_op(TracedOp(name, ranks, op, nbytes, p2p, axis))


def _run(mesh: Mesh, axis: str, op: str, nbytes: int, call: Callable, async_op: bool, result,
         finalize: Callable | None = None, peer: int | None = None):
    """Issue `call(group)` (which returns a Work or a list of Works when async), count it, return.
    `peer`: the other rank's global rank, for a send or receive."""
    group = mesh.group(axis)
    traced = _traced(mesh, axis, group, "p2p" if peer is not None else op, nbytes,
                     ((op, peer, nbytes, 0),) if peer is not None else ())
    mesh.stats.begin(collective=peer is None)  # a step's first collective: its arrival (meshlm.stragglers)
    issued = mesh.stats.mark()
    start = time.perf_counter()
    try:
        works = call(group)
    except RuntimeError as e:  # torch's DistBackendError is one
        raise _failed(e, (mesh.rank, mesh.ranks(axis)), op, axis, time.perf_counter() - start) from e
    mesh.stats.record(op, axis, nbytes, time.perf_counter() - start if issued is None else 0.0)
    if async_op:
        works = works if isinstance(works, list) else [works]
        return CommHandle(works, mesh.stats, op, axis, result, finalize, where=(mesh.rank, mesh.ranks(axis)),
                          traced=traced, issued=issued, wait_timeout_s=mesh.wait_timeout_s)
    if issued is not None:  # the current stream waited for the collective: its span ends here
        _end_span(mesh.stats, op, axis, issued, mesh.wait_timeout_s, (mesh.rank, mesh.ranks(axis)))
    mesh.stats.trace_wait(traced)
    return finalize() if finalize is not None else result


def all_reduce(tensor: torch.Tensor, mesh: Mesh, axis: str, *, op="sum", async_op: bool = False):
    """Reduce `tensor` in place over the axis group; returns it (or a handle whose wait() does)."""
    if mesh.size(axis) == 1:
        return _done(tensor, async_op)
    _require_contiguous(tensor, "all_reduce")
    red = _reduce_op(op)
    return _run(mesh, axis, "all_reduce", _nbytes(tensor),
                lambda g: dist.all_reduce(tensor, op=red, group=g, async_op=async_op), async_op, tensor)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, mesh: Mesh, axis: str, *,
                           async_op: bool = False):
    """Concatenate every rank's `input` along dim 0 into `output` (n x input.shape[0] rows)."""
    n = mesh.size(axis)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather output has {output.numel()} elements; expected {n} x {input.numel()}")
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return _done(output, async_op)
    _require_contiguous(output, "all_gather_into_tensor")
    return _run(mesh, axis, "all_gather", _nbytes(output),
                lambda g: _all_gather_single(output, input.contiguous(), group=g, async_op=async_op),
                async_op, output)


def all_gather(tensor: torch.Tensor, mesh: Mesh, axis: str, *, dim: int = 0, async_op: bool = False):
    """A new tensor: every rank's `tensor` concatenated along `dim`, in axis-coordinate order."""
    n = mesh.size(axis)
    if n == 1:
        return _done(tensor, async_op)
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0], *moved.shape[1:]))
    finalize = lambda: out.movedim(0, dim).contiguous()  # noqa: E731
    return _run(mesh, axis, "all_gather", _nbytes(out),
                lambda g: _all_gather_single(out, moved, group=g, async_op=async_op), async_op, None, finalize)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, mesh: Mesh, axis: str, *, op="sum",
                          async_op: bool = False):
    """Reduce `input` over the group and leave the rank's dim-0 chunk in `output`."""
    n = mesh.size(axis)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter input has {input.numel()} elements; expected {n} x {output.numel()}")
    if n == 1:
        output.copy_(input.reshape(output.shape))
        return _done(output, async_op)
    _require_contiguous(output, "reduce_scatter_tensor")
    red = _reduce_op(op)
    return _run(mesh, axis, "reduce_scatter", _nbytes(input),
                lambda g: _reduce_scatter_single(output, input.contiguous(), op=red, group=g, async_op=async_op),
                async_op, output)


def reduce_scatter(tensor: torch.Tensor, mesh: Mesh, axis: str, *, dim: int = 0, op="sum",
                   async_op: bool = False):
    """A new tensor: the sum over ranks of `tensor`, this rank's chunk along `dim` (size must divide)."""
    n = mesh.size(axis)
    if tensor.shape[dim] % n != 0:
        raise ValueError(f"reduce_scatter along dim {dim} of size {tensor.shape[dim]} over {axis}={n} ranks: "
                         f"the size must be a multiple of {n}")
    if n == 1:
        return _done(tensor, async_op)
    red = _reduce_op(op)
    moved = tensor.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    finalize = lambda: out.movedim(0, dim).contiguous()  # noqa: E731
    return _run(mesh, axis, "reduce_scatter", _nbytes(moved),
                lambda g: _reduce_scatter_single(out, moved, op=red, group=g, async_op=async_op),
                async_op, None, finalize)


def broadcast(tensor: torch.Tensor, mesh: Mesh, axis: str, *, src: int = 0, async_op: bool = False):
    """Copy the tensor of the member with coordinate `src` on `axis` into `tensor` on every member."""
    if mesh.size(axis) == 1:
        return _done(tensor, async_op)
    _require_contiguous(tensor, "broadcast")
    src_rank = mesh.global_rank(axis, src)
    return _run(mesh, axis, "broadcast", _nbytes(tensor),
                lambda g: dist.broadcast(tensor, src=src_rank, group=g, async_op=async_op), async_op, tensor)


def broadcast_json(obj, mesh: Mesh, axis: str, *, src: int = 0):
    """`obj` (JSON data) of the member with coordinate `src` on `axis`, on every member (others pass None):
    two broadcasts, the length then the UTF-8 bytes. Plain data only: nothing received is unpickled."""
    if mesh.size(axis) == 1:
        return obj
    device = _comm_device(mesh)
    mine = mesh.local_rank(axis) == src
    payload = json.dumps(obj, separators=(",", ":")).encode() if mine else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    broadcast(length, mesh, axis, src=src)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if mine
            else torch.empty(int(length.item()), dtype=torch.uint8, device=device))
    broadcast(data, mesh, axis, src=src)
    return obj if mine else json.loads(data.cpu().numpy().tobytes().decode())


def all_to_all_single(tensor: torch.Tensor, mesh: Mesh, axis: str, *,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, async_op: bool = False):
    """Send dim-0 slice i of `tensor` to member i; return what every member sent here, concatenated.

    Splits are rows along dim 0. None means even splits. With uneven splits the receiver must know
    `output_split_sizes` (exchange them first with `exchange_split_sizes`).
    """
    n = mesh.size(axis)
    for name, splits in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
        if splits is not None and len(splits) != n:
            raise ValueError(f"{name} has {len(splits)} entries; {axis} has {n} ranks")
    if input_split_sizes is not None and sum(input_split_sizes) != tensor.shape[0]:
        raise ValueError(f"input_split_sizes sum to {sum(input_split_sizes)}; the tensor has {tensor.shape[0]} rows")
    if n == 1:
        return _done(tensor, async_op)
    rows = sum(output_split_sizes) if output_split_sizes is not None else tensor.shape[0]
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    inp = tensor.contiguous()
    osz = list(output_split_sizes) if output_split_sizes is not None else None
    isz = list(input_split_sizes) if input_split_sizes is not None else None
    return _run(mesh, axis, "all_to_all", _nbytes(inp),
                lambda g: dist.all_to_all_single(out, inp, osz, isz, group=g, async_op=async_op), async_op, out)


def exchange_split_sizes(input_split_sizes: Sequence[int], mesh: Mesh, axis: str) -> list[int]:
    """What every member will send here, given what this rank sends each member (a counted all_to_all)."""
    counts = torch.tensor(list(input_split_sizes), dtype=torch.int64, device=_comm_device(mesh))
    return all_to_all_single(counts, mesh, axis).tolist()


def _comm_device(mesh: Mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def send(tensor: torch.Tensor, mesh: Mesh, axis: str, *, dst: int, async_op: bool = False):
    """Send to the member with coordinate `dst` on `axis` (blocking unless async_op)."""
    peer = _peer(mesh, axis, dst)
    fn = dist.isend if async_op else dist.send
    return _run(mesh, axis, "send", _nbytes(tensor), lambda g: fn(tensor.contiguous(), dst=peer, group=g),
                async_op, None, peer=peer)


def recv(tensor: torch.Tensor, mesh: Mesh, axis: str, *, src: int, async_op: bool = False):
    """Receive into `tensor` from the member with coordinate `src` on `axis`; returns `tensor`."""
    peer = _peer(mesh, axis, src)
    _require_contiguous(tensor, "recv")
    fn = dist.irecv if async_op else dist.recv
    return _run(mesh, axis, "recv", _nbytes(tensor), lambda g: fn(tensor, src=peer, group=g), async_op, tensor,
                peer=peer)


def _peer(mesh: Mesh, axis: str, coord: int) -> int:
    n = mesh.size(axis)
    if not 0 <= coord < n or coord == mesh.local_rank(axis):
        raise ValueError(f"peer coordinate {coord} on axis {axis} (size {n}) must be another member, in 0..{n - 1}")
    return mesh.global_rank(axis, coord)


@dataclass(frozen=True)
class P2P:
    """One point-to-point op for `batch_isend_irecv`: kind "send" or "recv", peer = axis coordinate."""

    kind: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0  # matches a send to its receive by tag, not by order, where the backend honours it (gloo)


def batch_isend_irecv(ops: Sequence[P2P], mesh: Mesh, axis: str) -> CommHandle:
    """Issue sends and receives together (pipeline stages, ring attention); wait() on the handle.

    Each op is counted under "send" or "recv"; the handle's wait time goes to "recv" if any.
    """
    group = mesh.group(axis)
    p2p_ops = []
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2P kind {op.kind!r} must be 'send' or 'recv'")
        fn = dist.isend if op.kind == "send" else dist.irecv
        _require_contiguous(op.tensor, f"batch_isend_irecv ({op.kind})")
        p2p_ops.append(dist.P2POp(fn, op.tensor, _peer(mesh, axis, op.peer), group, op.tag))
    if not p2p_ops:
        return _done(None, True)
    traced = _traced(mesh, axis, group, "p2p", p2p=tuple((op.kind, _peer(mesh, axis, op.peer), _nbytes(op.tensor),
                                                          op.tag) for op in ops))
    issued = mesh.stats.mark()
    start = time.perf_counter()
    works = dist.batch_isend_irecv(p2p_ops)
    seconds = time.perf_counter() - start if issued is None else 0.0
    for i, op in enumerate(ops):
        mesh.stats.record(op.kind, axis, _nbytes(op.tensor), seconds if i == 0 else 0.0)
    wait_op = "recv" if any(op.kind == "recv" for op in ops) else "send"
    return CommHandle(works, mesh.stats, wait_op, axis, None, where=(mesh.rank, mesh.ranks(axis)), traced=traced,
                      issued=issued, wait_timeout_s=mesh.wait_timeout_s)


# --------------------------------------------------------------------------------------------
# Autograd-aware ops
# --------------------------------------------------------------------------------------------


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous().clone(), ctx.mesh, ctx.axis), None, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis):
        return all_reduce(x.contiguous().clone(), mesh, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, dim, grad_op):
        ctx.mesh, ctx.axis, ctx.dim, ctx.grad_op = mesh, axis, dim, grad_op
        return all_gather(x, mesh, axis, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_op == "split":
            g = _own_chunk(grad, ctx.mesh, ctx.axis, ctx.dim)
        else:
            g = reduce_scatter(grad, ctx.mesh, ctx.axis, dim=ctx.dim)
        return g, None, None, None, None


class _ScatterAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return _own_chunk(x, mesh, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.mesh, ctx.axis, dim=ctx.dim), None, None, None


class _ReduceScatterAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return reduce_scatter(x, mesh, axis, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.mesh, ctx.axis, dim=ctx.dim), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, output_split_sizes, input_split_sizes):
        ctx.mesh, ctx.axis = mesh, axis
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        return all_to_all_single(x, mesh, axis, output_split_sizes=output_split_sizes,
                                 input_split_sizes=input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        # The inverse exchange: what came from member i goes back to member i.
        g = all_to_all_single(grad.contiguous(), ctx.mesh, ctx.axis, output_split_sizes=ctx.input_split_sizes,
                              input_split_sizes=ctx.output_split_sizes)
        return g, None, None, None, None


def _own_chunk(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    n = mesh.size(axis)
    if x.shape[dim] % n != 0:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} cannot be split over {axis}={n} ranks; "
                         f"it must be a multiple of {n}")
    return x.chunk(n, dim=dim)[mesh.local_rank(axis)].contiguous()


def copy_to_group(x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel layer)."""
    return _CopyToGroup.apply(x, mesh, axis) if mesh.size(axis) > 1 else x


def reduce_from_group(x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (output of a row-parallel layer)."""
    return _ReduceFromGroup.apply(x, mesh, axis) if mesh.size(axis) > 1 else x


def gather_along_dim(x: torch.Tensor, mesh: Mesh, axis: str, *, dim: int, grad_op: str = "split") -> torch.Tensor:
    """All-gather forward (concatenate along `dim`). Backward, by what the consumer did:

    grad_op="split": the consumer computes the same thing on every rank (the full gradient is
    already identical everywhere), so each rank keeps its own chunk -- no communication.
    grad_op="reduce_scatter": each rank's consumer contributes a partial gradient of the whole
    (sequence parallelism: the gathered activations feed a column-parallel layer), so the chunks
    are summed over ranks.
    """
    if grad_op not in ("split", "reduce_scatter"):
        raise ValueError(f"grad_op={grad_op!r} must be 'split' or 'reduce_scatter'")
    return _GatherAlongDim.apply(x, mesh, axis, dim, grad_op) if mesh.size(axis) > 1 else x


def scatter_along_dim(x: torch.Tensor, mesh: Mesh, axis: str, *, dim: int) -> torch.Tensor:
    """Keep this rank's chunk along `dim` forward (no communication); all-gather the gradient backward."""
    return _ScatterAlongDim.apply(x, mesh, axis, dim) if mesh.size(axis) > 1 else x


def reduce_scatter_along_dim(x: torch.Tensor, mesh: Mesh, axis: str, *, dim: int) -> torch.Tensor:
    """Sum over ranks and keep this rank's chunk along `dim` forward; all-gather backward."""
    return _ReduceScatterAlongDim.apply(x, mesh, axis, dim) if mesh.size(axis) > 1 else x


def all_to_all(x: torch.Tensor, mesh: Mesh, axis: str, *, output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Differentiable all_to_all_single along dim 0 (uneven splits allowed); backward is the inverse exchange."""
    if mesh.size(axis) == 1:
        return x
    osz = list(output_split_sizes) if output_split_sizes is not None else None
    isz = list(input_split_sizes) if input_split_sizes is not None else None
    return _AllToAll.apply(x, mesh, axis, osz, isz)
