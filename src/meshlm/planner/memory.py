"""Memory per GPU of one layout: model state, activations and buffers on the busiest rank.

Responsible for: the parameters one rank holds (`rank_params`), the bytes of weights, gradients, optimizer
state, activations (`layer_activation_bytes`, times the microbatches in flight,
`inflight_microbatches`), communication buffers, fragmentation and the reserved pool (`memory_bytes`).
Not responsible for: time (`timing.py`), or whether a total fits (`cost.py`: MIN_HEADROOM).

Model-state bytes per parameter (bf16 / fp8 training, Megatron's distributed-optimizer convention):
2 (bf16 weights) + 4 (fp32 gradients: accumulated and reduced in fp32) + 12 (fp32 master, Adam m and
v); the gradients are 2 bytes where `Job.grad_reduce_in_fp32` is False; a model cast to bf16 (`Job.bf16_states`)
keeps 2 + 2 + 4 (bf16 moments, no master), Megatron-Core's precision-aware optimizer with bf16 moments
(`Job.bf16_moments`) 8 in place of the 12. Under fp8 the GEMM inputs kept
for backward are fp8 copies (`fp8_saved_input_delta`). ZeRO-1 shards the 12, ZeRO-2 also the gradients,
ZeRO-3 also the weights, each over dp_shard x cp (communication: Megatron / FSDP-style, overlapped,
ZeRO-3 prefetching the next layer); FSDP accumulating without synchronization (`Job.fsdp_no_sync`) holds the
rank's gradients whole, in the reduce dtype, until the last micro-step reduces them.
`Job.runtime = "meshlm"` (fp32; what `cluster=local` and benchmarks/planner_vs_measured.py run) follows
meshlm's own runtime, as `parallel/data.py` and `parallel/zero.py` really allocate and communicate:
  plain DP   4 + 4 + 8, plus one flat copy of all gradients in the all-reduce buckets;
  ZeRO-1/2   full fp32 weights (4) + a flat fp32 master shard (4/n, counted under `optimizer`) + the
             moments (8/n); gradients: the 4/n shard, plus the full 4 under stage 1 -- or under
             stage 2 with accumulation (no_sync keeps full gradients until the last micro-step);
  ZeRO-3     the 4/n shard is the weights (no other copy); moments 8/n; gradients as stage 2;
  buffers    ZeRO 1-3: the padded gradient copy of the one reduce-scatter in flight; stage 3 also
             the gathered units: resharding after forward (`Layout.zero3_reshards`), the root unit, the
             block in use and the prefetched next one; keeping them (the default under pp), every unit
             of the rank's stage(s) for the whole step;
  comm       one reduce-scatter of all gradients per step (overlapping the last backward) and an
             all-reduce of the shard over dp_replicate; all-gathers: of all parameters once per step,
             synchronously (stages 1/2); stage 3 resharding, of every block twice and the root unit once
             per micro-step (pp > 1: the root twice too, it is not kept into backward), prefetched one
             unit ahead (overlapping compute); stage 3 keeping, of every unit once per step.
  TP         (`parallel/tensor.py`, plain DP over the TP-local shards) attention and MLP matrices
             (and q/k/v biases), the embedding and lm_head (split over the vocabulary) hold 1/tp per
             rank; norms are full copies on every tp rank; DP's bucket copy is of the local shards. Its
             collectives per microbatch are `timing.tp_collectives` (bytes: `Estimate.tp_comm_bytes`).
n = dp_shard; meshlm pads each bucket to a multiple of n (< n elements per bucket), which the planner's
ceil(params / n) leaves out (tests/test_planner_measured.py bounds the difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshlm.planner.layout import CP_COMPUTE_BYTES, Job, Layout
from meshlm.planner.placement import RankSetup, bytes_per

if TYPE_CHECKING:
    from meshlm.planner.cost import ModelSummary

MiB = 2**20  # bucket sizes are in MiB, as in parallel/data.py
FRAGMENTATION = 0.08  # caching-allocator fragmentation margin, fraction of what is allocated
# ZeRO-3 keeps the next layer's gathered weights while computing this one (prefetch): 2 layers live.
ZERO3_PREFETCH_LAYERS = 2


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


def fp8_saved_input_delta(summary: ModelSummary) -> tuple[float, float]:
    """Bytes per token per (average) layer that fp8 training adds to the bf16 count, as (tp_sharded,
    sequence_only): Transformer Engine's fp8 linear layers keep for their weight gradient the fp8 copy of
    their input (1 byte per element) instead of the bf16 input (what TE's `Linear` / `LayerNormLinear`
    modules save for backward under fp8_autocast).
    So the two norm outputs (inputs of qkv and of the MLP's first matmul) and the SwiGLU product (input
    of w_down) shrink by a byte per element, while the attention output, which the fused attention kernel
    keeps in bf16 for its own backward, is kept once more in fp8 as wo's input (+1 byte per element)."""
    cfg = summary.cfg
    moe = summary.moe_layer_fraction
    inter = (moe * (cfg.num_experts_per_token * cfg.expert_intermediate_size + cfg.shared_intermediate_size)
             + (1 - moe) * cfg.intermediate_size)
    return float(cfg.num_heads * cfg.head_dim - inter), -2.0 * cfg.hidden_size


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
      ulysses    the model's own core (whole sequence, heads / cp; kv heads replicated to lcm(kv, cp) keep
                 no more than the GQA expansion would): per local token what cp = 1 keeps, plus the
                 attention output a second time -- the core keeps it split by heads, wo's input is it
                 split by tokens (without cp they are one tensor). The whole sequence of q, k, v and the
                 scores' blocks live during the core only.
      hybrid     (cp_ulysses = U > 1, the ring across groups of U) the ring's, with its K and V at lcm(kv / tp, U)
                 heads (replicated as Ulysses does), and the output twice as Ulysses keeps it.
    tests/test_planner_cp.py checks the eager counts byte for byte against a real cp=2 run.
    """
    cfg, lo = summary.cfg, layout
    rc = lo.recompute if recompute is None else recompute
    by = bytes_per(job.precision)
    act = by["act"]
    tp, cp = lo.tp, lo.cp
    sp = lo.sequence_parallel and tp > 1
    s_local = job.seq_len / cp
    tokens_mb = lo.micro_batch_size * s_local
    out = tokens_mb * act * (summary.act_tp[rc] / tp + summary.act_seq[rc] / (tp if sp else 1))
    if job.precision == "fp8" and rc != "full":
        fp8_tp, fp8_seq = fp8_saved_input_delta(summary)
        out += tokens_mb * (fp8_tp / tp + fp8_seq / (tp if sp else 1))
    if cp == 1 or rc != "none":
        return out
    eager = not job.fused_elementwise
    q_dim, kv_dim, heads = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads
    if lo.cp_method == "ulysses":
        # The model's own core, on heads / cp over the whole sequence: per local token what cp = 1 keeps,
        # and the attention output once more (the core keeps it head-split, wo its input token-split).
        return out + tokens_mb * q_dim * act / tp
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
    out += tokens_mb * per_token / tp
    if lo.cp_ulysses > 1:  # the hybrid: the ring's, on K/V replicated to lcm(kv / tp, U), and the output twice
        g = math.lcm(cfg.num_kv_heads // tp, lo.cp_ulysses)
        out += tokens_mb * (2 * (g - cfg.num_kv_heads // tp) * cfg.head_dim + q_dim / tp) * act
    return out


@dataclass(frozen=True)
class RankParams:
    """Parameters on the busiest-memory rank before ZeRO sharding, and how ZeRO shards them."""

    dense: float  # tp-sharded and replicated parameters (embedding / head on their stages)
    experts: float  # routed-expert parameters (split over ep, and over expert_tp in a Megatron-Core run)
    layers: int  # layers on that rank
    shard: int  # ZeRO group: dp_shard x cp
    expert_shard: int  # ZeRO group of the expert parameters: shard / ep
    zero_stage: int
    meshlm_zero: bool  # Job.runtime == "meshlm" with ZeRO: meshlm's own accounting (see the docstring)

    @property
    def local(self) -> float:
        return self.dense + self.experts

    def sharded(self, stage_needed: int) -> float:
        """Parameters per rank of a state that ZeRO shards from `stage_needed` on."""
        if self.zero_stage >= stage_needed:
            return math.ceil(self.dense / self.shard) + math.ceil(self.experts / self.expert_shard)
        return self.dense + self.experts


def rank_params(summary: ModelSummary, job: Job, lo: Layout, r: RankSetup) -> RankParams:
    cfg, tp, pp, cp, ep, h = summary.cfg, r.tp, r.pp, r.cp, r.ep, summary.cfg.hidden_size
    layers_first, layers_last = r.layers_first, r.layers_last
    layers_mem = max(layers_first, layers_last)
    dense_params = layers_mem * (summary.layer_tp / tp + summary.layer_rep)
    expert_params = layers_mem * summary.layer_experts / (r.expert_tp * ep)
    embed_params = summary.embed / tp
    head_params = summary.head / tp if (not cfg.tie_embeddings or pp > 1) else 0.0
    if pp == 1:
        dense_params += embed_params + head_params + h
    else:  # the bigger of the first stage (embedding) and the last (head + final norm)
        first = layers_first * (summary.layer_tp / tp + summary.layer_rep) + embed_params
        last = layers_last * (summary.layer_tp / tp + summary.layer_rep) + head_params + h
        dense_params = max(first, last)
    shard = lo.dp_shard * cp
    return RankParams(dense=dense_params, experts=expert_params, layers=layers_mem, shard=shard,
                      expert_shard=max(1, shard * (tp // lo.etp) // ep), zero_stage=lo.zero_stage,
                      meshlm_zero=job.runtime == "meshlm" and lo.zero_stage > 0 and (lo.dp > 1 or cp > 1))


def memory_bytes(summary: ModelSummary, cluster_reserved: float, job: Job, lo: Layout, r: RankSetup,
                 p: RankParams, *, num_microbatches: int) -> dict:
    """Bytes per GPU by component: weights, gradients, optimizer, activations, comm_buffers,
    fragmentation, reserved (the caller adds the total)."""
    cfg, s, h = summary.cfg, job.seq_len, summary.cfg.hidden_size
    tp, pp, cp, ep, v, sp, rc, by = r.tp, r.pp, r.cp, r.ep, r.v, r.sp, r.rc, r.by
    tokens_mb, act_msg, m, z = r.tokens_mb, r.act_msg, num_microbatches, p.zero_stage
    layers_first, layers_last, layers_mem = r.layers_first, r.layers_last, p.layers
    dense_params, expert_params, n_local = p.dense, p.experts, p.local
    if p.meshlm_zero:
        # meshlm's own ZeRO (parallel/zero.py), fp32 throughout. Stages 1/2 keep the full fp32
        # parameters AND a flat fp32 master shard next to the moments (optimizer: 4 + 8 bytes per
        # parameter / shards); under stage 3 that shard is the weights (no other copy), so the
        # optimizer is the moments alone. Gradients: a flat shard always; stage 1 keeps the full
        # `.grad` too, stages 2/3 free it per bucket once copied out -- except that accumulation
        # (no_sync micro-steps, m > 1) keeps full gradients until the last micro-step.
        shard_n = p.sharded(1)
        mem = {
            "weights": (shard_n if z == 3 else n_local) * by["param"],
            "gradients": (shard_n + (n_local if z == 1 or m > 1 else 0.0)) * by["grad"],
            "optimizer": shard_n * (by["optim"] + (by["param"] if z < 3 else 0)),
        }
    else:
        mem = {
            "weights": p.sharded(3) * by["param"],
            "gradients": p.sharded(2) * by["grad"],
            "optimizer": p.sharded(1) * by["optim"],
        }
        if job.fp8_weights_are("cached") and z < 3:
            # Transformer Engine's fp8 weights (`Job.fp8_weights` "cached"): each linear layer's weight cast once and
            # kept in its module's workspace for every micro-batch, row-wise for the forward GEMM and column-wise for
            # the input gradient's (its weight quantizer asks for both usages while training): 2 bytes per element of
            # the rank's layer GEMM weights beside the bf16 ones (the embedding and head stay bf16). Held as fp8
            # parameters ("params") the same two copies replace the bf16 weights: 2 bytes, as counted.
            mem["weights"] += 2.0 * (layers_mem * summary.layer_tp / tp + expert_params)
        fsdp_units = (z == 3 and lo.zero3_reshards) or (z == 2 and job.zero2_unit_collectives)  # timing_dp's FSDP
        if job.fsdp_no_sync and m > 1 and fsdp_units and (lo.dp > 1 or cp > 1):
            # FSDP accumulating without synchronization (`Job.fsdp_no_sync`): every unit's unsharded gradient, in
            # the reduce dtype, until the last micro-step's reduce-scatter replaces it by its shard
            mem["gradients"] = n_local * by["reduce"]
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
    # fp32 logits and their gradient, of the vocabulary shard (of all of it where gathered for the loss)
    logits = tokens_mb * cfg.vocab_size / (1 if job.tp_loss_replicated else tp) * 4 * 2
    act_last = (layers_last * per_layer_mb + logits) if pp > 1 else 0.0
    mem["activations"] = max(act_first + (logits if pp == 1 else 0.0), act_last)
    buffers = 0.0
    if sp:
        buffers += 2 * act_msg  # gathered sequence-parallel activations (none without SP)
    if lo.dp > 1 or cp > 1:
        if p.meshlm_zero:
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
            elif lo.zero3_reshards:
                layer = summary.layer_tp / tp + summary.layer_rep + summary.layer_experts / (r.expert_tp * ep)
                root = n_local - layers_mem * layer
                gathered = min(layers_mem, 2)
                in_flight = min(layers_mem, 3) - gathered
                buffers += max((root + gathered * layer) * by["param"],
                               gathered * layer * by["param"] + in_flight * layer * by["grad"])
            else:
                # Kept: every unit of the stage gathered from the step's first forward to its reduction,
                # the last of which runs (a block's padded gradient copy) while they still are.
                layer = summary.layer_tp / tp + summary.layer_rep + summary.layer_experts / (r.expert_tp * ep)
                buffers += n_local * by["param"] + min(n_local, layer) * by["grad"]
        elif z == 0:
            # meshlm's DP (parallel/data.py) copies every gradient into a flat per-bucket buffer for the
            # all-reduce: one extra copy of all gradients, whatever the bucket size.
            buffers += (dense_params + expert_params) * by["grad"]
        elif z < 3:
            buffers += 2 * lo.bucket_size_mb * MiB
        elif z == 3:
            layer_full = (summary.layer_tp / tp + summary.layer_rep + summary.layer_experts / (r.expert_tp * ep))
            # FSDP's reshard_after_forward: two layers gathered (prefetch), or the stage's whole weights
            gathered = ZERO3_PREFETCH_LAYERS * layer_full if lo.zero3_reshards else n_local
            buffers += gathered * by["param"] + layer_full * by["grad"]
    if ep > 1:
        buffers += 2 * tokens_mb * cfg.num_experts_per_token * h * by["act"] / (tp if sp else 1)
    if pp > 1:
        buffers += 4 * act_msg / (tp if sp else 1)
    mem["comm_buffers"] = buffers
    allocated = sum(mem.values())
    mem["fragmentation"] = FRAGMENTATION * allocated
    mem["reserved"] = cluster_reserved
    return mem


def memory_measures(gib: dict) -> dict:
    """`memory_bytes`' total (by component, any unit) as the tools that measure a GPU's memory report it:
    "allocated" (torch.cuda.max_memory_allocated: the live tensors), "reserved" (max_memory_reserved: those with
    the caching allocator's fragmentation), "device" (nvidia-smi / NVML's used memory: all of it, with the CUDA
    context and the communication library's buffers, the cluster's reserved bytes). Published runs print one of
    these (`published_rows.memory_of`): each is compared with its own."""
    allocated = gib["total"] - gib["fragmentation"] - gib["reserved"]
    return {"allocated": allocated, "reserved": allocated + gib["fragmentation"], "device": gib["total"]}
