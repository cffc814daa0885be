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
the last checkpoint, on average half an interval, and the restart R); goodput = 1 - waste. That is restarting
from storage; `recovery.py` prices in-memory checkpoints and replica groups beside it, and `goodput` is the
configured path's (storage unless `recovery` says otherwise).

Power: every GPU draws its load power plus its share of server and network (`Cluster.gpu_power_w`,
`node_power_w`, `network_power_w`, from the datasheets cited in cluster.py), times the data centre's PUE.
"""

from __future__ import annotations

import math

from meshlm.planner.cluster import GiB, Cluster
from meshlm.planner.collectives import collective_time, group_span
from meshlm.planner.recovery import (HOST_COPY_BW_PER_GPU, checkpoint_restart, default_groups, recovery_paths,
                                     replica_sync)

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
    if not (math.isfinite(failure_rate_per_gpu_hour) and failure_rate_per_gpu_hour > 0):
        raise ValueError(f"failure rate {failure_rate_per_gpu_hour} per GPU-hour must be > 0 "
                         f"(default {FAILURE_RATE_PER_GPU_HOUR:.3g}, the Llama 3 paper's)")
    if not (math.isfinite(restart_s) and restart_s >= 0):
        raise ValueError(f"restart time {restart_s} s must be >= 0 (default {RESTART_S:g})")
    if storage_bw is not None and storage_bw <= 0:
        raise ValueError(f"storage bandwidth {storage_bw} B/s must be > 0 (e.g. --storage-bw 2e12 for 2 TB/s)")
    bw = storage_bw if storage_bw is not None else gpus * STORAGE_BW_PER_GPU
    write = ckpt_bytes / bw
    rate = gpus * failure_rate_per_gpu_hour / 3600.0
    mtbf = math.inf if rate == 0 else 1.0 / rate
    # reading the checkpoint back costs what writing it did
    storage = checkpoint_restart(mtbf_s=mtbf, step_s=step_s, write_s=write, reload_s=write, restart_s=restart_s)
    return {"failure_rate_per_gpu_hour": failure_rate_per_gpu_hour, "mtbf_hours": mtbf / 3600.0,
            "checkpoint_gb": ckpt_bytes / 1e9, "storage_gb_per_s": bw / 1e9, "checkpoint_write_s": write,
            "restart_s": restart_s + write, "checkpoint_interval_s": storage["checkpoint_interval_s"],
            "checkpoint_interval_steps": storage["checkpoint_interval_steps"], "goodput": storage["goodput"]}


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


def job_recovery(est, cluster: Cluster, f: dict, *, configured: str = "storage", groups: int | None = None,
                 restart_s: float = RESTART_S, host_bw: float | None = None) -> dict:
    """The recovery paths of one `Estimate` (`recovery.recovery_paths`) with its failures `f`: the state one GPU
    holds is its weights and optimizer state, the peer copy rides the scale-out link, and the replica groups are
    `groups` or the layout's (`recovery.default_groups`)."""
    replicas = est.layout.dp_replicate * est.layout.dp_shard  # copies of the model a group can hold whole
    if groups is not None and not (1 <= groups <= replicas and replicas % groups == 0):
        raise ValueError(f"--replica-groups {groups} must divide the layout's {replicas} data-parallel ranks "
                         "(dp_replicate x dp_shard): each group holds whole copies of the model")
    state = (est.memory_gib.get("weights", 0.0) + est.memory_gib.get("optimizer", 0.0)) * GiB
    return recovery_paths(mtbf_s=f["mtbf_hours"] * 3600.0, step_s=est.time_s["step"],
                          storage_write_s=f["checkpoint_write_s"], state_bytes=state,
                          host_bw=host_bw if host_bw is not None else HOST_COPY_BW_PER_GPU,
                          peer_bw=cluster.collective_fit("p2p", "scale-out")[1], restart_s=restart_s,
                          groups=groups if groups is not None else default_groups(est.layout), configured=configured)


