"""The serving modes and `meshlm plan infer` (planner/serving_modes.py, cli/plan_serving.py): checks that can fail,
torch-free.

The modes agree with one another; closed-loop clients beyond what fits wait by Little's law; the offline optimum within
latency targets; a disaggregated decode pool priced on its own iterations; the JSON's fields, the engines' default
request caps, the layout search (nearest first where nothing fits) and the throughput-interactivity plot.
"""

import json
import math
from dataclasses import replace

import pytest

from meshlm.planner.cluster import PRESETS, get_cluster
from meshlm.planner.serving import Serving, iteration_time
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_model import served_model
from meshlm.planner.serving_modes import estimate_serving, max_concurrency
from meshlm.planner.serving_workload import Workload
from test_planner_serving import _cli, _sv

FIELDS = ("output_tokens_per_s", "output_tokens_per_s_per_gpu", "total_tokens_per_s", "ttft_ms", "tpot_ms",
          "max_concurrency", "kv_bytes_per_token", "max_context_tokens", "bound", "power_w",
          "joules_per_output_token")


def test_modes_are_consistent():
    sv = _sv("llama3-8b", precision="fp8")
    small = estimate_serving(sv, Workload(1000, 1000, concurrency=8))
    best = estimate_serving(sv, Workload(1000, 1000, offline=True))
    assert best["output_tokens_per_s"] > 4 * small["output_tokens_per_s"] and best["tpot_ms"] > small["tpot_ms"]
    light = estimate_serving(sv, Workload(1000, 1000, request_rate=0.5))
    heavy = estimate_serving(sv, Workload(1000, 1000, request_rate=1000.0))
    assert light["keeps_up"] and not heavy["keeps_up"] and heavy["utilization"] > 1
    assert light["output_tokens_per_s"] == pytest.approx(500.0)
    static = estimate_serving(sv, Workload(128, 128, batch=64))
    assert static["mode"] == "static" and static["concurrency"] == 64


def test_clients_beyond_what_fits_wait_in_the_queue_by_littles_law():
    """C closed-loop clients: up to `max_concurrency` run as continuous batching, their prompts queueing for the token
    budget at the rate Little's law gives them (a lone client finds the engine idle); beyond it the engine runs N and
    C - N wait, each for (C - N) x O / (output tokens/s) before its prefill, the throughput staying N's."""
    from meshlm.planner.serving_modes import clients, continuous, prefill_queue

    sv, wl = _sv("llama3-70b", precision="fp8", tp=2), Workload(2000, 1000)
    cap = max_concurrency(sv, wl)
    within, alone = clients(sv, wl, cap), continuous(sv, wl, cap)
    rate = cap / (within["ttft_s"] + 1000 * within["tpot_s"])  # Little's law at the fixed point
    assert within["queued"] == 0 and within["ttft_s"] > alone["ttft_s"]
    queue = prefill_queue(sv, wl, alone, rate, busy=1.0, at_boundary=True)  # a client's request follows a last token
    assert within["ttft_s"] == pytest.approx(alone["ttft_s"] + queue, rel=1e-9)
    assert clients(sv, wl, 1)["ttft_s"] == continuous(sv, wl, 1)["ttft_s"]
    over = clients(sv, wl, cap + 40)
    assert (over["running"], over["queued"], over["concurrency"]) == (cap, 40, cap + 40)
    assert over["output_tokens_per_s"] == within["output_tokens_per_s"] and over["bound"] == "KV capacity"
    assert over["ttft_s"] == pytest.approx(within["ttft_s"] + 40 * 1000 / within["output_tokens_per_s"], rel=1e-12)
    capped = clients(sv, replace(wl, max_batch=8), 20)  # the engine's running-request cap, not the KV, stops it
    assert capped["running"] == 8 and capped["bound"] != "KV capacity"
    # `plan infer --concurrency` above the cap answers (the queue), where a static batch that large cannot fit
    est = estimate_serving(sv, Workload(2000, 1000, concurrency=cap + 40))
    assert est["fits"] and est["queued"] == 40 and est["ttft_ms"] == pytest.approx(over["ttft_s"] * 1e3)
    assert not estimate_serving(sv, Workload(2000, 1000, batch=cap + 40))["fits"]


def test_plan_infer_json_has_every_field(capsys):
    rc, out = _cli(["plan", "infer", "--model", "deepseek-v3", "--cluster", "h200", "--gpus", "8",
                    "--layout", "tp=1,ep=8,dp=8", "--precision", "fp8", "--kv-precision", "fp8",
                    "--input-len", "1024", "--output-len", "1024", "--offline", "--json"], capsys)
    d = json.loads(out)
    assert rc == 0 and d["fits"] and all(k in d for k in FIELDS), sorted(set(FIELDS) - set(d))
    assert d["bound"] in ("compute", "memory bandwidth", "KV capacity", "scale-up link", "scale-out link", "host")
    assert math.isclose(d["joules_per_output_token"], d["power_w"] / d["output_tokens_per_s"])


