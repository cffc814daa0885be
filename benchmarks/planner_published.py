"""Planner vs published Megatron-LM runs: predicted TFLOP/s per GPU against the reported figure.

Reads the published-runs CSV (default: ../shared/reference/published_runs_dev.csv relative to the
repository root; --csv to override), and for each row builds the model, cluster and layout it
describes, asks the planner for the step time, and converts it to TFLOP/s per GPU with the FLOP
count the row uses. Prints JSON: per-row prediction and error, and the median error.

Nothing is fitted to any row. The efficiencies are the per-GPU-type constants of
`meshlm.planner.cluster` (justified there). Per-row choices the paper leaves open are made by the
planner itself, never from the reported throughput:
  * micro-batch size (not given for these rows) and interleaving depth ("v not stated"): the
    fastest predicted choice that fits in memory (fastest overall if none fits);
  * the model: these are GPT models (learned positions, LayerNorm, 4h GeLU MLP, MHA). Ours is
    Llama-style, so the MLP is mapped to SwiGLU with intermediate = 2/3 * ffn, which has the same
    parameters and FLOPs per token; kv_heads = heads when not given;
  * attention kernels: runs from before FlashAttention (2022) materialise the s x s scores, so the
    planner is told `flash_attention=False` for them (read from the source's year);
  * FLOPs: rows whose `pct_peak_type` cites Megatron's eq. 3 (96 B s l h^2 (1 + s/6h + V/16lh), which
    counts the recomputed forward pass) are converted with eq. 3; others with the planner's hardware
    FLOPs of the row's recompute policy.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

from meshlm.config import ModelConfig
from meshlm.planner.cluster import get_cluster
from meshlm.planner.cost import Job, Layout, ModelSummary, estimate_layout, validate_layout

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CSV = REPO / ".." / "shared" / "reference" / "published_runs_dev.csv"


def _int(text: str, default: int | None = None) -> int | None:
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else default


def cluster_of(gpu: str) -> str:
    g = gpu.lower()
    for key, name in (("gb200", "gb200-nvl72"), ("b200", "b200"), ("h200", "h200"), ("h100", "h100"),
                      ("a100", "a100")):
        if key in g:
            return name
    raise ValueError(f"unknown GPU {gpu!r} in the CSV")


def model_of(row: dict) -> ModelConfig:
    heads = _int(row["heads"])
    ffn = _int(row["ffn"]) or 4 * _int(row["hidden"])
    return ModelConfig(vocab_size=_int(row["vocab"]), hidden_size=_int(row["hidden"]), num_layers=_int(row["layers"]),
                       num_heads=heads, num_kv_heads=_int(row["kv_heads"], heads),
                       intermediate_size=round(2 * ffn / 3), max_seq_len=_int(row["seq_len"]))


def recompute_of(text: str) -> str:
    t = (text or "").lower()
    if t.startswith("yes") or "full" in t:
        return "full"
    if "selective" in t:
        return "selective"
    return "none"


def eq3_flops_per_step(row: dict) -> float:
    B, s, l, h, V = (_int(row[k]) for k in ("gbs_seqs", "seq_len", "layers", "hidden", "vocab"))
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def predict_row(row: dict) -> dict:
    cfg = model_of(row)
    cluster = get_cluster(cluster_of(row["gpu"]))
    year = max((int(y) for y in re.findall(r"\b(20\d\d)\b", row["source"])), default=2024)
    job = Job(seq_len=_int(row["seq_len"]), global_batch_size=_int(row["gbs_seqs"]),
              precision="fp8" if "fp8" in row["precision"].lower() else "bf16", flash_attention=year >= 2022)
    n = _int(row["n_gpus"])
    tp, pp, cp, ep = (_int(row[k], 1) for k in ("tp", "pp", "cp", "ep"))
    dp = _int(row["dp"]) or n // (tp * pp * cp)
    zero = {"none": 0, "": 0}.get(row["zero_fsdp"].strip().lower(), 1)
    vpp_text = row["vpp"].strip().lower()
    if vpp_text.startswith("interleaved"):
        chunks = [c for c in range(2, 9) if pp * c <= cfg.num_layers]
        chunks = [_int(vpp_text[len("interleaved"):])] if _int(vpp_text[len("interleaved"):]) else chunks
        schedules = [("interleaved", c) for c in chunks]
    else:
        schedules = [("1f1b", _int(vpp_text, 1))] if pp > 1 else [("1f1b", 1)]
    mbs_list = [_int(row["mbs"])] if _int(row["mbs"]) else [1, 2, 4, 8]
    rc = recompute_of(row["recompute"])
    sp = row["sp"].strip().lower().startswith("yes")
    summary = ModelSummary.build(cfg, job.seq_len)
    candidates = []
    for mbs in mbs_list:
        for sched, v in schedules:
            lo = Layout(dp_shard=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero, pp_schedule=sched, pp_chunks=v,
                        micro_batch_size=mbs, sequence_parallel=sp, recompute=rc)
            try:
                m = validate_layout(cfg, job, lo, gpus=n)
            except ValueError:
                continue
            if sched == "interleaved" and m % pp:  # Megatron's interleaved schedule needs this
                continue
            candidates.append(estimate_layout(summary, cluster, job, lo, num_microbatches=m))
    if not candidates:
        return {"row_id": row["row_id"], "error": "no valid layout for the row's degrees"}
    fitting = [e for e in candidates if e.fits]
    best = min(fitting or candidates, key=lambda e: e.time_s["step"])
    step = best.time_s["step"]
    uses_eq3 = "eq.3" in row["pct_peak_type"]
    flops = eq3_flops_per_step(row) if uses_eq3 else summary.hw_flops_per_token[rc] * job.tokens
    predicted = flops / step / n / 1e12
    measured = float(row["tflops_per_gpu"])
    return {"row_id": row["row_id"], "model": row["model"], "gpus": n, "cluster": cluster.name,
            "layout": best.layout.short(), "fits": best.fits, "memory_gib": round(best.memory_gib["total"], 1),
            "flops_convention": "megatron-eq3" if uses_eq3 else "planner-hardware",
            "measured_tflops": measured, "predicted_tflops": round(predicted, 1),
            "error": round(predicted / measured - 1, 4),
            "time_breakdown": {k: round(v / step, 3) for k, v in best.time_s.items() if k != "step" and v > 0}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DEFAULT_CSV), help="published runs CSV")
    args = ap.parse_args(argv)
    path = Path(args.csv)
    if not path.exists():
        print(json.dumps({"skipped": f"published runs CSV not found at {path}; pass --csv"}))
        return 0
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    results = [predict_row(r) for r in rows]
    errors = [r["error"] for r in results if isinstance(r.get("error"), float)]
    print(json.dumps({
        "csv": str(path),
        "rows": results,
        "median_error": statistics.median(errors) if errors else None,
        "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
