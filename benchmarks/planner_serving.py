"""Serving planner vs published serving results: predicted output tokens/s, TTFT and TPOT against each row.

Reads benchmarks/data/serving_runs_dev.csv (its .md and benchmarks/data/README.md say where each row comes from;
--csv to override; where the file is missing, a JSON saying it was skipped, exit 0). --smoke: the first 3 rows
only, a check that the script runs. Each row is priced with its OWN deployment by `meshlm.planner.published_serving`
(`score_rows`; its docstring lists the choices the rows leave open), the planner's serving model
(`planner/serving.py`, `serving_modes.py`). Prints JSON: per-row predictions and errors (predicted / published - 1)
with the rest of `meshlm plan infer`'s fields for the deployment priced (per-GPU throughput, KV bytes per token,
longest context, requests that fit, power, joules per output token: `published_serving.plan_fields`),
and per group and overall the median |error| of throughput (output tokens/s; input tokens/s for prefill-only
rows), TTFT and TPOT where published. Rows the planner does not model are listed under "skipped" with the reason.

Nothing is fitted to any row: constants come from datasheets and kernel benchmarks (cluster.py) and engine
defaults (serving.py, published_serving.py). Other published serving results (the .md names them) are held out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshlm.planner.plot import plot_published_errors
from meshlm.planner.published_serving import read_rows, score_rows

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CSV = REPO / "benchmarks" / "data" / "serving_runs_dev.csv"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DEFAULT_CSV), help="published serving results CSV")
    ap.add_argument("--summary", action="store_true", help="print only the medians (no per-row detail)")
    ap.add_argument("--smoke", action="store_true", help="the first 3 rows only (a check that it runs)")
    ap.add_argument("--plot", metavar="PNG", help="also draw each group's rows' errors (predicted / measured - 1) of "
                    "throughput, TTFT and TPOT with their medians, beside the +-10%% and +-25%% bands")
    args = ap.parse_args(argv)
    path = Path(args.csv)
    if not path.exists():
        print(json.dumps({"skipped": f"{path} not found", "smoke": args.smoke}))
        return 0
    rows = read_rows(path)
    if args.smoke:
        rows = rows[:3]
    results, summary = score_rows(rows)
    out = {"smoke": args.smoke, "csv": str(path), "summary": summary}
    if not args.summary:
        out["rows"] = results
    if args.plot:
        panels: dict[str, dict[str, list[float]]] = {}
        for r in results:
            for metric in ("throughput", "ttft_ms", "tpot_ms"):
                if r.get(f"error_{metric}") is not None:
                    panels.setdefault(metric, {}).setdefault(r["group"], []).append(r[f"error_{metric}"])
        out["plot"] = str(plot_published_errors(panels, args.plot,
                                                title=f"planner vs published serving results ({path.name})"))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
