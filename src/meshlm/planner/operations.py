"""Running a training job on a cluster: failures, checkpoints and goodput; power and energy.

Responsible for: from one `Estimate` (step time, tokens/s) and the cluster, the expected time between
failures of the whole job, the time to write one checkpoint, the checkpoint interval that minimises lost
work (Young / Daly), the expected goodput (useful fraction of wall time), and the power the job draws
(cluster MW, energy per step, kWh per million tokens, and for a whole run of `train_tokens`).
Not responsible for: the step time itself (`cost.py`), or what a checkpoint contains on disk
(`meshlm.checkpoint`; the bytes here are the model state of the planner's accounting).

Failures. Each GPU fails independently at `failure_rate_per_gpu_hour` (a GPU and its share of host,
network and software faults); the job stops at the first failure of any GPU, so its mean time between
failures is 1 / (gpus x rate). Default: the Llama 3 paper (Dubey et al. 2024, Sec. 3.3.4): 419
unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs, i.e. 419 / (54 x 24 x 16384)
= 1.97e-5 per GPU-hour (a failure every ~3 hours at that size).
Checkpoint: bf16 weights + fp32 master weights and Adam moments (14 bytes per parameter, or 16 under fp32
training) written in parallel by all ranks at the storage bandwidth. Default storage bandwidth: the Llama 3
paper's Tectonic file system sustains 2 TB/s for 16K GPUs (Sec. 3.3.1), i.e. ~122 MB/s per GPU, scaled
with the job size. Young (1974) / Daly (2006): with write time d and MTBF M, the interval between
checkpoints that minimises waste is tau = sqrt(2 d M) - d (Daly's first-order form, for d < M / 2;
else M). Expected waste per unit time: d / tau (writing) + ((tau + d) / 2 + R) / M (the work lost since
the last checkpoint, on average half an interval, and the restart R); goodput = 1 - waste.

Power: every GPU draws its load power plus its share of server and network (`Cluster.gpu_power_w`,
`node_power_w`, `network_power_w`, from the datasheets cited in cluster.py), times the data centre's PUE.
"""

from __future__ import annotations

import math

from meshlm.planner.cluster import Cluster

# Llama 3 (Dubey et al. 2024, Sec. 3.3.4): 419 unexpected interruptions / (54 days x 24 h x 16,384 GPUs).
FAILURE_RATE_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# Llama 3 (Sec. 3.3.1): Tectonic sustains 2 TB/s for the 16K-GPU cluster; per GPU of the job.
STORAGE_BW_PER_GPU = 2e12 / 16384
# Restart after a failure: reschedule, re-initialise NCCL and reload the checkpoint. Ten minutes is the
# order of automated recovery that MegaScale (Jiang et al. 2024, Sec. 4) and Llama 3 (Sec. 3.3.4)
# describe; the checkpoint read is added on top at the storage bandwidth.
RESTART_S = 600.0


def checkpoint_bytes(total_params: float, *, precision: str) -> float:
    """Bytes of one full training checkpoint: weights + fp32 master + Adam m and v."""
    return total_params * (16 if precision == "fp32" else 14)


def failures(*, gpus: int, step_s: float, ckpt_bytes: float,
             failure_rate_per_gpu_hour: float = FAILURE_RATE_PER_GPU_HOUR,
             storage_bw: float | None = None, restart_s: float = RESTART_S) -> dict:
    """Failure, checkpoint and goodput figures of one job (seconds unless named otherwise)."""
    if failure_rate_per_gpu_hour < 0:
        raise ValueError(f"failure rate {failure_rate_per_gpu_hour} per GPU-hour must be >= 0 "
                         f"(default {FAILURE_RATE_PER_GPU_HOUR:.3g}, the Llama 3 paper's)")
    if storage_bw is not None and storage_bw <= 0:
        raise ValueError(f"storage bandwidth {storage_bw} B/s must be > 0 (e.g. --storage-bw 2e12 for 2 TB/s)")
    bw = storage_bw if storage_bw is not None else gpus * STORAGE_BW_PER_GPU
    write = ckpt_bytes / bw
    restart = restart_s + write  # reading the checkpoint back costs what writing it did
    rate = gpus * failure_rate_per_gpu_hour / 3600.0
    mtbf = math.inf if rate == 0 else 1.0 / rate
    if math.isinf(mtbf):
        interval, goodput = math.inf, 1.0
    else:
        interval = math.sqrt(2 * write * mtbf) - write if write < mtbf / 2 else mtbf
        interval = max(interval, step_s)  # a checkpoint is taken between steps
        waste = write / interval + ((interval + write) / 2 + restart) / mtbf
        goodput = max(0.0, 1.0 - waste)
    return {"failure_rate_per_gpu_hour": failure_rate_per_gpu_hour, "mtbf_hours": mtbf / 3600.0,
            "checkpoint_gb": ckpt_bytes / 1e9, "storage_gb_per_s": bw / 1e9, "checkpoint_write_s": write,
            "restart_s": restart, "checkpoint_interval_s": interval,
            "checkpoint_interval_steps": interval / step_s if step_s > 0 else math.inf, "goodput": goodput}


