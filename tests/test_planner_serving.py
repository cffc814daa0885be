"""The serving planner's structure (planner/serving*.py, `meshlm plan infer`): checks that can fail, torch-free.

Decode at batch 1 is bounded below by the weights streaming through HBM; the KV capacity is exactly what the
weights and the workspace leave; cp divides a sequence's KV per GPU; fp8 KV doubles the concurrency; a
disaggregated deployment ships exactly the prompt's KV; MLA's compressed cache. The
engine's terms (serving_engine.py): the roofline's rounded corner, GQA KV read per query head without a sharing
kernel, the host's launches without CUDA graphs, the expert all-to-all against DeepEP's own table, attention-DP
ranks waiting for the busiest prefill, two micro-batches reading the weights twice (only where the batch splits)
and hiding the all-to-all only under the compute DeepSeek's schedules pair with it (within SGLang's TBO ablation),
vLLM V0's per-sequence scheduler time, the busiest expert rank's
measured load imbalance, FP4 experts beside FP8 dense weights, fp8 GEMMs at their measured share of the peak, W4A16
GEMMs at the rates Marlin was measured at,
prefill two-batch overlap as SGLang's three stages per layer on one compute stream, and the running-request cap
trtllm-bench derives itself for TensorRT-LLM's perf-overview rows. The engines' memory rules:
test_planner_serving_memory.py.
"""

import argparse
import json
from dataclasses import replace

import pytest

from meshlm.cli.plan import add_parser as add_plan_parser
from meshlm.cli.plan import run as run_plan
from meshlm.planner.cluster import get_cluster
from meshlm.planner.serving import KV_MEMORY_FRACTION, Serving, iteration_time, kv_transfer_bytes
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_model import served_model
from meshlm.planner.serving_modes import estimate_serving, max_concurrency
from meshlm.planner.serving_workload import Workload


def _sv(model="llama3-70b", cluster="h100", kv="bf16", precision="bf16", **layout):
    return Serving(served_model(model), get_cluster(cluster), ServingLayout(**layout), precision=precision,
                   kv_precision=kv)


def _cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="meshlm")
    add_plan_parser(parser.add_subparsers(dest="command"))
    rc = run_plan(parser.parse_args(argv))
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("model,tp", [("llama3-8b", 1), ("llama3-70b", 8), ("deepseek-v3", 8)])
def test_decode_tpot_at_batch_one_is_at_least_weights_over_hbm_bandwidth(model, tp):
    sv = _sv(model, "h200", precision="fp8", tp=tp)
    r = estimate_serving(sv, Workload(128, 128, batch=1))
    touched = sv.weight_bytes_per_gpu()["dense"]  # batch 1 touches top-k experts only; the dense part always
    assert r["tpot_ms"] / 1e3 >= touched / sv.cluster.hbm_bw
    if not sv.sm.cfg.is_moe:
        assert r["tpot_ms"] / 1e3 >= r["weights_gib"] * 2**30 / sv.cluster.hbm_bw


