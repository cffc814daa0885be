"""What several commands share."""

from __future__ import annotations


def finite_float(text: str) -> float:
    """argparse `type` of a number flag: a float, refused (one argparse error) where it is nan or infinite, which
    every formula would carry through to a nan or inf answer."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def require_extra(extra: str, *modules: str) -> None:
    """Raise ValueError naming the pip extra that brings `modules` when one of them is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"this command needs {', '.join(missing)} (the [{extra}] extra): "
                         f"pip install {' '.join(missing)}, or the extra: pip install -e \".[{extra}]\"")


def add_node_arguments(group) -> None:
    """--nnodes, --rdzv-endpoint, --rdzv-id, --node-rank: where a command's ranks start (`launch.node_launcher_args`);
    the one definition, for `meshlm train`, `generate` and `serve`."""
    group.add_argument("--nnodes", type=int, default=1, metavar="N",
                       help="nodes taking part; each runs this command once (default 1)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="c10d rendezvous on the first node (needed with --nnodes > 1)")
    group.add_argument("--rdzv-id", default="meshlm", metavar="ID",
                       help="job id shared by the nodes of one run (default meshlm)")
    group.add_argument("--node-rank", type=int, default=None, metavar="R",
                       help="fix this node's rank (static rendezvous at --rdzv-endpoint) instead of "
                            "c10d's order by host name")


def add_serving_node_arguments(p) -> None:
    """`add_node_arguments` for `meshlm generate` / `serve`, whose --tp x --cp ranks split evenly over the nodes."""
    add_node_arguments(p.add_argument_group(
        "nodes", "Spread the --tp x --cp ranks evenly over several nodes, each running this same command "
        "(consecutive ranks on a node, tp innermost: a node of tp ranks or more holds whole tp groups, and the cp "
        "ranks spread over the nodes); rank 0, on the first node, schedules and prints (and, serving, answers HTTP), "
        "the other nodes only host ranks. Under torchrun or srun (RANK/WORLD_SIZE set) leave these out."))


def serving_ranks(args) -> int:
    """The ranks of `meshlm generate` / `meshlm serve`: --tp x --cp (ValueError unless both are >= 1)."""
    if args.tp < 1 or args.cp < 1:
        raise ValueError(f"--tp={args.tp} and --cp={args.cp} must be >= 1")
    return args.tp * args.cp


def launch_serving_ranks(args) -> int | None:
    """`meshlm generate` / `serve` over --tp x --cp ranks: started here through torch's launcher (this node's
    share of --nnodes nodes, each rank running this command again without the node options), returning the
    launch's exit code; or None where this process serves itself: one rank alone, or one rank of a launch
    (torchrun, srun; refused unless the launch has --tp x --cp ranks). Every refusal comes before a rank starts."""
    from meshlm.distributed import launched_ranks, read_launch_env, srun_agent
    from meshlm.launch import node_launcher_args, run_torchrun, without_node_flags

    ranks = serving_ranks(args)
    node_options = args.nnodes != 1 or args.rdzv_endpoint or args.node_rank is not None
    if launched_ranks() and not (node_options and srun_agent()):  # (the one srun task of its node: an agent)
        if node_options:
            raise ValueError(f"this process is already one of {read_launch_env()[1]} launched ranks; drop "
                             "--nnodes/--rdzv-endpoint/--node-rank under torchrun/srun")
        world = read_launch_env()[1]
        if world != ranks:
            raise ValueError(f"--tp={args.tp} x --cp={args.cp} serves on {ranks} ranks but this launch has {world}; "
                             f"start {ranks} ranks in all (torchrun --nnodes N --nproc-per-node {ranks}/N, or srun "
                             f"--ntasks {ranks})")
        return None
    per_node = serving_ranks_per_node(args)
    if ranks == 1:  # (one node: one rank does not split over several)
        return None
    _check_tp_against_the_model(args)
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if getattr(args, "device", "auto") != "cpu" and devices and per_node > devices:
        raise ValueError(f"{per_node} ranks on this node (--tp x --cp / --nnodes) but it has {devices} CUDA devices, "
                         "one per rank; spread the ranks over more nodes (--nnodes) or use fewer")
    return run_torchrun(node_launcher_args(args, per_node), without_node_flags(args.argv))


def server_ranks(args) -> tuple[int, str]:
    """(ranks, how a message names them) of one server of `meshlm generate` / `serve`: --tp x --cp, or with
    `serve --prefill/--decode` both instances' ranks (the prefill instance's first); ValueError on a bad layout."""
    if getattr(args, "prefill", None) is not None and getattr(args, "decode", None) is not None:
        from meshlm.infer.instances import parse_instance

        prefill, decode = parse_instance(args.prefill, role="prefill"), parse_instance(args.decode, role="decode")
        ranks = prefill.ranks + decode.ranks
        return ranks, f"--prefill {prefill.label()} + --decode {decode.label()} = {ranks} ranks"
    ranks = serving_ranks(args)
    return ranks, f"--tp={args.tp} x --cp={args.cp} = {ranks} rank(s)"


def serving_ranks_per_node(args) -> int:
    """The ranks of `meshlm generate` / `serve` (one server: `server_ranks`) on each of --nnodes nodes; ValueError
    on bad node options or ranks that do not split evenly over the nodes."""
    from meshlm.launch import check_node_arguments

    ranks, what = server_ranks(args)
    check_node_arguments(args)
    if ranks % args.nnodes:
        raise ValueError(f"{what} do not split evenly over --nnodes={args.nnodes}; make them a multiple of the "
                         "nodes")
    return ranks // args.nnodes


def replica_endpoints(args) -> list[str]:
    """`meshlm serve --replicas R --nnodes N`: replica i's own rendezvous, at --rdzv-endpoint's port + i (every
    replica is one engine over the N nodes, its rank 0 on node 0); ValueError where that cannot be set up."""
    serving_ranks_per_node(args)
    if args.nnodes == 1:
        return []
    if args.node_rank is None:
        raise ValueError(f"--replicas={args.replicas} over --nnodes={args.nnodes} needs --node-rank (node 0 runs the "
                         "router and every replica's front); give each node its rank")
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) + args.replicas - 1 < 65536:
        raise ValueError(f"--rdzv-endpoint={args.rdzv_endpoint!r} must be HOST:PORT, with PORT .. PORT+"
                         f"{args.replicas - 1} free on node 0 (one rendezvous per replica)")
    return [f"{host}:{int(port) + i}" for i in range(args.replicas)]


