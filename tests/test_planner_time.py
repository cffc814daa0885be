"""Planner tests of the time model: GEMM shapes and rates, collectives per kind and tier, overlap per strategy,
fp8 and bf16 accounting, and the layouts the planner refuses as the runtime does (`tests/test_planner.py`: the
counts, memory, search and CLI)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from meshlm.config import ModelConfig
from meshlm.planner.cluster import get_cluster
from meshlm.planner.cost import Job

from test_planner import TINY, VARIANTS  # the model variants the counts are checked on


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# ---- time model: GEMM shapes, collectives per kind, overlap per strategy ---------------------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_layer_gemms_carry_exactly_the_dense_flops(name):
    from meshlm.planner.cost import ModelSummary
    from meshlm.planner.kernels import layer_gemms

    cfg = ModelConfig(**{**TINY, **VARIANTS[name]})
    s = ModelSummary.build(cfg, 64)
    gemms = layer_gemms(cfg, tokens=1, tp=1, ep=1, moe_fraction=s.moe_layer_fraction)
    assert sum(2 * m * n * k * c for m, n, k, c in gemms) == pytest.approx(s.flops_dense)
    if cfg.is_moe:  # the same FLOPs whatever ep, only split over fewer local experts with more rows each
        split = layer_gemms(cfg, tokens=1, tp=1, ep=2, moe_fraction=s.moe_layer_fraction)
        assert sum(2 * m * n * k * c for m, n, k, c in split) == pytest.approx(s.flops_dense)


def test_thin_gemms_run_below_the_large_gemm_rate():
    from meshlm.planner.kernels import gemm_time

    kw = dict(rate=600e12, hbm_bw=3e12, in_bytes=2, k_overhead=256)
    big = gemm_time(8192, 8192, 8192, **kw)
    thin = gemm_time(8192, 8192, 512, **kw)  # a tp=16 shard of the same row-parallel layer
    rate_big, rate_thin = 2 * 8192**3 / big, 2 * 8192 * 8192 * 512 / thin
    assert rate_thin < 0.7 * rate_big and rate_big == pytest.approx(600e12 * 8192 / (8192 + 256))
    decode = gemm_time(1, 8192, 8192, **kw)  # one token: bound by streaming the weights
    assert decode == pytest.approx(2 * 8192 * 8192 / 3e12, rel=1e-3)
    # fp8: a stage holds the same bytes of K, twice the elements: the same fixed time at twice the rate
    fp8 = gemm_time(8192, 8192, 8192, **{**kw, "rate": 1200e12, "in_bytes": 1})
    assert 2 * 8192**3 / fp8 == pytest.approx(1200e12 * 8192 / (8192 + 512))


def test_collective_fits_are_per_kind_and_tier():
    from meshlm.planner.cluster import with_overrides
    from meshlm.planner.collectives import collective_time

    h100 = get_cluster("h100")
    slow_a2a = with_overrides(h100, collective_fits={"scale-out": {"all_to_all": (20e-6, 10e9)}})
    span = (8, 4)
    assert collective_time("all_reduce", 1e9, span, slow_a2a) == collective_time("all_reduce", 1e9, span, h100)
    assert collective_time("all_to_all", 1e9, span, slow_a2a) > 2 * collective_time("all_to_all", 1e9, span, h100)
    assert collective_time("all_to_all", 1e9, (8, 1), slow_a2a) == collective_time("all_to_all", 1e9, (8, 1), h100)
    # Nothing to move, nothing issued: no latency either (a dense model's expert gradients).
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"):
        assert collective_time(kind, 0.0, span, h100) == 0.0 < collective_time(kind, 1.0, span, h100)


def test_local_cluster_uses_each_calibrated_collective(tmp_path):
    from meshlm.planner.cluster import local_cluster

    data = {"matmul_flops": 1e11, "world_size": 4, "link": {"bandwidth": 1e9, "latency": 1e-4},
            "collectives": {"all_reduce": {"latency": 6e-4, "bandwidth": 2e9},
                            "p2p": {"latency": 5e-5, "bandwidth": 4e9}}}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    clu = local_cluster(path)
    assert clu.collective_fit("all_reduce", "scale-up") == (pytest.approx(6e-4 / 6), 2e9)  # 2 (n - 1) hops
    assert clu.collective_fit("p2p", "scale-out") == (5e-5, 4e9)
    assert clu.collective_fit("all_gather", "scale-up") == (1e-4, 1e9)  # not measured: the link's fit


def test_calibrated_collective_fit_keeps_the_small_message_latency_and_the_large_message_bandwidth():
    """`calibrate._fits`: an exact line comes back exactly, and one slow mid-size message (a 1 MiB call that
    another process interrupted) moves neither the latency the small messages show nor the bandwidth of the
    largest, where a least-squares fit over the same points puts the latency at 3.5x the 4 KiB call."""
    from meshlm.planner.calibrate import _fit, _fits

    sizes = (2**12, 2**16, 2**20, 2**22)
    line = [[b, 3e-4 + b / 1e9] for b in sizes]
    fit = _fits({"p2p": line}, 2)["p2p"]
    assert (fit["latency"], fit["bandwidth"]) == (pytest.approx(3e-4, rel=1e-9), pytest.approx(1e9, rel=1e-9))
    slow = line[:2] + [[2**20, 3 * line[2][1]], line[3]]
    fit = _fits({"p2p": slow}, 2)["p2p"]
    assert (fit["latency"], fit["bandwidth"]) == (pytest.approx(3e-4, rel=1e-9), pytest.approx(1e9, rel=1e-9))
    assert _fit(slow, 1.0)[0] > 3 * slow[0][1]


def test_comm_overlap_flags_change_only_their_component():
    cfg = ModelConfig.from_preset("llama3-70b")
    h100 = get_cluster("h100")
    from meshlm.planner import cost

    layout = cost.Layout(tp=8, pp=2, dp_shard=4, zero_stage=1)

    def run(**kw):
        return cost.estimate(cfg, h100, Job(seq_len=4096, global_batch_size=64, **kw), layout)

    base, tp_ov, dp_ex = run(), run(tp_comm_overlap=True), run(dp_comm_overlap=False)
    assert tp_ov.time_s["tp_comm"] < 0.5 * base.time_s["tp_comm"]
    assert dp_ex.time_s["dp_comm"] > base.time_s["dp_comm"]
    for key in ("compute", "optimizer"):
        assert tp_ov.time_s[key] == dp_ex.time_s[key] == base.time_s[key]
    assert dp_ex.time_s["pp_bubble"] == base.time_s["pp_bubble"]  # the bubble scales with per-microbatch time,
    assert tp_ov.time_s["pp_bubble"] < base.time_s["pp_bubble"]  # which hidden TP communication shortens


def test_fp8_is_faster_than_bf16_but_not_twice():
    cfg = ModelConfig.from_preset("llama3-8b")
    h100 = get_cluster("h100")
    from meshlm.planner import cost

    lo = cost.Layout(dp_shard=8, zero_stage=1)
    bf16 = cost.estimate(cfg, h100, Job(seq_len=8192, global_batch_size=64), lo)
    fp8 = cost.estimate(cfg, h100, Job(seq_len=8192, global_batch_size=64, precision="fp8"), lo)
    # GEMMs at twice the rate, but attention, elementwise work and the fp8 casts stay at bf16 / HBM speed
    assert 1.2 < bf16.time_s["step"] / fp8.time_s["step"] < 1.9


def test_fp8_output_head_runs_in_bf16():
    """fp8 covers the blocks' linear layers only: the head's GEMM costs what it costs under bf16, so a
    large-vocabulary model gains less from fp8 than the same model with a small vocabulary."""
    from meshlm.planner import cost

    h100 = get_cluster("h100")
    lo = cost.Layout(dp_shard=8, zero_stage=1)
    gains = {}
    for vocab in (32000, 256000):
        cfg = dataclasses.replace(ModelConfig.from_preset("llama3-8b"), vocab_size=vocab)
        t = {p: cost.estimate(cfg, h100, Job(seq_len=4096, global_batch_size=64, precision=p), lo).time_s["compute"]
             for p in ("bf16", "fp8")}
        gains[vocab] = t["bf16"] / t["fp8"]
    assert gains[256000] < gains[32000] - 0.05  # (a head at the fp8 rate: 1.59 vs 1.61)


def test_pipeline_sends_cross_domains_only_where_the_neighbour_is_across():
    """pp ranks two to a node: each rank's one neighbour across nodes rides the NIC, the other NVLink."""
    from meshlm.planner import cost
    from meshlm.planner.collectives import collective_time

    cfg = ModelConfig.from_preset("llama3-8b")
    h100 = get_cluster("h100")
    job = Job(seq_len=4096, global_batch_size=8)
    est = cost.estimate(cfg, h100, job, cost.Layout(tp=4, pp=4, sequence_parallel=False), gpus=16)
    assert est.links["pp"] == "hierarchical"
    msg = 4096 * cfg.hidden_size * 2
    pair = collective_time("p2p", msg, (2, 1), h100) + collective_time("p2p", msg, (1, 2), h100)
    assert est.time_s["pp_p2p"] == pytest.approx((8 + 4 - 1) * pair)


