"""Scaling curves: the best layout at each GPU count, and where adding GPUs stops paying.

Responsible for: parsing a GPU-count range (`8:16384` = the powers of two from 8 to 16384, or a list
`8,64,512`), searching the best layout at each count under strong scaling (the global batch fixed) or
weak scaling (the batch per GPU fixed), and the diminishing-returns point: the last count before the
next step up buys less than half its linear share of throughput (or none: a point where adding GPUs
slows the system); each count also carries the job's MTBF, goodput and power (`operations.py`).
Not responsible for: the search or the estimate (`search.py`, `cost.py`), or drawing (`plot.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshlm.config import ModelConfig
from meshlm.planner.cluster import Cluster
from meshlm.planner.cost import Estimate, Job
from meshlm.planner import mla as latent
from meshlm.planner.operations import operations
from meshlm.planner.search import search

COMM_KEYS = ("tp_comm", "cp_comm", "ep_comm", "pp_p2p", "dp_comm")
# "Diminishing returns": the next step up buys less than this fraction of its linear share.
DIMINISHING = 0.5


def parse_gpu_counts(text: str) -> list[int]:
    """`8:16384` -> [8, 16, ..., 16384] (powers of two, ends included); `8,64,512` -> [8, 64, 512]."""
    t = str(text).replace(" ", "")
    try:
        if ":" in t:
            lo, hi = (int(x) for x in t.split(":", 1))
            if lo < 1 or hi < lo:
                raise ValueError
            counts, x = [], lo
            while x < hi:
                counts.append(x)
                x *= 2
            counts.append(hi)
        else:
            counts = sorted({int(x) for x in t.split(",") if x})
    except ValueError:
        raise ValueError(f"--gpus {text!r} must be a range LO:HI (LO doubled up to HI, e.g. 8:16384) "
                         "or a list such as 8,64,512 of counts >= 1") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"--gpus {text!r} must name GPU counts >= 1, e.g. 8:16384")
    return counts


@dataclass
class ScalePoint:
    gpus: int
    global_batch_tokens: int
    fits: bool
    layout: str = ""
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    comm_share: float = 0.0  # communication components / step
    bound: str = ""  # largest non-compute time component
    mtbf_hours: float = 0.0  # of the whole job (operations.failures)
    goodput: float = 0.0  # expected useful fraction with Young/Daly checkpointing
    cluster_mw: float = 0.0  # operations.power
    scaling_efficiency: float = 0.0  # (tokens/s per GPU) / (that of the first fitting count)
    marginal_share: float | None = None  # of the step from the previous count: gain / linear gain

    def to_dict(self) -> dict:
        return asdict(self)


def _point(gpus: int, tokens: int, est: Estimate | None, ops: dict | None) -> ScalePoint:
    if est is None:
        return ScalePoint(gpus=gpus, global_batch_tokens=tokens, fits=False)
    step = est.time_s["step"]
    over = {k: v for k, v in est.time_s.items() if k not in ("compute", "step")}
    return ScalePoint(gpus=gpus, global_batch_tokens=tokens, fits=True, layout=est.layout.short(), step_s=step,
                      tokens_per_s=est.tokens_per_s, mfu=est.mfu,
                      comm_share=sum(est.time_s.get(k, 0.0) for k in COMM_KEYS) / step,
                      bound=max(over, key=over.get), mtbf_hours=ops["failures"]["mtbf_hours"],
                      goodput=ops["failures"]["goodput"], cluster_mw=ops["power"]["cluster_mw"])


def scale_curve(cfg: ModelConfig, cluster: Cluster, *, counts: list[int], seq_len: int, precision: str,
                mode: str, runtime: str = "megatron", global_batch_tokens: int = 0, tokens_per_gpu: int = 0,
                progress=None, **options) -> list[ScalePoint]:
    """The best fitting layout at each count. mode="strong": `global_batch_tokens` at every count;
    "weak": `tokens_per_gpu` x gpus (rounded down to whole sequences). `progress(point)` is called as
    each count is done. `options`: the job's other fields (e.g. ep_dispatcher)."""
    if mode not in ("strong", "weak"):
        raise ValueError(f"scaling mode {mode!r} must be strong or weak")
    total_params = latent.total_params(cfg, runtime)
    points = []
    for n in counts:
        tokens = global_batch_tokens if mode == "strong" else tokens_per_gpu * n
        seqs = tokens // seq_len
        if seqs < 1:
            raise ValueError(f"{tokens} tokens per step at {n} GPUs is less than one sequence of --seq-len "
                             f"{seq_len}; raise --global-batch-tokens / --tokens-per-gpu")
        job = Job(seq_len=seq_len, global_batch_size=seqs, precision=precision, runtime=runtime, **options)
        result = search(cfg, cluster, job, gpus=n, top=1)
        best = result.ranked[0] if result.ranked else None
        ops = None if best is None else operations(best, cluster, total_params=total_params, precision=precision)
        points.append(_point(n, seqs * seq_len, best, ops))
        if progress is not None:
            progress(points[-1])
    _relate(points)
    return points


