"""`meshlm train --replica-groups N`: a torchft lighthouse and N replica groups on this machine.

Responsible for: starting torchft's lighthouse (the quorum service every group reports to), then one job per
replica group -- `meshlm train --nproc P --max-restarts R` with parallel.fault_tolerance=replica,
parallel.replica_group=i and parallel.lighthouse set -- each its own torch elastic launcher, so that one group's
failure restarts that group alone while the others step on; waiting for them, and one line per failed group.
Not responsible for: what a group does (`meshlm.train.replica`), or multi-node runs: there each group is one job
(srun/torchrun) given parallel.lighthouse of a lighthouse started once (`torchft_lighthouse`); README shows it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from meshlm.distributed import exit_with_parent
from meshlm.launch import train_args


def start_lighthouse(min_groups: int):
    """torchft's lighthouse on a free port of this machine; (server, its address)."""
    from meshlm.train.replica import HEARTBEAT_TIMEOUT_S, JOIN_TIMEOUT_S, quiet_torchft

    quiet_torchft()
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as e:
        raise ValueError(f"--replica-groups needs torchft ({e}); pip install torchft (the ft extra: "
                         "pip install -e \".[ft]\")") from None
    server = LighthouseServer(bind="[::]:0", min_replicas=min_groups, join_timeout_ms=int(JOIN_TIMEOUT_S * 1000),
                              quorum_tick_ms=100, heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT_S * 1000))
    return server, server.address()


def group_command(args, group: int, lighthouse: str) -> list[str]:
    """The `meshlm train` command of replica group `group` (its own elastic launcher)."""
    sets = ["parallel.fault_tolerance=replica", f"parallel.replica_groups={args.replica_groups}",
            f"parallel.replica_group={group}", f"parallel.lighthouse={lighthouse}"]
    return [sys.executable, "-m", "meshlm.cli", "train", "--nproc", str(args.nproc or 1),
            "--max-restarts", str(args.max_restarts), *train_args(args), *[a for s in sets for a in ("--set", s)]]


def launch_replica_groups(args, cfg) -> int:
    """Start the lighthouse and the N groups; wait for all; the exit code of the first that failed."""
    from meshlm.checkpoint import check_run_dir
    from meshlm.parallel.parallelize import check_layout

    groups = args.replica_groups
    if groups < 1:
        raise ValueError(f"--replica-groups={groups} must be >= 1")
    if args.nnodes != 1 or args.rdzv_endpoint or args.node_rank is not None or args.emulate_nodes:
        raise ValueError("--replica-groups starts every group on this machine; for several nodes start one job "
                         "per group with parallel.lighthouse set (README: replica groups)")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
    p = cfg.parallel
    checked = dataclasses.replace(cfg, parallel=dataclasses.replace(p, fault_tolerance="replica", replica_groups=groups))
    check_layout(checked.validate(), args.nproc or 1)  # every group's layout, before anything starts
    for g in range(groups):  # and every group's run_dir
        check_run_dir(Path(cfg.train.run_dir) / f"replica_{g}", resume=args.resume, overwrite=args.overwrite,
                      model=cfg.model)
    server, address = start_lighthouse(p.min_replica_groups)
    print(f"meshlm: torchft lighthouse at {address}; {groups} replica group(s) of {args.nproc or 1} rank(s)",
          flush=True)
    procs = []
    try:
        # each group dies with this launcher (no group training on alone)
        procs = [subprocess.Popen(group_command(args, g, address), preexec_fn=exit_with_parent) for g in range(groups)]
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.shutdown()
    failed = [(g, c) for g, c in enumerate(codes) if c]
    for g, code in failed:
        print(f"meshlm train: replica group {g} failed (exit code {code}); its error is printed above",
              file=sys.stderr)
    return failed[0][1] if failed else 0