def test_kv_capacity_is_memory_left_after_weights_and_workspace_exactly():
    sv = _sv("llama3-70b", tp=4)
    m = sv.memory()
    assert m["kv_capacity"] == m["hbm"] - m["reserved"] - m["weights"] - m["workspace"]
    assert m["workspace"] == pytest.approx((1 - KV_MEMORY_FRACTION) * (m["hbm"] - m["reserved"] - m["weights"]))
    assert sv.max_tokens() == int(m["kv_capacity"] // sv.kv_bytes_per_token_per_gpu())
    # a model that does not fit has no KV room and says so
    r = estimate_serving(_sv("llama3-405b", tp=1), Workload(1000, 1000, offline=True))
    assert not r["fits"] and "fewer than one sequence" in r["reason"]


def test_vllm_expert_parallelism_gathers_the_tokens_without_overlap_by_default():
    """vLLM's default expert-parallel MoE all-gathers every dp rank's tokens and reduce-scatters the outputs
    (AgRsAll2AllManager) with no dual-batch overlap (`--enable-dbo` is opt-in): exactly those two collectives per MoE
    layer, exposed; one dp rank needs neither (the tp all-reduce sums the experts). A row naming DeepEP, DBO and EPLB
    gets them."""
    from meshlm.planner.collectives import collective_time, group_span
    from meshlm.planner.published_serving import engine_of
    from meshlm.planner.serving_comm import step_comm as _comm
    from meshlm.planner.serving_engine import ENGINES

    sv = replace(_sv("deepseek-v3", cluster="h200", precision="fp8", dp=8, ep=8), engine=ENGINES["vllm"])
    comm = _comm(sv, d=64, p=0)
    h, layers = sv.sm.cfg.hidden_size, sv.sm.moe_layers()
    span = group_span(1, 8, sv.cluster.scaleup_size)
    expected = layers * (collective_time("all_gather", 8 * 64 * h * 1.0, span, sv.cluster)
                         + collective_time("reduce_scatter", 8 * 64 * h * 2.0, span, sv.cluster))
    assert comm[("ep", "scale-up link")] == pytest.approx(expected)
    it = iteration_time(sv, decodes=64, kv_len=2000)
    assert it["ep_exposed"] == pytest.approx(it["scale-up link"])  # nothing hides it
    tbo = iteration_time(replace(sv, engine=replace(ENGINES["vllm"], two_batch_overlap=True)), decodes=64,
                         kv_len=2000)
    assert tbo["ep_exposed"] < it["ep_exposed"]
    assert ("ep", "scale-up link") not in _comm(replace(sv, layout=ServingLayout(tp=8, ep=8)), d=64, p=0)
    row = dict(engine="vLLM", engine_version="0.11.0", source="", ep="8", batch_or_concurrency="",
               notes="DP8 EP8, --enable-dbo, --all2all-backend deepep_low_latency, --enable-eplb")
    eng = engine_of(row)
    assert (eng.two_batch_overlap, eng.ep_all_to_all, eng.expert_balance) == (True, "deepep", "eplb")
    plain = engine_of(dict(row, notes="DP8 EP8, without DeepEP, no EPLB"))
    assert (plain.two_batch_overlap, plain.ep_all_to_all, plain.expert_balance) == (False, "allgather", "none")


def test_fp4_weights_on_a_gpu_without_fp4_name_the_w4a16_choice(capsys):
    with pytest.raises(ValueError, match="--expert-gemm-precision bf16"):
        _sv("mixtral-8x7b", precision="fp4", tp=2)
    with pytest.raises(ValueError, match=r"--expert-gemm-precision bf16 \(every GEMM of a dense model"):
        _sv("llama3-8b", precision="fp4")  # a dense model's 4-bit weights run as W4A16 too (AWQ / GPTQ)
    dense = Serving(served_model("llama3-8b"), get_cluster("h100"), ServingLayout(), precision="fp4",
                    expert_gemm_precision="bf16")
    assert dense.dense_gemm_precision == "bf16"
    w4a16 = Serving(served_model("mixtral-8x7b"), get_cluster("h100"), ServingLayout(tp=2), precision="fp4",
                    expert_gemm_precision="bf16")
    assert w4a16.gemm_precision == w4a16.dense_gemm_precision == "bf16"  # every 4-bit matrix dequantized in-kernel
    bf16 = replace(w4a16, precision="bf16", expert_gemm_precision=None)
    from meshlm.planner.serving_model import WEIGHT_BYTES

    assert sum(w4a16.weight_bytes_per_gpu().values()) == pytest.approx(
        sum(bf16.weight_bytes_per_gpu().values()) * WEIGHT_BYTES["fp4"] / WEIGHT_BYTES["bf16"])
    it, ref = iteration_time(w4a16, decodes=1, kv_len=1000), iteration_time(bf16, decodes=1, kv_len=1000)
    assert it["total"] < ref["total"]  # batch 1 streams ~a quarter of the bytes
    # on Blackwell the same flag keeps the dense GEMMs at the weights' own FP4
    b200 = replace(w4a16, cluster=get_cluster("b200"), expert_gemm_precision="fp8")
    assert (b200.gemm_precision, b200.dense_gemm_precision) == ("fp8", "fp4")
    rc, out = _cli(["plan", "infer", "--model", "mixtral-8x7b", "--cluster", "h100", "--precision", "fp4",
                    "--expert-gemm-precision", "bf16", "--tp", "2", "--json"], capsys)
    assert rc == 0 and json.loads(out)["output_tokens_per_s"] > 0


def test_w4a16_gemms_run_at_the_rates_marlin_was_measured_at():
    """4-bit weights multiplied in 16 bits, as measured: Marlin against torch's FP16 GEMM of the same shape in one
    harness (Marlin's bench.py in vLLM PR #2497: "speedup" 0.60 at 2,048 rows, 0.61 at 4,000), and vLLM's Marlin MoE
    kernel on H100 (FlagGems PR #4350's baseline: Mixtral's experts, 4096 x 14336 top 2, 16,384 tokens in 38.999 ms
    a layer). A decode at batch 1 keeps W4A16's quarter of the bytes (the test above)."""
    def gemms(sv, tokens):
        it = iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=tokens, prefill_ctx=tokens / 2)
        assert it["gemm_compute"] > it["gemm_memory"]  # a prefill this size is compute-bound either way
        return it["gemm_compute"]

    w4a16 = Serving(served_model("llama3-8b"), get_cluster("a100"), ServingLayout(), precision="fp4",
                    expert_gemm_precision="bf16")
    bf16 = replace(w4a16, precision="bf16", expert_gemm_precision=None)
    for tokens in (2048, 4000):
        assert 0.60 - 0.005 <= gemms(bf16, tokens) / gemms(w4a16, tokens) <= 0.61 + 0.005
    h100 = get_cluster("h100")
    flops = 16384 * 2 * 2 * 3 * 4096 * 14336  # 16,384 tokens through two of a layer's experts each
    assert flops / (h100.matmul_rate("bf16") * h100.weight_only_gemm_factor) == pytest.approx(38.999e-3, rel=0.02)
    # the H100 rate is the Hopper presets', not the other parts'
    assert get_cluster("h200").weight_only_gemm_factor == h100.weight_only_gemm_factor
    assert get_cluster("mi300x").weight_only_gemm_factor == get_cluster("a100").weight_only_gemm_factor


