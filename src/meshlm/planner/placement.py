"""Where one layout's ranks sit and what the busiest rank does: the shared setup of memory and time.

Responsible for: `WorldSetup` (`world_setup`): what every layout of one world size on one cluster shares --
the rates after CPU-core sharing and the collective times, remembered (`collectives.CollectiveTimes`) --,
made once per search; `RankSetup` (`rank_setup`): each parallel group's span over the scale-up / scale-out
tiers and the link it rides, the pipeline split (layers per rank, the bottleneck rank's load with the
head), the tokens one rank processes per microbatch, and the compute rates after CPU-core sharing.
Not responsible for: memory (`memory.py`), time (`timing.py`) or the collective formulas
(`collectives.py`).

Rank placement follows the mesh convention: tp innermost, then cp, dp_shard, dp_replicate, pp
outermost; ep is carved out of dp_shard x cp (its stride is tp), or with Megatron's expert_tp < tp (MoE
parallel folding) out of dp_shard x cp x tp / expert_tp, expert_tp innermost (its stride is expert_tp).
A group whose ranks all sit in one scale-up domain uses that link; one whose ranks are all in different
domains uses the scale-out link; a group spanning both runs hierarchically (inside first, then across,
one NIC per GPU).
On a CPU host (`Cluster.compute_slots`) ranks beyond the core count time-share the cores (and the
memory copies of their collectives), and collectives get no overlap once every core computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshlm.schedules import balanced_split, split_layers, stage_loads
from meshlm.planner.cluster import Cluster, ranks_per_host, time_shared
from meshlm.planner.collectives import CollectiveTimes, group_span, link_name
from meshlm.planner.layout import Job, Layout

if TYPE_CHECKING:
    from meshlm.planner.cost import ModelSummary


def bytes_per(precision: str, *, grad_reduce_in_fp32: bool = True, bf16_states: bool = False,
              bf16_moments: bool = False) -> dict:
    """Bytes per element of each model-state kind and of activations / gradient reductions;
    `grad_reduce_in_fp32=False` (`Job.grad_reduce_in_fp32`): mixed-precision gradients kept and reduced
    in bf16; `bf16_states` (`Job.bf16_states`): a model cast to bf16, its gradients and Adam moments bf16 too and no
    fp32 master copy (reduced in fp32 or not as the flag before says); `bf16_moments` (`Job.bf16_moments`): the
    fp32 master copy beside bf16 Adam moments."""
    if precision == "fp32":
        return dict(param=4, grad=4, optim=8, act=4, reduce=4)
    reduce = 4 if grad_reduce_in_fp32 else 2
    if bf16_states:
        return dict(param=2, grad=2, optim=4, act=2, reduce=reduce)
    return dict(param=2, grad=reduce, optim=4 + 2 + 2 if bf16_moments else 12, act=2, reduce=reduce)


@dataclass(frozen=True)
class WorldSetup:
    """What every layout of one search shares -- one model (`summary`), `job` and `gpus` ranks of `source` --
    made once per search (`world_setup`): the rates after core sharing, and answers the search asks again and
    again, remembered for it alone (a few thousand distinct ones for 180k layouts)."""

    summary: ModelSummary
    source: Cluster  # the cluster asked for
    job: Job
    gpus: int
    cluster: Cluster  # links slowed by CPU-core sharing where ranks time-share cores
    times: CollectiveTimes  # collective_time on `cluster`, remembered
    by: dict  # bytes_per(precision)
    share: float  # ranks per compute unit (>= 1)
    cores_saturated: bool
    peak: float
    peak_attn: float
    hbm_bw: float
    placements: dict = field(default_factory=dict)  # degrees -> (spans, links) (`rank_setup`)
    microbatches: dict = field(default_factory=dict)  # layout key -> MicrobatchTime (`cost.estimate_layout`)


def world_setup(summary: ModelSummary, cluster: Cluster, job: Job, gpus: int) -> WorldSetup:
    """Rates and links of `gpus` ranks on `cluster`: what `rank_setup` needs beyond the layout's degrees."""
    # Ranks that time-share compute units (a CPU host running more ranks than it has cores): `time_shared`.
    # On such a host a collective is memory copies and reductions done by those same cores (the
    # "link" is the loopback), so it time-shares them too, and it has no idle core to overlap on.
    slowed, share = time_shared(cluster, gpus)
    cores_saturated = bool(cluster.compute_slots) and ranks_per_host(cluster, gpus) >= cluster.compute_slots
    return WorldSetup(
        summary=summary, source=cluster, job=job, gpus=gpus, cluster=slowed, times=CollectiveTimes(slowed),
        by=bytes_per(job.precision, grad_reduce_in_fp32=job.grad_reduce_in_fp32, bf16_states=job.bf16_states,
                     bf16_moments=job.bf16_moments),
        share=share,
        cores_saturated=cores_saturated, peak=slowed.peak(job.precision) / share,
        peak_attn=(slowed.peak("bf16") if job.precision == "fp8" else slowed.peak(job.precision)) / share,
        hbm_bw=slowed.hbm_bw * slowed.hbm_efficiency / share)


