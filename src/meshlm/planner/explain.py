"""Words for a plan: why the winning layout wins and what bounds it.

Responsible for: turning a `SearchResult` (or one `Estimate`) into a short paragraph naming the
largest time component after compute and the link it runs on, the largest memory component and the
headroom, and how the winner compares with the runner-up and with the best layout of other
(tp, pp) classes; the cautions where the published runs of a plan's regime came out far from the prediction
(`overlap_caution` for training, `serving_caution` for a serving deployment).
Not responsible for: any number (they come from `cost.py` and `serving_modes.py`; the cautions' spreads from the dev
rows, rechecked by the tests).
"""

from __future__ import annotations

from meshlm.planner.cost import MIN_HEADROOM, Estimate
from meshlm.planner.memory import memory_measures
from meshlm.planner.search import SearchResult

# Which mesh axis (and so which link) each communication time component rides on.
_COMPONENT_AXIS = {"tp_comm": "tp", "cp_comm": "cp", "ep_comm": "ep", "pp_p2p": "pp", "dp_comm": "dp_shard"}
_COMPONENT_WORDS = {
    "compute": "matmul and elementwise compute", "recompute": "activation recomputation",
    "tp_comm": "tensor-parallel all-reduces / all-gathers", "cp_comm": "context-parallel K/V exchange",
    "ep_comm": "expert all-to-all", "pp_bubble": "pipeline bubble", "pp_p2p": "pipeline send/recv",
    "dp_comm": "data-parallel / ZeRO communication not hidden by backward", "optimizer": "optimizer step",
}


def bound_of(est: Estimate) -> str:
    """One sentence: the biggest non-compute time component and the biggest memory component."""
    overheads = {k: v for k, v in est.time_s.items() if k not in ("compute", "step")}
    worst = max(overheads, key=overheads.get)
    step = est.time_s["step"]
    axis = _COMPONENT_AXIS.get(worst)
    if worst == "dp_comm" and est.layout.dp_replicate > 1:
        axis = "dp_replicate"
    link = f" on the {est.links.get(axis, 'none')} link" if axis and est.links.get(axis, "none") != "none" else ""
    mem = {k: v for k, v in est.memory_gib.items() if k != "total"}
    big_mem = max(mem, key=mem.get)
    return (f"compute is {est.time_s['compute'] / step:.0%} of the step; the largest overhead is the "
            f"{_COMPONENT_WORDS[worst]} ({overheads[worst]:.3g} s, {overheads[worst] / step:.0%}){link}. "
            f"Memory: {est.memory_gib['total']:.1f} of {est.hbm_gib:.0f} GiB, largest part {big_mem} "
            f"({mem[big_mem]:.1f} GiB); " + memory_verdict(est) + " " + measured_as(est))


def measured_as(est: Estimate) -> str:
    """The layout's memory as the tools a user checks it with would report it (`memory.memory_measures`)."""
    m = memory_measures(est.memory_gib)
    return (f"As measured: torch.cuda.max_memory_allocated ~{m['allocated']:.1f} GiB, max_memory_reserved "
            f"~{m['reserved']:.1f} GiB, nvidia-smi ~{m['device']:.1f} GiB.")


# The published step over the predicted one of the dev rows the overlap caution rests on (ZeRO-3 / FSDP rows whose
# collectives alone outlast their compute), least and most, as benchmarks/data/published_runs_dev.csv stands
# (tests/test_planner_training_kinds.py recomputes them): 24 rows -- Modalities' FSDP2 of a 6B model on 8-128 of
# Leonardo's A100s at one or two sequences per GPU (group AS) 0.73-1.08x, Paxml's GPT-3 175B under XLA's FSDP on
# 128-2048 H100s (W) 0.88-0.93x, PyTorch FSDP1 at one sequence per GPU (AG) 1.40-1.56x (KempnerForge's 70B, AH, left
# the regime once its gradients were reduced once a step: `Job.fsdp_no_sync`).
OVERLAP_SPREAD = (0.73, 1.56)


