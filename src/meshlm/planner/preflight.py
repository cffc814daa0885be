"""`meshlm train`'s memory check, before any rank starts: the planner's bytes per rank for the run's own config
(model, layout, batch, precision -- the layout the runtime will build, priced as `meshlm plan estimate --runtime
meshlm` prices it) against the memory each rank has: its GPU's, or on a CPU this host's memory shared by the
ranks that run on it.

The host's memory is its total (`/proc/meminfo`'s MemTotal, or a smaller cgroup limit), not what is free right
now: ranks that start together would otherwise see each other's allocations and disagree. A run the
prediction says cannot fit is refused with the parts of the count and the fixes; `--no-memory-check` starts it
anyway (the prediction is a model: within ~10% of measured on the published runs, README's memory table).

Responsible for: the planner's inputs from a `Config` (`train_job_and_layout`), the prediction per rank
(`rank_memory_bytes`), what each rank has (`memory_per_rank`; the host's from `host_memory.host_memory_bytes`) and
the verdict (`check_train_memory`).
Not responsible for: the memory model (memory.py, cost.py) or measuring memory while training (train/metrics.py).
"""

from __future__ import annotations

import dataclasses
import os

from meshlm.config import Config

GiB = 2**30
# what the prediction lists, in the message's order (cost.Estimate.memory_gib's keys)
PARTS = ("weights", "gradients", "optimizer", "activations", "comm_buffers", "fragmentation", "reserved")


def train_job_and_layout(cfg: Config, world: int, *, device: str):
    """The planner's `Job` and `Layout` of `meshlm train` with `cfg` on `world` ranks of `device` ("cpu" or
    "cuda"): the degrees as `check_layout` resolves them, the per-rank micro-batch as the trainer derives it,
    fp32 master weights with bf16 autocast where train.precision asks for it (`train.setup.resolve_precision`)."""
    from meshlm.parallel.parallelize import check_layout, micro_batch_size
    from meshlm.planner.cost import Job
    from meshlm.planner.layout import Layout

    dims = check_layout(cfg, world)
    p, t = cfg.parallel, cfg.train
    bf16 = t.precision == "bf16" or (t.precision == "auto" and device == "cuda")
    job = Job(seq_len=t.seq_len, global_batch_size=t.global_batch_size, precision="bf16" if bf16 else "fp32",
              runtime="meshlm")
    layout = Layout(dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, cp=dims.cp,
                    ep=dims.ep, cp_method=p.cp_method, cp_ulysses=p.cp_ulysses, zero_stage=p.zero_stage,
                    zero3_reshard_after_forward=p.zero3_reshard_after_forward, pp_schedule=p.pp_schedule,
                    pp_chunks=p.pp_chunks, num_microbatches=p.num_microbatches,
                    micro_batch_size=micro_batch_size(cfg, dims.dp), sequence_parallel=p.sequence_parallel,
                    recompute=p.recompute, bucket_size_mb=p.bucket_size_mb)
    return job, layout


def rank_memory_bytes(cfg: Config, world: int, *, device: str) -> dict:
    """The planner's bytes per rank by part (`PARTS`) and "total", for the busiest rank. train.precision=fp64 (parity
    proofs: parameters, gradients, optimizer state and activations all in float64) is the fp32 count doubled."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.cost import estimate

    job, layout = train_job_and_layout(cfg, world, device=device)
    # only the reserve and the capacity of the cluster enter the memory count; a CPU keeps no CUDA context
    cluster = get_cluster("h100") if device == "cuda" else dataclasses.replace(get_cluster("h100"), reserved_bytes=0.0)
    gib = estimate(cfg.model, cluster, job, layout, gpus=world).memory_gib
    scale = 2 if cfg.train.precision == "fp64" else 1
    out = {k: gib.get(k, 0.0) * GiB * scale for k in PARTS}
    out["total"] = sum(out.values())
    return out


def memory_per_rank(device: str, ranks_here: int) -> tuple[int | None, str]:
    """(bytes each rank has, what they are): a GPU's whole memory, or the host's divided by its ranks."""
    if device == "cuda":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        return torch.cuda.get_device_properties(index).total_memory, "its GPU's memory"
    from meshlm import host_memory

    total = host_memory.host_memory_bytes()
    if total is None:
        return None, "unknown"
    return total // ranks_here, (f"this host's {total / GiB:.1f} GiB / {ranks_here} ranks" if ranks_here > 1 else
                                 f"this host's {total / GiB:.1f} GiB")


def params_lower_bound(cfg: Config) -> int:
    """At least the model's parameters, in O(1): its layers at the smallest kind's count (dense or MoE; the kinds
    repeat after model.first_dense_layers) and its input embedding -- the planner's own count walks every layer, so a
    model of a billion layers is refused from this one before it is summed."""
    from meshlm.models.stats import layer_params

    m = cfg.model
    kinds = [i for i in {0, m.first_dense_layers, m.first_dense_layers + 1} if 0 <= i < m.num_layers]
    sizes = [layer_params(m, i) for i in kinds]
    smallest = min(p.attention + p.mlp + p.experts + p.replicated for p in sizes)
    return m.num_layers * smallest + m.vocab_size * m.hidden_size


def check_train_memory(cfg: Config, world: int, *, ranks_here: int) -> str:
    """One line on what each rank is predicted to hold of what it has, or a ValueError naming the prediction, its
    parts, the memory and the fixes when it cannot fit. `ranks_here`: the ranks sharing this host's memory."""
    from meshlm.train.setup import resolve_device

    device = resolve_device(cfg.train.device).type
    have, what = memory_per_rank(device, ranks_here)
    gib = lambda b: f"{b / GiB:,.2f} GiB" if b < 1024 * GiB else f"{b / 1024**4:,.1f} TiB"  # noqa: E731
    fixes = ("make the model or the micro-batch smaller (model.*, train.micro_batch_size, train.seq_len), shard it "
             "(parallel.zero_stage, parallel.tp, parallel.pp) or add ranks; `meshlm plan estimate --runtime meshlm` "
             "breaks it down; --no-memory-check starts it anyway")
    # fp32 weights, gradients and AdamW's two moments (fp64: twice), split at best over every rank
    params = params_lower_bound(cfg)
    floor = params * 16 * (2 if cfg.train.precision == "fp64" else 1) / world
    if have is not None and floor > have:
        raise ValueError(f"this run needs at least {gib(floor)} per rank (its {params:,} or more "
                         f"parameters' weights, gradients and AdamW state, split over all {world} ranks) and each "
                         f"rank has {gib(have)} ({what}): {fixes}")
    need = rank_memory_bytes(cfg, world, device=device)
    parts = ", ".join(f"{k.replace('_', ' ')} {gib(need[k])}" for k in PARTS if need[k] > 0)
    if have is None:
        return f"memory: {gib(need['total'])} per rank predicted ({parts}); this host's memory is unknown"
    if need["total"] > have:
        raise ValueError(f"this run needs about {gib(need['total'])} per rank ({parts}) by the planner's count, and "
                         f"each rank has {gib(have)} ({what}): {fixes}")
    return f"memory: {gib(need['total'])} per rank predicted ({parts}) of {gib(have)} ({what})"
