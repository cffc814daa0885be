"""The cost model's entry point: memory per GPU and step time of one training layout, by component.

Responsible for: `ModelSummary` (a model's per-layer averages, computed once per search), `Estimate` (the
prediction: memory_gib and time_s by component, MFU, HFU, tokens/s, TFLOP/s per GPU), `layout_memory` (the
memory half alone: whether a layout fits), and `estimate_layout` / `estimate`, which put the pieces together:
  layout.py       Job, Layout, parse_layout, validate_layout (the inputs and what the runtime refuses)
  placement.py    where each group sits (links), the pipeline split, per-rank rates
  collectives.py  the time of one collective on a link tier
  kernels.py      GEMMs by shape, fp8 casts
  memory.py       bytes per GPU by component
  timing.py       microbatch compute and comm, pipeline bubble, exposed DP / ZeRO comm, optimizer
Not responsible for: enumerating layouts (`search.py`), explaining them (`explain.py`), or serving
(`serving_modes.py`). The names of those modules that callers used from here are re-exported.

A layout fits only with MIN_HEADROOM of the GPU's memory left free beyond everything itemised.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from operator import attrgetter

from meshlm.config import ModelConfig
from meshlm.models import stats as model_stats
from meshlm.planner.cluster import GiB, Cluster
from meshlm.planner.collectives import collective_time, group_span, link_name
from meshlm.planner.layout import (CP_COMPUTE_BYTES, CP_METHODS, PRECISIONS, RECOMPUTE, RUNTIMES,
                                   Job, Layout, parse_layout, resolve_layout, validate_layout)
from meshlm.planner.memory import (FRAGMENTATION, MiB, ZERO3_PREFETCH_LAYERS, RankParams,
                                   inflight_microbatches, layer_activation_bytes, memory_bytes, memory_measures,
                                   rank_params)
from meshlm.planner import mla as latent
from meshlm.planner.mla import MLA, latent_attention
from meshlm.planner.placement import RankSetup, WorldSetup, bytes_per, rank_setup, rank_split, world_setup
from meshlm.planner.timing import microbatch_time, optimizer_time, pipeline_bubble, pp_p2p_time, tp_collectives
from meshlm.planner.timing_dp import dp_comm_time

__all__ = ["CP_COMPUTE_BYTES", "CP_METHODS", "FRAGMENTATION", "MIN_HEADROOM", "MiB", "PRECISIONS", "RECOMPUTE",
           "RUNTIMES", "ZERO3_PREFETCH_LAYERS", "Estimate", "Job", "Layout", "LayoutMemory", "ModelSummary",
           "WorldSetup", "bytes_per", "collective_time", "estimate", "estimate_layout", "group_span",
           "inflight_microbatches", "layer_activation_bytes", "layout_memory", "link_name", "parse_layout",
           "pipeline_bubble", "rank_split", "tp_collectives", "validate_layout", "world_setup"]

# A layout "fits" only with this fraction of the memory left free beyond everything itemised. The
# itemised model state is exact (tests/test_planner_measured.py), but activations, fragmentation and
# NCCL/library buffers are estimates; a prediction within a few percent of capacity is a coin toss
# that ends in an out-of-memory error at step 1 or at the first long-tail allocation, so it is not
# offered as fitting (4 GiB of an 80 GiB GPU).
MIN_HEADROOM = 0.05


@dataclass
class Estimate:
    """One layout's prediction. `memory_gib` and `time_s` map component -> value, with `total` and
    `step`; `mfu` counts model FLOPs only, `hfu` counts recomputation too."""

    layout: Layout
    fits: bool
    memory_gib: dict
    time_s: dict
    mfu: float
    hfu: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs per GPU per second (the MFU numerator)
    hw_tflops_per_gpu: float  # with recomputation (the HFU numerator)
    num_microbatches: int
    links: dict = field(default_factory=dict)  # axis -> scale-up | scale-out | hierarchical | none
    hbm_gib: float = 0.0
    # Bytes one rank moves over the "tp" axis per optimizer step, counted as meshlm.comm_stats.CommStats
    # counts them (all_gather its output, reduce_scatter its input, all_reduce the tensor).
    tp_comm_bytes: float = 0.0
    # The same over the "cp" axis: what the ring sends (CommStats' "send"; the receives mirror them), or
    # the all-gathers' outputs and reduce-scatters' inputs.
    cp_comm_bytes: float = 0.0
    # The step's data-parallel / ZeRO collectives with nothing overlapping them, seconds (`time_s["dp_comm"]` is
    # what they leave exposed): against compute, how much the step leans on overlap (`explain.overlap_caution`).
    dp_comm_alone_s: float = 0.0

    @property
    def collectives_over_compute(self) -> float:
        """`dp_comm_alone_s` over the step's compute and recomputation: how much the step leans on overlap."""
        compute = self.time_s["compute"] + self.time_s["recompute"]
        return self.dp_comm_alone_s / compute if compute > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layout_str"] = self.layout.short()
        d["memory_measured_as_gib"] = memory_measures(self.memory_gib)
        return d


