"""`meshlm eval`: loss and perplexity of a checkpoint or a Hugging Face model."""

from __future__ import annotations

import argparse

from meshlm.launch import run_torchrun


def add_parser(sub) -> None:
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
    p.add_argument("--data", metavar="PATH", help="evaluate all of this text file, folder of text files, .jsonl "
                                                  "(of conversations: the loss on the assistant's turns, as training "
                                                  "takes it) or prepared folder (every split); default: the run's "
                                                  "validation split (a prepared folder's 'val' split)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a parallel/train/data field, e.g. train.global_batch_size=8 (repeatable)")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="ranks on this node (default: one process)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
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
    from meshlm.train.setup import resolve_device

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
