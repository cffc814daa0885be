"""meshlm.planner: predict memory and step time of parallel layouts on a cluster, pick one, explain it.

Works from configs and model dimensions only (no torch needed except for `calibrate`); exact parameter
counts and matmul FLOPs of our model (and the FLOP convention) are `meshlm.models.stats`, beside the model.

  cluster      GPU/cluster presets (a100, h100, h200, b200, gb200-nvl72) and `local` from calibration
  cost         Job, Layout, placement, collective and pipeline-bubble formulas, `Estimate`
  search       layout enumeration, pruning, ranking
  explain      why the winner wins and what bounds it
  serving*     serving: one deployment's memory, KV capacity, iterations, batching modes, engines
  plot         PNG of the top layouts' memory and time breakdowns
  calibrate    measure this machine (matmul FLOP/s, gloo collectives)
  inputs       sizes (4M), amounts (15T), a model spec, a Job, from what a user types
  published    the planner against published training runs (benchmarks/data/), each with its own layout
  published_rows  what a published row's cells say (model, cluster, stack, ZeRO stage, precision, schedule)

Python API: `estimate(...)` (one layout) and `plan(...)` (search) below.
"""

from __future__ import annotations

from pathlib import Path

from meshlm.config import ModelConfig
from meshlm.planner.cluster import PRESETS, Cluster, get_cluster
from meshlm.planner.cost import Estimate, Job, Layout, parse_layout, pipeline_bubble
from meshlm.planner.search import SearchResult
from meshlm.values import is_integer

__all__ = ["estimate", "plan", "Estimate", "Job", "Layout", "Cluster", "PRESETS", "SearchResult",
           "get_cluster", "pipeline_bubble"]


def _inputs(model, cluster, *, seq_len, global_batch_size, global_batch_tokens, precision, calibration,
            runtime="megatron", gpus=None):
    """(ModelConfig, Cluster, Job) of the public functions' arguments, their kinds checked (`gpus`: where given)."""
    from meshlm.planner.inputs import make_job, resolve_model

    if not isinstance(model, (str, Path, ModelConfig)):
        raise ValueError(f"model must be a preset name, a config.json path or a ModelConfig, not "
                         f"{type(model).__name__}")
    for name, value in [("seq_len", seq_len)] + ([] if gpus is None else [("gpus", gpus)]):
        if not is_integer(value):
            raise ValueError(f"{name}={value!r} must be a whole number")
    cfg = model if isinstance(model, ModelConfig) else resolve_model(str(model))
    clu = cluster if isinstance(cluster, Cluster) else get_cluster(cluster, calibration=calibration)
    job = make_job(seq_len=seq_len, global_batch_size=global_batch_size, global_batch_tokens=global_batch_tokens,
                   precision=precision, runtime=runtime)
    return cfg, clu, job


def estimate(model: str | ModelConfig, cluster: str | Cluster, *, gpus: int, layout: str | dict | Layout,
             seq_len: int = 8192, global_batch_size: int | None = None, global_batch_tokens: int | str | None = None,
             precision: str = "bf16", calibration: str | None = None, runtime: str = "megatron") -> Estimate:
    """Estimate one layout. `layout` is `"tp=8,pp=4,..."`, a dict of the same keys, or a `Layout`.
    `runtime="meshlm"` (with precision="fp32") follows meshlm's own runtime's accounting (cost.RUNTIMES).

    The returned `Estimate` has fits, memory_gib (by component and total), time_s (by component and
    step), mfu, hfu, tokens_per_s, tflops_per_gpu, hw_tflops_per_gpu.
    """
    from meshlm.planner import cost

    cfg, clu, job = _inputs(model, cluster, gpus=gpus, seq_len=seq_len, global_batch_size=global_batch_size,
                            global_batch_tokens=global_batch_tokens, precision=precision, calibration=calibration,
                            runtime=runtime)
    if not isinstance(layout, (str, dict, Layout)):
        raise ValueError(f"layout must be 'tp=8,pp=4,...', a dict of those keys or a Layout, not "
                         f"{type(layout).__name__}")
    if isinstance(layout, str):
        layout = parse_layout(layout, gpus=gpus)
    elif isinstance(layout, dict):
        layout = parse_layout(",".join(f"{k}={v}" for k, v in layout.items()), gpus=gpus)
    return cost.estimate(cfg, clu, job, layout, gpus=gpus)


def plan(model: str | ModelConfig, cluster: str | Cluster, *, gpus: int, seq_len: int = 8192,
         global_batch_size: int | None = None, global_batch_tokens: int | str | None = None,
         precision: str = "bf16", top: int = 10, calibration: str | None = None) -> SearchResult:
    """Search all layouts; `result.ranked` holds the fitting ones, fastest first (the `top` fastest; 0: all)."""
    from meshlm.planner.search import search

    if not is_integer(top) or top < 0:
        raise ValueError(f"top={top!r} must be a whole number >= 0 (the layouts to keep; 0: all that fit)")
    cfg, clu, job = _inputs(model, cluster, gpus=gpus, seq_len=seq_len, global_batch_size=global_batch_size,
                            global_batch_tokens=global_batch_tokens, precision=precision, calibration=calibration)
    return search(cfg, clu, job, gpus=gpus, top=top)
