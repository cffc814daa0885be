"""The million-token question: the smallest deployment that holds one long context, the per-token latency it
gets, and where adding GPUs stops paying.

Responsible for: `best_layout` (among the tp x pp x cp layouts of a GPU count that hold the sequence, the one with
the lowest TPOT), `smallest_deployment`, `tpot_curve` (the best TPOT as GPUs double), `stops_paying`,
`context_answer` (the JSON of `meshlm plan context`), `format_context` (its words) and `memory_curve` (weights +
KV per GPU against context length, for the plot).
Not responsible for: memory or time of an iteration (`serving.py`) or drawing (`plot.py`).

One sequence of `context` prompt tokens plus `output_len` generated ones (dp = 1; experts, if any, split by tp):
  * tp (inside a scale-up domain, dividing the heads) splits weights and KV heads (replicating KV heads past
    their count), pp splits layers (one sequence runs its stages one after another), cp splits the sequence
    (each cp rank keeps every weight of its stage; decode merges partial attention per layer);
  * it fits when the KV capacity of the tp x pp x cp GPUs holds context + output_len tokens (`Serving.max_tokens`);
  * TPOT: one decode step over context + output_len / 2 cached tokens; TTFT: the whole prompt in one prefill;
  * the KV spans the scale-up domains (nodes) the tp x cp x pp GPUs occupy, tp innermost;
  * adding GPUs stops paying at the first count whose doubling lowers the TPOT by less than STOP_GAIN.
"""

from __future__ import annotations

import math
from dataclasses import replace

from meshlm.planner.cluster import GiB, Cluster
from meshlm.planner.collectives import group_span
from meshlm.planner.serving import Serving, iteration_time
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_model import KV_BYTES, ServedModel

# A doubling of the GPUs "pays" when it cuts the TPOT by at least this fraction.
STOP_GAIN = 0.10


