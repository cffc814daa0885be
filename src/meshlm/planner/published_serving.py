"""The serving planner against published serving results: each row of benchmarks/data/serving_runs_dev.csv
priced with its OWN deployment (GPU, layout, precisions, lengths, batching) and compared with its figures.

Responsible for: turning a row into a `Serving` + `Workload` (`deployment_of`), predicting the row's published
metrics (`predict_row`: output tokens/s -- whole system or per GPU as the row gives it --, input tokens/s for
prefill-only rows, TTFT, TPOT), and the median |error| per group and overall (`summarize`; `score_rows`).
Not responsible for: any estimate (`serving.py`, `serving_modes.py`), reading the load a row states (its request
rate and latency limits: `published_load.py`) or the data (benchmarks/data/README.md).

Nothing is fitted to any row: the constants are cluster.py's (datasheets, kernel benchmarks) and serving.py's
(engine defaults). Choices the rows leave open, made the same way for every row, never from the figures:
  * a row's model by its name without case or punctuation, the longest known name it starts with ("llama2-70b-99.9" is
    Llama-2-70B); the load a row was measured under as its cells state it (published_load.py): a throughput measured
    within latency targets the row states ("TTFT p99 <= 2 s, TPOT p99 <= 200 ms", as MLPerf's server scenarios set)
    priced as the best concurrency meeting them -- in a server scenario (requests arriving) as the highest Poisson rate
    whose tails at the percentile the row names meet them (`serving_modes.max_rate`; the means where it names none);
    a server or interactive row of an MLPerf round stating none held to its benchmark's rules (loadgen's mlperf.conf,
    p99);
  * architectures from the models' published configs (`ARCHS`, or a preset of the same config, `PRESETS`: Llama 3.1
    70B is Llama 3 / 3.3 70B's; Mixtral 8x7B's experts split over the TP group as the rows state no EP; the DeepSeek
    rows use the deepseek-v3 preset with its latent attention; gpt-oss's sliding-window layers as its config.json
    lays them out); GPT-J's 4h GeLU MLP as SwiGLU of 2/3 the width (same
    parameters and FLOPs);
  * KV precision when blank: fp8 for TensorRT-LLM with fp8/fp4 ModelOpt checkpoints (their quantization
    configs set kv_cache_quant_algo FP8), the model's 16-bit dtype otherwise (vLLM's and SGLang's
    kv_cache_dtype "auto"; DeepSeek's native FP8 checkpoint);
  * the engine from the row's engine and version (serving_engine.ENGINES): TensorRT-LLM before 0.7 without its
    XQA kernel or CUDA graphs, later TensorRT-LLM without two-batch overlap, vLLM before 0.8 (or unversioned in a
    2024 source) as its V0 engine with single-step scheduling (the default then) whose CPU work the GPU waits for,
    vLLM 0.8-0.13 as its V1 engine with synchronous scheduling (the GPU waits for its engine core's host work, a
    measured lower bound), vLLM from 0.14 with async scheduling (its default then; before, where the row's settings
    name `--async-scheduling`, and after, not where they name `--no-async-scheduling`), SGLang as the default; NVIDIA
    NIM as the engine under it (`engine_name`: TensorRT-LLM for its optimized profiles); the engine cell matched however
    a table spells the engine (`ENGINE_NAMES`: "TRT-LLM", "ROCm vLLM");
  * experts' load balance: EPLB for DeepSeek's own serving and SGLang's large-EP deployment, none for TensorRT-LLM
    (its balancer is opt-in), perfect where a row says it simulated that -- in its notes, or in its source as
    DeepSeek's profile rows do ("we simulate an absolutely balanced MoE routing", deepseek-ai/profile-data) --
    (serving_engine.expert_imbalance);
  * NVFP4 DeepSeek-R1: FP4 routed experts, FP8 everything else (the checkpoint's recipe, `Serving.dense_precision`);
    gpt-oss's MXFP4 checkpoint: FP4 routed experts, BF16 everything else (`dense_precision_of`); TensorRT-LLM
    multiplies those experts with MXFP8 activations on Blackwell, BF16 on Hopper (`expert_gemm_precision_of`);
  * "tp 8, dp 8" on 8 GPUs is TensorRT-LLM's attention data parallelism: attention dp 8 x tp 1, experts over all 8;
    with no dp, replicas of tp x pp fill the row's GPUs; a row naming none of tp, pp, dp (MLPerf's results do not)
    on the layout of its GPUs the planner ranks first, as `plan infer` without --layout does (`_best_layout`);
  * fixed-batch and latency rows: a static batch; offline rows: the best concurrency that fits, capped by the
    engine's running-request limit (the row's max_batch_size / max_num_seqs per rank where given, else for
    TensorRT-LLM's perf-overview rows (v0.17's `trtllm-bench build --dataset` and v1.0's throughput run alike) the
    one trtllm-bench derives itself, `trtllm_bench_max_batch`, else vLLM's default max_num_seqs -- V1's 1024 on a GPU
    of 70 GiB or more but an A100, 256 otherwise and on V0 --, TensorRT-LLM's default max_batch_size 2048); rows
    with a client concurrency run it; server rows measured at a stated request rate ("2 requests/s", a benchmark
    client's --request-rate: `request_rate`) as Poisson arrivals at it, their mean TTFT and TPOT where the deployment
    keeps up, their throughput where it does not (`_fixed_rate`);
  * prefill-only rows (disaggregated prefill nodes): the pool's input tokens/s at full chunks of the row's
    tokens per device (else 16,384); decode-only rows: the row's sequences per GPU at its KV length (else the
    most that fit, at most the 256 DeepEP's low-latency kernels are sized for);
  * MTP rows: the draft tokens their notes give (Serving.mtp_tokens), DeepSeek-V3's measured acceptance; "~1K" is
    1024 tokens;
  * not modelled, reported as skipped: a simulated MTP run, the production mixes without lengths.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import replace
from pathlib import Path

from meshlm.config import ModelConfig
from meshlm.planner.cluster import get_cluster
from meshlm.planner.published_load import latency_targets, request_rate, target_percentile
from meshlm.planner.published_rows import cluster_of, name_key, predict_each, read_table
from meshlm.planner.serving import Serving, iteration_time
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_engine import ENGINES, Engine, default_max_batch
from meshlm.planner.serving_model import WEIGHT_BYTES, ServedModel, served_model
from meshlm.planner.serving_modes import (clients, max_concurrency, max_rate, offline, poisson, power_w,
                                          serving_layouts, static_batch)
from meshlm.planner.serving_workload import Workload

# Architectures of the rows' models (Hugging Face config.json of each). Llama 3.x: the presets.
_L2 = dict(vocab_size=32000, max_seq_len=4096, rope_theta=10000.0)
ARCHS = {
    "gpt-j-6b": dict(vocab_size=50400, hidden_size=4096, num_layers=28, num_heads=16, num_kv_heads=16,
                     intermediate_size=10880, max_seq_len=2048),  # EleutherAI/gpt-j-6b; SwiGLU of 2/3 x 16384
    "llama-2-7b": dict(_L2, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32, intermediate_size=11008),
    "llama-2-13b": dict(_L2, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=40, intermediate_size=13824),
    "llama-2-70b": dict(_L2, hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, intermediate_size=28672),
    "qwen3-235b-a22b": dict(vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                            head_dim=128, intermediate_size=12288, max_seq_len=40960, qk_norm=True, num_experts=128,
                            num_experts_per_token=8, moe_intermediate_size=1536),  # Qwen/Qwen3-235B-A22B
    "qwen3-14b": dict(vocab_size=151936, hidden_size=5120, num_layers=40, num_heads=40, num_kv_heads=8, head_dim=128,
                      intermediate_size=17408, max_seq_len=40960, qk_norm=True),  # Qwen/Qwen3-14B
    "qwen3-32b": dict(vocab_size=151936, hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128,
                      intermediate_size=25600, max_seq_len=40960, qk_norm=True),  # Qwen/Qwen3-32B
    # openai/gpt-oss-20b and -120b: layer_types alternate sliding (128-token window) and full attention, sliding first
    "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64,
                        intermediate_size=2880, max_seq_len=131072, attention_bias=True, num_experts=32,
                        num_experts_per_token=4, moe_intermediate_size=2880),
    "gpt-oss-120b": dict(vocab_size=201088, hidden_size=2880, num_layers=36, num_heads=64, num_kv_heads=8, head_dim=64,
                         intermediate_size=2880, max_seq_len=131072, attention_bias=True, num_experts=128,
                         num_experts_per_token=4, moe_intermediate_size=2880),
}
# Sliding windows per layer (0: full attention) of an ARCHS model, from its config.json (`layer_windows`):
# gpt-oss's layer_types alternate sliding_attention (128 tokens) and full_attention, sliding first.
WINDOWS = {"gpt-oss-20b": (128, 0) * 12, "gpt-oss-120b": (128, 0) * 18}
PRESETS = {"llama-3.1-8b": "llama3-8b", "llama-3.1-70b": "llama3-70b", "llama-3.3-70b": "llama3-70b",
           "llama-3.1-405b": "llama3-405b", "mixtral-8x7b": "mixtral-8x7b", "deepseek-r1": "deepseek-v3",
           "deepseek-v3": "deepseek-v3"}
# Other names tables give those models: MLPerf Inference calls GPT-J 6B "gptj-99" / "gptj-99.9" (its accuracy targets).
ALIASES = {"gpt-j": "gpt-j-6b"}
# trtllm-bench, with which TensorRT-LLM's perf-overview measures ("trtllm-bench ... throughput --dataset ...
# --extra_llm_api_options ...", no --max_batch_size / --max_num_tokens), sets the engine's running-request cap
# from its own memory estimate (tensorrt_llm/bench/build/tuning.py: calc_engine_setting and finetune_setting;
# bench/benchmark/utils/general.py: get_settings): KV of 2 x layers x max(tp, num_key_value_heads) x head_size
# bytes per token (config.json's head_dim, else hidden / heads) in --kv_cache_free_gpu_mem_fraction (default 0.90)
# of the GPUs' memory less the checkpoint's stored elements x bytes per element (fp8 1, NVFP4 0.5), requests of
# ISL + OSL, at most 4096 / pp, rounded up: below 256 to a multiple of 32 (at least 64), below 1024 to 128, else
# to 256. DeepSeek's config.json names 128 KV heads and no head_dim: the tool prices its latent cache as 128 heads
# of 7168 / 128 = 56, ~25x the 576 values per token and layer MLA caches, so its cap binds far below the KV.
TRTLLM_BENCH_KV_FRACTION = 0.90  # the perf-overview sets 0.95 "in many cases": the same DeepSeek caps, and the
# dense rows' caps stay above what their KV holds either way
TRTLLM_BENCH_MAX_REQUESTS = 4096
TRTLLM_BENCH_ELEMENT_BYTES = {"fp8": 1.0, "fp4": 0.5}
# DeepSeek-V3/R1 checkpoints hold the MTP module beside the main model: "685B, which includes 671B of the Main
# Model weights and 14B of the Multi-Token Prediction (MTP) Module weights" (deepseek-ai/DeepSeek-V3 README).
DEEPSEEK_CHECKPOINT_SHARE = 685 / 671
PREFILL_TOKENS_PER_DEVICE = 16384
# Decode tokens per GPU of an expert-parallel decode pool: DeepEP's low-latency buffers are sized for
# `num_max_dispatch_tokens_per_rank`, "the actual batch size in the decoding engine", which its README recommends
# to keep below 256 (deepseek-ai/DeepEP, V1 README, "Example use in inference decoding").
DEEPEP_DECODE_TOKENS = 256


class Skip(Exception):
    """A row the planner does not model; the message says why."""


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a published serving table (a column it lacks reads as blank: `published_rows.read_table`)."""
    return read_table(path)