def overlap_caution(est: Estimate) -> str | None:
    """A warning where the step leans on overlap: its ZeRO-3 / FSDP collectives alone take longer than its compute.
    The planner hides all of them that each pass's compute covers; the published runs of that regime took
    OVERLAP_SPREAD of the predicted step (Modalities' FSDP2 the least, PyTorch FSDP1 at one sequence per GPU the most),
    where those with collectives under a fifth of the compute came within a few percent. A warning, never a
    correction."""
    ratio = est.collectives_over_compute
    if est.layout.zero_stage < 3 or ratio <= 1:
        return None
    lo, hi = OVERLAP_SPREAD
    return (f"Caution: its ZeRO-3 gathers and reduce-scatters alone take {ratio:.1f}x its "
            "compute, and the planner hides all that each pass's compute covers; published FSDP runs in this regime "
            f"took {lo:.2f}-{hi:.2f}x the predicted step (benchmarks/data/ groups AS, W, AG: Modalities' FSDP2 on "
            "Leonardo's A100s the least, PyTorch FSDP1 at one sequence per GPU the most): read the step time as "
            "uncertain either way.")


# A decode iteration's tensor-parallel all-reduce is "small" up to this many bytes: the range where the engines run
# one-shot all-reduce kernels of their own rather than NCCL's / RCCL's rings (vLLM's custom all-reduce: one stage up to
# 256-512 KB by the group's size; TensorRT-LLM's ONESHOT strategy) -- which the planner prices as rings.
SMALL_ALL_REDUCE_BYTES = 512 * 1024
# The parts and engines of the published runs the second caution rests on (groups D and L: vLLM on MI300X).
MI300X_PARTS = ("MI300X", "MI325X")  # one compute die
VLLM_ENGINES = ("vllm", "vllm-async", "vllm-v0")
MI300X_VLLM_RUNNING = 256  # requests running per engine from which the second caution applies (D's least, 256)
# What the published runs of each regime came out at, published over predicted throughput (least, most), as the
# dev rows in benchmarks/data/serving_runs_dev.csv stand (tests/test_planner_serving_published.py recomputes them).
SMALL_ALL_REDUCE_SPREAD = (0.71, 2.50)  # groups B (MTP drafts), D, J, M: batch 1 to 16
MI300X_VLLM_SPREAD = (0.70, 0.92)  # groups D and L: 256 to 3,200 requests running
WEIGHT_ONLY_SPREAD = (0.41, 0.87)  # groups P and Q: vLLM's gpt-oss (MXFP4 experts, W4A16) on H100 and A100
TRTLLM_ENGINES = ("tensorrt-llm", "tensorrt-llm<0.7")
LATENT_ADP_SPREAD = (0.68, 1.03)  # groups A and B: TensorRT-LLM's DeepSeek-R1, attention DP + EP on one node


