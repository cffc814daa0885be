"""`meshlm plan`: search layouts, estimate one, estimate serving, simulate a pipeline schedule, or calibrate
this machine.

Responsible for: the argument parser of the `plan` command (`add_parser`), turning flags into
the planner's inputs (`planner/inputs.py`: model preset or Hugging Face config.json, cluster, job sizes like
4M), and printing tables or JSON (`run` hands each subcommand to its own `run_*` function). User mistakes
raise ValueError; the top-level CLI prints them as one line with exit code 2.
Not responsible for: any estimate (see `cost.py`, `search.py`), or the serving subcommands' flags and
output (`cli/plan_serving.py`: `infer`, `context`).

  meshlm plan --model llama3-70b --cluster h100 --gpus 64 --seq-len 8192 --global-batch-tokens 4M
  meshlm plan estimate --model llama3-70b --gpus 64 --global-batch-tokens 4M --layout tp=8,pp=4,zero_stage=1 --json
  meshlm plan scale --model llama3-70b --cluster h100 --gpus 8:16384 --global-batch-tokens 2M --plot scale.png
  meshlm plan compare --model llama3-70b --gpus 1152 --cluster h100 --cluster gb200-nvl72 --global-batch-tokens 16M
  meshlm plan infer --model llama3-70b --cluster h100 --gpus 8 --layout tp=8 --input-len 8192 --output-len 256
  meshlm plan infer --model deepseek-v3 --cluster h200 --gpus 8 --precision fp8 --offline   # every layout ranked
  meshlm plan context --model llama3-405b --cluster gb200-nvl72 --context 1M --plot context.png
  meshlm plan calibrate --out plan_calibration.json
  meshlm plan schedule --pp 4 --microbatches 8 --schedule interleaved --chunks 2 --plot pp.png
  meshlm plan schedule --from-run runs/pp --plot measured.png     # a pp run's measured timeline
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from meshlm.cli.common import finite_float
from meshlm.cli.plan_serving import CLUSTER_CHOICES, add_serving_parsers, run_context, run_infer
from meshlm.files import check_picture_path
from meshlm.planner.inputs import job_operations, make_job, parse_size, resolve_model, runtime_of
from meshlm.planner.layout import ATTENTION_KERNELS, EP_DISPATCHERS, FP8_WEIGHTS
from meshlm.planner.mla import latent_attention
from meshlm.planner.recovery import PATHS as RECOVERY_PATHS

if TYPE_CHECKING:
    from meshlm.config import ModelConfig


# plan schedule: the most stages, and stages x micro-batches x chunks, it simulates (each answers in seconds)
MAX_SCHEDULE_STAGES, MAX_SCHEDULE_ACTIONS = 1024, 100_000


def _add_common(p: argparse.ArgumentParser, *, required: bool, gpus: str = "one") -> None:
    p.add_argument("--model", required=required, metavar="PRESET|CONFIG.json",
                   help="a model preset (e.g. llama3-70b) or a Hugging Face config.json")
    if gpus == "compare":
        p.add_argument("--cluster", action="append", required=True,
                       help="a cluster to compare; give it twice or more (e.g. --cluster h100 --cluster gb200-nvl72)")
    else:
        p.add_argument("--cluster", default="h100",
                       help=f"{CLUSTER_CHOICES} (default h100)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration file for --cluster local (default plan_calibration.json)")
    if gpus == "range":
        p.add_argument("--gpus", required=True, help="GPU counts: LO:HI (LO doubled up to HI, e.g. 8:16384) or "
                                                     "8,64,512")
    else:
        p.add_argument("--gpus", type=int, required=required, help="number of GPUs")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (default 8192)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-size", default=None, help="sequences per optimizer step")
    batch.add_argument("--global-batch-tokens", default=None, help="tokens per optimizer step, e.g. 4M")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8", "fp32"],
                   help="training precision (default bf16; fp32 on --cluster local, as meshlm trains on CPUs)")
    p.add_argument("--fp8-weights", choices=FP8_WEIGHTS, default=None,
                   help="with --precision fp8, how the weights get into fp8: cached (Transformer Engine: cast once a "
                        "step, kept row- and column-wise beside the bf16 weights; the default), params (Megatron's "
                        "--fp8-param-gather, NVIDIA's NeMo / Megatron-Bridge fp8 recipes: the weights held in fp8, "
                        "gathered by the distributed optimizer in one byte), dynamic (torchao: cast in every "
                        "forward) or fsdp_all_gather (torchao under FSDP2: shards cast, gathered in fp8)")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="fused",
                   help="the attention kernel the training stack runs: fused (FlashAttention-3 / cuDNN class, the "
                        "cluster's attention rate: NVIDIA's recipes, Transformer Engine; the default), fa2 "
                        "(FlashAttention-2: PyTorch SDPA's flash backend or the flash-attn 2 package, as torchtitan "
                        "and most FSDP stacks run; slower on Hopper and Blackwell, the same on A100) or unfused (the "
                        "scores written out and the softmax run over them: Megatron-LM's kernels of 2021)")
    p.add_argument("--runtime", choices=["megatron", "meshlm"], default=None,
                   help="whose memory/communication accounting: megatron (mixed precision, the default for the "
                        "presets) or meshlm (its own fp32 runtime, the default for --cluster local)")
    p.add_argument("--ep-dispatcher", choices=EP_DISPATCHERS, default="alltoall",
                   help="how a MoE model's expert all-to-all moves tokens: alltoall (NCCL's all-to-all of every "
                        "routed copy: Megatron-Core's default, meshlm's runtime) or flex (Megatron-Core's flex "
                        "dispatcher with DeepEP or HybridEP: a token sent once to each other node holding one of its "
                        "experts, forwarded there over NVLink)")
    p.add_argument("--recompute-mla-up-proj", action="store_true",
                   help="a model with latent attention (DeepSeek-V3, Kimi K2): keep the compressed latents, not "
                        "the per-head q, k and v, and run the up-projections again in the backward (Megatron-Core's "
                        "recompute_modules mla_up_proj, which NVIDIA's DeepSeek-V3 recipes set on H100 and GB200)")
    p.add_argument("--fsdp-no-sync", action="store_true",
                   help="ZeRO-3 / FSDP layouts accumulate gradients without synchronizing until the last micro-step "
                        "(FSDP2's set_requires_gradient_sync(False), FSDP1's no_sync()): the rank's whole unsharded "
                        "gradients in memory at the reduce width, and one reduction a step instead of one a "
                        "micro-step (default: every micro-step reduces, FSDP's default)")
    p.add_argument("--train-tokens", default=None, metavar="N",
                   help="tokens of the whole run (e.g. 15T) for its days and energy")
    p.add_argument("--failure-rate", type=finite_float, default=None, metavar="PER_GPU_HOUR",
                   help="failures per GPU-hour (default 1.97e-5, the Llama 3 paper's 16K-GPU run)")
    p.add_argument("--storage-bw", default=None, metavar="BYTES_PER_S",
                   help="checkpoint storage write bandwidth of the job, e.g. 500G (default 122 MB/s per GPU, "
                        "the Llama 3 paper's 2 TB/s for 16K GPUs)")
    p.add_argument("--recovery", choices=RECOVERY_PATHS, default="storage", help="the recovery path "
                   "`goodput` is of (all are priced): restart from storage (default), from memory, or replica groups")
    p.add_argument("--replica-groups", type=int, metavar="G", help="groups of the replica path (default: the layout's)")
    p.add_argument("--restart-s", type=finite_float, metavar="S", help="restart time before reloading (default 600)")
    p.add_argument("--replica-sync-every", type=int, default=1, metavar="H", help="price semi-synchronous groups' sync")
    p.add_argument("--json", action="store_true", help="print JSON")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="predict memory and step time of parallel layouts on a cluster and pick one",
        description="Search every valid layout (dp_replicate, dp_shard + ZeRO stage, tp, pp + schedule, "
                    "cp + method, ep, micro-batch, recompute) for a model on a cluster, rank those that fit by step "
                    "time and explain the winner. Sub-commands: estimate (one layout), scale (the best layout at "
                    "each GPU count), compare (clusters), schedule (a pipeline schedule), infer (serving), context "
                    "(one long context), calibrate (measure this machine for --cluster local).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: meshlm plan --model llama3-70b --cluster h100 --gpus 64 --seq-len 8192 "
               "--global-batch-tokens 4M\nJSON keys: fits, memory_gib{...,total}, time_s{...,step}, mfu, hfu, "
               "tokens_per_s, tflops_per_gpu (see README).")
    _add_common(p, required=False)
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--plot", metavar="FILE.png", help="write memory and time breakdowns of the top layouts")
    sub = p.add_subparsers(dest="plan_command", metavar="SUBCOMMAND")

    e = sub.add_parser("estimate", help="memory and step time of one layout",
                       description="Estimate one layout. --layout keys: dp_replicate, dp_shard (default: the "
                                   "rest), tp, pp, cp, cp_method (ring|allgather|ulysses), cp_ulysses, ep, "
                                   "zero_stage, pp_schedule, pp_chunks, num_microbatches, micro_batch_size, recompute "
                                   "(none|selective|full), sequence_parallel, expert_tp (Megatron's expert tensor parallel size; 0: tp), "
                                   "zero3_reshard_after_forward (true|false; unset: false with pp > 1).")
    _add_common(e, required=True)
    e.add_argument("--layout", required=True, help="e.g. tp=8,pp=4,dp_shard=2,zero_stage=1,recompute=selective")

    sc = sub.add_parser("scale", help="best layout, tokens/s, MFU and comm share at each GPU count; "
                                      "strong and weak scaling; the diminishing-returns point",
                        description="Search the best layout at each GPU count of --gpus LO:HI (LO doubled up to HI) "
                                    "under "
                                    "strong scaling (--global-batch-tokens at every count) and weak scaling "
                                    "(--tokens-per-gpu x GPUs), and name the last count before the next step up "
                                    "buys less than half its linear share of tokens/s.")
    _add_common(sc, required=True, gpus="range")
    sc.add_argument("--tokens-per-gpu", default=None,
                    help="weak scaling: tokens per GPU per step (default: the strong run's at the largest count, "
                         "at least one sequence)")
    sc.add_argument("--mode", choices=["both", "strong", "weak"], default="both", help="which curves (default both)")
    sc.add_argument("--plot", metavar="FILE.png", help="write tokens/s against GPUs with the point marked")

    cmpp = sub.add_parser("compare", help="the best layout on two or more clusters, side by side, and the link "
                                          "that bounds each",
                          description="Search each --cluster for the same job and print the winners side by side: "
                                      "step time, tokens/s, MFU, power, which link each parallel axis rides and "
                                      "which communication bounds the step.")
    _add_common(cmpp, required=True, gpus="compare")

    add_serving_parsers(sub)
    s = sub.add_parser("schedule", help="simulate a pipeline schedule: bubble, peak in-flight, timeline PNG",
                       description="Simulate one pipeline schedule in unit time (F=1, B=1, W=1 per microbatch "
                                   "and chunk; the full backward is B+W) and print its bubble and the "
                                   "microbatches each rank holds at its peak.")
    s.add_argument("--pp", type=int, help="pipeline ranks (required unless --from-run)")
    s.add_argument("--microbatches", type=int, help="microbatches per step (required unless --from-run)")
    s.add_argument("--from-run", metavar="RUN_DIR", help="draw the measured timeline of a pipeline-parallel training "
                   "run (recorded for its first steps) instead, next to the simulator's prediction for the same "
                   "measured action times")
    s.add_argument("--step", type=int, help="with --from-run: the step to draw (default: the last recorded)")
    s.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zero_bubble"])
    s.add_argument("--chunks", type=int, default=1, help="virtual chunks per rank (interleaved)")
    s.add_argument("--plot", metavar="FILE.png", help="write the timeline")
    s.add_argument("--json", action="store_true")

    c = sub.add_parser("calibrate", help="measure matmul FLOP/s and collectives here for --cluster local",
                       description="Spawn local gloo ranks, time matmuls and collectives over message sizes, "
                                   "fit latency and bandwidth, and write them to --out.")
    c.add_argument("--out", default="plan_calibration.json", help="output file (default plan_calibration.json)")
    c.add_argument("--world-size", type=int, default=2, help="local ranks to spawn (default 2)")
    e = c.add_argument_group("emulated two-tier cluster",
                             "With --emulated: fit both link tiers of nodes emulated here as network namespaces "
                             "joined by links shaped to --inter-node-bw (as `meshlm train --emulate-nodes`); "
                             "needs root and iproute2. `--cluster local --calibration OUT` is then that cluster.")
    e.add_argument("--emulated", action="store_true", help="calibrate an emulated two-tier cluster")
    e.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    e.add_argument("--nproc-per-node", type=int, default=2, help="ranks per emulated node (default 2)")
    e.add_argument("--inter-node-bw", metavar="RATE", help="each node's link rate, tc units (1gbit, 100mbit)")
    e.add_argument("--inter-node-latency", metavar="TIME", help="one-way delay per node link (needs netem)")
    c.add_argument("--json", action="store_true")
    return p


def run(args) -> int:
    """`meshlm plan [SUBCOMMAND]`: each subcommand's function below; without one, the layout search."""
    commands = {None: run_search, "estimate": run_estimate, "scale": run_scale, "compare": run_compare,
                "infer": run_infer, "context": run_context, "schedule": run_schedule, "calibrate": run_calibrate}
    if getattr(args, "plot", None):  # refused before the search, not after it
        check_picture_path(args.plot, "--plot")
    clusters = getattr(args, "cluster", None)
    if getattr(args, "calibration", None) is not None and "local" not in (
            clusters if isinstance(clusters, list) else [clusters]):
        raise ValueError(f"--calibration {args.calibration} describes --cluster local, and no --cluster here is "
                         f"local ({clusters}): give --cluster local, or leave --calibration out")
    return commands[getattr(args, "plan_command", None)](args)


