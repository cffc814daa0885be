"""Step time of one layout on the busiest rank, by component.

Responsible for: one microbatch's compute (GEMMs by shape from `kernels.py`, attention as its own fused
kernel -- or, unfused, as two batched GEMMs by shape plus the softmax's HBM traffic --, memory-bound
elementwise work at HBM bandwidth, the output head as its own GEMM (bf16 under fp8: fp8 covers the
blocks' linear layers only) and the loss at HBM bandwidth) and its tensor / context / expert-parallel
communication (`microbatch_time`, which sums its sections: `layer_compute` -- `attention_time`,
`elementwise_time` --, `tp_comm_time`, `cp_comm_time` -- `ulysses_comm_time`, `kv_exchange_time` --,
`ep_comm_time`, `head_time`, `embedding_time`, `loss_time`), the pipeline bubble of each schedule (`pipeline_bubble`) and
p2p, and the optimizer step (`optimizer_time`). The data-parallel / ZeRO communication left exposed after
what overlaps is `timing_dp.py`'s (`dp_comm_time`, `fsdp_comm_time`). Which collectives tensor parallelism issues: `tp_collectives`.
Not responsible for: memory (`memory.py`), collective formulas (`collectives.py`) or placement
(`placement.py`).

Exposed vs overlapped communication, per strategy: TP is exposed unless `Job.tp_comm_overlap` (then
pipelined under the layer's GEMMs); the CP ring overlaps each step with the attention of the block in
hand, the CP all-gather is exposed; EP all-to-all is exposed unless `Job.ep_comm_overlap` (then under
another microbatch's compute of the layer); DP / ZeRO-1/2 overlap the last
microbatch's backward (and forward for the parameter gather) unless `Job.dp_comm_overlap` is False;
ZeRO-3 prefetches over all microbatches; FSDP-style ZeRO-3 with resharding (the Megatron / PyTorch runtimes)
is priced unit by unit and pass by pass (`timing_dp.fsdp_comm_time`). What overlaps still costs the SMs the collective holds
(`Cluster.comm_sm_fraction`), and the last gradient bucket never overlaps.

Context parallelism (cp > 1, `parallel/context.py`): every rank holds seq/cp tokens of each sequence;
ZeRO shards over dp_shard x cp and gradients are reduced over dp x cp (the cp ranks hold the same
weights). parallel.cp_method: `ring` passes this rank's K+V block round the cp ranks, cp - 1 steps
forward and (with the partial dK+dV, fp32) backward, overlapped with the attention of the block in hand
(plus an fp32 merge pass per step); `allgather` does one all-gather of K+V and one reduce-scatter of
dK+dV per layer, exposed; `ulysses` two all-to-alls each way (q, k, v to whole-sequence head groups, the
output back), exposed, its attention one kernel over the whole sequence on heads / cp. All repeat their
forward communication when the core is recomputed (Ulysses under selective: q, k, v's only). The hybrid
(`Layout.cp_ulysses` = U > 1, with the ring): Ulysses' all-to-alls over groups of U consecutive cp ranks,
the ring over the cp / U groups, its block the group's tokens at lcm(kv / tp, U) / U kv heads.
Activations per layer: `layer_activation_bytes` (the all-gather keeps the whole sequence's K/V and a
[seq/cp, seq] mask; the ring 1/cp of the sequence). The attention compute is priced the same for both
(a fused causal kernel over seq/cp queries); meshlm's all-gather runs SDPA with a boolean mask, which
on a GPU computes the masked tiles too -- the memory model counts that mask, the time model does not.

Known simplifications (each stated where it is used): layers are averaged (a MoE model's leading
dense layers are spread evenly); experts are balanced unless `Job.expert_imbalance` says by how much the
busiest expert rank is over the mean; the dispatcher's permutations cost their HBM passes
(`kernels.moe_dispatch_elements`) and the all-to-all its bytes; host-side time is not modelled (kernel
launches, and the dropless dispatcher's per-layer synchronisation of token counts with the host), though
fine-grained MoE runs (many small experts, small hidden size) in benchmarks/planner_published.py run
much slower than this model predicts; pipeline p2p is never overlapped; and fused attention has
its own efficiency, lower for the short blocks of a context-parallel ring. On a CPU host (`compute_slots`)
ranks beyond the core count time-share the cores, and collectives get no overlap once every core computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlm.config import ModelConfig
from meshlm.rules import PP_SCHEDULES
from meshlm.planner.collectives import expert_all_to_all, group_span
from meshlm.planner.kernels import fp8_cast_bytes, gemm_time, gemms_fwd_bwd, layer_gemms, moe_dispatch_elements
from meshlm.planner.layout import CP_COMPUTE_BYTES, FA1_RATE_OF_FA2, Job, Layout
from meshlm.planner.mla import router_groups, up_projection_gemms
from meshlm.planner.memory import RankParams
from meshlm.planner.placement import RankSetup

if TYPE_CHECKING:
    from meshlm.planner.cost import ModelSummary


def pipeline_bubble(schedule: str, *, pp: int, num_microbatches: int, pp_chunks: int = 1,
                    t_fwd: float = 1.0, t_bwd_input: float = 1.0, t_bwd_weight: float = 1.0,
                    others: float = 1.0) -> float:
    """Idle time of the busiest rank in one step, in the units of the per-microbatch times.

    `t_fwd`, `t_bwd_input`, `t_bwd_weight` are one rank's times for one microbatch over all its
    chunks (forward, input-gradient backward, weight-gradient backward). With T = t_fwd + t_bwd_input
    + t_bwd_weight and p = pp, m = num_microbatches, v = pp_chunks:

      gpipe        (p - 1) * T                      all forwards, then all backwards
      1f1b         (p - 1) * T                      same bubble as GPipe, fewer microbatches in flight
      interleaved  (p - 1) * T / v                  Narayanan et al. 2021: bubble shrinks by v
      zero_bubble  (p - 1) * max(F, B, F + B - W)  ZB-H1 (Qi et al. 2023): deferred weight-gradient
                                                    work fills the drain; with equal F, B, W this is
                                                    a third of 1F1B's bubble. The paper's max(0, F+B-W)
                                                    ignores that the last rank waits (p-1) F for its
                                                    first input whatever W is; with W > min(F, B) its
                                                    schedule leaves max(F, B) per stage (simulated)
    The fraction of the ideal time is bubble / (m * T), e.g. (p - 1) / m for 1F1B. These are exact for
    the schedules `meshlm.schedules` generates (interleaved: m divisible by p; zero_bubble:
    m >= p); tests/test_schedules.py checks them against its simulator over a grid.

    `others`: the other ranks' mean time per microbatch over the busiest rank's (1.0: balanced stages). The
    busiest rank idles while the fill and the drain pass through the others, at their pace, not its own: each
    formula times `others` -- exact in the simulator when the busiest rank is the last (the head's, as in
    Megatron-LM's uniform split), an upper bound when it is another (tests/test_schedules.py).
    """
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} must be one of {list(PP_SCHEDULES)}")
    if pp < 1 or num_microbatches < 1 or pp_chunks < 1:
        raise ValueError(f"pp={pp}, num_microbatches={num_microbatches}, pp_chunks={pp_chunks} must be >= 1")
    if pp == 1:
        return 0.0
    total = t_fwd + t_bwd_input + t_bwd_weight
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) * total * others
    if schedule == "interleaved":
        return (pp - 1) * total / pp_chunks * others
    return (pp - 1) * max(t_fwd, t_bwd_input, t_fwd + t_bwd_input - t_bwd_weight) * others


def tp_collectives(cfg: ModelConfig, *, tp: int, sequence_parallel: bool, tokens: float, act_bytes: int,
                   recompute: str = "none", norm_grads_in_graph: bool = True,
                   loss_replicated: bool = False, early_stop: bool = True) -> tuple[list, list]:
    """The tensor-parallel collectives of one microbatch (forward + backward) on one rank, as
    `(per_layer, around_layers)` lists of (kind, bytes, count); bytes in CommStats' convention.

    These are exactly the collectives `meshlm.parallel.tensor` issues (its module docstring lists
    them; tests/test_planner_measured.py compares the byte total with a real run's CommStats), x =
    tokens * hidden * act_bytes:
      per layer   no SP: 4 all-reduces of x;  SP: 4 all-gathers + 4 reduce-scatters of x, and the
                  all-reduce of the attn_norm and mlp_norm gradients (2 of 4 * hidden bytes);
                  qk_norm: 2 all-reduces of 4 * head_dim (q_norm, k_norm gradients, both modes);
                  full recompute repeats the forward's collectives up to w_down's input, the last
                  tensor backward needs, where the checkpoint stops there (`early_stop`: torch's without
                  reentrancy, meshlm's): no SP 1 AR (attention's output); SP 2 AG (attention and MLP
                  inputs) + 1 RS (attention's output); else (`Job.recompute_early_stop` False) all of the
                  forward's: 2 AR, or 2 AG + 2 RS.
      around      embedding: AR of x (no SP) / RS + AG backward (SP); lm_head input: AR backward
                  (no SP) / AG + RS (SP); SP final norm gradient: AR of 4 * hidden; loss: 3
                  all-reduces of 4 bytes per token (max, sum of exponentials, target logit).
    The grad-norm all-reduce (4 bytes once per step) is added by the caller.
    `norm_grads_in_graph=False` leaves out the norm-gradient all-reduces: Megatron coalesces them
    into one all-reduce per step after backward (negligible), where meshlm issues them per layer in
    the graph (latency-bound, visible on a CPU host). `loss_replicated` (`Job.tp_loss_replicated`): the loss's
    three all-reduces become one all-gather of the logits, tokens x vocab x act_bytes.
    """
    if tp <= 1:
        return [], []
    x = tokens * cfg.hidden_size * act_bytes
    full = recompute == "full"
    last = 0 if early_stop else 1  # the layer's last collective, run again where the checkpoint does not stop early
    if sequence_parallel:
        layer = [("all_gather", x, 4 + (2 if full else 0)), ("reduce_scatter", x, 4 + (1 + last if full else 0))]
        edge = [("reduce_scatter", x, 2), ("all_gather", x, 2)]
        if norm_grads_in_graph:
            layer.append(("all_reduce", 4 * cfg.hidden_size, 2))
            edge.append(("all_reduce", 4 * cfg.hidden_size, 1))
    else:
        layer = [("all_reduce", x, 4 + (1 + last if full else 0))]
        edge = [("all_reduce", x, 2)]
    if cfg.qk_norm and norm_grads_in_graph:
        layer.append(("all_reduce", 4 * cfg.head_dim, 2))
    if loss_replicated:
        edge.append(("all_gather", tokens * cfg.vocab_size * act_bytes, 1))
    else:
        edge.append(("all_reduce", 4 * tokens, 3))
    return layer, edge


@dataclass(frozen=True)
class MicrobatchTime:
    """One microbatch on the bottleneck rank (seconds), and the bytes its TP / CP collectives move."""

    compute: float  # forward + backward of its layers and head
    recompute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    fwd: float  # forward share of the total (the pipeline bubble's F)
    tp_bytes: float  # per microbatch, CommStats convention
    cp_bytes: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.tp_comm + self.cp_comm + self.ep_comm

    @property
    def bwd(self) -> float:
        return self.total - self.fwd


@dataclass(frozen=True)
class LayerCompute:
    """One average layer's compute for one microbatch on the busiest rank (seconds): its GEMMs, its
    attention core and its memory-bound elementwise work, forward and backward. Communication is apart:
    what overlaps a layer's compute is decided against these terms."""

    dense: float  # the layer's GEMMs, forward
    dense_bwd: float
    attn: float  # the attention core, forward
    attn_bwd: float
    elem: float  # elementwise work (and fp8 casts), forward
    elem_bwd: float
    # The latent attention's up-projection GEMMs, forward, where the backward runs them again to rebuild q, k and v
    # (`Job.recompute_mla_up_proj`); 0 otherwise.
    up_proj: float = 0.0

    @property
    def fwd(self) -> float:
        return self.dense + self.attn + self.elem

    @property
    def bwd(self) -> float:
        return self.dense_bwd + self.elem_bwd + self.attn_bwd

    def recompute(self, rc: str, *, dots_saved: bool = False) -> float:
        """What recomputation runs again in the backward: selective the attention core (and about half the
        elementwise work around it; `dots_saved`, a remat policy keeping only the GEMM outputs: all of it),
        full the whole forward; and, but under full, the up-projections whose outputs were not kept (`up_proj`)."""
        selective = self.attn + (1.0 if dots_saved else 0.5) * self.elem
        return {"none": self.up_proj, "selective": self.up_proj + selective, "full": self.fwd}[rc]


def microbatch_time(summary: ModelSummary, job: Job, lo: Layout, r: RankSetup) -> MicrobatchTime:
    """One microbatch on the busiest rank: its layers' compute and recomputation, the output head and the
    loss, and the tensor / context / expert-parallel communication left exposed, each per layer times the
    layers the busiest rank holds. The sections are the functions below, in this order."""
    # Dropless routing: the busiest expert rank (`Job.expert_imbalance` x the mean tokens) sets the pace.
    imbalance = job.expert_imbalance if r.ep > 1 else 1.0
    layer = layer_compute(summary, job, lo, r, imbalance=imbalance)
    t_fwd_layer, t_bwd_layer = layer.fwd, layer.bwd
    t_rc_layer = layer.recompute(r.rc, dots_saved=job.remat_saves_dots)
    t_tp_layer, t_tp_edge, tp_layer_colls, tp_edge_colls = tp_comm_time(summary.cfg, job, r, layer=layer)
    t_cp_layer, cp_layer_bytes = cp_comm_time(summary.cfg, job, lo, r, layer=layer)
    t_ep_layer = ep_comm_time(summary, job, r, imbalance=imbalance, window=t_fwd_layer + t_bwd_layer)
    head_on_busy, t_head_fwd, t_head_bwd = head_time(summary, job, r)
    t_emb_fwd, t_emb_bwd = embedding_time(summary.cfg, job, r)
    t_loss = loss_time(summary.cfg, r, replicated=job.tp_loss_replicated, fused=job.cross_entropy_fusion)

    layer_units = r.rank_units - head_on_busy
    comp_mb = (layer_units * (t_fwd_layer + t_bwd_layer) + t_head_fwd + t_head_bwd + t_emb_fwd + t_emb_bwd
               + t_loss)
    layers_busy = r.layers_busy
    rc_mb = layers_busy * t_rc_layer
    tp_mb = layers_busy * t_tp_layer + t_tp_edge  # pp > 1: both ends charged to the busiest rank
    cp_mb = layers_busy * t_cp_layer
    ep_mb = layers_busy * t_ep_layer
    t_mb_fwd = layer_units * t_fwd_layer + t_head_fwd + t_emb_fwd + (tp_mb + cp_mb + ep_mb) / 3

    return MicrobatchTime(
        compute=comp_mb, recompute=rc_mb, tp_comm=tp_mb, cp_comm=cp_mb, ep_comm=ep_mb, fwd=t_mb_fwd,
        tp_bytes=(sum(n * b for _, b, n in tp_layer_colls) * layers_busy + sum(n * b for _, b, n in tp_edge_colls)),
        cp_bytes=layers_busy * cp_layer_bytes)


def overlapped(t_comm: float, window: float, r: RankSetup) -> float:
    """A collective run under `window` seconds of compute: only the excess is exposed, and what overlaps
    still costs the SMs the transfer holds (`Cluster.comm_sm_fraction`); a CPU host with every core busy
    overlaps nothing."""
    if r.cores_saturated:
        return t_comm
    return max(0.0, t_comm - window) + r.cluster.comm_sm_fraction * min(t_comm, window)


def layer_compute(summary: ModelSummary, job: Job, lo: Layout, r: RankSetup, *, imbalance: float) -> LayerCompute:
    """One average layer's GEMMs, attention core and elementwise work for one microbatch."""
    cluster = r.cluster
    # Each GEMM of the layer by its shape (kernels.py): thin tp shards and small experts run below the
    # large-GEMM rate; fp8 runs the GEMMs on fp8 inputs at the fp8 rate -- the fp8 peak at its own measured share
    # (`Cluster.matmul_precision_factor`, as serving prices it: one GEMM model) --, everything else in bf16.
    gemms = layer_gemms(summary.cfg, tokens=r.tokens_mb, tp=r.tp, ep=r.ep, moe_fraction=summary.moe_layer_fraction,
                        etp=r.expert_tp, imbalance=imbalance, mla=summary.mla, sequence_parallel=r.sp)
    gemm_in_bytes = 1 if job.precision == "fp8" else r.by["act"]
    rate = r.peak * cluster.matmul_rate(job.precision) / cluster.peak(job.precision)  # r.peak: per rank, after sharing
    t_dense, t_dense_bwd = gemms_fwd_bwd(gemms, rate=rate, hbm_bw=r.hbm_bw,
                                         in_bytes=gemm_in_bytes, k_overhead=cluster.gemm_k_overhead)
    t_up_proj = 0.0
    if job.recompute_mla_up_proj and summary.mla is not None:
        t_up_proj, _ = gemms_fwd_bwd(up_projection_gemms(summary.cfg, summary.mla, tokens=r.tokens_mb, tp=r.tp),
                                     rate=rate, hbm_bw=r.hbm_bw, in_bytes=gemm_in_bytes,
                                     k_overhead=cluster.gemm_k_overhead)
    t_attn, t_attn_bwd = attention_time(summary, job, lo, r)
    t_elem_fwd, t_elem_bwd = elementwise_time(summary, job, r, gemms=gemms, imbalance=imbalance)
    if not job.gradient_accumulation_fusion:
        # Each weight gradient written in the activation dtype, then added into the main_grad by its own pass.
        params = summary.layer_tp / r.tp + summary.layer_rep + summary.layer_experts / (r.expert_tp * r.ep)
        t_elem_bwd += params * (r.by["act"] + 2 * r.by["grad"]) / r.hbm_bw
    return LayerCompute(dense=t_dense, dense_bwd=t_dense_bwd, attn=t_attn, attn_bwd=t_attn_bwd,
                        elem=t_elem_fwd, elem_bwd=t_elem_bwd, up_proj=t_up_proj)


def attention_time(summary: ModelSummary, job: Job, lo: Layout, r: RankSetup) -> tuple[float, float]:
    """The attention core of one layer and microbatch, forward and backward: one fused kernel
    (`Job.flash_attention`), or the unfused batched GEMMs of 2021 (their softmax is elementwise work)."""
    cfg, s, cluster = summary.cfg, job.seq_len, r.cluster
    attn_f = summary.flops_attn * r.tokens_mb / r.tp
    if job.flash_attention:
        # FLOPs count the full s x s square (the convention), but a fused causal kernel skips the
        # masked half, and runs at its own efficiency (softmax and masking inside the kernel, lower
        # than a plain GEMM's). Its backward recomputes the scores: 2.5x the forward's matmuls (the
        # FlashAttention papers' count), where a GEMM's backward is 2x.
        # Each kernel call sees the whole sequence's queries, or under context parallelism one chunk of
        # the load-balanced split, s / (2 cp) (parallel/context.py attends chunk pair by chunk pair, as
        # Transformer Engine's ring does): the masked diagonal tiles and the per-row-block softmax
        # epilogue cost a fixed number of tokens' worth (`attention_block_overhead`), so short blocks run
        # below the long-sequence rate.
        # Ulysses attends over the whole sequence (heads / cp of them): one call, block s.
        block = s / (2 * r.cp) if r.cp > 1 and lo.cp_method != "ulysses" else s
        block_eff = block / (block + cluster.attention_block_overhead)
        eff = cluster.attention_efficiency
        if (job.flash_attention_2 or job.flash_attention_1) and cluster.fa2_attention_efficiency:
            eff = min(eff, cluster.fa2_attention_efficiency)
        if job.flash_attention_1:  # the first FlashAttention: a fraction of FlashAttention-2's rate
            eff *= FA1_RATE_OF_FA2
        t_attn = attn_f * 0.5 / (r.peak_attn * eff * block_eff)
        return t_attn, 2.5 * t_attn
    # The unfused kernels of 2021: per head two batched GEMMs over the whole square, scores = q k^T
    # (s x s, inner dim head_dim) and out = p v (s x head_dim, inner dim s), priced by shape like every
    # GEMM (kernels.py): the scores' inner dim of 64-128 runs far below the large-GEMM rate (standard
    # attention is the slow baseline FlashAttention was measured against, Dao et al. 2022).
    # The softmax is HBM traffic (`elementwise_time`). attn_f counts the same 4 s^2 head_dim FLOPs per head.
    heads_mb = lo.micro_batch_size * cfg.num_heads / r.tp
    hd = cfg.head_dim
    return gemms_fwd_bwd([(s, s, hd, heads_mb), (s, hd, s, heads_mb)], rate=r.peak_attn * cluster.matmul_efficiency,
                         hbm_bw=r.hbm_bw, in_bytes=r.by["act"], k_overhead=cluster.gemm_k_overhead)


def elementwise_time(summary: ModelSummary, job: Job, r: RankSetup, *, gemms: list[tuple],
                     imbalance: float) -> tuple[float, float]:
    """Memory-bound elementwise work of one layer and microbatch (norms, residual adds, RoPE, SwiGLU
    product, MoE permutes: kernels.py's `moe_dispatch_elements`; the unfused softmax; fp8's casts), read +
    write, forward; backward moves about twice as much. Without SP the norm/residual part is replicated on
    every tp rank."""
    cfg, h, tp = summary.cfg, summary.cfg.hidden_size, r.tp
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = (summary.moe_layer_fraction * (cfg.num_experts_per_token * cfg.expert_intermediate_size * imbalance
                                           + cfg.shared_intermediate_size)
             + (1 - summary.moe_layer_fraction) * cfg.intermediate_size)
    moe_elems = summary.moe_layer_fraction * moe_dispatch_elements(cfg, ep=r.ep)
    if job.fused_elementwise:
        # Fused: RoPE reads and writes q and k once, SwiGLU reads two intermediates and writes one, each norm reads
        # and writes h; an op the stack still runs eagerly (`Job.eager_ops`) costs its eager count, below;
        # "attention_layout" copies q, k, v into the kernel's layout and its output back (read + write each).
        eager = job.eager_ops
        norm = _eager_norm_elements(job, r) if "rmsnorm" in eager else 2
        elems_seq = 2 * norm * h + 2 * 3 * h + moe_elems
        elems_tp = ((10 if "rope" in eager else 2) * (q_dim + kv_dim) + (5 if "swiglu" in eager else 3) * inter
                    + (2 * (2 * q_dim + 2 * kv_dim) if "attention_layout" in eager else 0))
    else:
        # Eager PyTorch, meshlm's model as written: every op is its own pass over memory. Per token,
        # elements (of the activations' dtype) read + written: each RMSNorm 7h in fp32 (pow, mean, scale,
        # weight); with 2-byte activations 18h, the norm running in fp32 (models/transformer.py's RMSNorm
        # upcasts, as Hugging Face's Llama, torchtitan's and IBM fms' do): upcast 2 + 4 bytes, x^2 4 + 4, its
        # mean 4, the scaling 4 + 4, the cast back 4 + 2, the weight 2 + 2 = 36 bytes; 2h where the stack
        # norms in one bf16 kernel (`Job.fp32_norms` False: MPT's low-precision LayerNorm); residual adds 3h each,
        # RoPE 10 per rotated element (neg, cat, two products, add) on q and k, the GQA
        # repeat_interleave of k and v, the attention output's transpose copy, SwiGLU 5 per
        # intermediate (silu, product).
        norm = _eager_norm_elements(job, r)
        elems_seq = 2 * norm * h + 2 * 3 * h + moe_elems
        elems_tp = 10 * (q_dim + kv_dim) + 2 * (q_dim + kv_dim) + 2 * q_dim + 5 * inter
    # A dropout of the hidden states that is its own pass (`Job.unfused_dropouts`): read h, write h per token;
    # the mask is drawn inside the pass (no bytes of its own).
    elems_seq += 2 * h * job.unfused_dropouts
    if not job.flash_attention:
        # unfused scale+mask+softmax (+dropout) over s scores per head: ~4 passes forward
        elems_tp += 4 * cfg.num_heads * job.seq_len
    elem_bytes_fwd = r.tokens_mb * r.by["act"] * (elems_tp / tp + elems_seq / (tp if r.sp else 1))
    t_elem_fwd = elem_bytes_fwd / r.hbm_bw
    t_elem_bwd = 2 * t_elem_fwd
    if job.precision == "fp8":
        shard = r.spans["dp_shard"][0] * r.spans["dp_shard"][1]
        cast_fwd, cast_bwd = fp8_cast_bytes(gemms, weights=job.fp8_weights, shard=shard)
        t_elem_fwd += cast_fwd / r.hbm_bw
        t_elem_bwd += cast_bwd / r.hbm_bw
    return t_elem_fwd, t_elem_bwd


def _eager_norm_elements(job: Job, r: RankSetup) -> int:
    """Elements (of the activations' dtype) one RMSNorm run as torch ops reads and writes per hidden element:
    `elementwise_time`'s eager count, 18 with 2-byte activations normed in fp32, 7 in fp32 training, 2 where the
    stack norms in one kernel of the activations' dtype (`Job.fp32_norms` False)."""
    return (18 if r.by["act"] == 2 else 7) if job.fp32_norms else 2


def tp_comm_time(cfg: ModelConfig, job: Job, r: RankSetup, *, layer: LayerCompute) -> tuple[float, float, list, list]:
    """Tensor-parallel communication per microbatch, the collectives of `tp_collectives` (meshlm's TP, which
    matches Megatron's): per layer 2 all-reduces (or AG + RS pairs under SP) forward, 2 backward, and when the
    forward is recomputed in full its collectives again (but the last where the checkpoint stops early,
    `Job.recompute_early_stop`); around the layers the embedding, lm_head input and loss.
    Not overlapped (Megatron default, and meshlm's TP) unless `Job.tp_comm_overlap`.
    Returns (seconds per layer, seconds around the layers, and the two collective lists)."""
    span_tp = r.spans["tp"]
    layer_colls, edge_colls = tp_collectives(cfg, tp=r.tp, sequence_parallel=r.sp, tokens=r.tokens_mb,
                                             act_bytes=r.by["act"], recompute=r.rc,
                                             norm_grads_in_graph=job.runtime == "meshlm",
                                             loss_replicated=job.tp_loss_replicated,
                                             early_stop=job.recompute_early_stop or job.runtime == "meshlm")
    t_layer = sum(n * r.times(kind, nbytes, span_tp) for kind, nbytes, n in layer_colls)
    if job.tp_comm_overlap:
        # Megatron/TE userbuffers: each all-gather is split and pipelined under the GEMM that consumes it,
        # each reduce-scatter under the GEMM that produces it; what the GEMMs cannot cover is exposed.
        t_layer = overlapped(t_layer, layer.dense + layer.dense_bwd, r)
    t_edge = sum(n * r.times(kind, nbytes, span_tp) for kind, nbytes, n in edge_colls)
    return t_layer, t_edge, layer_colls, edge_colls


def cp_comm_time(cfg: ModelConfig, job: Job, lo: Layout, r: RankSetup, *, layer: LayerCompute) -> tuple[float, float]:
    """Context-parallel communication of one layer and microbatch, exposed, and its bytes: the volumes of
    `parallel/context.py` (its docstring; `Estimate.cp_comm_bytes` counts them as CommStats does).
    Ulysses' all-to-alls run over every cp rank (cp_method=ulysses) or over the hybrid's groups of
    cp_ulysses consecutive ones, the ring (or the all-gather) over the rest: cp / n_u ranks."""
    cp = r.cp
    t_cp_layer = cp_layer_bytes = 0.0
    n_u = cp if lo.cp_method == "ulysses" else (lo.cp_ulysses if cp > 1 else 1)
    ring = cp // n_u
    g = math.lcm(cfg.num_kv_heads // r.tp, n_u)  # kv heads a rank exchanges: replicated to lcm(kv / tp, n_u)
    if n_u > 1:
        t, nbytes = ulysses_comm_time(cfg, job, lo, r, n_u=n_u, kv_heads=g)
        t_cp_layer += t
        cp_layer_bytes += nbytes
    if ring > 1:
        t, t_merge, nbytes = kv_exchange_time(cfg, job, lo, r, layer=layer, n_u=n_u, kv_heads=g)
        t_cp_layer += t
        t_cp_layer += t_merge
        cp_layer_bytes += nbytes
    return t_cp_layer, cp_layer_bytes


def ulysses_comm_time(cfg: ModelConfig, job: Job, lo: Layout, r: RankSetup, *, n_u: int,
                      kv_heads: int) -> tuple[float, float]:
    """Ulysses' all-to-alls over groups of n_u cp ranks: two forward (q, k, v of this rank's tokens; then the
    output), their inverses backward; recompute repeats q, k, v's (selective: the checkpoint stops there) or
    both (full). The attention needs all of it and the projection the output: exposed."""
    cp, tp, rc, cluster = r.cp, r.tp, r.rc, r.cluster
    span_u = r.spans["cp"] if n_u == cp else group_span(tp, n_u, cluster.scaleup_size)
    head = lo.micro_batch_size * (job.seq_len / cp) * cfg.head_dim * r.by["act"]  # one head of this rank's tokens
    h_tp = cfg.num_heads // tp
    qkv, o = head * (h_tp + 2 * kv_heads), head * h_tp
    n_qkv, n_o = 2 + (rc != "none"), 2 + (rc == "full")
    t = (n_qkv * r.times("all_to_all", qkv, span_u)
         + n_o * r.times("all_to_all", o, span_u))
    return t, n_qkv * qkv + n_o * o


def kv_exchange_time(cfg: ModelConfig, job: Job, lo: Layout, r: RankSetup, *, layer: LayerCompute, n_u: int,
                     kv_heads: int) -> tuple[float, float, float]:
    """The ring's (or the all-gather's) exchange of K and V over cp / n_u ranks: (seconds exposed, seconds of
    the ring's online-softmax merges, bytes). Recomputation (selective: the core; full: the layer) runs the
    core's forward communication again."""
    cp, tp, cluster, by = r.cp, r.tp, r.cluster, r.by
    span_cp, ring = r.spans["cp"], cp // n_u
    rc_again = 1 if r.rc in ("full", "selective") else 0
    # One block = this rank's K (or V) as the ring passes it: mbs x seq/cp x kv_dim/tp (the hybrid's: its
    # group's n_u x as many tokens at g / n_u kv heads).
    span_r = span_cp if ring == cp else group_span(tp * n_u, ring, cluster.scaleup_size)
    kv_block = lo.micro_batch_size * (job.seq_len / cp) * cfg.head_dim * kv_heads * by["act"]
    kv_pair = 2 * kv_block  # K + V
    grad_pair = kv_pair * CP_COMPUTE_BYTES / by["act"]  # dK + dV partial sums, in the compute dtype
    if lo.cp_method != "ring":
        # All-gather (Llama 3 style): one all-gather of every rank's K+V forward (its output: cp blocks
        # of K+V) and one reduce-scatter of dK+dV backward (in K/V's dtype: the gradient of the
        # gathered tensor), on the cp group; the attention needs all of it, so neither overlaps.
        t = ((1 + rc_again) * r.times("all_gather", cp * kv_pair, span_cp)
             + r.times("reduce_scatter", cp * kv_pair, span_cp))
        return t, 0.0, (2 + rc_again) * cp * kv_pair
    # ring - 1 steps each way, each overlapped with the attention of the block in hand (forward
    # attn / ring; backward attn_bwd / ring): K+V forward; K+V and the partial dK+dV (sent together to
    # the next rank) backward.
    ring_span = span_r if span_r[1] == 1 else (1, 2)
    t_send_fwd = r.times("p2p", kv_pair, ring_span)
    t_send_bwd = r.times("p2p", kv_pair + grad_pair, ring_span)
    t = (ring - 1) * ((1 + rc_again) * overlapped(t_send_fwd, layer.attn / ring, r)
                      + overlapped(t_send_bwd, layer.attn_bwd / ring, r))
    # Online-softmax merge after each extra ring step: read the step's partial output and the running one,
    # write it back, in fp32 (3 passes over this rank's q columns) forward, and about twice that backward
    # (dO and the partial gradients); memory-bound, not overlapped.
    q_dim = cfg.num_heads * cfg.head_dim
    merge_bytes = r.tokens_mb * q_dim / tp * CP_COMPUTE_BYTES * 3 * (1 + 2 + rc_again)
    t_merge = (ring - 1) * merge_bytes / r.hbm_bw
    return t, t_merge, (ring - 1) * ((1 + rc_again) * kv_pair + kv_pair + grad_pair)


def ep_comm_time(summary: ModelSummary, job: Job, r: RankSetup, *, imbalance: float, window: float) -> float:
    """Expert all-to-all of one (average) layer and microbatch: dispatch + combine forward and backward (and
    again if recomputed) by the job's dispatcher (`Job.ep_dispatcher`), exposed unless `Job.ep_comm_overlap` (then
    under `window`, the layer's forward + backward compute of another microbatch)."""
    cfg, ep = summary.cfg, r.ep
    if not (ep > 1 and cfg.is_moe):
        return 0.0
    tokens = r.tokens_mb / (r.tp if r.sp else 1)
    if job.ep_dispatcher == "flex":
        # DeepEP / HybridEP: a dispatch and a combine per pass (forward, backward, a recomputed forward), each token
        # crossing once to each other node holding one of its experts (as few as the router's groups allow); the
        # busiest rank's excess as a longer call
        cl = r.cluster
        call = expert_all_to_all(2 * tokens * cfg.hidden_size * r.by["act"], top_k=cfg.num_experts_per_token,
                                 span=r.spans["ep"], up=cl.collective_fit("all_to_all", "scale-up"),
                                 out=cl.collective_fit("all_to_all", "scale-out"), low_latency=False,
                                 groups=router_groups(cfg))
        t_ep_layer = summary.moe_layer_fraction * (2 + (1 if r.rc == "full" else 0)) * call * imbalance
    else:
        # NCCL's all-to-all of every routed copy; the busiest rank receives `imbalance` x the mean: the all-to-all
        # ends when it has
        a2a = tokens * cfg.num_experts_per_token * cfg.hidden_size * r.by["act"] * imbalance
        n_a2a = 4 + (2 if r.rc == "full" else 0)
        t_ep_layer = summary.moe_layer_fraction * n_a2a * r.times("all_to_all", a2a, r.spans["ep"])
    if job.ep_comm_overlap:
        # Megatron-Core's overlap_moe_expert_parallel_comm: the forward of one microbatch and the backward
        # of another run layer by layer on two streams, each one's dispatch / combine under the other's
        # compute (Megatron-Bridge's docs/training/communication-overlap.md, expert-parallel overlap; the
        # constraints as Megatron-Core's TransformerConfig checks them). The pipeline's warm-up forwards and
        # cool-down backwards have no partner; not counted (a few microbatches of many).
        t_ep_layer = overlapped(t_ep_layer, window, r)
    return t_ep_layer


def head_time(summary: ModelSummary, job: Job, r: RankSetup) -> tuple[float, float, float]:
    """The output head on the bottleneck rank (when it is the last pipeline rank): (its load in layer units,
    0 when the busiest rank is another; forward; backward). Its own GEMM by shape, tokens x vocab/tp x
    hidden, not an average layer's time. Under fp8 it runs in bf16: fp8 covers the linear layers inside the
    transformer blocks only (Transformer Engine's fp8_autocast wraps the blocks; Megatron-Core's output
    layer is a plain ColumnParallelLinear -- Megatron-Bridge's performance guide: "FP8 computation
    exclusively to the linear layers within the Transformer block")."""
    cfg, cluster = summary.cfg, r.cluster
    head_units = summary.head_units
    head_on_busy = head_units if r.rank_layers[-1] + head_units >= r.rank_units - 1e-9 else 0.0
    t_head_fwd = t_head_bwd = 0.0
    if head_on_busy:
        # `peak_attn`: the precision's peak, bf16's under fp8 (which covers the blocks' linear layers only)
        t_head_fwd, t_head_bwd = gemms_fwd_bwd([(r.tokens_mb, cfg.vocab_size / r.tp, cfg.hidden_size, 1.0)],
                                               rate=r.peak_attn * cluster.matmul_efficiency, hbm_bw=r.hbm_bw, in_bytes=r.by["act"],
                                               k_overhead=cluster.gemm_k_overhead)
    return head_on_busy, t_head_fwd, t_head_bwd


def embedding_time(cfg: ModelConfig, job: Job, r: RankSetup) -> tuple[float, float]:
    """The input embedding as a GEMM (`Job.embedding_gemm`: praxis' one-hot lookup) on the first pipeline stage,
    charged when that stage is the busiest rank: (forward, backward). Forward the one-hot [tokens, vocab / tp]
    is written (in the activations' bytes) and multiplied by the table, tokens x hidden x vocab / tp; backward only the
    table's gradient, vocab / tp x hidden over the tokens (the one-hot is no function of the parameters: no input
    gradient). In the activations' dtype: fp8 covers the blocks' linear layers only, as for the head. Zero for
    a row gather."""
    if not job.embedding_gemm or (r.pp > 1 and r.rank_layers[0] < r.rank_units - 1e-9):
        return 0.0, 0.0
    kw = dict(rate=r.peak_attn * r.cluster.matmul_efficiency, hbm_bw=r.hbm_bw, in_bytes=r.by["act"], k_overhead=r.cluster.gemm_k_overhead)
    vocab, h, t = cfg.vocab_size / r.tp, cfg.hidden_size, r.tokens_mb
    fwd = t * vocab * r.by["act"] / r.hbm_bw + gemm_time(t, h, vocab, **kw)
    return fwd, gemm_time(vocab, h, t, **kw)


def loss_time(cfg: ModelConfig, r: RankSetup, *, replicated: bool = False, fused: bool = False) -> float:
    """The loss over the vocabulary (the last stage, charged to the bottleneck rank like the head), at HBM
    bandwidth, per logit of this rank's vocabulary shard (of the whole vocabulary where the logits are gathered for
    the loss, `Job.tp_loss_replicated`), with logits of a bytes. As Megatron's vocab-parallel cross entropy runs it op
    by op (megatron/core/tensor_parallel/cross_entropy.py, its callers casting the logits to fp32 first: the legacy
    model's and Megatron-Core's `compute_language_model_loss`) and meshlm's (`parallel/tensor.py`) alike: the cast
    to fp32 (read a, write 4), the max (read 4), the shifted copy (read 4, write 4), its exp in place (read 4, write
    4), the sum (read 4), the softmax divided in place and kept for the backward (read 4, write 4); backward the
    softmax times the loss's gradient in place (read 4, write 4) and the cast back (read 4, write a): 40 bytes of
    fp32 passes and 2 (a + 4) of casts, 52 with 2-byte logits, 40 with fp32 ones (no cast). `fused`
    (`Job.cross_entropy_fusion`, Megatron-Core's megatron/core/fusions/fused_cross_entropy.py): the cast with the
    max (read a, write 4), the shift, exp and sum in one kernel (read 4, write 4), the division (read 4, write 4),
    the backward in one (read 4, write a): 28 bytes with 2-byte logits."""
    a = r.by["act"]
    up, down = (a + 4, 4 + a) if a < 4 else (0, 0)  # the casts to fp32 and back (none for fp32 logits)
    if fused:  # cast with max (or the max alone), shift-exp-sum, division; the backward with its cast
        per_logit = (up or 4) + 8 + 8 + (4 + a)
    else:  # cast, max, shifted copy, exp, sum, division; backward product, cast
        per_logit = up + 4 + 8 + 8 + 4 + 8 + 8 + down
    return r.tokens_mb * cfg.vocab_size / (1 if replicated else r.tp) * per_logit / r.hbm_bw


def pp_p2p_time(lo: Layout, r: RankSetup, *, num_microbatches: int, job: Job | None = None,
                t_microbatch: float = 0.0) -> float:
    """Activation sends between pipeline stages, exposed: 2 per microbatch and chunk (one to the next
    stage, one back to the previous), plus the fill. With several pipeline ranks per scale-up domain a
    rank has at most one neighbour in another domain: one of its two sends rides the scale-out link, the
    other the scale-up link; with one rank per domain both cross.

    `Job.pp_p2p_serial` (DeepSpeed's engine: each send and receive a blocking transfer of its own): a stage's
    cycle per micro-batch is its compute plus its transfers, four on an interior stage (receive and send, each
    way), two on an end stage; the pipeline runs at the slowest stage's cycle. The busiest rank's compute
    (`r.rank_units` layer units, `t_microbatch` seconds) is already charged with two: what the busiest
    interior stage's cycle (its blocks at the same time per block, and four transfers) exceeds that by is
    added per micro-batch.
    `Job.pp_partitioned_sends` (DeepSpeed's engine under tp): each send moves the rank's 1/tp slice, and each receive
    all-gathers the whole tensor over the tp group."""
    if r.pp == 1:
        return 0.0
    n_in, n_out = r.spans["pp"]
    partitioned = job is not None and job.pp_partitioned_sends and r.tp > 1 and not r.sp
    msg = r.act_msg / (r.tp if r.sp or partitioned else 1)
    inside = r.times("p2p", msg, (2, 1))
    across = r.times("p2p", msg, (1, 2))
    pair = 2 * inside if n_out == 1 else (2 * across if n_in == 1 else inside + across)
    if partitioned:  # each received slice (the activation forward, its gradient backward) gathered over the tp ranks
        pair += 2 * r.times("all_gather", r.act_msg, r.spans["tp"])
    t = r.v * (num_microbatches + r.pp - 1) * pair
    if job is not None and job.pp_p2p_serial and r.pp > 2 and r.v == 1:
        per_unit = t_microbatch / r.rank_units
        interior = max(r.rank_layers[1:-1]) * per_unit + 2 * pair
        t += num_microbatches * max(0.0, interior - (t_microbatch + pair))
    return t


def optimizer_time(r: RankSetup, p: RankParams) -> float:
    """The optimizer step streams gradients, master weights and Adam moments and writes the weights."""
    by = r.by
    return p.sharded(1) * (by["grad"] + by["optim"] * 2 + by["param"]) / r.hbm_bw
