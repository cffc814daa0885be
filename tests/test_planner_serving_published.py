"""The serving planner against published serving tables (planner/published_serving.py): how a row's cells are read --
its engine and version, lengths, model name --, that every development row is priced or skipped with its reason, and
that no wording of a cell stops the table. Torch-free; the model's structure is tests/test_planner_serving.py's."""

from __future__ import annotations

import pytest


def test_published_serving_rows_all_priced():
    """Every dev row is priced or skipped with a reason (the medians are the benchmark's to print): the shared file's
    74 rows and the 163 of groups H-R added for issue 25 (benchmarks/data/serving_runs_dev.md)."""
    from pathlib import Path

    from meshlm.planner.published_serving import read_rows, score_rows

    rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_runs_dev.csv")
    results, summary = score_rows(rows)
    assert summary["rows"] == len(rows) == 237 and summary["scored"] >= 228
    assert all("error_throughput" in r or "error_ttft_ms" in r for r in results if "skip" not in r)
    # each priced row carries the rest of `plan infer`'s JSON for its deployment (plan_fields)
    scored = [r for r in results if "skip" not in r]
    assert all({"kv_bytes_per_token", "max_context_tokens", "power_w", "bound"} <= set(r) for r in scored)
    output = [r for r in scored if "joules_per_output_token" in r]
    assert len(output) >= 110
    for r in output:
        assert r["output_tokens_per_s_per_gpu"] * r["gpus"] == pytest.approx(r["throughput"])
        assert r["joules_per_output_token"] == pytest.approx(r["power_w"] / r["throughput"])


def test_published_vllm_rows_before_v08_run_the_v0_engine():
    from meshlm.planner.published_serving import engine_of

    row = dict(engine="vLLM", engine_version="0.6.1", source="", notes="", ep="")
    assert engine_of(row).name == "vllm-v0"
    assert engine_of(dict(row, engine_version="0.8.4")).name == "vllm"
    assert engine_of(dict(row, engine_version="0.11.1 (ROCm 7.0.0 Docker)")).name == "vllm"
    assert engine_of(dict(row, engine_version="0.14.0")).name == "vllm-async"
    assert engine_of(dict(row, engine_version="not stated", source="a blog (Oct 10 2024)")).name == "vllm-v0"
    assert engine_of(dict(row, engine_version="not stated", source="a blog (2025)")).name == "vllm"
    # the flag where a row states its server command (notes), turned on before 0.14 or off after; negations turn nothing
    served = dict(row, engine_version="0.11.0", notes="server command 'vllm serve m --async-scheduling -tp 2'")
    assert engine_of(served).name == "vllm-async"
    assert engine_of(dict(served, notes="run without --async-scheduling")).name == "vllm"
    assert engine_of(dict(served, notes="no async scheduling")).name == "vllm"
    assert engine_of(dict(row, engine_version="0.15.1", notes="vllm serve m --no-async-scheduling")).name == "vllm"
    assert engine_of(dict(served, engine_version="0.6.3")).name == "vllm-v0"  # V0 has no async scheduler


def test_an_engine_cell_is_read_however_a_table_spells_the_engine():
    from meshlm.planner.published_serving import engine_name, engine_of

    row = dict(engine_version="", source="", notes="", ep="", batch_or_concurrency="")
    for cell, name in (("TRT-LLM", "tensorrt-llm"), ("trtllm", "tensorrt-llm"), ("trt_llm", "tensorrt-llm"),
                       ("NVIDIA TensorRT 10.8", "tensorrt-llm"), ("Triton + TensorRT-LLM", "tensorrt-llm"),
                       ("ROCm vLLM", "vllm"), ("vLLM (ROCm fork)", "vllm"), ("SGLang (DeepEP)", "sglang"),
                       ("DeepSeek in-house", "deepseek"), ("llama.cpp", "llama.cpp")):
        assert engine_name(dict(row, engine=cell)) == name, cell
    assert engine_of(dict(row, engine="TRT-LLM")).name == "tensorrt-llm"
    assert engine_of(dict(row, engine="ROCm vLLM", engine_version="0.9.2")).name == "vllm"
    assert engine_of(dict(row, engine="llama.cpp")).name == "default"


