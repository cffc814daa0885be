"""`meshlm config`: the resolved configuration, or every setting documented."""

from __future__ import annotations

import argparse
import sys



def add_parser(sub) -> None:
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


def run(args) -> int:
    from meshlm.config import load_config
    from meshlm.config_doc import reference_toml, render_config

    if args.config is None and not args.overrides:
        sys.stdout.write(reference_toml())
        return 0
    cfg = load_config(args.config, args.overrides)
    what = " ".join([*(["--config", args.config] if args.config else []), *[f"--set {o}" for o in args.overrides]])
    sys.stdout.write(render_config(cfg, header=f"# written by `meshlm config {what}`: meshlm train --config <this file>"))
    return 0