def _relate(points: list[ScalePoint]) -> None:
    fitting = [p for p in points if p.fits]
    if not fitting:
        return
    base = fitting[0]
    for p in fitting:
        p.scaling_efficiency = (p.tokens_per_s / p.gpus) / (base.tokens_per_s / base.gpus)
    for prev, p in zip(fitting, fitting[1:]):
        linear_gain = prev.tokens_per_s * (p.gpus / prev.gpus - 1)
        p.marginal_share = (p.tokens_per_s - prev.tokens_per_s) / linear_gain


def diminishing_point(points: list[ScalePoint]) -> ScalePoint | None:
    """The last fitting count before the first step up that buys < DIMINISHING of its linear share."""
    fitting = [p for p in points if p.fits]
    for prev, p in zip(fitting, fitting[1:]):
        if p.marginal_share is not None and p.marginal_share < DIMINISHING:
            return prev
    return None


def describe(points: list[ScalePoint], *, mode: str) -> str:
    head = (f"{mode} scaling\n{'GPUs':>6} {'tokens/step':>12} {'layout':<48} {'step s':>8} {'tokens/s':>13} "
            f"{'MFU':>6} {'comm':>5} {'eff':>5} {'marginal':>8} {'MTBF h':>7} {'goodput':>7} {'MW':>6}  bound")
    rows = [head]
    for p in points:
        if not p.fits:
            rows.append(f"{p.gpus:>6} {p.global_batch_tokens:>12,} {'(nothing fits in memory)':<48}")
            continue
        marg = "" if p.marginal_share is None else f"{p.marginal_share:.0%}"
        rows.append(f"{p.gpus:>6} {p.global_batch_tokens:>12,} {p.layout:<48} {p.step_s:>8.3g} "
                    f"{p.tokens_per_s:>13,.0f} {p.mfu:>6.1%} {p.comm_share:>5.0%} {p.scaling_efficiency:>5.0%} "
                    f"{marg:>8} {p.mtbf_hours:>7.3g} {p.goodput:>7.1%} {p.cluster_mw:>6.3g}  {p.bound}")
    point = diminishing_point(points)
    if point is None:
        rows.append(f"No diminishing-returns point in this range: every step up buys >= {DIMINISHING:.0%} of "
                    "its linear share.")
    else:
        nxt = next(p for p in points if p.fits and p.gpus > point.gpus)
        verb = ("slows the system down" if nxt.marginal_share < 0
                else f"buys only {nxt.marginal_share:.0%} of its linear share")
        rows.append(f"Diminishing returns past {point.gpus} GPUs: going to {nxt.gpus} {verb} "
                    f"({point.tokens_per_s:,.0f} -> {nxt.tokens_per_s:,.0f} tokens/s; bound by {nxt.bound}).")
    return "\n".join(rows)
