"""What one serving iteration sends between GPUs: the tensor-, context-, expert- and pipeline-parallel collectives of
a micro-step (`step_comm`), a driver rank's own messages (`driver_comm`), and the bytes of what they carry.

Responsible for: those seconds, keyed by kind and by the link they ride (scale-up or scale-out), each from
`collectives.py`'s pricing of the collective on the cluster -- the terms serving.py's module docstring lists for tp,
cp, ep and pp.
Not responsible for: when they overlap compute (serving.py's `_micro_step`, `serving_engine.overlapped_half`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshlm.planner.cluster import Cluster
from meshlm.planner.collectives import collective_time, expert_all_to_all, group_span
from meshlm.planner.mla import router_groups
from meshlm.planner.serving_model import WEIGHT_BYTES

if TYPE_CHECKING:  # serving.py imports this module: the deployment's type only for annotations
    from meshlm.planner.serving import Serving


def act_bytes(sv: Serving) -> float:
    """Bytes of an activation element: 16-bit, or 4 where the model is served in fp32."""
    return 4.0 if sv.precision == "fp32" else 2.0


def dispatch_bytes(sv: Serving) -> float:
    """Bytes per hidden element an expert dispatch sends: the weights' bytes, at most 16 bits (the combine
    returns bf16)."""
    return min(2.0, WEIGHT_BYTES[sv.precision])


def _tier(span: tuple[int, int]) -> str:
    return "scale-out link" if span[1] > 1 else "scale-up link"


def step_comm(sv: Serving, *, d: float, p: float, cl: Cluster | None = None) -> dict:
    """Seconds of communication per micro-step, keyed (kind, tier); `cl`: the cluster as one rank sees it
    (`_host_shared`; default `sv.cluster`)."""
    lo, cl, cfg = sv.layout, cl or sv.cluster, sv.sm.cfg
    layers, h, out = sv.sm.layers / lo.pp, cfg.hidden_size, {}
    q = d * (1 + sv.mtp_tokens)
    tokens = q + p / lo.cp
    if lo.tp > 1:
        span = group_span(1, lo.tp, cl.scaleup_size)
        # two per layer (Megatron), and the vocab-parallel embedding's sum (on the stage holding it)
        out[("tp", _tier(span))] = (2 * layers + 1) * collective_time("all_reduce", tokens * h * act_bytes(sv), span,
                                                                      cl)
    if lo.cp > 1 and d > 0:
        span = group_span(lo.tp, lo.cp, cl.scaleup_size)
        partial = q * (cfg.num_heads / lo.tp) * (cfg.head_dim + 1) * 4  # fp32 partial outputs + log-sum-exp
        per_layer = collective_time("all_gather", partial, span, cl)
        if sv.engine.cp_decode_on_owner:  # the owners' decode queries, gathered for every rank's KV shard
            per_layer += collective_time("all_gather", q * (cfg.num_heads / lo.tp) * cfg.head_dim * act_bytes(sv),
                                         span, cl)
        out[("cp", _tier(span))] = layers * per_layer
    if lo.ep > 1:
        if sv.engine.ep_all_to_all == "allgather":
            # every dp rank's tokens gathered to every rank, the experts' outputs reduce-scattered back (vLLM's
            # AgRsAll2AllManager, over the dp group): the same bytes whatever the routing, so no rank waits on an
            # excess; with one dp rank every rank holds the tokens and the tp all-reduce sums the experts' outputs
            if lo.dp > 1:
                span = group_span(lo.tp * lo.cp, lo.dp, cl.scaleup_size)
                everyone = lo.dp * tokens * h
                call = (collective_time("all_gather", everyone * dispatch_bytes(sv), span, cl)
                        + collective_time("reduce_scatter", everyone * 2.0, span, cl))
                out[("ep", _tier(span))] = sv.sm.moe_layers() / lo.pp * call
        else:
            span = group_span(1, lo.stage, cl.scaleup_size)
            per_token = h * (dispatch_bytes(sv) + 2.0)  # dispatch + combine (bf16)
            call = expert_all_to_all(tokens * per_token, top_k=cfg.num_experts_per_token, span=span,
                                     up=cl.collective_fit("all_to_all", "scale-up"), groups=router_groups(cfg),
                                     out=cl.collective_fit("all_to_all", "scale-out"),
                                     low_latency=p == 0 and sv.engine.ep_all_to_all == "deepep")
            # the busiest rank receives (and sends back) its experts' excess tokens (TensorRT-LLM tech blog 4)
            out[("ep", _tier(span))] = sv.sm.moe_layers() / lo.pp * call * sv.expert_imbalance()
    if lo.pp > 1:
        span = group_span(lo.stage, 2, cl.scaleup_size)
        out[("pp", _tier(span))] = collective_time("p2p", tokens * h * act_bytes(sv), span, cl)
    return out


def driver_comm(sv: Serving, cl: Cluster, *, sampled: float) -> float:
    """Seconds per step of a driver-rank engine's own messages (`Engine.driver_broadcast`): the step's input
    sent over cp, then tp (two broadcasts each of a small message, its `sampled` int64 token ids: a tree of log2 n
    p2p hops); the tp ranks' vocabulary slices of the `sampled` rows' logits all-gathered; under cp those rows'
    hidden states all-reduced."""
    lo, cfg = sv.layout, sv.sm.cfg
    out = 0.0
    for size, stride in ((lo.cp, lo.tp), (lo.tp, 1)):
        if size > 1:
            span = group_span(stride, size, cl.scaleup_size)
            out += 2 * math.ceil(math.log2(size)) * collective_time("p2p", sampled * 8, span, cl)
    if lo.tp > 1:
        out += collective_time("all_gather", sampled * cfg.vocab_size * 4, group_span(1, lo.tp, cl.scaleup_size), cl)
    if lo.cp > 1:
        out += collective_time("all_reduce", sampled * cfg.hidden_size * act_bytes(sv),
                               group_span(lo.tp, lo.cp, cl.scaleup_size), cl)
    return out
