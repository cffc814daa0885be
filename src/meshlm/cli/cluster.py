"""`meshlm cluster`: a meshlm command (train, generate, serve) on an emulated multi-node cluster on this machine."""

from __future__ import annotations

import argparse

from meshlm.launch import NODE_FLAGS, check_emulation, launch_emulated, run_emulated

_NODE_FLAGS = ("--nproc", *NODE_FLAGS, "--emulate-nodes", "--inter-node-bw", "--inter-node-latency")


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="run a meshlm command on an emulated multi-node cluster on this machine")
    csub = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    e = csub.add_parser(
        "emulate", help="emulated nodes (network namespaces, shaped links) each running the given command",
        description="Create --nodes Linux network namespaces on this machine, one per node, joined through a "
                    "bridge by links shaped with tc (tbf) to --inter-node-bw in each direction; run the command "
                    "after -- once in each namespace as that node (torch's launcher: --procs-per-node ranks, "
                    "node rank i, static rendezvous on node 0's address), with gloo bound to the node's link, so "
                    "ranks of one node talk over its loopback and ranks of different nodes over the shaped "
                    "link. The namespaces (with their links and qdiscs) are removed when the command ends, "
                    "fails or is interrupted; the bytes each node's link carried are printed at the end. Needs "
                    "Linux, root and iproute2 (ip, tc). The command is `meshlm train ...`, or `meshlm generate|serve "
                    "...` whose --tp x --cp ranks (with serve --prefill/--decode: both instances' ranks, the prefill "
                    "instance's on the first nodes) equal --nodes x --procs-per-node (rank 0, the engine and the HTTP "
                    "front, on node 0: reach a server with `ip netns exec NAMESPACE ...`, the namespaces being "
                    "printed first); leave out its --nproc/--nnodes/--node-rank/--rdzv-endpoint, which are set per "
                    "node.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  meshlm cluster emulate --nodes 2 --procs-per-node 2 --inter-node-bw 1gbit -- \\\n"
               "      meshlm train --set parallel.tp=2 --set train.steps=20\n"
               "  meshlm cluster emulate --nodes 2 --procs-per-node 1 --inter-node-bw 1gbit -- \\\n"
               "      meshlm generate --hf DIR --prompt \"def \" --cp 2\n"
               "  meshlm cluster emulate --nodes 2 --procs-per-node 1 --inter-node-bw 1gbit -- \\\n"
               "      meshlm serve --model DIR --prefill tp=1 --decode tp=1   # prefill on node 0, decode on node 1\n"
               "calibrate the planner on the same emulation: meshlm plan calibrate --emulated --nodes 2 "
               "--nproc-per-node 2 --inter-node-bw 1gbit --out emu.json")
    e.add_argument("--nodes", type=int, required=True, metavar="N", help="emulated nodes (>= 2)")
    e.add_argument("--procs-per-node", type=int, required=True, metavar="P", help="ranks on each node (>= 1)")
    e.add_argument("--inter-node-bw", required=True, metavar="RATE",
                   help="each node's link rate in each direction, tc units (1gbit, 100mbit, 125mbps)")
    e.add_argument("--inter-node-latency", metavar="TIME",
                   help="one-way delay on each node's link (1ms); needs the kernel's netem qdisc, refused "
                        "where it is missing")
    e.add_argument("node_command", nargs=argparse.REMAINDER, metavar="-- meshlm train|generate|serve ...",
                   help="the command each node runs")


def run(args) -> int:
    """`meshlm cluster emulate ... -- meshlm train|generate|serve ...`: the node command, validated here, run by
    `launch.run_emulated` (the one implementation, also behind `meshlm train --emulate-nodes`)."""
    if args.cluster_command != "emulate":
        raise ValueError("say what to do: meshlm cluster emulate --nodes N --procs-per-node P --inter-node-bw "
                         "RATE -- meshlm train ...")
    inner = list(args.node_command)
    if inner[:1] == ["--"]:
        inner = inner[1:]
    if inner[:1] == ["meshlm"]:
        inner = inner[1:]
    if not inner:
        raise ValueError("give the command each node runs after --, e.g. -- meshlm train --set parallel.tp=2")
    if inner[0] not in ("train", "generate", "serve"):
        raise ValueError(f"`meshlm {inner[0]}` takes no node rank; cluster emulate runs `meshlm train|generate|serve "
                         "...` (for the planner: meshlm plan calibrate --emulated)")
    given = [a.split("=", 1)[0] for a in inner if a.split("=", 1)[0] in _NODE_FLAGS]
    if given:
        raise ValueError(f"drop {', '.join(given)} from the node command: cluster emulate sets the ranks per node "
                         "(--procs-per-node), the node rank and the rendezvous of every node")
    from meshlm.cli import build_parser

    node = build_parser().parse_args(inner)
    node.argv = inner
    node.nproc, node.emulate_nodes = args.procs_per_node, args.nodes
    node.inter_node_bw, node.inter_node_latency = args.inter_node_bw, args.inter_node_latency
    if inner[0] == "train":
        from meshlm.config import load_config

        return launch_emulated(node, load_config(node.config, node.overrides))
    return _emulate_serving(node, inner)


def _emulate_serving(node, inner: list[str]) -> int:
    """`meshlm generate|serve` on the emulated nodes: its --tp x --cp ranks, --procs-per-node on each node."""
    from meshlm.cli.common import server_ranks

    ranks, what = server_ranks(node)
    if ranks != node.nproc * node.emulate_nodes:
        raise ValueError(f"{what}, but --nodes {node.emulate_nodes} x --procs-per-node {node.nproc} = "
                         f"{node.nproc * node.emulate_nodes}; make them equal")
    if getattr(node, "replicas", 1) != 1:
        raise ValueError("--replicas starts its servers on one node; leave it out of an emulated serve")
    rate, latency = check_emulation(node)
    return run_emulated(node, inner[0], inner[1:], rate_bps=rate, latency_s=latency)