def semi_sync(est, cluster: Cluster, *, groups: int, every: int) -> dict:
    """Semi-synchronous replica groups: one all-reduce of a GPU's weights over the `groups` (one rank per group,
    across nodes) every `every` steps (`recovery.replica_sync`). The estimate's step time still prices the
    synchronous data-parallel gradient reduction; this is what the groups' outer synchronisation adds."""
    n = est.layout.world
    span = group_span(n // groups, groups, cluster.scaleup_size)
    sync = collective_time("all_reduce", est.memory_gib.get("weights", 0.0) * GiB, span, cluster)
    return {"groups": groups, **replica_sync(sync_s=sync, every=every)}


def operations(est, cluster: Cluster, *, total_params: float, precision: str,
               failure_rate_per_gpu_hour: float = FAILURE_RATE_PER_GPU_HOUR, storage_bw: float | None = None,
               train_tokens: float | None = None, recovery: str = "storage", replica_groups: int | None = None,
               restart_s: float = RESTART_S, replica_sync_every: int = 1) -> dict:
    """{"failures": ..., "power": ...} for one `Estimate` (the JSON keys of `plan estimate --json`); `failures`
    carries every recovery path (`job_recovery`) and its `goodput` is the `recovery` path's; with
    `replica_sync_every` > 1 also "replica_sync" (`semi_sync`)."""
    if replica_sync_every < 1:
        raise ValueError(f"--replica-sync-every {replica_sync_every} must be >= 1 (1: every step)")
    gpus = est.layout.world
    f = failures(gpus=gpus, step_s=est.time_s["step"], ckpt_bytes=checkpoint_bytes(total_params, precision=precision),
                 failure_rate_per_gpu_hour=failure_rate_per_gpu_hour, storage_bw=storage_bw, restart_s=restart_s)
    f.update(job_recovery(est, cluster, f, configured=recovery, groups=replica_groups, restart_s=restart_s))
    f["goodput"] = f["goodput_by_recovery"][recovery]
    p = power(cluster, gpus=gpus, step_s=est.time_s["step"], tokens_per_s=est.tokens_per_s, goodput=f["goodput"],
              train_tokens=train_tokens)
    out = {"failures": f, "power": p}
    if replica_sync_every > 1:
        groups = f["recovery"]["replica"]["groups"] if f["recovery"]["replica"] else 1
        if groups < 2:
            raise ValueError("--replica-sync-every needs at least 2 replica groups (--replica-groups G)")
        out["replica_sync"] = semi_sync(est, cluster, groups=groups, every=replica_sync_every)
    return out


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,.0f}"


def describe_recovery(ops: dict) -> str:
    """One line: each recovery path's time lost per failure and goodput, the configured one marked."""
    f = ops["failures"]
    parts = []
    for path, lost in f["lost_s_per_failure"].items():
        mark = " (configured)" if path == f["configured_recovery"] else ""
        if lost is None:
            parts.append(f"{path}{mark}: needs >= 2 replica groups")
        else:
            parts.append(f"{path}{mark} {lost / 60:.3g} min lost per failure, goodput "
                         f"{f['goodput_by_recovery'][path]:.1%}")
    line = "Recovery: " + "; ".join(parts) + "."
    if "replica_sync" in ops:
        r = ops["replica_sync"]
        line += (f" Semi-synchronous groups: {r['sync_s']:.3g} s to synchronise {r['groups']} groups every "
                 f"{r['every_steps']} steps ({r['per_step_s']:.3g} s per step).")
    return line


def describe(ops: dict) -> str:
    """Three lines for the text output of `meshlm plan` / `plan estimate`."""
    f, p = ops["failures"], ops["power"]
    line1 = (f"Failures: cluster MTBF {f['mtbf_hours']:.3g} h at {f['failure_rate_per_gpu_hour']:.2g} failures per "
             f"GPU-hour; a {_num(f['checkpoint_gb'])} GB checkpoint takes {f['checkpoint_write_s']:.3g} s at "
             f"{_num(f['storage_gb_per_s'])} GB/s -> checkpoint every {f['checkpoint_interval_s'] / 60:.3g} min "
             f"(Young/Daly), expected goodput {f['goodput']:.1%}.")
    line1 += "\n" + describe_recovery(ops)
    if p["watts_per_gpu"] <= 0:
        return line1 + "\nPower: not known for this cluster (no datasheet figures; presets only)."
    line2 = (f"Power: {p['cluster_mw']:.3g} MW ({p['watts_per_gpu']:,.0f} W per GPU incl. server, network and "
             f"PUE {p['pue']:g}), {p['energy_per_step_kwh']:.3g} kWh per step, "
             f"{p['kwh_per_million_tokens']:.3g} kWh per million tokens")
    if "run_mwh" in p:
        line2 += (f"; {_tokens(p['train_tokens'])} tokens take {p['run_days']:,.0f} days (at that goodput) and "
                  f"{p['run_mwh']:,.0f} MWh")
    return line1 + "\n" + line2 + "."
