"""The `meshlm` command line: train, verify, generate, eval, plot, config, info, plan, serve, convert, rag, cluster.

Responsible for: argument parsing, turning user mistakes (ValueError and subclasses) into one clear
line on stderr with exit code 2, and dispatching to the library. Heavy imports (torch) happen inside
the command that needs them so `meshlm --help` is instant.
Not responsible for: any logic of its own beyond wiring; starting ranks (launch.py).
"""

from __future__ import annotations

import argparse
import sys

from meshlm.launch import launch_emulated, launch_ranks, run_torchrun

EPILOG = """examples:
  meshlm train                                   # tiny model on the Python stdlib sources, CPU ok
  meshlm train --set train.steps=50 --set train.lr=1e-3
  meshlm train --config configs/tiny.toml --resume
  meshlm train --nproc 4                         # 4 local data-parallel ranks
  meshlm verify --nproc 4 --set parallel.tp=2    # prove a layout against the single-process run
  meshlm generate --checkpoint runs/default --prompt "def fib(n):"
  meshlm eval --checkpoint runs/default          # loss and perplexity on the run's validation split
  meshlm plot runs/default --out loss.png        # loss, val loss, tokens/s, communication share
  meshlm info --model llama3-70b
"""


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train", help="train a model (single process, or N local ranks with --nproc)",
        description="Train a model. With no arguments: the `tiny` preset on the embedded default corpus "
                    "(the Python standard library sources of this interpreter), a few minutes on a laptop CPU. "
                    "Settings come from the defaults, then --config (TOML), then each --set in order.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="override examples: --set model.preset=tiny-moe --set train.steps=200 --set train.run_dir=runs/x\n"
               "sections: model, parallel, train, data (`meshlm config` prints every field, with its meaning)")
    p.add_argument("--config", metavar="FILE", help="TOML config file ([model], [parallel], [train], [data])")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one field, e.g. train.lr=3e-4 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue from <run_dir>/checkpoints/latest (bit-identical continuation under the same "
                        "layout; when that pointer is damaged, from the newest complete checkpoint); refuses "
                        "when there is none and never deletes anything")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh even though train.run_dir holds an earlier run's checkpoints (they are "
                        "deleted); without it such a run refuses")
    launch = p.add_argument_group(
        "launching ranks", "Passed to PyTorch's elastic launcher (torch.distributed.run), which starts "
        "--nproc ranks on this node. Under torchrun or srun (RANK/WORLD_SIZE set) leave these out.")
    launch.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="ranks on this node (CPU: gloo, one thread each; GPU: NCCL, one device each); "
                             "leave it out for one process")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a rank dies, restart all ranks up to R times; they resume from the newest "
                             "complete checkpoint of the run by themselves (default 0: the run fails)")
    launch.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="nodes taking part; each runs this command once (default 1)")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                        help="c10d rendezvous on the first node (needed with --nnodes > 1)")
    launch.add_argument("--rdzv-id", default="meshlm", metavar="ID",
                        help="job id shared by the nodes of one run (default meshlm)")
    launch.add_argument("--node-rank", type=int, default=None, metavar="R",
                        help="fix this node's rank (static rendezvous at --rdzv-endpoint) instead of "
                             "ranking nodes by arrival (c10d)")
    emulate = p.add_argument_group(
        "emulated nodes", "Rehearse a multi-node layout on this machine: each node a Linux network namespace "
        "(its --nproc ranks talk over its loopback), the nodes joined by links shaped with tc to "
        "--inter-node-bw each way. Needs root and iproute2 (ip, tc); everything is removed on exit. "
        "The same as `meshlm cluster emulate --nodes N --procs-per-node P --inter-node-bw RATE -- meshlm train ...`.")
    emulate.add_argument("--emulate-nodes", type=int, default=0, metavar="N",
                         help="emulate N nodes of --nproc ranks each (N >= 2; ranks 0..nproc-1 on node 0, ...)")
    emulate.add_argument("--inter-node-bw", metavar="RATE",
                         help="each node's link rate in each direction, tc units (1gbit, 100mbit, 125mbps)")
    emulate.add_argument("--inter-node-latency", metavar="TIME",
                         help="one-way delay on each node's link (1ms); needs the kernel's netem qdisc")


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify", help="prove a layout against the single-process run (loss, grad norm, weights)",
        description="Run the config for --steps steps twice from the same seed and data: on --nproc local\n"
                    "ranks with its [parallel] layout (through `meshlm train --nproc`), and on one process with\n"
                    "[parallel] reset to the defaults. Print per step the loss and the gradient norm of both and\n"
                    "their relative difference, and what each mesh axis moved; then the largest final weight\n"
                    "difference and the tensor that has it. Exit 0 when everything matches, 1 when something\n"
                    "does not, 2 for a layout that cannot run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  meshlm verify --nproc 2                                   # data parallel x 2\n"
               "  meshlm verify --nproc 4 --set parallel.tp=2               # tensor (+sequence) parallel x 2 DP\n"
               "  meshlm verify --nproc 4 --set parallel.zero_stage=3 --precision fp32 --json\n"
               "  meshlm verify --all-layouts --max-ranks 8 --sample 10 --moe  # a sample of every MoE layout\n"
               "fp64 (default): both runs entirely in float64, losses/grad norms within 1e-9 relative and "
               "weights within 1e-9 absolute, on any machine. fp32: the real dtype; losses/grad norms within "
               "1e-5, the weight difference reported only.")
    p.add_argument("--nproc", type=int, metavar="N", help="ranks of the layout, on this node (or --all-layouts)")
    p.add_argument("--all-layouts", action="store_true",
                   help="verify every (dp_replicate, dp_shard, tp, pp, cp, ep, zero_stage) of 2..--max-ranks ranks "
                        "that the build accepts for the config (seq 64, global batch 8, micro-batch 2 unless --set), "
                        "one line each, then a summary with what was refused and why")
    p.add_argument("--max-ranks", type=int, default=8, metavar="N", help="with --all-layouts: up to N ranks (default 8)")
    p.add_argument("--sample", type=int, default=0, metavar="K",
                   help="with --all-layouts: verify K layouts drawn at random (--seed), not all")
    p.add_argument("--seed", type=int, default=0, help="with --sample: which K (default 0)")
    p.add_argument("--moe", action="store_true", help="with --all-layouts: the tiny-moe preset (ep enumerated too)")
    p.add_argument("--config", metavar="FILE", help="TOML config file (as for train)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one field, e.g. parallel.tp=2 (repeatable)")
    p.add_argument("--steps", type=int, default=5, metavar="S", help="optimizer steps of each run (default 5)")
    p.add_argument("--precision", choices=["fp64", "fp32"], default="fp64",
                   help="fp64 (default): an exact proof; fp32: the real dtype, weights reported not judged")
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="keep the runs in DIR/reference and DIR/layout (default: a temporary directory, "
                        "removed when everything matches)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a meshlm checkpoint or a Hugging Face model",
                       description="Generate a continuation of --prompt on the inference engine "
                                   "(paged KV cache): one process, or --tp N x --cp M ranks.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a meshlm run dir or one of its checkpoints")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks on this node (started through torch's launcher; each holds 1/N of "
                        "the weights and of every KV block; default 1)")
    p.add_argument("--cp", type=int, default=1, metavar="M",
                   help="context-parallel ranks: every sequence's KV blocks spread over M ranks, so a context "
                        "M times one rank's cache is served (x --tp ranks in all; default 1)")


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval", help="loss and perplexity of a checkpoint or a Hugging Face model on a dataset",
        description="Evaluate a model: the mean token loss and perplexity (exp of the loss) over a dataset, by\n"
                    "default the run's validation split (its data.path and data.val_fraction), or all of --data.\n"
                    "Whole global batches (train.global_batch_size samples of train.seq_len tokens) are evaluated,\n"
                    "the same samples under every layout; --nproc N runs it on N local ranks with the layout of\n"
                    "--set parallel.* (any layout `meshlm train` accepts).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  meshlm eval --checkpoint runs/default                       # the run's validation split\n"
               "  meshlm eval --checkpoint runs/default --data my_corpus/ --json\n"
               "  meshlm eval --checkpoint runs/default --nproc 2 --set parallel.tp=2\n"
               "  meshlm eval --hf path/to/hf-model --data notes.txt --set train.seq_len=512")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a meshlm run dir or one of its checkpoints")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (config.json, safetensors, "
                                                 "tokenizer.json)")
    p.add_argument("--data", metavar="PATH", help="evaluate all of this text file, folder of text files or .jsonl "
                                                  "(default: the run's validation split)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a parallel/train/data field, e.g. train.global_batch_size=8 (repeatable)")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="ranks on this node (default: one process)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot", help="draw training runs (loss, validation loss, tokens/s, communication) into a PNG",
        description="Draw one or more training runs from their metrics.jsonl: loss and validation loss per step "
                    "(runs overlaid), tokens/s, and the share of each step spent in communication. "
                    "Needs matplotlib (pip install meshlm[plot]).",
        epilog="example: meshlm plot runs/dp2 runs/tp2 --out compare.png")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="train.run_dir of a run (holds metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")


