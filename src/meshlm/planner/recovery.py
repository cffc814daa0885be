"""Recovering a training job from a failure, three ways, and the goodput of each.

Responsible for: the time one failure costs the job (`lost_s_per_failure`) and the expected goodput under each
recovery path meshlm runs, from the job's MTBF, step time, state sizes and links:
  storage  restart every rank from the newest storage checkpoint (`meshlm train --max-restarts R`,
           train.checkpoint_interval);
  memory   restart every rank from the newest in-memory checkpoint (train.memory_checkpoint_interval: each rank's
           pieces in its host memory and one peer's);
  replica  torchft replica groups (parallel.fault_tolerance = "replica"): only the failed group restarts and
           copies the state from a live group while the others keep stepping;
and the synchronisation of semi-synchronous replica groups (parallel.replica_sync_every = H: LocalSGD / DiLoCo),
one all-reduce of the weights over the groups on the scale-out link every H steps.
Not responsible for: the failure rate, the storage bandwidth or the power (`operations.py`), the step time
(`cost.py`), or what the runtime does (`meshlm.train.memory`, `meshlm.train.replica`).

The model, per path (M: the job's mean time between failures; s: one step; R: the restart -- reschedule the ranks,
re-initialise the communicators --; b: the model state one GPU holds, its weights and optimizer state):
  storage  every rank writes its pieces to storage in parallel (write d = checkpoint bytes / storage bandwidth)
           every tau (Young 1974 / Daly 2006: tau = sqrt(2 d M) - d); a failure loses the work since the last
           checkpoint (on average (tau + d) / 2), the restart R and the read back (as long as the write).
           waste = d / tau + ((tau + d) / 2 + R + d) / M.
  memory   every rank copies b to its host memory (PCIe) and sends a copy to its peer on another node (the
           scale-out link), both before the next step as meshlm's train/memory.py does: d_m = b / host + b / peer,
           taken every tau_m (Young/Daly on d_m); a failure loses (tau_m + d_m) / 2, the restart R, and the reload:
           the failed node is replaced, so its ranks fetch their pieces from their peers (b / peer) while the
           others read their own host memory in parallel, faster. waste = d_m / tau_m + ((tau_m + d_m) / 2 + R +
           b / peer) / M. (Gemini, Wang et al. SOSP 2023, checkpoints to CPU memory and peers on this argument.)
  replica  G groups; a failure ends one group's step in flight, which every group retries with the next quorum
           (s lost by the whole job); the failed group is away for its restart R and the copy of the state from a
           live group (b / peer over the scale-out link, every rank of the group at once) while the other G - 1
           keep stepping on their slices, so the job runs at (G - 1) / G for that time.
           waste = (s + (R + b / peer) / G) / M. Needs G >= 2 (one group has no live peer to copy from).
For memory and replica, storage checkpoints still guard against the rarer loss of a node with its peer, or of
every group; they can be taken far apart and are not counted. Goodput = 1 - waste (at least 0).
"""

from __future__ import annotations

import math

PATHS = ("storage", "memory", "replica")
# A GPU's copy to host memory: PCIe Gen5 x16, 64 GB/s per direction (PCI-SIG), at the 0.8 of a link's rate that
# the cluster presets assume large transfers reach (cluster.py, link_efficiency).
HOST_COPY_BW_PER_GPU = 64e9 * 0.8


def young_daly_interval(write_s: float, mtbf_s: float, step_s: float) -> float:
    """Seconds between checkpoints that minimise lost work: Daly's first-order sqrt(2 d M) - d for d < M / 2,
    else M; at least one step (a checkpoint is taken between steps)."""
    if math.isinf(mtbf_s):
        return math.inf
    interval = math.sqrt(2 * write_s * mtbf_s) - write_s if write_s < mtbf_s / 2 else mtbf_s
    return max(interval, step_s)


def _goodput(waste: float) -> float:
    return max(0.0, 1.0 - waste)


