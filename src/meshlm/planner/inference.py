"""Inference estimates: weight and KV-cache memory, the largest batch, decode and prefill speed.

Responsible for: serving one model replica with tensor parallelism `tp` on a cluster: bytes of
weights and of KV cache per token per GPU, the largest batch that fits at a context length, decode
tokens/s (each step streams the weights and the live KV cache through HBM, or is bound by compute,
plus 2 tensor-parallel all-reduces per layer whose latency does not shrink with batch), and the
time to prefill a prompt.
Not responsible for: scheduling, paging or batching policy (the inference engine's business).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshlm.config import ModelConfig
from meshlm.models import stats as model_stats
from meshlm.planner.cluster import GiB, Cluster
from meshlm.planner.collectives import collective_time, group_span

WORKSPACE_FRACTION = 0.05  # activations and allocator slack during serving, of HBM


@dataclass
class InferenceEstimate:
    tp: int
    weights_gib: float  # per GPU
    kv_bytes_per_token: float  # per GPU, all layers
    max_tokens_in_cache: int  # per replica
    max_batch: int  # sequences of `context_len` that fit
    decode_step_s: float  # at `batch`
    decode_tokens_per_s: float  # whole replica, at `batch`
    decode_bound: str  # hbm | compute | tp-latency
    prefill_s: float  # one prompt of `context_len`
    batch: int
    context_len: int
    fits: bool
    reason: str = ""  # why it does not fit (empty when it fits)

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_inference(cfg: ModelConfig, cluster: Cluster, *, tp: int = 1, context_len: int = 4096,
                       batch: int = 0, precision: str = "bf16") -> InferenceEstimate:
    """`batch=0` uses the largest batch that fits."""
    if tp < 1 or cfg.num_heads % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide num_heads={cfg.num_heads}")
    if context_len < 1:
        raise ValueError(f"context_len={context_len} must be >= 1")
    wbytes = 1 if precision == "fp8" else (4 if precision == "fp32" else 2)
    params = model_stats.count_params(cfg)
    weights = params["total"] * wbytes / tp
    # K and V of every layer; kv heads are split by tp, or replicated when tp exceeds them.
    kv_heads_local = max(1, cfg.num_kv_heads // tp)
    kv_per_token = 2 * cfg.num_layers * kv_heads_local * cfg.head_dim * 2  # bf16 cache
    free = cluster.hbm_bytes * (1 - WORKSPACE_FRACTION) - cluster.reserved_bytes - weights
    max_tokens = max(0, int(free // kv_per_token))
    max_batch = max_tokens // context_len
    b = batch or max(1, max_batch)
    hbm = cluster.hbm_bw * cluster.hbm_efficiency
    # A MoE decode step reads only the experts some token in the batch routes to (uniform routing).
    touched = min(1.0, b * cfg.num_experts_per_token / cfg.num_experts) if cfg.is_moe else 1.0
    active_weights = (params["total"] - params["experts"] * (1 - touched)) * wbytes / tp
    t_mem = (active_weights + b * context_len * kv_per_token) / hbm
    flops = b * model_stats.flops_per_token(cfg, context_len) / tp
    t_compute = flops / (cluster.peak(precision if precision != "fp32" else "bf16") * cluster.matmul_efficiency)
    span = group_span(1, tp, cluster.scaleup_size)
    msg = b * cfg.hidden_size * 2
    t_tp = 2 * cfg.num_layers * collective_time("all_reduce", msg, span, cluster) if tp > 1 else 0.0
    bound = max((("hbm", t_mem), ("compute", t_compute)), key=lambda kv: kv[1])
    step = bound[1] + t_tp
    label = "tp-latency" if t_tp > bound[1] else bound[0]
    prefill_flops = context_len * model_stats.flops_per_token(cfg, context_len) / tp
    prefill = (prefill_flops / (cluster.peak(precision if precision != "fp32" else "bf16") * cluster.matmul_efficiency)
               + (2 * cfg.num_layers * collective_time("all_reduce", context_len * cfg.hidden_size * 2, span, cluster)
                  if tp > 1 else 0.0))
    reason = ""
    if max_batch < 1:
        reason = (f"{weights / GiB:.1f} GiB of weights per GPU leave room for {max_tokens:,} tokens of KV cache, "
                  f"fewer than one sequence of {context_len} tokens; raise --tp, shorten --context-len or use "
                  f"--precision fp8")
    elif b > max_batch:
        reason = f"--batch {b} needs {b * context_len:,} tokens of KV cache; {max_tokens:,} fit (max batch {max_batch})"
    return InferenceEstimate(reason=reason, tp=tp, weights_gib=weights / GiB, kv_bytes_per_token=kv_per_token,
                             max_tokens_in_cache=max_tokens, max_batch=max_batch, decode_step_s=step,
                             decode_tokens_per_s=b / step, decode_bound=label, prefill_s=prefill, batch=b,
                             context_len=context_len, fits=max_batch >= 1 and b <= max_batch)