def _add_config(sub) -> None:
    p = sub.add_parser(
        "config", help="print a config as commented TOML: every field, its value and what it does",
        description="Print the config `meshlm train` would run with these --config/--set, as TOML with every field "
                    "of every section and the comment the code gives it. With no arguments: the defaults, the "
                    "text of configs/tiny.toml.",
        epilog="examples:\n  meshlm config > my.toml                       # start a config of your own\n"
               "  meshlm config --set parallel.tp=2 --set train.steps=50",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="TOML config file (as for train)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one field (repeatable)")


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="parameter counts, FLOPs per token and weight memory of a model",
                       description="Describe a model: parameters (total, embedding, active per token for MoE), "
                                   "training FLOPs per token, and the memory its weights take.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="tiny", metavar="PRESET", help="a preset name (default tiny)")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory or config.json")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length for the attention FLOPs "
                                                           "(default: 4096, capped by the model's max)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Hugging Face model directory or a meshlm checkpoint: POST /v1/completions, "
                    "/v1/chat/completions (stream or not), GET /v1/models, /health, /metrics.")
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory or meshlm checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint except /health")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="largest request body accepted, in MiB (default 16); larger ones get 413")
    p.add_argument("--quiet", action="store_true",
                   help="do not log a line per request (method, path, status, tokens, latency)")
    p.add_argument("--rag", default=None, metavar="INDEX",
                   help="a `meshlm rag index` folder: requests with \"rag\": {\"top_k\": K} get passages put "
                        "before their prompt and a \"retrieved\" list in the response")
    p.add_argument("--rag-top-k", type=int, default=4, help="passages per request when it does not say (default 4)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV block (default 32)")
    p.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV cache memory in MiB (default 256)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default 2048)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (each holds 1/N of the weights and of every KV block; default 1)")
    p.add_argument("--cp", type=int, default=1, metavar="M",
                   help="context-parallel ranks (every sequence's KV blocks spread over M ranks; x --tp ranks in "
                        "all, started through torch's launcher; --kv-cache-mb is per rank; default 1)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default: cuda when present, in bf16; else cpu in fp32), cpu or cuda")
    p.add_argument("--collective-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="with --tp/--cp: how long a rank waits in a step's collective for the others before the "
                        "server reports the engine broken (default 600); an idle server keeps its ranks alive "
                        "with a small message a second, so idling longer than this is fine")


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a meshlm checkpoint to a Hugging Face folder, or the other way",
        description="Convert between meshlm training checkpoints and Hugging Face model directories.\n\n"
                    "--to-hf OUT_DIR: INPUT is a meshlm run directory (its checkpoints/latest), its checkpoints/\n"
                    "  folder or one step_N checkpoint, trained under any layout. OUT_DIR gets config.json (llama,\n"
                    "  qwen2 or qwen3 when dense; mixtral, qwen2_moe or qwen3_moe for MoE: whichever expresses the\n"
                    "  model config exactly), model.safetensors and the run's tokenizer.json if it had one; it\n"
                    "  loads with transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR). A model no Hugging\n"
                    "  Face type expresses is refused, naming the model field.\n"
                    "--to-meshlm RUN_DIR: INPUT is a Hugging Face directory (config.json + safetensors; llama,\n"
                    "  mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe). RUN_DIR gets a complete checkpoint\n"
                    "  at step 0 (the weights, a fresh optimizer state, its tokenizer.json) and config.toml (the\n"
                    "  run's config); fine-tune with `meshlm train --config RUN_DIR/config.toml --resume`, or\n"
                    "  generate from it at once. The data, train.seed and train.global_batch_size are fixed here\n"
                    "  (--set): the checkpoint's data loader position refers to them.\n\n"
                    "An output directory that is not empty is refused unless --overwrite.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  meshlm convert runs/default --to-hf hf/tiny                # latest checkpoint of a run\n"
               "  meshlm convert runs/x/checkpoints/step_000100 --to-hf hf/x --dtype bfloat16\n"
               "  python -c \"import transformers as t; t.AutoModelForCausalLM.from_pretrained('hf/tiny')\"\n"
               "  meshlm convert ~/models/Qwen3-0.6B --to-meshlm runs/qwen3-ft \\\n"
               "      --set data.path=my_corpus/ --set train.steps=200 --set train.lr=1e-5\n"
               "  meshlm train --config runs/qwen3-ft/config.toml --resume      # fine-tune from those weights\n"
               "  meshlm generate --checkpoint runs/qwen3-ft --prompt \"Hello\"")
    p.add_argument("input", metavar="CHECKPOINT_OR_RUN_DIR|HF_DIR",
                   help="a meshlm run dir or checkpoint (with --to-hf), or a Hugging Face directory (with --to-meshlm)")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-hf", metavar="OUT_DIR", help="write a Hugging Face model directory")
    to.add_argument("--to-meshlm", metavar="RUN_DIR", help="write a meshlm run directory (checkpoint at step 0)")
    p.add_argument("--overwrite", action="store_true", help="replace what the output directory holds")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="--to-hf: dtype of the written weights (default: the checkpoint's, fp32 master weights)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="--to-meshlm: a train/data/parallel field of the new run, e.g. data.path=corpus/ "
                        "(repeatable; the model comes from the Hugging Face config)")


