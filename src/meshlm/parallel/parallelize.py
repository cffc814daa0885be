"""The one place that turns a plain model into a parallel one, in one fixed order.

Responsible for: checking, before any work, that a layout can run (`check_layout`: the degrees against
the world size, `dims.ParallelDims.resolve`; then every refusal of `meshlm.rules.check_layout_numbers`,
the same rules the planner applies; then the runtime-only parallel.pp_layers) and `parallelize`, which
applies the strategies to a model in the order PP split -> TP/SP -> EP -> CP -> activation
checkpointing -> ZeRO / DP, and hands the trainer what it needs: the module to run, the `no_sync()`
context for gradient accumulation, the global gradient-norm function for clipping and the
data-parallel reduction at the end of a pipeline step.
Not responsible for: the strategies themselves (one file each in `meshlm.parallel`), building the
mesh (`meshlm.mesh`), or the training step (`meshlm.train.trainer`).

What composes (each proven against one process in fp64, tests/test_train_*.py and tests/test_layouts.py):
data parallelism, plain or ZeRO-1/2/3 (ZeRO reduce-scatters over "dp_shard" -- "dp_shard_cp" under
context parallelism -- and all-reduces the shards over "dp_replicate"); tensor parallelism with or
without sequence parallelism, DP and ZeRO working on the TP-local shards; pipeline parallelism (the model
split into this rank's stage first; ZeRO-3 gathers per stage, `parallel.zero3_reshard_after_forward`;
tied embeddings as two copies summed over "pp_ends", `tied.TiedEmbedding`); context parallelism
(ring, all-gather, Ulysses and the hybrid; the cp ranks join the data-parallel ones in the gradient
reduction, "dp_cp"); expert parallelism (the experts' gradients -- and under ZeRO their shards -- over
"ep_dp"); MoE layers under SP and cp (their load-balancing counts summed over the ranks that split a
micro-batch's tokens, `expert.balance_over`; under SP their gradients over tp); recomputation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshlm.config import Config, ModelConfig, ParallelConfig, zero3_reshards
from meshlm.mesh import Mesh, ParallelDims
from meshlm.parallel.context import ContextParallel, apply_context_parallel
from meshlm.parallel.data import DataParallel, apply_data_parallel
from meshlm.parallel.expert import apply_expert_parallel, balance_over, expert_mesh
from meshlm.parallel.materialize import ShardInit, materialize
from meshlm.parallel.pipeline import PipelineStage, default_layers_per_stage, pipeline_grad_norm, split_model
from meshlm.parallel.recompute import apply_recompute
from meshlm.parallel.tied import TiedEmbedding, counted, tied_embedding_mesh
from meshlm.parallel.tensor import apply_tensor_parallel, sum_moe_grads_over_tp, tensor_parallel_grad_norm
from meshlm.parallel.zero import ZeroGroup, ZeroSharding, apply_zero
from meshlm.rules import check_expert_parallel, check_layout_numbers, check_replica_groups, check_tensor_parallel

# Set on a model by `parallelize`: a second application would stack hooks and reduce twice.
_MARK = "_meshlm_parallelized"


def check_layout(cfg: Config, world_size: int) -> ParallelDims:
    """The resolved degrees for `world_size` ranks, or a ValueError naming the numbers and a fix.

    Cheap and collective-free: the launcher calls it before starting any rank, and every rank
    again before it builds data or model.
    """
    # The arithmetic first: "tp=3 does not divide 4 ranks" is the more basic mistake.
    dims = ParallelDims.from_config(cfg.parallel).resolve(world_size)
    p, t = cfg.parallel, cfg.train
    # Every other refusal, the planner's too (`meshlm.rules`).
    check_layout_numbers(cfg.model, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp,
                         cp=dims.cp, ep=dims.ep, zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel,
                         cp_method=p.cp_method, cp_ulysses=p.cp_ulysses, pp_schedule=p.pp_schedule,
                         pp_chunks=p.pp_chunks, seq_len=t.seq_len, global_batch_size=t.global_batch_size,
                         micro_batch_size=t.micro_batch_size, num_microbatches=p.num_microbatches)
    if dims.pp > 1:
        pp_layers(p, cfg.model, seq_len=t.seq_len)  # raises for counts that do not fit (a runtime-only setting)
    if p.fault_tolerance != "none":  # torchft replica groups (`meshlm.train.replica`): the layouts inside one
        check_replica_groups(cfg.model, replica_groups=p.replica_groups, dp_replicate=dims.dp_replicate,
                             dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep,
                             zero_stage=p.zero_stage, global_batch_size=t.global_batch_size,
                             micro_batch_size=micro_batch_size(cfg, dims.dp * p.replica_groups))
    return dims


def pp_layers(parallel: ParallelConfig, model: ModelConfig, *, seq_len: int) -> list[int]:
    """Blocks per pipeline stage, stage order: `parallel.pp_layers` (validated), or when it is empty the
    planner's cost-balanced split (`pipeline.default_layers_per_stage`: `schedules.balanced_split` with the
    output head's FLOPs against a block's at `seq_len`; every stage keeps at least one block)."""
    num_layers = model.num_layers
    if not parallel.pp_layers:
        return default_layers_per_stage(model, pp=parallel.pp, pp_chunks=parallel.pp_chunks, seq_len=seq_len)
    counts = [int(p) for p in parallel.pp_layers.split(",")]
    stages = parallel.pp * parallel.pp_chunks
    if len(counts) != stages or sum(counts) != num_layers:
        raise ValueError(f"parallel.pp_layers={parallel.pp_layers!r} must give {stages} counts (parallel.pp x "
                         f"parallel.pp_chunks, one per stage in stage order) summing to model.num_layers={num_layers}; "
                         f"got {len(counts)} summing to {sum(counts)}")
    return counts


def micro_batch_size(cfg: Config, dp: int) -> int:
    """Sequences per forward/backward on one rank: `train.micro_batch_size`, or for 0 the per-rank batch
    (under pipeline parallelism with parallel.num_microbatches set: the per-rank batch split into that many)."""
    if cfg.train.micro_batch_size:
        return cfg.train.micro_batch_size
    per_rank = cfg.train.global_batch_size // dp
    if cfg.parallel.pp > 1 and cfg.parallel.num_microbatches:
        return max(1, per_rank // cfg.parallel.num_microbatches)
    return per_rank


@dataclass
class ParallelModel:
    """What `parallelize` hands the trainer.

    `module` is what the step calls (`module(tokens) -> logits`); data parallelism only attaches
    hooks, so today it is the model itself. `data_parallel` is None when the dp degree is 1 or ZeRO
    is on; `zero` (parallel.zero_stage >= 1) is the handle the optimizer is built from
    (`build_optimizer(model, cfg, zero=...)`), and then `clip_params` is its flat shard.
    """

    module: nn.Module
    mesh: Mesh
    data_parallel: DataParallel | None = None
    # set for parallel.zero_stage >= 1 (then data_parallel is None); under expert parallelism a ZeroGroup
    # of two shardings (the dense parameters over dp_shard, the experts over "ep_dp")
    zero: ZeroSharding | ZeroGroup | None = None
    tensor_parallel: bool = False  # tp > 1: the module returns this rank's vocab slice of the logits
    pipeline: PipelineStage | None = None  # pp > 1: this rank's stage; the trainer runs whole steps through it
    context: ContextParallel | None = None  # cp > 1: the module takes this rank's chunks and their positions
    expert_parallel: bool = False  # ep > 1: this rank holds num_experts / ep experts of every MoE layer
    expert_data_parallel: DataParallel | None = None  # ep > 1: the experts' gradients, summed over "ep_dp"
    tied: TiedEmbedding | None = None  # pp > 1 with tied embeddings, on the first and last stage

    def no_sync(self):
        """Context for the non-final micro-steps of gradient accumulation: no gradient reduction."""
        if self.zero is not None:
            return self.zero.no_sync()
        stack = contextlib.ExitStack()
        for handle in (self.data_parallel, self.expert_data_parallel):
            if handle is not None:
                stack.enter_context(handle.no_sync())
        return stack

    @property
    def grad_norm_fn(self) -> Callable[[list[torch.Tensor]], torch.Tensor] | None:
        """The global gradient norm for clipping; None means the local norm (one process).

        This stage's norm (its whole model without pipeline parallelism), then summed over the stages:
        ZeRO's from its shards; under tensor / expert parallelism from the parameters' shard tags
        (sharded gradients summed over their axis, replicated ones counted once); else, after DP's
        reduction, the gradients are whole and the local norm is the stage's."""
        stage_norm = None
        if self.zero is not None:
            stage_norm = self.zero.grad_norm_fn
        elif self.tensor_parallel or self.expert_parallel:
            params = counted(self.module.parameters())
            axes = tuple(a for a, on in (("tp", self.tensor_parallel), ("ep", self.expert_parallel)) if on)
            stage_norm = lambda grads: tensor_parallel_grad_norm(params, self.mesh, axes=axes)  # noqa: E731
        if self.pipeline is not None:
            if stage_norm is None:  # each parameter lives on one stage, whole over dp after the reduction
                params = counted(self.module.parameters())  # a tied head's copy counted on the first stage
                return lambda grads: pipeline_grad_norm([p.grad for p in params if p.grad is not None], self.mesh)
            return lambda grads: pipeline_grad_norm([stage_norm(grads)], self.mesh)
        if stage_norm is not None:
            return stage_norm
        return self.data_parallel.grad_norm_fn if self.data_parallel is not None else None

    def reduce_grads(self) -> None:
        """The data-parallel reduction of gradients accumulated under `no_sync` (the pipeline's step); first
        the two copies of a tied embedding add their gradients."""
        if self.tied is not None:
            self.tied.sum_grads()
        for handle in (self.zero, self.data_parallel, self.expert_data_parallel):
            if handle is not None:
                handle.reduce_grads()

    def clip_params(self, model: nn.Module) -> list[nn.Parameter]:
        """The tensors whose `.grad` the optimizer steps on, for `clip_grad_norm`: the model's parameters,
        or under ZeRO the optimizer's flat shard (its `.grad` is the reduced gradient shard)."""
        if self.zero is not None:
            return [part.param_shard for part in self.zero.parts]
        return list(model.parameters())

    @property
    def dp_rank(self) -> int:
        return self.mesh.local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.mesh.size("dp")


