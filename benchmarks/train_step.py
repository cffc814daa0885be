"""Time training steps of one model on one device and print JSON.

    python benchmarks/train_step.py --preset tiny --batch 8 --seq-len 256 --steps 10
    python benchmarks/train_step.py --preset llama3-8b --set num_layers=2 --device cuda --batch 2 --seq-len 4096

Prints tokens/s, step time (median of the timed steps), peak memory, and MFU against the device's
peak dense bf16 FLOP/s (on a GPU; on CPU the MFU is against --peak-tflops when given). The model is
meshlm's reference model, no parallelism: this is the single-device baseline every layout is compared to.
Beside it, "planner": what `meshlm plan` predicts for the same step on the cluster preset of this GPU
(--cluster, default by the device's name, as the planner reads a published table's GPU cell: every preset's
part, the H100 PCIe / NVL and H200 NVL cards included), as predicted / measured: the model's eager PyTorch step
(one memory pass per elementwise op, SDPA's flash kernel, fp32 norms), one device, no parallelism.

    python benchmarks/train_step.py --smoke      # preset tiny, 1 sequence of 16 tokens, one step (CI)

--smoke: the tiny preset, batch 1, 16 tokens, one timed step, no warmup, on the device --device picks (a
GPU where there is one); with --device cuda on a host without a GPU, a JSON saying so instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from _common import parse_args_smoke, print_smoke_skip  # benchmarks/ is on sys.path when run as a script
from _common import predicted_vs_measured
from meshlm.config import ModelConfig, _coerce
from meshlm.models import build_model
from meshlm.models.stats import flops_per_token
from meshlm.planner import published_rows
from meshlm.train.metrics import peak_tflops_guess


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a ModelConfig field, e.g. num_layers=2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak for MFU (default: by GPU name)")
    ap.add_argument("--cluster", default="auto",
                    help="planner cluster preset to predict the step on (default: by GPU name; none on CPU; 'none': skip)")
    args = parse_args_smoke(ap, dict(preset="tiny", batch=1, seq_len=16, steps=1, warmup=0))
    if args.smoke and args.device == "cuda" and not torch.cuda.is_available():
        print_smoke_skip("train_step", {"run": "--device cuda: this machine has no GPU"})
        return

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device == "cuda")
    overrides = {}
    for item in args.overrides:
        key, _, value = item.partition("=")
        overrides[key] = _coerce(ModelConfig, key, json.loads(value))
    cfg = ModelConfig.from_preset(args.preset, **overrides)
    cfg.max_seq_len = max(cfg.max_seq_len, args.seq_len)
    model = build_model(cfg, seed=0, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen).to(device)

    def step() -> float:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        step()
    times = [step() for _ in range(args.steps)]
    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq_len
    train_flops = 3 * flops_per_token(cfg, args.seq_len) * tokens_per_step
    peak = args.peak_tflops or (peak_tflops_guess(torch.device(device))[0] if device == "cuda" else 0.0)
    result = {
        "benchmark": "train_step", "smoke": args.smoke, "preset": args.preset, "overrides": overrides, "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "precision": "bf16" if bf16 else "fp32", "batch": args.batch, "seq_len": args.seq_len,
        "params": model.num_params(), "step_time_s": step_s, "tokens_per_s": tokens_per_step / step_s,
        "achieved_tflops": train_flops / step_s / 1e12,
        "mfu": (train_flops / step_s / (peak * 1e12)) if peak else None,
        "peak_memory_mib": (torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None,
    }
    cluster = cluster_of(args.cluster, result["device_name"])
    if cluster and bf16:
        predicted = planner_step_s(cfg, cluster, batch=args.batch, seq_len=args.seq_len)
        result["planner"] = {"cluster": cluster, **predicted_vs_measured(
            {"step_time_s": (predicted, step_s), "tokens_per_s": (tokens_per_step / predicted, tokens_per_step / step_s)})}
    if device == "cpu":
        import resource

        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result, indent=2))


def cluster_of(choice: str, device_name: str) -> str | None:
    """The planner preset to predict on: `choice` unless "auto"; else the preset `device_name` names, read as the
    planner reads a published table's GPU cell (published_rows.cluster_of); None for a GPU without one."""
    if choice != "auto":
        return None if choice == "none" else choice
    try:
        return published_rows.cluster_of(device_name)
    except ValueError:
        return None


def planner_step_s(cfg: ModelConfig, cluster: str, *, batch: int, seq_len: int) -> float:
    """The planner's seconds for this benchmark's step: one device, bf16 autocast, eager elementwise work."""
    from meshlm.planner import get_cluster
    from meshlm.planner.cost import Job, Layout, estimate

    job = Job(seq_len=seq_len, global_batch_size=batch, precision="bf16", flash_attention=True,
              flash_attention_2=True, fused_elementwise=False)
    return estimate(cfg, get_cluster(cluster), job, Layout(dp_shard=1, micro_batch_size=batch), gpus=1).time_s["step"]

if __name__ == "__main__":
    main()