@dataclass(frozen=True)
class ModelSummary:
    """Per-layer averages of a model, computed once per search (the search is arithmetic only)."""

    cfg: ModelConfig
    seq_len: int
    layer_tp: float  # params per layer sharded by tp (attention + dense MLP / shared experts)
    layer_experts: float  # routed expert params per layer (all experts), sharded by ep * tp
    layer_rep: float  # replicated params per layer
    embed: int
    head: int  # untied output head params (tied: a copy on the last stage when pp > 1, see below)
    flops_dense: float  # forward FLOPs per token per layer (average), excluding the attention core
    flops_dense_moe_experts: float  # part of flops_dense done by routed experts (for fp8 / EP bookkeeping)
    flops_attn: float  # attention core per token per layer
    flops_head: float
    act_tp: dict  # recompute -> per-token-per-layer elements split by tp
    act_seq: dict  # recompute -> per-token-per-layer elements split by tp only under SP
    moe_layer_fraction: float
    model_flops_per_token: float  # training, no recompute
    hw_flops_per_token: dict  # recompute -> training FLOPs per token
    # (pp, pp_chunks, pp_split) -> placement's split of this model: a search asks for the same few splits
    # tens of thousands of times; kept with the summary (one per search), not in a global.
    splits: dict = field(default_factory=dict, compare=False, repr=False)
    mla: MLA | None = None  # DeepSeek's latent attention in place of cfg's grouped-query attention (mla.py)

    @property
    def head_units(self) -> float:
        """The output head's forward FLOPs per token in units of one average layer's: what the last pipeline stage
        runs beside its layers (placement's split, the bubble's other ranks, timing's head)."""
        return self.flops_head / (self.flops_dense + self.flops_attn)

    @classmethod
    def for_job(cls, cfg: ModelConfig, job: Job) -> "ModelSummary":
        """The summary a job's estimate uses: activations as its stack keeps them (`Job.fused_elementwise`), and
        the latent attention its model runs (`mla.latent_attention`: the preset's, but on meshlm's runtime), its
        up-projections' outputs rebuilt in the backward where the job says so (`Job.recompute_mla_up_proj`)."""
        return cls.build(cfg, job.seq_len, eager=not job.fused_elementwise, mla=latent_attention(cfg, job.runtime),
                         mla_up_proj_recomputed=job.recompute_mla_up_proj)

    @classmethod
    def build(cls, cfg: ModelConfig, seq_len: int, *, eager: bool = False, mla: MLA | None = None,
              mla_up_proj_recomputed: bool = False) -> "ModelSummary":
        """`eager`: activations as meshlm's model keeps them run op by op (Job.fused_elementwise=False). `mla`: the
        layers' attention is that latent attention (`mla.py`: its parameters, GEMM FLOPs, core FLOPs and kept
        activations replace those of the grouped-query attention `cfg` describes); `mla_up_proj_recomputed`: its q,
        k and v not kept but rebuilt (`Job.recompute_mla_up_proj`)."""
        L = cfg.num_layers
        lp = [model_stats.layer_params(cfg, i) for i in range(L)]
        lf = [model_stats.layer_flops(cfg, i, seq_len) for i in range(L)]
        act = {rc: [model_stats.activation_elems_per_token(cfg, i, recompute=rc, eager=eager) for i in range(L)]
               for rc in RECOMPUTE}
        n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
        expert_flops = 2 * 3 * cfg.hidden_size * cfg.expert_intermediate_size * cfg.num_experts_per_token
        out = dict(
            layer_tp=sum(p.attention + p.mlp for p in lp) / L,
            layer_experts=sum(p.experts for p in lp) / L,
            layer_rep=sum(p.replicated for p in lp) / L,
            flops_dense=sum(f.dense for f in lf) / L,
            flops_attn=sum(f.attention_core for f in lf) / L,
            act_tp={rc: sum(a[0] for a in v) / L for rc, v in act.items()},
            act_seq={rc: sum(a[1] for a in v) / L for rc, v in act.items()},
            model_flops_per_token=model_stats.train_flops_per_token(cfg, seq_len),
            hw_flops_per_token={rc: model_stats.train_flops_per_token(cfg, seq_len, recompute=rc)
                                for rc in RECOMPUTE},
        )
        if mla is not None:
            out.update(_latent_attention_terms(cfg, seq_len, mla, out, attention=lp[0].attention,
                                               up_proj_recomputed=mla_up_proj_recomputed))
        return cls(cfg=cfg, seq_len=seq_len, embed=cfg.vocab_size * cfg.hidden_size,
                   head=cfg.vocab_size * cfg.hidden_size, flops_dense_moe_experts=expert_flops * n_moe / L,
                   flops_head=2 * cfg.hidden_size * cfg.vocab_size, moe_layer_fraction=n_moe / L, mla=mla, **out)