def checkpoint_restart(*, mtbf_s: float, step_s: float, write_s: float, reload_s: float, restart_s: float,
                       interval_s: float | None = None) -> dict:
    """A restart of every rank from a checkpoint written in `write_s` every `interval_s` (None: the Young/Daly
    interval) and read back in `reload_s` after the restart: the storage and memory paths."""
    interval = young_daly_interval(write_s, mtbf_s, step_s) if interval_s is None else interval_s
    lost = (interval + write_s) / 2 + restart_s + reload_s
    goodput = 1.0 if math.isinf(mtbf_s) else _goodput(write_s / interval + lost / mtbf_s)
    return {"checkpoint_write_s": write_s, "checkpoint_interval_s": interval,
            "checkpoint_interval_steps": interval / step_s if step_s > 0 else math.inf, "restart_s": restart_s,
            "reload_s": reload_s, "lost_s_per_failure": lost, "goodput": goodput}


def replica_recovery(*, mtbf_s: float, step_s: float, groups: int, state_bytes: float, peer_bw: float,
                     restart_s: float) -> dict | None:
    """The failed group's restart and copy of the state from a live group while the others step on (None with
    fewer than 2 groups)."""
    if groups < 2:
        return None
    heal = state_bytes / peer_bw
    lost = step_s + (restart_s + heal) / groups
    goodput = 1.0 if math.isinf(mtbf_s) else _goodput(lost / mtbf_s)
    return {"groups": groups, "restart_s": restart_s, "heal_s": heal, "retried_step_s": step_s,
            "lost_s_per_failure": lost, "goodput": goodput}


def recovery_paths(*, mtbf_s: float, step_s: float, storage_write_s: float, state_bytes: float, host_bw: float,
                   peer_bw: float, restart_s: float, groups: int, configured: str = "storage") -> dict:
    """Every path's figures, goodput and lost time per failure side by side, and the `configured` one named."""
    if configured not in PATHS:
        raise ValueError(f"recovery {configured!r} must be one of {', '.join(PATHS)}")
    if host_bw <= 0 or peer_bw <= 0:
        raise ValueError(f"host ({host_bw}) and peer ({peer_bw}) bandwidths must be > 0 B/s")
    if restart_s < 0:
        raise ValueError(f"restart time {restart_s} s must be >= 0")
    paths = {
        "storage": checkpoint_restart(mtbf_s=mtbf_s, step_s=step_s, write_s=storage_write_s,
                                      reload_s=storage_write_s, restart_s=restart_s),
        "memory": checkpoint_restart(mtbf_s=mtbf_s, step_s=step_s,
                                     write_s=state_bytes / host_bw + state_bytes / peer_bw,
                                     reload_s=state_bytes / peer_bw, restart_s=restart_s),
        "replica": replica_recovery(mtbf_s=mtbf_s, step_s=step_s, groups=groups, state_bytes=state_bytes,
                                    peer_bw=peer_bw, restart_s=restart_s),
    }
    if paths[configured] is None:
        raise ValueError(f"recovery 'replica' needs at least 2 replica groups (got {groups}); give "
                         "--replica-groups G or a layout with dp_replicate > 1")
    return {"configured_recovery": configured, "state_gb_per_gpu": state_bytes / 1e9,
            "goodput_by_recovery": {k: (v["goodput"] if v else None) for k, v in paths.items()},
            "lost_s_per_failure": {k: (v["lost_s_per_failure"] if v else None) for k, v in paths.items()},
            "recovery": paths}


def replica_sync(*, sync_s: float, every: int) -> dict:
    """Semi-synchronous groups (LocalSGD / DiLoCo): one all-reduce of the weights over the groups (`sync_s`, on the
    scale-out link) every `every` steps, i.e. sync_s / every per step."""
    if every < 1:
        raise ValueError(f"replica sync interval {every} must be >= 1 step")
    return {"every_steps": every, "sync_s": sync_s, "per_step_s": sync_s / every}


def default_groups(layout) -> int:
    """The replica groups a layout can have: its dp_replicate replicas, else (no ZeRO: every data rank holds the
    whole state) its dp_shard ranks; 1 when the state is sharded over every data rank."""
    if layout.dp_replicate > 1:
        return layout.dp_replicate
    return layout.dp_shard if layout.zero_stage == 0 else 1