def test_plan_infer_expert_gemms_wider_than_their_weights(capsys):
    """--expert-gemm-precision fp8 keeps fp4 experts' bytes (the same KV room) but multiplies them at the fp8 rate:
    a compute-heavy prefill slows, the capacity does not move."""
    base = ["plan", "infer", "--model", "deepseek-v3", "--cluster", "b200", "--gpus", "8", "--layout",
            "tp=1,ep=8,dp=8", "--precision", "fp4", "--input-len", "8192", "--output-len", "16", "--batch", "64",
            "--json"]
    runs = []
    for extra in ([], ["--expert-gemm-precision", "fp8"]):
        rc, out = _cli(base + extra, capsys)
        assert rc == 0
        runs.append(json.loads(out))
    fp4, mixed = runs
    assert mixed["max_concurrency"] == fp4["max_concurrency"] and mixed["weights_gib"] == fp4["weights_gib"]
    assert mixed["ttft_ms"] > fp4["ttft_ms"]
    with pytest.raises(ValueError, match="narrower than the 'bf16' weights"):
        Serving(served_model("deepseek-v3"), get_cluster("b200"), ServingLayout(ep=8, dp=8), precision="bf16",
                expert_gemm_precision="fp8")


def test_plan_infer_runs_a_dense_models_four_bit_weights_as_w4a16(capsys):
    """A dense model's fp4 weights on an A100 with --expert-gemm-precision bf16 (the flag its refusal names,
    test_planner_serving.py): every GEMM at the bf16 rate on the 4-bit bytes -- a quarter of bf16's weights, more KV
    room, a faster decode at batch 1."""
    base = ["plan", "infer", "--model", "llama3-70b", "--cluster", "a100", "--tp", "2", "--input-len", "1024",
            "--output-len", "256", "--json"]
    runs = {}
    for name, extra in (("w4a16", ["--precision", "fp4", "--expert-gemm-precision", "bf16"]), ("bf16", [])):
        rc, out = _cli(base + extra + ["--batch", "1"], capsys)
        assert rc == 0
        runs[name] = json.loads(out)
    assert runs["w4a16"]["weights_gib"] == pytest.approx(runs["bf16"]["weights_gib"] * (0.5 + 1 / 16) / 2, rel=0.01)
    assert runs["w4a16"]["max_concurrency"] > runs["bf16"]["max_concurrency"]
    assert runs["w4a16"]["tpot_ms"] < runs["bf16"]["tpot_ms"]


def test_plan_infer_ranks_layouts_and_names_the_new_flags(capsys):
    rc, out = _cli(["plan", "infer", "--model", "llama3-70b", "--cluster", "h100", "--gpus", "8",
                    "--precision", "fp8", "--top", "3", "--json"], capsys)
    ranked = json.loads(out)
    assert rc == 0 and len(ranked) == 3 and all(r["gpus"] == 8 for r in ranked)
    assert ranked[0]["output_tokens_per_s"] >= ranked[-1]["output_tokens_per_s"]
    with pytest.raises(ValueError, match="--input-len"):
        _cli(["plan", "infer", "--model", "llama3-70b", "--tp", "8", "--context-len", "8192"], capsys)
    with pytest.raises(ValueError, match="fp4"):
        replace(_sv("llama3-8b"), precision="fp4")


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0"], "--gpus 0 must be >= 1"), (["--gpus", "-2"], "--gpus -2 must be >= 1"),
    (["--tp", "0"], "--tp 0 must be >= 1"), (["--tp", "1", "--prefill-chunk", "0"], "--prefill-chunk 0 must be > 0"),
    (["--tp", "1", "--max-batch", "0"], "--max-batch 0 must be > 0")])
def test_plan_infer_refuses_counts_below_one_by_name(capsys, flags, message):
    # Each was once taken silently: --gpus 0 as one GPU, --gpus -2 as dp=-2, --prefill-chunk 0 as the default,
    # --max-batch 0 as no cap.
    with pytest.raises(ValueError) as err:
        _cli(["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", *flags], capsys)
    assert str(err.value) == message


