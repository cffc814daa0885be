"""Layout search: enumerate valid layouts for a model on a cluster, estimate each, rank those that fit.

Responsible for: the candidate space and its pruning, and the ranked result (plus the best layout of
each (tp, pp) class, which `explain.py` uses to say why the winner wins).
Not responsible for: the cost formulas (`cost.py`) or the wording (`explain.py`).

Pruning (each rule only drops layouts the cost model can never rank higher):
  * tensor parallelism stays inside one scale-up domain (a tp group across the network is never
    competitive: it moves 4-6 activation-sized collectives per layer), and must divide the heads, kv
    heads, vocabulary and intermediate size (as `cost.validate_layout` and the runtime require);
  * sequence parallelism is always on with tp > 1 (same bytes as plain all-reduces, less memory);
  * GPipe is skipped: 1F1B has the same bubble with fewer microbatches in flight;
  * recomputation: for each layout the cheapest policy that fits is kept (none < selective < full
    in time, the reverse in memory); if none fits, `full` is kept as the closest miss. Only the memory of
    the others is priced (`cost.layout_memory`), the time of the one kept;
  * context parallelism only while each rank keeps >= 1024 tokens of the sequence; every method
    (ring, all-gather, and Ulysses where cp divides a tp rank's heads) is tried for each cp > 1;
  * hybrid sharding (dp_replicate > 1) only with ZeRO-3, with power-of-two shard groups.

Speed: what every layout shares is set up once (`placement.world_setup`), and it remembers the answers
layouts ask again and again: collective times, group placements, and one microbatch's time, which layouts
that differ only in their data parallelism share (`cost.MICROBATCH_FREE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshlm.config import ModelConfig
from meshlm.planner.cluster import Cluster
from meshlm.planner.cost import (CP_METHODS, Estimate, Job, Layout, ModelSummary, estimate_layout, layout_memory,
                                 world_setup)
from meshlm.planner.layout import validate_layout

MICRO_BATCH_SIZES = (1, 2, 4, 8)
PP_CHUNKS = (2, 3, 4, 5, 6, 8)


@dataclass
class SearchResult:
    ranked: list[Estimate]  # fitting layouts, fastest first
    evaluated: int
    num_fit: int
    closest_miss: Estimate | None  # the smallest-memory layout when nothing fits
    best_by_class: dict = field(default_factory=dict)  # (tp, pp) -> best Estimate (fitting preferred)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) steps (a search over --gpus 10^9 must not count to 10^9)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def candidate_layouts(cfg: ModelConfig, cluster: Cluster, job: Job, gpus: int):
    """Yield (layout without recompute choice, num_microbatches) for every valid pruned layout."""
    L = cfg.num_layers
    tps = [t for t in divisors(gpus) if t <= cluster.scaleup_size and cfg.num_heads % t == 0
           and cfg.num_kv_heads % t == 0 and cfg.vocab_size % t == 0 and cfg.intermediate_size % t == 0
           and (job.seq_len % t == 0)]
    for tp in tps:
        for cp in _pow2_upto(gpus // tp):
            if gpus % (tp * cp) or (cp > 1 and (job.seq_len % (2 * cp) or job.seq_len // cp < 1024)):
                continue
            if cp > 1 and (job.seq_len // cp) % tp:
                continue
            rest = gpus // (tp * cp)
            # (cp_method, cp_ulysses): each method, and the hybrid -- Ulysses within groups of u ranks, the ring
            # across them -- for every u strictly between 1 and cp (what does not split the heads is refused below)
            cp_methods = [(m, 1) for m in CP_METHODS] + [("ring", u) for u in divisors(cp) if 1 < u < cp]
            if cp == 1:
                cp_methods = [("ring", 1)]  # the method only matters when cp > 1
            for pp in divisors(rest):
                if pp > L:
                    break
                dp = rest // pp
                for mbs in MICRO_BATCH_SIZES:
                    if job.global_batch_size % (dp * mbs):
                        continue
                    m = job.global_batch_size // (dp * mbs)
                    scheds = [("1f1b", 1)]
                    if pp > 1:
                        scheds.append(("zero_bubble", 1))
                        scheds += [("interleaved", v) for v in PP_CHUNKS if pp * v <= L and m % pp == 0]
                    dp_splits = [(1, 1, 0)] if dp == 1 else (
                        [(1, dp, z) for z in (0, 1, 2, 3)]
                        + [(dp // s, s, 3) for s in _pow2_upto(dp // 2) if s > 1 and dp % s == 0])
                    eps = [1]
                    if cfg.is_moe:
                        eps = [e for e in _pow2_upto(cfg.num_experts) if cfg.num_experts % e == 0]
                    for sched, v in scheds:
                        for dpr, dps, z in dp_splits:
                            for ep in eps:
                                if (dps * cp) % ep:
                                    continue
                                # ZeRO-3: units resharded after each forward, or kept for the step
                                for reshard in ((True, False) if z == 3 else (None,)):
                                    for method, ulysses in cp_methods:
                                        lo = Layout(dp_replicate=dpr, dp_shard=dps, tp=tp, pp=pp, cp=cp,
                                                    cp_method=method, cp_ulysses=ulysses, ep=ep, zero_stage=z,
                                                    pp_schedule=sched, pp_chunks=v, micro_batch_size=mbs,
                                                    sequence_parallel=tp > 1, zero3_reshard_after_forward=reshard)
                                        try:  # the runtime's own refusals (`meshlm.rules`): never propose those
                                            validate_layout(cfg, job, lo, gpus=gpus)
                                        except ValueError:
                                            continue
                                        yield lo, m


def search(cfg: ModelConfig, cluster: Cluster, job: Job, *, gpus: int, top: int = 10) -> SearchResult:
    """Estimate every candidate layout and rank the ones that fit by step time."""
    job.validate()
    cluster.check_trains_in(job.precision)
    cfg.validate()
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be >= 1")
    summary = ModelSummary.for_job(cfg, job)
    world = world_setup(summary, cluster, job, gpus)  # rates and remembered answers, shared by every layout
    fitting: list[Estimate] = []
    closest: Estimate | None = None
    best_by_class: dict = {}
    evaluated = 0
    for base, m in candidate_layouts(cfg, cluster, job, gpus):
        for rc in ("none", "selective", "full"):  # the first that fits; the time is priced for that one only
            lo = base if rc == base.recompute else replace(base, recompute=rc)
            memory = layout_memory(summary, cluster, job, lo, num_microbatches=m, world=world)
            evaluated += 1
            if memory.fits:
                break
        chosen = estimate_layout(summary, cluster, job, lo, num_microbatches=m, world=world, memory=memory)
        if chosen.fits:
            fitting.append(chosen)
        elif closest is None or chosen.memory_gib["total"] < closest.memory_gib["total"]:
            closest = chosen
        key = (base.tp, base.pp)
        cur = best_by_class.get(key)
        if cur is None or (chosen.fits, -chosen.time_s["step"]) > (cur.fits, -cur.time_s["step"]) or (
                not chosen.fits and not cur.fits and chosen.memory_gib["total"] < cur.memory_gib["total"]):
            best_by_class[key] = chosen
    if evaluated == 0:
        raise ValueError(f"no valid layout for {gpus} GPUs with global batch {job.global_batch_size} sequences "
                         f"of {job.seq_len} tokens: the batch must be divisible by the data-parallel degree "
                         "times the micro-batch size; try a batch that is a multiple of the GPU count")
    fitting.sort(key=lambda e: (e.time_s["step"], e.memory_gib["total"]))
    return SearchResult(ranked=fitting[:max(top, 1)] if top else fitting, evaluated=evaluated,
                        num_fit=len(fitting), closest_miss=None if fitting else closest,
                        best_by_class=best_by_class)
