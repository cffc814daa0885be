"""Data parallelism: replicated parameters, gradients summed over the "dp" axis during backward.

Responsible for: `apply_data_parallel(model, mesh)`, which makes the replicas identical at the start
(a broadcast from coordinate 0 of the axis), groups gradients into buckets, and all-reduces each
bucket asynchronously (through `meshlm.comm`, so the bytes are counted) as soon as backward has
produced all of its gradients, overlapping communication with the rest of backward; `no_sync()` for
gradient accumulation; and the gradient-norm function for clipping. The hooks hold the returned object
weakly (`buckets.weak_hook`): keep it while the model trains; dropping it with the model frees both.
Not responsible for: sharding parameters, gradients or optimizer state (ZeRO, `parallel/zero.py`),
sharding the data (`data.text.BatchLoader(..., dp_rank, dp_size)`), or the loss normalisation.

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

The bucketing, the hooks and the in-order launch are the shared engine of `parallel/buckets.py`
(buckets in reverse registration order, one async collective each, all waited at the end of
backward); this file only says that a bucket's collective is an all-reduce over `axis`.
A parameter this rank's backward did not reach (an unused branch) contributes zeros and still gets
the summed gradient; but every rank's synchronising backward must reach at least one parameter,
since that is what starts the reduction. Memory: one flat buffer per bucket, i.e. one extra copy of
the gradients (gradients are copied in before and out after the all-reduce).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh
from meshlm.parallel.buckets import Bucket, GradientBuckets, group_by_size


class DataParallel(GradientBuckets):
    """The hooks and buckets that `apply_data_parallel` attached to a model (the model is unchanged).

    Each bucket owns a flat buffer: gradients are copied in, all-reduced in place, copied back.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, *, bucket_size_mb: float, axis: str,
                 params: list[nn.Parameter] | None = None):
        self.model, self.mesh, self.axis = model, mesh, axis
        self.bucket_size_mb = bucket_size_mb
        groups = group_by_size(model, bucket_size_mb, params=params)
        buckets = [Bucket(i, params, names) for i, (params, names) in enumerate(groups)]
        for b in buckets:
            b.flat_buffer = torch.empty(b.padded, dtype=b.params[0].dtype, device=b.params[0].device)
        super().__init__(buckets)

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Copy coordinate 0's parameters to every rank of the axis (one broadcast per bucket)."""
        for b in self.buckets:
            b.flat(b.params, out=b.flat_buffer)
            comm.broadcast(b.flat_buffer, self.mesh, self.axis, src=0)
            for i, p in enumerate(b.params):
                p.copy_(b.unflat(b.flat_buffer, i))

    # -- the bucket engine's two questions: which collective, and where its result goes -------------

    @torch.no_grad()
    def launch(self, bucket: Bucket) -> comm.CommHandle:
        # A parameter unused by this rank's graph (grad None) contributes zeros to the sum.
        bucket.buffer = bucket.flat((p.grad for p in bucket.params), out=bucket.flat_buffer)
        return comm.all_reduce(bucket.buffer, self.mesh, self.axis, async_op=True)

    @torch.no_grad()
    def finish_bucket(self, bucket: Bucket) -> None:
        for i, p in enumerate(bucket.params):
            # Every rank writes a gradient, even for a parameter its own graph did not use, so
            # that the optimizer updates the same tensors everywhere and the replicas stay equal.
            if p.grad is None:
                p.grad = bucket.unflat(bucket.buffer, i).clone()
            else:
                p.grad.copy_(bucket.unflat(bucket.buffer, i))

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


def apply_data_parallel(model: nn.Module, mesh: Mesh, *, bucket_size_mb: float = 25.0, axis: str = "dp",
                        broadcast: bool = True, params: list[nn.Parameter] | None = None) -> DataParallel:
    """Make `model` data-parallel over `axis` of `mesh`, in place; returns the handle with no_sync().

    `axis` is the group whose members see different tokens of the same replica: "dp" normally,
    "dp_cp" when context parallelism splits sequences too (their gradients are partial sums as well).
    `params`: only these parameters (None: all trainable ones). Expert parallelism reduces the dense
    parameters over "dp" and the experts over "ep_dp" (the ranks holding the same experts): two handles.
    Collective over the axis (every member must call it). `broadcast=True` copies the parameters of
    coordinate 0 to the others first: a deterministic init already makes them equal, but a replica
    that drifted (a different seed, a partial checkpoint load) would otherwise train silently apart.
    """
    mesh.size(axis)  # validates the axis name
    dp = DataParallel(model, mesh, bucket_size_mb=bucket_size_mb, axis=axis, params=params)
    if broadcast:
        dp.broadcast_parameters()
    return dp