def test_bf16_gradients_halve_gradient_memory_and_dp_traffic():
    """Job.grad_reduce_in_fp32=False (NeMo / Megatron-Bridge performance recipes): 2-byte gradients."""
    from meshlm.planner import cost

    cfg = ModelConfig.from_preset("llama3-8b")
    h100 = get_cluster("h100")
    lo = cost.Layout(dp_shard=64, zero_stage=1)
    run = lambda **kw: cost.estimate(cfg, h100, Job(seq_len=4096, global_batch_size=64, dp_comm_overlap=False,  # noqa: E731
                                                    **kw), lo)
    fp32, bf16 = run(), run(grad_reduce_in_fp32=False)
    assert bf16.memory_gib["gradients"] == pytest.approx(fp32.memory_gib["gradients"] / 2)
    assert bf16.time_s["dp_comm"] < 0.8 * fp32.time_s["dp_comm"]
    for key in ("weights", "optimizer", "activations"):
        assert bf16.memory_gib[key] == fp32.memory_gib[key]
    # fp32 training has no bf16 gradients to keep
    f32 = cost.estimate(cfg, h100, Job(seq_len=4096, global_batch_size=64, precision="fp32",
                                       grad_reduce_in_fp32=False), lo)
    assert f32.memory_gib["gradients"] == cost.estimate(
        cfg, h100, Job(seq_len=4096, global_batch_size=64, precision="fp32"), lo).memory_gib["gradients"]