def test_cp_split_divides_kv_per_gpu_by_cp():
    one, four = _sv("llama3-8b", tp=2), _sv("llama3-8b", tp=2, cp=4)
    assert four.kv_bytes_per_token_per_gpu() == one.kv_bytes_per_token_per_gpu() / 4
    assert four.max_tokens() == pytest.approx(4 * one.max_tokens(), abs=4)
    # and cp costs a per-layer merge on the link
    it = iteration_time(four, decodes=8, kv_len=100_000)
    assert it["scale-up link"] > iteration_time(_sv("llama3-8b", tp=2, cp=1), decodes=8, kv_len=100_000)["scale-up link"]


def test_fp8_kv_doubles_max_concurrency_at_the_same_memory():
    wl = Workload(2048, 2048, offline=True)
    bf16, fp8 = _sv("llama3-8b", kv="bf16"), _sv("llama3-8b", kv="fp8")
    assert bf16.memory() == fp8.memory()
    assert max_concurrency(fp8, wl) in (2 * max_concurrency(bf16, wl), 2 * max_concurrency(bf16, wl) + 1)


def test_disaggregation_ships_exactly_the_prompt_kv():
    sv = _sv("llama3-70b", tp=4, dp=2)
    cfg, prompt = sv.sm.cfg, 3000
    expected = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * prompt * 2  # bf16
    assert kv_transfer_bytes(sv.sm, prompt_tokens=prompt, kv_precision="bf16") == expected
    r = estimate_serving(sv, Workload(prompt, 200, disaggregate=(4, 4)))
    assert r["kv_transfer_bytes_per_request"] == expected and r["gpus"] == 8
    assert r["ttft_ms"] > 0 and r["output_tokens_per_s"] > 0


def test_mla_caches_the_compressed_latent():
    sm = served_model("deepseek-v3")
    assert sm.kv_bytes_per_token(2.0) == 61 * (512 + 64) * 2
    assert 660e9 < sm.params()["total"] < 690e9  # 671B
    # the latent is shared by the heads: tp does not split it
    sv = _sv("deepseek-v3", precision="fp8", tp=8)
    assert sv.kv_bytes_per_token_per_gpu() == 61 * 576 * 2
    # so are its down-projections (h x 1536 and h x 576 a layer): every tp rank holds and runs them whole
    whole = 61 * 7168 * (1536 + 576)
    assert sm.params()["attention_replicated"] == whole
    one = _sv("deepseek-v3", precision="fp8", tp=1)
    assert sv.weight_bytes_per_gpu()["dense"] == pytest.approx((one.weight_bytes_per_gpu()["dense"] - whole) / 8
                                                               + whole, rel=1e-12)
    from meshlm.planner.serving import _work

    body = lambda s: _work(s, d=64, kv_len=1024, p=0, p_ctx=0, p_rank=0)["dense_gemm_flops"]  # noqa: E731
    assert body(sv) == pytest.approx((body(one) - 64 * 2 * whole) / 8 + 64 * 2 * whole, rel=1e-12)


def test_roofline_corner_is_rounded_but_bounded():
    from meshlm.planner.serving_engine import roofline

    assert roofline(3.0, 0.0) == 3.0 and roofline(0.0, 2.0) == 2.0
    assert roofline(1.0, 1.0) == pytest.approx(2**0.5)  # DeepGEMM's kernels near the ridge: ~1.3x the larger
    assert max(3.0, 1.0) < roofline(3.0, 1.0) < 3.0 + 1.0


def test_gqa_kv_is_read_once_per_query_head_without_a_sharing_kernel():
    from meshlm.planner.serving_engine import ENGINES

    shared = _sv("llama3-70b", tp=2)
    old = replace(shared, engine=ENGINES["tensorrt-llm<0.7"])
    a, b = (iteration_time(sv, decodes=64, kv_len=4096) for sv in (shared, old))
    cfg = shared.sm.cfg
    assert b["attention_memory"] == pytest.approx(a["attention_memory"] * cfg.num_heads / cfg.num_kv_heads, rel=1e-3)
    # MLA's latent is one head: read once whatever the kernel
    ds = _sv("deepseek-v3", precision="fp8", ep=8, dp=8)
    c, d = (iteration_time(sv, decodes=64, kv_len=4096) for sv in (ds, replace(ds, engine=ENGINES["tensorrt-llm<0.7"])))
    assert c["attention_memory"] == d["attention_memory"]


def test_host_launches_bound_a_small_model_without_cuda_graphs():
    from meshlm.planner.serving_engine import ENGINES, HOST_LAUNCH_S, KERNEL_FLOOR_S

    tiny = Serving(served_model("tiny"), get_cluster("h100"), ServingLayout())
    eager = replace(tiny, engine=ENGINES["tensorrt-llm<0.7"])
    it = iteration_time(eager, decodes=1, kv_len=128)
    assert it["bound"] == "host" and it["total"] == pytest.approx(it["host"])
    graphed = iteration_time(tiny, decodes=1, kv_len=128)
    assert graphed["bound"] != "host" and graphed["total"] < it["total"]
    # every elementwise kernel costs at least the launch floor
    assert graphed["elementwise"] >= tiny.sm.layers * 5 * KERNEL_FLOOR_S and HOST_LAUNCH_S > KERNEL_FLOOR_S


