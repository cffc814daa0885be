"""The data-parallel / ZeRO communication of one step left on the critical path after what overlaps.

Responsible for: `dp_comm_time` (DDP's bucketed all-reduce, ZeRO-1/2's reduce-scatter + all-gather, meshlm's
ZeRO, FSDP without resharding) and `fsdp_comm_time` (FSDP-style ZeRO-3 with resharding, and FSDP's ZeRO-2, unit by
unit and pass by pass). The overlap rules are `timing.py`'s module docstring's ("Exposed vs overlapped communication").
Not responsible for: one micro-batch's time (`timing.microbatch_time`, which these take as given), collective
formulas (`collectives.py`) or placement (`placement.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlm.planner.layout import Job, Layout
from meshlm.planner.memory import MiB, RankParams
from meshlm.planner.placement import RankSetup

if TYPE_CHECKING:
    from meshlm.planner.cost import ModelSummary
    from meshlm.planner.timing import MicrobatchTime


def dp_comm_time(summary: ModelSummary, job: Job, lo: Layout, r: RankSetup, p: RankParams, mb: MicrobatchTime, *,
                 num_microbatches: int) -> tuple[float, float]:
    """Data-parallel / ZeRO communication of one step: (what is left on the critical path, what the collectives
    take with nothing overlapping them)."""
    cluster, by, tp, cp, ep, m, z = r.cluster, r.by, r.tp, r.cp, r.ep, num_microbatches, p.zero_stage
    span_dps, span_dpr, span_dp_all = r.spans["dp_shard"], r.spans["dp_replicate"], r.spans["dp_all"]
    span_exp, cores_saturated = r.spans["dp_experts"], r.cores_saturated
    n_local, layers_mem, shard = p.local, p.layers, p.shard
    t_mb, t_mb_fwd, t_mb_bwd = mb.total, mb.fwd, mb.bwd
    n_dense_local = p.dense  # parameters one rank owns before ZeRO sharding
    n_exp_local = p.experts
    t_dp = alone = 0.0
    if lo.dp * cp > 1:
        g_dense = n_dense_local * by["reduce"]
        g_exp = n_exp_local * by["reduce"]
        sync = 0.0  # collectives the runtime issues synchronously (nothing to overlap with)
        if p.meshlm_zero:
            # meshlm's ZeRO: one reduce-scatter of all (padded) gradients per step, launched per
            # bucket during the last micro-step's backward (async), then the shard's all-reduce over
            # dp_replicate; stages 1/2 all-gather every updated parameter inside the optimizer step
            # (synchronous). Stage 3 all-gathers every block before its forward and again before its
            # backward in every micro-step, and the root unit (embedding, norm, head) once: each gather
            # is prefetched one unit ahead, so all but the root's (which starts the forward) overlap
            # the compute of the micro-steps.
            comm = (r.times("reduce_scatter", g_dense + g_exp, span_dps)
                    + r.times("all_reduce", (g_dense + g_exp) / shard, span_dpr))
            window = t_mb_bwd
            if z == 3:
                root = n_local - layers_mem * (summary.layer_tp / tp + summary.layer_rep
                                               + summary.layer_experts / (r.expert_tp * ep))
                window = m * t_mb
                if not lo.zero3_reshards:  # every unit once per step; the first gather starts the step
                    comm += r.times("all_gather", (n_local - root) * by["param"], span_dps)
                    sync = r.times("all_gather", root * by["param"], span_dps)
                else:  # pp > 1: the root is freed after forward and gathered again for backward
                    again = root if r.pp > 1 else 0.0
                    comm += m * r.times("all_gather", (2 * n_local - 2 * root + again) * by["param"], span_dps)
                    sync = m * r.times("all_gather", root * by["param"], span_dps)
            else:
                sync = r.times("all_gather", n_local * by["param"], span_dps)
        elif z == 0:
            comm = (r.times("all_reduce", g_dense, span_dp_all)
                    + r.times("all_reduce", g_exp, span_exp))
            window = t_mb_bwd
        elif z == 2 and job.zero2_unit_collectives:  # FSDP's SHARD_GRAD_OP: FULL_SHARD's units, no backward gathers
            return fsdp_comm_time(summary, job, lo, r, p, mb, num_microbatches=m, backward_gathers=False)
        elif z in (1, 2):
            if job.zero1_grad_all_reduce:  # every gradient all-reduced over all data-parallel ranks (Job field)
                grads = r.times("all_reduce", g_dense, span_dp_all) + r.times("all_reduce", g_exp, span_exp)
            else:
                grads = (r.times("reduce_scatter", g_dense, span_dps) + r.times("all_reduce", g_dense / shard, span_dpr)
                         + r.times("reduce_scatter", g_exp, span_exp))
            # fp8 parameters (`Job.fp8_weights` "params") are gathered in fp8: a byte per layer GEMM weight
            gemm_bytes = 1 if job.fp8_weights_are("params") else by["param"]
            dense_gemm = layers_mem * summary.layer_tp / tp
            comm = (grads + r.times("all_gather", (n_dense_local - dense_gemm) * by["param"] + dense_gemm * gemm_bytes,
                                    span_dps)
                    + r.times("all_gather", n_exp_local * gemm_bytes, span_exp))
            window = t_mb_bwd + t_mb_fwd  # grads overlap the last backward, params the first forward
        elif lo.zero3_reshards:
            return fsdp_comm_time(summary, job, lo, r, p, mb, num_microbatches=m)
        else:
            # FSDP without resharding (torchtitan under pp): weights gathered once per step and kept,
            # gradients reduce-scattered once, after the step's last backward.
            comm = (r.times("all_gather", n_dense_local * by["param"], span_dps)
                    + r.times("reduce_scatter", g_dense, span_dps)
                    + r.times("all_gather", n_exp_local * by["param"], span_exp)
                    + r.times("reduce_scatter", g_exp, span_exp)
                    + r.times("all_reduce", g_dense / shard, span_dpr))
            window = m * t_mb
            if job.fsdp_copy_out:  # FSDP2's copy out of the one gather, on the compute stream
                sync = (n_dense_local + n_exp_local) * by["param"] * 2 / r.hbm_bw
        if cores_saturated or (not job.dp_comm_overlap and z < 3):
            window = 0.0
        bucket = lo.bucket_size_mb * MiB
        bucket_time = comm * min(1.0, bucket / max(1.0, g_dense + g_exp))  # the last bucket never overlaps
        t_dp = max(comm - window, bucket_time)
        # What is hidden still costs: the collective's kernels occupy SMs the overlapped compute loses.
        t_dp += cluster.comm_sm_fraction * max(0.0, comm - t_dp) + sync
        alone = comm + sync

    return t_dp, alone


def block_tensors(cfg) -> int:
    """Parameter tensors of one decoder block as meshlm's model holds them: two norms, q, k, v and o, the MLP's gate,
    up and down; q, k and v biases (`ModelConfig.attention_bias`) and q / k norms (`qk_norm`) where the model has
    them."""
    return 9 + 3 * int(cfg.attention_bias) + 2 * int(cfg.qk_norm)


def fsdp_comm_time(summary: ModelSummary, job: Job, lo: Layout, r: RankSetup, p: RankParams, mb: MicrobatchTime, *,
                   num_microbatches: int, backward_gathers: bool = True) -> tuple[float, float]:
    """FSDP / ZeRO-3 with resharding (PyTorch FSDP, DeepSpeed stage 3, Megatron-FSDP): what its collectives leave
    exposed in one step, unit by unit, and what they take with nothing overlapping them.

    The units are the blocks, plus the root (embedding, final norm, head: what the blocks leave of the rank's
    parameters). Every micro-step gathers each block before its forward and again before its backward (the
    recomputation of a checkpointed block uses the backward's gather) and reduce-scatters its gradient after
    its backward (HSDP, dp_replicate > 1: then all-reduces its shard across the replicas): one collective per
    unit and pass, each paying its ring's latency (`collectives`: linear in the ranks for these two). Each
    gather is prefetched one unit ahead, so unit i+1's collectives run under unit i's compute (Zhao et al.
    2023, "PyTorch FSDP", VLDB, Sec. 4.2 backward / forward prefetching): per pass, what the pass's collectives
    take beyond its compute is exposed, layer by layer (uniform layers: the pass's totals). The root is gathered
    once per micro-step, before the first forward, with no compute to hide it; the step's last reduce-scatters
    (the first block's and the root's) have nothing after them. What is hidden still costs the SMs the
    collectives hold (`Cluster.comm_sm_fraction`); a CPU host with every core busy overlaps nothing.
    `Job.zero3_serial_gathers` (DeepSpeed's ZeRO-3 before v0.6): every parameter tensor is gathered by a collective
    of its own, the device synchronized around it, so no gather overlaps compute and each pays its ring's latency
    (`block_tensors` per block); the gradients' reduce-scatters overlap as above.
    `backward_gathers=False` (ZeRO-2 as FSDP's SHARD_GRAD_OP, `Job.zero2_unit_collectives`): the forward's gathers are
    kept for the backward, which only reduce-scatters. `Job.fsdp_no_sync`: only the step's last micro-step reduces;
    the others' backwards gather alone.
    `Job.fsdp_copy_out` (FSDP2): each gather's copy out of the all-gather buffer, a read and a write of the unit's
    parameters on the compute stream, is exposed whatever overlaps the collectives. Under fp8 with
    `Job.fp8_weights` "fsdp_all_gather" the blocks' weights are gathered (and copied out) in one byte each."""
    cluster, by, ep, m = r.cluster, r.by, r.ep, num_microbatches
    span_dps, span_dpr, span_exp = r.spans["dp_shard"], r.spans["dp_replicate"], r.spans["dp_experts"]
    block = summary.layer_tp / r.tp + summary.layer_rep  # one block's parameters on this rank, before sharding
    block_exp = summary.layer_experts / (r.expert_tp * ep)
    root = max(0.0, p.local - p.layers * (block + block_exp))

    # Bytes per gathered block parameter: fp8 where the weights are cast before the all-gather (the norms' few
    # parameters are counted with them).
    block_bytes = 1 if job.fp8_weights_are("fsdp_all_gather") else by["param"]

    def unit(params: float, experts: float, gather_bytes: float, pieces: float = 1,
             expert_pieces: float = 1) -> tuple[float, float]:
        """(gather, gradient reduction) seconds of one unit, its parameters gathered in `pieces` collectives (its
        experts' in `expert_pieces`)."""
        gather = pieces * r.times("all_gather", params * gather_bytes / pieces, span_dps)
        reduce = (r.times("reduce_scatter", params * by["reduce"], span_dps)
                  + r.times("all_reduce", params * by["reduce"] / p.shard, span_dpr))
        if experts:  # the routed experts' own collectives, over their own group
            gather += expert_pieces * r.times("all_gather", experts * gather_bytes / expert_pieces, span_exp)
            reduce += r.times("reduce_scatter", experts * by["reduce"], span_exp)
        return gather, reduce

    # DeepSpeed's serial gathers: one collective per tensor (each local expert's three matrices apart)
    serial = job.zero3_serial_gathers
    pieces = dict(pieces=block_tensors(summary.cfg), expert_pieces=3 * summary.cfg.num_experts / ep) if serial else {}
    ag_block, red_block = unit(block, block_exp, block_bytes, **pieces)
    ag_root, red_root = unit(root, 0.0, by["param"])
    passes = 2 if backward_gathers else 1  # block gathers per micro-step
    # Micro-steps that reduce their gradients: each, or the last alone where accumulation skips synchronization.
    reducing = 1 if job.fsdp_no_sync else m
    fwd_comm = p.layers * ag_block
    bwd_gathers, bwd_reduce = p.layers * (passes - 1) * ag_block, p.layers * red_block
    total = m * (fwd_comm + bwd_gathers + ag_root) + reducing * (bwd_reduce + red_root)
    if r.cores_saturated:
        return total, total
    if serial:  # every gather on the critical path; the reductions overlap the backward
        exposed = (m * (passes * p.layers * ag_block + ag_root) + reducing * max(0.0, bwd_reduce - mb.bwd)
                   + red_block + red_root)
    else:
        exposed = (m * (max(0.0, fwd_comm - mb.fwd) + ag_root) + (m - reducing) * max(0.0, bwd_gathers - mb.bwd)
                   + reducing * max(0.0, bwd_gathers + bwd_reduce - mb.bwd) + red_block + red_root)
    exposed = min(total, exposed)
    # Gathers per step: each block before its forward (and its backward), the root once per micro-step.
    copied = m * (passes * p.layers * (block + block_exp) * block_bytes + root * by["param"])
    copies = 2 * copied / r.hbm_bw if job.fsdp_copy_out else 0.0
    return exposed + cluster.comm_sm_fraction * (total - exposed) + copies, total