def test_the_summary_counts_each_groups_rows_within_the_goal():
    from meshlm.planner.published_serving import GROUP_GOAL_ABS_ERROR, summarize

    results = [dict(row_id=f"X{i}", group=g, error_throughput=e) for i, (g, e) in
               enumerate((("A", 0.1), ("A", -0.3), ("A", GROUP_GOAL_ABS_ERROR), ("B", -0.26), ("B", 0.0)))]
    out = summarize([*results, dict(row_id="X9", group="B", skip="no prompt length")])["throughput"]
    assert (out["n"], out["within_goal"]) == (5, 3)
    assert out["per_group"]["A"]["within_goal"] == 2 and out["per_group"]["B"]["within_goal"] == 1


def test_published_lengths_are_counts_never_shares():
    from meshlm.planner.published_serving import _int

    assert _int("production mix (56.3% of input tokens hit on-disk KV cache)") is None
    assert _int("~1K (real dataset)") == 1024 and _int("16,384 tokens/device") == 16384
    assert _int("decode-only (KV length 2,000)") == 2000 and _int("batch 64 (largest)") == 64


def test_issue25_rows_read_presets_precisions_and_stacks():
    """The rows added for issue 25 (groups H-M) as published_serving reads them."""
    from pathlib import Path

    from meshlm.planner.published_serving import _max_batch, deployment_of, engine_name, read_rows

    rows = {r["row_id"]: r for r in read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data"
                                                / "serving_runs_dev.csv")}
    # presets of the same config: Llama 3.1 70B is Llama 3 70B's; Mixtral's experts split over the TP group
    assert deployment_of(rows["H133"]).sm.cfg.num_layers == 80 and deployment_of(rows["H133"]).layout.tp == 2
    assert deployment_of(rows["H145"]).sm.cfg.num_experts == 8 and deployment_of(rows["H145"]).layout.ep == 1
    # gpt-oss's MXFP4 checkpoint keeps all but the routed experts in BF16
    assert deployment_of(rows["J153"]).precision == "fp4" and deployment_of(rows["J153"]).dense_precision == "bf16"
    # NVIDIA NIM runs its optimized profiles on TensorRT-LLM: that engine, and its fp8-checkpoint KV reading
    assert engine_name(rows["K155"]) == "tensorrt-llm" and deployment_of(rows["K155"]).kv_precision == "fp8"
    assert engine_name(dict(rows["K155"], engine_version="generic vLLM backend")) == "vllm"
    # vLLM's max_num_seqs caps the running requests like TensorRT-LLM's max_batch_size
    assert _max_batch(rows["L164"], deployment_of(rows["L164"]), 128, 2048) == 3200
    # AMD's latency table: a static batch on vLLM 0.10.2's V1 engine, its output tokens/s batch x 2048 / latency
    assert deployment_of(rows["M172"]).engine.name == "vllm" and rows["M174"]["batch_or_concurrency"] == "batch 4"
    assert float(rows["M174"]["throughput_output_tok_s_total"]) == pytest.approx(4 * 2048 / 18.487, abs=0.05)
    # a vLLM row that states no cap runs the engine's default: V1's by the device (1024 on an H100 / MI300X-class GPU,
    # 256 on an A100 or a smaller one), V0's 256
    bare = dict(rows["L164"], batch_or_concurrency="all prompts queued")
    cap = lambda **kw: _max_batch(dict(bare, **kw), deployment_of(dict(bare, **kw)), 128, 2048)  # noqa: E731
    assert cap() == 1024 and cap(gpu="H100-SXM5-80GB") == 1024 and cap(gpu="NVIDIA L40S") == 256
    assert cap(gpu="A100-SXM4-80GB") == 256 and cap(engine_version="0.6.3") == 256