def _model(args) -> ModelConfig:
    if args.model is None:
        raise ValueError("--model is required (a preset such as llama3-70b, or a Hugging Face config.json)")
    return resolve_model(args.model)


def _training_model(args) -> ModelConfig:
    """--model, and the training precision where --precision is not given: fp32 on --cluster local (meshlm
    trains in fp32 on CPUs), bf16 elsewhere."""
    cfg = _model(args)
    if args.precision is None:
        args.precision = "fp32" if args.cluster == "local" else "bf16"
    if args.fp8_weights is not None and args.precision != "fp8":
        raise ValueError(f"--fp8-weights {args.fp8_weights} says how fp8 training casts its weights; --precision is "
                         f"{args.precision}: give --precision fp8 or leave --fp8-weights out")
    if args.recompute_mla_up_proj and latent_attention(cfg, "megatron") is None:
        raise ValueError(f"--recompute-mla-up-proj re-runs the up-projections of latent attention; --model "
                         f"{args.model} has grouped-query attention: leave the flag out")
    return cfg


def _job_options(args) -> dict:
    """The job fields the training subcommands take from their flags beside its sizes."""
    return dict(ep_dispatcher=args.ep_dispatcher, recompute_mla_up_proj=args.recompute_mla_up_proj,
                fsdp_no_sync=args.fsdp_no_sync, fp8_weights=args.fp8_weights or "cached",
                flash_attention=args.attention != "unfused", flash_attention_2=args.attention == "fa2")