def serving_caution(*, bound: str, tp: int, running: float, all_reduce_bytes: float, engine: str,
                    gpu: str, weight_only: bool = False, latent_adp: bool = False) -> str | None:
    """A warning where the published serving runs of a deployment's regime came out far from the prediction
    (benchmarks/data/serving_runs_dev.md, caveats 15-20) -- never a correction:
      * a decode bound by small tensor-parallel all-reduces (`bound` "scale-up link", `all_reduce_bytes` up to
        SMALL_ALL_REDUCE_BYTES): priced as rings, run by the engines' one-shot kernels (SMALL_ALL_REDUCE_SPREAD);
      * vLLM on MI300X with at least MI300X_VLLM_RUNNING requests `running` per engine, every such dev row bound by
        compute here (MI300X_VLLM_SPREAD);
      * routed experts of 4-bit weights multiplied by 16-bit activations (`weight_only`, W4A16: the weights
        dequantized in the kernel, priced at Marlin's measured share of the bf16 GEMM rate), every such dev row
        too fast (WEIGHT_ONLY_SPREAD);
      * TensorRT-LLM serving a latent-attention MoE (DeepSeek's) with attention data parallelism and expert
        parallelism (`latent_adp`), all such dev rows but one too fast (LATENT_ADP_SPREAD)."""
    if bound == "scale-up link" and tp > 1 and all_reduce_bytes <= SMALL_ALL_REDUCE_BYTES:
        lo, hi = SMALL_ALL_REDUCE_SPREAD
        return ("Caution: its decode waits on small tensor-parallel all-reduces, priced as NCCL/RCCL rings, which "
                f"serving engines replace with one-shot kernels of their own; published runs in this regime came out "
                f"from {1 - lo:.0%} below to {hi:.1f}x the predicted throughput (benchmarks/data/serving_runs_dev.md, "
                "groups B, D, J, M): read its TPOT as uncertain.")
    if running >= MI300X_VLLM_RUNNING and gpu.startswith(MI300X_PARTS) and engine in VLLM_ENGINES:
        lo, hi = MI300X_VLLM_SPREAD
        return (f"Caution: published vLLM runs on MI300X with {MI300X_VLLM_RUNNING}-3,200 requests running came out "
                f"{100 * (1 - hi):.0f}-{100 * (1 - lo):.0f}% below the predicted throughput "
                "(benchmarks/data/serving_runs_dev.md, groups D and L): read the throughput as an upper bound.")
    if weight_only:
        lo, hi = WEIGHT_ONLY_SPREAD
        return ("Caution: its routed experts' 4-bit weights are dequantized into 16-bit GEMMs (W4A16), priced at "
                "the rate Marlin, vLLM's kernel for them, was measured at; published runs of this kind "
                "(vLLM's gpt-oss on H100 and A100) came out "
                f"{100 * (1 - hi):.0f}-{100 * (1 - lo):.0f}% below the predicted throughput "
                "(benchmarks/data/serving_runs_dev.md, groups P and Q): read the throughput as an upper bound.")
    if latent_adp and engine in TRTLLM_ENGINES:
        lo, hi = LATENT_ADP_SPREAD
        return ("Caution: TensorRT-LLM's published runs of a latent-attention MoE (DeepSeek-R1) with attention data "
                f"parallelism and expert parallelism came out from {100 * (hi - 1):.0f}% above to "
                f"{100 * (1 - lo):.0f}% below the predicted throughput, all but one below (benchmarks/data/"
                "serving_runs_dev.md, groups A and B): read the throughput as optimistic.")
    return None


def memory_verdict(est: Estimate) -> str:
    """Whether the layout fits and why, in the same terms as `Estimate.fits` (cost.MIN_HEADROOM)."""
    headroom = est.hbm_gib - est.memory_gib["total"]
    margin = est.hbm_gib * MIN_HEADROOM
    if headroom < 0:
        return f"{-headroom:.1f} GiB over capacity: does not fit."
    if not est.fits:
        return (f"only {headroom:.1f} GiB free, under the {margin:.1f} GiB ({MIN_HEADROOM:.0%} of the GPU) the "
                "planner keeps free for allocator spikes and library buffers: does not fit.")
    return f"{headroom:.1f} GiB headroom (fits, keeping the {margin:.1f} GiB margin)."


def zero_group_words(lo) -> str:
    """The ranks ZeRO shards over, named as the layout string names them (dp_shard, times cp)."""
    n = lo.dp_shard * lo.cp
    if lo.cp > 1:
        return f"the {n} ranks of dp_shard {lo.dp_shard} x cp {lo.cp}"
    return f"the {n} dp_shard ranks" + (f" of each of {lo.dp_replicate} replicas" if lo.dp_replicate > 1 else "")


def link_summary(est: Estimate) -> str:
    """Which link each parallel axis rides, and which communication bounds the step (plan compare)."""
    lo = est.layout
    axes = [(name, deg) for name, deg in (("TP", lo.tp), ("EP", lo.ep), ("CP", lo.cp), ("PP", lo.pp),
                                          ("DP", lo.dp)) if deg > 1]
    key = {"TP": "tp", "EP": "ep", "CP": "cp", "PP": "pp", "DP": "dp_shard" if lo.dp_shard > 1 else "dp_replicate"}
    where = ", ".join(f"{name}={deg} on {est.links.get(key[name], 'none')}" for name, deg in axes) or "one GPU"
    step = est.time_s["step"]
    comm = {k: est.time_s.get(k, 0.0) for k in _COMPONENT_AXIS}
    worst = max(comm, key=comm.get)
    if comm[worst] <= 0:
        return f"links: {where}; no communication on the critical path (compute-bound)."
    axis = _COMPONENT_AXIS[worst]
    if worst == "dp_comm" and lo.dp_replicate > 1:
        axis = "dp_replicate"
    return (f"links: {where}; bound by the {_COMPONENT_WORDS[worst]} on the {est.links.get(axis, 'none')} link "
            f"({comm[worst] / step:.0%} of the step).")


