"""Where one layout's ranks sit and what the busiest rank does: the shared setup of memory and time.

Responsible for: `RankSetup` (`rank_setup`): each parallel group's span over the scale-up / scale-out
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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlm.schedules import balanced_split, split_layers, stage_loads
from meshlm.planner.cluster import Cluster, slowed_links
from meshlm.planner.collectives import group_span, link_name
from meshlm.planner.layout import Job, Layout

if TYPE_CHECKING:
    from meshlm.planner.cost import ModelSummary


def bytes_per(precision: str, *, grad_reduce_in_fp32: bool = True) -> dict:
    """Bytes per element of each model-state kind and of activations / gradient reductions;
    `grad_reduce_in_fp32=False` (`Job.grad_reduce_in_fp32`): mixed-precision gradients kept and reduced
    in bf16."""
    if precision == "fp32":
        return dict(param=4, grad=4, optim=8, act=4, reduce=4)
    grad = 4 if grad_reduce_in_fp32 else 2
    return dict(param=2, grad=grad, optim=12, act=2, reduce=grad)


@dataclass(frozen=True)
class RankSetup:
    cluster: Cluster  # links slowed by CPU-core sharing where ranks time-share cores
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


def rank_setup(summary: ModelSummary, cluster: Cluster, job: Job, lo: Layout) -> RankSetup:
    cfg = summary.cfg
    by = bytes_per(job.precision, grad_reduce_in_fp32=job.grad_reduce_in_fp32)
    tp, pp, cp, ep, v, etp = lo.tp, lo.pp, lo.cp, lo.ep, lo.pp_chunks, lo.etp
    gpus = lo.world
    tokens_mb = lo.micro_batch_size * job.seq_len / cp
    # Ranks that time-share compute units (a CPU host running more ranks than it has cores) each
    # compute and stream memory at slots / ranks of the single-unit rate. GPUs never share (slots 0).
    # (On an emulated cluster every domain is on the one host: all the ranks share its cores.)
    ranks_per_domain = gpus if cluster.host_shared_by_domains else min(gpus, cluster.scaleup_size)
    share = max(1.0, ranks_per_domain / cluster.compute_slots) if cluster.compute_slots else 1.0
    # On such a host a collective is memory copies and reductions done by those same cores (the
    # "link" is the loopback), so it time-shares them too, and it has no idle core to overlap on.
    cores_saturated = bool(cluster.compute_slots) and ranks_per_domain >= cluster.compute_slots
    if share > 1:
        cluster = slowed_links(cluster, share)
    D = cluster.scaleup_size
    spans = {
        "tp": group_span(1, tp, D),
        "cp": group_span(tp, cp, D),
        "ep": group_span(etp, ep, D),
        "dp_shard": group_span(tp, cp * lo.dp_shard, D),  # ZeRO / FSDP shards over dp_shard x cp
        "dp_replicate": group_span(tp * cp * lo.dp_shard, lo.dp_replicate, D),
        "dp_all": group_span(tp, cp * lo.dp, D),  # plain all-reduce over every data-parallel rank
        "dp_experts": group_span(etp * ep, max(1, lo.dp * cp * tp // (etp * ep)), D),  # expert gradients' replicas
        "pp": group_span(tp * cp * lo.dp, pp, D),
    }
    links = {k: link_name(*spans[k]) for k in ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp")}
    split = summary.splits.get((pp, v, lo.pp_split))
    if split is None:
        head_units = summary.flops_head / (summary.flops_dense + summary.flops_attn)
        if lo.pp_split == "uniform":  # Megatron-LM: num_layers / stages each, the head on top of the last
            split = stage_loads(split_layers(cfg.num_layers, pp * v), pp=pp, pp_chunks=v, head_units=head_units)
        else:
            split = rank_split(cfg.num_layers, pp=pp, chunks=v, head_units=head_units)
        summary.splits[(pp, v, lo.pp_split)] = split
    rank_layers, rank_units = split
    return RankSetup(
        cluster=cluster, by=by, tp=tp, pp=pp, cp=cp, ep=ep, v=v, sp=lo.sequence_parallel and tp > 1,
        rc=lo.recompute, tokens_mb=tokens_mb, act_msg=tokens_mb * cfg.hidden_size * by["act"],
        peak=cluster.peak(job.precision) / share,
        peak_attn=(cluster.peak("bf16") if job.precision == "fp8" else cluster.peak(job.precision)) / share,
        hbm_bw=cluster.hbm_bw * cluster.hbm_efficiency / share, cores_saturated=cores_saturated,
        spans=spans, links=links, rank_layers=rank_layers, rank_units=rank_units,
        # meshlm keeps every routed expert whole on each tp rank (replicated over tp, the ep group at stride tp:
        # `spans` above); Megatron-Core splits it over expert_tp ranks
        etp=1 if job.runtime == "meshlm" else etp)