# Flags `cluster emulate` sets on each node's command itself (one node rank and rendezvous per namespace).
_NODE_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--emulate-nodes",
               "--inter-node-bw", "--inter-node-latency")


def _add_cluster(sub) -> None:
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
                    "fails or is interrupted. Needs Linux, root and iproute2 (ip, tc). The command is "
                    "`meshlm train ...` (the command that takes a node rank); leave out its --nproc/--nnodes/"
                    "--node-rank/--rdzv-endpoint, which are set per node.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  meshlm cluster emulate --nodes 2 --procs-per-node 2 --inter-node-bw 1gbit -- \\\n"
               "      meshlm train --set parallel.tp=2 --set train.steps=20\n"
               "calibrate the planner on the same emulation: meshlm plan calibrate --emulated --nodes 2 "
               "--nproc-per-node 2 --inter-node-bw 1gbit --out emu.json")
    e.add_argument("--nodes", type=int, required=True, metavar="N", help="emulated nodes (>= 2)")
    e.add_argument("--procs-per-node", type=int, required=True, metavar="P", help="ranks on each node (>= 1)")
    e.add_argument("--inter-node-bw", required=True, metavar="RATE",
                   help="each node's link rate in each direction, tc units (1gbit, 100mbit, 125mbps)")
    e.add_argument("--inter-node-latency", metavar="TIME",
                   help="one-way delay on each node's link (1ms); needs the kernel's netem qdisc, refused "
                        "where it is missing")
    e.add_argument("node_command", nargs=argparse.REMAINDER, metavar="-- meshlm train ...",
                   help="the command each node runs")