def _diff(a: Estimate, b: Estimate) -> str:
    """Name the time components where `a` saves most against `b`."""
    keys = [k for k in a.time_s if k != "step"]
    gains = sorted(((b.time_s[k] - a.time_s[k], k) for k in keys), reverse=True)
    parts = [f"{_COMPONENT_WORDS[k]} ({g:.3g} s less)" for g, k in gains[:2] if g > 1e-3 * b.time_s["step"]]
    losses = [f"{_COMPONENT_WORDS[k]} ({-g:.3g} s more)" for g, k in gains[::-1][:1] if g < -1e-3 * b.time_s["step"]]
    text = ", ".join(parts) if parts else "nearly identical components"
    if losses:
        text += f"; it pays for it with {losses[0]}"
    return text


def explain(result: SearchResult) -> str:
    if not result.ranked:
        miss = result.closest_miss
        text = f"No layout fits in memory ({result.evaluated} evaluated)."
        if miss is not None:
            text += (f" The closest is {miss.layout.short()} at {miss.memory_gib['total']:.1f} GiB of "
                     f"{miss.hbm_gib:.0f} GiB. " + bound_of(miss)
                     + " Use more GPUs, a GPU with more memory, a shorter sequence or a smaller model.")
        return text
    win = result.ranked[0]
    lo = win.layout
    lines = [f"Winner: {lo.short()} -- step {win.time_s['step']:.3g} s, MFU {win.mfu:.1%}"
             + (f" (HFU {win.hfu:.1%} with {lo.recompute} recompute)" if lo.recompute != "none" else "")
             + f", {win.tokens_per_s:,.0f} tokens/s, {win.num_microbatches} microbatches per step."]
    why = []
    if lo.tp > 1:
        why.append(f"TP={lo.tp} keeps the per-layer collectives on the {win.links['tp']} link")
    if lo.pp > 1:
        why.append(f"PP={lo.pp} splits the layers so weights and optimizer state fit, with a "
                   f"{lo.pp_schedule} bubble of {win.time_s['pp_bubble'] / win.time_s['step']:.0%}")
    if lo.cp > 1:
        how = {"allgather": "K/V all-gathered once per layer: one exposed collective instead of cp - 1 "
                            "overlapped ring steps",
               "ulysses": "attention split by heads through two exposed all-to-alls per layer, each rank "
                          "attending over the whole sequence",
               "ring": "K/V passed round a ring, overlapped with attention"}[lo.cp_method]
        why.append(f"CP={lo.cp} splits each sequence, cutting per-rank activations and TP degree ({how})")
    if lo.zero_stage:
        why.append(f"ZeRO-{lo.zero_stage} over {zero_group_words(lo)} shards "
                   + {1: "optimizer state", 2: "optimizer state and gradients", 3: "weights, gradients and optimizer state"}[lo.zero_stage]
                   + ("" if lo.zero_stage < 3 else ", weights gathered per micro-batch" if lo.zero3_reshards
                      else ", weights gathered once per step and kept"))
    if lo.recompute != "none":
        why.append(f"{lo.recompute} recomputation is the cheapest policy that fits activations in memory")
    if why:
        lines.append("Why: " + "; ".join(why) + ".")
    lines.append("Bound: " + bound_of(win))
    if (caution := overlap_caution(win)) is not None:
        lines.append(caution)
    if len(result.ranked) > 1:
        second = result.ranked[1]
        gap = second.time_s["step"] / win.time_s["step"] - 1
        lines.append(f"Runner-up {second.layout.short()} is {gap:.1%} slower: the winner has "
                     f"{_diff(win, second)}.")
    others = []
    for (tp, pp), est in sorted(result.best_by_class.items()):
        if (tp, pp) == (lo.tp, lo.pp) or not (tp == lo.tp or pp == lo.pp):
            continue
        if est.fits:
            others.append(f"tp={tp},pp={pp}: best {est.time_s['step'] / win.time_s['step'] - 1:+.0%} step time")
        else:
            others.append(f"tp={tp},pp={pp}: does not fit (needs {est.memory_gib['total']:.0f} GiB)")
    if others:
        lines.append("Alternatives: " + "; ".join(others[:6]) + ".")
    return "\n".join(lines)