def test_fp8_keeps_gemm_inputs_in_fp8():
    """Under fp8 the two norm outputs and the SwiGLU product are kept as 1-byte copies, the attention output
    once more (its fp8 copy for wo): the difference from bf16 is exactly that, per token and layer."""
    from meshlm.planner import cost
    from meshlm.planner.memory import layer_activation_bytes

    cfg = ModelConfig.from_preset("llama3-70b")
    summary = cost.ModelSummary.build(cfg, 4096)
    lo = cost.Layout(tp=4, dp_shard=2, sequence_parallel=True)
    act = {p: layer_activation_bytes(summary, Job(seq_len=4096, global_batch_size=8, precision=p), lo)
           for p in ("bf16", "fp8")}
    q_dim = cfg.num_heads * cfg.head_dim
    expected = 4096 * ((q_dim - cfg.intermediate_size) / 4 - 2 * cfg.hidden_size / 4)
    assert act["fp8"] - act["bf16"] == pytest.approx(expected)
    full = {p: layer_activation_bytes(summary, Job(seq_len=4096, global_batch_size=8, precision=p), lo,
                                      recompute="full") for p in ("bf16", "fp8")}
    assert full["fp8"] == full["bf16"]  # full recompute keeps the layer input only, in bf16


def test_ops_left_eager_first_flash_attention_and_unfused_wgrad_cost_exactly_their_terms():
    """A fusing stack's ops still run op by op (`Job.eager_ops`) cost their extra passes exactly: RoPE 8 more elements
    per rotated element of q and k, SwiGLU 2 more per intermediate, the attention layout copies 2 x (2 q + 2 kv), each
    of the two RMSNorms 16 more per hidden element (in fp32 as torch ops, 18 against a fused kernel's 2); the
    backward twice the forward. The first FlashAttention runs at FA1_RATE_OF_FA2 of FlashAttention-2's rate;
    --no-gradient-accumulation-fusion adds one pass over each layer's weight gradients (bf16 read, fp32 main_grad
    read and written) to the backward. An op name the planner does not know is refused."""
    from meshlm.planner.cost import Layout, ModelSummary
    from meshlm.planner.layout import FA1_RATE_OF_FA2
    from meshlm.planner.placement import rank_setup
    from meshlm.planner.timing import attention_time, elementwise_time, layer_compute

    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4,
                      intermediate_size=2816, max_seq_len=2048)
    lo = Layout(dp_shard=8, micro_batch_size=2)
    a100 = get_cluster("a100")
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size

    def setup(**kw):
        job = Job(seq_len=2048, global_batch_size=16, **kw)
        summary = ModelSummary.build(cfg, 2048)
        return summary, job, rank_setup(summary, a100, job, lo)

    summary, job, r = setup()
    base = elementwise_time(summary, job, r, gemms=[], imbalance=1.0)
    for op, elems in (("rope", 8 * (q + kv)), ("swiglu", 2 * inter), ("attention_layout", 2 * (2 * q + 2 * kv)),
                      ("rmsnorm", 2 * (18 - 2) * cfg.hidden_size)):
        s, j, r = setup(eager_ops=frozenset({op}))
        fwd, bwd = elementwise_time(s, j, r, gemms=[], imbalance=1.0)
        extra = elems * r.tokens_mb * 2 / r.hbm_bw
        assert fwd - base[0] == pytest.approx(extra) and bwd - base[1] == pytest.approx(2 * extra)
    with pytest.raises(ValueError, match="eager_ops"):
        Job(seq_len=2048, global_batch_size=16, eager_ops=frozenset({"layernorm"})).validate()
    fa2, fa1 = (attention_time(*setup(flash_attention_1=x)[:2], lo, setup()[2]) for x in (False, True))
    assert fa1[0] * FA1_RATE_OF_FA2 == pytest.approx(fa2[0]) and fa1[1] * FA1_RATE_OF_FA2 == pytest.approx(fa2[1])
    fused = layer_compute(summary, job, lo, r, imbalance=1.0)
    s, j, r = setup(gradient_accumulation_fusion=False)
    unfused = layer_compute(s, j, lo, r, imbalance=1.0)
    params = summary.layer_tp + summary.layer_rep
    assert unfused.elem_bwd - fused.elem_bwd == pytest.approx(params * (2 + 4 + 4) / r.hbm_bw)
    assert unfused.elem == fused.elem and unfused.dense_bwd == fused.dense_bwd


