"""`meshlm data prepare` and `meshlm data show`: the command lines of `meshlm.data.prepare` and `meshlm.data.show`.

Responsible for: `add_parser(subparsers)` (the `data` command and its subcommands `prepare` and `show`), `run(args)`,
and printing `show`'s samples (rich: the counted text green, or [[...]] when piped).
Not responsible for: the work itself (prepare.py, show.py).
"""

from __future__ import annotations

import argparse
import math
import sys

EPILOG = """examples:
  meshlm data prepare corpus/ --tokenizer tokenizer.json --out data/corpus
  meshlm data prepare a.jsonl.zst b.parquet --tokenizer tok/ --out data/ab --workers 8 --val-fraction 0.01
  meshlm data prepare dump.parquet --field content --tokenizer tokenizer.json --out data/dump
  meshlm data prepare chats.jsonl.zst --tokenizer models/qwen2.5/ --out data/chats --val-fraction 0.01

Conversations (.jsonl lines of {"messages": [...]}, or prompt/completion pairs: a file's first line says which
kind it holds; parquet files with a "messages" column, or "prompt" and "completion", "tools" a list or a JSON text)
are rendered by the chat template of the --tokenizer model folder and masked, the loss on the
assistant's turns, as training reads a .jsonl of them in memory; whether one may be split across samples is
data.split_across_samples at training time.

A rerun of the same command continues an interrupted one (finished shards are kept).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add `data` (with its subcommands `prepare` and `show`) to a `meshlm` subparsers object."""
    from meshlm.data.prepare import DEFAULT_SHARD_BYTES

    p = subparsers.add_parser("data", help="prepare corpora for training (tokenize once into token shards), and "
                                           "show samples as training reads them",
                              description="Work on training corpora.")
    sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    prep = sub.add_parser(
        "prepare", help="tokenize text, .jsonl(.gz/.zst) or .parquet sources into memory-mappable token shards",
        description="Tokenize SOURCEs once into token shards (flat uint16/uint32 arrays, a document index per "
                    "shard, manifest.json with sha256s) that training memory-maps. A folder is read recursively "
                    "in sorted order, every file but hidden ones (a name starting with '.'), the markers data jobs "
                    "write (_SUCCESS, _committed_*, _started_*, *.crc, parquet's _metadata and _common_metadata, "
                    "_temporary/, _delta_log/), empty files and binary ones (a NUL byte in the first 8 KiB), which are "
                    "counted in one line on stderr; a text file is one document; each .jsonl line and each parquet "
                    "row one document (its --field), or one conversation (see below).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    prep.add_argument("sources", nargs="+", metavar="SOURCE",
                      help="text files, folders, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files")
    prep.add_argument("--tokenizer", required=True, metavar="FILE",
                      help="the model's tokenizer.json (or a folder holding one)")
    prep.add_argument("--out", required=True, metavar="DIR", help="output folder (new, empty, or an unfinished run's)")
    prep.add_argument("--workers", type=int, default=1, metavar="N",
                      help="tokenizing processes, one core each (default %(default)s)")
    prep.add_argument("--field", default="text", metavar="NAME",
                      help="JSON key / parquet column holding the text (default %(default)s)")
    prep.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                      help="share of documents (chosen by a hash of their text; conversations: of their line) "
                           "written to a 'val' split "
                           "(default %(default)s: none)")
    prep.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_BYTES / 2**20, metavar="MB",
                      help="input MiB per shard, the unit of parallel work and of resuming (default %(default)s)")
    prep.add_argument("--all-tokens", action="store_true",
                      help="conversations: no loss masks, every token counts (for a chat template that rewrites "
                           "earlier turns; train with data.assistant_only_loss=false)")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")

    show = sub.add_parser(
        "show", help="print training samples as the model sees them, the targets that count in the loss marked",
        description="Print samples of what training reads from PATH -- a prepared folder, or any data.path "
                    "(a .jsonl of conversations is rendered by the --tokenizer model folder's chat template) -- "
                    "decoded, each token marked by whether predicting it counts in the loss (green, or [[...]] "
                    "with --no-color or piped): the assistant's turns of conversations, every token of texts.",
        epilog="example:\n  meshlm data show data/chats --seq-len 2048 --samples 3\n"
               "  meshlm data show chats.jsonl --tokenizer models/qwen2.5/ --seq-len 512",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("path", metavar="PATH", help="a prepared folder, or a file or folder training reads")
    show.add_argument("--tokenizer", metavar="FILE", default=None,
                      help="tokenizer.json or model folder (default: a prepared folder's own; bytes otherwise)")
    show.add_argument("--seq-len", type=int, default=128, metavar="L", help="train.seq_len (default %(default)s)")
    show.add_argument("--samples", type=int, default=2, metavar="N", help="how many (default %(default)s)")
    show.add_argument("--first", type=int, default=0, metavar="K", help="the first sample shown (default 0)")
    show.add_argument("--split", default="train", choices=("train", "val"), help="a prepared folder's split")
    show.add_argument("--split-across-samples", action="store_true",
                      help="data.split_across_samples=true: conversations packed back to back")
    show.add_argument("--all-tokens", action="store_true", help="data.assistant_only_loss=false")
    show.add_argument("--no-color", action="store_true",
                      help="mark counted text [[like this]] instead of green (the default when piped)")
    return p


def run(args) -> int:
    command = getattr(args, "data_command", None)
    if command == "show":
        return _show(args)
    if command != "prepare":
        print("usage: meshlm data prepare SOURCE... --tokenizer FILE --out DIR | meshlm data show PATH "
              "(meshlm data prepare --help, meshlm data show --help)", file=sys.stderr)
        return 2
    from meshlm.data.prepare import prepare

    if not (math.isfinite(args.shard_mb) and args.shard_mb * 2**20 >= 1):
        raise ValueError(f"--shard-mb={args.shard_mb} must be a positive number of MiB (input per shard), e.g. 128")
    summary = prepare(args.sources, tokenizer_path=args.tokenizer, out=args.out, workers=args.workers,
                      field=args.field, val_fraction=args.val_fraction,
                      shard_bytes=int(args.shard_mb * 2**20), progress=not args.no_progress,
                      assistant_only=not args.all_tokens)
    kind = "conversations" if summary.get("num_loss_tokens") else "documents"
    splits = ", ".join(f"{split} {summary['num_tokens'][split]:,} tokens in {summary['num_documents'][split]:,} "
                       f"{kind}" + (f" ({summary['num_loss_tokens'][split]:,} counted in the loss)" if
                                    summary.get("num_loss_tokens") else "") for split in summary["num_tokens"])
    done = (f"{summary['shards_written']} shards written, {summary['shards_skipped']} already there"
            if summary["shards_written"] else f"all {summary['num_shards']} shards were already there")
    print(f"{summary['out']}: {splits}; {done}; {summary['text_mb_per_s']} MB/s of text, "
          f"{summary['tokens_per_s']:,} tokens/s")
    return 0


def _show(args) -> int:
    from rich.console import Console
    from rich.text import Text

    from meshlm.data.show import open_samples, sample_runs

    for name in ("seq_len", "samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    samples, tokenizer = open_samples(args.path, tokenizer=args.tokenizer, seq_len=args.seq_len, split=args.split,
                                      assistant_only=not args.all_tokens, whole=not args.split_across_samples)
    if not len(samples):
        raise ValueError(f"{args.path} gives no sample of --seq-len {args.seq_len} + 1 tokens; pass a smaller "
                         "--seq-len")
    if not 0 <= args.first < len(samples):
        raise ValueError(f"--first={args.first}: {args.path} gives {len(samples)} samples of {args.seq_len + 1} "
                         f"tokens; pass 0..{len(samples) - 1}")
    console = Console(highlight=False, no_color=args.no_color, soft_wrap=True)
    brackets = args.no_color or not console.is_terminal  # piped: the marks must survive without colours
    for index in range(args.first, min(args.first + args.samples, len(samples))):
        runs, counted = sample_runs(samples, index, tokenizer)
        console.print(f"--- sample {index} of {len(samples)}: {counted} of {args.seq_len} targets count ---",
                      style="bold")
        text = Text()
        for piece, counts in runs:
            if counts and brackets:
                text.append(f"[[{piece}]]")
            else:
                text.append(piece, style="green" if counts else "dim")
        console.print(text)
    return 0