def _require_gpus(args) -> None:
    if args.gpus is None:
        raise ValueError("--gpus is required")
    if args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be >= 1")


def _cluster_and_job(args):
    """The --cluster and the training job of --gpus, --seq-len and the batch flags."""
    from meshlm.planner.cluster import get_cluster

    cluster = get_cluster(args.cluster, calibration=args.calibration)
    _require_gpus(args)
    job = make_job(seq_len=args.seq_len, global_batch_size=args.global_batch_size,
                   global_batch_tokens=args.global_batch_tokens, precision=args.precision,
                   runtime=runtime_of(args), **_job_options(args))
    return cluster, job


def run_search(args) -> int:
    """`meshlm plan`: rank every valid layout on the cluster, explain the winner, optionally plot the top."""
    from meshlm.planner.explain import explain
    from meshlm.planner.search import search

    cfg = _training_model(args)
    cluster, job = _cluster_and_job(args)
    if args.top < 1:
        raise ValueError(f"--top {args.top} must be >= 1 (the layouts to show)")
    result = search(cfg, cluster, job, gpus=args.gpus, top=args.top)
    text = explain(result)
    if args.plot:
        from meshlm.planner.plot import plot_estimates

        plot_estimates(result.ranked, args.plot,
                       title=f"{args.model} on {args.gpus} x {cluster.gpu}, seq {job.seq_len}, "
                             f"{job.tokens / 2**20:.3g}M tokens/step")
    ops = job_operations(result.ranked[0], cfg, cluster, args) if result.ranked else {}
    if args.json:
        print(json.dumps({**ops, "model": args.model, "cluster": cluster.name, "gpus": args.gpus,
                          "seq_len": job.seq_len, "global_batch_size": job.global_batch_size,
                          "precision": job.precision, "evaluated": result.evaluated, "num_fit": result.num_fit,
                          "ranked": [e.to_dict() for e in result.ranked],
                          "closest_miss": result.closest_miss.to_dict() if result.closest_miss else None,
                          "explanation": text}, indent=2))
        return 0
    print(f"{args.model} on {args.gpus} x {cluster.gpu} ({cluster.name}), seq {job.seq_len}, "
          f"{job.global_batch_size} sequences ({job.tokens:,} tokens) per step, {job.precision}: "
          f"{result.evaluated} layouts evaluated, {result.num_fit} fit")
    if result.ranked:
        print(format_table(result.ranked))
    print()
    print(text)
    if ops:
        from meshlm.planner.operations import describe

        print(describe(ops))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def run_estimate(args) -> int:
    """`meshlm plan estimate`: one layout's memory, step time, failures and power."""
    from meshlm.planner.cost import estimate, parse_layout

    cfg = _training_model(args)
    cluster, job = _cluster_and_job(args)
    est = estimate(cfg, cluster, job, parse_layout(args.layout, gpus=args.gpus), gpus=args.gpus)
    ops = job_operations(est, cfg, cluster, args)
    if args.json:
        print(json.dumps({**est.to_dict(), **ops}, indent=2))
        return 0
    from meshlm.planner.explain import bound_of, overlap_caution
    from meshlm.planner.operations import describe

    print(format_table([est]))
    print(bound_of(est))
    if (caution := overlap_caution(est)) is not None:
        print(caution)
    print(describe(ops))
    return 0


