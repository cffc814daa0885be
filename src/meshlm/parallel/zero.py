"""ZeRO-1/2/3: optimizer state, gradients (stage >= 2) and parameters (stage 3) sharded over "dp_shard".

Responsible for: `apply_zero(model, mesh, stage=..., bucket_size_mb=...) -> ZeroSharding`, which
attaches gradient hooks that reduce-scatter bucketed gradients into this rank's flat gradient shard
(launched asynchronously as backward produces them, like `parallel/data.py`'s all-reduce),
`ZeroSharding.no_sync()` for accumulation, the global gradient-norm function (tensor-parallel aware),
and ZeRO-3's gathering of parameters one unit ahead, whole model or pipeline stage. As with data parallelism,
the gradient hooks hold the returned object weakly: keep it while the model trains.
Not responsible for: the optimizer over the flat shard (`parallel/zero_adamw.py`, `ZeroAdamW`), the
bucket hooks and their in-order launch (the shared engine of `parallel/buckets.py`), sharding the
data, or the loss normalisation (the trainer; gradients are SUMMED over ranks exactly as in
`parallel/data.py`).

Stages. Every rank computes full gradients (of its tokens) in every stage.
  stage 1: full fp32 parameters everywhere; the model's `.grad` tensors stay allocated (the full
           gradient is kept); the AdamW moments and the fp32 update are sharded (1/dp_shard each).
  stage 2: as stage 1, but each parameter's `.grad` is freed as soon as its bucket has been copied
           out for the reduce-scatter, during backward; what a rank keeps is its gradient shard.
  stage 3: as stage 2, and the parameters too live only as this rank's flat shard. A bucket is a
           unit -- one transformer block (`model.layers`), or the rest of the model (embedding, final
           norm, head) -- whose parameters are views of one padded flat buffer; the buffer's storage
           is all-gathered before the unit's forward (a forward pre-hook) and again, when it was freed,
           as the gradient of the unit's output arrives (a hook on that output: it fires in every pass
           that walks through the unit). Between uses every parameter has storage of size 0
           (`full_params()` gathers them all, for inspection; checkpoints read the flat shards instead,
           `param_ranges`). Prefetch: when a unit is gathered, the gather of the unit that runs next
           (next block in forward; previous block in backward) is started asynchronously, so its
           all-gather overlaps this unit's compute. These gathers run on a second set of process groups
           (`Mesh.duplicate`): the reduce-scatters of backward are launched when a bucket's gradients are
           in, a local event, so on one group the two kinds could interleave differently on different ranks.
           When a unit is freed is `reshard_after_forward` (parallel.zero3_reshard_after_forward, FSDP2's
           name and meaning; unset: false under pipeline parallelism, true otherwise, as torchtitan):
    True   freed after each forward and, in backward, once the next unit's backward starts (the gradient
           reaching that unit's output went through every node of this one that reads a weight) or the
           pass ends. The root unit of a whole-model forward is kept from its forward into its
           backward, which follows at once (freed when the first block's backward starts; the
           embedding lookup's backward reads no weight): at most the root and two blocks are full in
           forward, two blocks in backward.
    False  kept from the first forward of the step until the backward that reduces (the last
           micro-step's, freeing each unit as that backward is done with it) or, under a pipeline,
           until `reduce_grads()`: every unit of the model (stage) is full during the step.
           Pipeline parallelism (`pipeline_chunks`): the stage's forward calls the embedding, its blocks,
           the final norm and the head one by one, never the model, so the hooks sit on those modules:
           a block is its own unit, the root unit holds whatever of embedding / norm / head the stage has
           (none on a middle stage) and is gathered before the first of them and done after the last;
           prefetches stay within a chunk. Micro-batches run out of order (several forwards before their
           backwards, chunks interleaved): every forward and every backward pass gathers what it needs,
           so the order does not matter. The root unit is not kept into backward (it comes actions later).
           zero_bubble's B walks the chain like a fused backward (gathers); its W computes weight
           gradients only, from module outputs to their own parameters, which reads no weight: inside
           `weight_pass()` nothing is gathered (a W that falls back to walking the chain, under full
           recomputation, gathers like a backward). A stage's root unit holding just the embedding is not
           gathered for backward at all.
           All-gathers on the shard axis per optimizer step, with m micro-batches (micro-steps) of this
           rank and P(u) the padded bytes of unit u:
             False:               sum over units of P(u)                      (each unit once per step)
             True, whole model:   m x (2 x sum over blocks of P(b) + P(root))
             True, pipeline:      m x sum over the stage's units of (1 + w x g(u)) x P(u), g(u) = 0 for a
                                  root unit of just the embedding (the first stage), else 1; w the
                                  backward passes walking the chain per micro-batch: 1, or 2 where
                                  zero_bubble's W walks it again after B (full recomputation; on the
                                  first stage B has no input gradient to compute then: 1).
Accumulation: inside `no_sync()` gradients accumulate locally in `.grad` (the full gradient, in every
stage) and the last micro-step's backward reduce-scatters the accumulated sum once.

Flat layout and padding. Parameters are grouped into buckets in reverse registration order (the
order backward produces them). Each bucket is one flat buffer of its parameters' gradients,
zero-padded at the end to a multiple of n = dp_shard, so that it splits into n equal chunks;
rank r owns chunk r of every bucket, and its flat shard is the concatenation of those chunks.
The padding is at most n - 1 elements per bucket; padded elements have zero gradient, zero
parameter and zero moments, so AdamW leaves them zero. Communication per optimizer step, on
"dp_shard": one reduce-scatter per bucket (counted as the padded bucket bytes) and, stages 1/2, one
all-gather per bucket of the updated parameters (the padded bucket bytes again); stage 3 instead
all-gathers the units around their uses (the formulas above).
Memory beyond the model: the fp32 master shard (4 bytes / dp_shard per parameter, next to the
moments' 8), and one padded bucket buffer per reduce-scatter in flight; stage 3 also the gathered units
(True: the root and two blocks at most; False: the whole model, or stage, during the step).

Hybrid sharding (dp_replicate > 1): after the reduce-scatter the gradient shard is all-reduced over
"dp_replicate" (the ranks holding the same shard in other replicas), so every replica computes the
same update; parameters are gathered within the replica only.

Weight decay: the same rule as `train.optim.param_groups` (>= 2-D tensors decayed), carried as a
flat boolean mask over the shard.

Context parallelism (cp > 1): the cp ranks of a replica are data-parallel ranks for the parameters
(same weights, different tokens), so everything above happens over "dp_shard_cp" (dp_shard x cp)
instead of "dp_shard", and the initial broadcast over "dp_cp".

Expert parallelism (ep > 1): two shardings of one model, used as one (`ZeroGroup`): the experts over
"ep_dp" (the ranks holding the same experts, across replicas: no replica all-reduce), everything else
as above; each is built with `params=` its parameters. Under stage 3 both gather per block -- the
rest's units hold a block's dense parameters (plus the root unit), the experts' units a block's experts
only (no root unit; no unit for a dense block) -- and each gathers on its own duplicated groups.

Tensor parallelism underneath (tp > 1): ZeRO works on the TP-local shards, which are ordinary local
tensors to it; only the gradient norm needs to know which elements are TP shards (summed over "tp")
and which are replicated over tp (norm weights: counted once). The flat mask `tp_sharded` says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh
from meshlm.parallel.buckets import Bucket, GradientBuckets, group_by_size, trainable_parameters

REPLICATE_AXIS = "dp_replicate"
# Reduce-scatters in flight during backward: each holds a padded copy of its bucket's gradients. One
# is enough to overlap: the next bucket is launched a whole bucket's backward later, by which time the
# previous reduce-scatter has usually finished (benchmarks/zero.py: same step time, less memory than 2).
MAX_REDUCE_SCATTERS_IN_FLIGHT = 1


class _ShardedBucket(Bucket):
    """A bucket padded to `num_shards` equal chunks, of which this rank owns one (`chunk` elements at
    `shard_offset` of its flat shard); under ZeRO-3 also the unit whose parameters live in it."""

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], num_shards: int,
                 shard_offset: int):
        super().__init__(index, params, names, pad_to=num_shards)
        self.chunk = self.padded // num_shards
        self.shard_offset = shard_offset
        self.unit: nn.Module | None = None  # ZeRO-3: the module around whose passes the bucket is gathered
        self.full: torch.Tensor | None = None  # ZeRO-3: the padded full parameters (storage freed between uses)
        self.gathered = False
        self.gather_handle: comm.CommHandle | None = None  # ZeRO-3: a gather in flight (prefetch)
        self.next_forward: _ShardedBucket | None = None  # ZeRO-3: the unit whose forward comes next
        self.next_backward: _ShardedBucket | None = None  # ... and whose backward comes next
        # ZeRO-3: whether the unit's backward reads its parameters (False for a pipeline stage's root unit that
        # holds just the embedding: the lookup's backward reads no weight)
        self.backward_gather = True


class ZeroSharding(GradientBuckets):
    """The hooks, buckets and flat shard that `apply_zero` attached to a model (the model is unchanged)."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, stage: int, bucket_size_mb: float,
                 params: list[nn.Parameter] | None = None, shard_axis: str | None = None,
                 replicate_axis: str | None = REPLICATE_AXIS, data_axis: str | None = None,
                 other_shards_axis: str | None = None, init=None, reshard_after_forward: bool = True,
                 pipeline_chunks: list[list[nn.Module]] | None = None):
        if stage not in (1, 2, 3):
            raise ValueError(f"parallel.zero_stage={stage} must be 1, 2 or 3 (0 is plain data parallelism)")
        for name, p in trainable_parameters(model):
            if p.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"parameter {name} is {p.dtype}; ZeRO keeps fp32 master weights, build the "
                                 "model in fp32 and use train.precision=bf16 for bf16 compute")
        self.model, self.mesh, self.stage = model, mesh, stage
        # ZeRO-3 (see the module doc): free a unit after each forward (True) or keep it until the step's
        # reduction (False); `pipeline_chunks`: under pipeline parallelism the modules each chunk's forward calls
        self.reshard_after_forward, self.pipeline_chunks = reshard_after_forward, pipeline_chunks
        self._in_backward: _ShardedBucket | None = None  # ZeRO-3: the unit whose backward runs now
        self._pass_open = False  # ZeRO-3: the end of the backward pass in progress is queued
        self._weights_only = False  # ZeRO-3: inside `weight_pass()`
        # Context parallelism: the cp ranks of a replica hold the same parameters and see different
        # tokens, exactly like dp_shard ranks, so they share the sharding (see the module doc).
        cp = mesh.size("cp") > 1
        default_shard, default_data = ("dp_shard_cp", "dp_cp") if cp else ("dp_shard", "dp")
        self.shard_axis, self.data_axis = shard_axis or default_shard, data_axis or default_data
        self.replicate_axis = replicate_axis  # None: the shard axis spans every replica already
        # Ranks holding other parameters of the same kind (expert parallelism: "ep", the other experts):
        # the gradient norm sums their squares too.
        self.other_shards_axis = other_shards_axis
        self.num_shards, self.shard_rank = mesh.size(self.shard_axis), mesh.local_rank(self.shard_axis)
        groups = self._unit_groups(params) if stage == 3 else group_by_size(model, bucket_size_mb, params=params)
        buckets, offset = [], 0
        for params, names in groups:
            buckets.append(_ShardedBucket(len(buckets), params, names, self.num_shards, offset))
            offset += buckets[-1].chunk
        self.shard_numel = offset
        super().__init__(buckets, max_in_flight=MAX_REDUCE_SCATTERS_IN_FLIGHT)  # hooks fire in backward only
        # The gradient shard: reduce-scatter outputs land in views of it, one per bucket. It exists from
        # the first reduce-scatter of a step until the optimizer's zero_grad (`release_grad_shard`).
        self.grad_shard: torch.Tensor | None = None
        # The master shard the optimizer updates; its `.grad` is the gradient shard, so
        # `clip_grad_norm([param_shard], ...)` clips exactly what the optimizer steps on. A model built sharded
        # (`init`, ZeRO-3: parameters without storage) takes each unit's values from `init`, one unit at a time.
        self.param_shard = nn.Parameter(self.local_shard(
            init.flat_range if init is not None else (lambda name, p, start, end: p.detach().reshape(-1)[start:end])),
            requires_grad=False)
        # Elements of TP-sharded parameters (None without tensor parallelism): the norm sums them over tp.
        self.tp_sharded = None
        if mesh.size("tp") > 1:
            self.tp_sharded = self.local_shard(  # padding: False (its gradient is zero)
                lambda name, p, start, end: float(getattr(p, "_meshlm_shard", (None,))[0] == "tp")).bool()
        # Elements the gradient norm skips (None: none): a tied head's copy of the embedding under pp, counted
        # on the first stage (`tied.TiedEmbedding`).
        self.uncounted = None
        if any(getattr(p, "_meshlm_tied_copy", False) for b in buckets for p in b.params):
            self.uncounted = self.local_shard(
                lambda name, p, start, end: float(getattr(p, "_meshlm_tied_copy", False))).bool()
        if stage == 3:
            self.gather_mesh = mesh.duplicate(self.shard_axis)  # the parameter gathers' own groups (see the module doc)
            if pipeline_chunks is None:
                self._link_units()
            else:
                self._link_pipeline_units(pipeline_chunks)

    def _unit_groups(self, only: list[nn.Parameter] | None) -> list[tuple[list[nn.Parameter], list[str]]]:
        """ZeRO-3: one bucket per transformer block, in backward order, then the rest (embedding, final
        norm, head) -- the units whose parameters are gathered around their forward and backward.

        `only`: just these of the model's parameters (expert parallelism shards the experts and the
        rest over different groups, as two shardings of the same blocks). A unit left with no
        parameters gets no bucket: the experts' sharding has no root unit, nor units for dense blocks."""
        self._units = []
        layers = getattr(self.model, "layers", None)
        blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])
        name_of = {id(p): name for name, p in trainable_parameters(self.model)}
        keep = None if only is None else {id(p) for p in only}
        groups, seen = [], set()
        for unit in [*reversed(blocks), self.model]:
            params = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen
                      and (keep is None or id(p) in keep)]
            seen.update(id(p) for p in params)
            if params:
                groups.append((params, [name_of[id(p)] for p in params]))
                self._units.append(unit)
        return groups

    def _link_units(self) -> None:
        """Forward runs the root (embedding...), if this sharding has one, then blocks 0..N-1; backward
        the root's head, then N-1..0. A unit is gathered in a forward pre-hook on its module."""
        for b, unit in zip(self.buckets, self._units):
            b.unit = unit
        self.root = next((b for b in self.buckets if b.unit is self.model), None)
        blocks_backward = [b for b in self.buckets if b is not self.root]
        head = [self.root] if self.root is not None else []
        forward = [*head, *reversed(blocks_backward)]
        backward = [*head, *blocks_backward]
        for order, attr in ((forward, "next_forward"), (backward, "next_backward")):
            for b, nxt in zip(order, order[1:]):
                setattr(b, attr, nxt)
        for b in self.buckets:
            self._hooks += [b.unit.register_forward_pre_hook(lambda m, a, b=b: self._use(b, b.next_forward)),
                            b.unit.register_forward_hook(lambda m, a, o, b=b: self._after_forward(b, o))]

    def _link_pipeline_units(self, chunks: list[list[nn.Module]]) -> None:
        """Under pipeline parallelism the stage's forward never calls the model: it calls, per chunk, the
        embedding (first stage), the chunk's blocks, the final norm and the head (last stage), in that
        order (`PipelineStage.chunk_modules`). A block is its own unit; the root unit (whatever of the
        embedding, norm and head this rank holds) is gathered before the first of its modules in the
        chunk and done after the last. Prefetches stay within a chunk: which chunk or micro-batch runs
        next is the schedule's business."""
        for b, unit in zip(self.buckets, self._units):
            b.unit = unit
        self.root = next((b for b in self.buckets if b.unit is self.model), None)
        bucket_of = {id(b.unit): b for b in self.buckets if b is not self.root}
        if self.root is not None:
            bucket_of.update((id(m), self.root) for m in self.model.children() if m is not self.model.layers)
        embed = getattr(self.model, "embed", None)
        placed = set()
        for modules in chunks:
            order: list[list] = []  # [bucket, first module, last module] in forward order
            for mod in modules:
                b = bucket_of.get(id(mod))
                if b is None:
                    continue  # a module of no unit of this sharding (experts': a dense block, the root)
                if order and order[-1][0] is b:
                    order[-1][2] = mod
                else:
                    order.append([b, mod, mod])
            for b, first, last in order:
                assert id(b) not in placed, "a unit runs in one chunk of the stage"
                placed.add(id(b))
                b.backward_gather = not (first is embed and last is embed)
            for (b, _, _), (nxt, _, _) in zip(order, order[1:]):
                b.next_forward = nxt
            backward = [b for b, _, _ in reversed(order) if b.backward_gather]
            for b, nxt in zip(backward, backward[1:]):
                b.next_backward = nxt
            for b, first, last in order:
                self._hooks += [first.register_forward_pre_hook(lambda m, a, b=b: self._use(b, b.next_forward)),
                                last.register_forward_hook(lambda m, a, o, b=b: self._after_forward(b, o))]

    # -- ZeRO-3: parameters live as shards; full only around the forward / backward of their unit ---

    @torch.no_grad()
    def _shard_parameters(self) -> None:
        """Point every parameter into its bucket's flat buffer, then free the buffers (stage 3)."""
        for b in self.buckets:
            # the values do not matter: the buffer is freed below and gathered from the shards before any use
            p0 = b.params[0]
            b.full = torch.empty(b.padded, dtype=p0.dtype, device=p0.device)
            for i, p in enumerate(b.params):
                p.data = b.unflat(b.full, i)
            b.gathered = True
            self.free(b)

    def _start_gather(self, bucket: _ShardedBucket) -> None:
        if self.stage < 3 or bucket.gathered or bucket.gather_handle is not None:
            return
        bucket.full.untyped_storage().resize_(bucket.padded * bucket.full.element_size())
        bucket.gather_handle = comm.all_gather_into_tensor(
            bucket.full, self.shard_of(bucket, self.param_shard).contiguous(), self.gather_mesh, self.shard_axis,
            async_op=True)

    @torch.no_grad()
    def gather(self, bucket: _ShardedBucket) -> None:
        """Make the bucket's parameters full (waiting for a prefetch in flight, or gathering now)."""
        if self.stage < 3 or bucket.gathered:
            return
        self._start_gather(bucket)
        bucket.gather_handle.wait()
        bucket.gather_handle, bucket.gathered = None, True

    def _use(self, bucket: _ShardedBucket, upcoming: _ShardedBucket | None) -> None:
        """Before a unit's forward: its parameters now, the next unit's on the way."""
        self.gather(bucket)
        if upcoming is not None:
            self._start_gather(upcoming)

    def _frees_in_backward(self) -> bool:
        """Whether backward frees a unit once done with it: always when resharding after forward, else only
        in the backward that reduces (the last of the step: no later pass of the step needs the unit)."""
        return self.reshard_after_forward or self._sync_enabled

    def free(self, bucket: _ShardedBucket) -> None:
        if self.stage < 3:
            return
        if bucket.gather_handle is not None:  # a prefetch that was not used after all
            bucket.gather_handle.wait()
            bucket.gather_handle, bucket.gathered = None, True
        if bucket.gathered:
            # The parameters stay views of this storage; a later gather refills it in place.
            bucket.full.untyped_storage().resize_(0)
            bucket.gathered = False

    def _after_forward(self, bucket: _ShardedBucket, output) -> None:
        backward_follows = torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad
        # Kept: without resharding, until the step's reduction; resharding, the root unit of a whole-model
        # forward, whose backward (head, final norm) starts right after its forward ends (as FSDP2 keeps its
        # root) -- not a pipeline stage's, whose backward comes some actions later.
        keep = backward_follows and (not self.reshard_after_forward
                                     or (bucket is self.root and self.pipeline_chunks is None))
        if not keep:
            self.free(bucket)
        if backward_follows and bucket.backward_gather:
            # The gradient of the unit's output arrives just before the unit's own backward: gather
            # then. (A module full-backward pre-hook would do too, but warns for the root, whose
            # input -- token ids -- needs no gradient.) It fires in every pass that walks through the
            # unit: a fused backward, zero_bubble's B, and a W that walks the chain again.
            output.register_hook(lambda grad: self._backward_use(bucket))

    @contextlib.contextmanager
    def weight_pass(self):
        """Backward passes inside compute weight gradients only, each from a module's output to that
        module's own parameters (zero_bubble's W, `pipeline.SplitBackward`): no node of theirs reads a
        weight, so none gathers a unit (the head's output, the logits, is also the root unit's output)."""
        self._weights_only = True
        try:
            yield
        finally:
            self._weights_only = False

    def _backward_use(self, bucket: _ShardedBucket) -> None:
        """A unit's backward starts: the unit before it in this pass is done with its parameters (the
        gradient reaching this unit's output went through all of that unit's input-gradient nodes, the
        only ones that read weights); gather this one, prefetch the next."""
        if self._weights_only:
            return
        if not self._pass_open:  # free what the pass leaves gathered once it ends (B of zero_bubble, too)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
            self._pass_open = True
        previous, self._in_backward = self._in_backward, bucket
        if previous is not None and previous is not bucket and self._frees_in_backward():
            self.free(previous)
        self.gather(bucket)
        if bucket.next_backward is not None:
            self._start_gather(bucket.next_backward)

    def _end_of_pass(self) -> None:
        self._pass_open, self._in_backward = False, None
        if self._frees_in_backward():
            for b in self.buckets:
                self.free(b)

    @contextlib.contextmanager
    def full_params(self):
        """Full parameters inside (checkpoints, inspection); under ZeRO-3 they are freed again on exit.
        Changes made to them inside are not kept under ZeRO-3 (the shard is the master)."""
        for b in self.buckets:
            self.gather(b)
        try:
            yield
        finally:
            for b in self.buckets:
                self.free(b)

    # -- views of the flat shard --------------------------------------------------------------

    def shard_of(self, bucket: _ShardedBucket, flat_shard: torch.Tensor) -> torch.Tensor:
        return flat_shard[bucket.shard_offset:bucket.shard_offset + bucket.chunk]

    def shard_ranges(self, select) -> list[tuple[int, int]]:
        """[start, end) ranges of this rank's flat shard holding parameters `p` with `select(p)` true
        (adjacent ranges merged): the places a per-parameter rule applies, without a flat mask."""
        ranges: list[tuple[int, int]] = []
        for b in self.buckets:
            mine = self.shard_rank * b.chunk
            for p, offset in zip(b.params, b.offsets):
                start, end = max(offset, mine), min(offset + p.numel(), mine + b.chunk)
                if start < end and select(p):
                    start, end = b.shard_offset + start - mine, b.shard_offset + end - mine
                    if ranges and ranges[-1][1] == start:
                        ranges[-1] = (ranges[-1][0], end)
                    else:
                        ranges.append((start, end))
        return ranges

    def param_ranges(self):
        """(name, parameter, start, end, shard_start) for every parameter part this rank's flat shard
        holds: elements [start, end) of the flattened (TP-local) parameter live at [shard_start,
        shard_start + end - start) of the shard. What a checkpoint writes and reads in place."""
        for b in self.buckets:
            mine = self.shard_rank * b.chunk
            for name, p, offset in zip(b.names, b.params, b.offsets):
                start, end = max(offset, mine), min(offset + p.numel(), mine + b.chunk)
                if start < end:
                    yield name, p, start - offset, end - offset, b.shard_offset + start - mine

    @torch.no_grad()
    def local_shard(self, value_of) -> torch.Tensor:
        """This rank's flat shard, in the parameters' dtype: `value_of(name, param, start, end)` gives elements
        [start, end) of a parameter, flattened (None: zeros), for each part the shard holds (`param_ranges`); the
        padding is zeros. Only this rank's elements are asked for, so a model built sharded draws only what it
        holds."""
        p0 = self.buckets[0].params[0]
        shard = torch.zeros(self.shard_numel, dtype=p0.dtype, device=p0.device)
        for name, p, start, end, at in self.param_ranges():
            value = value_of(name, p, start, end)
            if value is not None:
                shard[at:at + end - start] = value
        return shard

    @torch.no_grad()
    def gather_full(self, flat_shard: torch.Tensor) -> dict[int, torch.Tensor]:
        """The full tensors of every parameter from every rank's flat shard (an all-gather per bucket)."""
        out = {}
        for b in self.buckets:
            full = flat_shard.new_empty(b.padded)
            comm.all_gather_into_tensor(full, self.shard_of(b, flat_shard).contiguous(), self.mesh, self.shard_axis)
            for i, p in enumerate(b.params):
                out[id(p)] = b.unflat(full, i)
        return out

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Copy the parameters of dp coordinate 0 to every data-parallel rank (one broadcast per bucket)."""
        for b in self.buckets:
            flat = b.flat(b.params)
            comm.broadcast(flat, self.mesh, self.data_axis, src=0)
            for i, p in enumerate(b.params):
                p.copy_(b.unflat(flat, i))
        self.param_shard.copy_(self.local_shard(lambda name, p, start, end: p.detach().reshape(-1)[start:end]))

    # -- the bucket engine: a reduce-scatter into this rank's gradient shard per bucket ----------

    @torch.no_grad()
    def launch(self, bucket: _ShardedBucket) -> comm.CommHandle:
        if self.grad_shard is None:  # every chunk is written by its reduce-scatter: no zeroing needed
            p0 = bucket.params[0]
            self.grad_shard = torch.empty(self.shard_numel, dtype=p0.dtype, device=p0.device)
            self.param_shard.grad = self.grad_shard
        bucket.buffer = bucket.flat(p.grad for p in bucket.params)
        if self.stage >= 2:
            for p in bucket.params:  # the full gradient is not kept: the shard is all this rank needs
                p.grad = None
        return comm.reduce_scatter_tensor(self.shard_of(bucket, self.grad_shard), bucket.buffer,
                                          self.mesh, self.shard_axis, async_op=True)

    def release_grad_shard(self) -> None:
        """Drop the gradient shard (the optimizer's zero_grad): no memory for it between steps."""
        self.grad_shard = self.param_shard.grad = None

    def on_bucket_complete(self, bucket: _ShardedBucket) -> None:
        if self._frees_in_backward():
            self.free(bucket)  # ZeRO-3: the unit's backward is done with its full parameters

    def after_backward(self, synced: bool) -> None:
        if synced or self.reshard_after_forward:
            for bucket in self.buckets:
                self.free(bucket)  # ZeRO-3: units whose parameters this backward did not reach
        if synced and self.replicate_axis is not None:
            # Hybrid sharding: the same shard of the other replicas holds their tokens' share.
            comm.all_reduce(self.grad_shard, self.mesh, self.replicate_axis)

    # -- after backward -----------------------------------------------------------------------

    @property
    def parts(self) -> list["ZeroSharding"]:
        """The shardings of the model (this one; see `ZeroGroup`)."""
        return [self]

    def grad_norm_fn(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm of the reduced gradient, from this rank's shard (`grads` is `[param_shard.grad]`,
        i.e. the gradient shard, as `clip_grad_norm` passes it)."""
        (g,) = [g.detach() for g in grads]
        return self.grad_sq_norm().sqrt().to(torch.promote_types(g.dtype, torch.float32))

    def grad_sq_norm(self) -> torch.Tensor:
        """The squared global norm of this sharding's reduced gradient (float64; collective).

        Sums of squares are all-reduced over the shard axis: shards are disjoint within a replica and
        equal across replicas (after the hybrid all-reduce), so that suffices. Under tensor parallelism
        the elements of TP shards are then summed over "tp" too, while replicated ones (norm weights,
        equal on every tp rank) are counted once; with `other_shards_axis` (experts) everything is."""
        g = self.grad_shard.detach()
        if self.uncounted is not None:
            g = g.masked_fill(self.uncounted, 0)
        if self.tp_sharded is None:
            sq = torch.linalg.vector_norm(g, dtype=torch.float64).reshape(1) ** 2
            comm.all_reduce(sq, self.mesh, self.shard_axis)
            total = sq[0]
        else:
            sq = torch.stack([torch.linalg.vector_norm(g[self.tp_sharded], dtype=torch.float64),
                              torch.linalg.vector_norm(g[~self.tp_sharded], dtype=torch.float64)]) ** 2
            comm.all_reduce(sq, self.mesh, self.shard_axis)
            sharded = sq[:1].clone()
            comm.all_reduce(sharded, self.mesh, "tp")
            total = sharded[0] + sq[1]
        if self.other_shards_axis is not None:
            total = comm.all_reduce(total.reshape(1).clone(), self.mesh, self.other_shards_axis)[0]
        return total


class ZeroGroup:
    """Several `ZeroSharding`s over disjoint parameters of one model, each over its own group, used as
    one (expert parallelism: the dense parameters sharded over dp_shard, the experts over "ep_dp", the
    ranks holding the same experts). `ZeroAdamW` steps every part."""

    def __init__(self, parts: list[ZeroSharding]):
        self.parts = parts
        self.stage = parts[0].stage

    def no_sync(self):
        stack = contextlib.ExitStack()
        for part in self.parts:
            stack.enter_context(part.no_sync())
        return stack

    @contextlib.contextmanager
    def full_params(self):
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.full_params())
            yield

    def reduce_grads(self) -> None:
        for part in self.parts:
            part.reduce_grads()

    def weight_pass(self):
        stack = contextlib.ExitStack()
        for part in self.parts:
            stack.enter_context(part.weight_pass())
        return stack

    def grad_norm_fn(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """The global norm over every part (`grads`: the parts' gradient shards, as `clip_grad_norm` passes)."""
        dtype = torch.promote_types(next(iter(grads)).dtype, torch.float32)
        return sum(part.grad_sq_norm() for part in self.parts).sqrt().to(dtype)


def apply_zero(model: nn.Module, mesh: Mesh, *, stage: int, bucket_size_mb: float = 25.0,
               broadcast: bool = True, reshard_after_forward: bool = True,
               pipeline_chunks: list[list[nn.Module]] | None = None, **axes) -> ZeroSharding:
    """Shard optimizer state (stage 1), gradients (2) and parameters (3) of `model` over "dp_shard", in place.

    Collective over "dp" (and, stage 3, over the whole world once, to create the gather groups: every
    rank applies the same shardings in the same order). Build the optimizer with `ZeroAdamW(zero, ...)`
    (`train.optim.build_optimizer` does when given the handle). `broadcast=True` starts every replica
    from dp coordinate 0's weights. `axes`: the `ZeroSharding` keywords for a part of the model over
    other groups (params, shard_axis, replicate_axis, data_axis, other_shards_axis; see `ZeroGroup`).
    Stage 3: `reshard_after_forward` (see the module doc); `pipeline_chunks`, under pipeline parallelism,
    the modules each of this rank's chunks calls in order (`PipelineStage.chunk_modules`).
    """
    zero = ZeroSharding(model, mesh, stage=stage, bucket_size_mb=bucket_size_mb,
                        reshard_after_forward=reshard_after_forward, pipeline_chunks=pipeline_chunks, **axes)
    if broadcast:
        zero.broadcast_parameters()
    if stage == 3:
        zero._shard_parameters()
    return zero