def test_offline_within_latency_targets_is_the_best_concurrency_that_meets_them():
    """`--max-tpot-ms` / `--max-ttft-ms` (a serving SLO): the offline optimum among the concurrencies whose steady-state
    TPOT and TTFT meet the targets -- the next step up the grid misses one -- never above the unconstrained optimum;
    where none meets them, the fewest requests with meets_slo false. Published rows that state a target are priced
    within it (`latency_targets`); a figure without a comparison is a result, not a target."""
    from meshlm.planner.published_load import latency_targets
    from meshlm.planner.serving_modes import continuous, offline
    from meshlm.planner.serving_workload import Workload

    sv = _sv("llama3-70b", "h100", tp=8)
    free = offline(sv, Workload(2048, 512))
    target = 0.5 * free["tpot_s"]
    best = offline(sv, Workload(2048, 512, max_tpot_s=target))
    assert best["meets_slo"] and best["tpot_s"] <= target < free["tpot_s"]
    assert best["output_tokens_per_s"] < free["output_tokens_per_s"]
    above = continuous(sv, Workload(2048, 512), best["concurrency"] * 2 ** 0.25 + 1)
    assert above["tpot_s"] > target
    ttft = continuous(sv, Workload(2048, 512), best["concurrency"] / 4)["ttft_s"]
    assert ttft < best["ttft_s"]
    both = offline(sv, Workload(2048, 512, max_tpot_s=target, max_ttft_s=ttft))
    assert both["meets_slo"] and both["ttft_s"] <= ttft and both["concurrency"] < best["concurrency"]
    from meshlm.planner.serving_modes import disaggregated

    split = disaggregated(_sv("llama3-70b", "h100", tp=8), Workload(2048, 512, disaggregate=(8, 8), max_tpot_s=target))
    assert split["meets_slo"] and split["tpot_s"] <= target  # the decode pool's concurrency meets it
    none = offline(sv, Workload(2048, 512, max_tpot_s=1e-6))
    assert not none["meets_slo"] and none["concurrency"] == sv.layout.dp
    with pytest.raises(ValueError, match="offline concurrency"):
        Workload(2048, 512, concurrency=8, max_tpot_s=0.1)
    with pytest.raises(ValueError, match="--max-tpot-ms 0 must be > 0"):
        Workload(2048, 512, max_tpot_s=0.0)
    cell = lambda text: latency_targets({"batch_or_concurrency": text, "notes": ""})  # noqa: E731
    assert cell("server: TTFT p99 <= 2 s, TPOT p99 <= 200 ms") == (2.0, 0.2)
    assert cell("TTFT (p99) < 450 ms; TPOT < 40 ms") == (0.45, 0.04)
    assert cell("TTFT 120 ms, TPOT 30 ms measured") == (None, None)


def test_plan_infer_runs_the_named_engines_default_request_cap(capsys):
    """`--engine vllm` without `--max-batch` runs vLLM's default max_num_seqs (V1: 1024 on an H100, 256 on an A100;
    V0: 256), `--engine tensorrt-llm` its 2048, the default engine none; `--max-batch` overrides."""
    base = ["plan", "infer", "--model", "llama3-8b", "--tp", "1", "--input-len", "128", "--output-len", "128",
            "--precision", "fp8", "--kv-precision", "fp8", "--json"]

    def cap(*extra, cluster="h100"):
        rc, out = _cli(base + ["--cluster", cluster, *extra], capsys)
        assert rc == 0
        return json.loads(out)["max_concurrency"]

    free = cap()
    assert free > 2048  # what the KV holds: the caps below bind
    assert cap("--engine", "vllm") == 1024 and cap("--engine", "vllm-v0") == 256
    assert cap("--engine", "vllm", cluster="a100") == 256 and cap("--engine", "tensorrt-llm") == 2048
    assert cap("--engine", "vllm", "--max-batch", "64") == 64


def test_disaggregated_decode_pool_chosen_on_its_own_iterations():
    """A decode pool's iterations carry no prompts: under a TPOT target it runs the most requests whose decode-only
    iteration meets it -- more than a pool that also prefills (whose prompt-carrying iterations are longer) -- and a
    TTFT target is judged on the prefill pool's TTFT (a prompt alone plus its KV's transfer)."""
    from meshlm.planner.serving_modes import disaggregated, offline

    sv = _sv("llama3-70b", "h100", tp=8)
    wl = Workload(2048, 512, disaggregate=(8, 8))
    target = iteration_time(sv, decodes=128, kv_len=2048 + 256)["total"] * 1.001
    split = disaggregated(sv, replace(wl, max_tpot_s=target))
    assert split["meets_slo"] and split["tpot_s"] <= target
    assert split["concurrency"] >= 128
    assert iteration_time(sv, decodes=split["concurrency"] * 2 ** 0.25 + 1, kv_len=2048 + 256)["total"] > target
    assert offline(sv, Workload(2048, 512, max_tpot_s=target))["concurrency"] < split["concurrency"]
    ttft = split["ttft_s"]
    assert ttft == pytest.approx(iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=2048, prefill_ctx=1024)["total"]
                                 + split["kv_transfer_s"])
    assert not disaggregated(sv, replace(wl, max_ttft_s=0.5 * ttft))["meets_slo"]
    assert disaggregated(sv, replace(wl, max_ttft_s=2 * ttft))["meets_slo"]


