"""`meshlm train`: one process, local ranks (--nproc), an emulated cluster, or a rank of torchrun/srun."""

from __future__ import annotations

import argparse
import os
import shlex

from meshlm.cli.common import add_node_arguments
from meshlm.launch import launch_emulated, launch_ranks


def add_parser(sub) -> None:
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
                        "deleted; a run_dir holding files meshlm did not write is refused); without it such a run "
                        "refuses")
    p.add_argument("--no-memory-check", action="store_true",
                   help="start even where the planner predicts that a rank's memory cannot hold the run (without "
                        "it such a run is refused before any rank starts, naming the bytes by part and the fixes)")
    launch = p.add_argument_group(
        "launching ranks", "Passed to PyTorch's elastic launcher (torch.distributed.run), which starts "
        "--nproc ranks on this node. Under torchrun or srun (RANK/WORLD_SIZE set) leave these out.")
    launch.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="ranks on this node (CPU: gloo, one thread each; GPU: NCCL, one device each); "
                             "leave it out for one process")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a rank dies, restart all ranks up to R times; they resume from the newest "
                             "complete checkpoint of the run by themselves (default 0: the run fails)")
    launch.add_argument("--replica-groups", type=int, default=0, metavar="N",
                        help="fault tolerance on torchft: N replica groups of --nproc ranks, each its own launcher "
                             "job (restarted alone, --max-restarts), and a lighthouse for their per-step quorum; a "
                             "failed group drops out while the others step on, and rejoins from a live one")
    add_node_arguments(launch)
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


def run(args) -> int:
    from meshlm.config import load_config
    from meshlm.checkpoint import check_run_dir
    from meshlm.distributed import launched_ranks, read_launch_env, srun_agent
    from meshlm.train.metrics import check_trackers

    cfg = load_config(args.config, args.overrides)
    check_trackers(tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb)  # before any rank or work
    # torchrun, or one task of a multi-task srun step -- unless it is the one srun task of its node, there to
    # start the node's --nproc ranks itself (examples/slurm.sbatch)
    under_launcher = launched_ranks() and not (args.nproc is not None and srun_agent())
    if args.replica_groups:
        if under_launcher:
            raise ValueError("--replica-groups starts its own launchers; drop it under torchrun/srun")
        if args.emulate_nodes or args.inter_node_bw or args.inter_node_latency:
            raise ValueError("--replica-groups is not supported on emulated nodes; leave out --replica-groups or "
                             "the emulation (--emulate-nodes, --inter-node-bw, --inter-node-latency)")
        from meshlm.replica_launch import launch_replica_groups

        return launch_replica_groups(args, cfg)
    if cfg.parallel.fault_tolerance != "none":  # one torchft replica group: its own run_dir, a lighthouse to reach
        from meshlm.train.replica import check_lighthouse, replica_group_config

        cfg = replica_group_config(cfg)
        if not under_launcher:
            check_lighthouse(cfg.parallel.lighthouse)
    emulating = args.emulate_nodes or args.inter_node_bw or args.inter_node_latency
    if emulating and args.nproc is None:
        raise ValueError("--emulate-nodes/--inter-node-bw/--inter-node-latency need --nproc N (ranks per node)")
    if args.nproc is not None:
        if under_launcher:
            raise ValueError(f"--nproc was given but this process is already one of {read_launch_env()[1]} "
                             "launched ranks; drop --nproc under torchrun/srun")
        if emulating:
            return launch_emulated(args, cfg)  # each emulated node's launcher checks the memory
        return launch_ranks(args, cfg, preflight=lambda world: _check_memory(args, cfg, world, ranks_here=args.nproc,
                                                                             say=True))
    if args.nnodes != 1 or args.rdzv_endpoint or args.node_rank is not None:
        raise ValueError("--nnodes/--rdzv-endpoint/--node-rank need --nproc N (ranks per node)")
    _, world_size, _ = read_launch_env()
    from meshlm.distributed import restart_count
    from meshlm.parallel.parallelize import check_layout
    from meshlm.checkpoint import has_complete_checkpoint

    check_layout(cfg, world_size)  # before the process group: a bad layout fails fast, with one line
    # a launcher's ranks: its parent said it (--nproc), or each rank checks quietly (torchrun, srun)
    _check_memory(args, cfg, world_size, ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                  say=not under_launcher)
    resume, overwrite, restarts = args.resume, args.overwrite, restart_count() if under_launcher else 0
    if restarts:
        # The launcher restarted every rank after one failed (--max-restarts): continue from the newest
        # complete checkpoint of this run, or, if it died before the first one, start it again.
        resume = has_complete_checkpoint(cfg.train.run_dir)
        overwrite = not resume
    # After a restart the ranks may resume from their in-memory copies: checksumming the storage checkpoint here
    # would read all of it for nothing (the trainer verifies it before it ever loads from storage).
    check_run_dir(cfg.train.run_dir, resume=resume, overwrite=overwrite, model=cfg.model, checksums=not restarts)
    return _train_this_rank(cfg, resume=resume, overwrite=overwrite, distributed=under_launcher, restarts=restarts)


