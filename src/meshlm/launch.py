"""Starting the ranks of a command: local and multi-node ranks through torch's launcher (torchrun's
`main`, `run_torchrun`), and emulated nodes (`run_emulated`: one network namespace per node, each
running the command -- `meshlm train`, `generate` or `serve` -- as that node).

Responsible for: the launcher's arguments (rendezvous, node rank, restarts: `node_launcher_args`, shared by
every command that takes --nnodes), checking the layout and the run directory before any rank starts, and
turning a failed launch into one line on the rank that failed first and an exit code (`launch_exit_code`), and
a launcher stopped by a signal (SIGTERM: how a server is stopped) into one line and 128 + the signal's number.
Not responsible for: what a rank does (cli.py runs it), or the namespaces and links (emulate.py).
"""

from __future__ import annotations

import logging
import sys


def train_args(args) -> list[str]:
    """The `meshlm train` arguments every rank is started with: the config, its overrides, --resume/--overwrite,
    --no-memory-check."""
    return [*(["--config", args.config] if args.config else []), *[a for o in args.overrides for a in ("--set", o)],
            *(["--resume"] if args.resume else []), *(["--overwrite"] if args.overwrite else []),
            *(["--no-memory-check"] if getattr(args, "no_memory_check", False) else [])]


# The options that place this command's ranks on nodes (cli/common.py's `add_node_arguments`: --nnodes,
# --node-rank, --rdzv-endpoint, --rdzv-id), as their values follow them on a command line.
NODE_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id")