def cmd_cluster(args) -> int:
    """`meshlm cluster emulate ... -- meshlm train ...`: the train command, validated here, run by
    `launch.launch_emulated` (the one implementation, also behind `meshlm train --emulate-nodes`)."""
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
    if inner[0] != "train":
        raise ValueError(f"`meshlm {inner[0]}` takes no node rank; cluster emulate runs `meshlm train ...` "
                         "(for the planner: meshlm plan calibrate --emulated)")
    given = [a.split("=", 1)[0] for a in inner if a.split("=", 1)[0] in _NODE_FLAGS]
    if given:
        raise ValueError(f"drop {', '.join(given)} from the node command: cluster emulate sets the ranks per node "
                         "(--procs-per-node), the node rank and the rendezvous of every node")
    from meshlm.config import load_config

    train = build_parser().parse_args(inner)
    train.argv = inner
    train.nproc, train.emulate_nodes = args.procs_per_node, args.nodes
    train.inter_node_bw, train.inter_node_latency = args.inter_node_bw, args.inter_node_latency
    cfg = load_config(train.config, train.overrides)
    return launch_emulated(train, cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshlm",
        description="Train and serve transformer LLMs across a mesh of devices: data parallelism (DDP, "
                    "ZeRO-1/2/3, hybrid), tensor + sequence parallelism, pipeline parallelism, expert parallelism "
                    "(MoE all-to-all), context parallelism (ring attention) and activation recomputation on one "
                    "device mesh, each layout verifiable against one process (meshlm verify); sharded checkpoints "
                    "that reload under any layout; a planner; a paged-KV inference engine on one device or "
                    "several (--tp, --cp), with an OpenAI-compatible server and retrieval.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    from meshlm import __version__

    parser.add_argument("--version", action="version", version=f"meshlm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_verify(sub)
    _add_generate(sub)
    _add_eval(sub)
    _add_plot(sub)
    _add_config(sub)
    _add_info(sub)
    from meshlm.planner.cli import add_plan_parser

    add_plan_parser(sub)
    _add_serve(sub)
    _add_convert(sub)
    _add_cluster(sub)
    from meshlm.infer.rag import add_rag_parser

    add_rag_parser(sub)
    return parser


def cmd_train(args) -> int:
    from meshlm.config import load_config
    from meshlm.checkpoint import check_run_dir
    from meshlm.distributed import launched_ranks, read_launch_env
    from meshlm.train.metrics import check_trackers

    cfg = load_config(args.config, args.overrides)
    check_trackers(tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb)  # before any rank or work
    under_launcher = launched_ranks()  # torchrun, or one task of a multi-task srun step
    emulating = args.emulate_nodes or args.inter_node_bw or args.inter_node_latency
    if emulating and args.nproc is None:
        raise ValueError("--emulate-nodes/--inter-node-bw/--inter-node-latency need --nproc N (ranks per node)")
    if args.nproc is not None:
        if under_launcher:
            raise ValueError(f"--nproc was given but this process is already one of {read_launch_env()[1]} "
                             "launched ranks; drop --nproc under torchrun/srun")
        if emulating:
            return launch_emulated(args, cfg)
        return launch_ranks(args, cfg)
    if args.nnodes != 1 or args.rdzv_endpoint or args.node_rank is not None:
        raise ValueError("--nnodes/--rdzv-endpoint/--node-rank need --nproc N (ranks per node)")
    _, world_size, _ = read_launch_env()
    from meshlm.distributed import restart_count
    from meshlm.parallel.parallelize import check_layout
    from meshlm.checkpoint import has_complete_checkpoint

    check_layout(cfg, world_size)  # before the process group: a bad layout fails fast, with one line
    resume, overwrite, restarts = args.resume, args.overwrite, restart_count() if under_launcher else 0
    if restarts:
        # The launcher restarted every rank after one failed (--max-restarts): continue from the newest
        # complete checkpoint of this run, or, if it died before the first one, start it again.
        resume = has_complete_checkpoint(cfg.train.run_dir)
        overwrite = not resume
    check_run_dir(cfg.train.run_dir, resume=resume, overwrite=overwrite, model=cfg.model)
    return _train_this_rank(cfg, resume=resume, overwrite=overwrite, distributed=under_launcher, restarts=restarts)


def _train_this_rank(cfg, *, resume: bool, overwrite: bool, distributed: bool, restarts: int = 0) -> int:
    import os

    from torch.distributed.elastic.multiprocessing.errors import record

    run = _run_rank
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        # Started by torch elastic: an exception also goes to the error file it names, so that the
        # launcher's last line can say why the first failed rank failed.
        run = record(_run_rank)
    return run(cfg, resume=resume, overwrite=overwrite, distributed=distributed, restarts=restarts)


def _run_rank(cfg, *, resume: bool, overwrite: bool, distributed: bool, restarts: int) -> int:
    from meshlm.distributed import exit_with_parent, init_distributed, teardown_distributed
    from meshlm.train.trainer import Trainer, resolve_device

    if distributed:
        exit_with_parent()  # a killed launcher takes its ranks with it (no orphans training on)
        init_distributed(resolve_device(cfg.train.device).type, timeout_s=cfg.parallel.collective_timeout_s)
    finished = False
    try:
        trainer = Trainer(cfg, resume=resume, overwrite=overwrite, restarts=restarts)
        trainer.train()
        if cfg.train.sample_tokens > 0:
            # Every rank generates (the same tokens: same weights, same seed): under ZeRO-3 each
            # forward gathers parameters collectively, so rank 0 cannot run it alone.
            prompt = "def "
            text = trainer.sample(prompt, max_new_tokens=cfg.train.sample_tokens)
            if trainer.is_main:
                print(f"--- sample ---\n{prompt}{text}\n--------------")
        if trainer.is_main and trainer.saved_step is not None:
            run_dir = cfg.train.run_dir
            print(f"checkpoint: {trainer.run_dir / 'checkpoints' / f'step_{trainer.saved_step:06d}'}\n"
                  f"next: meshlm generate --checkpoint {run_dir} --prompt \"def \"   |   "
                  f"meshlm eval --checkpoint {run_dir}   |   meshlm serve --model {run_dir}")
        finished = True
    finally:
        teardown_distributed(wait=finished)
    return 0


def cmd_verify(args) -> int:
    from meshlm import verify
    from meshlm.config import load_config
    from meshlm.distributed import launched_ranks

    if launched_ranks():
        raise ValueError("meshlm verify starts its own ranks (--nproc); run it outside torchrun/srun")
    if args.all_layouts:
        if args.nproc is not None or args.run_dir is not None or args.json:
            raise ValueError("--all-layouts chooses the ranks of every layout and reports one line each: drop "
                             "--nproc, --run-dir and --json (or verify one layout with --nproc)")
        if args.max_ranks < 2 or args.sample < 0:
            raise ValueError(f"--max-ranks={args.max_ranks} must be >= 2 and --sample={args.sample} >= 0")
        preset = ["model.preset=tiny-moe"] if args.moe else []
        cfg = load_config(args.config, [*preset, *verify.ALL_LAYOUTS_DEFAULTS, *args.overrides])
        return verify.main_all_layouts(cfg, max_ranks=args.max_ranks, sample=args.sample, seed=args.seed,
                                       steps=args.steps, precision=args.precision)
    if args.moe or args.sample:
        raise ValueError("--moe and --sample go with --all-layouts")
    if args.nproc is None:
        raise ValueError("meshlm verify needs --nproc N (the layout's ranks), or --all-layouts")
    cfg = load_config(args.config, args.overrides)
    return verify.main(cfg, nproc=args.nproc, steps=args.steps, precision=args.precision,
                       run_dir=args.run_dir, as_json=args.json)


def cmd_generate(args) -> int:
    from meshlm.distributed import init_distributed, launched_ranks, teardown_distributed
    from meshlm.infer.llm import LLM
    from meshlm.infer.sequence import SamplingParams

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.tp < 1 or args.cp < 1:
        raise ValueError(f"--tp={args.tp} and --cp={args.cp} must be >= 1")
    ranks = args.tp * args.cp
    if ranks > 1 and not launched_ranks():
        return run_torchrun(["--standalone", "--nproc-per-node", str(ranks)], args.argv)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_new_tokens, seed=args.seed)
    if ranks > 1:
        import torch

        init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    try:
        llm = LLM(args.checkpoint or args.hf, tp=args.tp, cp=args.cp)
        if llm.is_driver:
            try:
                _generate_and_print(llm, args, params)
            finally:
                llm.close()
    except BaseException:
        teardown_distributed()  # no waiting for ranks that may never arrive: the launcher stops them
        raise
    teardown_distributed(wait=True)
    return 0


def _generate_and_print(llm, args, params) -> None:
    if llm.tokenizer is None:
        raise ValueError(f"{args.checkpoint or args.hf!r} has no tokenizer (tokenizer.json); cannot encode --prompt")
    num_prompt = len(llm.tokenizer.encode(args.prompt))
    if num_prompt == 0:
        raise ValueError("--prompt encodes to no tokens; give some text")
    if num_prompt + args.max_new_tokens > llm.engine.max_model_len:
        raise ValueError(f"the prompt ({num_prompt} tokens) + --max-new-tokens={args.max_new_tokens} exceeds the "
                         f"model's context of {llm.engine.max_model_len} tokens; use --max-new-tokens <= "
                         f"{max(llm.engine.max_model_len - num_prompt, 0)}")
    result = llm.generate([args.prompt], params)[0]
    print(args.prompt + result.text)


def cmd_eval(args) -> int:
    from meshlm import evaluate
    from meshlm.distributed import launched_ranks

    if args.nproc is not None:
        if launched_ranks():
            raise ValueError("--nproc was given but this process is already one of several launched ranks; "
                             "drop --nproc under torchrun/srun")
        if args.nproc < 1:
            raise ValueError(f"--nproc={args.nproc} must be >= 1")
        from meshlm.parallel.parallelize import check_layout

        cfg, _ = evaluate.eval_config(checkpoint=args.checkpoint, hf=args.hf, data=args.data,
                                      overrides=args.overrides, checksums=False)  # the ranks verify it
        check_layout(cfg, args.nproc)  # before any rank starts
        rank_args = ["eval", *(["--checkpoint", args.checkpoint] if args.checkpoint else ["--hf", args.hf]),
                     *(["--data", args.data] if args.data else []),
                     *[a for o in args.overrides for a in ("--set", o)], *(["--json"] if args.json else [])]
        return run_torchrun(["--nnodes", "1", "--nproc-per-node", str(args.nproc), "--standalone"], rank_args)
    if not launched_ranks():
        print(evaluate.format_result(evaluate.evaluate(checkpoint=args.checkpoint, hf=args.hf, data=args.data,
                                                       overrides=args.overrides), as_json=args.json))
        return 0
    from meshlm.distributed import exit_with_parent, init_distributed, teardown_distributed

    exit_with_parent()  # a killed launcher takes its ranks with it
    prepared = evaluate.eval_config(checkpoint=args.checkpoint, hf=args.hf, data=args.data, overrides=args.overrides)
    from meshlm.train.trainer import resolve_device

    cfg = prepared[0]
    env = init_distributed(resolve_device(cfg.train.device).type, timeout_s=cfg.parallel.collective_timeout_s)
    finished = False
    try:
        result = evaluate.evaluate(data=args.data, prepared=prepared)
        if env.rank == 0:
            print(evaluate.format_result(result, as_json=args.json), flush=True)
        finished = True
    finally:
        teardown_distributed(wait=finished)
    return 0


def cmd_plot(args) -> int:
    from meshlm.plot import plot_runs

    runs = plot_runs(args.run_dirs, args.out)
    print(f"wrote {args.out}: loss and validation loss, tokens/s and communication share of {len(runs)} run(s)")
    for run in runs:
        print(f"  {run.summary()}")
    return 0


def cmd_config(args) -> int:
    from meshlm.config import load_config
    from meshlm.config_doc import reference_toml, render_config

    if args.config is None and not args.overrides:
        sys.stdout.write(reference_toml())
        return 0
    cfg = load_config(args.config, args.overrides)
    what = " ".join([*(["--config", args.config] if args.config else []), *[f"--set {o}" for o in args.overrides]])
    sys.stdout.write(render_config(cfg, header=f"# written by `meshlm config {what}`: meshlm train --config <this file>"))
    return 0


def cmd_info(args) -> int:
    import json

    from meshlm.config import ModelConfig
    from meshlm.models.stats import count_params, flops_per_token

    cfg = ModelConfig.from_hf(args.hf) if args.hf else ModelConfig.from_preset(args.model)
    seq_len = args.seq_len or min(4096, cfg.max_seq_len)
    params = count_params(cfg)
    flops = flops_per_token(cfg, seq_len)
    info = {"model": args.hf or args.model, "seq_len": seq_len, "params": params,
            "train_flops_per_token": 3 * flops, "forward_flops_per_token": flops,
            "weights_gib": {"fp32": params["total"] * 4 / 2**30, "bf16": params["total"] * 2 / 2**30}}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model            {info['model']}  ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads} heads / {cfg.num_kv_heads} kv heads, vocab {cfg.vocab_size}"
          + (f", {cfg.num_experts} experts top-{cfg.num_experts_per_token}" if cfg.is_moe else "") + ")")
    for key, value in params.items():
        print(f"params.{key:<11} {value:>20,}  ({value / 1e9:.3f} B)")
    print(f"FLOPs/token      {3 * flops:>20.4g}  training (fwd+bwd) at seq_len {seq_len}; forward {flops:.4g}")
    print(f"weights          {info['weights_gib']['bf16']:>20.2f}  GiB in bf16 "
          f"({info['weights_gib']['fp32']:.2f} GiB fp32)")
    return 0


