"""`meshlm plot`: a run's metrics as a PNG."""

from __future__ import annotations




def add_parser(sub) -> None:
    p = sub.add_parser(
        "plot", help="draw training runs (loss, validation loss, tokens/s, communication) into a PNG",
        description="Draw one or more training runs from their metrics.jsonl: loss and validation loss per step "
                    "(runs overlaid), tokens/s, and the share of each step spent in communication. "
                    "Needs matplotlib (pip install matplotlib).",
        epilog="example: meshlm plot runs/dp2 runs/tp2 --out compare.png")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="train.run_dir of a run (holds metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the picture to write")


def run(args) -> int:
    from meshlm.plot import plot_runs

    runs = plot_runs(args.run_dirs, args.out)
    print(f"wrote {args.out}: loss and validation loss, tokens/s and communication share of {len(runs)} run(s)")
    for run in runs:
        print(f"  {run.summary()}")
    return 0
