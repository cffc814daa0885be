"""The serving engines' memory rules (planner/serving.py `Serving.memory`, planner/serving_engine.py), checks that
can fail, torch-free: vLLM's KV cache is its gpu_memory_utilization of the whole GPU less the weights and the peak of
its profile run -- its sampler over one row of logits per request it may run, held to vLLM's own published logs --,
SGLang's is its mem_fraction_static of the whole GPU by its own defaults, `--memory-fraction` sets whichever knob the
engine has, `--max-batch` the rows vLLM's profile samples, `--dense-precision` an MoE checkpoint's weights beside its
experts; published rows sample as their vLLM version did.
"""

import json
from dataclasses import replace

import pytest

from meshlm.planner.cluster import get_cluster
from meshlm.planner.serving_model import served_model
from test_planner_serving import _cli, _sv
from test_planner_serving_window import GPT_OSS_120B


def test_vllm_budgets_its_kv_cache_from_the_whole_device():
    """vLLM's gpu_memory_utilization (0.9) is of the whole GPU, weights included, less its profile run's sampler (one
    row of logits per request it may run: V1's 1024 on an H100, V0's 256); TensorRT-LLM's free_gpu_memory_fraction of
    what the weights leave: the same deployment holds 0.1 x (weights + reserve) + the profile less KV under vLLM,
    exactly."""
    from meshlm.planner.serving_engine import ENGINES, VLLM_GPU_MEMORY_UTILIZATION, VLLM_PROFILE_BYTES_PER_LOGIT

    trt = _sv("llama3-70b", tp=4)
    for name, rows in (("vllm", 1024), ("vllm-async", 1024), ("vllm-v0", 256)):
        m = replace(trt, engine=ENGINES[name]).memory()
        profile = rows * trt.sm.cfg.vocab_size * VLLM_PROFILE_BYTES_PER_LOGIT["native"]
        assert m["kv_capacity"] == pytest.approx(VLLM_GPU_MEMORY_UTILIZATION * m["hbm"] - m["reserved"] - m["weights"]
                                                 - profile)
        assert m["kv_capacity"] == m["hbm"] - m["reserved"] - m["weights"] - m["workspace"]
        t = trt.memory()
        assert t["kv_capacity"] - m["kv_capacity"] == pytest.approx(0.1 * (t["weights"] + t["reserved"]) + profile)
    # 70B in BF16 over two 80 GB GPUs: at vLLM's defaults the sampler its profile runs over 1024 rows leaves no KV
    # cache; at max_num_seqs 64, ~40% of the KV TensorRT-LLM's rule does
    tight = _sv("llama3-70b", tp=2)
    assert replace(tight, engine=ENGINES["vllm"]).memory()["kv_capacity"] == 0
    ratio = replace(tight, engine=replace(ENGINES["vllm"], max_running=64)).memory()["kv_capacity"] \
        / tight.memory()["kv_capacity"]
    assert 0.3 < ratio < 0.5


def test_vllms_profile_run_sampler_is_what_its_logs_measured():
    """vLLM's KV cache is what gpu_memory_utilization leaves after the weights and its profile run, whose peak is
    the sampler's over one row of logits per request it may run (serving_engine.VLLM_PROFILE_BYTES_PER_LOGIT, set
    from PR #21429's log); held here to three other published logs: PR #21489 (gemma-3-4b-it on a B200, 1024 rows of
    262,208: "9.96 GiB for peak activation"), PR #10511 (V0, Llama 3 8B on an H100, 256 rows of 128,256: "PyTorch
    activation peak memory 1.26GiB", the forward's share of the peak beside it) and issue #23278 (gpt-oss-120b, 1024
    rows of 201,088, on one H100 of 79.22 GiB at 0.9: "Model loading took 65.9651 GiB", "Available KV cache memory:
    -2.14 GiB")."""
    from meshlm.planner.serving_engine import VLLM_PROFILE_BYTES_PER_LOGIT

    gib, native = 2**30, VLLM_PROFILE_BYTES_PER_LOGIT["native"]
    assert 1024 * 262_208 * native / gib == pytest.approx(9.96, rel=0.05)
    assert 0.85 * 1.26 < 256 * 128_256 * native / gib < 1.26
    assert 1024 * 201_088 * native / gib == pytest.approx(0.9 * 79.22 - 65.9651 + 2.14, rel=0.03)
    # FlashInfer's sampler (vLLM 0.9.0-0.11.0 on CUDA where installed) sorts nothing: less than half the peak
    assert VLLM_PROFILE_BYTES_PER_LOGIT["flashinfer"] < native / 2


