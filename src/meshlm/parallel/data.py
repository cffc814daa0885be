"""Data parallelism: replicated parameters, gradients summed over the "dp" axis during backward.

Responsible for: `apply_data_parallel(model, mesh)`, which makes the replicas identical at the start
(a broadcast from coordinate 0 of the axis), groups gradients into buckets, and all-reduces each
bucket asynchronously (through `meshlm.comm`, so the bytes are counted) as soon as backward has
produced all of its gradients, overlapping communication with the rest of backward; `no_sync()` for
gradient accumulation; and the gradient-norm function for clipping.
Not responsible for: sharding parameters, gradients or optimizer state (ZeRO, `parallel/zero.py`),
sharding the data (`train.data.BatchLoader(..., dp_rank, dp_size)`), or the loss normalisation.

The contract with the trainer -- gradients are SUMMED over ranks, not averaged:
  every micro-batch loss is sum(token losses) / tokens_in_the_GLOBAL_batch, so a rank's gradient is
  its share of the global-mean gradient and the sum over ranks (and over accumulation micro-steps)
  is exactly the single-process gradient, whatever the dp degree and however unevenly tokens fall on
  ranks. Averaging instead would be right only if every rank held the same number of tokens.
Accumulation: run every micro-step but the last inside `with dp.no_sync():` -- gradients then
accumulate locally in `.grad`, and the last backward reduces the accumulated sum once. Without
no_sync every backward reduces what `.grad` holds, so earlier micro-steps would be counted again.
After `loss.backward()` returns on the last micro-step, every `.grad` already holds the global sum
(the wait happens in a callback at the end of backward); `finish_grad_sync()` is there for callers
that want to be explicit and is a no-op then.

Buckets follow reverse registration order, which approximates the order in which backward produces
gradients (the head first, the embedding last), so the first buckets are ready while backward still
runs. Buckets are launched strictly in order on every rank -- a bucket that is ready early waits for
its predecessors -- because collectives on one group must be issued in the same order everywhere.
A parameter this rank's backward did not reach (an unused branch) contributes zeros and still gets
the summed gradient; but every rank's synchronising backward must reach at least one parameter,
since that is what starts the reduction. Memory: one flat buffer per bucket, i.e. one extra copy of
the gradients (gradients are copied in before and out after the all-reduce).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh


class _Bucket:
    """Parameters whose gradients are reduced together through one flat buffer."""

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str]):
        self.index = index
        self.params = params
        self.names = names
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(params))]
        self.buffer = torch.empty(sum(numels), dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()  # indices into params whose gradient this backward produced
        self.handle: comm.CommHandle | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class GradientSync:
    """What DataParallel and ZeRO share: `no_sync()`, the switch that defers their gradient reduction."""

    _sync_enabled = True

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate full gradients locally in `.grad`, with no communication
        (non-final micro-steps of gradient accumulation)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous


class DataParallel(GradientSync):
    """The hooks and buckets that `apply_data_parallel` attached to a model (the model is unchanged)."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, bucket_size_mb: float, axis: str):
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb} must be > 0")
        self.model, self.mesh, self.axis = model, mesh, axis
        self.bucket_size_mb = bucket_size_mb
        self._sync_enabled = True
        self._callback_queued = False
        self._next_launch = 0
        self.buckets = self._make_buckets(bucket_size_mb)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self.buckets for p in b.params]

    # -- setup ------------------------------------------------------------------------------

    def _make_buckets(self, bucket_size_mb: float) -> list[_Bucket]:
        limit = bucket_size_mb * 2**20
        named, seen = [], set()
        for name, p in self.model.named_parameters():  # tied weights appear once
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        buckets, params, names, size = [], [], [], 0
        for name, p in reversed(named):
            # A flat buffer holds one dtype on one device; a full bucket is closed after the tensor
            # that filled it, so no tensor is ever split and no bucket is empty.
            if params and (p.dtype != params[0].dtype or p.device != params[0].device):
                buckets.append(_Bucket(len(buckets), params, names))
                params, names, size = [], [], 0
            params.append(p)
            names.append(name)
            size += p.numel() * p.element_size()
            if size >= limit:
                buckets.append(_Bucket(len(buckets), params, names))
                params, names, size = [], [], 0
        if params:
            buckets.append(_Bucket(len(buckets), params, names))
        return buckets

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Copy coordinate 0's parameters to every rank of the axis (one broadcast per bucket)."""
        for b in self.buckets:
            for i, p in enumerate(b.params):
                b.view(i).copy_(p)
            comm.broadcast(b.buffer, self.mesh, self.axis, src=0)
            for i, p in enumerate(b.params):
                p.copy_(b.view(i))

    # -- backward -----------------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync_enabled or self.mesh.size(self.axis) == 1:
            return
        if not self._callback_queued:
            # Runs once the whole backward is done: reduces what is left, waits, writes the grads back.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grad_sync)
            self._callback_queued = True
        bucket, i = self._where[id(param)]
        bucket.ready.add(i)
        self._launch_ready()

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        for i, p in enumerate(bucket.params):
            if p.grad is None:  # unused by this rank's graph: it contributes nothing to the sum
                bucket.view(i).zero_()
            else:
                bucket.view(i).copy_(p.grad)
        bucket.handle = comm.all_reduce(bucket.buffer, self.mesh, self.axis, async_op=True)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Reduce any bucket not yet launched (parameters unused this step), wait for all, write back.

        Called automatically at the end of a synchronising backward; calling it again is a no-op.
        """
        if not self._callback_queued:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self.buckets:
            bucket.handle.wait()
            for i, p in enumerate(bucket.params):
                # Every rank writes a gradient, even for a parameter its own graph did not use, so
                # that the optimizer updates the same tensors everywhere and the replicas stay equal.
                if p.grad is None:
                    p.grad = bucket.view(i).clone()
                else:
                    p.grad.copy_(bucket.view(i))
            bucket.handle = None
            bucket.ready.clear()
        self._next_launch = 0
        self._callback_queued = False

    # -- after backward -------------------------------------------------------------------------

    def grad_norm_fn(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the gradients, for `clip_grad_norm(..., norm_fn=dp.grad_norm_fn)`.

        After the all-reduce every rank holds the full gradients, so the local norm is the global
        norm and no communication is needed (ZeRO, TP and PP provide functions that do communicate).
        """
        # at least fp32 (bf16 gradients), fp64 kept as is
        norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.promote_types(g.dtype, torch.float32))
                 for g in grads]
        if not norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(norms))

    @property
    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket in launch order: what one synchronising backward all-reduces."""
        return [b.nbytes for b in self.buckets]

    def remove(self) -> None:
        """Detach the hooks (the model becomes a plain single-process model again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def apply_data_parallel(model: nn.Module, mesh: Mesh, *, bucket_size_mb: float = 25.0, axis: str = "dp",
                        broadcast: bool = True) -> DataParallel:
    """Make `model` data-parallel over `axis` of `mesh`, in place; returns the handle with no_sync().

    `axis` is the group whose members see different tokens of the same replica: "dp" normally,
    "dp_cp" when context parallelism splits sequences too (their gradients are partial sums as well).
    Collective over the axis (every member must call it). `broadcast=True` copies the parameters of
    coordinate 0 to the others first: a deterministic init already makes them equal, but a replica
    that drifted (a different seed, a partial checkpoint load) would otherwise train silently apart.
    """
    mesh.size(axis)  # validates the axis name
    dp = DataParallel(model, mesh, bucket_size_mb=bucket_size_mb, axis=axis)
    if broadcast:
        dp.broadcast_parameters()
    return dp
