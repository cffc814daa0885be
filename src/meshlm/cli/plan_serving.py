"""`meshlm plan infer` and `meshlm plan context`: the serving questions of `meshlm plan` (see `cli/plan.py`).

Responsible for: the two serving subcommands' argument parsers, turning their flags into the serving
planner's inputs (`Serving`, `Workload`), and printing the estimate, the ranking or the long-context answer
as a table or JSON. User mistakes raise ValueError (one line, exit code 2).
Not responsible for: any estimate (`planner/serving*.py`), or the training subcommands (`cli/plan.py`).

  meshlm plan infer --model llama3-70b --cluster h100 --gpus 8 --layout tp=8 --input-len 8192 --output-len 256
  meshlm plan infer --model deepseek-v3 --cluster h200 --gpus 8 --precision fp8 --offline   # every layout ranked
  meshlm plan context --model llama3-405b --cluster gb200-nvl72 --context 1M --plot context.png
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from meshlm.cli.common import finite_float
from meshlm.planner.cluster import PRESETS
from meshlm.planner.inputs import parse_size
from meshlm.planner.serving_engine import ENGINES

# plan context: the largest --max-gpus (every count up to the smallest deployment is tried, each in microseconds)
MAX_CONTEXT_GPUS = 1 << 20
# The --cluster names: planner/cluster.py's presets, or this machine after `meshlm plan calibrate`.
CLUSTER_CHOICES = " | ".join([*PRESETS, "local"])


def _add_served(p: argparse.ArgumentParser) -> None:
    """The model, cluster and precisions of a serving question (`plan infer`, `plan context`)."""
    p.add_argument("--model", required=True, metavar="PRESET|CONFIG.json")
    p.add_argument("--cluster", default="h100", help=f"{CLUSTER_CHOICES} (default h100)")
    p.add_argument("--precision", default=None, choices=["bf16", "fp8", "fp4", "fp32"],
                   help="weights and GEMMs (default bf16; fp32 on --cluster local, as meshlm serves on CPUs)")
    p.add_argument("--kv-precision", default=None, choices=["bf16", "fp8", "fp32"],
                   help="KV cache (default bf16; fp32 on --cluster local)")
    p.add_argument("--expert-gemm-precision", default=None, choices=["bf16", "fp8"],
                   help="the routed experts' GEMMs where they run wider than their --precision weights (mixed input: "
                        "fp8 for MXFP4 weights with MXFP8 activations, TensorRT-LLM's gpt-oss on Blackwell; bf16 "
                        "for weight-only W4A16 -- on a GPU without FP4 tensor cores, as vLLM runs gpt-oss on Hopper "
                        "and Ampere, every GEMM of fp4 weights, at the rate its Marlin kernel was measured at); "
                        "default: the weights' precision")
    p.add_argument("--dense-precision", default=None, choices=["bf16", "fp8", "fp4"],
                   help="weights and GEMMs of everything beside an MoE model's routed experts (attention, dense MLPs, "
                        "shared experts, embeddings, head) where the checkpoint keeps them wider than --precision: "
                        "bf16 for gpt-oss's MXFP4 checkpoints, fp8 for NVIDIA's NVFP4 DeepSeek-R1; default: "
                        "--precision")


def add_serving_parsers(sub) -> None:
    """`plan infer` (one serving deployment) and `plan context` (one long sequence)."""
    i = sub.add_parser("infer", help="serving estimate: throughput, TTFT, TPOT, KV capacity, bound, power",
                       description="Serve --model on --gpus GPUs of --cluster: one --layout, or every layout ranked. "
                                   "One of --batch (static), --concurrency (continuous), --offline (the default: the "
                                   "best concurrency that fits) or --request-rate (Poisson arrivals; 'max': the "
                                   "highest rate meeting latency targets); planner/serving*.py.",
                       epilog="JSON keys: output_tokens_per_s, output_tokens_per_s_per_gpu, total_tokens_per_s, "
                              "ttft_ms, tpot_ms, max_concurrency, kv_bytes_per_token (per GPU), max_context_tokens, "
                              "bound, power_w, joules_per_output_token, ... (see README).")
    _add_served(i)
    i.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration file for --cluster local (default plan_calibration.json)")
    i.add_argument("--gpus", type=int, default=None, help="GPUs of the deployment (default: the layout's, or --tp)")
    i.add_argument("--layout", default=None, help="tp=T,pp=P,cp=C,ep=E,dp=D (dp default: the rest of --gpus); "
                                                 "without it every layout of --gpus is ranked")
    i.add_argument("--tp", type=int, default=None, help="shorthand for --layout tp=T (and --gpus T when not given)")
    i.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    i.add_argument("--output-len", type=int, default=1024, help="generated tokens per request (default 1024)")
    mode = i.add_mutually_exclusive_group()
    mode.add_argument("--batch", type=int, default=None, help="static batch: prefill all, then decode all")
    mode.add_argument("--concurrency", type=int, default=None, help="continuous batching with C requests in flight")
    mode.add_argument("--offline", action="store_true", help="the throughput-maximising concurrency that fits "
                                                             "(the default)")
    mode.add_argument("--request-rate", type=_rate, default=None, metavar="R|max",
                      help="Poisson arrivals of R requests/s: latencies (means and --percentile tails) at that load, "
                           "and whether it keeps up; 'max': the highest rate whose tails meet --max-ttft-ms / "
                           "--max-tpot-ms (MLPerf's server scenario)")
    i.add_argument("--percentile", type=finite_float, default=None, metavar="P",
                   help="the tail of Poisson arrivals' TTFT and TPOT reported, and that --request-rate max holds "
                        "to the targets (default 99)")
    i.add_argument("--max-ttft-ms", type=finite_float, default=None, metavar="MS",
                   help="with --offline: the best concurrency whose time to first token stays within MS "
                        "(steady state, no queueing); with --request-rate max: the highest rate whose --percentile "
                        "TTFT does; JSON meets_slo says whether any does")
    i.add_argument("--max-tpot-ms", type=finite_float, default=None, metavar="MS",
                   help="as --max-ttft-ms, for the time per output token")
    i.add_argument("--prefix-hit", type=finite_float, default=0.0, metavar="H",
                   help="the share of each prompt's tokens the engine finds in its prefix cache (a shared system "
                        "prompt, earlier turns of a chat, a RAG template), in [0, 1): only the rest are prefilled, "
                        "attending over the whole prompt; the KV is still counted whole per request (default 0)")
    i.add_argument("--prefix-shared", action="store_true",
                   help="the cached prefix of --prefix-hit is one prefix every request shares (a system prompt, a "
                        "RAG template): the running requests hold its KV once, so more of them fit; vLLM's V1 "
                        "engines (--engine vllm, vllm-async) also read it once a step where their cascade-attention "
                        "rule says so, the others once per request")
    i.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens per iteration (default 8192, TensorRT-LLM's max_num_tokens)")
    i.add_argument("--max-batch", type=int, default=None,
                   help="the engine's cap on running requests per dp rank (default: the --engine's own -- vLLM's "
                        "max_num_seqs, 1024 on a GPU of 70 GiB or more but an A100, else 256; TensorRT-LLM's 2048 -- "
                        "none for the others)")
    i.add_argument("--engine", default=None,
                   help="serving software priced (planner/serving_engine.py): " + ", ".join([*ENGINES, "meshlm"])
                        + "; vllm is vLLM 0.8-0.13 (its V1 engine's host work between steps, per running request, "
                        "on every step), vllm-async 0.14 on (async scheduling hides it), vllm-v0 0.7 and before"
                        "; vllm* and sglang give the KV cache a share of the whole GPU less the weights "
                        "(gpu_memory_utilization, mem_fraction_static; vllm* less its profile run's sampler too, "
                        "--sampler), the others 0.9 of what the weights leave "
                        "(default: meshlm on --cluster local when its calibration measured meshlm's engine, else "
                        "default)")
    i.add_argument("--memory-fraction", type=finite_float, default=None, metavar="F",
                   help="the --engine's memory knob, in (0, 1]: for vllm* its --gpu-memory-utilization (the share of "
                        "the whole GPU for weights, activations and KV cache; default 0.9), for sglang its "
                        "--mem-fraction-static (the whole GPU's share for weights and KV; default by the GPU's "
                        "memory), for the others the share of what the weights leave that the KV cache gets "
                        "(TensorRT-LLM's free_gpu_memory_fraction; default 0.9)")
    i.add_argument("--sampler", default=None, choices=["native", "flashinfer"],
                   help="vllm* only: the sampler whose profile run over --max-batch rows of logits the KV cache is "
                        "sized after -- native (PyTorch's sort, 38.8 bytes a logit: vLLM without FlashInfer, and its "
                        "default from 0.11.1; the default here) or flashinfer (14: the default of vLLM 0.9-0.11.0 "
                        "where FlashInfer is installed, as in vLLM's Docker image)")
    i.add_argument("--mtp-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: K draft tokens per step from a one-layer draft head (the model's "
                        "MTP module, as DeepSeek-V3's, or an EAGLE head; priced as one decoder layer), or from "
                        "--draft-model; each "
                        "step verifies them in one pass over the KV (default 0)")
    i.add_argument("--mtp-acceptance", type=finite_float, default=None, metavar="P",
                   help="chance each draft is accepted after the one before (default 0.875, DeepSeek-V3's MTP; "
                        "measure your own draft model's)")
    i.add_argument("--draft-model", default=None, metavar="PRESET|CONFIG.json",
                   help="the --mtp-tokens drafts come from this smaller model of the same vocabulary instead "
                        "(draft-target speculative decoding: TensorRT-LLM's, vLLM's draft model, meshlm's "
                        "--speculative draft): K decode steps of it a step, on the same layout; its weights and KV "
                        "take their share of each GPU's memory")
    i.add_argument("--disaggregate", default=None, metavar="PREFILL_GPUS:DECODE_GPUS",
                   help="prefill and decode on separate GPUs (each pool the layout's tp x pp x cp replicas)")
    i.add_argument("--top", type=int, default=5, help="layouts to show without --layout (default 5)")
    i.add_argument("--plot", metavar="FILE.png",
                   help="throughput per GPU against tokens/s per request (and TTFT against throughput) as requests "
                        "in flight double, for the layout or each layout shown; the answer starred")
    i.add_argument("--context-len", type=int, default=None, help=argparse.SUPPRESS)
    i.add_argument("--json", action="store_true")

    x = sub.add_parser("context", help="one long context: smallest deployment, TPOT, where more GPUs stop paying",
                       description="The fewest GPUs (tp x pp x cp) of --cluster that hold the weights and one "
                                   "sequence of --context tokens, its TPOT, the nodes its KV spans, and the best "
                                   "TPOT as GPUs double (planner/serving_context.py; JSON keys: see README).")
    _add_served(x)
    x.add_argument("--context", required=True, help="prompt tokens of the one sequence, e.g. 1M (= 2^20), 128K")
    x.add_argument("--output-len", type=int, default=1, help="tokens generated after it (default 1)")
    x.add_argument("--max-gpus", type=int, default=4096,
                   help=f"largest deployment to consider (default 4096, at most {MAX_CONTEXT_GPUS:,})")
    x.add_argument("--plot", metavar="FILE.png", help="weights + KV per GPU against context length and TPOT "
                                                      "against GPUs, for scale-up domains of 8 and 72")
    x.add_argument("--json", action="store_true")


def run_infer(args) -> int:
    """`meshlm plan infer`: one serving deployment (or every layout of --gpus ranked)."""
    from meshlm.planner.serving_modes import estimate_serving, search_serving

    sv, wl, gpus = _serving_inputs(args)
    if args.plot and wl.disaggregate:
        raise ValueError("--plot draws one pool's continuous batching; leave out --disaggregate")
    if args.layout is None and args.tp is None:
        if args.top < 1:
            raise ValueError(f"--top {args.top} must be >= 1 (the layouts to show)")
        ranked = search_serving(sv, wl, gpus=gpus, top=args.top)
        if args.json:
            print(json.dumps(ranked, indent=2))
        else:
            if not ranked[0]["fits"]:
                print(f"no layout of {gpus} x {sv.cluster.gpu} fits {args.model} at {wl.input_len}+{wl.output_len} "
                      f"tokens; the nearest (fewest weights per GPU) first:")
            print("\n".join(format_serving(r, args.model, sv.cluster.gpu) for r in ranked))
    else:
        ranked = [estimate_serving(sv, wl)]
        print(json.dumps(ranked[0], indent=2) if args.json else format_serving(ranked[0], args.model, sv.cluster.gpu))
    if args.plot:
        _plot_frontier(args, sv, wl, ranked)
    return 0


def _plot_frontier(args, sv, wl, answers: list[dict]) -> None:
    """`plan infer --plot`: each fitting answer's layout swept over requests in flight (`frontier`), its answer
    starred."""
    from meshlm.planner.plot import plot_frontier
    from meshlm.planner.serving_layout import parse_serving_layout
    from meshlm.planner.serving_modes import frontier

    curves, marks = {}, {}
    for r in (a for a in answers if a["fits"]):
        lo = parse_serving_layout(r["layout"])
        curves[r["layout"]] = frontier(replace(sv, layout=lo), wl)
        marks[r["layout"]] = (1e3 / r["tpot_ms"], r["output_tokens_per_s_per_gpu"])
    if not curves:
        raise ValueError("--plot: no layout fits, nothing to draw")
    plot_frontier(curves, args.plot, marks=marks, title=f"{args.model} on {sv.cluster.gpu}, "
                                                        f"{wl.input_len}+{wl.output_len} tokens per request")
    if not args.json:
        print(f"wrote {args.plot}")


def run_context(args) -> int:
    """`meshlm plan context`: the smallest deployment that holds one long sequence, and its scaling."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.plot import plot_context
    from meshlm.planner.serving import Serving
    from meshlm.planner.serving_layout import ServingLayout
    from meshlm.planner.serving_context import context_answer, format_context, plot_variants
    from meshlm.planner.serving_model import served_model

    context = parse_size(args.context)
    if context < 1 or args.output_len < 1 or args.max_gpus < 1:
        raise ValueError("--context, --output-len and --max-gpus must be >= 1")
    if args.max_gpus > MAX_CONTEXT_GPUS:
        raise ValueError(f"--max-gpus {args.max_gpus:,} is beyond the {MAX_CONTEXT_GPUS:,} GPUs `plan context` "
                         "searches (it tries every count up to the smallest that holds the sequence): give fewer")
    cluster = get_cluster(args.cluster)
    sm = served_model(args.model)
    sv = Serving(sm, cluster, ServingLayout(), **_precisions(args, sm))
    answer = context_answer(sv, context, args.output_len, max_gpus=args.max_gpus)
    print(json.dumps(answer, indent=2) if args.json else format_context(answer, args.model))
    if args.plot:
        variants = plot_variants(sv, context, args.output_len, max_gpus=args.max_gpus)
        plot_context(variants, args.plot, title=f"{args.model} on {sv.cluster.gpu}: {context:,}-token context")
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _serving_inputs(args):
    """(Serving, Workload, gpus) from `plan infer`'s flags."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.serving import Serving
    from meshlm.planner.serving_layout import ServingLayout, parse_serving_layout
    from meshlm.planner.serving_engine import default_max_batch, engine
    from meshlm.planner.serving_model import served_model
    from meshlm.planner.serving_workload import DEFAULT_PERCENTILE, DEFAULT_PREFILL_CHUNK, Workload

    if args.context_len is not None:
        raise ValueError("--context-len is gone: give --input-len (prompt tokens) and --output-len (generated "
                         "tokens), e.g. --input-len 8192 --output-len 256")
    if args.layout and args.tp:
        raise ValueError("give --layout tp=T,... or --tp T, not both")
    for flag, value in (("--gpus", args.gpus), ("--tp", args.tp)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    layout = args.layout or (f"tp={args.tp}" if args.tp else None)
    gpus = args.gpus or (args.tp if args.tp and not args.layout else None)
    lo = parse_serving_layout(layout, gpus=gpus) if layout else ServingLayout()
    gpus = gpus or lo.world
    if layout is None and args.gpus is None:
        raise ValueError("give --gpus N (every layout ranked), or --layout / --tp")
    _refuse_idle_flags(args)
    disagg = parse_disaggregate(args.disaggregate) if args.disaggregate else None
    if disagg and args.gpus is not None and args.gpus != sum(disagg):
        raise ValueError(f"--gpus {args.gpus} and --disaggregate {args.disaggregate} ({sum(disagg)} GPUs) disagree: "
                         f"the two pools are the deployment; give --gpus {sum(disagg)}, or leave --gpus out")
    wl = Workload(args.input_len, args.output_len, batch=args.batch, concurrency=args.concurrency,
                  offline=args.offline, request_rate=None if args.request_rate == "max" else args.request_rate,
                  max_rate=args.request_rate == "max",
                  percentile=DEFAULT_PERCENTILE if args.percentile is None else args.percentile,
                  max_batch=args.max_batch,
                  prefill_chunk=DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk,
                  disaggregate=disagg, max_ttft_s=_seconds(args.max_ttft_ms), max_tpot_s=_seconds(args.max_tpot_ms),
                  prefix_hit=args.prefix_hit, prefix_shared=args.prefix_shared)
    cluster = get_cluster(args.cluster, calibration=args.calibration)
    name = args.engine or ("meshlm" if cluster.serving_host else "default")
    eng = engine(name, cluster)
    if args.memory_fraction is not None:  # the knob the engine has: of the whole GPU (vLLM), or of what is free
        if not 0 < args.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction {args.memory_fraction:g} must be in (0, 1], e.g. 0.9")
        knob = "device_memory_fraction" if eng.whole_device else "free_memory_fraction"
        eng = replace(eng, **{knob: args.memory_fraction})
    if args.max_batch is not None:  # the cap the engine is configured with (vLLM's profile run samples that many rows)
        eng = replace(eng, max_running=args.max_batch)
    if args.sampler is not None:
        if eng.profile_sampler is None:
            raise ValueError(f"--sampler {args.sampler} sizes vLLM's KV cache; --engine {eng.name} sizes its own "
                             "otherwise: give --engine vllm, vllm-async or vllm-v0, or leave --sampler out")
        eng = replace(eng, profile_sampler=args.sampler)
    sm = served_model(args.model)
    sv = Serving(sm, cluster, lo, **_precisions(args, sm), engine=eng,
                 mtp_tokens=args.mtp_tokens, draft_model=served_model(args.draft_model) if args.draft_model else None,
                 **({} if args.mtp_acceptance is None else {"mtp_acceptance": args.mtp_acceptance}))
    # the engine's cap: --max-batch, else its own default (vLLM's max_num_seqs, TensorRT-LLM's batch size)
    wl = replace(wl, max_batch=default_max_batch(sv.engine, cluster))
    return sv, wl, gpus


def _refuse_idle_flags(args) -> None:
    """A flag that only acts with another one, given without it: named, rather than ignored."""
    if args.percentile is not None and args.request_rate is None:
        raise ValueError(f"--percentile {args.percentile:g} is the tail of Poisson arrivals' latencies: give "
                         "--request-rate R (or max) with it, or leave it out")
    if args.mtp_acceptance is not None and not args.mtp_tokens:
        raise ValueError(f"--mtp-acceptance {args.mtp_acceptance:g} is the chance a draft token is accepted: give "
                         "--mtp-tokens K (drafts per step) with it, or leave it out")


def _rate(text: str) -> float | str:
    """--request-rate: requests/s, or 'max'."""
    if text.strip().lower() == "max":
        return "max"
    try:
        rate = finite_float(text)
    except argparse.ArgumentTypeError:  # not a number, nan or infinite
        rate = 0.0
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected requests/s > 0 (e.g. 2.5) or 'max'")
    return rate


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def parse_disaggregate(text: str) -> tuple[int, int]:
    """`--disaggregate P:D` -> (prefill GPUs, decode GPUs)."""
    a, _, b = text.partition(":")
    if not (a.isdigit() and b.isdigit() and int(a) > 0 and int(b) > 0):
        raise ValueError(f"--disaggregate {text!r}: expected PREFILL_GPUS:DECODE_GPUS, e.g. 8:24")
    return int(a), int(b)


def _precisions(args, sm) -> dict:
    """--precision and --kv-precision, fp32 by default on --cluster local (meshlm serves in fp32 on CPUs),
    --expert-gemm-precision and --dense-precision (an MoE model's alone: a dense model is all --precision)."""
    if args.dense_precision is not None and not sm.cfg.is_moe:
        raise ValueError(f"--dense-precision {args.dense_precision} sets the weights beside an MoE model's routed "
                         f"experts; {args.model} has none: give its weights' precision as --precision")
    default = "fp32" if args.cluster == "local" else "bf16"
    return {"precision": args.precision or default, "kv_precision": args.kv_precision or default,
            "expert_gemm_precision": args.expert_gemm_precision, "dense_precision": args.dense_precision}


def format_serving(r: dict, model: str, gpu: str) -> str:
    """One answer of `plan infer` (`serving_modes.estimate_serving`'s JSON) as the lines the terminal shows."""
    head = (f"{model} on {r['gpus']} x {gpu} ({r['layout']}), {r['precision']} weights, {r['kv_precision']} KV: "
            f"weights {r['weights_gib']:.1f} GiB/GPU, "
            + (f"the engine's profile run {r['profile_gib']:.1f} GiB/GPU (its sampler over --max-batch rows), "
               if r.get("profile_gib") else "")
            + f"KV {r['kv_bytes_per_token'] / 1024:.1f} KiB/token/GPU "
            f"({r['kv_bytes_per_request'] / 2**20:,.1f} MiB/request/GPU), one sequence of up to "
            f"{r['max_context_tokens']:,} tokens fits -> max concurrency {r['max_concurrency']} "
            f"at {r['input_len']}+{r['output_len']} tokens"
            + (f" ({r['prefix_hit']:.0%} of each prompt cached: {r['prefill_tokens_per_request']:,} tokens prefilled"
               + (f", the {r['shared_prefix_tokens']:,}-token prefix shared" if r.get("shared_prefix_tokens") else "")
               + ")" if r.get("prefix_hit") else "")
            + (f"; speculative: {r['draft_tokens_per_step']} drafts a step from "
               f"{r['draft_model'] or 'a one-layer draft head (an MTP module or EAGLE head)'}, "
               f"{r['tokens_per_step']:.2f} tokens a step"
               if r.get("draft_tokens_per_step") else ""))
    if not r["fits"]:
        return f"{head}\n  does not fit: {r['reason']}"
    rate = f", keeps up: {'yes' if r['keeps_up'] else 'NO'} (utilisation {r['utilization']:.0%})" if "keeps_up" in r else ""
    if "percentile" in r:
        from meshlm.planner.serving_modes import percentile_label

        p = percentile_label(r["percentile"])
        rate = (f"; {r['request_rate']:.3g} requests/s{rate}, TTFT {p} {_text_ms(r[f'ttft_{p}_ms'], 1)}, TPOT {p} "
                f"{_text_ms(r[f'tpot_{p}_ms'], 2)}")
    queue = f" ({r['running']} running, {r['queued']} waiting in the queue)" if r.get("queued") else ""
    mode = {"static": "static batch", "concurrency": "continuous batching"}.get(r["mode"], r["mode"])
    if r.get("disaggregate"):
        mode = "disaggregated {}:{} (prefill:decode GPUs), {}".format(*r["disaggregate"], mode)
    if "meets_slo" in r:
        what = "rate" if r["mode"] == "max-rate" else "concurrency"
        mode += " within the latency targets" if r["meets_slo"] else f" (NO {what} meets the latency targets)"
    warning = "".join(f"\n  {r[k]}" for k in ("context_note", "caution") if r.get(k))
    return (f"{head}\n  {mode} at concurrency {r['concurrency']:.0f}{queue}: {r['output_tokens_per_s']:,.0f} output "
            f"tokens/s ({r['output_tokens_per_s_per_gpu']:,.0f}/GPU), TTFT {_text_ms(r['ttft_ms'], 1)}, TPOT "
            f"{_text_ms(r['tpot_ms'], 2)}, bound: {r['bound']}{rate}; {r['power_w'] / 1e3:.3g} kW, "
            f"{r['joules_per_output_token']:.3g} J/output token{warning}")


def _text_ms(ms: float | None, digits: int) -> str:
    """A latency in ms, or what a latency without bound means."""
    return "without bound (the queue grows)" if ms is None else f"{ms:.{digits}f} ms"