def test_fsdp2_copy_out_costs_each_gather_a_read_and_a_write_of_its_unit():
    """FSDP2 copies every all-gather's output into the parameters' own tensors on the compute stream
    (`Job.fsdp_copy_out`): dp_comm grows by exactly m x (2 x blocks + root) gathers' parameters read and written;
    without resharding after the forward, by one copy of every parameter per step."""
    from meshlm.planner.cost import Layout, ModelSummary, estimate
    from meshlm.planner.placement import rank_setup

    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=16,
                      intermediate_size=2816, max_seq_len=2048)
    h100 = get_cluster("h100")
    lo = Layout(dp_shard=16, zero_stage=3, micro_batch_size=1, recompute="none")
    job = Job(seq_len=2048, global_batch_size=32)
    est = [estimate(cfg, h100, dataclasses.replace(job, fsdp_copy_out=x), lo, gpus=16) for x in (False, True)]
    summary = ModelSummary.build(cfg, 2048)
    r = rank_setup(summary, h100, job, lo)
    block = summary.layer_tp + summary.layer_rep
    root = 2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size  # embedding, untied head, final norm
    m = est[0].num_microbatches
    assert m == 2
    expected = m * (2 * cfg.num_layers * block + root) * 2 * 2 / r.hbm_bw
    assert est[1].time_s["dp_comm"] - est[0].time_s["dp_comm"] == pytest.approx(expected, rel=1e-6)
    assert est[1].time_s["compute"] == est[0].time_s["compute"]
    # Without resharding the weights are gathered once per step, and copied out once.
    kept = dataclasses.replace(lo, zero3_reshard_after_forward=False)
    est = [estimate(cfg, h100, dataclasses.replace(job, fsdp_copy_out=x), kept, gpus=16) for x in (False, True)]
    once = (cfg.num_layers * block + root) * 2 * 2 / r.hbm_bw
    assert est[1].time_s["dp_comm"] - est[0].time_s["dp_comm"] == pytest.approx(once, rel=1e-6)