def test_every_kernel_of_a_thin_decode_step_lasts_its_launch():
    """One sequence decoding on a model far too small to fill an H100, under CUDA graphs: each layer's four GEMMs
    (qkv, output, gate-up, down), its attention and its five elementwise kernels, and the head, each last the
    launch floor, whatever their bytes (a 256-wide layer's weights take 0.1 us to read)."""
    from meshlm.planner.serving_engine import KERNEL_FLOOR_S

    tiny = Serving(served_model("tiny"), get_cluster("h100"), ServingLayout())
    assert tiny.sm.cfg.hidden_size == 256 and not tiny.sm.cfg.is_moe
    it = iteration_time(tiny, decodes=1, kv_len=128)
    kernels = tiny.sm.layers * (4 + 1 + 5) + 1
    assert it["total"] == pytest.approx(kernels * KERNEL_FLOOR_S, rel=1e-9)
    # a MoE layer: router, the shared expert's two GEMMs and the routed experts' two grouped GEMMs in place of the
    # MLP's two, and four more small kernels (routing, permutations); tiny-moe's first layer is dense
    moe = Serving(served_model("tiny-moe"), get_cluster("h100"), ServingLayout())
    layers, moe_layers = moe.sm.layers, moe.sm.moe_layers()
    assert (layers, moe_layers) == (4, 3) and moe.sm.cfg.shared_intermediate_size
    kernels = (layers - moe_layers) * (4 + 1 + 5) + moe_layers * (2 + 1 + 2 + 2 + 1 + 5 + 4) + 1
    assert iteration_time(moe, decodes=1, kv_len=128)["total"] == pytest.approx(kernels * KERNEL_FLOOR_S, rel=1e-9)


def test_expert_all_to_all_matches_deepep_low_latency_table():
    """DeepEP's low-latency kernels (H800, CX7 400 Gb/s): 128 tokens, hidden 7168, top-8, fp8 dispatch + bf16
    combine take 155 + 273 us at EP32 and 192 + 369 us at EP128; the normal kernels send one copy per node."""
    from meshlm.planner.collectives import expert_all_to_all

    h800 = get_cluster("h800")
    up, out = h800.collective_fit("all_to_all", "scale-up"), h800.collective_fit("all_to_all", "scale-out")
    call = lambda ep, ll: expert_all_to_all(128 * 7168 * 3.0, top_k=8, span=(8, ep // 8), up=up, out=out,  # noqa: E731
                                            low_latency=ll)
    assert call(32, True) == pytest.approx((155 + 273) * 1e-6, rel=0.15)
    assert call(128, True) == pytest.approx((192 + 369) * 1e-6, rel=0.15)
    assert call(32, False) < call(32, True)


def test_attention_dp_ranks_wait_for_the_busiest_prefill():
    from meshlm.planner.serving_engine import ENGINES, busiest_rank_prefill
    from meshlm.planner.serving_modes import steady_iteration

    assert busiest_rank_prefill(64, 1024, 1) == (1.0, 64)
    prob, piece = busiest_rank_prefill(64, 1024, 8)
    assert piece == 1024 and prob == pytest.approx(1 - (1 - 64 / 1024) ** 8)
    sv = _sv("deepseek-v3", "h200", precision="fp8", ep=8, dp=8)
    wl = Workload(1024, 2048, concurrency=1024)
    balanced = replace(sv, engine=replace(ENGINES["default"], adp_balanced=True))
    assert steady_iteration(sv, wl, 128)["total"] > steady_iteration(balanced, wl, 128)["total"]


def test_two_batch_overlap_reads_the_weights_twice():
    from meshlm.planner.serving_engine import ENGINES

    tbo = _sv("deepseek-v3", "h200", precision="fp8", ep=8, dp=8)
    flat = replace(tbo, engine=ENGINES["tensorrt-llm"])
    a, b = (iteration_time(sv, decodes=128, kv_len=2048) for sv in (tbo, flat))
    assert a["gemm_memory"] > 1.5 * b["gemm_memory"]


def test_two_batch_overlap_needs_two_sequences_to_split():
    """One decoding sequence cannot be split into two micro-batches: the weights are read once, as without TBO."""
    from meshlm.planner.serving_engine import ENGINES

    tbo = _sv("deepseek-v3", "h200", precision="fp8", ep=8, dp=8)
    flat = replace(tbo, engine=ENGINES["tensorrt-llm"])
    one = [iteration_time(sv, decodes=1, kv_len=2048) for sv in (tbo, flat)]
    assert one[0]["gemm_memory"] == pytest.approx(one[1]["gemm_memory"])
    # two sequences split: two halves of one sequence each, each reading what one sequence reads
    assert iteration_time(tbo, decodes=2, kv_len=2048)["gemm_memory"] == pytest.approx(2 * one[1]["gemm_memory"])
    # a prefill-only step splits its tokens, a lone token does not
    pre = [iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=4096, prefill_ctx=2048) for sv in (tbo, flat)]
    assert pre[0]["gemm_memory"] > 1.5 * pre[1]["gemm_memory"]


def _sglang_ep72():
    """SGLang's large-EP decode pool of its 96-H100 post: DeepSeek-V3 fp8, attention DP 72 x EP72 over 9 nodes."""
    from meshlm.planner.serving_engine import ENGINES

    sv = _sv("deepseek-v3", "h100", precision="fp8", ep=72, dp=72)
    return replace(sv, engine=replace(ENGINES["sglang"], expert_balance="eplb"))