def _int(text: str) -> int | None:
    """The first count in a field ("~1K": 1024), never a share ("56.3% of input tokens ...": no count)."""
    m = re.search(r"(?<![\d.])(\d[\d,]*)(?![\d.,]*%)(\s*[kK]\b)?", text or "")
    if not m:
        return None
    return int(m.group(1).replace(",", "")) * (1024 if m.group(2) else 1)  # "~1K (real dataset)": 1024


def _float(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def model_of(row: dict) -> ServedModel:
    """The row's model: a preset or an `ARCHS` config whose name starts the row's (compared by
    `published_rows.name_key`, the longest name first: "llama2-70b-99.9" is Llama-2-70B, "DeepSeek-R1-0528"
    DeepSeek-R1; `ALIASES`: "gptj-99" is GPT-J 6B)."""
    key = name_key(row["model"])
    names = sorted([*PRESETS, *ARCHS, *ALIASES], key=len, reverse=True)
    name = next((n for n in names if key.startswith(name_key(n))), None)
    name = ALIASES.get(name, name)
    if name in PRESETS:
        return served_model(PRESETS[name])
    if name in ARCHS:
        return ServedModel(ModelConfig(**ARCHS[name]), windows=WINDOWS.get(name, ()))
    raise Skip(f"no architecture for {row['model']!r}")


def precisions_of(row: dict) -> tuple[str, str]:
    w = row["weight_precision"].lower()
    weights = "fp4" if "fp4" in w else "fp8" if "fp8" in w else "bf16"
    kv = row["kv_precision"].lower()
    if kv:
        return weights, "fp8" if "fp8" in kv else "bf16"
    trt_quantized = engine_name(row).startswith("tensorrt") and weights != "bf16" and "native" not in w
    return weights, "fp8" if trt_quantized else "bf16"


def layout_stated(row: dict) -> bool:
    """Whether the row names any of tp, pp, dp (MLPerf's results, for one, name none: `predict_row` searches)."""
    return any(_int(row[k]) for k in ("tp", "pp", "dp"))


def layout_of(row: dict) -> ServingLayout:
    """The row's layout; where it gives no dp, replicas of tp x pp fill its GPUs ("tp 2" on 8 GPUs is 4 replicas)."""
    n, tp, pp = _int(row["n_gpus"]), _int(row["tp"]) or 1, _int(row["pp"]) or 1
    if not n:
        raise Skip("the row gives no GPU count")
    if not _int(row["dp"]) and n % (tp * pp):
        raise Skip(f"tp x pp = {tp * pp} does not divide the row's {n} GPUs and no dp says how they are used")
    dp, ep = _int(row["dp"]) or n // (tp * pp), _int(row["ep"]) or 1
    if dp * pp > n:
        raise Skip(f"dp x pp = {dp * pp} exceeds the row's {n} GPUs")
    if dp * tp * pp > n:  # TensorRT-LLM's attention DP inside the tp group
        tp = n // (dp * pp)
    return ServingLayout(tp=tp, pp=pp, dp=dp, ep=ep)


def deployment_of(row: dict) -> Serving:
    weights, kv = precisions_of(row)
    try:
        cluster = get_cluster(cluster_of(row["gpu"]))
    except ValueError:
        raise Skip(f"no cluster preset for {row['gpu']!r}") from None
    sm = model_of(row)
    return Serving(sm, cluster, layout_of(row), precision=weights, kv_precision=kv, engine=engine_of(row),
                   dense_precision=dense_precision_of(row, weights, sm), mtp_tokens=mtp_of(row),
                   expert_gemm_precision=expert_gemm_precision_of(row, cluster))


def expert_gemm_precision_of(row: dict, cluster) -> str | None:
    """The routed experts' GEMMs where they run wider than their weights (`Serving.expert_gemm_precision`): MXFP4
    experts (gpt-oss) on a GPU without FP4 tensor cores multiply BF16 activations by weights dequantized in the kernel
    (W4A16: TensorRT-LLM on Hopper, vLLM's Marlin and Triton MoE kernels on Ampere and Hopper); on Blackwell
    TensorRT-LLM gives them MXFP8 activations. None otherwise (NVFP4 checkpoints quantize activations to FP4 too)."""
    if "mxfp4" not in row["weight_precision"].lower():
        return None
    if "fp4" not in cluster.peak_flops:
        return "bf16"
    return "fp8" if engine_name(row).startswith("tensorrt") else None


def dense_precision_of(row: dict, weights: str, sm: ServedModel) -> str | None:
    """Everything but the routed experts of an FP4 checkpoint (Serving.dense_precision): BF16 where the row names it
    ("MXFP4 (routed experts) + BF16 (rest)": gpt-oss's checkpoint leaves attention, router, embeddings and head
    unquantized, its quantization_config's modules_to_not_convert), else FP8 for NVIDIA's NVFP4 DeepSeek-R1
    checkpoints; None (the weights' precision) otherwise."""
    if weights != "fp4":
        return None
    if re.search(r"\+\s*bf16", row["weight_precision"].lower()):
        return "bf16"
    return "fp8" if sm.mla is not None else None


def mtp_of(row: dict) -> int:
    """MTP draft tokens per step the row's notes turn on (its num_nextn_predict_layers / "(N layers)"), else 0."""
    notes = row["notes"].lower()
    if "simulated mtp" in notes:
        raise Skip("a simulated MTP run (dummy attention kernels, an assumed acceptance), not a measured one")
    if not re.search(r"mtp[^.;]*\bon\b", notes) or "not stated" in notes:
        return 0
    m = re.search(r"num_nextn_predict_layers=(\d+)|\((\d+) layers\)", notes)
    if m is None:
        raise Skip("MTP on, with no number of draft tokens")
    return int(m.group(1) or m.group(2))


# The engines a row's engine cell names, however a table spells them ("TRT-LLM", "NVIDIA TensorRT-LLM", "ROCm vLLM",
# "SGLang (DeepEP)"): (pattern, name) in order, the first that matches.
ENGINE_NAMES = ((r"\bvllm", "vllm"), (r"\bsglang", "sglang"), (r"\b(tensorrt|trt)(?!\w)|\btrt[-_]?llm", "tensorrt-llm"),
                (r"\bdeepseek", "deepseek"))


def engine_name(row: dict) -> str:
    """The engine that runs the row's model, lower case (`ENGINE_NAMES`; else the cell as written). NVIDIA NIM for
    LLMs is a serving stack over other engines: it runs the prebuilt TensorRT-LLM engines of its optimized profiles
    (model, GPU, precision, TP) and falls back to a generic vLLM backend where none exists (NIM for LLMs docs,
    "Optimization" and "Support Matrix"): TensorRT-LLM unless the row's engine_version names vLLM."""
    name = row["engine"].strip().lower()
    if name.startswith("nvidia nim"):
        return "vllm" if "vllm" in row["engine_version"].lower() else "tensorrt-llm"
    return next((engine for pattern, engine in ENGINE_NAMES if re.search(pattern, name)), name)


def engine_of(row: dict) -> Engine:
    """The row's engine: TensorRT-LLM before 0.7 decodes GQA without sharing a group's KV loads (no XQA kernel);
    DeepSeek's own serving and SGLang's large-EP deployment balance experts with EPLB, a row that simulates a
    perfect balance has none; TensorRT-LLM's load balancer is opt-in (none of its rows turns it on)."""
    name, version = engine_name(row), re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", row["engine_version"])
    if name.startswith("tensorrt"):
        old = version is not None and (int(version.group(1)), int(version.group(2))) < (0, 7)
        eng = ENGINES["tensorrt-llm<0.7" if old else "tensorrt-llm"]
    elif name.startswith("deepseek"):
        eng = ENGINES["deepseek"]
    elif name.startswith("sglang"):
        eng = replace(ENGINES["sglang"], expert_balance="eplb") if (_int(row["ep"]) or 1) > 1 else ENGINES["sglang"]
        release = re.search(r"(\d+)\.(\d+)\.(\d+)", row["engine_version"])
        if release and tuple(int(x) for x in release.groups()) < (0, 4, 8):  # before its memory heuristics (PR #10975)
            eng = replace(eng, sglang_memory="tp")
        eng = _memory_share(row, eng, r"mem[-_]fraction[-_]static")
    elif name.startswith("vllm"):
        eng = _vllm_options(row, ENGINES[_vllm_preset(row, version)])
        eng = _memory_share(row, eng, r"gpu[-_]memory[-_]utilization")
        eng = replace(eng, max_running=_stated_cap(row), profile_sampler=_vllm_sampler(row, version))
    else:
        eng = ENGINES["default"]
    simulated = "perfect expert load balance" in row["notes"].lower()
    if simulated or "perfectly balanced routing" in row["source"].lower():  # DeepSeek's profiles
        eng = replace(eng, expert_balance="perfect")
    return eng


def _settings_text(row: dict) -> str:
    """The cells where a row states an engine's settings (its notes, batch and version cells), lower case."""
    return " ".join(row.get(k, "") for k in ("notes", "batch_or_concurrency", "engine_version")).lower()


def _names(text: str, pattern: str) -> bool:
    """Whether `text` names `pattern` other than negated ("no ...", "not ...", "without ..." before it)."""
    return re.search(r"(?<!no )(?<!not )(?<!without )(?:" + pattern + ")", text) is not None


def _vllm_options(row: dict, eng: Engine) -> Engine:
    """vLLM's opt-in expert-parallel features where the row names them (its notes, layout or batch cells): DeepEP
    kernels (`--all2all-backend deepep_*`), dual-batch overlap (`--enable-dbo`), EPLB (`--enable-eplb`)."""
    text = _settings_text(row)
    if _names(text, "deepep"):
        eng = replace(eng, ep_all_to_all="deepep")
    if _names(text, r"--enable-dbo|dual[- ]batch overlap"):
        eng = replace(eng, two_batch_overlap=True)
    if _names(text, r"(?:--enable-)?eplb"):
        eng = replace(eng, expert_balance="eplb")
    return eng


def _memory_share(row: dict, eng: Engine, flag: str) -> Engine:
    """The share of the whole GPU a row sets for the engine (vLLM's --gpu-memory-utilization, SGLang's
    --mem-fraction-static: `flag`, a value after it in `_settings_text`), else the engine's default."""
    m = re.search(r"(?:--)?" + flag + r"[\s=:]+(0?\.\d+|1\.0*)\b", _settings_text(row))
    return replace(eng, device_memory_fraction=float(m.group(1))) if m else eng


def _vllm_sampler(row: dict, version: re.Match | None) -> str:
    """The sampler a vLLM row's profile run sampled with (`serving_engine.VLLM_PROFILE_BYTES_PER_LOGIT`): FlashInfer's
    on an NVIDIA GPU from v0.9.0 through v0.11.0 (read as installed, as vLLM's Docker image has it), PyTorch's
    otherwise (ROCm, earlier and later versions, no version)."""
    if version is None or row.get("gpu", "").strip().upper().startswith("MI"):
        return "native"
    v = tuple(int(x or 0) for x in version.groups())
    return "flashinfer" if (0, 9, 0) <= v <= (0, 11, 0) else "native"


def _stated_cap(row: dict) -> int | None:
    """The running-request cap per rank a row states (its max_batch_size, vLLM's max_num_seqs), else None."""
    m = re.search(r"(?:max_batch_size|max_num_seqs) (\d+) per rank", row.get("batch_or_concurrency", ""))
    return int(m.group(1)) if m else None


def _vllm_preset(row: dict, version: re.Match | None) -> str:
    """vLLM's engine by version: V0 below 0.8 (V1 became the default in v0.8.0, March 2025) or with no version and a
    source dated 2024; V1 with synchronous scheduling through 0.13; V1 with async scheduling, its default from
    v0.14.0 (serving_engine.VLLM_V1_HOST_PER_SEQ_S), from 0.14. A V1 row whose settings (version, notes or batch cells:
    its server command) name `--async-scheduling` ran it before it became the default, one naming
    `--no-async-scheduling` ran without it after; a negated mention turns nothing on."""
    if version is None:
        return "vllm-v0" if "2024" in row["engine_version"] + row["source"] else "vllm"
    v = (int(version.group(1)), int(version.group(2)))
    if v < (0, 8):
        return "vllm-v0"
    text = _settings_text(row)
    if "--no-async-scheduling" in text:
        return "vllm"
    if _names(text, r"--async-scheduling|async(?:hronous)? scheduling"):
        return "vllm-async"
    return "vllm" if v < (0, 14) else "vllm-async"


def _max_batch(row: dict, sv: Serving, input_len: int, output_len: int) -> int | None:
    """The running-request cap per rank: the row's max_batch_size (vLLM: max_num_seqs) where it gives one,
    trtllm-bench's own where a perf-overview row leaves it to the tool (`trtllm_bench_max_batch`), else the engine's
    default (`serving_engine.default_max_batch`: vLLM V1's by the device); a burst of N prompts sent at once ("all N
    prompts at once") runs at most its share of them on each rank."""
    stated = _stated_cap(row)
    if stated is not None:
        return stated
    if "perf-overview" in row["source"].lower():
        return trtllm_bench_max_batch(sv, input_len, output_len)
    cap = default_max_batch(sv.engine, sv.cluster)
    burst = re.search(r"all (\d+) prompts at once", row["batch_or_concurrency"])
    if burst:
        share = math.ceil(int(burst.group(1)) / sv.layout.dp)
        return share if cap is None else min(cap, share)
    return cap


def trtllm_bench_max_batch(sv: Serving, input_len: int, output_len: int) -> int:
    """trtllm-bench's max_batch_size for a deployment and its dataset's lengths (module constants): the tool's
    estimate of requests whose KV fits, capped and rounded up as it does, times pp (the tool divides by pp: a cap per
    micro-batch, pp of them in flight). Every GPU of the deployment counts (its --tp spans the attention-DP ranks
    of a DEP run), and the cap applies to each rank's scheduler."""
    cfg, lo, cl = sv.sm.cfg, sv.layout, sv.cluster
    head = cfg.hidden_size // cfg.num_heads if sv.sm.mla is not None else cfg.head_dim
    kv_bytes = 1.0 if sv.kv_precision == "fp8" else 2.0
    token = 2 * cfg.num_layers * max(lo.stage, cfg.num_kv_heads) * head * kv_bytes
    element = TRTLLM_BENCH_ELEMENT_BYTES.get(sv.precision, 2.0)
    free = lo.world * cl.hbm_bytes - _checkpoint_elements(sv) * element
    raw = min(TRTLLM_BENCH_KV_FRACTION * free / (token * (input_len + output_len)), TRTLLM_BENCH_MAX_REQUESTS) / lo.pp
    step = 32 if raw < 256 else 128 if raw < 1024 else 256
    per_micro_batch = max(64 if raw < 256 else 0, step * math.ceil(raw / step))
    return per_micro_batch * lo.pp  # each of the pp micro-batches in flight holds up to max_batch_size


def _checkpoint_elements(sv: Serving) -> float:
    """Elements the checkpoint's safetensors hold (what trtllm-bench counts as its parameters): NVFP4 stores two
    weights per byte with an fp8 scale per 16 (the routed experts where `Serving.dense_precision` keeps the rest in
    fp8, else every projection); DeepSeek's checkpoints add the MTP module (DEEPSEEK_CHECKPOINT_SHARE)."""
    p = sv.sm.params()
    if sv.precision == "fp4":
        packed = p["experts"] if sv.dense_precision else p["experts"] + p["attention"] + p["mlp"]
        total = p["total"] - packed * (1 - WEIGHT_BYTES["fp4"])
    else:
        total = p["total"]
    return total * (DEEPSEEK_CHECKPOINT_SHARE if sv.sm.mla is not None else 1.0)


def predict_row(row: dict) -> dict:
    """The row's published metrics beside the predicted ones (or {"skip": reason})."""
    base = {"row_id": row["row_id"], "group": row["group"], "model": row["model"], "gpu": row["gpu"]}
    try:
        sv = deployment_of(row)
        sv, pred = (sv, _predict(row, sv)) if layout_stated(row) else _best_layout(row, sv)
    except (Skip, ValueError) as e:  # ValueError: a layout or lengths the planner refuses, its message says why
        return {**base, "skip": str(e)}
    out = dict(base, layout=sv.layout.label(), precision=sv.precision, kv_precision=sv.kv_precision, **pred,
               **plan_fields(sv, row, pred))
    n = _int(row["n_gpus"])
    published = {"throughput": _published_throughput(row, n), "ttft_ms": _float(row["ttft_ms"]),
                 "tpot_ms": _float(row["tpot_ms"])}
    for key, value in published.items():
        if value and key in pred and pred[key] is not None:
            out[f"published_{key}"] = value
            out[f"error_{key}"] = pred[key] / value - 1
    return out


def plan_fields(sv: Serving, row: dict, pred: dict) -> dict:
    """The rest of `meshlm plan infer`'s JSON for a priced row's deployment (README's key table): per-GPU KV bytes of a
    token, the longest sequence it holds, power and energy per output token; with the row's lengths, the requests that
    fit and the total tokens/s. None of them is published, so none is scored: they say what the deployment priced is."""
    gpus, watts = sv.layout.world, power_w(sv) * sv.layout.world
    out = {"gpus": gpus, "kv_bytes_per_token": sv.kv_bytes_per_token_per_gpu(), "max_context_tokens": sv.max_tokens(),
           "power_w": watts}
    I, O, phase = _int(row["input_len"]), _int(row["output_len"]), row["output_len"].lower()
    if "throughput" in pred and "prefill" not in phase:  # output tokens/s (a prefill-only row's are input tokens)
        tput = pred["throughput"]
        out.update(output_tokens_per_s_per_gpu=tput / gpus, joules_per_output_token=watts / tput)
        if I and O and "decode" not in phase:  # a decode-only row's "length" is its KV's
            out.update(total_tokens_per_s=tput * (I + O) / O, max_concurrency=max_concurrency(sv, Workload(I, O)))
    return out


def _best_layout(row: dict, sv: Serving) -> tuple[Serving, dict]:
    """A row that names no layout, priced on the layout of its GPUs the planner ranks first, as `plan infer` without
    --layout ranks them (serving_modes.search_serving): among the layouts that hold the row's requests, those meeting
    its latency targets first, then the highest output tokens/s (the lowest TTFT for first-token rows)."""
    best = None
    for lo in serving_layouts(sv, sv.layout.world):
        candidate = replace(sv, layout=lo)
        try:
            pred = _predict(row, candidate)
        except (Skip, ValueError):  # does not fit, or a split the planner refuses
            continue
        key = (pred.get("meets_slo", True), pred.get("throughput", 0.0), -pred["ttft_ms"] if "ttft_ms" in pred else 0.0)
        if best is None or key > best[0]:
            best = (key, candidate, pred)
    if best is None:
        raise Skip(f"no layout of the row's {sv.layout.world} GPUs holds one request")
    return best[1], best[2]


def _published_throughput(row: dict, n: int) -> float | None:
    """Output tokens/s of the whole system (input tokens/s for prefill-only rows)."""
    per_gpu = _float(row["tokens_per_s_per_gpu"])
    if per_gpu:
        return per_gpu * n
    return _float(row["throughput_output_tok_s_total"]) or _float(row["throughput_total_tok_s_total"])


def _predict(row: dict, sv: Serving) -> dict:
    I, out_text, batch_text = _int(row["input_len"]), row["output_len"].lower(), row["batch_or_concurrency"].lower()
    if I is None:
        raise Skip("production mix without a prompt length")
    if "prefill" in out_text:
        tokens = _int(batch_text) if "tokens" in batch_text else PREFILL_TOKENS_PER_DEVICE
        it = iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=tokens, prefill_ctx=I / 2)
        return {"throughput": sv.layout.dp * tokens / it["total"], "bound": it["bound"]}
    if "decode" in out_text:
        kv = _int(out_text) or I
        wl = Workload(I, kv - I + 1 if kv > I else 1)
        fit = max(1, max_concurrency(sv, Workload(kv, 1)) // sv.layout.dp)
        seqs = _int(batch_text) if "per" in batch_text else min(fit, DEEPEP_DECODE_TOKENS)
        it = iteration_time(sv, decodes=seqs, kv_len=kv)
        return {"throughput": sv.layout.dp * seqs / it["total"], "tpot_ms": it["total"] * 1e3, "bound": it["bound"],
                "input_len": wl.input_len}
    O = _int(out_text)
    first_token_only = O is None or "first-token" in out_text
    O = O if O and not first_token_only else 1
    scenario = row["scenario"].strip().lower()
    static = scenario in ("fixed-batch", "latency")
    closed_loop = not static and "concurrency" in batch_text  # a client count sets the load
    if (static or closed_loop) and _int(batch_text) == 0:
        raise Skip(f"the row's load {row['batch_or_concurrency']!r} runs no request")
    # Latency targets choose the offline concurrency, or under an arrival process (a server scenario) the highest
    # Poisson rate whose tails meet them; a static batch or a client count is the load itself.
    ttft, tpot = (None, None) if static or closed_loop else latency_targets(row)
    arrivals = scenario in ("server", "interactive") and (ttft is not None or tpot is not None)
    max_batch = _max_batch(row, sv, I, O)
    if max_concurrency(sv, Workload(I, O, max_batch=max_batch)) < sv.layout.dp:
        raise Skip(f"one request of {I}+{O} tokens does not fit each dp rank in the planner's memory model")
    rate = request_rate(row) if scenario in ("server", "interactive") and not (static or closed_loop) else None
    if rate == 0:
        raise Skip(f"the row's load {row['batch_or_concurrency']!r} sends no request")
    if rate is not None and not arrivals:
        return _fixed_rate(sv, Workload(I, O, max_batch=max_batch, request_rate=rate, percentile=None))
    wl = Workload(I, O, max_batch=max_batch, max_ttft_s=ttft, max_tpot_s=tpot, max_rate=arrivals,
                  percentile=target_percentile(row))
    if static:
        r = static_batch(sv, wl, _int(batch_text) or 1)
    elif closed_loop:
        r = clients(sv, wl, _int(batch_text))
    elif arrivals:
        r = max_rate(sv, wl)
    else:
        r = offline(sv, wl)
    pred = {"ttft_ms": r["ttft_s"] * 1e3, "concurrency": r["concurrency"], "bound": r["bound"],
            **({"meets_slo": r["meets_slo"]} if "meets_slo" in r else {})}
    if not first_token_only:
        pred.update(throughput=r["output_tokens_per_s"], tpot_ms=r["tpot_s"] * 1e3)
    return pred


def _fixed_rate(sv: Serving, wl: Workload) -> dict:
    """A row measured at a fixed rate of Poisson arrivals (a benchmark client's --request-rate): the mean TTFT and
    TPOT at that rate (`serving_modes.poisson`) where the deployment keeps up with it; where it does not, its
    throughput (the most it serves: the offline optimum) and no latencies -- the queue then grows for as long as the
    run lasts, a transient the steady state does not price. A run that keeps up yields the rate it is offered, less
    its ramp and drain (the clients' last requests finish after the arrivals stop): nothing of the deployment's to
    score, so no throughput is priced there."""
    r = poisson(sv, wl)
    pred = {"concurrency": r["concurrency"], "bound": r["bound"], "request_rate": wl.request_rate}
    if r["keeps_up"]:
        return dict(pred, ttft_ms=r["ttft_s"] * 1e3, tpot_ms=r["tpot_s"] * 1e3)
    return dict(pred, throughput=r["output_tokens_per_s"])


def _median_abs(values: list[float]) -> float | None:
    return statistics.median(abs(v) for v in values) if values else None


# Issue 25's per-group goal for the median |error|; the summary also counts the rows within it.
GROUP_GOAL_ABS_ERROR = 0.25


def summarize(results: list[dict]) -> dict:
    """Median |error| per group and overall, of throughput, TTFT and TPOT where published, and how many rows are within
    GROUP_GOAL_ABS_ERROR ("within_goal")."""
    scored = [r for r in results if "skip" not in r]
    out = {"rows": len(results), "scored": len(scored),
           "skipped": {r["row_id"]: r["skip"] for r in results if "skip" in r}}

    def stats(errors: list[float]) -> dict:
        return {"n": len(errors), "median_abs_error": _median_abs(errors),
                "within_goal": sum(abs(e) <= GROUP_GOAL_ABS_ERROR for e in errors)}

    for metric in ("throughput", "ttft_ms", "tpot_ms"):
        errors = [r for r in scored if f"error_{metric}" in r]
        groups = sorted({r["group"] for r in errors})
        out[metric] = {**stats([r[f"error_{metric}"] for r in errors]),
                       "per_group": {g: stats([r[f"error_{metric}"] for r in errors if r["group"] == g])
                                     for g in groups}}
    return out


def score_rows(rows: list[dict]) -> tuple[list[dict], dict]:
    """Every row predicted and the medians of the errors; a row the planner fails on is reported as skipped with the
    error, not left to stop the table."""
    results = predict_each(rows, predict_row, ("row_id", "group", "model", "gpu"))
    return results, summarize(results)