def _latent_attention_terms(cfg: ModelConfig, seq_len: int, mla: MLA, gqa: dict, *, attention: int,
                            up_proj_recomputed: bool = False) -> dict:
    """`ModelSummary.build`'s per-layer terms (`gqa`, as `cfg`'s grouped-query attention gives them) with every
    layer's attention (`attention` parameters, the same in each layer) replaced by the latent attention `mla`;
    `up_proj_recomputed`: its q, k and v rebuilt in the backward (`Job.recompute_mla_up_proj`), not kept, their
    GEMMs run once more where the layer is not recomputed whole."""
    h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sharded, replicated = latent.matmul_params(cfg, mla)
    gqa_matmul = 2 * h * q_dim + 2 * h * kv_dim  # wq, wk, wv, wo (the biases are no matmul)
    dense = gqa["flops_dense"] + 2 * (sharded + replicated - gqa_matmul)
    core = latent.core_flops_per_token(cfg, mla, seq_len)
    kept_tp, kept_seq = latent.activation_elems(cfg, mla, up_proj_recomputed=up_proj_recomputed)
    # The up-projections' forward FLOPs per token, run once more in the backward where they are rebuilt.
    rebuilt = (2 * sum(n * k for _, n, k, _ in latent.up_projection_gemms(cfg, mla, tokens=1, tp=1))
               if up_proj_recomputed else 0)
    gqa_kept = 2 * q_dim + 2 * kv_dim  # q, k, v and the attention output (models/stats.py)
    L, head = cfg.num_layers, 2 * h * cfg.vocab_size
    forward = L * (dense + core) + head
    return dict(
        layer_tp=gqa["layer_tp"] - attention + sharded,
        layer_rep=gqa["layer_rep"] + replicated + latent.norm_params(mla),
        flops_dense=dense, flops_attn=core,
        act_tp={rc: v + (kept_tp - gqa_kept if rc != "full" else 0) for rc, v in gqa["act_tp"].items()},
        act_seq={rc: v + (kept_seq if rc != "full" else 0) for rc, v in gqa["act_seq"].items()},
        model_flops_per_token=3 * forward,
        hw_flops_per_token={"none": 3 * forward + L * rebuilt, "selective": 3 * forward + L * (core + rebuilt),
                            "full": 3 * forward + L * (dense + core)})


# The Layout fields `microbatch_time` reads neither itself nor through the RankSetup fields it uses (it prices
# one microbatch's layers, head, loss and tp / cp / ep communication; data parallelism and the schedule come
# after): a search remembers one microbatch's time per value of all the other fields. A new Layout field is
# part of the key unless it is named here.
MICROBATCH_FREE = ("dp_replicate", "dp_shard", "zero_stage", "zero3_reshard_after_forward", "pp_schedule",
                   "num_microbatches", "bucket_size_mb")
_microbatch_key = attrgetter(*(f.name for f in fields(Layout) if f.name not in MICROBATCH_FREE))


@dataclass(frozen=True)
class LayoutMemory:
    """The memory half of an estimate (`layout_memory`): enough to know whether a layout fits, without its time."""

    layout: Layout
    r: RankSetup
    p: RankParams
    components: dict  # bytes per GPU by component (memory.memory_bytes)
    total: float
    fits: bool


