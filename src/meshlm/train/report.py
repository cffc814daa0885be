"""What a training run reports of itself: its parameter count and each step's metrics row.

Responsible for: counting the whole model's parameters from any rank's share (tp shards scaled up, a tied
head counted once, the pipeline's stages added up), and the row a step logs -- loss, learning rate,
gradient norm, throughput, MFU, memory, communication per mesh axis, MoE expert load, the pipeline's idle
share -- in the order `metrics.jsonl` has always had its keys.
Not responsible for: writing, printing or sending the rows anywhere (`meshlm.train.metrics`), or
reducing the loss over the ranks (the trainer passes it reduced).
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh
from meshlm.parallel.expert import expert_load_stats
from meshlm.parallel.tied import counted
from meshlm.train.metrics import peak_memory_mib


def count_parameters(model: nn.Module, mesh: Mesh, *, pipeline: bool, device: torch.device) -> int:
    """The whole model's parameters (collective over "pp" when `pipeline`)."""
    # Under tp a sharded parameter holds 1/tp of its elements on this rank: count the whole model.
    # A tied head's copy of the embedding on the last pipeline stage is the same weight: counted once.
    params = counted(model.parameters())
    shards = [getattr(p, "_meshlm_shard", None) for p in params]
    num_params = sum(p.numel() * (mesh.size(shard[0]) if shard is not None else 1)
                     for p, shard in zip(params, shards))
    if pipeline:  # each stage holds its own blocks: add them up
        num_params = int(comm.all_reduce(torch.tensor([num_params], dtype=torch.int64, device=device),
                                         mesh, "pp").item())
    return num_params


def step_row(*, step: int, loss: float, lr: float, grad_norm: float, num_tokens: int, step_time: float,
             flops_per_token: float, peak_tflops: float | None, world_size: int, device: torch.device,
             activation_mib: float | None, comm_stats: dict, data_wait: float = 0.0) -> dict:
    """The metrics row of one optimizer step. `comm_stats`: what the step itself moved, per mesh axis
    (`CommStats.summary()`, taken before any reduction made only for logging); `data_wait`: seconds the
    step waited for its data (`data_wait_s`; with prepared data, read a step ahead, near 0)."""
    tokens_per_s = num_tokens / step_time
    mfu = (tokens_per_s * flops_per_token / (peak_tflops * 1e12 * world_size)
           if peak_tflops else None)  # None: no known peak (CPU without train.peak_tflops)
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "mfu": mfu, "memory_mib": peak_memory_mib(device),
            "activation_mib": activation_mib,
            "step_time_s": step_time, "data_wait_s": data_wait,
            "comm_mb": {axis: v["mb"] for axis, v in comm_stats.items()},
            "comm_s": {axis: v["seconds"] for axis, v in comm_stats.items()}}


def expert_load(model: nn.Module, mesh: Mesh, *, axis: tuple[str, ...]) -> dict | None:
    """Tokens per expert of the last micro-batch, summed over the data ranks: the worst layer's (collective
    over `axis`); None without MoE layer statistics."""
    stats = expert_load_stats(model, mesh, axis=axis)
    if not stats:
        return None
    worst = max(stats.values(), key=lambda v: v["imbalance"])
    return {"min": worst["min"], "max": worst["max"], "imbalance": worst["imbalance"],
            "dropped": sum(v["dropped"] for v in stats.values())}


def pipeline_idle_share(result) -> float:
    """This rank's idle share of its pipeline step: waits for activations and gradients (the bubble) and
    for its own sends, over the step's wall time (rank 0 logs: the first stage's)."""
    return 1.0 - result.busy / result.seconds if result.seconds else 0.0