def test_vllm_rows_on_nvidia_read_their_bursts_flags_and_mxfp4_kernels():
    """Groups P and Q (vLLM on H100 / A100): a burst of N prompts runs at most N per rank, under vLLM's default cap;
    --async-scheduling turns the V1 engine's async scheduler on before v0.14 made it the default; MXFP4 experts on a
    GPU without FP4 tensor cores run BF16 GEMMs (W4A16), on Blackwell TensorRT-LLM's take MXFP8 activations."""
    from pathlib import Path

    from meshlm.planner.published_serving import _max_batch, deployment_of, read_rows

    rows = {r["row_id"]: r for r in read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data"
                                                / "serving_runs_dev.csv")}
    burst = rows["P238"]  # Qwen3-14B on one H100: 100 prompts of 32,000 tokens sent at once
    assert burst["batch_or_concurrency"].startswith("all 100 prompts at once")
    assert _max_batch(burst, deployment_of(burst), 32000, 99) == 100
    assert _max_batch(rows["P239"], deployment_of(rows["P239"]), 3996, 200) == 500
    wide = dict(burst, batch_or_concurrency="all 5000 prompts at once")
    assert _max_batch(wide, deployment_of(wide), 32000, 99) == 1024  # vLLM V1's cap on an H100
    assert deployment_of(burst).engine.name == "vllm"
    assert deployment_of(rows["P256"]).engine.name == "vllm-async"  # 0.11.0 with --async-scheduling
    assert deployment_of(rows["Q270"]).engine.name == "vllm-async"  # 0.19.1: the default
    oss = deployment_of(rows["P254"])  # gpt-oss-20b on an H100
    assert oss.precision == "fp4" and oss.gemm_precision == "bf16" and oss.dense_gemm_precision == "bf16"
    assert deployment_of(rows["J153"]).gemm_precision == "fp8"  # TensorRT-LLM on B200
    assert deployment_of(rows["P238"]).sm.cfg.num_layers == 40 and deployment_of(rows["P244"]).sm.cfg.num_layers == 64
    assert len(deployment_of(rows["P254"]).sm.windows) == 24


def test_published_serving_model_names_are_read_without_case_or_punctuation():
    from meshlm.planner.published_serving import Skip, model_of

    for name, layers in (("llama2-70b-99.9", 80), ("Llama 2 70B", 80), ("DeepSeek-R1-0528", 61),
                         ("Llama-3.1-405B-Instruct-FP8", 126), ("Llama-2-7B", 32), ("Mixtral-8x7B-Instruct-v0.1", 32),
                         ("gptj-99", 28), ("GPT-J", 28)):  # MLPerf's GPT-J names: ALIASES
        assert model_of({"model": name}).cfg.num_layers == layers, name
    with pytest.raises(Skip, match="no architecture"):
        model_of({"model": "llama-2"})  # a prefix of Llama-2-7B's name is not Llama-2-7B


def test_no_wording_of_a_serving_cell_stops_the_table():
    """Every cell of one serving row in forty worded otherwise in turn ("0" for a number, "n/a" for a text; the load
    cell also as a load of none: no batch, no clients, no arrivals): each row comes back priced or skipped with its
    reason (a layout the planner refuses, a deployment whose weights leave no room for one request, a load that runs
    no request), never an exception that stops the table."""
    from pathlib import Path

    from meshlm.planner.published_serving import predict_row, read_rows

    rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_runs_dev.csv")[::40]
    for row in rows:
        for cell in (c for c in row if c not in ("row_id", "group")):
            text = "0" if row[cell][:1].isdigit() else "n/a"
            out = predict_row({**row, cell: text})
            assert "skip" in out or "layout" in out, (row["row_id"], cell, text)
        for load in ("batch 0", "concurrency 0", "Poisson arrivals at QPS 0 (0 requests/s)"):
            out = predict_row({**row, "batch_or_concurrency": load})
            assert "skip" in out or "layout" in out, (row["row_id"], load)
            # the load is read as a count of clients anywhere, as a batch in static scenarios, as a rate in served ones
            read = (load.startswith("concurrency") or load.startswith("batch") and row["scenario"] in ("fixed-batch",
                    "latency") or load.startswith("Poisson") and row["scenario"] in ("server", "interactive"))
            if read:
                skip = out.get("skip", "")
                assert "runs no request" in skip or "sends no request" in skip, (row["row_id"], load)


