"""The gradient-bucket engine that data parallelism (`data.py`) and ZeRO (`zero.py`) share.

Responsible for: grouping a model's parameters into buckets (flat runs of whole tensors, in reverse
registration order, which approximates the order backward produces their gradients), the
post-accumulate-grad hooks that notice when every gradient of a bucket is in, launching one
asynchronous collective per bucket strictly in bucket order as soon as the bucket and all its
predecessors are ready, the end-of-backward callback that launches what is left and waits for all,
and `no_sync()` for the non-final micro-steps of gradient accumulation.
Not responsible for: which collective a bucket runs or where its result goes -- a subclass says
that in `launch` (start the collective, return its handle) and `finish_bucket` (after the wait);
`on_bucket_complete` and `after_backward` are hooks for ZeRO-3's parameter freeing.

Why strictly in order: collectives on one process group must be issued in the same order on every
rank. Readiness is a local event (a parameter this rank's graph does not reach is never "ready"),
so a bucket that is ready early waits for its predecessors, and anything still pending at the end
of backward is launched then, in order. Every rank therefore issues exactly the same sequence of
bucket collectives, whatever its graph used. (ZeRO-3 also gathers parameters during backward; it
does that on a separate process group so the two sequences cannot interleave differently.)
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from meshlm import comm


class Bucket:
    """Parameters whose gradients go through one collective as one flat buffer.

    The flat layout is the parameters in order, zero-padded at the end to a multiple of `pad_to`
    (ZeRO splits a bucket into equal chunks; data parallelism pads to 1, i.e. not at all).
    """

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], *, pad_to: int = 1):
        self.index, self.params, self.names = index, params, names
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(params))]
        self.numel = sum(numels)
        self.padded = math.ceil(self.numel / pad_to) * pad_to
        self.ready: set[int] = set()  # indices into params whose gradient this backward produced
        self.handle: comm.CommHandle | None = None
        self.buffer: torch.Tensor | None = None  # the flat gradients while a collective uses them

    @property
    def nbytes(self) -> int:
        """Bytes of the padded flat buffer: what one collective over this bucket moves."""
        return self.padded * self.params[0].element_size()

    def flat(self, tensors: Iterable[torch.Tensor | None], out: torch.Tensor | None = None) -> torch.Tensor:
        """The padded flat concatenation of one tensor per parameter (None: zeros), into `out` if given."""
        p0 = self.params[0]
        if out is None:
            out = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        for i, (p, t) in enumerate(zip(self.params, tensors)):
            view = out[self.offsets[i]:self.offsets[i] + p.numel()]
            view.zero_() if t is None else view.copy_(t.reshape(-1))
        return out

    def unflat(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a flat buffer, shaped like the parameter (a view)."""
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) in registration order, each tensor once (tied weights keep their first name)."""
    named, seen = [], set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    return named


def group_by_size(model: nn.Module, bucket_size_mb: float, *,
                  params: list[nn.Parameter] | None = None) -> list[tuple[list[nn.Parameter], list[str]]]:
    """(params, names) per bucket, in reverse registration order; a new bucket starts when the last
    one reached `bucket_size_mb` or the dtype/device changes (a flat buffer holds one of each).
    Whole tensors only, so no bucket is empty and none splits a tensor. `params`: only these of the
    model's trainable parameters (e.g. the experts, reduced over another group than the rest)."""
    if bucket_size_mb <= 0:
        raise ValueError(f"parallel.bucket_size_mb={bucket_size_mb} must be > 0")
    named = trainable_parameters(model)
    if params is not None:
        keep = {id(p) for p in params}
        named = [(name, p) for name, p in named if id(p) in keep]
    if not named:
        raise ValueError("the model has no trainable parameters to reduce")
    limit = bucket_size_mb * 2**20
    groups, params, names, size = [], [], [], 0
    for name, p in reversed(named):
        if params and (p.dtype != params[0].dtype or p.device != params[0].device):
            groups.append((params, names))
            params, names, size = [], [], 0
        params.append(p)
        names.append(name)
        size += p.numel() * p.element_size()
        if size >= limit:
            groups.append((params, names))
            params, names, size = [], [], 0
    if params:
        groups.append((params, names))
    return groups


