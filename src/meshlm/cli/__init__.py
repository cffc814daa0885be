"""The `meshlm` command line: train, data, verify, generate, eval, plot, config, info, plan, serve, convert, rag, cluster.

Every subcommand is a module of this package with `add_parser(subparsers)` and `run(args) -> int`; this file
builds the parser from them and dispatches. Responsible for: argument parsing, turning user mistakes
(ValueError and subclasses) into one clear line on stderr with exit code 2, a path that cannot be read or written
(an OSError naming a file) into one line with exit code 1, a closed pipe into a quiet exit 1, and dispatching to the
library.
Heavy imports (torch) happen inside `run`, so `meshlm --help` is instant. `python -m meshlm.cli` is the same
command (what torchrun starts on every rank).
Not responsible for: any logic of its own beyond wiring; starting ranks (launch.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# In the order `meshlm --help` lists them.
COMMANDS = ("train", "data", "verify", "generate", "eval", "plot", "config", "info", "plan", "serve", "convert",
            "rag", "cluster")


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
    for name in COMMANDS:
        importlib.import_module(f"meshlm.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what ranks started by a launcher run again
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return importlib.import_module(f"meshlm.cli.{args.command}").run(args)
    except ValueError as e:  # user mistakes: one line, no traceback
        print(f"meshlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"meshlm {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`meshlm plan ... | head`): stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush has nowhere to fail
        return 1
    except OSError as e:
        if e.filename is None:  # not a path the user named (a socket, a peer): the traceback says more
            raise
        # a path that cannot be read or written (a folder given for a file, a file in the way of a folder, no
        # permission, a full disk): one line naming it, as `cp` or `mkdir` say it
        where = f"{e.filename!s}" + (f" -> {e.filename2!s}" if e.filename2 else "")
        print(f"meshlm {args.command}: error: {where}: {e.strerror or e}", file=sys.stderr)
        return 1