def test_a_row_naming_no_layout_is_priced_on_the_best_layout_of_its_gpus():
    """A row naming none of tp, pp, dp (MLPerf's results, for one) is priced on the layout of its GPUs with the highest
    predicted throughput among those `plan infer` ranks, as if the row had named it; with tp but no dp, replicas fill
    the row's GPUs: "tp 2" on 8 GPUs is four replicas, four times one's throughput -- not one replica on 2 of the 8."""
    from pathlib import Path

    from meshlm.planner.published_serving import deployment_of, predict_row, read_rows
    from meshlm.planner.serving_modes import serving_layouts

    rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_runs_dev.csv")
    row = next(r for r in rows if r["row_id"] == "H134")  # Llama 3.1 70B FP8, 1000 + 1000 tokens, H100, tp 2
    bare = {**row, "n_gpus": "8", "tp": "", "pp": "", "dp": "", "ep": ""}
    named = {}
    for lo in serving_layouts(deployment_of(bare), 8):
        out = predict_row({**bare, "tp": str(lo.tp), "pp": str(lo.pp), "dp": str(lo.dp)})
        if "throughput" in out:
            named[out["layout"]] = out["throughput"]
    chosen = predict_row(bare)
    assert len(named) > 2 and chosen["throughput"] == max(named.values())
    assert chosen["layout"] == max(named, key=named.get)
    one, four = predict_row({**bare, "tp": "2", "n_gpus": "2"}), predict_row({**bare, "tp": "2"})
    assert (one["layout"], four["layout"]) == ("tp=2,pp=1,cp=1,ep=1,dp=1", "tp=2,pp=1,cp=1,ep=1,dp=4")
    assert four["throughput"] == pytest.approx(4 * one["throughput"], rel=1e-9)
    assert "does not divide" in predict_row({**bare, "tp": "3"})["skip"]


def test_a_row_naming_no_layout_and_a_latency_target_is_priced_on_a_layout_meeting_it():
    """As `plan infer` ranks layouts (serving_modes.search_serving), a row with a latency target and no layout is priced
    on the best layout meeting the target -- not on one that misses it but whose trickle of requests (one per replica,
    every layout's fallback) yields more tokens/s than the few a meeting layout can run."""
    from pathlib import Path

    from meshlm.planner.published_serving import deployment_of, predict_row, read_rows
    from meshlm.planner.serving_modes import serving_layouts

    rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_runs_dev.csv")
    row = next(r for r in rows if r["row_id"] == "H134")  # Llama 3.1 70B FP8, 1000 + 1000 tokens, H100
    bare = {**row, "n_gpus": "8", "tp": "", "pp": "", "dp": "", "ep": ""}
    layouts = serving_layouts(deployment_of(bare), 8)

    def each(notes: str) -> dict:
        named = ({**bare, "notes": notes, "tp": str(lo.tp), "pp": str(lo.pp), "dp": str(lo.dp)} for lo in layouts)
        return {out["layout"]: out for out in map(predict_row, named) if "throughput" in out}

    # a target only the fastest layout's fewest requests meet: every layout's trickle is its TPOT at one per replica
    trickle = each("TPOT < 0.001 ms")
    target = min(r["tpot_ms"] for r in trickle.values()) * 1.001
    ranked = each(f"TPOT < {target} ms")
    meeting = {k: r for k, r in ranked.items() if r["meets_slo"]}
    assert meeting and max(r["throughput"] for r in ranked.values()) > max(r["throughput"] for r in meeting.values())
    chosen = predict_row({**bare, "notes": f"TPOT < {target} ms"})
    assert chosen["meets_slo"] and chosen["tpot_ms"] <= target
    assert chosen["layout"] == max(meeting, key=lambda k: meeting[k]["throughput"])