def _job_tokens(args) -> int:
    if args.global_batch_tokens:
        return parse_size(args.global_batch_tokens)
    if args.global_batch_size:
        return parse_size(args.global_batch_size) * args.seq_len
    raise ValueError("give --global-batch-size (sequences) or --global-batch-tokens (e.g. 4M)")


def run_scale(args) -> int:
    """`meshlm plan scale`: the best layout at each GPU count, strong and weak, and where returns diminish."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.scale import (
        describe,
        diminishing_point,
        parse_gpu_counts,
        scale_curve,
    )

    cfg = _training_model(args)
    cluster = get_cluster(args.cluster, calibration=args.calibration)
    counts = parse_gpu_counts(args.gpus)
    tokens = _job_tokens(args)
    # Weak scaling's default per-GPU batch is the strong run's at its largest count (at least one sequence),
    # so the two curves meet there.
    per_gpu = parse_size(args.tokens_per_gpu) if args.tokens_per_gpu else max(args.seq_len, tokens // counts[-1])
    modes = ["strong", "weak"] if args.mode == "both" else [args.mode]
    curves = {}
    for mode in modes:
        if not args.json:
            print(f"{mode} scaling of {args.model} on {cluster.name}: "
                  + (f"{tokens:,} tokens per step" if mode == "strong" else f"{per_gpu:,} tokens per GPU per step"),
                  flush=True)
        curves[mode] = scale_curve(cfg, cluster, counts=counts, seq_len=args.seq_len, precision=args.precision,
                                   runtime=runtime_of(args), mode=mode, global_batch_tokens=tokens,
                                   tokens_per_gpu=per_gpu, **_job_options(args))
        if not args.json:
            print(describe(curves[mode], mode=mode))
            print()
    marks = {mode: diminishing_point(points) for mode, points in curves.items()}
    if args.plot:
        from meshlm.planner.plot import plot_scaling

        plot_scaling(curves, args.plot, marks=marks, title=f"{args.model} on {cluster.gpu} ({cluster.name}), "
                                                            f"seq {args.seq_len}")
    if args.json:
        print(json.dumps({"model": args.model, "cluster": cluster.name, "seq_len": args.seq_len,
                          "curves": {m: [p.to_dict() for p in pts] for m, pts in curves.items()},
                          "diminishing_returns_gpus": {m: (p.gpus if p else None) for m, p in marks.items()}},
                         indent=2))
    elif args.plot:
        print(f"plot: {args.plot}")
    return 0


def run_compare(args) -> int:
    """`meshlm plan compare`: the best layout of one job on each --cluster, side by side."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.explain import link_summary
    from meshlm.planner.search import search

    cfg = _training_model(args)
    if len(args.cluster) < 2:
        raise ValueError(f"plan compare needs two or more --cluster (got {args.cluster}); "
                         "e.g. --cluster h100 --cluster gb200-nvl72")
    twice = sorted({c for c in args.cluster if args.cluster.count(c) > 1})
    if twice:
        raise ValueError(f"--cluster {', '.join(twice)} given twice; compare different clusters")
    _require_gpus(args)
    job = make_job(seq_len=args.seq_len, global_batch_size=args.global_batch_size,
                   global_batch_tokens=args.global_batch_tokens, precision=args.precision, runtime="megatron",
                   **_job_options(args))
    rows = []
    for name in args.cluster:
        cluster = get_cluster(name, calibration=args.calibration)
        result = search(cfg, cluster, job, gpus=args.gpus, top=1)
        if not result.ranked:
            rows.append({"cluster": name, "fits": False, "bound": "nothing fits in memory"})
            continue
        est = result.ranked[0]
        ops = job_operations(est, cfg, cluster, args)
        rows.append({"cluster": name, "gpu": cluster.gpu, "scaleup_size": cluster.scaleup_size, "fits": True,
                     "layout": est.layout.short(), "step_s": est.time_s["step"], "tokens_per_s": est.tokens_per_s,
                     "mfu": est.mfu, "links": est.links, "cluster_mw": ops["power"]["cluster_mw"],
                     "kwh_per_million_tokens": ops["power"]["kwh_per_million_tokens"],
                     "goodput": ops["failures"]["goodput"], "bound": link_summary(est)})
    if args.json:
        print(json.dumps({"model": args.model, "gpus": args.gpus, "seq_len": job.seq_len,
                          "global_batch_size": job.global_batch_size, "clusters": rows}, indent=2))
    else:
        print(f"{args.model} on {args.gpus} GPUs, seq {job.seq_len}, {job.tokens:,} tokens per step, {job.precision}")
        print(format_compare(rows))
    return 0