def parallelize(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, *, broadcast: bool = True,
                seq_len: int | None = None, init: ShardInit | None = None) -> ParallelModel:
    """Apply every strategy `parallel` asks for to `model` (in place), in the fixed order; collective.

    Every rank of the mesh must call it. `broadcast=True` makes data-parallel replicas start from
    coordinate 0's weights (see `apply_data_parallel`). `seq_len` (train.seq_len; None: the model's
    max_seq_len) prices the pipeline's default split (`pp_layers`). Raises ValueError for a mesh that does not
    match `parallel`, a model `meshlm.rules` refuses, or a model that was parallelized already, before
    changing anything.

    A model on the meta device (`build_model(..., materialize=False)`) is split as it is, then each rank
    gives values only to what it holds (`init`, a `materialize.ShardInit`; its mesh is set here): no rank
    ever holds the whole model, and no broadcast is needed (every rank computes the same numbers).
    """
    if getattr(model, _MARK, False):
        raise ValueError("this model was parallelized already; build a fresh model (a second pass would "
                         "attach a second set of gradient hooks and reduce every gradient twice)")
    tp = mesh.size("tp")
    if mesh.size("pp") != parallel.pp:
        raise ValueError(f"parallel.pp={parallel.pp} but the mesh has pp={mesh.size('pp')}; build the mesh from "
                         "the same parallel config")
    if tp != parallel.tp:
        raise ValueError(f"parallel.tp={parallel.tp} but the mesh has tp={tp}; build the mesh from the same "
                         "parallel config")
    check_tensor_parallel(model.config, tp, sequence_parallel=parallel.sequence_parallel)
    cp = mesh.size("cp")
    if cp != parallel.cp:
        raise ValueError(f"parallel.cp={parallel.cp} but the mesh has cp={cp}; build the mesh from the same "
                         "parallel config")
    # The fixed order: PP split -> TP/SP -> EP -> CP -> activation checkpointing -> ZeRO / DP.
    setattr(model, _MARK, True)
    result = ParallelModel(module=model, mesh=mesh, tensor_parallel=tp > 1)
    if parallel.pp > 1:
        result.pipeline = split_model(model, pp_rank=mesh.local_rank("pp"), pp=parallel.pp,
                                      pp_chunks=parallel.pp_chunks,
                                      layers_per_stage=pp_layers(parallel, model.config,
                                                                 seq_len=seq_len or model.config.max_seq_len))
        if model.config.tie_embeddings:
            mesh = result.mesh = tied_embedding_mesh(mesh)  # collective: the "pp_ends" groups
    if tp > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=parallel.sequence_parallel)
    if parallel.ep > 1:
        check_expert_parallel(model.config, parallel.ep)
        # The "ep" and "ep_dp" groups join the mesh (collective): from here on the trainer uses this one.
        mesh = result.mesh = expert_mesh(mesh, parallel.ep)
        apply_expert_parallel(model, mesh)
        result.expert_parallel = True
    if cp > 1:
        result.context = apply_context_parallel(model, mesh, method=parallel.cp_method, ulysses=parallel.cp_ulysses)
    # The MoE load-balancing loss is over a micro-batch's tokens: sum its counts over the ranks that split them.
    balance_over(model, mesh, ("cp",) + (("tp",) if parallel.sequence_parallel else ()))
    apply_recompute(model, parallel.recompute)
    zero_init = None
    if any(p.is_meta for p in model.parameters()):
        if init is None:
            raise ValueError("the model is on the meta device: pass init=ShardInit(...) to give each rank its values")
        init = dataclasses.replace(init, mesh=mesh)
        materialize(model, init, hollow=parallel.zero_stage == 3)
        zero_init = init if parallel.zero_stage == 3 else None  # ZeRO-3 fills its shards unit by unit
        broadcast = False
    if result.pipeline is not None:
        result.tied = TiedEmbedding.of(result.pipeline, mesh)  # on the parameters the step uses: after materialize
    if parallel.sequence_parallel:
        sum_moe_grads_over_tp(model, mesh)
    # Under expert parallelism the experts' gradients are summed (or ZeRO-sharded) only over the ranks that
    # hold the same experts ("ep_dp"), the other parameters' over every data-parallel rank.
    experts = [p for p in model.parameters() if getattr(p, "_meshlm_shard", None) == ("ep", 0)]
    dense = [p for p in model.parameters() if all(p is not e for e in experts)] if experts else None
    if parallel.zero_stage > 0:
        # ZeRO does the data-parallel reduction itself (reduce-scatter, then the replicas' all-reduce):
        # DP's all-reduce on top would reduce every gradient twice. ZeRO-3 under a pipeline gathers
        # around the modules each chunk calls (the stage's forward never calls the model itself).
        stage3 = dict(reshard_after_forward=zero3_reshards(parallel.zero3_reshard_after_forward, parallel.pp),
                      pipeline_chunks=None if result.pipeline is None else
                      [result.pipeline.chunk_modules(c) for c in range(parallel.pp_chunks)])
        result.zero = apply_zero(model, mesh, stage=parallel.zero_stage, bucket_size_mb=parallel.bucket_size_mb,
                                 broadcast=broadcast, params=dense, init=zero_init, **stage3)
        if experts:
            # ep_dp spans the replicas too: one sharding over all of it, no replica all-reduce; the
            # other experts' squares join the gradient norm over "ep". ZeRO-3: both shardings gather
            # per block (the experts have no root unit), each on its own duplicated groups.
            expert_zero = apply_zero(model, mesh, stage=parallel.zero_stage, bucket_size_mb=parallel.bucket_size_mb,
                                     broadcast=broadcast, params=experts, shard_axis="ep_dp", replicate_axis=None,
                                     data_axis="ep_dp", other_shards_axis="ep", init=zero_init, **stage3)
            result.zero = ZeroGroup([result.zero, expert_zero])
        if parallel.zero_stage == 3 and result.pipeline is not None:
            result.pipeline.weight_pass = result.zero.weight_pass  # zero_bubble's W: nothing to gather
    elif mesh.size("dp_cp") > 1:
        # Under context parallelism the cp ranks hold the same weights and see different tokens: their
        # gradients are summed with the data-parallel ranks' ("dp_cp"; "dp" when cp = 1).
        result.data_parallel = apply_data_parallel(model, mesh, bucket_size_mb=parallel.bucket_size_mb,
                                                   axis="dp_cp" if cp > 1 else "dp", broadcast=broadcast,
                                                   params=dense)
        if experts and mesh.size("ep_dp") > 1:
            result.expert_data_parallel = apply_data_parallel(model, mesh, bucket_size_mb=parallel.bucket_size_mb,
                                                              axis="ep_dp", broadcast=broadcast, params=experts)
    return result