def test_two_batch_overlap_speedup_stays_within_sglang_ablation():
    """SGLang's TBO ablation (LMSYS large-scale-EP post, "Ablation Study: Two-batch Overlap"): decode at 256
    tokens/device 1.255x over no TBO, 1.35x the most any decode case gained (simulated MTP), -27% at 32 tokens;
    prefill 1.27-1.35x at equal tokens. Perfect overlap (max(work, all-to-all)) gave 1.65x decode, 1.63x prefill."""
    tbo = _sglang_ep72()
    flat = replace(tbo, engine=replace(tbo.engine, two_batch_overlap=False))

    def speedup(**kw):
        return iteration_time(flat, **kw)["total"] / iteration_time(tbo, **kw)["total"]

    assert 1.0 < speedup(decodes=256, kv_len=2000) <= 1.35
    assert speedup(decodes=32, kv_len=2000) < 1.0  # two halves of 16 read the weights twice and hide little
    # prefill: SGLang's three stages per layer on one compute stream give what it measured (the schedule of all
    # the other micro-batch's work beside each all-to-all gave 1.50x)
    for tokens in (4096, 16384):
        assert 1.27 <= speedup(decodes=0, kv_len=0, prefill_tokens=tokens, prefill_ctx=2048) <= 1.35


def test_two_batch_overlap_hides_an_all_to_all_only_under_the_compute_paired_with_it():
    """DeepSeek's published schedules (SGLang's "deepseek_blog" TBO strategies): in decode the routed experts run
    between their own dispatch and combine, so nothing hides them; a step is never shorter than its work or its
    all-to-all, and in decode never shorter than the all-to-all plus the routed experts."""
    from meshlm.planner.serving import _micro_step
    from meshlm.planner.serving_engine import overlapped_half

    sv = _sglang_ep72()
    for d, p in ((128, 0), (0, 4096)):
        m = _micro_step(sv, d=d, kv_len=2000, p=p, p_ctx=1024, p_rank=p)
        st, both = m["stages"], overlapped_half(m["stages"], decode=p == 0)
        assert sum(st.values()) == pytest.approx(m["work"] + m["ep"])
        assert both >= max(m["work"], m["ep"]) - 1e-12
        assert both < m["work"] + m["ep"]
        if p == 0:
            assert both >= st["rest"] + st["experts"] + st["dispatch"] + st["combine"] - 1e-12
    # a step whose all-to-all dwarfs its compute is the all-to-all plus what cannot hide under it
    st = {"attn_in": 1.0, "attn_out": 1.0, "shared": 1.0, "experts": 2.0, "dispatch": 10.0, "combine": 20.0,
          "rest": 0.5}
    assert overlapped_half(st, decode=True) == pytest.approx(0.5 + 10 + 2 + 20)
    # prefill: the first attention, then both micro-batches' dispatches and combines back to back
    assert overlapped_half(st, decode=False) == pytest.approx(0.5 + (2 + 2 * (10 + 20)) / 2)


def test_prefill_two_batch_overlap_runs_sglangs_three_stages_on_one_stream():
    """SGLang's prefill TBO: per layer A1 B1 A2 B2 A3 B3 on one compute stream (attention + dispatch; wait, routed
    experts + combine; shared experts, wait) with the all-to-alls one after another on DeepEP's stream. Compute-bound,
    the pair costs its compute; communication-bound, the first attention plus every all-to-all; in between, B's
    combine hides only under the shared experts (the next layer's attention queues behind B's wait)."""
    from meshlm.planner.serving_engine import prefill_pair

    assert prefill_pair(a=10, s=1, m=10, d=1, c=1) == pytest.approx(2 * (10 + 10 + 1))
    assert prefill_pair(a=2, s=1, m=2, d=10, c=20) == pytest.approx(2 + 2 * (10 + 20))
    # A's combine hides under B's routed experts, B's only under the two shared experts
    a, s_, m, d, c = 4.0, 1.0, 5.0, 1.0, 4.0
    assert prefill_pair(a=a, s=s_, m=m, d=d, c=c) == pytest.approx(2 * a + 2 * m + c)
    # homogeneous: totals over layers price as the layers do
    assert prefill_pair(a=3 * a, s=3 * s_, m=3 * m, d=3 * d, c=3 * c) == pytest.approx(3 * (2 * a + 2 * m + c))


def test_expert_balance_orders_the_step_none_eplb_perfect():
    """SGLang measured default-EPLB prefill 18% slower than simulated perfect balance (59,337 vs 50,302 tokens/s
    per node); without a balancer the busiest rank is slower still (TensorRT-LLM tech blog 4)."""
    base = _sglang_ep72()
    steps = {b: iteration_time(replace(base, engine=replace(base.engine, expert_balance=b)), decodes=0, kv_len=0,
                               prefill_tokens=16384, prefill_ctx=2048)["total"] for b in ("none", "eplb", "perfect")}
    assert steps["none"] > steps["eplb"] > steps["perfect"]