def test_vllms_kv_cache_shrinks_by_its_sampler_over_the_requests_it_may_run(capsys):
    """The profile's peak scales with the rows the engine may run: V1's max_num_seqs default, 1024 on an H100 and 256
    on an A100 (same memory), or `--max-batch` (vLLM's --max-num-seqs); other engines' KV does not depend on it."""
    from meshlm.planner.serving_engine import ENGINES, VLLM_PROFILE_BYTES_PER_LOGIT

    per_row = 128_256 * VLLM_PROFILE_BYTES_PER_LOGIT["native"]  # Llama 3's vocabulary
    h100, a100 = (replace(_sv("llama3-8b", cluster=c), engine=ENGINES["vllm"]) for c in ("h100", "a100"))
    assert h100.memory()["hbm"] == a100.memory()["hbm"]
    assert a100.memory()["kv_capacity"] - h100.memory()["kv_capacity"] == pytest.approx((1024 - 256) * per_row)
    base = ["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", "--tp", "1", "--json"]
    kv = {}
    for engine, cap in (("vllm", None), ("vllm", "64"), ("tensorrt-llm", None), ("tensorrt-llm", "64")):
        rc, out = _cli(base + ["--engine", engine] + (["--max-batch", cap] if cap else []), capsys)
        assert rc == 0
        r = json.loads(out)
        kv[engine, cap] = r["kv_capacity_gib"] * 2**30
        rows = 0 if engine == "tensorrt-llm" else int(cap or 1024)
        assert r["profile_gib"] * 2**30 == pytest.approx(rows * per_row)  # the JSON's part of the workspace
    assert kv["vllm", "64"] - kv["vllm", None] == pytest.approx((1024 - 64) * per_row)
    assert kv["tensorrt-llm", "64"] == kv["tensorrt-llm", None]


def test_vllms_kv_cache_is_within_a_quarter_of_what_its_logs_printed():
    """Qwen3-235B-A22B-FP8 at TP4 under vLLM's defaults and PyTorch's sampler (the reader's model of it, groups P):
    on four H100s vLLM logged "Available KV cache memory: 8.11 GiB" and "GPU KV cache size: 178,880 tokens" (issue
    #21348, July 2025), on four H200s at gpu_memory_utilization 0.5 "Available KV cache memory: 7.07 GiB" (PR
    #21429). The planner's capacity comes within 25% of both; without the profile run's sampler it was ~1.9x them.
    SGLang on the same four H100s at --mem-fraction-static 0.93 logged "#tokens: 367404, K size: 8.23 GB, V size:
    8.23 GB" (the same issue): within 10%."""
    from pathlib import Path

    from meshlm.planner.published_serving import deployment_of, read_rows
    from meshlm.planner.serving_engine import ENGINES

    rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_runs_dev.csv")
    sv = deployment_of(next(r for r in rows if r["row_id"] == "P250"))  # Qwen3-235B-A22B FP8, TP4, H100, vLLM
    assert (sv.layout.tp, sv.precision, sv.engine.name) == (4, "fp8", "vllm")
    h100 = replace(sv, engine=replace(sv.engine, profile_sampler="native"))
    h200 = replace(h100, cluster=get_cluster("h200"), engine=replace(h100.engine, device_memory_fraction=0.5))
    gib = 2**30
    assert h100.memory()["kv_capacity"] / gib == pytest.approx(8.11, rel=0.25)
    assert h100.memory()["kv_capacity"] / h100.kv_bytes_per_token_per_gpu() == pytest.approx(178_880, rel=0.25)
    assert h200.memory()["kv_capacity"] / gib == pytest.approx(7.07, rel=0.25)
    sglang = replace(sv, engine=replace(ENGINES["sglang"], device_memory_fraction=0.93))
    assert sglang.memory()["kv_capacity"] / sglang.kv_bytes_per_token_per_gpu() == pytest.approx(367_404, rel=0.1)


