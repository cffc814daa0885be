"""Process-group setup and teardown for one training or serving process.

Responsible for: reading the rank layout that the launcher (torchrun, or srun through torchrun)
puts in RANK / WORLD_SIZE / LOCAL_RANK, choosing the backend (gloo on CPU, NCCL on CUDA with one
device per local rank), starting the default process group, and tearing it down.
Not responsible for: launching processes (torchrun does that), building the mesh of parallel groups
(`meshlm.mesh.build_mesh`), or any collective (`meshlm.comm`).

A single process (no launcher, WORLD_SIZE unset or 1) gets no process group at all: a
`Mesh` of world size 1 works without one, and every collective on a one-rank axis is a no-op.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global rank, world size, rank within its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # None: single process, no process group
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 prints; the others stay quiet."""
        return self.rank == 0


def read_launch_env(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) of this process; (0, 1, 0) when no launcher started it.

    torchrun (and `meshlm train --nproc`) set RANK / WORLD_SIZE / LOCAL_RANK. Without them, a task
    of a multi-task `srun` step is a rank too: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (one task
    per GPU; the batch script exports MASTER_ADDR and MASTER_PORT, see examples/slurm.sbatch).
    """
    environ = os.environ if environ is None else environ
    if "RANK" not in environ and "WORLD_SIZE" not in environ and int(environ.get("SLURM_NTASKS", "1") or 1) > 1:
        names = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    else:
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    try:
        rank = int(environ.get(names[0], "0"))
        world_size = int(environ.get(names[1], "1"))
        local_rank = int(environ.get(names[2], str(rank)))
    except ValueError as e:
        raise ValueError(f"{'/'.join(names)} must be integers (set by the launcher): {e}") from None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{names[0]}={rank} {names[1]}={world_size} is not a valid layout; "
                         "launch with torchrun, srun or `meshlm train --nproc N`")
    return rank, world_size, local_rank


def cuda_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device of the rank with `local_rank` on its node, `visible` devices in sight: one device each
    (torchrun: cuda:LOCAL_RANK), or the one device Slurm binds to each task (srun --gpus-per-task=1: every
    task sees its own GPU as cuda:0 whatever its SLURM_LOCALID) -- local_rank % visible. More ranks than
    devices on a node that shows several is a mistake, refused."""
    if visible > 1 and local_rank >= visible:
        raise ValueError(f"LOCAL_RANK={local_rank} but only {visible} CUDA devices are visible; start at most that "
                         "many processes per node (or bind one GPU to each task: srun --gpus-per-task=1)")
    return local_rank % visible


def srun_agent(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process may be the one task per node of a multi-node `srun` step (examples/slurm.sbatch:
    `--ntasks-per-node=1`, each task a torchrun agent that starts its node's ranks) rather than a rank: as many
    SLURM tasks as nodes, and none of torchrun's variables. The command's node options (`--nproc`, `--nnodes`)
    say which it is; `read_launch_env` alone would count each such task as one rank."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return False
    try:
        tasks = int(environ.get("SLURM_NTASKS", "1") or 1)
        nodes = int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or 0)
    except ValueError:
        return False
    return tasks > 1 and tasks == nodes


def launched_ranks(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher (torchrun, srun with several tasks) started this process as one of many ranks."""
    return read_launch_env(environ)[1] > 1 or "WORLD_SIZE" in (os.environ if environ is None else environ)


def init_distributed(device_type: str = "cpu", *, environ: Mapping[str, str] | None = None,
                     timeout_s: float = 600.0) -> DistEnv:
    """Start the default process group for this process (if the launch has more than one rank).

    `device_type` is "cpu" (gloo; one intra-op thread per rank so that N ranks on one host do not
    oversubscribe its cores) or "cuda" (NCCL; this process owns cuda:LOCAL_RANK). MASTER_ADDR and
    MASTER_PORT are read by torch's env:// rendezvous, as torchrun sets them.
    """
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r} is not supported; use 'cpu' or 'cuda'")
    rank, world_size, local_rank = read_launch_env(environ)
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device_type='cuda' but no CUDA device is visible; use device_type='cpu'")
        device = torch.device("cuda", cuda_device_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return DistEnv(rank=0, world_size=1, local_rank=0, backend=None, device=device)
    if dist.is_initialized():
        raise ValueError("a default process group already exists; call teardown_distributed() first")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cpu":
        torch.set_num_threads(1)
    kwargs = {"device_id": device} if device_type == "cuda" else {}
    env = os.environ if environ is None else environ
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"{world_size} ranks but {missing} are not set; launch with torchrun, or export "
                         "MASTER_ADDR=<first node> MASTER_PORT=<free port> before srun")
    timeout = timedelta(seconds=timeout_s)
    # NCCL's own watchdog aborts the process at the group's timeout without saying who is missing: give ours
    # (`meshlm.liveness`, at twice the collective timeout) the time to say it first.
    pg_timeout = timedelta(seconds=3 * timeout_s + 60) if backend == "nccl" else timeout
    # The rendezvous store: torch elastic's agent hosts one (TORCHELASTIC_USE_AGENT_STORE) and keeps it when
    # it restarts the ranks after a failure (--max-restarts), so every attempt gets a key prefix of its own:
    # without it the new ranks read the dead ranks' addresses and fail to connect. Otherwise rank 0 hosts it.
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"meshlm/attempt_{restart_count(env)}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout, **kwargs)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=device)


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times the launcher restarted this job's ranks after a failure (torch elastic's
    TORCHELASTIC_RESTART_COUNT, with `meshlm train --max-restarts R`); 0 on the first attempt."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def exit_with_parent() -> None:
    """Have the kernel kill this process when its parent (the launcher's agent) dies (Linux).

    Without it, a launcher killed by SIGKILL leaves its ranks training on as orphans. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def teardown_distributed(*, wait: bool = False) -> None:
    """Destroy the default process group (and every subgroup) if one exists. Safe to call twice.

    `wait=True` (after a successful run) first waits for every rank: a rank that tears its groups
    down while a peer is still finishing its last collective on them makes gloo abort that peer at
    exit. Not after an error: the peers may never reach the barrier, and the launcher stops them.
    """
    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