def format_compare(rows: list[dict]) -> str:
    """`plan compare`'s rows as text: each cluster's winner and what bounds it, then the fastest."""
    lines = []
    for r in rows:
        if not r["fits"]:
            lines.append(f"  {r['cluster']:<12} nothing fits in memory")
            continue
        lines.append(f"  {r['cluster']:<12} ({r['scaleup_size']}-GPU scale-up domains) {r['layout']}")
        lines.append(f"  {'':<12} step {r['step_s']:.3g} s, {r['tokens_per_s']:,.0f} tokens/s, "
                     f"MFU {r['mfu']:.1%}, {r['cluster_mw']:.3g} MW, {r['kwh_per_million_tokens']:.3g} kWh/M tokens")
        lines.append(f"  {'':<12} {r['bound']}")
    fitting = [r for r in rows if r["fits"]]
    if len(fitting) > 1:
        best = max(fitting, key=lambda r: r["tokens_per_s"])
        others = ", ".join(f"{best['tokens_per_s'] / r['tokens_per_s']:.2f}x the tokens/s of {r['cluster']}"
                           for r in fitting if r is not best)
        lines.append(f"Fastest: {best['cluster']}, {others}.")
    return "\n".join(lines)


def run_schedule(args) -> int:
    """`meshlm plan schedule`: simulate one pipeline schedule in unit time, or (--from-run) show a run's."""
    if args.from_run:
        return _schedule_from_run(args)
    from meshlm.schedules import build_schedule, plot_schedule, simulate

    if args.pp is None or args.microbatches is None:
        raise ValueError("meshlm plan schedule needs --pp and --microbatches (or --from-run RUN_DIR)")
    if args.pp > MAX_SCHEDULE_STAGES:
        raise ValueError(f"--pp {args.pp}: at most {MAX_SCHEDULE_STAGES} stages to simulate")
    actions = args.pp * args.microbatches * max(1, args.chunks or 1)
    if actions > MAX_SCHEDULE_ACTIONS:
        raise ValueError(f"--pp {args.pp} x --microbatches {args.microbatches} x --chunks {args.chunks} = {actions:,} "
                         f"forward passes to simulate; at most {MAX_SCHEDULE_ACTIONS:,}: a schedule's shape shows at a "
                         "few stages and micro-batches")
    sim = simulate(build_schedule(args.schedule, pp=args.pp, num_microbatches=args.microbatches,
                                  pp_chunks=args.chunks))
    if args.plot:
        plot_schedule(sim, args.plot)
    if args.json:
        print(json.dumps({"schedule": args.schedule, "pp": args.pp, "num_microbatches": args.microbatches,
                          "pp_chunks": args.chunks, "makespan": sim.makespan, "bubble": sim.bubble,
                          "bubble_fraction": sim.bubble_fraction, "peak_inflight": sim.peak_inflight}))
    else:
        print(f"{args.schedule} pp={args.pp} m={args.microbatches} v={args.chunks}: bubble {sim.bubble:g} of "
              f"{sim.makespan:g} time units ({sim.bubble_fraction:.1%} of the compute), peak in-flight "
              f"microbatches per rank {[round(x, 2) for x in sim.peak_inflight]}"
              + (f"; timeline -> {args.plot}" if args.plot else ""))
    return 0