def test_vllm_v0_and_sync_v1_schedulers_add_their_per_sequence_cpu_time():
    """vLLM's V0 engine and its V1 engine before async scheduling: the GPU waits host_per_seq_s per running
    sequence every iteration; V1 with async scheduling (v0.14+) overlaps it."""
    from meshlm.planner.serving_engine import (ENGINES, VLLM_V0_HOST_PER_SEQ_S, VLLM_V1_ASYNC_GAIN,
                                               VLLM_V1_HOST_PER_SEQ_S)

    overlapped = replace(_sv("llama3-70b", "h100", tp=4), engine=ENGINES["vllm-async"])
    v0, v1 = (replace(overlapped, engine=ENGINES[name]) for name in ("vllm-v0", "vllm"))
    for seqs in (1, 64, 256):
        a, b, c = (iteration_time(sv, decodes=seqs, kv_len=1024) for sv in (overlapped, v0, v1))
        assert b["total"] - a["total"] == pytest.approx(seqs * VLLM_V0_HOST_PER_SEQ_S)
        assert c["total"] - a["total"] == pytest.approx(seqs * VLLM_V1_HOST_PER_SEQ_S)
        assert b["scheduler"] == pytest.approx(seqs * VLLM_V0_HOST_PER_SEQ_S) and a["scheduler"] == 0.0
    # PR #23914's sync / async tokens/s at 32-256 running requests: the step time async hides grows with the batch,
    # 10.6-13.3 us a request (gbs / sync - gbs / async), and the price is their slope
    hidden = [(gbs / sync - gbs / fast) / gbs for gbs, sync, fast in VLLM_V1_ASYNC_GAIN]
    assert all(10.5e-6 < h < 13.4e-6 for h in hidden) and VLLM_V1_HOST_PER_SEQ_S == pytest.approx(12.8e-6, rel=0.01)
    assert VLLM_V1_HOST_PER_SEQ_S > 0.287e-3 / 256  # more than update_from_output alone (PR #46112, batch 256)
    tiny = replace(Serving(served_model("tiny"), get_cluster("h100"), ServingLayout()), engine=ENGINES["vllm-v0"])
    assert iteration_time(tiny, decodes=256, kv_len=128)["bound"] == "host"
    assert VLLM_V0_HOST_PER_SEQ_S * 256 == pytest.approx(13e-3)  # the RFC's upper bubble at max_num_seqs 256


def test_trtllm_bench_caps_running_requests_by_its_own_kv_estimate():
    """trtllm-bench (TensorRT-LLM's perf-overview runs) sets max_batch_size from its own KV estimate
    (tensorrt_llm/bench/build/tuning.py). DeepSeek-R1 fp8 on 8 H200, 1024/1024: 2 x 61 layers x 128 heads x 56
    bytes a token (its config.json names no head_dim: 7168 / 128) in 0.9 x (8 x 141 GiB - 685e9 checkpoint bytes)
    is 264 requests of 2048 tokens, rounded up to 384 -- below the ~630 per rank whose MLA latent fits; at 1024/8192
    61.9, rounded up to the floor of 64. A dense GQA model's cap is what its KV allows, rounded up: its KV binds."""
    from meshlm.planner.published_serving import _max_batch, trtllm_bench_max_batch

    ds = _sv("deepseek-v3", "h200", kv="fp8", precision="fp8", ep=8, dp=8)
    assert trtllm_bench_max_batch(ds, 1024, 1024) == 384 and trtllm_bench_max_batch(ds, 1024, 8192) == 64
    assert max_concurrency(ds, Workload(1024, 1024)) // 8 > 384
    for sv in (_sv("llama3-70b", "h100", kv="fp8", precision="fp8", tp=2), _sv("llama3-8b", "h200", kv="fp8")):
        assert max_concurrency(sv, Workload(1000, 1000)) <= trtllm_bench_max_batch(sv, 1000, 1000)
    # the tool divides its estimate by pp (a cap per micro-batch); pp micro-batches are in flight: 8 GPUs as pp=8
    # run as many requests as the same 8 as tp=8, within the rounding (up to 128 per micro-batch)
    tp8, pp8 = (trtllm_bench_max_batch(_sv("llama3-70b", "rtx-pro-6000", kv="fp8", precision="fp4", **lo), 1000, 1000)
                for lo in (dict(tp=8), dict(pp=8)))
    assert pp8 % 8 == 0 and abs(pp8 - tp8) <= 8 * 128
    # a perf-overview row takes the tool's cap; a row that states its own keeps it; others the engine default
    row = dict(batch_or_concurrency="all 3000 requests queued", source="TensorRT-LLM perf-overview", engine="TensorRT-LLM")
    assert _max_batch(row, ds, 1024, 1024) == 384
    assert _max_batch(dict(row, batch_or_concurrency="max_batch_size 128 per rank"), ds, 1024, 1024) == 128
    from meshlm.planner.serving_engine import ENGINES

    trtllm = replace(ds, engine=ENGINES["tensorrt-llm"])  # the row's engine, as deployment_of reads it
    assert _max_batch(dict(row, source="a blog"), trtllm, 1024, 1024) == 2048


def test_expert_imbalance_is_the_measured_ratio_and_bounded():
    from meshlm.planner.serving_engine import EP_IMBALANCE_EPLB, EP_IMBALANCE_NO_EPLB, expert_imbalance

    assert expert_imbalance(256, 1, "none") == 1.0 and expert_imbalance(256, 32, "perfect") == 1.0
    # the measurement itself: EP32, 8 experts per rank (TensorRT-LLM tech blog 4, Table 1)
    assert expert_imbalance(256, 32, "none") == pytest.approx(1 + EP_IMBALANCE_NO_EPLB)
    assert expert_imbalance(256, 32, "eplb") == pytest.approx(1 + EP_IMBALANCE_EPLB)
    none = [expert_imbalance(256, ep, "none") for ep in (2, 4, 8, 16, 32, 64, 128, 256)]
    eplb = [expert_imbalance(256, ep, "eplb") for ep in (2, 4, 8, 16, 32, 64, 128, 256)]
    assert none == sorted(none) and eplb == sorted(eplb) and all(a < b for a, b in zip(eplb, none))
    assert all(1.0 < x <= ep for x, ep in zip(none, (2, 4, 8, 16, 32, 64, 128, 256)))
    assert expert_imbalance(256, 8, "none") > expert_imbalance(1024, 8, "none")  # more experts per rank average out