def test_fsdp_shard_grad_op_pays_a_collective_per_unit_and_pass():
    """ZeRO-2 as FSDP's SHARD_GRAD_OP (`Job.zero2_unit_collectives`): every micro-step gathers each block and the root
    before its forward and reduce-scatters each after its backward, one collective apiece, so a second more per
    node-crossing hop costs 2 x m x (blocks + 1) seconds at least (where Megatron's bucketed ZeRO-2 pays for two
    collectives a step), and m x blocks fewer than FULL_SHARD, which gathers each block again for its backward.
    llm-foundry's SHARD_GRAD_OP rows get it, a DeepSpeed ZeRO-2 row does not."""
    from meshlm.planner.cluster import with_overrides
    from meshlm.planner.cost import Layout, estimate
    from meshlm.planner.published import job_of
    from meshlm.planner.published_rows import model_of

    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=16,
                      intermediate_size=2816, max_seq_len=2048)
    base = get_cluster("h100")
    slow = with_overrides(base, scaleout_latency=base.scaleout_latency + 1.0)  # dp 16: two nodes, one crossing hop
    z2 = Layout(dp_shard=16, zero_stage=2, micro_batch_size=1, recompute="none")
    job = Job(seq_len=2048, global_batch_size=32)

    def extra(lo, **kw):
        j = dataclasses.replace(job, **kw)
        est = [estimate(cfg, c, j, lo, gpus=16) for c in (base, slow)]
        assert est[0].num_microbatches == 2
        return est[1].time_s["dp_comm"] - est[0].time_s["dp_comm"]

    m, units = 2, cfg.num_layers + 1
    per_unit = extra(z2, zero2_unit_collectives=True)
    assert 2 * m * units - 0.1 <= per_unit <= 2 * m * units + 0.1
    assert 2 - 0.1 <= extra(z2) <= 2 + 0.1  # one gradient reduce-scatter, one parameter all-gather
    full_shard = extra(dataclasses.replace(z2, zero_stage=3))
    assert full_shard - per_unit == pytest.approx(m * cfg.num_layers, abs=0.1)

    row = {"model": "MPT-1B", "params_b": "1.3", "layers": "24", "hidden": "2048", "heads": "16", "kv_heads": "16",
           "ffn": "8192", "vocab": "50368", "moe": "dense", "seq_len": "2048", "gbs_seqs": "1536", "gbs_tokens": "",
           "mbs": "12", "gpu": "H100 80GB", "n_gpus": "128", "tp": "1", "pp": "1", "vpp": "", "dp": "128",
           "zero_fsdp": "SHARD_GRAD_OP (ZeRO-2, Composer)", "cp": "1", "ep": "", "sp": "no", "recompute": "none",
           "precision": "bf16", "source": "MosaicML llm-foundry (2024)", "source_loc": "", "notes": "",
           "inferred_fields": "", "other_metric": "", "group": "O", "row_id": "X1"}
    assert job_of(row, model_of(row)).zero2_unit_collectives
    assert not job_of({**row, "zero_fsdp": "ZeRO-2 (DeepSpeed)"}, model_of(row)).zero2_unit_collectives


def test_fp8_weights_cost_what_their_cast_moves():
    """`Job.fp8_weights`: Transformer Engine's cached weights cost nothing per micro-batch; torchao's dynamic scaling
    casts every weight in every forward (6 bytes per element: a max-abs read, a read and two fp8 writes); with FSDP's
    float8 all-gather each rank casts its shard (3 bytes per shard element) and the backward copies the gathered
    weight into its transposed layout (2 bytes per element), and the blocks are gathered -- and copied out -- in one
    byte per parameter instead of two. An unknown mode is refused."""
    from meshlm.planner.cost import Layout, ModelSummary, estimate
    from meshlm.planner.kernels import fp8_cast_bytes
    from meshlm.planner.placement import rank_setup

    gemms = [(4096, 3072, 1024, 1.0), (4096, 1024, 2816, 2.0)]
    weights = 3072 * 1024 + 2 * 1024 * 2816
    cached = fp8_cast_bytes(gemms)
    dynamic = fp8_cast_bytes(gemms, weights="dynamic", shard=8)
    gathered = fp8_cast_bytes(gemms, weights="fsdp_all_gather", shard=8)
    assert dynamic[0] - cached[0] == 6 * weights and dynamic[1] == cached[1]
    assert gathered[0] - cached[0] == pytest.approx(3 * weights / 8) and gathered[1] - cached[1] == 2 * weights
    with pytest.raises(ValueError, match="fp8_weights"):
        Job(seq_len=2048, global_batch_size=8, fp8_weights="delayed").validate()

    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=16,
                      intermediate_size=2816, max_seq_len=2048)
    h100 = get_cluster("h100")
    lo = Layout(dp_shard=16, zero_stage=3, micro_batch_size=1, recompute="none")
    job = Job(seq_len=2048, global_batch_size=32, precision="fp8", fp8_weights="fsdp_all_gather")
    est = [estimate(cfg, h100, dataclasses.replace(job, fsdp_copy_out=x), lo, gpus=16) for x in (False, True)]
    summary = ModelSummary.build(cfg, 2048)
    r = rank_setup(summary, h100, job, lo)
    block = summary.layer_tp + summary.layer_rep
    root = 2 * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size
    copied = est[0].num_microbatches * (2 * cfg.num_layers * block * 1 + root * 2)
    assert est[1].time_s["dp_comm"] - est[0].time_s["dp_comm"] == pytest.approx(2 * copied / r.hbm_bw, rel=1e-6)