def _schedule_from_run(args) -> int:
    """A pipeline-parallel run's measured timeline beside the simulator's, fed the measured action times."""
    from meshlm.schedules import plot_schedule
    from meshlm.timeline import load_timeline, measured_overheads, simulate_measured

    run = load_timeline(args.from_run, step=args.step)
    t_comm, t_gap = measured_overheads(run)
    predicted = simulate_measured(run, t_comm=t_comm, t_gap=t_gap)
    sch = run.schedule
    if args.plot:
        plot_schedule(run, args.plot, title=f"measured {sch.name}: pp={sch.pp}, m={sch.num_microbatches}, "
                                            f"bubble {run.bubble * 1e3:.1f} ms ({run.bubble_fraction:.1%})")
    if args.json:
        print(json.dumps({"schedule": sch.name, "pp": sch.pp, "num_microbatches": sch.num_microbatches,
                          "pp_chunks": sch.pp_chunks, "makespan_s": run.makespan,
                          "bubble_fraction": run.bubble_fraction, "idle_s_per_rank": run.idle,
                          "predicted_bubble_fraction": predicted.bubble_fraction,
                          "predicted_makespan_s": predicted.makespan, "predicted_idle_s_per_rank": predicted.idle,
                          "measured_comm_latency_s": t_comm, "measured_gap_s": t_gap}))
        return 0
    print(f"measured {sch.name} pp={sch.pp} m={sch.num_microbatches} v={sch.pp_chunks}: step "
          f"{run.makespan * 1e3:.1f} ms, bubble {run.bubble_fraction:.1%} of the busiest rank's compute "
          f"(simulated with the measured action times, comm latency {t_comm * 1e3:.2f} ms and "
          f"{t_gap * 1e3:.2f} ms between actions: {predicted.bubble_fraction:.1%}, step "
          f"{predicted.makespan * 1e3:.1f} ms); idle ms per rank "
          f"{[round(x * 1e3, 1) for x in run.idle]} (simulated {[round(x * 1e3, 1) for x in predicted.idle]})"
          + (f"; timeline -> {args.plot}" if args.plot else ""))
    return 0