def test_busiest_expert_rank_scales_the_expert_gemms_and_all_to_all_only():
    from meshlm.planner.serving import _work
    from meshlm.planner.serving_comm import step_comm as _comm
    from meshlm.planner.serving_engine import ENGINES

    sv = _sv("deepseek-v3", "h800", precision="fp8", ep=32, dp=32)
    even = replace(sv, engine=replace(ENGINES["default"], expert_balance="perfect"))
    imb = sv.expert_imbalance()
    assert imb > 1.5 and even.expert_imbalance() == 1.0
    kw = dict(d=64, kv_len=2048, p=0, p_ctx=0, p_rank=0)
    w, w0 = _work(sv, **kw), _work(even, **kw)
    assert w["expert_gemm_flops"] == pytest.approx(imb * w0["expert_gemm_flops"])
    assert w["dense_gemm_flops"] == w0["dense_gemm_flops"] and w["kv_bytes"] == w0["kv_bytes"]
    (key,) = [k for k in _comm(sv, d=64, p=0) if k[0] == "ep"]
    assert _comm(sv, d=64, p=0)[key] == pytest.approx(imb * _comm(even, d=64, p=0)[key])
    assert iteration_time(sv, decodes=64, kv_len=2048)["total"] > iteration_time(even, decodes=64, kv_len=2048)["total"]


def test_experts_only_fp4_keeps_the_dense_weights_in_fp8():
    from pathlib import Path

    from meshlm.planner.published_serving import deployment_of, read_rows
    from meshlm.planner.serving_model import WEIGHT_BYTES

    sv = _sv("deepseek-v3", "b200", precision="fp4", ep=8, dp=8)
    mixed = replace(sv, dense_precision="fp8")
    p = sv.sm.params()
    dense = p["attention"] + p["mlp"] + p["other"]
    assert mixed.weight_bytes_per_gpu()["dense"] == pytest.approx(dense * 1.0)
    assert sv.weight_bytes_per_gpu()["dense"] == pytest.approx(dense * WEIGHT_BYTES["fp4"])
    assert mixed.weight_bytes_per_gpu()["experts"] == sv.weight_bytes_per_gpu()["experts"]
    # dense GEMMs at the fp8 rate take twice as long as at fp4; the experts' the same
    a, b = (iteration_time(x, decodes=0, kv_len=0, prefill_tokens=8192, prefill_ctx=512) for x in (sv, mixed))
    assert b["gemm_compute"] > a["gemm_compute"]
    with pytest.raises(ValueError, match="dense precision"):
        replace(sv, dense_precision="int3")
    with pytest.raises(ValueError, match="fp4"):
        replace(_sv("deepseek-v3", "h200", precision="fp8", ep=8, dp=8), dense_precision="fp4")
    # the published rows' reading: NVFP4 DeepSeek -> fp8 dense; SGLang large EP and DeepSeek -> EPLB, but
    # DeepSeek's profiles simulated a perfectly balanced routing (deepseek-ai/profile-data README)
    rows = {r["row_id"]: r for r in read_rows(Path(__file__).resolve().parents[1] / "benchmarks" / "data"
                                                / "serving_runs_dev.csv")}
    assert deployment_of(rows["B046"]).dense_precision == "fp8"
    assert deployment_of(rows["A020"]).dense_precision is None
    assert deployment_of(rows["F112"]).engine.expert_balance == "eplb"
    assert deployment_of(rows["F113"]).engine.expert_balance == "perfect"
    assert deployment_of(rows["G119"]).engine.expert_balance == "perfect"
    assert deployment_of(rows["G117"]).engine.expert_balance == "eplb"  # DeepSeek's production service
    assert deployment_of(rows["A029"]).engine.expert_balance == "none"


def test_fp8_gemms_keep_the_measured_share_of_their_peak():
    from meshlm.planner.cluster import with_overrides

    h100 = get_cluster("h100")
    assert h100.matmul_rate("bf16") == h100.peak("bf16") * h100.matmul_efficiency
    assert h100.matmul_rate("fp8") == pytest.approx(1979e12 * 0.62 * 70.9 / 80.3)
    assert get_cluster("mi300x").matmul_rate("fp8") == pytest.approx(2615e12 * 0.47 * (1159.5 / 2615) / (781.9 / 1300))
    assert get_cluster("rtx-pro-6000").matmul_rate("fp8") == get_cluster("rtx-pro-6000").peak("fp8") * 0.62  # unmeasured
    # a compute-bound fp8 prefill takes exactly 1 / factor as long in its GEMMs as at the whole fp8 peak fraction
    sv = _sv("llama3-70b", "h100", precision="fp8", tp=8)
    flat = replace(sv, cluster=with_overrides(h100, matmul_precision_factor={}))
    a, b = (iteration_time(x, decodes=0, kv_len=0, prefill_tokens=8192, prefill_ctx=4096) for x in (sv, flat))
    assert a["gemm_compute"] == pytest.approx(b["gemm_compute"] * 80.3 / 70.9)
    assert a["attention_compute"] == b["attention_compute"]