def cmd_plan(args) -> int:
    from meshlm.planner.cli import run_plan

    return run_plan(args)


def require_extra(extra: str, *modules: str) -> None:
    """Raise ValueError naming the pip extra that brings `modules` when one of them is missing."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"this command needs {', '.join(missing)} (the [{extra}] extra): "
                         f"pip install -e \".[{extra}]\" (or pip install meshlm[{extra}])")


def cmd_serve(args) -> int:
    require_extra("serve", "fastapi", "uvicorn")
    from meshlm.distributed import init_distributed, launched_ranks, teardown_distributed
    from meshlm.infer.server import run_serve

    if args.tp < 1 or args.cp < 1:
        raise ValueError(f"--tp={args.tp} and --cp={args.cp} must be >= 1")
    ranks = args.tp * args.cp
    if ranks == 1:
        return run_serve(args)
    if not launched_ranks():
        return run_torchrun(["--standalone", "--nproc-per-node", str(ranks)], args.argv)
    import torch

    if args.collective_timeout <= 0:
        raise ValueError(f"--collective-timeout={args.collective_timeout} must be > 0 seconds")
    init_distributed("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu",
                     timeout_s=args.collective_timeout)
    try:
        code = run_serve(args)
    except BaseException:
        teardown_distributed()
        raise
    teardown_distributed(wait=True)
    return code


def cmd_rag(args) -> int:
    require_extra("rag", "bm25s")
    from meshlm.infer.rag import run_rag

    return run_rag(args)


def cmd_convert(args) -> int:
    from meshlm import convert

    if args.to_hf is not None:
        if args.overrides:
            raise ValueError("--set applies to --to-meshlm only (the checkpoint's config is what is exported)")
        info = convert.to_hf(args.input, args.to_hf, overwrite=args.overwrite, dtype=args.dtype)
        for note in info["notes"]:
            print(f"meshlm convert: note: {note}", file=sys.stderr)
        tokenizer = {"tokenizer.json": "its tokenizer.json", "bytes": "a tokenizer.json of its byte tokenizer",
                     None: "no tokenizer"}[info["tokenizer"]]
        print(f"wrote {info['to']}: {info['architecture']} ({info['model_type']}, {info['dtype']}) from "
              f"{info['from']} (step {info['step']}), with {tokenizer}")
        return 0
    if args.dtype is not None:
        raise ValueError("--dtype applies to --to-hf only (a meshlm checkpoint keeps fp32 master weights)")
    info = convert.to_meshlm(args.input, args.to_meshlm, overwrite=args.overwrite, overrides=args.overrides)
    print(f"wrote {info['checkpoint']} ({info['model_type']} from {info['from']}, step 0, tokenizer: "
          f"{info['tokenizer']})\nfine-tune: meshlm train --config {info['config']} --resume")
    return 0


COMMANDS = {"train": cmd_train, "verify": cmd_verify, "generate": cmd_generate, "eval": cmd_eval, "plot": cmd_plot,
            "config": cmd_config, "info": cmd_info, "plan": cmd_plan, "serve": cmd_serve, "convert": cmd_convert,
            "rag": cmd_rag, "cluster": cmd_cluster}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what ranks started by a launcher run again
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args)
    except ValueError as e:  # user mistakes: one line, no traceback
        print(f"meshlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"meshlm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