def _layouts(sm: ServedModel, cluster: Cluster, gpus: int, tokens: int):
    """The tp x pp x cp layouts of `gpus` GPUs: tp within a scale-up domain dividing the heads, pp at most a stage a
    layer, cp at most a cp rank a token of the sequence's `tokens`."""
    for tp in (t for t in range(1, min(gpus, cluster.scaleup_size) + 1)
               if gpus % t == 0 and sm.cfg.num_heads % t == 0):
        for pp in (p for p in range(1, min(gpus // tp, sm.layers) + 1) if (gpus // tp) % p == 0):
            if gpus // (tp * pp) <= tokens:
                yield ServingLayout(tp=tp, pp=pp, cp=gpus // (tp * pp))


def _point(sv: Serving, context: int, output_len: int) -> dict:
    it = iteration_time(sv, decodes=1, kv_len=context + output_len / 2)
    mem = sv.memory()
    kv = sv.kv_bytes_per_gpu(context + output_len)
    world = sv.layout.world
    return {"gpus": world, "layout": sv.layout.label(), "tpot_ms": it["total"] * 1e3, "bound": it["bound"],
            "nodes": group_span(1, world, sv.cluster.scaleup_size)[1], "weights_gib_per_gpu": mem["weights"] / GiB,
            "kv_gib_per_gpu": kv / GiB, "kv_capacity_gib_per_gpu": mem["kv_capacity"] / GiB}


def best_layout(sv: Serving, gpus: int, context: int, output_len: int) -> dict | None:
    """The lowest-TPOT tp x pp x cp layout of `gpus` GPUs that holds the sequence, or None."""
    best = None
    for lo in _layouts(sv.sm, sv.cluster, gpus, context + output_len):
        cand = replace(sv, layout=lo)
        if cand.max_tokens() < context + output_len:
            continue
        point = _point(cand, context, output_len)
        if best is None or point["tpot_ms"] < best["tpot_ms"]:
            best = point
    return best


def _lower_bound(sv: Serving, context: int, output_len: int) -> int:
    """No fewer GPUs can hold the weights and the sequence's KV (capacity before the workspace)."""
    usable = sv.cluster.hbm_bytes - sv.cluster.reserved_bytes
    need = sv.sm.params()["total"] * sv.memory()["weights"] / max(1.0, sum(sv.weight_bytes_per_gpu().values()))
    need += sv.sm.kv_bytes(context + output_len, KV_BYTES[sv.kv_precision])
    return max(1, int(need // usable))


def smallest_deployment(sv: Serving, context: int, output_len: int, *, max_gpus: int) -> dict | None:
    for gpus in range(_lower_bound(sv, context, output_len), max_gpus + 1):
        best = best_layout(sv, gpus, context, output_len)
        if best is not None:
            return best
    return None


def tpot_curve(sv: Serving, context: int, output_len: int, *, start: int, max_gpus: int) -> list[dict]:
    """The best layout at start, 2 start, 4 start, ... GPUs (up to max_gpus)."""
    out, gpus = [], start
    while gpus <= max_gpus:
        point = best_layout(sv, gpus, context, output_len)
        if point is not None:
            out.append(point)
        gpus *= 2
    return out


def stops_paying(curve: list[dict]) -> dict | None:
    """The first point of `curve` whose doubling gains less than STOP_GAIN of its TPOT (the last if all pay)."""
    for here, there in zip(curve, curve[1:]):
        if there["tpot_ms"] > (1 - STOP_GAIN) * here["tpot_ms"]:
            return here
    return curve[-1] if curve else None


def context_answer(sv: Serving, context: int, output_len: int, *, max_gpus: int = 4096) -> dict:
    """The JSON of `meshlm plan context` (README lists the keys)."""
    out = {"context_tokens": context, "output_len": output_len, "cluster": sv.cluster.name,
           "precision": sv.precision, "kv_precision": sv.kv_precision,
           "kv_bytes_per_token_model": sv.sm.kv_bytes_per_token(KV_BYTES[sv.kv_precision]),
           "model_context_tokens": sv.sm.cfg.max_seq_len, "context_note": sv.sm.context_note(context + output_len)}
    small = smallest_deployment(sv, context, output_len, max_gpus=max_gpus)
    if small is None:
        return dict(out, fits=False, reason=f"no tp x pp x cp layout of up to {max_gpus} GPUs holds {context:,} + "
                                            f"{output_len} tokens; raise --max-gpus or use --kv-precision fp8")
    prefill = iteration_time(replace(sv, layout=_layout(small["layout"])), decodes=0, kv_len=0, prefill_tokens=context,
                             prefill_ctx=context / 2)
    curve = tpot_curve(sv, context, output_len, start=small["gpus"], max_gpus=max_gpus)
    return dict(out, fits=True, **small, ttft_s=prefill["total"], curve=curve, stops_paying=stops_paying(curve))


def memory_curve(sv: Serving, contexts: list[int]) -> list[dict]:
    """Weights and KV (one sequence) per GPU of `sv`'s layout at each context length, GiB."""
    weights = sum(sv.weight_bytes_per_gpu().values())
    usable = sv.memory()["kv_capacity"] + weights
    return [{"context": n, "weights_gib": weights / GiB, "kv_gib": sv.kv_bytes_per_gpu(n) / GiB,
             "usable_gib": usable / GiB}
            for n in contexts]


def plot_variants(sv: Serving, context: int, output_len: int, *, max_gpus: int) -> dict:
    """{label: (answer, memory points)} for scale-up domains of 8 and of 72 GPUs (NVL72) on `sv`'s GPUs: what the
    plot compares (a domain size the cluster does not have is a what-if of the same GPUs and links)."""
    out = {}
    for size, label in ((8, "scale-up domain of 8"), (72, "scale-up domain of 72 (NVL72)")):
        variant = replace(sv, cluster=replace(sv.cluster, scaleup_size=size))
        answer = context_answer(variant, context, output_len, max_gpus=max_gpus)
        memory = []
        if answer["fits"]:
            memory = memory_curve(replace(variant, layout=_layout(answer["layout"])), log2_contexts(context))
        out[label] = (answer, memory)
    return out


def _layout(label: str) -> ServingLayout:
    return ServingLayout(**{k: int(v) for k, v in (kv.split("=") for kv in label.split(","))})


def format_context(r: dict, model: str) -> str:
    head = (f"{model}, one sequence of {r['context_tokens']:,} + {r['output_len']} tokens on {r['cluster']} "
            f"({r['precision']} weights, {r['kv_precision']} KV: {r['kv_bytes_per_token_model'] / 1024:.0f} KiB "
            f"of KV per token)")
    if r["context_note"]:
        head += f"\n  {r['context_note']}"
    if not r["fits"]:
        return f"{head}\n  does not fit: {r['reason']}"
    lines = [head, f"  smallest deployment: {r['gpus']} GPUs ({r['layout']}), the KV spans {r['nodes']} "
                   f"node(s) / scale-up domain(s); per GPU {r['weights_gib_per_gpu']:.1f} GiB weights + "
                   f"{r['kv_gib_per_gpu']:.1f} GiB KV",
             f"  TPOT {r['tpot_ms']:.1f} ms (bound: {r['bound']}), TTFT {r['ttft_s']:.1f} s (the whole prompt)",
             "  GPUs   layout                     nodes   TPOT ms  bound"]
    lines += [f"  {p['gpus']:>5}  {p['layout']:<26} {p['nodes']:>5} {p['tpot_ms']:>9.2f}  {p['bound']}"
              for p in r["curve"]]
    stop = r["stops_paying"]
    if stop is r["curve"][-1]:
        lines.append(f"  every doubling up to {stop['gpus']} GPUs still cuts the TPOT by {STOP_GAIN:.0%} or more")
    elif stop:
        lines.append(f"  adding GPUs stops paying at {stop['gpus']} GPUs ({stop['tpot_ms']:.2f} ms): doubling from "
                     f"there cuts the TPOT by less than {STOP_GAIN:.0%}")
    return "\n".join(lines)


def log2_contexts(context: int) -> list[int]:
    """Context lengths for the plot: powers of two from 4K to twice `context`."""
    top = max(12, math.ceil(math.log2(max(context, 2))) + 1)
    return [2**k for k in range(12, top + 1)]
