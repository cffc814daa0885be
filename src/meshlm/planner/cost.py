"""The cost model: memory per GPU and step time of one training layout, by component.

Responsible for: `Job` and `Layout` (the planner's inputs), validating a layout against the model and
the GPU count, placing each parallel group on the scale-up or scale-out link, the collective time
formulas, the pipeline-bubble formula of each schedule, and `estimate_layout`, which returns an
`Estimate` (memory_gib and time_s by component, MFU, HFU, tokens/s, TFLOP/s per GPU).
Not responsible for: enumerating layouts (`search.py`), explaining them (`explain.py`), or inference
(`inference.py`).

Rank placement follows the mesh convention: tp innermost, then cp, dp_shard, dp_replicate, pp
outermost; ep is carved out of dp_shard x cp (its stride is tp). A group whose ranks all sit in one
scale-up domain uses that link; one whose ranks are all in different domains uses the scale-out
link; a group spanning both runs hierarchically (inside first, then across, one NIC per GPU).

Model-state bytes per parameter (bf16 / fp8 training, Megatron's distributed-optimizer convention):
2 (bf16 weights) + 4 (fp32 gradients: accumulated and reduced in fp32) + 12 (fp32 master, Adam m and
v). ZeRO-1 shards the 12, ZeRO-2 also the gradients, ZeRO-3 also the weights, each over dp_shard x cp
(communication: Megatron / FSDP-style, overlapped, ZeRO-3 prefetching the next layer).
`Job.runtime = "meshlm"` (fp32; what `cluster=local` and benchmarks/planner_vs_measured.py run) follows
meshlm's own runtime, as `parallel/data.py` and `parallel/zero.py` really allocate and communicate:
  plain DP   4 + 4 + 8, plus one flat copy of all gradients in the all-reduce buckets;
  ZeRO-1/2   full fp32 weights (4) + a flat fp32 master shard (4/n, counted under `optimizer`) + the
             moments (8/n); gradients: the 4/n shard, plus the full 4 under stage 1 -- or under
             stage 2 with accumulation (no_sync keeps full gradients until the last micro-step);
  ZeRO-3     the 4/n shard is the weights (no other copy); moments 8/n; gradients as stage 2;
  buffers    ZeRO 1-3: the padded gradient copy of the one reduce-scatter in flight; stage 3 also
             the gathered units (the root unit, the block in use and the prefetched next one);
  comm       one reduce-scatter of all gradients per step (overlapping the last backward) and an
             all-reduce of the shard over dp_replicate; all-gathers: of all parameters once per step,
             synchronously (stages 1/2); stage 3 of every block twice and the root unit once per
             micro-step, prefetched one unit ahead (overlapping compute).
  TP         (`parallel/tensor.py`, plain DP over the TP-local shards) attention and MLP matrices
             (and q/k/v biases), the embedding and lm_head (split over the vocabulary) hold 1/tp per
             rank; norms are full copies on every tp rank; DP's bucket copy is of the local shards. Its collectives per microbatch are `tp_collectives` (bytes: `Estimate.tp_comm_bytes`).
n = dp_shard; meshlm pads each bucket to a multiple of n (< n elements per bucket), which the planner's
ceil(params / n) leaves out (tests/test_planner_measured.py bounds the difference).

Context parallelism (cp > 1, `parallel/context.py`): every rank holds seq/cp tokens of each sequence;
ZeRO shards over dp_shard x cp and gradients are reduced over dp x cp (the cp ranks hold the same
weights). parallel.cp_method: `ring` passes this rank's K+V block round the cp ranks, cp - 1 steps
forward and (with the partial dK+dV, fp32) backward, overlapped with the attention of the block in hand
(plus an fp32 merge pass per step); `allgather` does one all-gather of K+V and one reduce-scatter of
dK+dV per layer, exposed. Both repeat their forward communication when the core is recomputed.
Activations per layer: `layer_activation_bytes` (the all-gather keeps the whole sequence's K/V and a
[seq/cp, seq] mask; the ring 1/cp of the sequence). The attention compute is priced the same for both
(a fused causal kernel over seq/cp queries); meshlm's all-gather runs SDPA with a boolean mask, which
on a GPU computes the masked tiles too -- the memory model counts that mask, the time model does not.

Known simplifications (each stated where it is used): layers are averaged (a MoE model's leading
dense layers are spread evenly), experts are assumed perfectly balanced, tensor-parallel
communication is not overlapped with compute (meshlm's TP does not overlap it, nor did the Megatron
runs of the published comparison), data-parallel communication overlaps with the backward (or
forward) pass of one microbatch, and what overlaps still slows the compute by the SMs the
collective holds (`Cluster.comm_sm_fraction`). Fused attention has its own efficiency, lower for
the short blocks of a context-parallel ring. A layout fits only with MIN_HEADROOM of memory free.
On a CPU host (`compute_slots`) ranks beyond the core count time-share the cores, and collectives
get no overlap once every core computes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from meshlm.config import PP_SCHEDULES, ModelConfig
from meshlm.parallel.schedules import balanced_split, stage_loads
from meshlm.planner import model_stats
from meshlm.planner.cluster import GiB, Cluster, slowed_links
from meshlm.planner.collectives import collective_time, group_span, link_name  # noqa: F401 (re-exported)
from meshlm.planner.kernels import fp8_cast_bytes, gemms_fwd_bwd, layer_gemms

RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp8", "fp32")
# Whose runtime the accounting follows: "megatron" (Megatron-Core / FSDP conventions: bf16 weights, fp32
# gradients, a distributed optimizer, norm gradients reduced once per step) or "meshlm" (meshlm's own
# parallel/data.py + parallel/zero.py, fp32, exactly as they allocate and communicate; what `--cluster
# local` runs and tests/test_planner_measured.py counts).
RUNTIMES = ("megatron", "meshlm")
# parallel.cp_method, as `meshlm.parallel.context.METHODS` (not imported: the planner runs without torch).
CP_METHODS = ("ring", "allgather")
# Bytes of the compute dtype in which context-parallel attention keeps its log-sum-exp and the ring
# passes its partial dK/dV: fp32 whatever the activation dtype (`parallel/context.py`, for accuracy).
CP_COMPUTE_BYTES = 4
MiB = 2**20  # bucket sizes are in MiB, as in parallel/data.py
FRAGMENTATION = 0.08  # caching-allocator fragmentation margin, fraction of what is allocated
# A layout "fits" only with this fraction of the memory left free beyond everything itemised. The
# itemised model state is exact (tests/test_planner_measured.py), but activations, fragmentation and
# NCCL/library buffers are estimates; a prediction within a few percent of capacity is a coin toss
# that ends in an out-of-memory error at step 1 or at the first long-tail allocation, so it is not
# offered as fitting (4 GiB of an 80 GiB GPU).
MIN_HEADROOM = 0.05
# ZeRO-3 keeps the next layer's gathered weights while computing this one (prefetch): 2 layers live.
ZERO3_PREFETCH_LAYERS = 2


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    seq_len: int
    global_batch_size: int  # sequences per optimizer step
    precision: str = "bf16"  # bf16 | fp8 | fp32
    # Fused (flash) attention stores no s x s scores; False models 2021-era unfused softmax kernels.
    flash_attention: bool = True
    # Norms, RoPE, SwiGLU and residual adds as fused kernels (Megatron/TE, torch.compile); False
    # models eager PyTorch, one memory pass per op (meshlm's model uncompiled, e.g. the CPU runs).
    fused_elementwise: bool = True
    # Tensor-parallel collectives pipelined under the GEMMs (Megatron-Core / Transformer Engine
    # `tp_comm_overlap`, MegaScale Sec. 3.3); meshlm's own TP does not overlap them (False).
    tp_comm_overlap: bool = False
    # Gradient reduce-scatter / all-reduce and parameter all-gather overlapped with the backward / forward
    # (meshlm's DP and ZeRO, PyTorch DDP/FSDP, Megatron-Core's overlap_grad_reduce / overlap_param_gather).
    # False: issued after the backward, exposed (Megatron-LM before 2023); ZeRO-3 always prefetches.
    dp_comm_overlap: bool = True
    runtime: str = "megatron"  # one of RUNTIMES: whose memory and communication accounting applies

    def validate(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be >= 1")
        if self.global_batch_size < 1:
            raise ValueError(f"global batch={self.global_batch_size} sequences must be >= 1 "
                             "(give --global-batch-size or --global-batch-tokens >= --seq-len)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {list(PRECISIONS)}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r} must be one of {list(RUNTIMES)}")
        if self.runtime == "meshlm" and self.precision != "fp32":
            raise ValueError(f"runtime='meshlm' trains in fp32 (precision={self.precision!r} given); use "
                             "precision='fp32', or runtime='megatron' for mixed precision")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch_size


@dataclass(frozen=True)
class Layout:
    """A parallel layout. Keys are the `parallel.*` config names plus micro_batch_size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    # ring: K/V blocks passed round the cp ranks, overlapped with attention; allgather: K/V of the whole
    # sequence gathered once per layer (parallel.cp_method). Only matters when cp > 1.
    cp_method: str = "ring"
    ep: int = 1
    zero_stage: int = 0
    pp_schedule: str = "1f1b"
    pp_chunks: int = 1
    num_microbatches: int = 0  # 0: derived, global_batch / (dp * micro_batch_size)
    micro_batch_size: int = 1
    sequence_parallel: bool = True
    recompute: str = "none"
    bucket_size_mb: float = 25.0

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def short(self) -> str:
        parts = [f"tp{self.tp}" + ("sp" if self.sequence_parallel and self.tp > 1 else ""),
                 f"pp{self.pp}" + (f"x{self.pp_chunks}" if self.pp_chunks > 1 else ""),
                 (f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp_shard}")
                 + f"/z{self.zero_stage}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("ag" if self.cp_method == "allgather" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"mbs{self.micro_batch_size}")
        if self.pp > 1:
            parts.append(self.pp_schedule)
        parts.append(f"rc:{self.recompute}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


_LAYOUT_TYPES = {f.name: f.type for f in fields(Layout)}


def parse_layout(text: str, *, gpus: int) -> Layout:
    """`tp=8,pp=4,dp_shard=2,zero_stage=1,recompute=full` -> Layout; dp_shard defaults to the rest."""
    kw: dict = {}
    for item in [t for t in text.replace(" ", "").split(",") if t]:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"layout item {item!r} must look like key=value (e.g. tp=8)")
        if key not in _LAYOUT_TYPES:
            raise ValueError(f"layout key {key!r} is unknown; valid keys: {', '.join(_LAYOUT_TYPES)}")
        kind = _LAYOUT_TYPES[key]
        if kind == "bool":
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(f"layout {key}={value!r} must be true or false")
            kw[key] = value.lower() in ("true", "1", "yes", "on")
        elif kind == "str":
            kw[key] = value
        else:
            try:
                kw[key] = float(value) if kind == "float" else int(value)
            except ValueError:
                raise ValueError(f"layout {key}={value!r} must be a number") from None
    if kw.get("dp_shard", -1) == -1:
        others = kw.get("dp_replicate", 1) * kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
        if others < 1 or gpus % others:
            raise ValueError(f"layout {text!r}: dp_replicate*tp*pp*cp={others} must divide --gpus={gpus}")
        kw["dp_shard"] = gpus // others
    return Layout(**kw)


def validate_layout(cfg: ModelConfig, job: Job, layout: Layout, *, gpus: int) -> int:
    """Raise ValueError naming the value and the fix; return the number of microbatches."""
    lo = layout
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "pp_chunks", "micro_batch_size"):
        if getattr(lo, name) < 1:
            raise ValueError(f"layout {name}={getattr(lo, name)} must be >= 1")
    if lo.world != gpus:
        raise ValueError(f"layout dp_replicate*dp_shard*tp*pp*cp = {lo.world} must equal --gpus={gpus}")
    if lo.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"layout zero_stage={lo.zero_stage} must be 0, 1, 2 or 3")
    if lo.recompute not in RECOMPUTE:
        raise ValueError(f"layout recompute={lo.recompute!r} must be one of {list(RECOMPUTE)}")
    if lo.cp_method not in CP_METHODS:
        raise ValueError(f"layout cp_method={lo.cp_method!r} must be one of {list(CP_METHODS)} "
                         "(parallel.cp_method); e.g. cp=2,cp_method=allgather")
    if lo.pp_schedule not in PP_SCHEDULES:
        raise ValueError(f"layout pp_schedule={lo.pp_schedule!r} must be one of {list(PP_SCHEDULES)}")
    if lo.pp_chunks > 1 and lo.pp_schedule != "interleaved":
        raise ValueError(f"layout pp_chunks={lo.pp_chunks} needs pp_schedule=interleaved")
    # What the runtime's `parallel.tensor.check_tensor_parallel` refuses: every tp-split size must divide.
    for name in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):
        value = getattr(cfg, name)
        if lo.tp > 1 and value % lo.tp:
            raise ValueError(f"layout tp={lo.tp} must divide model.{name}={value} (tensor parallelism splits it "
                             f"evenly); choose a tp that divides num_heads={cfg.num_heads}, num_kv_heads="
                             f"{cfg.num_kv_heads}, vocab_size={cfg.vocab_size} and intermediate_size="
                             f"{cfg.intermediate_size}, or pad model.{name} to a multiple of {lo.tp}")
    if lo.pp * lo.pp_chunks > cfg.num_layers:
        raise ValueError(f"layout pp*pp_chunks={lo.pp * lo.pp_chunks} exceeds num_layers={cfg.num_layers}")
    if lo.ep > 1:
        if not cfg.is_moe:
            raise ValueError(f"layout ep={lo.ep} needs a MoE model; set ep=1")
        if cfg.num_experts % lo.ep:
            raise ValueError(f"layout ep={lo.ep} must divide num_experts={cfg.num_experts}")
        if (lo.dp_shard * lo.cp) % lo.ep:
            raise ValueError(f"layout ep={lo.ep} must divide dp_shard*cp={lo.dp_shard * lo.cp} "
                             "(experts are sharded over the data-parallel ranks)")
    if job.seq_len % (2 * lo.cp if lo.cp > 1 else 1):
        raise ValueError(f"seq_len={job.seq_len} must be divisible by 2*cp={2 * lo.cp} "
                         "(load-balanced causal split)")
    if lo.sequence_parallel and lo.tp > 1 and (job.seq_len // lo.cp) % lo.tp:
        raise ValueError(f"seq_len/cp={job.seq_len // lo.cp} must be divisible by tp={lo.tp} "
                         "with sequence_parallel; or set sequence_parallel=false")
    per_step = lo.dp * lo.micro_batch_size
    if job.global_batch_size % per_step:
        raise ValueError(f"global batch of {job.global_batch_size} sequences must be divisible by "
                         f"dp_replicate*dp_shard*micro_batch_size={per_step}; change the batch or the layout")
    m = job.global_batch_size // per_step
    if lo.num_microbatches and lo.num_microbatches != m:
        raise ValueError(f"layout num_microbatches={lo.num_microbatches} disagrees with the batch: "
                         f"{job.global_batch_size} / (dp {lo.dp} * micro_batch_size {lo.micro_batch_size}) = {m}")
    return m


# --------------------------------------------------------------------------------------------
# Pipeline bubble
# --------------------------------------------------------------------------------------------


def pipeline_bubble(schedule: str, *, pp: int, num_microbatches: int, pp_chunks: int = 1,
                    t_fwd: float = 1.0, t_bwd_input: float = 1.0, t_bwd_weight: float = 1.0) -> float:
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
    the schedules `meshlm.parallel.schedules` generates (interleaved: m divisible by p; zero_bubble:
    m >= p); tests/test_schedules.py checks them against its simulator over a grid.
    """
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} must be one of {list(PP_SCHEDULES)}")
    if pp < 1 or num_microbatches < 1 or pp_chunks < 1:
        raise ValueError(f"pp={pp}, num_microbatches={num_microbatches}, pp_chunks={pp_chunks} must be >= 1")
    if pp == 1:
        return 0.0
    total = t_fwd + t_bwd_input + t_bwd_weight
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) * total
    if schedule == "interleaved":
        return (pp - 1) * total / pp_chunks
    return (pp - 1) * max(t_fwd, t_bwd_input, t_fwd + t_bwd_input - t_bwd_weight)


def inflight_microbatches(schedule: str, *, pp: int, num_microbatches: int, pp_chunks: int = 1) -> float:
    """Microbatches whose activations the first pipeline rank holds at its peak, in units of one
    microbatch through all of that rank's layers (interleaving holds extra partial chunks)."""
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        # Megatron's warm-up on rank 0: 2(p-1) + (v-1)p chunk-forwards before the first backward.
        chunks = min(m * pp_chunks, 2 * (pp - 1) + (pp_chunks - 1) * pp + 1)
        return chunks / pp_chunks
    return float(min(m, pp))  # 1F1B and ZB-H1 (same peak memory by design)


# --------------------------------------------------------------------------------------------
# Tensor-parallel collectives
# --------------------------------------------------------------------------------------------


def tp_collectives(cfg: ModelConfig, *, tp: int, sequence_parallel: bool, tokens: float, act_bytes: int,
                   recompute: str = "none", norm_grads_in_graph: bool = True) -> tuple[list, list]:
    """The tensor-parallel collectives of one microbatch (forward + backward) on one rank, as
    `(per_layer, around_layers)` lists of (kind, bytes, count); bytes in CommStats' convention.

    These are exactly the collectives `meshlm.parallel.tensor` issues (its module docstring lists
    them; tests/test_planner_measured.py compares the byte total with a real run's CommStats), x =
    tokens * hidden * act_bytes:
      per layer   no SP: 4 all-reduces of x;  SP: 4 all-gathers + 4 reduce-scatters of x, and the
                  all-reduce of the attn_norm and mlp_norm gradients (2 of 4 * hidden bytes);
                  qk_norm: 2 all-reduces of 4 * head_dim (q_norm, k_norm gradients, both modes);
                  full recompute repeats the forward's collectives up to w_down's input, the last
                  tensor backward needs (torch's checkpoint stops there): no SP 1 AR (attention's
                  output); SP 2 AG (attention and MLP inputs) + 1 RS (attention's output).
      around      embedding: AR of x (no SP) / RS + AG backward (SP); lm_head input: AR backward
                  (no SP) / AG + RS (SP); SP final norm gradient: AR of 4 * hidden; loss: 3
                  all-reduces of 4 bytes per token (max, sum of exponentials, target logit).
    The grad-norm all-reduce (4 bytes once per step) is added by the caller.
    `norm_grads_in_graph=False` leaves out the norm-gradient all-reduces: Megatron coalesces them
    into one all-reduce per step after backward (negligible), where meshlm issues them per layer in
    the graph (latency-bound, visible on a CPU host).
    """
    if tp <= 1:
        return [], []
    x = tokens * cfg.hidden_size * act_bytes
    full = recompute == "full"
    if sequence_parallel:
        layer = [("all_gather", x, 4 + (2 if full else 0)), ("reduce_scatter", x, 4 + (1 if full else 0))]
        edge = [("reduce_scatter", x, 2), ("all_gather", x, 2)]
        if norm_grads_in_graph:
            layer.append(("all_reduce", 4 * cfg.hidden_size, 2))
            edge.append(("all_reduce", 4 * cfg.hidden_size, 1))
    else:
        layer = [("all_reduce", x, 4 + (1 if full else 0))]
        edge = [("all_reduce", x, 2)]
    if cfg.qk_norm and norm_grads_in_graph:
        layer.append(("all_reduce", 4 * cfg.head_dim, 2))
    edge.append(("all_reduce", 4 * tokens, 3))
    return layer, edge


# --------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------


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
    # Bytes one rank moves over the "tp" axis per optimizer step, counted as meshlm.comm.CommStats
    # counts them (all_gather its output, reduce_scatter its input, all_reduce the tensor).
    tp_comm_bytes: float = 0.0
    # The same over the "cp" axis: what the ring sends (CommStats' "send"; the receives mirror them), or
    # the all-gathers' outputs and reduce-scatters' inputs.
    cp_comm_bytes: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layout_str"] = self.layout.short()
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

    @classmethod
    def build(cls, cfg: ModelConfig, seq_len: int, *, eager: bool = False) -> "ModelSummary":
        """`eager`: activations as meshlm's model keeps them run op by op (Job.fused_elementwise=False)."""
        L = cfg.num_layers
        lp = [model_stats.layer_params(cfg, i) for i in range(L)]
        lf = [model_stats.layer_flops(cfg, i, seq_len) for i in range(L)]
        act = {rc: [model_stats.activation_elems_per_token(cfg, i, recompute=rc, eager=eager) for i in range(L)]
               for rc in RECOMPUTE}
        n_moe = sum(cfg.is_moe_layer(i) for i in range(L))
        expert_flops = 2 * 3 * cfg.hidden_size * cfg.expert_intermediate_size * cfg.num_experts_per_token
        return cls(
            cfg=cfg, seq_len=seq_len,
            layer_tp=sum(p.attention + p.mlp for p in lp) / L,
            layer_experts=sum(p.experts for p in lp) / L,
            layer_rep=sum(p.replicated for p in lp) / L,
            embed=cfg.vocab_size * cfg.hidden_size,
            head=cfg.vocab_size * cfg.hidden_size,
            flops_dense=sum(f.dense for f in lf) / L,
            flops_dense_moe_experts=expert_flops * n_moe / L,
            flops_attn=sum(f.attention_core for f in lf) / L,
            flops_head=2 * cfg.hidden_size * cfg.vocab_size,
            act_tp={rc: sum(a[0] for a in v) / L for rc, v in act.items()},
            act_seq={rc: sum(a[1] for a in v) / L for rc, v in act.items()},
            moe_layer_fraction=n_moe / L,
            model_flops_per_token=model_stats.train_flops_per_token(cfg, seq_len),
            hw_flops_per_token={rc: model_stats.train_flops_per_token(cfg, seq_len, recompute=rc)
                                for rc in RECOMPUTE},
        )


def _bytes_per(precision: str) -> dict:
    if precision == "fp32":
        return dict(param=4, grad=4, optim=8, act=4, reduce=4)
    return dict(param=2, grad=4, optim=12, act=2, reduce=4)


def layer_activation_bytes(summary: ModelSummary, job: Job, layout: Layout, *, recompute: str | None = None) -> float:
    """Bytes one rank keeps for backward in one (average) layer for one microbatch, with a fused
    attention kernel (the caller adds an unfused one's scores); `recompute` overrides the layout's.

    Per token, `ModelSummary.act_tp` / `act_seq` (model_stats.activation_elems_per_token) at the
    activation dtype, over mbs x seq / cp tokens. Under context parallelism (cp > 1, not recompute=full,
    which keeps only the layer input) the attention core is `parallel/context.py`'s, not the one those
    counts assume, and keeps instead (recompute=selective re-runs the core in backward, keeping only its
    inputs q, k, v and the output wo keeps: exactly what cp = 1 keeps, so no change there):
      ring       this rank's q, k, v, the output and the log-sum-exp (heads per token, in the fp32
                 compute dtype); no GQA-expanded K/V (the ring expands them inside, untracked), so the
                 eager count loses that expansion and its SDPA log-sum-exp.
      allgather  the same, with the gathered K and V of the whole sequence (kv heads: 2 x kv_dim x cp per
                 local token) in place of this rank's k and v: linear in the sequence per rank, but cp
                 times the ring's K/V.
    tests/test_planner_cp.py checks the eager counts byte for byte against a real cp=2 run.
    """
    cfg, lo = summary.cfg, layout
    rc = lo.recompute if recompute is None else recompute
    by = _bytes_per(job.precision)
    act = by["act"]
    tp, cp = lo.tp, lo.cp
    sp = lo.sequence_parallel and tp > 1
    s_local = job.seq_len / cp
    tokens_mb = lo.micro_batch_size * s_local
    out = tokens_mb * act * (summary.act_tp[rc] / tp + summary.act_seq[rc] / (tp if sp else 1))
    if cp == 1 or rc != "none":
        return out
    eager = not job.fused_elementwise
    q_dim, kv_dim, heads = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads
    # What the cp = 1 count holds inside the core beyond q, k, v and the output (eager only; fused: nothing):
    # the GQA-expanded k and v, and SDPA's log-sum-exp.
    expansion = 2 * (q_dim - kv_dim) if eager else 0
    sdpa_lse = heads if eager else 0
    # Both methods: the core of parallel/context.py keeps this rank's q, the output and the fp32
    # log-sum-exp; the ring keeps this rank's k and v, the all-gather the gathered K/V of the whole
    # sequence at the kv heads instead (2 x kv_dim x cp per local token).
    per_token = heads * CP_COMPUTE_BYTES - (expansion + sdpa_lse) * act
    if lo.cp_method == "allgather":
        per_token += 2 * kv_dim * (cp - 1) * act
    return out + tokens_mb * per_token / tp


def _rank_split(num_layers: int, *, pp: int, chunks: int, head_units: float) -> tuple[list[int], float]:
    """Layers on each pipeline rank, and the bottleneck rank's load in layer units (head included).

    The split is the runtime's default (`parallel.schedules.balanced_split`, which the runtime uses
    when `parallel.pp_layers` = ""): contiguous stages s = chunk * pp + rank, the last stage (which also
    runs the output head) given the layer count that minimises the busiest rank's load, the rest spread
    over the earlier stages first, every stage keeping at least one layer as the runtime needs (a
    head-only last stage would sometimes be faster, e.g. 126 layers over 16 x 7 stages with the head worth
    1.5 layers: 8 instead of 8.5, but meshlm does not run one; tests/test_planner.py checks the agreement).
    """
    counts = balanced_split(num_layers, pp=pp, pp_chunks=chunks, head_units=head_units)
    return stage_loads(counts, pp=pp, pp_chunks=chunks, head_units=head_units)


def estimate_layout(summary: ModelSummary, cluster: Cluster, job: Job, layout: Layout, *,
                    num_microbatches: int) -> Estimate:
    """Memory and time of `layout` (already validated; see `validate_layout`)."""
    cfg, lo, s = summary.cfg, layout, job.seq_len
    by = _bytes_per(job.precision)
    h = cfg.hidden_size
    tp, pp, cp, ep, v = lo.tp, lo.pp, lo.cp, lo.ep, lo.pp_chunks
    m = num_microbatches
    mbs = lo.micro_batch_size
    sp = lo.sequence_parallel and tp > 1
    gpus = lo.world
    L = cfg.num_layers
    tokens_mb = mbs * s / cp  # tokens one rank processes per microbatch
    # Ranks that time-share compute units (a CPU host running more ranks than it has cores) each
    # compute and stream memory at slots / ranks of the single-unit rate. GPUs never share (slots 0).
    ranks_per_domain = min(gpus, cluster.scaleup_size)
    share = max(1.0, ranks_per_domain / cluster.compute_slots) if cluster.compute_slots else 1.0
    # On such a host a collective is memory copies and reductions done by those same cores (the
    # "link" is the loopback), so it time-shares them too, and it has no idle core to overlap on.
    cores_saturated = bool(cluster.compute_slots) and ranks_per_domain >= cluster.compute_slots
    if share > 1:
        cluster = slowed_links(cluster, share)
    peak = cluster.peak(job.precision) / share
    peak_attn = (cluster.peak("bf16") if job.precision == "fp8" else cluster.peak(job.precision)) / share
    eff = cluster.matmul_efficiency
    hbm_bw = cluster.hbm_bw * cluster.hbm_efficiency / share

    # ---- placement -------------------------------------------------------------------------
    D = cluster.scaleup_size
    span_tp = group_span(1, tp, D)
    span_cp = group_span(tp, cp, D)
    span_ep = group_span(tp, ep, D)
    span_dps = group_span(tp, cp * lo.dp_shard, D)  # ZeRO / FSDP shards over dp_shard x cp
    span_dpr = group_span(tp * cp * lo.dp_shard, lo.dp_replicate, D)
    span_dp_all = group_span(tp, cp * lo.dp, D)  # plain all-reduce over every data-parallel rank
    span_pp = group_span(tp * cp * lo.dp, pp, D)
    links = {"tp": link_name(*span_tp), "cp": link_name(*span_cp), "ep": link_name(*span_ep),
             "dp_shard": link_name(*span_dps), "dp_replicate": link_name(*span_dpr),
             "pp": link_name(*span_pp)}

    # ---- pipeline split: head on the last stage, measured in layer-compute units --------------
    head_units = summary.flops_head / (summary.flops_dense + summary.flops_attn)
    rank_layers, rank_units = _rank_split(L, pp=pp, chunks=v, head_units=head_units)
    layers_first, layers_last = rank_layers[0], rank_layers[-1]

    # ---- compute per microbatch on the bottleneck rank ---------------------------------------
    rc = lo.recompute
    attn_f = summary.flops_attn * tokens_mb / tp
    # Each GEMM of the layer by its shape (kernels.py): thin tp shards and small experts run below the
    # large-GEMM rate; fp8 runs the GEMMs on fp8 inputs at the fp8 rate, everything else in bf16.
    gemms = layer_gemms(cfg, tokens=tokens_mb, tp=tp, ep=ep, moe_fraction=summary.moe_layer_fraction)
    gemm_in_bytes = 1 if job.precision == "fp8" else by["act"]
    t_dense, t_dense_bwd = gemms_fwd_bwd(gemms, rate=peak * eff, hbm_bw=hbm_bw, in_bytes=gemm_in_bytes,
                                         k_overhead=cluster.gemm_k_overhead)
    if job.flash_attention:
        # FLOPs count the full s x s square (the convention), but a fused causal kernel skips the
        # masked half, and runs at its own efficiency (softmax and masking inside the kernel, lower
        # than a plain GEMM's). Its backward recomputes the scores: 2.5x the forward's matmuls (the
        # FlashAttention papers' count), where a GEMM's backward is 2x.
        # Each kernel call sees s / cp queries (a ring step under context parallelism): the masked
        # diagonal tiles and the per-row-block softmax epilogue cost a fixed number of tokens' worth
        # (`attention_block_overhead`), so short blocks run below the long-sequence rate.
        block = s / cp
        block_eff = block / (block + cluster.attention_block_overhead)
        t_attn = attn_f * 0.5 / (peak_attn * cluster.attention_efficiency * block_eff)
        t_attn_bwd = 2.5 * t_attn
    else:
        # the unfused kernels of 2021: batched GEMMs over the whole square (softmax as HBM traffic below)
        t_attn = attn_f / (peak_attn * eff)
        t_attn_bwd = 2 * t_attn
    t_layer_fwd_mm = t_dense + t_attn
    # Memory-bound elementwise work (norms, residual adds, RoPE, SwiGLU product, MoE permutes), read +
    # write, forward; backward moves about twice as much. Without SP the norm/residual part is
    # replicated on every tp rank.
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = (summary.moe_layer_fraction * (cfg.num_experts_per_token * cfg.expert_intermediate_size
                                           + cfg.shared_intermediate_size)
             + (1 - summary.moe_layer_fraction) * cfg.intermediate_size)
    moe_elems = summary.moe_layer_fraction * 4 * cfg.num_experts_per_token * h
    if job.fused_elementwise:
        elems_seq = 10 * h + moe_elems
        elems_tp = 2 * (q_dim + kv_dim) + 3 * inter
    else:
        # Eager PyTorch, meshlm's model as written: every op is its own pass over memory. Per token,
        # elements read + written: each RMSNorm 7h (pow, mean, scale, weight), residual adds 3h each,
        # RoPE 10 per rotated element (neg, cat, two products, add) on q and k, the GQA
        # repeat_interleave of k and v, the attention output's transpose copy, SwiGLU 5 per
        # intermediate (silu, product).
        elems_seq = 20 * h + moe_elems
        elems_tp = 10 * (q_dim + kv_dim) + 2 * (q_dim + kv_dim) + 2 * q_dim + 5 * inter
    if not job.flash_attention:
        # unfused scale+mask+softmax (+dropout) over s scores per head: ~4 passes forward
        elems_tp += 4 * cfg.num_heads * s
    elem_bytes_fwd = tokens_mb * by["act"] * (elems_tp / tp + elems_seq / (tp if sp else 1))
    t_elem_fwd = elem_bytes_fwd / hbm_bw
    t_elem_bwd = 2 * t_elem_fwd
    if job.precision == "fp8":
        cast_fwd, cast_bwd = fp8_cast_bytes(gemms)
        t_elem_fwd += cast_fwd / hbm_bw
        t_elem_bwd += cast_bwd / hbm_bw
    t_fwd_layer = t_layer_fwd_mm + t_elem_fwd
    t_bwd_layer = t_dense_bwd + t_elem_bwd + t_attn_bwd
    t_rc_layer = {"none": 0.0, "selective": t_attn + 0.5 * t_elem_fwd, "full": t_fwd_layer}[rc]

    # Tensor-parallel comm per microbatch, the collectives of `tp_collectives` (meshlm's TP, which
    # matches Megatron's): per layer 2 all-reduces (or AG + RS pairs under SP) forward, 2 backward,
    # 2 more when the forward is recomputed in full; around the layers the embedding, lm_head input and
    # loss. Not overlapped (Megatron default, and meshlm's TP).
    act_msg = tokens_mb * h * by["act"]
    tp_layer_colls, tp_edge_colls = tp_collectives(cfg, tp=tp, sequence_parallel=sp, tokens=tokens_mb,
                                                   act_bytes=by["act"], recompute=rc,
                                                   norm_grads_in_graph=job.runtime == "meshlm")
    t_tp_layer = sum(n * collective_time(kind, nbytes, span_tp, cluster) for kind, nbytes, n in tp_layer_colls)
    if job.tp_comm_overlap and not cores_saturated:
        # Megatron/TE userbuffers: each all-gather is split and pipelined under the GEMM that consumes it,
        # each reduce-scatter under the GEMM that produces it; what the GEMMs cannot cover is exposed, and
        # what they cover still costs the SMs the transfer holds.
        window = t_dense + t_dense_bwd
        t_tp_layer = (max(0.0, t_tp_layer - window)
                      + cluster.comm_sm_fraction * min(t_tp_layer, window))
    t_tp_edge = sum(n * collective_time(kind, nbytes, span_tp, cluster) for kind, nbytes, n in tp_edge_colls)
    # Context parallelism, the volumes of `parallel/context.py` (its docstring; `Estimate.cp_comm_bytes`
    # counts them as CommStats does). One block = this rank's K (or V): mbs x seq/cp x kv_dim/tp.
    # Recomputation (selective: the core; full: the layer) runs the core's forward communication again.
    rc_again = 1 if rc in ("full", "selective") else 0
    if cp > 1:
        kv_block = mbs * (s / cp) * kv_dim / tp * by["act"]
        kv_pair = 2 * kv_block  # K + V
        grad_pair = kv_pair * CP_COMPUTE_BYTES / by["act"]  # dK + dV partial sums, in the compute dtype
        if lo.cp_method == "ring":
            # cp - 1 ring steps each way, each overlapped with the attention of the block in hand
            # (forward t_attn / cp; backward t_attn_bwd / cp): K+V forward; K+V and the partial dK+dV
            # (sent together to the next rank) backward. Only the excess is exposed, and what overlaps
            # still costs the SMs the transfer holds; a CPU host with every core busy overlaps nothing.
            ring_span = span_cp if span_cp[1] == 1 else (1, 2)
            t_send_fwd = collective_time("p2p", kv_pair, ring_span, cluster)
            t_send_bwd = collective_time("p2p", kv_pair + grad_pair, ring_span, cluster)

            def overlapped(t_comm: float, t_compute: float) -> float:
                if cores_saturated:
                    return t_comm
                return max(0.0, t_comm - t_compute) + cluster.comm_sm_fraction * min(t_comm, t_compute)

            t_cp_layer = (cp - 1) * ((1 + rc_again) * overlapped(t_send_fwd, t_attn / cp)
                                     + overlapped(t_send_bwd, t_attn_bwd / cp))
            # Online-softmax merge after each extra ring step: read the step's partial output and the
            # running one, write it back, in fp32 (3 passes over this rank's q columns) forward, and
            # about twice that backward (dO and the partial gradients); memory-bound, not overlapped.
            merge_bytes = tokens_mb * q_dim / tp * CP_COMPUTE_BYTES * 3 * (1 + 2 + rc_again)
            t_cp_layer += (cp - 1) * merge_bytes / hbm_bw
            cp_layer_bytes = (cp - 1) * ((1 + rc_again) * kv_pair + kv_pair + grad_pair)
        else:
            # All-gather (Llama 3 style): one all-gather of every rank's K+V forward (its output: cp blocks
            # of K+V) and one reduce-scatter of dK+dV backward (in K/V's dtype: the gradient of the
            # gathered tensor), on the cp group; the attention needs all of it, so neither overlaps.
            t_cp_layer = ((1 + rc_again) * collective_time("all_gather", cp * kv_pair, span_cp, cluster)
                          + collective_time("reduce_scatter", cp * kv_pair, span_cp, cluster))
            cp_layer_bytes = (2 + rc_again) * cp * kv_pair
    else:
        t_cp_layer = cp_layer_bytes = 0.0
    # Expert all-to-all: dispatch + combine forward and backward (and again if recomputed).
    if ep > 1 and cfg.is_moe:
        a2a = tokens_mb / (tp if sp else 1) * cfg.num_experts_per_token * h * by["act"]
        n_a2a = 4 + (2 if rc == "full" else 0)
        t_ep_layer = summary.moe_layer_fraction * n_a2a * collective_time("all_to_all", a2a, span_ep, cluster)
    else:
        t_ep_layer = 0.0

    comp_mb = rank_units * (t_fwd_layer + t_bwd_layer)
    layers_busy = max(layers_first, layers_last)
    rc_mb = layers_busy * t_rc_layer
    tp_mb = layers_busy * t_tp_layer + t_tp_edge  # pp > 1: both ends charged to the busiest rank
    cp_mb = layers_busy * t_cp_layer
    ep_mb = layers_busy * t_ep_layer
    t_mb = comp_mb + rc_mb + tp_mb + cp_mb + ep_mb
    t_mb_fwd = rank_units * t_fwd_layer + (tp_mb + cp_mb + ep_mb) / 3
    t_mb_bwd = t_mb - t_mb_fwd

    # ---- pipeline ----------------------------------------------------------------------------
    bubble = pipeline_bubble(lo.pp_schedule, pp=pp, num_microbatches=m, pp_chunks=v,
                             t_fwd=t_mb_fwd, t_bwd_input=t_mb_bwd / 2, t_bwd_weight=t_mb_bwd / 2)
    if pp > 1:
        hop = collective_time("p2p", act_msg / (tp if sp else 1), span_pp if span_pp[1] == 1 else (1, 2), cluster)
        t_pp_p2p = 2 * v * (m + pp - 1) * hop
    else:
        t_pp_p2p = 0.0

    # ---- parameters on the busiest-memory rank -----------------------------------------------
    layers_mem = max(layers_first, layers_last)
    dense_params = layers_mem * (summary.layer_tp / tp + summary.layer_rep)
    expert_params = layers_mem * summary.layer_experts / (tp * ep)
    embed_params = summary.embed / tp
    head_params = summary.head / tp if (not cfg.tie_embeddings or pp > 1) else 0.0
    if pp == 1:
        dense_params += embed_params + head_params + h
    else:  # the bigger of the first stage (embedding) and the last (head + final norm)
        first = layers_first * (summary.layer_tp / tp + summary.layer_rep) + embed_params
        last = layers_last * (summary.layer_tp / tp + summary.layer_rep) + head_params + h
        dense_params = max(first, last)
    shard = lo.dp_shard * cp
    expert_shard = max(1, shard // ep)
    z = lo.zero_stage

    def sharded(n_dense: float, n_exp: float, stage_needed: int) -> float:
        if z >= stage_needed:
            return math.ceil(n_dense / shard) + math.ceil(n_exp / expert_shard)
        return n_dense + n_exp

    n_local = dense_params + expert_params
    meshlm_zero = job.runtime == "meshlm" and z > 0 and (lo.dp > 1 or cp > 1)
    if meshlm_zero:
        # meshlm's own ZeRO (parallel/zero.py), fp32 throughout. Stages 1/2 keep the full fp32
        # parameters AND a flat fp32 master shard next to the moments (optimizer: 4 + 8 bytes per
        # parameter / shards); under stage 3 that shard is the weights (no other copy), so the
        # optimizer is the moments alone. Gradients: a flat shard always; stage 1 keeps the full
        # `.grad` too, stages 2/3 free it per bucket once copied out -- except that accumulation
        # (no_sync micro-steps, m > 1) keeps full gradients until the last micro-step.
        shard_n = sharded(dense_params, expert_params, 1)
        mem = {
            "weights": (shard_n if z == 3 else n_local) * by["param"],
            "gradients": (shard_n + (n_local if z == 1 or m > 1 else 0.0)) * by["grad"],
            "optimizer": shard_n * (by["optim"] + (by["param"] if z < 3 else 0)),
        }
    else:
        mem = {
            "weights": sharded(dense_params, expert_params, 3) * by["param"],
            "gradients": sharded(dense_params, expert_params, 2) * by["grad"],
            "optimizer": sharded(dense_params, expert_params, 1) * by["optim"],
        }
    # Activations of the first rank (most microbatches in flight) or the last (logits).
    per_layer_mb = layer_activation_bytes(summary, job, lo)
    if not job.flash_attention and rc == "none":
        # an unfused attention keeps its s x s scores and softmax (by["act"] each) and the dropout mask
        # (1 byte) per head: what selective recomputation was invented to drop (Korthikanti et al.)
        per_layer_mb += tokens_mb * (2 * by["act"] + 1) * cfg.num_heads * s / tp
    inflight = inflight_microbatches(lo.pp_schedule, pp=pp, num_microbatches=m, pp_chunks=v)
    act_first = inflight * layers_first * per_layer_mb
    # Backward of one layer holds the gradients of that layer's intermediate tensors next to the saved
    # ones (about one layer's full activations); under full recompute the layer being recomputed
    # also holds its full activations again.
    layer_full_act = layer_activation_bytes(summary, job, lo, recompute="none")
    act_first += layer_full_act * (2 if rc == "full" else 1)
    logits = tokens_mb * cfg.vocab_size / tp * 4 * 2  # fp32 logits and their gradient
    act_last = (layers_last * per_layer_mb + logits) if pp > 1 else 0.0
    mem["activations"] = max(act_first + (logits if pp == 1 else 0.0), act_last)
    buffers = 0.0
    if sp:
        buffers += 2 * act_msg  # gathered sequence-parallel activations (none without SP)
    if lo.dp > 1 or cp > 1:
        if meshlm_zero:
            # One reduce-scatter is in flight at a time (parallel/zero.py), holding a padded copy of its
            # bucket's gradients. Stages 1/2: a bucket closes once it holds bucket_size_mb, so it is at
            # most that plus one tensor (the embedding is the largest): an upper bound. Stage 3 (a
            # bucket is a unit): in forward the root unit (embedding, final norm, head; kept until the
            # first block's backward), a block and the next one (prefetched) are gathered; in a block's
            # backward that block and the next one, with the previous block's reduce-scatter in flight.
            if z < 3:
                largest = max(summary.embed, summary.head) / tp
                bucket = lo.bucket_size_mb * MiB / by["grad"] + largest
                buffers += min(n_local, bucket) * by["grad"]
            else:
                layer = summary.layer_tp / tp + summary.layer_rep + summary.layer_experts / (tp * ep)
                root = n_local - layers_mem * layer
                gathered = min(layers_mem, 2)
                in_flight = min(layers_mem, 3) - gathered
                buffers += max((root + gathered * layer) * by["param"],
                               gathered * layer * by["param"] + in_flight * layer * by["grad"])
        elif z == 0:
            # meshlm's DP (parallel/data.py) copies every gradient into a flat per-bucket buffer for the
            # all-reduce: one extra copy of all gradients, whatever the bucket size.
            buffers += (dense_params + expert_params) * by["grad"]
        elif z < 3:
            buffers += 2 * lo.bucket_size_mb * MiB
        elif z == 3:
            layer_full = (summary.layer_tp / tp + summary.layer_rep + summary.layer_experts / (tp * ep))
            buffers += ZERO3_PREFETCH_LAYERS * layer_full * by["param"] + layer_full * by["grad"]
    if ep > 1:
        buffers += 2 * tokens_mb * cfg.num_experts_per_token * h * by["act"] / (tp if sp else 1)
    if pp > 1:
        buffers += 4 * act_msg / (tp if sp else 1)
    mem["comm_buffers"] = buffers
    allocated = sum(mem.values())
    mem["fragmentation"] = FRAGMENTATION * allocated
    mem["reserved"] = cluster.reserved_bytes
    total_bytes = sum(mem.values())

    # ---- data-parallel / ZeRO communication ------------------------------------------------------
    n_dense_local = dense_params  # parameters one rank owns before ZeRO sharding
    n_exp_local = expert_params
    t_dp = 0.0
    bucket_time = 0.0
    if lo.dp * cp > 1:
        g_dense = n_dense_local * by["reduce"]
        g_exp = n_exp_local * by["reduce"]
        span_exp = group_span(tp * ep, max(1, lo.dp * cp // ep), D)
        sync = 0.0  # collectives the runtime issues synchronously (nothing to overlap with)
        if meshlm_zero:
            # meshlm's ZeRO: one reduce-scatter of all (padded) gradients per step, launched per
            # bucket during the last micro-step's backward (async), then the shard's all-reduce over
            # dp_replicate; stages 1/2 all-gather every updated parameter inside the optimizer step
            # (synchronous). Stage 3 all-gathers every block before its forward and again before its
            # backward in every micro-step, and the root unit (embedding, norm, head) once: each gather
            # is prefetched one unit ahead, so all but the root's (which starts the forward) overlap
            # the compute of the micro-steps.
            comm = (collective_time("reduce_scatter", g_dense + g_exp, span_dps, cluster)
                    + collective_time("all_reduce", (g_dense + g_exp) / shard, span_dpr, cluster))
            window = t_mb_bwd
            if z == 3:
                root = n_local - layers_mem * (summary.layer_tp / tp + summary.layer_rep
                                               + summary.layer_experts / (tp * ep))
                comm += m * collective_time("all_gather", (2 * n_local - 2 * root) * by["param"], span_dps, cluster)
                window = m * t_mb
                sync = m * collective_time("all_gather", root * by["param"], span_dps, cluster)
            else:
                sync = collective_time("all_gather", n_local * by["param"], span_dps, cluster)
        elif z == 0:
            comm = (collective_time("all_reduce", g_dense, span_dp_all, cluster)
                    + collective_time("all_reduce", g_exp, span_exp, cluster))
            window = t_mb_bwd
        elif z in (1, 2):
            comm = (collective_time("reduce_scatter", g_dense, span_dps, cluster)
                    + collective_time("all_reduce", g_dense / shard, span_dpr, cluster)
                    + collective_time("all_gather", n_dense_local * by["param"], span_dps, cluster)
                    + collective_time("reduce_scatter", g_exp, span_exp, cluster)
                    + collective_time("all_gather", n_exp_local * by["param"], span_exp, cluster))
            window = t_mb_bwd + t_mb_fwd  # grads overlap the last backward, params the first forward
        else:
            # FSDP: gather weights for forward and again for backward, reduce-scatter gradients, every
            # microbatch; then one all-reduce of the shard across replicas per step.
            per_mb = (2 * collective_time("all_gather", n_dense_local * by["param"], span_dps, cluster)
                      + collective_time("reduce_scatter", g_dense, span_dps, cluster)
                      + 2 * collective_time("all_gather", n_exp_local * by["param"], span_exp, cluster)
                      + collective_time("reduce_scatter", g_exp, span_exp, cluster))
            comm = m * per_mb + collective_time("all_reduce", g_dense / shard, span_dpr, cluster)
            window = m * t_mb
        if cores_saturated or (not job.dp_comm_overlap and z < 3):
            window = 0.0
        bucket = lo.bucket_size_mb * MiB
        bucket_time = comm * min(1.0, bucket / max(1.0, g_dense + g_exp))  # the last bucket never overlaps
        t_dp = max(comm - window, bucket_time)
        # What is hidden still costs: the collective's kernels occupy SMs the overlapped compute loses.
        t_dp += cluster.comm_sm_fraction * max(0.0, comm - t_dp) + sync

    # ---- optimizer: streams weights, gradients, master and Adam states through HBM ----------------
    n_opt = sharded(dense_params, expert_params, 1)
    t_opt = n_opt * (by["grad"] + by["optim"] * 2 + by["param"]) / hbm_bw

    compute = m * (comp_mb + rc_mb)
    time = {
        "compute": m * comp_mb,
        "recompute": m * rc_mb,
        "tp_comm": m * tp_mb,
        "cp_comm": m * cp_mb,
        "ep_comm": m * ep_mb,
        "pp_bubble": bubble,
        "pp_p2p": t_pp_p2p,
        "dp_comm": t_dp,
        "optimizer": t_opt,
    }
    assert compute >= 0
    step = sum(time.values())
    time["step"] = step
    tokens = job.tokens
    model_flops = summary.model_flops_per_token * tokens
    hw_flops = summary.hw_flops_per_token[rc] * tokens
    peak_all = gpus * peak
    return Estimate(
        layout=layout,
        fits=total_bytes <= cluster.hbm_bytes * (1 - MIN_HEADROOM),
        memory_gib={**{k: v / GiB for k, v in mem.items()}, "total": total_bytes / GiB},
        time_s=time,
        mfu=model_flops / (step * peak_all),
        hfu=hw_flops / (step * peak_all),
        tokens_per_s=tokens / step,
        tflops_per_gpu=model_flops / step / gpus / 1e12,
        hw_tflops_per_gpu=hw_flops / step / gpus / 1e12,
        num_microbatches=m,
        links=links,
        hbm_gib=cluster.hbm_bytes / GiB,
        tp_comm_bytes=(m * sum(n * b for _, b, n in tp_layer_colls) * layers_busy
                       + m * sum(n * b for _, b, n in tp_edge_colls) + (4 if tp > 1 else 0)),
        cp_comm_bytes=m * layers_busy * cp_layer_bytes,
    )


def estimate(cfg: ModelConfig, cluster: Cluster, job: Job, layout: Layout, *, gpus: int | None = None) -> Estimate:
    """Validate and estimate one layout."""
    job.validate()
    gpus = layout.world if gpus is None else gpus
    m = validate_layout(cfg, job, layout, gpus=gpus)
    return estimate_layout(ModelSummary.build(cfg, job.seq_len, eager=not job.fused_elementwise), cluster, job,
                           layout, num_microbatches=m)