def weak_hook(method):
    """`method` as a parameter hook that does not keep its object alive.

    A parameter's hooks are held where Python's garbage collector cannot follow them (the autograd graph
    holds the parameter too), so a hook bound to the strategy would keep the strategy -- and through it the
    model, its buckets and ZeRO's shards -- alive for the life of the process after its trainer is gone.
    """
    ref, owner = weakref.WeakMethod(method), type(method.__self__).__name__

    def hook(*args):
        target = ref()
        if target is None:
            raise RuntimeError(f"a gradient hook fired after its {owner} was garbage-collected: keep the object "
                               "the apply_* call returned for as long as the model trains")
        return target(*args)

    return hook


class GradientBuckets:
    """Hooks that launch one collective per bucket, in order, overlapped with backward; see the module doc.

    After a synchronising `loss.backward()` returns, every bucket's collective has been waited for
    and `finish_bucket` has run (the end-of-backward callback); `finish_grad_sync()` is then a no-op.
    """

    def __init__(self, buckets: list[Bucket], *, max_in_flight: int | None = None):
        self.buckets = buckets
        # With a limit, launching a bucket first completes the oldest ones in flight beyond it (wait,
        # `finish_bucket`, drop its buffer): ZeRO's per-launch buffers then never add up to a whole copy
        # of the gradients. None: every collective stays in flight until backward ends.
        self.max_in_flight = max_in_flight
        self._next_wait = 0
        self._sync_enabled = True
        self._backward_syncs = True  # whether the backward in progress reduces (no_sync was off at its start)
        self._callback_queued = False
        self._next_launch = 0
        self._where = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        on_grad_ready = weak_hook(self._on_grad_ready)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad_ready) for b in buckets for p in b.params]

    # -- what a strategy provides ------------------------------------------------------------------

    def launch(self, bucket: Bucket) -> comm.CommHandle:
        """Start the bucket's asynchronous collective from the parameters' `.grad`; return its handle."""
        raise NotImplementedError

    def finish_bucket(self, bucket: Bucket) -> None:
        """After the bucket's collective completed: put its result where the optimizer reads it."""

    def on_bucket_complete(self, bucket: Bucket) -> None:
        """Every gradient of the bucket is in (synchronising or not)."""

    def after_backward(self, synced: bool) -> None:
        """The end of every backward, after the waits (`synced`: whether this backward reduced)."""

    # -- accumulation -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate full gradients locally in `.grad`, with no communication
        (non-final micro-steps of gradient accumulation); the next synchronising backward reduces the sum."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -- backward ---------------------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            # Runs once the whole backward is done: launches what is left, waits, hands results over.
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grad_sync)
            self._callback_queued = True
            self._backward_syncs = self._sync_enabled
        bucket, i = self._where[id(param)]
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self.on_bucket_complete(bucket)
        if self._backward_syncs:
            self._launch_ready()

    def _launch_next(self) -> None:
        # Completing the oldest first, before the new launch allocates its buffer, keeps the buffers
        # alive at any moment at max_in_flight.
        while self.max_in_flight is not None and self._next_launch - self._next_wait >= self.max_in_flight:
            self._complete_next()
        bucket = self.buckets[self._next_launch]
        bucket.handle = self.launch(bucket)
        self._next_launch += 1

    def _complete_next(self) -> None:
        bucket = self.buckets[self._next_wait]
        bucket.handle.wait()
        self.finish_bucket(bucket)
        bucket.handle, bucket.buffer = None, None
        self._next_wait += 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch_next()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Launch the buckets not launched yet (parameters this backward did not reach), wait for all,
        and hand the results over. Called automatically at the end of backward; a no-op otherwise."""
        if not self._callback_queued:
            return
        self._callback_queued = False
        synced = self._backward_syncs
        if synced:
            while self._next_launch < len(self.buckets):
                self._launch_next()
            while self._next_wait < len(self.buckets):
                self._complete_next()
        for bucket in self.buckets:
            bucket.ready.clear()
        self._next_launch = self._next_wait = 0
        self.after_backward(synced)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Reduce what `.grad` holds now, every bucket in order, and wait: for a caller that ran all of
        a step's backward passes inside `no_sync()` (a pipeline step's many partial backwards)."""
        assert not self._callback_queued and self._next_launch == 0, "call it after backward, not during"
        while self._next_launch < len(self.buckets):
            self._launch_next()
        while self._next_wait < len(self.buckets):
            self._complete_next()
        self._next_launch = self._next_wait = 0
        self.after_backward(True)

    @property
    def bucket_bytes(self) -> list[int]:
        """Padded bytes of each bucket in launch order: what one synchronising backward reduces per bucket."""
        return [b.nbytes for b in self.buckets]

    def remove(self) -> None:
        """Detach the hooks (the model becomes a plain single-process model again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