def test_dense_precision_keeps_what_sits_beside_the_experts_wider(capsys, tmp_path):
    """`--dense-precision`: gpt-oss's checkpoints are MXFP4 routed experts beside BF16 attention, router, embeddings
    and head -- 64.0 GiB on one GPU, as vLLM loads it (64.38 GiB in vLLM issue #33155's log), where all-fp4 prices
    61.2 --; a dense model has nothing beside experts and is refused naming --precision. Under vLLM's defaults on one
    H100 the model then leaves no KV cache, and the refusal names its profile run and --max-batch."""
    path = tmp_path / "gpt-oss-120b.json"
    path.write_text(json.dumps(GPT_OSS_120B))
    base = ["plan", "infer", "--model", str(path), "--cluster", "h100", "--tp", "1", "--precision", "fp4",
            "--expert-gemm-precision", "bf16", "--json"]
    runs = {}
    for dense in (None, "bf16"):
        rc, out = _cli(base + (["--dense-precision", dense] if dense else []), capsys)
        assert rc == 0
        runs[dense] = json.loads(out)
    p = served_model(str(path)).params()
    beside = p["attention"] + p["mlp"] + p["other"]
    assert (runs["bf16"]["weights_gib"] - runs[None]["weights_gib"]) * 2**30 == pytest.approx(beside * (2 - 0.5625))
    assert round(runs["bf16"]["weights_gib"], 1) == 64.0 and round(runs[None]["weights_gib"], 1) == 61.2
    rc, out = _cli(base + ["--dense-precision", "bf16", "--engine", "vllm-async"], capsys)
    r = json.loads(out)
    assert not r["fits"] and "profile run 7.4 GiB (its sampler over 1024 rows)" in r["reason"]
    assert "--max-batch" in r["reason"]
    with pytest.raises(ValueError, match="llama3-8b has none: give its weights' precision as --precision"):
        _cli(["plan", "infer", "--model", "llama3-8b", "--tp", "1", "--dense-precision", "fp8"], capsys)


def test_published_vllm_rows_sample_as_their_version_did():
    """A vLLM row's profile sampler: FlashInfer's on an NVIDIA GPU from v0.9.0 through v0.11.0 (its default where
    installed, as vLLM's Docker image has it), PyTorch's before, after, on ROCm and with no version; a cap the row
    states ("max_num_seqs N per rank") is the one the engine samples. gpt-oss-120b on one H100: the engine of v0.11.0
    holds a KV cache, that of v0.14.1 none (vLLM issue #33155: "OOM on one H100 after upgrading from v0.11.2 to
    v0.14.1")."""
    from pathlib import Path

    from meshlm.planner.published_serving import deployment_of, engine_of, predict_row, read_rows
    from meshlm.planner.serving_engine import VLLM_PROFILE_BYTES_PER_LOGIT

    row = dict(engine="vLLM", engine_version="0.11.0", gpu="H100-SXM5-80GB", notes="", source="", ep="",
               batch_or_concurrency="")
    sampler = {v: engine_of(dict(row, engine_version=v)).profile_sampler
               for v in ("0.8.5", "0.9.0", "0.10.2", "0.11.0", "0.11.1", "0.14.0", "not stated")}
    assert sampler == {"0.8.5": "native", "0.9.0": "flashinfer", "0.10.2": "flashinfer", "0.11.0": "flashinfer",
                       "0.11.1": "native", "0.14.0": "native", "not stated": "native"}
    assert engine_of(dict(row, gpu="MI300X-192GB")).profile_sampler == "native"
    assert engine_of(row).max_running is None
    assert engine_of(dict(row, batch_or_concurrency="max_num_seqs 512 per rank")).max_running == 512

    rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_runs_dev.csv")
    gpt_oss = next(r for r in rows if r["row_id"] == "P263")  # gpt-oss-120b, one H100, vLLM 0.11.0
    sv = deployment_of(gpt_oss)
    m = sv.memory()
    profile = 1024 * sv.sm.cfg.vocab_size * VLLM_PROFILE_BYTES_PER_LOGIT["flashinfer"]
    assert m["kv_capacity"] == pytest.approx(0.9 * m["hbm"] - m["reserved"] - m["weights"] - profile)
    assert m["kv_capacity"] > 0
    assert predict_row(gpt_oss)["throughput"] > 0
    later = dict(gpt_oss, engine_version="0.14.1")
    assert deployment_of(later).memory()["kv_capacity"] == 0
    assert "does not fit" in predict_row(later)["skip"]