def run_calibrate(args) -> int:
    """`meshlm plan calibrate`: measure this machine (or an emulated two-tier cluster) for --cluster local."""
    from meshlm.planner.calibrate import calibrate, calibrate_emulated

    emulation = args.inter_node_bw or args.inter_node_latency or args.nodes != 2 or args.nproc_per_node != 2
    if emulation and not args.emulated:
        raise ValueError("--inter-node-bw/--inter-node-latency/--nodes/--nproc-per-node describe an emulated cluster; "
                         "add --emulated")
    if args.emulated and not (2 <= args.nodes and args.nproc_per_node >= 1):
        raise ValueError(f"--nodes {args.nodes} must be >= 2 and --nproc-per-node {args.nproc_per_node} >= 1")
    if args.emulated:
        from meshlm.emulate import check_host, parse_duration, parse_rate

        if not args.inter_node_bw:
            raise ValueError("--emulated needs --inter-node-bw RATE (e.g. 1gbit), the link between nodes")
        rate = parse_rate(args.inter_node_bw)
        latency = parse_duration(args.inter_node_latency) if args.inter_node_latency else 0.0
        check_host()
        data = calibrate_emulated(args.out, nodes=args.nodes, procs_per_node=args.nproc_per_node,
                                  rate_bps=rate, latency_s=latency)
    else:
        data = calibrate(args.out, world_size=args.world_size)
    if args.json:
        print(json.dumps(data, indent=2))
    elif args.emulated:
        print(format_emulated_calibration(data, ranks=args.nodes * args.nproc_per_node, out=args.out))
    else:
        print(format_calibration(data, out=args.out))
    return 0