def check_node_arguments(args) -> None:
    """Refuse (ValueError, one line) node options that cannot start: --nnodes < 1, several nodes without a
    rendezvous, a node rank without one or outside 0..nnodes-1."""
    if args.nnodes < 1:
        raise ValueError(f"--nnodes={args.nnodes} must be >= 1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ValueError(f"--nnodes={args.nnodes} needs --rdzv-endpoint HOST:PORT (an address of the first "
                         "node that every node can reach), the same on every node")
    if args.node_rank is not None and not args.rdzv_endpoint:
        raise ValueError("--node-rank needs --rdzv-endpoint HOST:PORT (the address of node 0)")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank={args.node_rank} must be between 0 and --nnodes - 1 = {args.nnodes - 1}")


def node_launcher_args(args, nproc: int) -> list[str]:
    """torch.distributed.run's arguments for `nproc` ranks on this node of --nnodes: a private rendezvous on one
    node, else c10d at --rdzv-endpoint (nodes ranked by the launcher) or, with --node-rank, a static one."""
    launcher = ["--nnodes", str(args.nnodes), "--nproc-per-node", str(nproc)]
    if args.rdzv_endpoint is None:
        return [*launcher, "--standalone"]  # one node: a private c10d rendezvous on a free local port
    if args.node_rank is None:
        return [*launcher, "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
    return [*launcher, "--rdzv-backend", "static", "--rdzv-endpoint", args.rdzv_endpoint,
            "--node-rank", str(args.node_rank)]


def without_node_flags(argv: list[str]) -> list[str]:
    """`argv` less the node options (`NODE_FLAGS`, as `--flag VALUE` or `--flag=VALUE`): what the ranks run
    again once the launcher has placed them."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in NODE_FLAGS:
            skip = True
        elif a.split("=", 1)[0] not in NODE_FLAGS:
            out.append(a)
    return out


def launch_ranks(args, cfg, *, preflight=None) -> int:
    """Start --nproc ranks of this same command through torch.distributed.run; its exit code. `preflight`: called
    with the world size once the arguments and the layout check out, before any rank starts (`meshlm train`'s
    memory check)."""
    from meshlm.parallel.parallelize import check_layout
    from meshlm.checkpoint import check_run_dir

    if args.nproc < 1:
        raise ValueError(f"--nproc={args.nproc} must be >= 1")
    check_node_arguments(args)
    check_layout(cfg, args.nproc * args.nnodes)  # before any rank starts
    if preflight is not None:
        preflight(args.nproc * args.nnodes)
    check_run_dir(cfg.train.run_dir, resume=args.resume, overwrite=args.overwrite, model=cfg.model)
    import torch

    if cfg.train.device != "cpu" and torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        raise ValueError(f"--nproc={args.nproc} but this node has {torch.cuda.device_count()} CUDA devices (one "
                         f"per rank); use --nproc <= {torch.cuda.device_count()}, or train.device=cpu")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts={args.max_restarts} must be >= 0")
    launcher = [*node_launcher_args(args, args.nproc), "--max-restarts", str(args.max_restarts)]
    try:
        return run_torchrun(launcher, ["train", *train_args(args)])
    finally:
        if cfg.train.memory_checkpoint_interval:  # the job is over (restarts included): its in-memory copies go
            from meshlm.checkpoint.memory import SnapshotFiles, memory_root

            SnapshotFiles(memory_root(cfg.train.run_dir, cfg.train.memory_checkpoint_dir)).remove()


def launch_emulated(args, cfg) -> int:
    """`meshlm train --emulate-nodes N` (and `meshlm cluster emulate -- meshlm train`): N network namespaces, each
    running `meshlm train --nproc P --nnodes N --node-rank i` (`run_emulated`)."""
    from meshlm.parallel.parallelize import check_layout
    from meshlm.checkpoint import check_run_dir

    rate, latency = check_emulation(args)
    check_layout(cfg, args.nproc * args.emulate_nodes)  # before any namespace or rank
    check_run_dir(cfg.train.run_dir, resume=args.resume, overwrite=args.overwrite, model=cfg.model)
    return run_emulated(args, "train", ["--nproc", str(args.nproc), *train_args(args)], rate_bps=rate,
                        latency_s=latency)


def check_emulation(args) -> tuple[float, float]:
    """(rate in bit/s, one-way latency in s) of the emulation options --emulate-nodes, --nproc (ranks per node),
    --inter-node-bw, --inter-node-latency; ValueError (one line) on a bad one, on node options (the emulation
    sets them), and where this host cannot emulate nodes (`emulate.check_host`)."""
    from meshlm.emulate import MAX_NODES, check_host, parse_duration, parse_rate

    if not 2 <= args.emulate_nodes <= MAX_NODES:
        raise ValueError(f"{args.emulate_nodes} emulated nodes: need 2..{MAX_NODES} (--emulate-nodes / cluster emulate "
                         "--nodes)")
    if not args.inter_node_bw:
        raise ValueError("emulated nodes need --inter-node-bw RATE (e.g. 1gbit), the link between nodes")
    if args.nnodes != 1 or args.rdzv_endpoint or args.node_rank is not None:
        raise ValueError("emulated nodes all run here; drop --nnodes/--rdzv-endpoint/--node-rank")
    if getattr(args, "max_restarts", 0):
        raise ValueError("--max-restarts is not supported on emulated nodes; leave it out")
    if getattr(args, "replica_groups", 0):
        raise ValueError("--replica-groups is not supported on emulated nodes; leave it out")
    if args.nproc < 1:
        raise ValueError(f"{args.nproc} ranks per node (--nproc / cluster emulate --procs-per-node) must be >= 1")
    rate = parse_rate(args.inter_node_bw)
    latency = parse_duration(args.inter_node_latency) if args.inter_node_latency else 0.0
    check_host()  # no ip/tc, not root: one line before anything else
    return rate, latency


def run_emulated(args, command: str, command_args: list[str], *, rate_bps: float, latency_s: float) -> int:
    """`meshlm COMMAND COMMAND_ARGS --nnodes N --node-rank i --rdzv-endpoint <node 0>` in each of N = --emulate-nodes
    network namespaces (torch's launcher on every node, static rendezvous on node 0's address); says on stderr
    which namespace each node is and, at the end (also when interrupted), the bytes each node's link carried. The
    namespaces are removed however it ends; the exit code is the first failed node's."""
    import os

    from meshlm.emulate import EmulatedCluster

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as run_torchrun: one intra-op thread per rank
    nodes = args.emulate_nodes
    with EmulatedCluster(nodes=nodes, rate_bps=rate_bps, latency_s=latency_s) as cluster:
        # A fresh namespace has no listener on any port: the rendezvous may take a fixed one.
        endpoint = f"{cluster.addresses[0]}:29500"
        where = ", ".join(f"node {i} = {ns} ({a})" for i, (ns, a) in enumerate(zip(cluster.namespaces,
                                                                                    cluster.addresses)))
        print(f"meshlm cluster emulate: {where} (enter one: ip netns exec NAMESPACE ...)", file=sys.stderr,
              flush=True)
        try:
            code = cluster.run_on_nodes(lambda i: [sys.executable, "-m", "meshlm.cli", command, *command_args,
                                                   "--nnodes", str(nodes), "--node-rank", str(i),
                                                   "--rdzv-endpoint", endpoint])
        finally:  # also after Ctrl-C or SIGTERM (how a server is stopped): what the links carried until then
            carried = "; ".join(f"node {i} sent {sent} B, received {received} B"
                                for i, (sent, received) in enumerate(cluster.link_bytes()))
            print(f"meshlm cluster emulate: node links carried: {carried}", file=sys.stderr, flush=True)
    if code:
        print(f"meshlm {command}: an emulated node failed (exit code {code}); its error is printed above",
              file=sys.stderr)
    return code


def run_torchrun(launcher: list[str], rank_args: list[str]) -> int:
    """`torchrun LAUNCHER -m meshlm.cli RANK_ARGS`; its exit code, with one line on the first failed rank.

    The launcher's log directory is a temporary one removed when it returns: torch's default (DefaultLogsSpecs) is a
    fresh `torchelastic_*` directory in the system's temporary directory that nothing removes, one per launch. Nothing
    is lost: the ranks' output is not redirected there (it goes to this process's stdout and stderr), and a failed
    rank's error file is read (`first_failure`) before the directory goes."""
    import os
    import tempfile

    # Each rank uses one intra-op thread (init_distributed sets it); saying so here also keeps the
    # launcher from printing its warning about choosing that default for us.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    cap_shutdown_grace()
    quiet_rank_stops()
    with tempfile.TemporaryDirectory(prefix="meshlm-launch-") as logs:
        try:
            torchrun([*launcher, "--log-dir", logs, "--module", "meshlm.cli", *rank_args])
        except ChildFailedError as e:
            failed = sorted(e.failures.items())
            codes = sorted({f.exitcode for _, f in failed})
            print(f"meshlm {rank_args[0]}: {first_failure(e)}", file=sys.stderr)
            return launch_exit_code(codes)
        except SignalException as e:  # SIGTERM (how a server is stopped), SIGINT, SIGHUP or SIGQUIT to the launcher
            print(f"meshlm {rank_args[0]}: stopped by {e.sigval.name}; the launcher stopped every rank",
                  file=sys.stderr)
            return 128 + int(e.sigval)  # the shell's convention for a process ended by a signal: 143 for SIGTERM
    return 0


# What a rank gets between the launcher's SIGTERM and its SIGKILL when the launcher stops the ranks after one
# failed. torch elastic waits up to 30 s; meshlm's ranks end at once on SIGTERM (they install no handler), so
# that wait only ever waits for a rank that cannot run -- stopped (SIGSTOP, a debugger) or wedged -- and
# delays the launcher's exit (or its restart) by as much.
SHUTDOWN_GRACE_S = 3


def cap_shutdown_grace() -> None:
    """Cap torch elastic's SIGTERM grace at SHUTDOWN_GRACE_S in this (the launcher's) process. Its agent stops
    the ranks through `PContext.close(death_sig, timeout=30)` and offers no setting for that path
    (torchrun's --shutdown-timeout covers only a signal to the launcher itself)."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close
    if getattr(close, "meshlm_capped", False):
        return

    def capped(self, death_sig=None, timeout: float = 30):
        return close(self, death_sig, min(timeout, SHUTDOWN_GRACE_S))

    capped.meshlm_capped = True
    api.PContext.close = capped


# torch elastic's own lines about stopping the ranks (as its logging.Logger format strings): the launcher's
# "Received SIGTERM death signal, shutting down workers" and one "Sending process PID closing signal SIGTERM" per
# rank. meshlm says the same in one line of its own (`run_torchrun`: stopped by a signal, or which rank failed
# first and how many others stopped after it).
TORCH_STOP_MESSAGES = {"torch.distributed.elastic.agent.server.api": "Received %s death signal, shutting down workers",
                       "torch.distributed.elastic.multiprocessing.api": "Sending process %s closing signal %s"}


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


def quiet_rank_stops() -> None:
    """Leave out `TORCH_STOP_MESSAGES` in this (the launcher's) process; every other line of torch's is kept."""
    for name, message in TORCH_STOP_MESSAGES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(message))


def first_failure(error) -> str:
    """One line on the rank that failed first (the others are mostly the launcher's teardown of them) -- or,
    when its error blames other ranks (a peer that stopped answering or never reached the collective,
    `meshlm.liveness`), on those ranks, with what the first rank saw."""
    from meshlm.liveness import blamed_ranks

    rank, failure = error.get_first_failure()
    blamed = []
    if failure.exitcode < 0:
        why = f"killed by {failure.signal_name()}"
    else:
        message = failure.message
        while isinstance(message, dict):  # the error file of a rank that raised (`record`): its exception
            message = message.get("message", "")
        lines = [line for line in str(message or "").strip().splitlines() if line.strip()]
        why = f"exit code {failure.exitcode}" + (f": {lines[-1][:600]}" if lines else "")
        blamed = [r for r in blamed_ranks(lines[-1] if lines else "") if r != rank]
    others = len(error.failures) - 1
    if blamed:
        who = f"rank{'s' if len(blamed) > 1 else ''} {', '.join(map(str, blamed))}"
        return (f"{who} stopped answering; rank {rank} noticed first ({why}); the launcher stopped every rank; "
                "its error is printed above")
    return (f"rank {rank} failed first ({why})" + (f"; {others} other rank(s) stopped after it" if others else "")
            + "; its error is printed above")


def launch_exit_code(codes: list[int]) -> int:
    """The exit code of a failed launch from its ranks' codes: 2 (a user mistake) when every rank
    that exited by itself exited 2 -- the launcher stops the others with a signal (a negative code)."""
    own = {c for c in codes if c >= 0}
    return 2 if own == {2} else 1