@dataclass(frozen=True)
class RankSetup:
    cluster: Cluster  # links slowed by CPU-core sharing where ranks time-share cores
    times: CollectiveTimes  # collective_time on `cluster` (`r.times(kind, nbytes, span)`)
    by: dict  # bytes_per(precision)
    tp: int
    pp: int
    cp: int
    ep: int
    v: int  # pp_chunks
    sp: bool  # sequence parallelism in effect (tp > 1)
    rc: str  # recompute policy
    tokens_mb: float  # tokens one rank processes per microbatch
    act_msg: float  # bytes of one microbatch's hidden states on one rank (before SP's split)
    peak: float  # FLOP/s of the GEMMs' precision on one rank (after sharing)
    peak_attn: float  # FLOP/s of attention (bf16 under fp8)
    hbm_bw: float  # achieved bytes/s of memory-bound kernels
    cores_saturated: bool  # a CPU host with every core computing: nothing overlaps
    spans: dict  # group -> (members per domain, domains): tp, cp, ep, dp_shard, dp_replicate, dp_all, pp
    links: dict  # axis -> scale-up | scale-out | hierarchical | none
    rank_layers: list  # layers on each pipeline rank
    rank_units: float  # the bottleneck rank's load in layer-compute units (head included)
    others_units: float  # the other pipeline ranks' mean load in the same units (rank_units when pp = 1)
    etp: int = 0  # ranks one routed expert is split over (Layout.etp; 1 under meshlm's runtime); 0: tp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def layers_first(self) -> int:
        return self.rank_layers[0]

    @property
    def layers_last(self) -> int:
        return self.rank_layers[-1]

    @property
    def layers_busy(self) -> int:
        return max(self.rank_layers[0], self.rank_layers[-1])


def rank_split(num_layers: int, *, pp: int, chunks: int, head_units: float) -> tuple[list[int], float]:
    """Layers on each pipeline rank, and the bottleneck rank's load in layer units (head included).

    The split is the runtime's default (`schedules.balanced_split`, which the runtime uses
    when `parallel.pp_layers` = ""): contiguous stages s = chunk * pp + rank, the last stage (which also
    runs the output head) given the layer count that minimises the busiest rank's load, the rest spread
    over the earlier stages first, every stage keeping at least one layer as the runtime needs (a
    head-only last stage would sometimes be faster, e.g. 126 layers over 16 x 7 stages with the head worth
    1.5 layers: 8 instead of 8.5, but meshlm does not run one; tests/test_planner.py checks the agreement).
    """
    counts = balanced_split(num_layers, pp=pp, pp_chunks=chunks, head_units=head_units)
    return stage_loads(counts, pp=pp, pp_chunks=chunks, head_units=head_units)


def rank_setup(summary: ModelSummary, cluster: Cluster, job: Job, lo: Layout, *,
               world: WorldSetup | None = None) -> RankSetup:
    """`world`: `world_setup(summary, cluster, job, lo.world)`, made once by a caller setting up many layouts."""
    cfg = summary.cfg
    tp, pp, cp, ep, v, etp = lo.tp, lo.pp, lo.cp, lo.ep, lo.pp_chunks, lo.etp
    if world is None:
        world = world_setup(summary, cluster, job, lo.world)
    elif world.summary is not summary or world.source is not cluster or world.job is not job or world.gpus != lo.world:
        raise ValueError(f"world_setup was made for {world.gpus} GPUs of another model, cluster or job than layout "
                         f"{lo.short()}'s {lo.world}; make one per (summary, cluster, job, gpus)")
    tokens_mb = lo.micro_batch_size * job.seq_len / cp
    degrees = (tp, cp, etp, ep, lo.dp_shard, lo.dp_replicate, pp)
    placed = world.placements.get(degrees)
    if placed is None:
        placed = world.placements[degrees] = _place(*degrees, world.cluster.scaleup_size)
    spans, links = placed
    head_units = summary.head_units
    split = summary.splits.get((pp, v, lo.pp_split))
    if split is None:
        if lo.pp_split == "uniform":  # Megatron-LM: num_layers / stages each, the head on top of the last
            split = stage_loads(split_layers(cfg.num_layers, pp * v), pp=pp, pp_chunks=v, head_units=head_units)
        else:
            split = rank_split(cfg.num_layers, pp=pp, chunks=v, head_units=head_units)
        summary.splits[(pp, v, lo.pp_split)] = split
    rank_layers, rank_units = split
    loads = sum(rank_layers) + head_units
    others_units = (loads - rank_units) / (pp - 1) if pp > 1 else rank_units
    by = world.by
    return RankSetup(
        cluster=world.cluster, times=world.times, by=by, tp=tp, pp=pp, cp=cp, ep=ep, v=v,
        sp=lo.sequence_parallel and tp > 1, rc=lo.recompute, tokens_mb=tokens_mb,
        act_msg=tokens_mb * cfg.hidden_size * by["act"], peak=world.peak, peak_attn=world.peak_attn,
        hbm_bw=world.hbm_bw, cores_saturated=world.cores_saturated,
        spans=dict(spans), links=dict(links), rank_layers=rank_layers, rank_units=rank_units,
        others_units=others_units,
        # meshlm keeps every routed expert whole on each tp rank (replicated over tp, the ep group at stride tp:
        # `spans` above); Megatron-Core splits it over expert_tp ranks
        etp=1 if job.runtime == "meshlm" else etp)


def _place(tp: int, cp: int, etp: int, ep: int, dp_shard: int, dp_replicate: int, pp: int, D: int) -> tuple[dict, dict]:
    """Each group's (members per domain, domains) and the link it rides, on domains of D ranks."""
    dp = dp_replicate * dp_shard
    spans = {
        "tp": group_span(1, tp, D),
        "cp": group_span(tp, cp, D),
        "ep": group_span(etp, ep, D),
        "dp_shard": group_span(tp, cp * dp_shard, D),  # ZeRO / FSDP shards over dp_shard x cp
        "dp_replicate": group_span(tp * cp * dp_shard, dp_replicate, D),
        "dp_all": group_span(tp, cp * dp, D),  # plain all-reduce over every data-parallel rank
        "dp_experts": group_span(etp * ep, max(1, dp * cp * tp // (etp * ep)), D),  # expert gradients' replicas
        "pp": group_span(tp * cp * dp, pp, D),
    }
    return spans, {k: link_name(*spans[k]) for k in ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")}