def test_a_row_measured_at_a_fixed_request_rate_is_priced_at_that_rate():
    """A server row measured at a fixed rate of Poisson arrivals (group O: a benchmark client's --request-rate) is
    priced at that rate (serving_modes.poisson, the means): its TTFT and TPOT where the deployment keeps up -- the
    throughput of such a run is the rate offered, less its ramp and drain, so none is priced --; where it does not,
    its throughput (the offline optimum) and no latencies (a queue growing for the run's length)."""
    from dataclasses import replace
    from pathlib import Path

    from meshlm.planner.published_load import request_rate
    from meshlm.planner.published_serving import _max_batch, deployment_of, predict_row, read_rows
    from meshlm.planner.serving_modes import offline, poisson
    from meshlm.planner.serving_workload import Workload

    assert request_rate({"batch_or_concurrency": "Poisson arrivals at QPS 2 (2 requests/s); 500 requests"}) == 2.0
    assert request_rate({"batch_or_concurrency": "0.5 req/s"}) == 0.5
    assert request_rate({"batch_or_concurrency": "concurrency 8"}) is None
    rows = {r["row_id"]: r for r in read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data"
                                              / "serving_runs_dev.csv")}
    light, heavy = rows["O178"], rows["O182"]  # Llama 3.1 70B, 4 H100, 467 + 256 tokens, 2 and 32 requests/s
    sv = deployment_of(light)
    wl = Workload(467, 256, max_batch=_max_batch(light, sv, 467, 256), request_rate=2.0, percentile=None)
    at = poisson(sv, wl)
    out = predict_row(light)
    assert at["keeps_up"] and "throughput" not in out and out["request_rate"] == 2.0
    assert (out["ttft_ms"], out["tpot_ms"]) == (at["ttft_s"] * 1e3, at["tpot_s"] * 1e3)
    assert "error_ttft_ms" in out and "error_tpot_ms" in out
    over = predict_row(heavy)
    assert not poisson(sv, replace(wl, request_rate=32.0))["keeps_up"] and "ttft_ms" not in over
    assert over["throughput"] == offline(sv, replace(wl, request_rate=None, offline=True))["output_tokens_per_s"]


def test_the_serving_cautions_state_what_the_dev_rows_show():
    """`explain.serving_caution`'s spreads are the published over predicted throughputs of the dev rows of each regime,
    recomputed here from the rows (a change of the model or of the data that moves them fails until the caution says
    so): 7 rows of small decode all-reduces (groups B, D, J, M), 15 of vLLM on MI300X with 256 or more requests
    running (D, L), 18 of W4A16 experts (gpt-oss on H100 / A100, P and Q), 6 of TensorRT-LLM's DeepSeek-R1 with
    attention DP + EP (A, B; all but one too fast), the 117 other rows of a decode count without one."""
    from pathlib import Path

    from meshlm.planner.explain import (LATENT_ADP_SPREAD, MI300X_VLLM_SPREAD, SMALL_ALL_REDUCE_SPREAD,
                                       WEIGHT_ONLY_SPREAD)
    from meshlm.planner.published_serving import deployment_of, read_rows, score_rows
    from meshlm.planner.serving_modes import caution

    rows = read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "serving_runs_dev.csv")
    by_id = {r["row_id"]: r for r in rows}
    results, _ = score_rows(rows)
    ratios: dict = {"all-reduces": [], "MI300X": [], "W4A16": [], "latent-attention": [], None: []}
    for res in results:
        if "skip" in res or "error_throughput" not in res or "concurrency" not in res:
            continue  # prefill-only rows price no in-flight count
        said = caution(deployment_of(by_id[res["row_id"]]), bound=res["bound"], concurrency=res["concurrency"])
        regime = next((k for k in ("all-reduces", "MI300X", "W4A16", "latent-attention") if said and k in said), None)
        ratios[regime].append(1 / (1 + res["error_throughput"]))
    assert len(ratios["all-reduces"]) == 7 and len(ratios["MI300X"]) == 15 and len(ratios["W4A16"]) == 18
    assert len(ratios["latent-attention"]) == 6 and len(ratios[None]) == 117
    assert (min(ratios["all-reduces"]), max(ratios["all-reduces"])) == pytest.approx(SMALL_ALL_REDUCE_SPREAD, abs=0.005)
    assert (min(ratios["MI300X"]), max(ratios["MI300X"])) == pytest.approx(MI300X_VLLM_SPREAD, abs=0.005)
    assert (min(ratios["W4A16"]), max(ratios["W4A16"])) == pytest.approx(WEIGHT_ONLY_SPREAD, abs=0.005)
    latent = ratios["latent-attention"]
    assert (min(latent), max(latent)) == pytest.approx(LATENT_ADP_SPREAD, abs=0.005) and sum(r > 1 for r in latent) == 1