def power(cluster: Cluster, *, gpus: int, step_s: float, tokens_per_s: float, goodput: float = 1.0,
          train_tokens: float | None = None) -> dict:
    """Power and energy of one job; `train_tokens` adds the whole run (wall time divided by goodput)."""
    per_gpu = (cluster.gpu_power_w + cluster.node_power_w + cluster.network_power_w) * cluster.pue
    watts = gpus * per_gpu
    out = {"watts_per_gpu": per_gpu, "cluster_mw": watts / 1e6, "pue": cluster.pue,
           "energy_per_step_kwh": watts * step_s / 3.6e6,
           "kwh_per_million_tokens": watts * 1e6 / tokens_per_s / 3.6e6 if tokens_per_s > 0 else math.inf}
    if train_tokens:
        wall = train_tokens / tokens_per_s / max(goodput, 1e-9)
        out.update(train_tokens=train_tokens, run_days=wall / 86400.0, run_mwh=watts * wall / 3.6e9)
    return out


def operations(est, cluster: Cluster, *, total_params: float, precision: str,
               failure_rate_per_gpu_hour: float = FAILURE_RATE_PER_GPU_HOUR, storage_bw: float | None = None,
               train_tokens: float | None = None) -> dict:
    """{"failures": ..., "power": ...} for one `Estimate` (the JSON keys of `plan estimate --json`)."""
    gpus = est.layout.world
    f = failures(gpus=gpus, step_s=est.time_s["step"], ckpt_bytes=checkpoint_bytes(total_params, precision=precision),
                 failure_rate_per_gpu_hour=failure_rate_per_gpu_hour, storage_bw=storage_bw)
    p = power(cluster, gpus=gpus, step_s=est.time_s["step"], tokens_per_s=est.tokens_per_s, goodput=f["goodput"],
              train_tokens=train_tokens)
    return {"failures": f, "power": p}


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,.0f}"


def describe(ops: dict) -> str:
    """Two lines for the text output of `meshlm plan` / `plan estimate`."""
    f, p = ops["failures"], ops["power"]
    line1 = (f"Failures: cluster MTBF {f['mtbf_hours']:.3g} h at {f['failure_rate_per_gpu_hour']:.2g} failures per "
             f"GPU-hour; a {_num(f['checkpoint_gb'])} GB checkpoint takes {f['checkpoint_write_s']:.3g} s at "
             f"{_num(f['storage_gb_per_s'])} GB/s -> checkpoint every {f['checkpoint_interval_s'] / 60:.3g} min "
             f"(Young/Daly), expected goodput {f['goodput']:.1%}.")
    if p["watts_per_gpu"] <= 0:
        return line1 + "\nPower: not known for this cluster (no datasheet figures; presets only)."
    line2 = (f"Power: {p['cluster_mw']:.3g} MW ({p['watts_per_gpu']:,.0f} W per GPU incl. server, network and "
             f"PUE {p['pue']:g}), {p['energy_per_step_kwh']:.3g} kWh per step, "
             f"{p['kwh_per_million_tokens']:.3g} kWh per million tokens")
    if "run_mwh" in p:
        line2 += (f"; {_tokens(p['train_tokens'])} tokens take {p['run_days']:,.0f} days (at that goodput) and "
                  f"{p['run_mwh']:,.0f} MWh")
    return line1 + "\n" + line2 + "."
