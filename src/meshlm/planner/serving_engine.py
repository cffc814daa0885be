"""What the serving software adds to the roofline of one iteration: how its kernels meet the roofline's corner,
whether its decode-attention kernel shares a KV head's loads among the query heads of a group, how its expert
all-to-all moves tokens, and how attention data-parallel ranks wait for the slowest.

Responsible for: `Engine` (the properties of a serving engine the time depends on) and its presets (`ENGINES`),
`roofline` (a kernel's time from its compute and memory times) and `busiest_rank_prefill` (attention data
parallelism's per-iteration imbalance).
Not responsible for: which work an iteration carries (`serving.py`), batching policy (`serving_modes.py`) or the
expert all-to-all's time (`collectives.expert_all_to_all`, which training's flex dispatcher shares).
Every constant here comes from a kernel benchmark or an engine's documentation, named where it is set -- none is
fitted to a published end-to-end serving figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The roofline's corner. A kernel near the ridge point is slower than the larger of its compute and memory times:
# it cannot stream its operands at full bandwidth while its tensor cores run at full rate. DeepGEMM's published
# H800 benchmarks (deepseek-ai/DeepGEMM README, Feb 2025, tables "Normal GEMMs for dense models" and "Grouped
# GEMMs for MoE models (masked layout)") show it: the masked grouped GEMMs of 4 x 256 tokens (N 4096, K 7168 and
# N 7168, K 2048) sit where FLOPs / (0.62 x 1979 TFLOP/s) equals bytes / (0.8 x 3.35 TB/s), and take 1.31x that
# time (64.5 us and 36.9 us); 2 x 512 tokens (compute time 1.8x the memory time) take 1.18x the compute time;
# M = 64 dense GEMMs (memory time 3.6x the compute time) run at the memory time within 3%. An L_p norm of the two
# times with p = 2 reproduces these within ~5% (1.41x at the corner, 1.15x at a 1.8 ratio, 1.04x at 3.6).
ROOFLINE_P = 2.0

# DeepEP's normal (prefill) kernels occupy SMs while they overlap compute: the library's example sets
# `Buffer.set_num_sms(24)` (deepseek-ai/DeepEP, README of V1, "Example use in model training or inference
# prefilling"); 24 of an H800's 132 SMs.
DEEPEP_NORMAL_SMS = 24


# Kernel launches. A GPU runs a kernel no shorter than its launch: NVIDIA's "Getting Started with CUDA Graphs"
# (developer.nvidia.com/blog/cuda-graphs, 2019) times a 2.9 us kernel at 3.8 us apiece launched back to back from
# the host (the host's launch rate is the limit) and 3.4 us apiece replayed from a CUDA graph. The elementwise
# kernels of a decoder layer around its GEMMs and attention do almost no work in decode, so each costs the floor:
# vLLM's LlamaDecoderLayer runs five (two fused residual-add + RMSNorm, rotary embedding, reshape_and_cache,
# SiluAndMul); a MoE layer adds routing and token permutation (TensorRT-LLM fuses DeepSeek's top-k routing from 18
# ops into 2 kernels, "Optimizing DeepSeek R1 Throughput on NVIDIA Blackwell GPUs", tech blog 3; plus permute and
# un-permute): four. The GEMMs and attention kernels last at least the floor too (`kernel_floored`): a thin decode
# GEMM -- a 70B model's attention projections over 8 GPUs read 1-2 us of weights -- costs the floor, not its bytes.
KERNEL_FLOOR_S = 3.4e-6
HOST_LAUNCH_S = 3.8e-6
SMALL_KERNELS_PER_LAYER = 5
SMALL_KERNELS_PER_MOE_LAYER = 4

# Expert load imbalance under expert parallelism: the MoE layer waits for the rank whose experts received the most
# routed tokens. TensorRT-LLM's "Scaling Expert Parallelism in TensorRT-LLM (Part 1)" (tech blog 4, Table 1:
# DeepSeek-R1, EP32 on 32 GB200, local batch 256, a machine-translation dataset, mean over layers and iterations)
# measures the busiest rank's excess over the mean ("imbalance ratio"): 1.564 with 8 experts per rank and no
# balancer; 0.109 and 0.115 with DeepSeek's EPLB (redundant experts: 9 slots per rank at EP32, 8 at EP36). The same
# table's per-expert spread (std 164.1 over a mean of 128 tokens) divided by sqrt(8) is its per-rank spread
# (491.6 / 1024): expert loads add up like independent draws. `expert_imbalance` carries the measurement to other
# degrees on that footing: the per-rank spread scales as 1 / sqrt(experts per rank) (without a balancer; EPLB
# balances ranks directly), and the busiest of n ranks sits sqrt(2 ln n) spreads above the mean (the largest of n
# normal draws), taken relative to the measured n = 32.
EP_IMBALANCE_NO_EPLB = 1.564
EP_IMBALANCE_EPLB = (0.109 + 0.115) / 2
EP_IMBALANCE_MEASURED_AT = 32  # ranks
EP_IMBALANCE_EXPERTS_PER_RANK = 8  # at that measurement, without EPLB


# vLLM's V0 engine (through v0.7) runs its scheduler, the input preparation of the next step and the processing of
# the last step's outputs in Python between GPU steps, one sequence at a time, while the GPU waits: "the GPU is often
# idle, waiting for CPU operations (5-13ms of GPU bubble)" per decode step (vLLM RFC #6854, "Multi-Step
# Scheduling", July 2024); vLLM's v0.6.0 post ("vLLM v0.6.0: 2.7x Throughput Improvement and 5x Latency
# Reduction", Sept 2024) profiles Llama 3 8B on one H100 at 29% of the time in scheduling and input preparation
# against 38% on the GPU, and finds output processing "with the overhead increasing as batch sizes grew". The work is
# per sequence (block tables, positions and slot mappings built, one sampled token pythonized and detokenized per
# sequence), so the bubble is priced per running sequence: the RFC's upper 13 ms at vLLM's default max_num_seqs of
# 256 running sequences. Multi-step scheduling (--num-scheduler-steps, off by default in v0.6) and the V1 engine
# (default from v0.8, scheduling overlapped with the GPU) remove it; TensorRT-LLM's C++ batch manager and SGLang's
# overlap scheduler (v0.4, "zero-overhead batch scheduler") hide it.
VLLM_V0_HOST_PER_SEQ_S = 13e-3 / 256

# vLLM's V1 engine (default from v0.8) moved tokenization, detokenization and streaming into a front-end process
# that runs beside the engine core ("vLLM V1: A Major Upgrade to vLLM's Core Architecture", blog, Jan 2025): that
# output processing is hidden. Its engine core loop is still serial: "schedule -> execute_model ->
# update_from_output ... doesn't allow us to utilize CPU cycles while the GPU is running the model" (RFC #23233,
# Aug 2025). Async scheduling (PR #19970, experimental `--async-scheduling`, June 2025; with PR #23569, "Fully
# overlap model execution", input preparation too) schedules one step ahead; it became the default in v0.14.0
# (PR #27614, "Enable async scheduling by default", released Jan 2026). Between v0.8 and v0.13 the GPU waits for
# the engine core's host work every step. What async scheduling takes off each step is measured at stated batches
# in PR #23914 ("implement async_scheduling in single process mode", Aug 2025, vLLM main of v0.10): one A100 pair
# at TP=2, `gbs` requests queued at once, each generating 512 tokens (max_tokens=512, ignore_eos=True), so `gbs`
# run every step; its table's tokens/s sync -> async below. A step of `gbs` sequences takes gbs / tps seconds, so
# the step time async hides is gbs / sync - gbs / async: 0.34, 0.78, 1.70 and 3.26 ms at 32, 64, 128 and 256
# running requests -- linear in them, 10.6-13.3 us each; the least-squares slope is priced per running sequence
# (VLLM_V1_HOST_PER_SEQ_S, ~12.8 us). A LOWER BOUND on V1's synchronous host time: the tokens/s are read as output
# tokens (counting the prompts would make every step longer by the same factor), and what the async path does not
# overlap is not in the difference. Of it, `Scheduler.update_from_output` alone is 0.287 ms at a decode batch of 256
# (PR #46112's baseline, benchmarks/overheads/benchmark_scheduler_update_from_output.py, June 2026): 1.1 us a
# request; the rest is schedule(), the model runner's `_update_states` / `_prepare_inputs` and the sampled tokens'
# copy to the host (PR #42131 reports schedule() at 0.2 ms and _update_states at ~0.18 ms a decode step on B200).
VLLM_V1_ASYNC_GAIN = ((32, 1014, 1025), (64, 1853, 1896), (128, 3048, 3177), (256, 4039, 4258))  # (gbs, sync, async)
VLLM_V1_HOST_PER_SEQ_S = (sum(b * (b / sync - b / fast) for b, sync, fast in VLLM_V1_ASYNC_GAIN)
                          / sum(b * b for b, _, _ in VLLM_V1_ASYNC_GAIN))


def roofline(compute_s: float, memory_s: float) -> float:
    """Seconds of a kernel whose FLOPs alone take `compute_s` and whose bytes alone take `memory_s` (ROOFLINE_P)."""
    hi, lo = max(compute_s, memory_s), min(compute_s, memory_s)
    if lo <= 0 or hi == float("inf"):
        return hi
    return hi * (1.0 + (lo / hi) ** ROOFLINE_P) ** (1.0 / ROOFLINE_P)


# SGLang's default `mem_fraction_static` (the whole GPU's share for weights and KV pool) before 0.4.8, by tp size
# (python/sglang/srt/server_args.py, 0.3-0.4.7): (at least this tp, share), the first that holds.
SGLANG_TP_FRACTIONS = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))


def sglang_static_fraction(hbm_bytes: float, *, parallel: int, dp_attention: bool, draft: bool) -> float:
    """SGLang's default `mem_fraction_static` from 0.4.8 (server_args.py, `_handle_mem_fraction_static`, PR #10975):
    the GPU less a reserve for activations and CUDA graphs by its memory class -- 2.8 + tp x pp / 10 GiB under 35
    GiB (chunks of 2K), 9.5 + tp x pp / 2 under 90 (A100, H100: 8K chunks, graphs to batch 160), 12 + tp x pp / 2
    under 160 (H20, H200), 32 above (B200, MI300: 16K chunks, graphs to 512) -- plus 2 GiB with a draft model and 4
    with attention data parallelism, over the GPU, rounded to 3 places as it rounds."""
    gib = hbm_bytes / 2**30
    if gib < 35:
        reserve = 2.8 + parallel / 10
    elif gib < 90:
        reserve = 9.5 + parallel / 2
    elif gib < 160:
        reserve = 12 + parallel / 2
    else:
        reserve = 32.0
    reserve += 2.0 * draft + 4.0 * dp_attention
    return round((gib - reserve) / gib, 3)


# vLLM's default `gpu_memory_utilization` (EngineArgs, vllm/engine/arg_utils.py; the same in V0 and V1): "The fraction
# of GPU memory to be used for the model executor", the whole device's -- weights, activations and the KV cache
# together -- where TensorRT-LLM's `free_gpu_memory_fraction` is of what the weights leave.
VLLM_GPU_MEMORY_UTILIZATION = 0.9

# What vLLM's profile run takes out of that share before the KV cache gets the rest. Its worker sizes the cache as
# gpu_memory_utilization x the GPU's memory less the weights, less the peak of torch's allocations during a profile run,
# less what other allocations grew by (vllm/v1/worker/gpu_worker.py `determine_available_memory`, PR #19312, June 2025;
# V0 and earlier V1 counted the same peak). The profile run ends with a dummy sampling pass over one row of logits for
# every request the engine may run (max_num_seqs; V1's `_dummy_sampler_run`, PR #13594; V0 profiled with as many
# sequences), with top-k (the vocabulary less one) and top-p set -- the peak per row of the vocabulary, by sampler:
#   * "native", PyTorch's top-k / top-p (vLLM's default on CUDA without FlashInfer, and from v0.11.1, PR #26859, until
#     its Triton top-k / top-p, PR #33538, Feb 2026 -- later versions are priced so too, unmeasured; on ROCm): it sorts
#     the whole vocabulary of every row -- the float32 logits, the sorted values, their int64 indices and the sort's
#     scratch live at once. Measured: "torch peak memory increase: 5.62GiB" for Qwen3-235B-A22B-FP8 at TP4 on H200
#     with max_num_seqs at its default 1024 and a vocabulary of 151,936 (the log in vllm-project/vllm PR #21429, July
#     2025): 38.8 bytes a logit. Three other logs agree: gemma-3-4b-it on a B200, vocabulary 262,208, 1024 rows,
#     "9.96 GiB for peak activation" (PR #21489; 39.8 bytes); V0's Llama 3 8B on H100, vocabulary 128,256, 256 rows,
#     "PyTorch activation peak memory 1.26GiB" (PR #10511; 41 bytes, the rest of the peak the forward's); gpt-oss-120b
#     on one H100 (issue #23278, v0.10.1): "Model loading took 65.9651 GiB", "Available KV cache memory: -2.14 GiB" --
#     71.3 GiB (0.9 x 79.22) less both leaves 7.47 GiB to the profile, 1024 x 201,088 x 38.8 bytes = 7.44 GiB of it;
#   * "flashinfer", FlashInfer's rejection sampling (vLLM's default on CUDA where FlashInfer is installed -- its Docker
#     image, and its CUDA wheels once "flashinfer-python is a default dep", PR #26859's words -- from PR #15777, May
#     2025, to PR #26859, Oct 2025: v0.9-v0.11.0): no sort; the caller's bf16 logits, the sampler's float32 copy,
#     FlashInfer's top-k-masked copy and its softmax live at once, 2 + 4 + 4 + 4 = 14 bytes
#     (vllm/v1/sample/ops/topk_topp_sampler.py `flashinfer_sample` -> `top_k_top_p_sampling_from_logits`; counted from
#     the code, not measured).
# The forward pass's own transients at the token budget are smaller at the engine's defaults (Qwen3-32B's MLP at 8,192
# tokens: ~1.3 GB against its native sampler's 6.0 GB); they, the other allocations (NCCL's buffers) and the GPU memory
# the driver keeps are left to `Cluster.reserved_bytes`.
VLLM_PROFILE_BYTES_PER_LOGIT = {"native": 5.62 * 2**30 / (1024 * 151_936), "flashinfer": 2 + 4 + 4 + 4}


@dataclass(frozen=True)
class Engine:
    """The serving software, as far as the time of an iteration depends on it.

    `gqa_shared_kv`: the decode-attention kernel loads a KV head once for all the query heads that share it
    (GQA/MQA). TensorRT-LLM before its XQA kernel (v0.7) ran decode attention with the masked multi-head
    attention kernel, one query head per thread block, each loading its group's K/V: for GQA the cache is read
    once per query head. The XQA kernel fixed it "reducing data loading" (TensorRT-LLM blog "New XQA-kernel
    provides 2.4x more Llama-70B throughput within the same latency budget", docs/source/blogs/XQA-kernel.md; the
    Falcon-180B/H200 blog: "improved its GQA kernels, in the generation phase, providing up to 2.4x improvement
    on Llama-70B over TensorRT-LLM v0.5"). FlashAttention/FlashInfer/vLLM kernels pack the group (shared).
    `ep_all_to_all`: "deepep" -- decode iterations use DeepEP's low-latency kernels (every routed copy sent on
    its own, pure RDMA across nodes), prefill iterations its normal kernels (one copy per remote node, forwarded
    over NVLink inside it; SMs taken from compute) -- SGLang's and DeepSeek's large-EP serving; "allgather" -- every
    rank's tokens all-gathered to the expert group and the outputs reduce-scattered back (vLLM's default backend,
    AgRsAll2AllManager; DeepEP is its opt-in `--all2all-backend`); "all_to_all" -- the routed copies alone, node by
    node (`collectives.expert_all_to_all`'s normal kernels).
    `cuda_graphs`: without them the host launches every kernel of an iteration, which then takes at least
    kernels x HOST_LAUNCH_S ("host" bound); TensorRT-LLM's gptSession ran without them before 0.7.
    `two_batch_overlap`: DeepSeek's serving ("Day 6" inference system overview: dual micro-batch overlap in
    prefill and decode) and SGLang's two-batch overlap (TBO) split the batch in two so one half's dispatch and
    combine run under the other half's compute -- each half reading the weights, each transfer hidden only under
    the compute paired with it (overlapped_half, DeepSeek's published schedules). TensorRT-LLM's attention-DP
    MoE of 2025 (all-gather and reduce-scatter of the tokens around the experts, "Optimizing DeepSeek R1
    Throughput on NVIDIA Blackwell GPUs", tech blog 3) leaves it exposed.
    `expert_balance`: how evenly the routed tokens load the expert-parallel ranks (`expert_imbalance`): "none"
    (experts placed as numbered; TensorRT-LLM's load balancer is opt-in, `moe_config.load_balancer`), "eplb"
    (DeepSeek's EPLB with redundant experts: DeepSeek's own serving, "Day 6" overview, 32 redundant experts; SGLang's
    large-EP deployment) or "perfect" (a simulated perfect balance).
    `adp_balanced`: attention data-parallel ranks schedule prefills together (TensorRT-LLM's ADP balance
    strategy, or disaggregated prefill); otherwise each rank prefills when it has room and the iteration waits
    for the busiest (`busiest_rank_prefill`).
    `host_per_seq_s`: CPU seconds per running sequence per iteration that the GPU waits for (scheduling, input
    preparation and output processing done between steps: vLLM's V0 engine, VLLM_V0_HOST_PER_SEQ_S; vLLM's V1
    engine before async scheduling became its default, VLLM_V1_HOST_PER_SEQ_S, a lower bound); 0 where the
    engine overlaps them with the GPU.
    `host_per_step_s`, `host_per_layer_s`, `host_per_layer_seq_s`: the rest of an engine's host work that nothing
    overlaps, per step, per decoder layer of a stage and per (layer, sequence): an eager engine's operator
    dispatch (meshlm's, measured by `meshlm plan calibrate`: `meshlm_engine`). Where given, it replaces the
    kernel-launch floor of the elementwise kernels (it already holds their dispatch).
    `driver_broadcast`: one driver rank schedules and samples (meshlm's serving ranks): each step it sends the
    step's input to the other ranks (two broadcasts per axis, the length then the JSON) and gathers the tp
    ranks' vocabulary slices of the logits; under cp the sampled rows' hidden states are all-reduced.
    `device_memory_fraction`: the share of the whole GPU the engine may fill, its weights and own buffers inside it
    (vLLM's `gpu_memory_utilization`, VLLM_GPU_MEMORY_UTILIZATION by default: the KV cache gets what is left of it);
    `sglang_memory`: SGLang's default share of that kind (`mem_fraction_static`), "reserve" (0.4.8 on: the GPU less
    a reserve by its memory class, `sglang_static_fraction`) or "tp" (before: by the tp size, SGLANG_TP_FRACTIONS);
    neither: the KV cache takes `free_memory_fraction` of what the weights leave (TensorRT-LLM's
    `free_gpu_memory_fraction`; None: `serving.KV_MEMORY_FRACTION`, its default). `device_share` says which.
    `cp_decode_on_owner`: under cp a decode token's projections run only on the cp rank that holds its KV slot
    (meshlm's cp serving), not on every cp rank, and its query is all-gathered per layer for the split-KV
    attention.
    `max_running`: the cap on the requests one rank runs at once the engine is configured with (vLLM's max_num_seqs,
    TensorRT-LLM's max_batch_size); None: its default on the GPU (`default_max_batch`).
    `profile_sampler`: the KV cache gets what is left after a profile run that samples one row of logits per request
    the engine may run, with this sampler (vLLM: "native" or "flashinfer", VLLM_PROFILE_BYTES_PER_LOGIT,
    `profile_peak_bytes`); None: no such run.
    `cascade_attention`: where every running request shares a cached prompt prefix (`--prefix-shared`), a step's
    attention reads that prefix's KV once for all of them and each request's own tokens after it, the two partials
    merged by their log-sum-exp (FlashInfer's "cascade inference"), when vLLM's rule says it pays
    (`vllm_cascades`): vLLM's V1 engine, its FlashAttention and FlashInfer backends. SGLang, TensorRT-LLM and meshlm's
    engine read the prefix once per request (meshlm's: measured on this machine's CPU, a cascade there was slower,
    README.md).
    """

    name: str
    cuda_graphs: bool = True  # decode iterations replayed from CUDA graphs (else launched kernel by kernel)
    two_batch_overlap: bool = True  # with ep > 1, two micro-batches hide each other's expert all-to-all
    gqa_shared_kv: bool = True
    ep_all_to_all: str = "deepep"
    adp_balanced: bool = False
    expert_balance: str = "none"
    host_per_seq_s: float = 0.0
    host_per_step_s: float = 0.0
    host_per_layer_s: float = 0.0
    host_per_layer_seq_s: float = 0.0
    driver_broadcast: bool = False
    cp_decode_on_owner: bool = False
    device_memory_fraction: float | None = None
    free_memory_fraction: float | None = None
    sglang_memory: str | None = None
    max_running: int | None = None
    profile_sampler: str | None = None
    cascade_attention: bool = False

    def __post_init__(self):
        if self.expert_balance not in ("none", "eplb", "perfect"):
            raise ValueError(f"expert_balance={self.expert_balance!r}: choose none, eplb or perfect")
        for name in ("host_per_seq_s", "host_per_step_s", "host_per_layer_s", "host_per_layer_seq_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.ep_all_to_all not in ("deepep", "allgather", "all_to_all"):
            raise ValueError(f"ep_all_to_all={self.ep_all_to_all!r}: choose deepep, allgather or all_to_all")
        if self.profile_sampler not in (None, *VLLM_PROFILE_BYTES_PER_LOGIT):
            raise ValueError(f"profile_sampler={self.profile_sampler!r}: choose one of "
                             f"{sorted(VLLM_PROFILE_BYTES_PER_LOGIT)} or None")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running={self.max_running} must be >= 1")
        if self.sglang_memory not in (None, "reserve", "tp"):
            raise ValueError(f"sglang_memory={self.sglang_memory!r}: choose reserve, tp or None")
        for name in ("device_memory_fraction", "free_memory_fraction"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"{name}={value} must be in (0, 1]")

    @property
    def whole_device(self) -> bool:
        """Whether the engine budgets a share of the whole GPU (vLLM, SGLang) rather than of what the weights leave."""
        return self.device_memory_fraction is not None or self.sglang_memory is not None

    def device_share(self, hbm_bytes: float, *, parallel: int, dp_attention: bool, draft: bool) -> float | None:
        """The share of the whole GPU the engine budgets for weights and KV cache (`device_memory_fraction`, or
        SGLang's default by `sglang_memory`), or None where the KV cache takes a share of what the weights leave.
        `parallel`: tp x pp; `dp_attention`: attention data parallelism; `draft`: a speculative draft model."""
        if self.device_memory_fraction is not None:
            return self.device_memory_fraction
        if self.sglang_memory == "reserve":
            return sglang_static_fraction(hbm_bytes, parallel=parallel, dp_attention=dp_attention, draft=draft)
        if self.sglang_memory == "tp":
            return next(f for tp, f in SGLANG_TP_FRACTIONS if parallel >= tp)
        return None

    def profile_peak_bytes(self, vocab_size: int, cluster) -> float:
        """Bytes per GPU the engine's profile run peaks at beside the weights, which its KV cache cannot have
        (`profile_sampler`: its sampler over one row of logits per request it may run on `cluster`)."""
        if self.profile_sampler is None:
            return 0.0
        return default_max_batch(self, cluster) * vocab_size * VLLM_PROFILE_BYTES_PER_LOGIT[self.profile_sampler]

    @property
    def eager_host(self) -> bool:
        """Whether the engine's measured per-layer host work replaces the kernel-launch floor."""
        return self.host_per_layer_s > 0 or self.host_per_layer_seq_s > 0


_VLLM = dict(device_memory_fraction=VLLM_GPU_MEMORY_UTILIZATION, ep_all_to_all="allgather", two_batch_overlap=False,
             profile_sampler="native")
ENGINES = {e.name: e for e in (
    Engine("default"),
    Engine("tensorrt-llm", two_batch_overlap=False),
    Engine("tensorrt-llm<0.7", cuda_graphs=False, gqa_shared_kv=False, two_batch_overlap=False),
    # vLLM's defaults under expert parallelism: all-gather / reduce-scatter around the experts, no dual-batch overlap
    # (`--enable-dbo`, opt-in, DP + EP only: docs "Dual Batch Overlap"); a row naming them turns them on (engine_of)
    # V1 engine, v0.8-v0.13: synchronous scheduling
    Engine("vllm", host_per_seq_s=VLLM_V1_HOST_PER_SEQ_S, cascade_attention=True, **_VLLM),
    # V1 engine from v0.14: async scheduling (the default) overlaps its host work
    Engine("vllm-async", cascade_attention=True, **_VLLM),
    # v0.7 and before, single-step scheduling
    Engine("vllm-v0", host_per_seq_s=VLLM_V0_HOST_PER_SEQ_S, **_VLLM),
    Engine("sglang", sglang_memory="reserve"),  # 0.4.8 on; published_serving.engine_of reads older versions
    Engine("deepseek", expert_balance="eplb"),  # DeepSeek's own serving ("Day 6" overview): TBO, DeepEP, EPLB
)}


# vLLM's V1 rule for cascade attention (vllm/v1/attention/backends/flash_attn.py, `use_cascade_attention`, which its
# FlashInfer backend calls too): a common prefix of at least 256 tokens, at least 8 requests in the step, and, where
# the plain kernel would run FlashDecoding (grouped-query heads, every request decoding one token), a tile count
# model of the two kernels over the GPU's SMs (128 x 128 tiles): cascade runs q_heads x ceil(requests / 128) thread
# blocks a wave, FlashDecoding requests x kv_heads x ceil(q_heads / kv_heads / 128) per prefix tile.
VLLM_CASCADE_MIN_PREFIX = 256
VLLM_CASCADE_MIN_REQUESTS = 8
VLLM_CASCADE_TILE = 128


def vllm_cascades(*, prefix: float, requests: float, q_heads: int, kv_heads: int, sms: int, decode_only: bool) -> bool:
    """Whether vLLM's V1 engine attends a step by cascade attention (see above): `prefix` tokens every one of its
    `requests` shares, `q_heads` / `kv_heads` heads per GPU, `sms` the GPU's SMs (0: no CUDA GPU, never),
    `decode_only`: every request decodes one token this step."""
    if prefix < VLLM_CASCADE_MIN_PREFIX or requests < VLLM_CASCADE_MIN_REQUESTS or sms < 1:
        return False
    per_kv = q_heads // kv_heads
    if not (decode_only and per_kv > 1):  # no FlashDecoding to beat
        return True
    n, tile = math.ceil(requests), VLLM_CASCADE_TILE
    tiles = math.ceil(prefix / tile)
    cascade = math.ceil(q_heads * math.ceil(n / tile) / sms) * tiles
    flash_decoding = math.ceil(n * kv_heads * math.ceil(per_kv / tile) * tiles / sms)
    return cascade < flash_decoding


def meshlm_engine(serving_host: dict, *, cluster: str = "local") -> Engine:
    """meshlm's own engine (`meshlm.infer`) on a cluster whose calibration measured its host work
    (`Cluster.serving_host`, from `calibrate_serving.measure_serving_host`: seconds per step, per decoder layer, per
    sequence and per (layer, sequence) of `Engine.step` on tiny models). Rank 0 schedules, samples and
    detokenizes in Python between steps, and every rank dispatches its PyTorch operators one by one: nothing
    of it overlaps the compute."""
    if not serving_host:
        raise ValueError(f"--engine meshlm needs the engine's host time per step, which `meshlm plan calibrate` "
                         f"measures (serving_host in the calibration file); cluster {cluster!r} has none: rerun "
                         f"`meshlm plan calibrate` or pick another --engine")
    return Engine("meshlm", host_per_step_s=serving_host["step_s"], host_per_seq_s=serving_host["seq_s"],
                  host_per_layer_s=serving_host["layer_s"], host_per_layer_seq_s=serving_host["layer_seq_s"],
                  driver_broadcast=True, cp_decode_on_owner=True, two_batch_overlap=False)


# The engines' default caps on the requests one rank runs at once, where a deployment sets none: TensorRT-LLM's
# BuildConfig max_batch_size (2048); vLLM's max_num_seqs, which its V1 engine sets by the device
# (EngineArgs.get_batch_defaults, vllm/engine/arg_utils.py: "For GPUs like H100 and MI300x, use larger default values",
# 1024 on a GPU of at least 70 GiB that is not an A100 -- PR #17885 measured a loss there -- for the LLM class and the
# API server alike; 256 on the others, and on the V0 engine). SGLang sizes its cap from the memory it has (none here).
TRTLLM_MAX_BATCH = 2048
VLLM_MAX_NUM_SEQS = 256
VLLM_V1_LARGE_GPU_MAX_NUM_SEQS = 1024
VLLM_V1_LARGE_GPU_BYTES = 70 * 2**30


def default_max_batch(eng: Engine, cluster) -> int | None:
    """The running-request cap per rank `eng` applies on `cluster`'s GPUs: the one it is configured with
    (`Engine.max_running`), else its default there (module constants); None: none."""
    if eng.max_running is not None:
        return eng.max_running
    if eng.name.startswith("tensorrt-llm"):
        return TRTLLM_MAX_BATCH
    if eng.name in ("vllm", "vllm-async") and cluster.hbm_bytes >= VLLM_V1_LARGE_GPU_BYTES \
            and "a100" not in cluster.name:
        return VLLM_V1_LARGE_GPU_MAX_NUM_SEQS
    return VLLM_MAX_NUM_SEQS if eng.name.startswith("vllm") else None


def engine(name: str, cluster=None) -> Engine:
    """A preset of `ENGINES`, or "meshlm" priced from `cluster`'s calibration (`meshlm_engine`)."""
    if name == "meshlm":
        return meshlm_engine(getattr(cluster, "serving_host", {}), cluster=getattr(cluster, "name", "?"))
    if name not in ENGINES:
        raise ValueError(f"--engine {name!r}: choose one of {sorted(ENGINES) + ['meshlm']}")
    return ENGINES[name]


def overlapped_half(st: dict, *, decode: bool) -> float:
    """Seconds of one micro-batch's half of a two-batch-overlapped step (the pair's time / 2), on the schedules
    DeepSeek published with its inference profiles (deepseek-ai/profile-data, README's prefill and decode figures),
    which SGLang's TBO runs as written (sglang operations_strategy.py, `_compute_moe_deepseek_blog_prefill` /
    `_decode`). An all-to-all hides only under the compute the schedule runs beside it:
      * decode (low-latency kernels, no SMs held): per micro-batch and layer, its dispatch runs under its shared
        experts and the other's attention projections, its routed experts run alone (they need the dispatch and
        feed the combine), its combine runs under the other's core attention, output projection and gate --
        max(shared + attn_in, dispatch) + experts + max(attn_out, combine);
      * prefill (normal kernels on 24 SMs): `prefill_pair`, the three stages a layer of each micro-batch runs
        in turn on one compute stream while the dispatches and combines run on one communication stream.
    Each term summed over the MoE layers (they are alike, so the sum of maxima is the maxima of the sums)."""
    a_in, a_out, s, m = st["attn_in"], st["attn_out"], st["shared"], st["experts"]
    d, c = st["dispatch"], st["combine"]
    if decode:
        return st["rest"] + max(s + a_in, d) + m + max(a_out, c)
    return st["rest"] + prefill_pair(a=a_in + a_out, s=s, m=m, d=d, c=c) / 2


def prefill_pair(*, a: float, s: float, m: float, d: float, c: float) -> float:
    """Seconds of both micro-batches through a MoE layer under SGLang's prefill TBO (`_compute_moe_deepseek_blog_
    prefill`, tbo_delta_stages 0): each micro-batch's layer is three stages -- (1) attention and gate, its dispatch
    launched; (2) wait for that dispatch, routed experts, its combine launched; (3) shared experts, wait for that
    combine -- run A1 B1 A2 B2 A3 B3 on one compute stream, whose waits hold back every kernel queued after them,
    while DeepEP's buffer runs the dispatches and combines one after another on its communication stream, each
    from when the compute it follows is done. So A's combine hides under B's routed experts, B's only under the
    shared experts, and the next layer's attention queues behind B's wait. `a`, `s`, `m`: one micro-batch's
    attention (with the gate), shared and routed experts; `d`, `c`: its dispatch and combine. The schedule repeats
    each layer from the same state (its communication stream idle when B3 ends), so totals over layers go in."""
    a_done = a  # A1
    a_sent = a_done + d
    b_done = a_done + a  # B1
    b_sent = max(a_sent, b_done) + d
    a_experts = max(b_done, a_sent) + m  # A2
    a_back = max(b_sent, a_experts) + c
    b_experts = max(a_experts, b_sent) + m  # B2
    b_back = max(a_back, b_experts) + c
    a_end = max(b_experts + s, a_back)  # A3
    return max(a_end + s, b_back)  # B3


def expert_imbalance(num_experts: int, ep: int, balance: str) -> float:
    """The busiest expert-parallel rank's routed tokens over the mean (>= 1, at most ep): measured at EP32 by
    TensorRT-LLM (module constants), carried to `ep` ranks holding `num_experts / ep` experts each."""
    if ep <= 1 or balance == "perfect":
        return 1.0
    spread = math.sqrt(math.log(ep) / math.log(EP_IMBALANCE_MEASURED_AT))
    if balance == "eplb":
        return min(float(ep), 1.0 + EP_IMBALANCE_EPLB * spread)
    per_rank = max(1.0, num_experts / ep)
    return min(float(ep), 1.0 + EP_IMBALANCE_NO_EPLB * spread * math.sqrt(EP_IMBALANCE_EXPERTS_PER_RANK / per_rank))


def busiest_rank_prefill(mean_tokens: float, request_tokens: float, ranks: int) -> tuple[float, float]:
    """Attention data parallelism without balancing: (probability, tokens) of the prefill the busiest of `ranks`
    carries in one iteration, when each rank prefills `mean_tokens` per iteration on average in pieces of
    `request_tokens` (a request's prompt, or the engine's chunk) that start whenever that rank has room.

    The MoE layers join every rank each layer, so "the iteration time is dominated by the slowest rank"
    (TensorRT-LLM, "ADP Balance Strategy", docs/source/blogs/tech_blog/blog10_ADP_Balance_Strategy.md: round-robin
    baseline with 54% average balance ratio on DeepSeek-V3, 8 GB200). A rank carries a piece in an iteration with
    probability q = mean / piece; some rank does with 1 - (1 - q)^ranks, and then the iteration lasts as long as
    that rank's attention and dense layers over the piece."""
    if ranks <= 1 or request_tokens <= 0 or mean_tokens >= request_tokens:
        return 1.0, mean_tokens
    q = mean_tokens / request_tokens
    return 1.0 - (1.0 - q) ** ranks, request_tokens


def layer_kernels(*, moe: bool, tp: int, ep: int) -> tuple[int, int]:
    """(elementwise kernels, all kernels) of one decoder layer's forward: the elementwise ones (module constants),
    four GEMMs (qkv, output, gate-up, down; a MoE layer: router, shared expert's two, the experts' two grouped
    GEMMs), attention, two all-reduces under tp, a dispatch and a combine under ep."""
    small = SMALL_KERNELS_PER_LAYER + (SMALL_KERNELS_PER_MOE_LAYER if moe else 0)
    gemms = 2 + (5 if moe else 2)
    comm = (2 if tp > 1 else 0) + (2 if moe and ep > 1 else 0)
    return small, small + gemms + 1 + comm


def stage_kernels(*, layers: float, moe: float, tp: int, ep: int) -> tuple[float, float]:
    """(elementwise kernels, all kernels) one GPU runs per micro-step through a stage of `layers` decoder layers, `moe`
    of them MoE layers."""
    a, b = layer_kernels(moe=False, tp=tp, ep=ep), layer_kernels(moe=True, tp=tp, ep=ep)
    return (layers - moe) * a[0] + moe * b[0], (layers - moe) * a[1] + moe * b[1]


def kernel_floored(kernels: dict, *, layers: int, pp: int, dense: float, experts: float,
                   attn: float) -> tuple[float, float, float]:
    """The dense GEMMs', routed experts' and attention's seconds of a micro-step through one of `pp` stages with each
    kernel lasting at least its launch (KERNEL_FLOOR_S, as the elementwise kernels do). `kernels`:
    `ServedModel.gemm_kernels()`, (parameters of one kernel, kernels per forward) by "body", "head" and "experts". A
    time is shared out over its kernels by their parameters (the same tokens pass each, so FLOPs and bytes both go as
    parameters; attention evenly over the `layers`), and each share raised to the floor."""

    def floored(seconds: float, pieces: list[tuple[float, float]]) -> float:
        total = sum(p * n for p, n in pieces) / pp
        if seconds <= 0 or not total:
            return seconds
        return sum(n / pp * max(seconds * p / total, KERNEL_FLOOR_S) for p, n in pieces)

    return (floored(dense, kernels["body"] + kernels["head"]), floored(experts, kernels["experts"]),
            floored(attn, [(1.0, layers)]))