def layout_memory(summary: ModelSummary, cluster: Cluster, job: Job, layout: Layout, *, num_microbatches: int,
                  world: WorldSetup | None = None) -> LayoutMemory:
    """Bytes per GPU of `layout` (validated), and whether it fits with MIN_HEADROOM left free."""
    r = rank_setup(summary, cluster, job, layout, world=world)
    p = rank_params(summary, job, layout, r)
    mem = memory_bytes(summary, cluster.reserved_bytes, job, layout, r, p, num_microbatches=num_microbatches)
    total = sum(mem.values())
    return LayoutMemory(layout, r, p, mem, total, total <= cluster.hbm_bytes * (1 - MIN_HEADROOM))


def estimate_layout(summary: ModelSummary, cluster: Cluster, job: Job, layout: Layout, *,
                    num_microbatches: int, world: WorldSetup | None = None,
                    memory: LayoutMemory | None = None) -> Estimate:
    """Memory and time of `layout` (already validated; see `validate_layout`). `world`: what every layout of
    this world size on `cluster` shares (`world_setup`), made once by a caller estimating many; `memory`: this
    layout's `layout_memory`, where the caller has it already."""
    lo, m = layout, num_microbatches
    if world is None:
        world = world_setup(summary, cluster, job, lo.world)
    if memory is None:
        memory = layout_memory(summary, cluster, job, lo, num_microbatches=m, world=world)
    elif memory.layout is not lo:
        raise ValueError(f"memory= was priced for layout {memory.layout.short()}, not {lo.short()}")
    r, p, mem, total_bytes = memory.r, memory.p, memory.components, memory.total
    key = _microbatch_key(lo)  # layouts that differ only in their data parallelism share one microbatch's time
    mb = world.microbatches.get(key)
    if mb is None:
        mb = world.microbatches[key] = microbatch_time(summary, job, lo, r)
    dp_exposed, dp_alone = dp_comm_time(summary, job, lo, r, p, mb, num_microbatches=m)
    time = {
        "compute": m * mb.compute,
        "recompute": m * mb.recompute,
        "tp_comm": m * mb.tp_comm,
        "cp_comm": m * mb.cp_comm,
        "ep_comm": m * mb.ep_comm,
        # the fill and drain run at the other ranks' pace (their layers' share of the busiest rank's)
        "pp_bubble": pipeline_bubble(lo.pp_schedule, pp=r.pp, num_microbatches=m, pp_chunks=r.v,
                                     t_fwd=mb.fwd, t_bwd_input=mb.bwd / 2, t_bwd_weight=mb.bwd / 2,
                                     others=r.others_units / r.rank_units),
        "pp_p2p": pp_p2p_time(lo, r, num_microbatches=m, job=job, t_microbatch=mb.total),
        "dp_comm": dp_exposed,
        "optimizer": optimizer_time(r, p) + cluster.step_overhead,  # with the step's fixed framework work
    }
    step = sum(time.values())
    time["step"] = step
    gpus, tokens = lo.world, job.tokens
    model_flops = summary.model_flops_per_token * tokens
    hw_flops = summary.hw_flops_per_token[r.rc] * tokens
    peak_all = gpus * r.peak
    return Estimate(
        layout=layout,
        fits=memory.fits,
        memory_gib={**{k: v / GiB for k, v in mem.items()}, "total": total_bytes / GiB},
        time_s=time,
        mfu=model_flops / (step * peak_all),
        hfu=hw_flops / (step * peak_all),
        tokens_per_s=tokens / step,
        tflops_per_gpu=model_flops / step / gpus / 1e12,
        hw_tflops_per_gpu=hw_flops / step / gpus / 1e12,
        num_microbatches=m,
        links=r.links,
        hbm_gib=cluster.hbm_bytes / GiB,
        tp_comm_bytes=m * mb.tp_bytes + (4 if r.tp > 1 else 0),  # + the grad-norm all-reduce, once per step
        cp_comm_bytes=m * mb.cp_bytes,
        dp_comm_alone_s=dp_alone,
    )


def estimate(cfg: ModelConfig, cluster: Cluster, job: Job, layout: Layout, *, gpus: int | None = None) -> Estimate:
    """Validate and estimate one layout."""
    job.validate()
    cfg.validate()
    cluster.check_trains_in(job.precision)
    if gpus is None:  # dp_shard=-1 then takes what the other degrees leave of their own product: 1
        gpus = layout.world if layout.is_resolved else layout.dp_replicate * layout.tp * layout.pp * layout.cp
    layout = resolve_layout(layout, gpus=gpus)
    m = validate_layout(cfg, job, layout, gpus=gpus)
    return estimate_layout(ModelSummary.for_job(cfg, job), cluster, job, layout, num_microbatches=m)