def in_process_group(work, device_type: str, **init_kwargs) -> int:
    """`work()` on this rank of a launch, between the start of the process group (`init_distributed`'s
    `init_kwargs`) and its teardown; returns what `work` returns."""
    from meshlm.distributed import init_distributed, teardown_distributed

    init_distributed(device_type, **init_kwargs)
    try:
        code = work()
    except BaseException:
        teardown_distributed()  # no waiting for ranks that may never arrive: the launcher stops them
        raise
    teardown_distributed(wait=True)
    return code


def _check_tp_against_the_model(args) -> None:
    """--tp against the served model's sizes (`rules.check_tensor_parallel`, the ranks' own check), from its config
    alone -- a Hugging Face config.json or a meshlm checkpoint's meta.json -- so that a --tp the model cannot take
    is one line here, not one per rank after they start; a config that cannot be read is left to the ranks."""
    from meshlm.rules import check_tensor_parallel

    path = getattr(args, "model", None) or getattr(args, "checkpoint", None) or getattr(args, "hf", None)
    if not path or getattr(args, "tp", 1) <= 1:
        return
    try:
        cfg = _served_config(path)
    except Exception:  # noqa: BLE001 -- unreadable here: each rank reads and refuses it itself, by name
        return
    check_tensor_parallel(cfg, args.tp)


def _served_config(path):
    """The `ModelConfig` of a served model, without its weights."""
    from pathlib import Path

    from meshlm.checkpoint.find import config_from_dict, read_meta, resolve_checkpoint
    from meshlm.hf_config import read_hf_config

    if (Path(path) / "config.json").is_file():
        return read_hf_config(path)
    return config_from_dict(read_meta(resolve_checkpoint(path))["config"]).model
