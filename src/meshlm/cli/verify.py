"""`meshlm verify`: a layout (or every layout) against the single-process run."""

from __future__ import annotations

import argparse

from meshlm.verify import MAX_STEPS

DEFAULT_MAX_RANKS, MAX_RANKS = 8, 64  # --all-layouts: ranks of the largest layouts enumerated, and their limit


def add_parser(sub) -> None:
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
    p.add_argument("--max-ranks", type=int, default=DEFAULT_MAX_RANKS, metavar="N",
                   help=f"with --all-layouts: up to N ranks (default %(default)s, at most {MAX_RANKS})")
    p.add_argument("--sample", type=int, default=0, metavar="K",
                   help="with --all-layouts: verify K layouts drawn at random (--seed), not all")
    p.add_argument("--seed", type=int, default=0, help="with --sample: which K (default 0)")
    p.add_argument("--moe", action="store_true", help="with --all-layouts: the tiny-moe preset (ep enumerated too)")
    p.add_argument("--config", metavar="FILE", help="TOML config file (as for train)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one field, e.g. parallel.tp=2 (repeatable)")
    p.add_argument("--steps", type=int, default=5, metavar="S",
                   help=f"optimizer steps of each run (default %(default)s, at most {MAX_STEPS})")
    p.add_argument("--precision", choices=["fp64", "fp32"], default="fp64",
                   help="fp64 (default): an exact proof; fp32: the real dtype, weights reported not judged")
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="keep the runs in DIR/reference and DIR/layout (default: a temporary directory, "
                        "removed when everything matches)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from meshlm import verify
    from meshlm.config import load_config
    from meshlm.distributed import launched_ranks

    if launched_ranks():
        raise ValueError("meshlm verify starts its own ranks (--nproc); run it outside torchrun/srun")
    if args.all_layouts:
        if args.nproc is not None or args.run_dir is not None or args.json:
            raise ValueError("--all-layouts chooses the ranks of every layout and reports one line each: drop "
                             "--nproc, --run-dir and --json (or verify one layout with --nproc)")
        if not 2 <= args.max_ranks <= MAX_RANKS:
            raise ValueError(f"--max-ranks={args.max_ranks} must be in 2..{MAX_RANKS}: every rank of a layout is a "
                             "process on this machine")
        if args.sample < 0:
            raise ValueError(f"--sample={args.sample} must be >= 0 (0: every layout)")
        preset = ["model.preset=tiny-moe"] if args.moe else []
        cfg = load_config(args.config, [*preset, *verify.ALL_LAYOUTS_DEFAULTS, *args.overrides])
        return verify.main_all_layouts(cfg, max_ranks=args.max_ranks, sample=args.sample, seed=args.seed,
                                       steps=args.steps, precision=args.precision)
    alone = [flag for flag, given in (("--moe", args.moe), ("--sample", args.sample), ("--seed", args.seed),
                                      ("--max-ranks", args.max_ranks != DEFAULT_MAX_RANKS)) if given]
    if alone:
        raise ValueError(f"{', '.join(alone)} go with --all-layouts")
    if args.nproc is None:
        raise ValueError("meshlm verify needs --nproc N (the layout's ranks), or --all-layouts")
    cfg = load_config(args.config, args.overrides)
    return verify.main(cfg, nproc=args.nproc, steps=args.steps, precision=args.precision,
                       run_dir=args.run_dir, as_json=args.json)