def test_search_where_nothing_fits_says_so_and_leads_with_the_nearest(capsys):
    """405B in bf16 fits no layout of 8 H100s: the search says so first and ranks the layouts with the fewest weights
    per GPU first (the whole model over all 8), not the replicated ones."""
    rc, out = _cli(["plan", "infer", "--model", "llama3-405b", "--cluster", "h100", "--gpus", "8", "--input-len",
                    "1024", "--output-len", "256", "--offline", "--json"], capsys)
    ranked = json.loads(out)
    assert rc == 0 and not any(r["fits"] for r in ranked)
    assert [r["weights_gib"] for r in ranked] == sorted(r["weights_gib"] for r in ranked)
    assert ranked[0]["weights_gib"] < 100  # 405B x 2 bytes / 8 GPUs
    rc, out = _cli(["plan", "infer", "--model", "llama3-405b", "--cluster", "h100", "--gpus", "8", "--input-len",
                    "1024", "--output-len", "256", "--offline"], capsys)
    assert out.startswith("no layout of 8 x H100-SXM fits llama3-405b at 1024+256 tokens")
    assert "does not fit" in out


@pytest.mark.parametrize("cluster", sorted(PRESETS))
def test_plan_infer_prices_every_preset_or_names_what_it_lacks(cluster, capsys):
    """Every cluster preset, a dense and an MoE model, each weight precision, the default search on 8 GPUs: the best
    deployment comes back with every JSON field finite and positive, or the planner refuses before pricing with an
    error naming the precision the GPU lacks and the flag to run it (W4A16) -- never an exception of its own, a NaN or
    a zero throughput."""
    for model in ("llama3-8b", "mixtral-8x7b"):
        for precision in ("bf16", "fp8", "fp4"):
            argv = ["plan", "infer", "--model", model, "--cluster", cluster, "--precision", precision, "--gpus", "8",
                    "--input-len", "2048", "--output-len", "512", "--json", "--top", "1"]
            if precision not in PRESETS[cluster].peak_flops:
                with pytest.raises(ValueError) as refused:
                    _cli(argv, capsys)
                assert str(refused.value).startswith(f"{cluster} has no {precision} tensor cores")
                assert "--expert-gemm-precision bf16" in str(refused.value)
                continue
            rc, out = _cli(argv, capsys)
            best = json.loads(out)[0]
            assert rc == 0 and best["fits"], (model, precision, best.get("reason"))
            for key in FIELDS:
                if key != "bound":
                    assert math.isfinite(best[key]) and best[key] > 0, (model, precision, key, best[key])


def test_frontier_trades_interactivity_for_throughput_and_plot_draws_it(tmp_path, capsys):
    """`frontier`: requests in flight doubling up to what fits: per-GPU throughput rises, each request's tokens/s
    falls, the last point is the KV's limit; its throughput and TPOT are `continuous`'s at that count. `plan infer
    --plot` writes the PNG (one curve per layout shown); with --disaggregate it refuses."""
    from meshlm.planner.serving_modes import continuous, frontier

    sv, wl = _sv("llama3-8b", tp=1), Workload(1024, 512)
    points = frontier(sv, wl)
    counts = [p["concurrency"] for p in points]
    assert counts[:3] == [1, 2, 4] and counts[-1] == max_concurrency(sv, wl) and counts == sorted(counts)
    per_gpu = [p["output_tokens_per_s_per_gpu"] for p in points]
    user = [p["tokens_per_s_per_user"] for p in points]
    assert per_gpu == sorted(per_gpu) and user == sorted(user, reverse=True)
    at = continuous(sv, wl, counts[3])
    assert points[3]["output_tokens_per_s_per_gpu"] == pytest.approx(at["output_tokens_per_s"])
    assert points[3]["tpot_ms"] == pytest.approx(at["tpot_s"] * 1e3)
    assert frontier(_sv("llama3-405b", tp=1), wl) == []  # nothing fits one GPU
    png = tmp_path / "frontier.png"
    rc, out = _cli(["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "2", "--input-len", "1024",
                    "--output-len", "512", "--top", "2", "--plot", str(png)], capsys)
    assert rc == 0 and f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="--disaggregate"):
        _cli(["plan", "infer", "--model", "llama3-8b", "--tp", "1", "--disaggregate", "1:1", "--plot", str(png)],
             capsys)