def _check_memory(args, cfg, world: int, *, ranks_here: int, say: bool) -> None:
    """Refuse a run whose ranks the planner predicts cannot hold it (`planner.preflight`), unless
    --no-memory-check; `say`: print the prediction's line."""
    if args.no_memory_check:
        return
    from meshlm.planner.preflight import check_train_memory

    line = check_train_memory(cfg, world, ranks_here=max(1, ranks_here))
    if say:
        print(line, flush=True)


def _train_this_rank(cfg, *, resume: bool, overwrite: bool, distributed: bool, restarts: int = 0) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    run = _run_rank
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        # Started by torch elastic: an exception also goes to the error file it names, so that the
        # launcher's last line can say why the first failed rank failed.
        run = record(_run_rank)
    return run(cfg, resume=resume, overwrite=overwrite, distributed=distributed, restarts=restarts)


def _run_rank(cfg, *, resume: bool, overwrite: bool, distributed: bool, restarts: int) -> int:
    from meshlm.data.chat import sample_prompt
    from meshlm.data.dataset import has_conversations
    from meshlm.data.sources import is_chat_jsonl
    from meshlm.distributed import exit_with_parent, init_distributed, teardown_distributed
    from meshlm.train.setup import resolve_device
    from meshlm.train.trainer import Trainer

    if cfg.parallel.fault_tolerance != "none":
        from meshlm.train.replica import ReplicaTrainer as Trainer
    if distributed:
        exit_with_parent()  # a killed launcher takes its ranks with it (no orphans training on)
        init_distributed(resolve_device(cfg.train.device).type, timeout_s=cfg.parallel.collective_timeout_s)
    finished = False
    try:
        trainer = Trainer(cfg, resume=resume, overwrite=overwrite, restarts=restarts)
        # Conversations: the reply to the first one's opening messages (its first user turn), as served;
        # prompts and completions given as texts: the first prompt's; prepared conversations: to "Hello".
        chats = is_chat_jsonl(cfg.data.path)
        hello = cfg.data.prepared and has_conversations(cfg.data)
        trainer.train()
        prompt, chat = ("", True) if chats or hello else ("def ", False)
        if cfg.train.sample_tokens > 0:
            # Every rank generates (the same tokens: same weights, same seed): under ZeRO-3 each
            # forward gathers parameters collectively, so rank 0 cannot run it alone.
            try:  # a prompt that fills model.max_seq_len, or that the template refuses: the run itself went well
                if chats:
                    prompt, chat = sample_prompt(cfg.data.path, trainer.tokenizer) or (prompt, chat)
                elif hello:
                    prompt = trainer.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
                text = f"{prompt}{trainer.sample(prompt, max_new_tokens=cfg.train.sample_tokens, chat=chat)}" \
                    if prompt else "(none: the first conversation has no prompt before a reply)"
            except ValueError as e:
                text = f"(none: {e})"
            if trainer.is_main:
                print(f"--- sample ---\n{text}\n--------------")
        if trainer.is_main and trainer.saved_step is not None:
            run_dir = cfg.train.run_dir
            ask = '--chat --prompt "Hello"' if chat else '--prompt "def "' if not chats \
                else f"--prompt {shlex.quote(prompt[:40])}"
            print(f"checkpoint: {trainer.run_dir / 'checkpoints' / f'step_{trainer.saved_step:06d}'}\n"
                  f"next: meshlm generate --checkpoint {run_dir} {ask}   |   "
                  f"meshlm eval --checkpoint {run_dir}   |   meshlm serve --model {run_dir}")
        finished = True
    finally:
        teardown_distributed(wait=finished)
    return 0