def format_calibration(data: dict, *, out: str) -> str:
    """One line: what `plan calibrate` measured on this machine."""
    link = data["link"]
    return (f"matmul {data['matmul_flops'] / 1e9:.1f} GFLOP/s per core, attention "
            f"{data['attention_flops'] / 1e9:.1f} GFLOP/s (+{data['attention_block_overhead']:.0f} tokens/block), "
            f"{data['cpu_cores']} cores, memory {data['memory_bandwidth'] / 1e9:.1f} GB/s, "
            f"collective link {link['bandwidth'] / 1e9:.2f} GB/s + {link['latency'] * 1e6:.0f} us/hop "
            f"-> {out}")


def format_emulated_calibration(data: dict, *, ranks: int, out: str) -> str:
    """One line: what `plan calibrate --emulated` measured on the emulated two-tier cluster of `ranks` ranks."""
    share = max(1.0, ranks / data["cpu_cores"])  # the file holds per-core figures (emulated_calibration)
    alone, slow = data.get("alone", data), data.get("contention", {}).get("slowdown", share)
    up, across = data["collectives"]["all_reduce"], data["scale_out"]["collectives"]["all_reduce"]
    flat = data.get("flat", {}).get("collectives", {}).get("all_reduce")
    return (f"matmul {alone['matmul_flops'] / 1e9:.1f} GFLOP/s on one core alone, {data['cpu_cores']} cores; "
            f"{ranks} ranks computing at once: {slow:.1f}x slower each; a step's fixed work "
            f"{data.get('step_overhead_s', 0) * 1e3:.0f} ms. All-reduce inside a node "
            f"{up['bandwidth'] / share / 1e9:.2f} GB/s, across nodes {across['bandwidth'] / 1e6:.1f} MB/s per rank"
            + (f", on one ring of all ranks {flat['bandwidth'] / 1e6:.1f} MB/s per node link" if flat else "")
            + f"; a call among busy ranks waits +{up.get('call_overhead', 0) * 1e3:.1f} ms inside a node, "
            f"+{across.get('call_overhead', 0) * 1e3:.1f} ms across -> {out}")


def format_table(estimates) -> str:
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'v':>2} {'cp':>3} {'ep':>3} {'dp':>9} {'z':>1} {'mbs':>3} "
            f"{'schedule':<11} {'recomp':<9} {'mem GiB':>8} {'step s':>8} {'MFU':>6} {'HFU':>6} "
            f"{'TFLOP/s':>8} {'tokens/s':>11}  top overhead")
    rows = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        lo = e.layout
        dp = f"{lo.dp_replicate}x{lo.dp_shard}" if lo.dp_replicate > 1 else str(lo.dp_shard)
        over = {k: v for k, v in e.time_s.items() if k not in ("compute", "step")}
        worst = max(over, key=over.get)
        sched = lo.pp_schedule if lo.pp > 1 else "-"
        cp = lo.cp_name()  # as Layout.short()
        rows.append(f"{i:>3} {lo.tp:>3} {lo.pp:>3} {lo.pp_chunks:>2} {cp:>3} {lo.ep:>3} {dp:>9} "
                    f"{lo.zero_stage:>1} {lo.micro_batch_size:>3} {sched:<11} {lo.recompute:<9} "
                    f"{e.memory_gib['total']:>8.1f} {e.time_s['step']:>8.3g} {e.mfu:>6.1%} {e.hfu:>6.1%} "
                    f"{e.tflops_per_gpu:>8.1f} {e.tokens_per_s:>11,.0f}  {worst} {over[worst] / e.time_s['step']:.0%}"
                    + ("" if e.fits else ("  DOES NOT FIT (over capacity)" if e.memory_gib["total"] > e.hbm_gib
                                          else "  DOES NOT FIT (less than the free-memory margin left)")))
    return "\n".join(rows)


