"""Planner vs measured step time on this machine (`--cluster local`), printed as JSON.

Uses the calibration file written by `meshlm plan calibrate` (runs it first when the file is
missing), then times real CPU training steps (forward, backward, AdamW; fp32; one thread per rank)
and compares each with the planner's prediction for the same model, batch and layout.

Today only world-1 layouts run: the multi-rank strategies (DP/ZeRO, TP, PP) are not in
`meshlm.parallel` yet. TODO(planner): add rows for dp=2, ZeRO-1/2/3 at world 2-4, tp=2 and pp=2 as
each strategy lands (launch them with the trainer's --nproc), and compare predicted model-state
bytes with each rank's exactly counted bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from meshlm.config import ModelConfig
from meshlm.models import build_model
from meshlm.planner import estimate
from meshlm.planner.cluster import get_cluster

CASES = [  # (model overrides of the tiny preset, batch, seq_len)
    (dict(), 4, 128),
    (dict(), 8, 256),
    (dict(num_layers=8), 4, 256),
    (dict(hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536), 4, 128),
]


def measure(cfg: ModelConfig, batch: int, seq_len: int, *, steps: int = 3) -> float:
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    times = []
    for i in range(steps + 1):
        t = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step pays one-time allocation
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default="plan_calibration.json")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not Path(args.calibration).exists():
        from meshlm.planner.calibrate import calibrate

        calibrate(args.calibration, world_size=2)
    local = get_cluster("local", calibration=args.calibration)
    rows = []
    for overrides, batch, seq in CASES:
        cfg = ModelConfig.from_preset("tiny", **overrides)
        cfg.max_seq_len = max(cfg.max_seq_len, seq)
        measured = measure(cfg, batch, seq, steps=args.steps)
        est = estimate(cfg, local, gpus=1, layout=f"dp_shard=1,micro_batch_size={batch}", seq_len=seq,
                       global_batch_size=batch, precision="fp32")
        rows.append({"model": f"tiny{overrides or ''}", "batch": batch, "seq_len": seq, "layout": "world 1",
                     "measured_s": round(measured, 5), "predicted_s": round(est.time_s["step"], 5),
                     "ratio_predicted_over_measured": round(est.time_s["step"] / measured, 3)})
    ratios = [r["ratio_predicted_over_measured"] for r in rows]
    print(json.dumps({"cluster": {"matmul_flops": local.peak("fp32"), "link_bandwidth": local.scaleup_bw,
                                  "link_latency": local.scaleup_latency},
                      "rows": rows, "median_ratio": statistics.median(ratios),
                      "pending": "multi-rank layouts (dp, ZeRO-1/2/3, tp, pp at world 2-4): strategies not built yet"},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