def test_runtime_accounting_is_an_explicit_field():
    from meshlm.planner import cost

    cfg = ModelConfig(**TINY)
    lo = cost.Layout(dp_shard=4, zero_stage=1)
    mine = cost.estimate(cfg, get_cluster("a100"), Job(seq_len=16, global_batch_size=4, precision="fp32",
                                                       runtime="meshlm"), lo)
    megatron = cost.estimate(cfg, get_cluster("a100"), Job(seq_len=16, global_batch_size=4, precision="fp32"), lo)
    # meshlm's ZeRO-1 keeps full fp32 weights + a flat master shard; Megatron's accounting shards the 8
    # bytes of fp32 moments only (fp32 weights are the master copy)
    assert mine.memory_gib["optimizer"] > megatron.memory_gib["optimizer"]
    with pytest.raises(ValueError, match="runtime='meshlm' trains in fp32"):
        Job(seq_len=16, global_batch_size=4, precision="bf16", runtime="meshlm").validate()
    with pytest.raises(ValueError, match="runtime='torch' must be one of"):
        Job(seq_len=16, global_batch_size=4, runtime="torch").validate()


def test_validate_layout_refuses_what_the_runtime_refuses():
    from meshlm.planner import cost

    job = Job(seq_len=64, global_batch_size=4)
    odd_vocab = ModelConfig(**{**TINY, "vocab_size": 65})
    with pytest.raises(ValueError, match="model.vocab_size=65 is not divisible by tp=2"):
        cost.validate_layout(odd_vocab, job, cost.Layout(tp=2), gpus=2)
    odd_mlp = ModelConfig(**{**TINY, "num_kv_heads": 4, "intermediate_size": 50})
    with pytest.raises(ValueError, match="model.intermediate_size=50 is not divisible by tp=4"):
        cost.validate_layout(odd_mlp, job, cost.Layout(tp=4), gpus=4)
    assert cost.validate_layout(odd_mlp, job, cost.Layout(tp=2), gpus=2) == 4


def test_plan_attention_names_the_kernel_the_stack_runs(capsys):
    """`meshlm plan --attention`: fa2 (torchtitan's and most FSDP stacks' FlashAttention-2) adds exactly the step's
    attention kernels at FlashAttention-2's rate over the fused one's on H100 and nothing on A100, where FA2 is the rated
    kernel; unfused writes the scores out (gigabytes at 16K tokens) and runs them as GEMMs; fused is the default."""
    from test_planner import _cli

    from meshlm.planner.cost import Layout, ModelSummary
    from meshlm.planner.placement import rank_setup
    from meshlm.planner.timing import attention_time

    argv = ["plan", "estimate", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "16384", "--global-batch-size",
            "8", "--layout", "dp_shard=8,zero_stage=3,micro_batch_size=1", "--json"]
    run = lambda *flags: json.loads(_cli(argv + list(flags), capsys)[1])  # noqa: E731
    cfg, lo = ModelConfig.from_preset("llama3-8b"), Layout(dp_shard=8, zero_stage=3, micro_batch_size=1)
    summary = ModelSummary.build(cfg, 16384)
    for name, slower in (("a100", False), ("h100", True)):  # H100's last: its fused and fa2 runs are kept
        fused, fa2 = run("--cluster", name), run("--cluster", name, "--attention", "fa2")
        assert run("--cluster", name, "--attention", "fused") == fused
        jobs = [Job(seq_len=16384, global_batch_size=8, flash_attention_2=f) for f in (False, True)]
        kernels = [sum(attention_time(summary, j, lo, rank_setup(summary, get_cluster(name), j, lo))) for j in jobs]
        added = fa2["time_s"]["compute"] - fused["time_s"]["compute"]
        assert added == pytest.approx(cfg.num_layers * (kernels[1] - kernels[0]), rel=1e-9, abs=1e-12)
        assert (added > 0.1 * fused["time_s"]["compute"]) == slower, name
    unfused = run("--cluster", "h100", "--attention", "unfused")
    assert unfused["memory_gib"]["total"] > fused["memory_gib"]["total"] + 100
    assert unfused["time_s"]["compute"] > fa2["time_s"]["compute"]