def test_a_cached_prefix_is_attended_over_but_not_prefilled():
    """`--prefix-hit H`: a request prefills only the prompt's tokens past its cached prefix, each attending over the
    whole prefix before it; its KV is counted whole. One request of 8,192 + 2 tokens with three quarters cached
    prefills the last 2,048 tokens, which sit at positions 6,144-8,191 and so attend over 7,168 tokens on average."""
    sv = _sv("llama3-8b", tp=1)
    cold = estimate_serving(sv, Workload(8192, 2, batch=1))
    warm = estimate_serving(sv, Workload(8192, 2, batch=1, prefix_hit=0.75))
    expected = iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=2048, prefill_ctx=7168)["total"]
    assert warm["ttft_ms"] == pytest.approx(expected * 1e3, rel=1e-12)
    assert warm["prefill_tokens_per_request"] == 2048 and warm["prefix_hit"] == 0.75
    # attending over the prefix costs: more than the same 2,048 tokens as a prompt of their own, less than all 8,192
    alone = estimate_serving(sv, Workload(2048, 2, batch=1))["ttft_ms"]
    assert alone * 1.02 < warm["ttft_ms"] < cold["ttft_ms"] / 2
    for key in ("max_concurrency", "kv_bytes_per_request", "max_context_tokens"):
        assert warm[key] == cold[key], key
    # the decode steps read the same KV: the TPOT of a static batch does not move
    assert warm["tpot_ms"] == pytest.approx(cold["tpot_ms"], rel=1e-12)


def test_a_prefix_hit_pays_where_prompts_dominate_the_work():
    """Continuous batching and the offline optimum with most of each long prompt cached: less prefill work per
    output token, so more throughput, a shorter TTFT and a shorter TPOT (fewer prompt tokens ride each iteration),
    at the same requests in flight -- and the most requests that fit are the same."""
    sv = _sv("llama3-8b", tp=1)
    for mode in (dict(concurrency=16), dict(offline=True), dict(request_rate=0.5)):
        cold = estimate_serving(sv, Workload(8192, 64, **mode))
        warm = estimate_serving(sv, Workload(8192, 64, prefix_hit=0.9, **mode))
        assert warm["ttft_ms"] < 0.5 * cold["ttft_ms"], mode
        assert warm["tpot_ms"] < cold["tpot_ms"], mode
        assert warm["max_concurrency"] == cold["max_concurrency"], mode
        if "request_rate" not in mode:  # a rate it keeps up with is served as offered, cached or not
            assert warm["output_tokens_per_s"] > 2 * cold["output_tokens_per_s"], mode
    # disaggregated: the prefill pool does a tenth of the work; the whole prompt's KV still crosses to the decode pool
    cold = estimate_serving(sv, Workload(8192, 64, offline=True, disaggregate=(1, 1)))
    warm = estimate_serving(sv, Workload(8192, 64, offline=True, disaggregate=(1, 1), prefix_hit=0.9))
    assert warm["kv_transfer_bytes_per_request"] == cold["kv_transfer_bytes_per_request"]
    assert warm["prefill_requests_per_s"] > 5 * cold["prefill_requests_per_s"]


@pytest.mark.parametrize("hit", [1.0, -0.1, 1.5])
def test_plan_infer_refuses_a_prefix_hit_outside_its_range(capsys, hit):
    with pytest.raises(ValueError, match=f"--prefix-hit {hit:g} must be at least 0 and below 1"):
        _cli(["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", "--tp", "1", "--prefix-hit", str(hit)],
             capsys)


def test_every_request_prefills_at_least_its_last_prompt_token():
    assert Workload(10, 1, prefix_hit=0.99).prefill_len == 1
    assert Workload(1, 1, prefix_hit=0.5).prefill_len == 1
    assert Workload(1000, 1, prefix_hit=0.5).prefill_len == 500