def test_mtp_verifies_drafts_over_one_kv_read_and_yields_the_accepted_chain():
    from meshlm.planner.published_serving import Skip, mtp_of
    from meshlm.planner.serving import MTP_ACCEPTANCE, _work

    sv = _sv("deepseek-v3", "h200", precision="fp8", tp=8)
    mtp = replace(sv, mtp_tokens=3)
    p = MTP_ACCEPTANCE
    assert mtp.mtp_tokens_per_step() == pytest.approx(1 + p + p**2 + p**3) and sv.mtp_tokens_per_step() == 1
    kw = dict(d=8, kv_len=4096, p=0, p_ctx=0, p_rank=0)
    w, w0 = _work(mtp, **kw), _work(sv, **kw)
    assert w["gemm_flops"] == pytest.approx(4 * w0["gemm_flops"]) and w["attn_flops"] == pytest.approx(4 * w0["attn_flops"])
    kv_tok = sv.kv_bytes_per_token_per_gpu()
    assert w["kv_bytes"] - w0["kv_bytes"] == pytest.approx(3 * 8 * kv_tok)  # only the drafts' writes: one read
    plain = iteration_time(sv, decodes=1, kv_len=2048)["total"]
    per_token = [iteration_time(replace(mtp, mtp_acceptance=a), decodes=1, kv_len=2048)["total"] for a in (0.0, 0.5, 0.9)]
    assert per_token[0] > plain > per_token[2] and per_token == sorted(per_token, reverse=True)
    assert iteration_time(mtp, decodes=0, kv_len=0, prefill_tokens=512, prefill_ctx=256)["total"] == \
        iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=512, prefill_ctx=256)["total"]  # prefill untouched
    with pytest.raises(ValueError, match="acceptance"):
        replace(sv, mtp_tokens=2, mtp_acceptance=1.0)
    assert mtp_of({"notes": "MTP speculative decoding (num_nextn_predict_layers=3) ON"}) == 3
    assert mtp_of({"notes": "MTP speculative decoding (3 layers) ON; per-user 158"}) == 3
    assert mtp_of({"notes": "whether MTP/speculative decoding is on is not stated"}) == 0
    with pytest.raises(Skip):
        mtp_of({"notes": "SIMULATED MTP (doubled batch)"})


def test_prefill_runs_the_output_head_once_per_prompt_and_decode_once_per_token():
    """Engines compute logits only for the rows they sample: a prompt's last token, every decode token. A step
    prefilling 4 prompts of 1024 tokens and decoding 16 sequences multiplies by the head for 4 + 16 rows, not for
    4096 + 16 (the head: vocab x hidden, 2 FLOPs per multiply-add, over tp)."""
    from meshlm.planner.serving import _work

    sv = _sv("llama3-8b", tp=2)
    cfg, head = sv.sm.cfg, 2.0 * sv.sm.cfg.vocab_size * sv.sm.cfg.hidden_size
    body = sv.sm.matmul_flops_per_token()["dense"] - head
    w = _work(sv, d=16, kv_len=2048, p=4096, p_ctx=512, p_rank=4096)
    assert w["dense_gemm_flops"] == pytest.approx(((16 + 4096) * body + (16 + 4) * head) / 2, rel=1e-12)
    assert cfg.vocab_size * cfg.hidden_size > 0.05 * body / 2  # the head is not negligible: the test can fail


def test_plan_infer_carries_the_caution_of_its_regime():
    """`caution` in the JSON and the text where the published runs of the deployment's regime came out far from the
    prediction (`explain.serving_caution`; its spreads are checked against the dev rows in
    tests/test_planner_serving_published.py): a batch-1 decode over tp 8 waits on small all-reduces, one over tp 1 on
    none; vLLM on MI300X with a thousand requests running is another regime, the same on H100 is not; W4A16 experts
    the third."""
    from meshlm.planner.serving_engine import engine
    from meshlm.cli.plan_serving import format_serving

    small = estimate_serving(_sv(tp=8), Workload(128, 2048, batch=1))
    assert small["bound"] == "scale-up link" and "one-shot" in small["caution"]
    assert small["caution"] in format_serving(small, "llama3-70b", "H100")
    assert estimate_serving(_sv("llama3-8b", tp=1), Workload(128, 2048, batch=1))["caution"] is None
    for cluster, cautioned in (("mi300x", True), ("h100", False)):
        sv = replace(_sv(cluster=cluster, precision="fp8", kv="fp8", tp=8), engine=engine("vllm"))
        r = estimate_serving(sv, Workload(128, 2048, concurrency=1000))
        assert ("MI300X" in (r["caution"] or "")) is cautioned
    # FP4 experts multiplied in BF16 (W4A16, on a GPU without FP4) are the third; in FP8 on Blackwell they are not
    for cluster, gemm, cautioned in (("h100", "bf16", True), ("b200", "fp8", False)):
        sv = Serving(served_model("mixtral-8x7b"), get_cluster(cluster), ServingLayout(tp=2), precision="fp4",
                     expert_gemm_precision=gemm)
        r = estimate_serving(sv, Workload(2000, 200, offline=True))
        assert ("W4A16" in (r["caution"] or "")) is cautioned
