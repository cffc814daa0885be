"""ZeRO-1/2/3: optimizer state, gradients (stage >= 2) and parameters (stage 3) sharded over "dp_shard".

Responsible for: `apply_zero(model, mesh, stage=..., bucket_size_mb=...) -> ZeroSharding`, which
attaches gradient hooks that reduce-scatter bucketed gradients into this rank's flat gradient shard
(launched asynchronously as backward produces them, like `parallel/data.py`'s all-reduce),
`ZeroSharding.no_sync()` for accumulation, the global gradient-norm function, and
`ZeroAdamW`, an AdamW over this rank's flat shard of the parameters that all-gathers the updated
parameters after its step and reads/writes its state in the per-parameter layout of the unsharded
AdamW (`full_state_dict` / `load_full_state_dict`), so a checkpoint moves between zero stages and
data-parallel sizes.
Not responsible for: sharding the data, or the loss normalisation (the trainer; gradients are SUMMED
over ranks exactly as in `parallel/data.py`), or prefetching the next unit's parameters (ZeRO-3
gathers synchronously, unit by unit: correct, not yet overlapped).

Stages. Every rank computes full gradients (of its tokens) in every stage.
  stage 1: full fp32 parameters everywhere; the model's `.grad` tensors stay allocated (the full
           gradient is kept); the AdamW moments and the fp32 update are sharded (1/dp_shard each).
  stage 2: as stage 1, but each parameter's `.grad` is freed as soon as its bucket has been copied
           out for the reduce-scatter, during backward; what a rank keeps is its gradient shard.
  stage 3: as stage 2, and the parameters too live only as this rank's flat shard. A bucket is a
           unit -- one transformer block (`model.layers`), or the rest of the model (embedding, final
           norm, head) -- whose parameters are views of one padded flat buffer; the buffer's storage
           is all-gathered before the unit's forward, freed after it, gathered again when the
           gradient of the unit's output arrives, and freed once all the unit's gradients are in.
           Between uses every parameter has storage of size 0 (`full_params()` gathers them all, for
           checkpoints and inspection).
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
all-gathers every unit twice per micro-step (forward and backward): 2 x micro-steps x padded bytes.
Memory beyond the model: the fp32 master shard (4 bytes / dp_shard per parameter, next to the
moments' 8), and one padded bucket buffer per reduce-scatter in flight.

Hybrid sharding (dp_replicate > 1): after the reduce-scatter the gradient shard is all-reduced over
"dp_replicate" (the ranks holding the same shard in other replicas), so every replica computes the
same update; parameters are gathered within the replica only.

Weight decay: the same rule as `train.optim.param_groups` (>= 2-D tensors decayed), carried as a
flat boolean mask over the shard.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh
from meshlm.parallel.data import GradientSync

SHARD_AXIS = "dp_shard"
REPLICATE_AXIS = "dp_replicate"


class _Bucket:
    """Parameters reduce-scattered together; `padded` elements, of which this rank owns `chunk`."""

    def __init__(self, params: list[nn.Parameter], names: list[str], num_shards: int, shard_offset: int):
        self.params, self.names = params, names
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(params))]
        self.numel = sum(numels)
        self.padded = math.ceil(self.numel / num_shards) * num_shards
        self.chunk = self.padded // num_shards
        self.shard_offset = shard_offset  # where this bucket's chunk sits in the rank's flat shard
        self.ready: set[int] = set()
        self.unit: nn.Module | None = None  # ZeRO-3: the module around whose passes the bucket is gathered
        self.full: torch.Tensor | None = None  # ZeRO-3: the padded full parameters (storage freed between uses)
        self.gathered = False
        self.buffer: torch.Tensor | None = None  # gradient input while a reduce-scatter is in flight
        self.handle: comm.CommHandle | None = None

    def flat(self, tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
        """The padded flat concatenation of one tensor per parameter (None: zeros)."""
        p0 = self.params[0]
        out = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        for i, (p, t) in enumerate(zip(self.params, tensors)):
            if t is not None:
                out[self.offsets[i]:self.offsets[i] + p.numel()].copy_(t.reshape(-1))
        return out

    def unflat(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class ZeroSharding(GradientSync):
    """The hooks, buckets and flat shard that `apply_zero` attached to a model (the model is unchanged)."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, stage: int, bucket_size_mb: float):
        if stage not in (1, 2, 3):
            raise ValueError(f"parallel.zero_stage={stage} must be 1, 2 or 3 (0 is plain data parallelism)")
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb} must be > 0")
        self.model, self.mesh, self.stage = model, mesh, stage
        self.num_shards, self.shard_rank = mesh.size(SHARD_AXIS), mesh.local_rank(SHARD_AXIS)
        self.buckets = self._unit_buckets() if stage == 3 else self._make_buckets(bucket_size_mb)
        self.shard_numel = sum(b.chunk for b in self.buckets)
        p0 = self.buckets[0].params[0]
        # The gradient shard: reduce-scatter outputs land in views of it, one per bucket.
        self.grad_shard = torch.zeros(self.shard_numel, dtype=p0.dtype, device=p0.device)
        # The fp32 master shard the optimizer updates; its `.grad` is the gradient shard, so
        # `clip_grad_norm([param_shard], ...)` clips exactly what the optimizer steps on.
        self.param_shard = nn.Parameter(self.local_shard({id(p): p.detach() for b in self.buckets for p in b.params}),
                                        requires_grad=False)
        self.param_shard.grad = self.grad_shard
        self._sync_enabled = True
        self._backward_syncs = True  # whether the backward in progress reduces (no_sync was off at its start)
        self._callback_queued = False
        self._next_launch = 0
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self.buckets for p in b.params]
        if stage == 3:
            for b in self.buckets:
                self._hooks += [b.unit.register_forward_pre_hook(lambda m, a, b=b: self.gather(b)),
                                b.unit.register_forward_hook(lambda m, a, o, b=b: self._after_forward(b, o))]

    def _unit_buckets(self) -> list[_Bucket]:
        """ZeRO-3: one bucket per transformer block, in backward order, then the rest (embedding, final
        norm, head) -- the units whose parameters are gathered around their forward and backward."""
        layers = getattr(self.model, "layers", None)
        blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])
        name_of = {}
        for name, p in self.model.named_parameters():
            name_of.setdefault(id(p), name)
        buckets, seen, offset = [], set(), 0
        for unit in [*reversed(blocks), self.model]:
            params = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            if params:
                buckets.append(_Bucket(params, [name_of[id(p)] for p in params], self.num_shards, offset))
                buckets[-1].unit = unit
                offset += buckets[-1].chunk
        return buckets

    # -- ZeRO-3: parameters live as shards; full only around the forward / backward of their unit ---

    @torch.no_grad()
    def _shard_parameters(self) -> None:
        """Point every parameter into its bucket's flat buffer, then free the buffers (stage 3)."""
        for b in self.buckets:
            b.full = b.flat(b.params)
            for i, p in enumerate(b.params):
                p.data = b.unflat(b.full, i)
            b.gathered = True
            self.free(b)

    @torch.no_grad()
    def gather(self, bucket: _Bucket) -> None:
        if self.stage < 3 or bucket.gathered:
            return
        bucket.full.untyped_storage().resize_(bucket.padded * bucket.full.element_size())
        comm.all_gather_into_tensor(bucket.full, self.shard_of(bucket, self.param_shard).contiguous(),
                                    self.mesh, SHARD_AXIS)
        bucket.gathered = True

    def free(self, bucket: _Bucket) -> None:
        if self.stage < 3 or not bucket.gathered:
            return
        # The parameters stay views of this storage; a later gather refills it in place.
        bucket.full.untyped_storage().resize_(0)
        bucket.gathered = False

    def _after_forward(self, bucket: _Bucket, output) -> None:
        self.free(bucket)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            # The gradient of the unit's output arrives just before the unit's own backward: gather
            # then. (A module full-backward pre-hook would do too, but warns for the root, whose
            # input -- token ids -- needs no gradient.)
            output.register_hook(lambda grad: self.gather(bucket))

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

    def _make_buckets(self, bucket_size_mb: float) -> list[_Bucket]:
        limit = bucket_size_mb * 2**20
        named, seen = [], set()
        for name, p in self.model.named_parameters():  # tied weights appear once
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        if not named:
            raise ValueError("ZeRO needs a model with trainable parameters")
        groups, params, names, size = [], [], [], 0
        for name, p in reversed(named):
            if p.dtype != torch.float32:
                raise ValueError(f"parameter {name} is {p.dtype}; ZeRO keeps fp32 master weights, build the "
                                 "model in fp32 and use train.precision=bf16 for bf16 compute")
            if params and p.device != params[0].device:
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
        buckets, offset = [], 0
        for params, names in groups:
            buckets.append(_Bucket(params, names, self.num_shards, offset))
            offset += buckets[-1].chunk
        return buckets

    # -- views of the flat shard --------------------------------------------------------------

    def shard_of(self, bucket: _Bucket, flat_shard: torch.Tensor) -> torch.Tensor:
        return flat_shard[bucket.shard_offset:bucket.shard_offset + bucket.chunk]

    def my_chunk(self, bucket: _Bucket, padded_flat: torch.Tensor) -> torch.Tensor:
        start = self.shard_rank * bucket.chunk
        return padded_flat[start:start + bucket.chunk]

    @torch.no_grad()
    def local_shard(self, tensors_of: dict[int, torch.Tensor]) -> torch.Tensor:
        """This rank's flat shard of one full tensor per parameter (keyed by id of the parameter)."""
        return torch.cat([self.my_chunk(b, b.flat(tensors_of.get(id(p)) for p in b.params))
                          for b in self.buckets])

    @torch.no_grad()
    def gather_full(self, flat_shard: torch.Tensor) -> dict[int, torch.Tensor]:
        """The full tensors of every parameter from every rank's flat shard (an all-gather per bucket)."""
        out = {}
        for b in self.buckets:
            full = flat_shard.new_empty(b.padded)
            comm.all_gather_into_tensor(full, self.shard_of(b, flat_shard).contiguous(), self.mesh, SHARD_AXIS)
            for i, p in enumerate(b.params):
                out[id(p)] = b.unflat(full, i)
        return out

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Copy the parameters of dp coordinate 0 to every data-parallel rank (one broadcast per bucket)."""
        for b in self.buckets:
            flat = b.flat(b.params)
            comm.broadcast(flat, self.mesh, "dp", src=0)
            for i, p in enumerate(b.params):
                p.copy_(b.unflat(flat, i))
        self.param_shard.copy_(self.local_shard({id(p): p.detach() for b in self.buckets for p in b.params}))

    # -- backward -----------------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync_enabled and self.stage < 3:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grad_sync)
            self._callback_queued = True
            self._backward_syncs = self._sync_enabled
        bucket, i = self._where[id(param)]
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self.free(bucket)  # ZeRO-3: the unit's backward is done with its full parameters
        if self._backward_syncs:
            self._launch_ready()

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        # Collectives on one group must be issued in the same order on every rank: strictly by bucket.
        bucket.buffer = bucket.flat(p.grad for p in bucket.params)
        if self.stage >= 2:
            for p in bucket.params:  # the full gradient is not kept: the shard is all this rank needs
                p.grad = None
        bucket.handle = comm.reduce_scatter_tensor(self.shard_of(bucket, self.grad_shard), bucket.buffer,
                                                   self.mesh, SHARD_AXIS, async_op=True)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Reduce-scatter buckets not yet launched (unused parameters), wait for all; then the shard
        holds the summed gradient. Called automatically at the end of a synchronising backward."""
        if not self._callback_queued:
            return
        for bucket in self.buckets:
            self.free(bucket)  # ZeRO-3: units whose parameters this backward did not reach
        self._callback_queued = False
        if not self._backward_syncs:  # ZeRO-3 under no_sync: only the freeing above
            for bucket in self.buckets:
                bucket.ready.clear()
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle, bucket.buffer = None, None
            bucket.ready.clear()
        # Hybrid sharding: the same shard of the other replicas holds their tokens' share.
        comm.all_reduce(self.grad_shard, self.mesh, REPLICATE_AXIS)
        self._next_launch = 0

    # -- after backward -----------------------------------------------------------------------

    def grad_norm_fn(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Global L2 norm from this rank's gradient shard(s): sqrt(all_reduce over dp_shard of the sum of
        squares). Shards are disjoint within a replica and equal across replicas, so dp_shard suffices."""
        sq = torch.zeros((), dtype=torch.float64, device=self.grad_shard.device)
        for g in grads:
            sq += torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double() ** 2
        comm.all_reduce(sq, self.mesh, SHARD_AXIS)
        return sq.sqrt().float()

    @property
    def bucket_bytes(self) -> list[int]:
        """Padded bytes of each bucket: what one step reduce-scatters, and all-gathers, per bucket."""
        return [b.padded * b.params[0].element_size() for b in self.buckets]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW on this rank's flat parameter shard; `step()` also all-gathers the updated parameters.

    One param group holding the flat fp32 shard (so `set_lr` and the trainer's interface work), whose
    `.grad` is the ZeRO gradient shard. The update is the same elementwise arithmetic as
    `torch.optim.AdamW(foreach=False)`, with the decay applied where the flat mask says so.
    """

    def __init__(self, zero: ZeroSharding, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float):
        self.zero = zero
        shard = zero.param_shard
        self._params_by_id = {id(p): p for b in zero.buckets for p in b.params}
        super().__init__([shard], dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        masks = {id(p): torch.full_like(p, float(p.dim() >= 2)) for b in zero.buckets for p in b.params}
        self.decay_mask = zero.local_shard(masks).bool()  # padding: False (its values stay zero anyway)
        self.state[shard] = {"step": torch.zeros((), dtype=torch.float32),
                             "exp_avg": torch.zeros_like(shard), "exp_avg_sq": torch.zeros_like(shard)}

    @property
    def shard(self) -> torch.Tensor:
        return self.param_groups[0]["params"][0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The model's full `.grad` (stage 1, or accumulation) must not carry into the next step; the
        # shard is overwritten by the next reduce-scatter, zeroed only for clarity.
        for b in self.zero.buckets:
            for p in b.params:
                p.grad = None
        self.zero.grad_shard.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ZeroAdamW takes no closure"
        group = self.param_groups[0]
        lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        param, grad, state = self.shard, self.zero.grad_shard, self.state[self.shard]
        state["step"] += 1
        if wd != 0:
            param.mul_(torch.where(self.decay_mask, 1 - lr * wd, 1.0))
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = float(state["step"])
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(state["exp_avg"], denom, value=-lr / bias_correction1)
        # ZeRO-1/2 keep full parameters on every rank: bring every rank's updated shard back. ZeRO-3
        # gathers each unit from the shard when its next forward needs it.
        if self.zero.stage < 3:
            for pid, full in self.zero.gather_full(param).items():
                self._params_by_id[pid].copy_(full)

    # -- the per-parameter layout of checkpoints ------------------------------------------------

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        # registration order, as `torch.distributed.checkpoint.state_dict.get_state_dict` names them
        return [(n, p) for b in self.zero.buckets for n, p in zip(b.names, b.params)][::-1]

    def full_state_dict(self) -> dict:
        """The optimizer state as `get_state_dict(model, torch.optim.AdamW)` lays it out: full
        per-parameter moments keyed by parameter name. Collective over dp_shard (all-gathers)."""
        state = self.state[self.shard]
        exp_avg = self.zero.gather_full(state["exp_avg"])
        exp_avg_sq = self.zero.gather_full(state["exp_avg_sq"])
        named = self._named()
        # every hyperparameter key torch's AdamW has (DCP matches the saved keys against its template)
        plain = torch.optim.AdamW([torch.zeros(1)], foreach=False,
                                  **{k: v for k, v in self.param_groups[0].items() if k != "params"})
        group = {k: v for k, v in plain.param_groups[0].items() if k != "params"}
        groups = [{**group, "weight_decay": group["weight_decay"] if decayed else 0.0,
                   "params": [n for n, p in named if (p.dim() >= 2) == decayed]} for decayed in (True, False)]
        return {"state": {n: {"step": state["step"].clone(), "exp_avg": exp_avg[id(p)].clone(),
                              "exp_avg_sq": exp_avg_sq[id(p)].clone()} for n, p in named},
                "param_groups": groups}

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict) -> None:
        """Take this rank's shard of a per-parameter state (from any zero stage or dp size)."""
        named = self._named()
        missing = [n for n, _ in named if n not in sd["state"]]
        if missing:
            raise ValueError(f"the optimizer state has no entry for {missing[:3]}; it belongs to another model")
        state = self.state[self.shard]
        steps = {float(sd["state"][n]["step"]) for n, _ in named}
        assert len(steps) == 1, f"per-parameter AdamW steps differ: {steps}"
        state["step"].fill_(steps.pop())
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].copy_(self.zero.local_shard({id(p): sd["state"][n][key] for n, p in named}))
        # the parameters were loaded with the model: refresh the master shard from them
        self.shard.copy_(self.zero.local_shard({id(p): p.detach() for _, p in named}))

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the moments; the fp32 master shard excluded)."""
        s = self.state[self.shard]
        return sum(s[k].numel() * s[k].element_size() for k in ("exp_avg", "exp_avg_sq"))


def apply_zero(model: nn.Module, mesh: Mesh, *, stage: int, bucket_size_mb: float = 25.0,
               broadcast: bool = True) -> ZeroSharding:
    """Shard gradients / optimizer state of `model` over "dp_shard" (ZeRO `stage` 1 or 2), in place.

    Collective over "dp". Build the optimizer with `ZeroAdamW(zero, ...)` (`train.optim.build_optimizer`
    does when given the handle). `broadcast=True` starts every replica from dp coordinate 0's weights.
    """
    zero = ZeroSharding(model, mesh, stage=stage, bucket_size_mb=bucket_size_mb)
    if broadcast:
        zero.broadcast_parameters()
    if stage == 3:
        zero._shard_parameters()
    return zero