def test_a_prefix_every_request_shares_is_held_once():
    """`--prefix-shared`: the cached prefix is one prompt prefix every request shares (a system prompt), its KV held
    once per dp rank, so each request's own KV is its tokens past it: on llama3-8b (32 layers, 8 kv heads of 128, bf16:
    131,072 bytes a token) with 3,840 of 4,096 prompt tokens shared and 256 generated, a request holds 512 tokens of
    its own beside the one copy of the prefix."""
    sv = _sv("llama3-8b", tp=1)
    cap = sv.memory()["kv_capacity"]
    per_token = 32 * 2 * 8 * 128 * 2
    own = estimate_serving(sv, Workload(4096, 256, offline=True, prefix_hit=0.9375))
    shared = estimate_serving(sv, Workload(4096, 256, offline=True, prefix_hit=0.9375, prefix_shared=True))
    assert own["max_concurrency"] == int(cap // (4352 * per_token))
    assert shared["max_concurrency"] == int((cap - 3840 * per_token) // (512 * per_token))
    assert shared["shared_prefix_tokens"] == 3840 and own["shared_prefix_tokens"] == 0
    # pp 2: each stage holds its 16 layers' share of both
    two = replace(sv, layout=ServingLayout(pp=2))
    cap2 = two.memory()["kv_capacity"]
    assert max_concurrency(two, Workload(4096, 256, prefix_hit=0.9375, prefix_shared=True)) == \
        int((cap2 - 3840 * per_token / 2) // (512 * per_token / 2))


def test_a_windowed_layer_keeps_no_shared_prefix():
    """A sliding-window layer keeps each request's own last window, not the shared prefix: only the full-attention
    layers hold it once. Two layers, one full and one of a 128-token window, 4,096 + 256 tokens, 3,840 shared: a
    request holds 512 tokens of its own in the full layer and its 128-token window in the other."""
    from meshlm.config import ModelConfig
    from meshlm.planner.serving_model import ServedModel

    cfg = ModelConfig(vocab_size=1000, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4,
                      intermediate_size=1024, max_seq_len=8192)
    sm = ServedModel(cfg, windows=(0, 128))
    layer_token = 2 * 4 * 64 * 2  # K and V of 4 kv heads of 64, bf16
    budget = 1e9
    assert sm.sequences_sharing_a_prefix(budget, 4352, 3840, 2.0, tp=1, pp=1, cp=1) == \
        int((budget - 3840 * layer_token) // ((512 + 128) * layer_token))
    # without sharing, each request holds its whole 4,352 tokens in the full layer (and its window in the other)
    assert sm.kv_bytes_per_gpu(4352, 2.0, tp=1, pp=1, cp=1) == (4352 + 128) * layer_token


def test_prefix_shared_needs_a_prefix_hit(capsys):
    with pytest.raises(ValueError, match="--prefix-shared .* --prefix-hit"):
        _cli(["plan", "infer", "--model", "llama3-8b", "--cluster", "h100", "--tp", "1", "--prefix-shared"], capsys)


def test_vllm_cascade_rule_as_its_source_writes_it():
    """vLLM V1's `use_cascade_attention`: at least 256 shared tokens and 8 requests; then always where no
    FlashDecoding would run (a prompt in the step, or one query head per kv head), else its tile model over the SMs.
    llama3-8b on one H100 (32 query and 8 kv heads, 132 SMs), 4,096 shared tokens (32 tiles): FlashDecoding's
    8 x requests x 32 blocks fill more than cascade's one wave of 32 tiles from 17 requests on; llama3-70b at tp 8 (8
    and 1 heads a GPU) from 133."""
    from meshlm.planner.serving_engine import vllm_cascades

    h100 = dict(q_heads=32, kv_heads=8, sms=132)
    assert not vllm_cascades(prefix=255, requests=64, decode_only=False, **h100)
    assert not vllm_cascades(prefix=4096, requests=7, decode_only=False, **h100)
    assert vllm_cascades(prefix=256, requests=8, decode_only=False, **h100)
    assert vllm_cascades(prefix=256, requests=8, decode_only=True, q_heads=32, kv_heads=32, sms=132)  # MHA
    assert not vllm_cascades(prefix=4096, requests=16, decode_only=True, **h100)
    assert vllm_cascades(prefix=4096, requests=17, decode_only=True, **h100)
    tp8 = dict(q_heads=8, kv_heads=1, sms=132)
    assert [vllm_cascades(prefix=4096, requests=n, decode_only=True, **tp8) for n in (132, 133)] == [False, True]
    assert not vllm_cascades(prefix=4096, requests=64, decode_only=False, q_heads=32, kv_heads=8, sms=0)  # no SMs


def test_a_cascading_engine_reads_the_shared_prefix_once():
    """Decode attention's KV bytes per iteration: each request its whole KV, but under vLLM's cascade the prefix they
    all share once. llama3-8b on one H100 (131,072 bytes a token), 4,224 tokens cached per request of which 3,840
    shared: 64 decodes read (64 x 4,224 - 63 x 3,840) tokens under vLLM, 64 x 4,224 under SGLang (no cascade), and
    vLLM too at 16 decodes alone (FlashDecoding's turn) but not with a prompt in the step; never on an AMD part
    (no SMs: its ROCm backends do not cascade) or for latent attention."""
    from meshlm.planner.serving_engine import ENGINES

    per_token, cached, shared = 32 * 2 * 8 * 128 * 2, 4224, 3840
    vllm = replace(_sv("llama3-8b", tp=1), engine=ENGINES["vllm"])
    bw = vllm.cluster.hbm_bw * vllm.cluster.hbm_efficiency

    def read(sv, d, **kw):  # KV bytes read by the decodes: the attention's memory time less the new tokens' writes
        it = iteration_time(sv, decodes=d, kv_len=cached, shared_prefix=shared, **kw)
        return it["attention_memory"] * (sv.cluster.hbm_bw * sv.cluster.hbm_efficiency) / per_token - d

    assert read(vllm, 64) == pytest.approx(64 * cached - 63 * shared, rel=1e-12)
    assert read(replace(vllm, engine=ENGINES["sglang"]), 64) == pytest.approx(64 * cached, rel=1e-12)
    assert read(vllm, 16) == pytest.approx(16 * cached, rel=1e-12)
    mixed = iteration_time(vllm, decodes=16, kv_len=cached, shared_prefix=shared, prefill_tokens=256,
                           prefill_ctx=4096)["attention_memory"] * bw / per_token - 16 - 256
    assert mixed == pytest.approx(16 * cached - 15 * shared, rel=1e-12)
    amd = replace(vllm, cluster=get_cluster("mi300x"))
    assert read(amd, 64) == pytest.approx(64 * cached, rel=1e-12)
    mla = replace(_sv("deepseek-v3", tp=8), engine=ENGINES["vllm"])
    kw = dict(decodes=64, kv_len=cached)
    assert iteration_time(mla, **kw, shared_prefix=shared) == iteration_time(mla, **kw)


def test_a_shared_prefix_is_read_once_only_in_full_attention_layers():
    """A windowed layer reads each request's own window whatever the requests share; a full one the shared prefix once
    (the two-layer model of the test above it: one full, one of a 128-token window)."""
    from meshlm.config import ModelConfig
    from meshlm.planner.serving_model import ServedModel

    cfg = ModelConfig(vocab_size=1000, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4,
                      intermediate_size=1024, max_seq_len=8192)
    sm = ServedModel(cfg, windows=(0, 128))
    layer_token = 2 * 4 * 64 * 2
    assert sm.decode_kv_bytes_per_gpu(10, 4352, 3840, 2.0, tp=1, pp=1, cp=1) == \
        (10 * (4352 + 128) - 9 * 3840) * layer_token
    assert sm.decode_kv_bytes_per_gpu(10, 4352, 0, 2.0, tp=1, pp=1, cp=1) == \
        10 * sm.kv_bytes_per_gpu(4352, 2.0, tp=1, pp=1, cp=1)


def test_plan_infer_prices_a_shared_prefix_read_once_on_vllm():
    """The whole path: 64 requests of 4,096 + 256 tokens, 94% of each prompt a prefix they all share, on one H100:
    vLLM's decode reads the prefix once a step (a shorter TPOT than with the same prefix cached per request); SGLang
    reads it per request (the same TPOT either way)."""
    from meshlm.planner.serving_engine import ENGINES

    wl = dict(concurrency=64, prefix_hit=0.9375)
    for engine, faster in (("vllm", True), ("sglang", False)):
        sv = replace(_sv("llama3-8b", tp=1), engine=ENGINES[engine])
        own = estimate_serving(sv, Workload(4096, 256, **wl))
        shared = estimate_serving(sv, Workload(4096, 256, prefix_shared=True, **wl))
        if faster:
            assert shared["tpot_ms"] < 0.7 * own["tpot_ms"]
        else:
            assert shared["tpot_ms"] == pytest.approx(own["tpot_ms"], rel=1e-12)


def test_a_disaggregated_pool_too_small_for_the_weights_is_refused_by_name(capsys):
    """Each pool of --disaggregate holds the weights on its own: deepseek-v3 in bf16 at tp 4 fits 16 H200s as one
    deployment but not 8 of them, so 8:8 does not fit -- said of the pool, not priced at zero tokens/s (which divided
    the joules per token by zero)."""
    argv = ["plan", "infer", "--model", "deepseek-v3", "--cluster", "h200", "--gpus", "16", "--layout", "tp=4,ep=2"]
    rc, out = _cli(argv + ["--json"], capsys)
    assert rc == 0 and json.loads(out)["fits"]
    rc, out = _cli(argv + ["--disaggregate", "8:8", "--json"], capsys)
    answer = json.loads(out)
    assert rc == 0 and not answer["fits"] and answer["reason"].startswith("the prefill pool's ")
    assert "share of --disaggregate" in answer["reason"]


def test_a_draft_model_proposes_the_drafts_and_shares_the_memory():
    """Draft-target speculative decoding (`Serving.draft_model`): a step verifies k drafts in one pass of the model (as
    with MTP) and runs k decode steps of the draft model, the first carrying the step's prompt tokens; a prompt-only
    iteration prefills it in both; per generated token, over 1 + p + ... + p^k. The draft's weights are the
    deployment's too, and each sequence's KV holds both models' share: llama3-70b at tp 8 (80 layers x 1 kv head a
    GPU, 40 KiB a token) with llama3-8b (32 x 1, 16 KiB)."""
    from meshlm.planner.serving import _step

    sv = _sv("llama3-70b", tp=8)
    draft = served_model("llama3-8b")
    spec = replace(sv, mtp_tokens=4, mtp_acceptance=0.7, draft_model=draft)
    lone = replace(sv, sm=draft)
    a = 1 + 0.7 + 0.7 ** 2 + 0.7 ** 3 + 0.7 ** 4
    kw = dict(decodes=16, kv_len=2048)
    want = (_step(replace(sv, mtp_tokens=4), **kw, prefill_tokens=64 * a, prefill_ctx=512)["total"]
            + _step(lone, **kw, prefill_tokens=64 * a, prefill_ctx=512)["total"] + 3 * _step(lone, **kw)["total"]) / a
    assert iteration_time(spec, **kw, prefill_tokens=64, prefill_ctx=512)["total"] == pytest.approx(want, rel=1e-12)
    prompt = dict(decodes=0, kv_len=0, prefill_tokens=8192, prefill_ctx=4096)
    assert iteration_time(spec, **prompt)["total"] == pytest.approx(
        iteration_time(sv, **prompt)["total"] + iteration_time(lone, **prompt)["total"], rel=1e-12)
    # memory: the draft's weights beside the model's, the KV cache split 40 : 16 between them
    assert spec.memory()["weights"] == pytest.approx(sv.memory()["weights"] + lone.memory()["weights"], rel=1e-12)
    assert spec.kv_share() == pytest.approx(40 / 56, rel=1e-12)
    per_request = 3072 * 80 * 2 * 128 * 2
    assert spec.max_sequences(3072) == int(spec.memory()["kv_capacity"] * 40 / 56 // per_request)


def test_plan_infer_refuses_a_draft_model_it_cannot_use(capsys):
    argv = ["plan", "infer", "--model", "llama3-70b", "--cluster", "h100", "--tp", "8"]
    with pytest.raises(ValueError, match="--mtp-tokens K"):
        _cli(argv + ["--draft-model", "llama3-8b"], capsys)
    with pytest.raises(ValueError, match="vocabulary .* a draft must share the tokenizer"):
        _cli(argv + ["--draft-model", "deepseek-v3", "--mtp-tokens", "2"], capsys)
    with pytest.raises(ValueError, match="the draft model on this layout: tp=64 must divide num_heads=32"):
        _cli(["plan", "infer", "--model", "llama3-405b", "--cluster", "h100", "--tp", "64", "--draft-model",
              "llama3-8b", "--mtp-tokens", "2"], capsys)
    rc, out = _cli(argv + ["--draft-model", "llama3-8b", "--mtp-tokens", "4", "--batch", "1", "--json"], capsys)
    answer = json.loads(out)
    assert rc == 0 and answer["draft_model"] == "llama3-8b" and answer["draft_tokens_per_step"] == 4
    rc, out = _cli(argv + ["--draft-model", "llama3-8b", "--mtp-tokens", "4", "--mtp-acceptance", "0.5"], capsys)
    assert "speculative: 4 drafts a step from llama3-8b, 1.94 tokens a step" in out  # 1 + .5 + .25 + .125 + .0625


def test_the_layout_search_splits_a_draft_model_too():
    """Without --layout, only layouts that split both models are ranked: on GB200 NVL72's 72-GPU domain llama3-405b's
    128 heads take tp 64, llama3-8b's 32 do not."""
    from meshlm.planner.serving_modes import serving_layouts

    sv = _sv("llama3-405b", "gb200-nvl72")
    spec = replace(sv, mtp_tokens=2, draft_model=served_model("llama3-8b"))
    assert max(lo.tp for lo in serving_layouts(sv, 64)) == 64
    assert max(lo.tp for lo in serving_layouts(spec, 64)) == 32
    assert all(estimate_serving(replace(spec, layout=lo), Workload(1024, 256, batch=1))["fits"] is not None
               for lo in serving_layouts(spec, 64))