def test_sglang_budgets_its_kv_cache_from_the_whole_device_by_its_own_defaults():
    """SGLang's mem_fraction_static is of the whole GPU too: from 0.4.8 the GPU less a reserve by its memory class
    (9.5 + tp x pp / 2 GiB on an 80 GB part, 32 GiB on B200, +4 with attention DP), before it by the tp size (0.88 at tp
    1 ... 0.79 from 16); rows name their version."""
    from meshlm.planner.published_serving import engine_of
    from meshlm.planner.serving_engine import ENGINES, sglang_static_fraction

    gib = 2**30
    assert sglang_static_fraction(80 * gib, parallel=1, dp_attention=False, draft=False) == pytest.approx(70 / 80)
    assert sglang_static_fraction(80 * gib, parallel=8, dp_attention=True, draft=True) == pytest.approx(
        round((80 - 9.5 - 4 - 4 - 2) / 80, 3))
    assert sglang_static_fraction(180 * gib, parallel=4, dp_attention=False, draft=False) == round(148 / 180, 3)
    sv = replace(_sv("llama3-70b", tp=4), engine=ENGINES["sglang"])
    m = sv.memory()
    share = sglang_static_fraction(m["hbm"], parallel=4, dp_attention=False, draft=False)
    assert m["kv_capacity"] == pytest.approx(share * m["hbm"] - m["reserved"] - m["weights"])
    assert m["kv_capacity"] == m["hbm"] - m["reserved"] - m["weights"] - m["workspace"]
    row = dict(engine="SGLang", engine_version="main (~v0.4.6, May 2025)", source="", notes="", ep="")
    old = engine_of(row)
    assert old.sglang_memory == "tp" and old.device_share(80 * gib, parallel=4, dp_attention=False, draft=False) == 0.85
    assert engine_of(dict(row, engine_version="0.5.5.post1")).sglang_memory == "reserve"
    # a share the row sets is the engine's: SGLang's --mem-fraction-static, vLLM's --gpu-memory-utilization
    set_ = engine_of(dict(row, notes="launched with --mem-fraction-static 0.8"))
    assert set_.device_share(80 * gib, parallel=4, dp_attention=False, draft=False) == 0.8
    vllm = dict(row, engine="vLLM", engine_version="0.11.0")
    assert engine_of(dict(vllm, notes="--gpu-memory-utilization=0.95")).device_memory_fraction == 0.95
    assert engine_of(dict(vllm, notes="gpu_memory_utilization not printed")).device_memory_fraction == 0.9


def test_memory_fraction_sets_the_knob_the_engine_has(capsys):
    """`plan infer --memory-fraction F`: vLLM's gpu_memory_utilization (the whole GPU), or the share of what the
    weights leave (TensorRT-LLM's free_gpu_memory_fraction); out of (0, 1] it is refused, naming the flag."""
    from meshlm.planner.serving_engine import VLLM_PROFILE_BYTES_PER_LOGIT

    base = ["plan", "infer", "--model", "llama3-70b", "--cluster", "h100", "--tp", "4", "--json"]
    runs = {}
    for engine, fraction in (("vllm", "0.95"), ("tensorrt-llm", "0.5")):
        rc, out = _cli(base + ["--engine", engine, "--memory-fraction", fraction], capsys)
        assert rc == 0
        runs[engine] = json.loads(out)
    gib, sv = 2**30, _sv("llama3-70b", tp=4)
    m = sv.memory()
    profile = 1024 * sv.sm.cfg.vocab_size * VLLM_PROFILE_BYTES_PER_LOGIT["native"]  # its sampler over max_num_seqs rows
    assert runs["vllm"]["kv_capacity_gib"] * gib == pytest.approx(0.95 * m["hbm"] - m["reserved"] - m["weights"]
                                                                  - profile)
    assert runs["tensorrt-llm"]["kv_capacity_gib"] * gib == pytest.approx(0.5 * (m["hbm"] - m["reserved"]
                                                                               - m["weights"]))
    with pytest.raises(ValueError, match=r"--memory-fraction 1.5 must be in \(0, 1\]"):
        _cli(base + ["--memory-fraction", "1.5"], capsys)


def test_sampler_picks_the_profile_vllm_sized_its_kv_cache_after(capsys):
    """`--sampler flashinfer` (vLLM 0.9-0.11.0 where FlashInfer is installed) prices the profile run at FlashInfer's
    bytes per logit, `native` (the default) at PyTorch's sort; an engine without such a profile refuses the flag."""
    from meshlm.planner.serving_engine import VLLM_PROFILE_BYTES_PER_LOGIT

    base = ["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", "--tp", "1", "--json"]
    profile = {}
    for sampler in (None, "native", "flashinfer"):
        rc, out = _cli(base + ["--engine", "vllm"] + (["--sampler", sampler] if sampler else []), capsys)
        assert rc == 0
        profile[sampler] = json.loads(out)["profile_gib"] * 2**30
    assert profile[None] == profile["native"] == pytest.approx(1024 * 128_256 * VLLM_PROFILE_BYTES_PER_LOGIT["native"])
    assert profile["flashinfer"] == pytest.approx(1024 * 128_256 * VLLM_PROFILE_BYTES_PER_LOGIT["flashinfer"])
    with pytest.raises(ValueError, match="--engine tensorrt-llm sizes its own otherwise"):
        _cli(base + ["--engine", "tensorrt-llm", "--sampler", "native"], capsys)
