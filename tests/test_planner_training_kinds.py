"""The training planner's terms for the three kinds of run issue 25 found predicted too fast: ZeRO-3 / FSDP
over many nodes (one collective per unit and pass, each paying a ring latency that grows with the ranks),
Megatron's uniform pipeline split (the head and loss on top of the last stage) and FlashAttention-2 on
Hopper; eager RMSNorm in fp32, Paxml's one-hot embedding, block-input
dropout and dots-only remat; and how a published row's own
description (HSDP, its network, compiled or not) becomes a layout, a job and a cluster; and the planner's
accuracy over all of benchmarks/data's published runs.
Arithmetic only: no ranks are started."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshlm.config import ModelConfig
from meshlm.planner.cluster import get_cluster, with_overrides
from meshlm.planner.collectives import collective_time
from meshlm.planner.cost import Job, Layout, ModelSummary, estimate
from meshlm.planner.placement import rank_setup
from meshlm.planner.timing import attention_time

from test_planner_stacks import _row  # a published-run row with every column


def _gpt(layers: int = 24, hidden: int = 2048, vocab: int = 51200) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=16, num_kv_heads=16,
                       intermediate_size=4 * hidden, max_seq_len=2048)


def test_all_gather_and_reduce_scatter_latency_is_one_ring_over_every_rank():
    """NCCL has no tree for all-gather / reduce-scatter: n - 1 ring steps, n_out - 1 of them across domains
    (its tuning.cc cost model); all-reduce keeps the tree's log n across domains."""
    h100 = get_cluster("h100")
    up, out = h100.scaleup_latency, h100.scaleout_latency
    for kind in ("all_gather", "reduce_scatter"):
        assert collective_time(kind, 1.0, (8, 128), h100) == pytest.approx((8 * 128 - 128) * up + 127 * out)
        assert collective_time(kind, 1.0, (8, 1), h100) == pytest.approx(7 * up)
        assert collective_time(kind, 1.0, (1, 64), h100) == pytest.approx(63 * out)
    # all-reduce over 128 domains: 2 x (7 hops inside + 2 log2(128) = 14 tree hops across)
    assert collective_time("all_reduce", 1.0, (8, 128), h100) == pytest.approx(2 * 7 * up + 2 * 14 * out)


def test_fsdp_pays_a_latency_per_unit_and_pass():
    """FSDP gathers every block before its forward and before its backward and reduce-scatters its gradient: with
    a scale-out hop latency that dwarfs everything, a micro-step costs at least 3 x blocks such collectives'
    extra latency ((n_out - 1) hops each), and at most that plus the root's two."""
    cfg = _gpt(layers=12)
    job = Job(seq_len=2048, global_batch_size=64)
    lo = Layout(dp_shard=32, zero_stage=3, micro_batch_size=1, recompute="none")  # 4 nodes of 8, m = 2
    base = get_cluster("h100")
    slow = with_overrides(base, scaleout_latency=base.scaleout_latency + 1.0)  # + 1 s per crossing hop
    dp_base = estimate(cfg, base, job, lo, gpus=32).time_s["dp_comm"]
    est = estimate(cfg, slow, job, lo, gpus=32)
    extra, m, hops = est.time_s["dp_comm"] - dp_base, est.num_microbatches, 4 - 1
    assert m == 2
    assert 3 * 12 * m * hops * 1.0 <= extra <= (3 * 12 + 2) * m * hops * 1.0 + 1.0


def test_deepspeed_zero3_before_v06_gathers_each_tensor_on_the_critical_path():
    """`Job.zero3_serial_gathers`: every parameter tensor its own all-gather, none hidden under compute: a micro-step
    pays 2 x blocks x `block_tensors` ring latencies at least (one more second per crossing hop costs at least that
    many seconds per hop), and with compute to spare all the gathers stay exposed, where prefetched ones hide. Rows
    of DeepSpeed's ZeRO-3 of 2021 (or naming a release before 0.6) get it."""
    from meshlm.planner.published import job_of
    from meshlm.planner.published_rows import model_of
    from meshlm.planner.timing_dp import block_tensors

    cfg = _gpt(layers=12)
    assert block_tensors(cfg) == 9 and block_tensors(replace(cfg, attention_bias=True, qk_norm=True)) == 14
    lo = Layout(dp_shard=32, zero_stage=3, micro_batch_size=1, recompute="none")  # 4 nodes of 8, m = 2
    base = get_cluster("h100")
    slow = with_overrides(base, scaleout_latency=base.scaleout_latency + 1.0)
    serial = Job(seq_len=2048, global_batch_size=64, zero3_serial_gathers=True)
    extra = (estimate(cfg, slow, serial, lo, gpus=32).time_s["dp_comm"]
             - estimate(cfg, base, serial, lo, gpus=32).time_s["dp_comm"])
    assert extra >= 2 * 2 * 12 * block_tensors(cfg) * 3 * 1.0
    long_job = Job(seq_len=8192, global_batch_size=64)
    summary = ModelSummary.build(cfg, 8192)
    span = rank_setup(summary, base, long_job, lo).spans["dp_shard"]
    tensors = block_tensors(cfg)
    gathers = 2 * 2 * 12 * tensors * collective_time("all_gather", (summary.layer_tp + summary.layer_rep) * 2 / tensors,
                                                     span, base)
    hidden, serial = (estimate(cfg, base, replace(long_job, zero3_serial_gathers=x), lo, gpus=32).time_s["dp_comm"]
                      for x in (False, True))
    assert serial >= gathers > hidden

    row = _row(model="GPT-3 175B", layers="96", hidden="12288", heads="96", kv_heads="96", ffn="49152",
               vocab="51200", n_gpus="384", dp="384", mbs="4", gbs_seqs="1536", zero_fsdp="ZeRO-3",
               recompute="full", precision="fp16", source="a study of 2021")
    cfg = model_of(row)
    assert job_of(row, cfg).zero3_serial_gathers
    assert not job_of({**row, "zero_fsdp": "FSDP (FairScale)"}, cfg).zero3_serial_gathers
    assert not job_of({**row, "source": "a study of 2023"}, cfg).zero3_serial_gathers
    assert job_of({**row, "source": "a study of 2023", "notes": "DeepSpeed 0.5.4"}, cfg).zero3_serial_gathers
    assert not job_of({**row, "zero_fsdp": "ZeRO-1"}, cfg).zero3_serial_gathers


def test_fsdp_exposes_the_root_gather_and_the_last_reductions_even_with_compute_to_spare():
    """Long sequences leave the gathers far under the compute, yet the root's gather opens each micro-step
    and the last reduce-scatter closes the step: dp_comm stays above those, and grows with the micro-steps."""
    cfg = _gpt(layers=8, hidden=1024)
    h100 = get_cluster("h100")
    lo = Layout(dp_shard=16, zero_stage=3, micro_batch_size=1, recompute="none")
    one = estimate(cfg, h100, Job(seq_len=2048, global_batch_size=16), lo, gpus=16)
    four = estimate(cfg, h100, Job(seq_len=2048, global_batch_size=64), lo, gpus=16)
    root_bytes = 2 * cfg.vocab_size * cfg.hidden_size * 2  # embedding + untied head, bf16
    span = rank_setup(ModelSummary.build(cfg, 2048), h100, Job(seq_len=2048, global_batch_size=16), lo).spans["dp_shard"]
    root_gather = collective_time("all_gather", root_bytes, span, h100)
    assert one.time_s["dp_comm"] >= root_gather
    assert four.time_s["dp_comm"] >= one.time_s["dp_comm"] + 3 * root_gather * (1 - h100.comm_sm_fraction)


def test_uniform_pipeline_split_puts_the_head_on_top_of_an_even_last_stage():
    """Megatron's split: num_layers / stages blocks each, the head and loss on the last rank as well; the
    planner's balanced split lightens that rank, so the uniform one is never faster."""
    cfg = _gpt(layers=24, hidden=1536)
    job = Job(seq_len=1024, global_batch_size=32)
    a100 = get_cluster("a100")
    summary = ModelSummary.build(cfg, 1024)
    head_units = summary.flops_head / (summary.flops_dense + summary.flops_attn)
    uni = Layout(pp=8, dp_shard=1, micro_batch_size=1, pp_split="uniform")
    r = rank_setup(summary, a100, job, uni)
    assert r.rank_layers == [3] * 8 and r.rank_units == pytest.approx(3 + head_units)
    bal = rank_setup(summary, a100, job, replace(uni, pp_split="balanced"))
    assert bal.rank_units < r.rank_units and sum(bal.rank_layers) == 24
    assert estimate(cfg, a100, job, uni, gpus=8).time_s["step"] > estimate(cfg, a100, job, replace(
        uni, pp_split="balanced"), gpus=8).time_s["step"]
    with pytest.raises(ValueError, match="pp_split"):
        estimate(cfg, a100, job, replace(uni, pp_split="even"), gpus=8)


def test_flash_attention_2_runs_at_its_own_rate_on_hopper_only():
    cfg = _gpt()
    lo = Layout(dp_shard=8, micro_batch_size=1)
    for name, ratio in (("h100", 0.55 / 0.35), ("a100", 1.0)):
        cluster = get_cluster(name)
        times = []
        for fa2 in (False, True):
            job = Job(seq_len=2048, global_batch_size=8, flash_attention_2=fa2)
            summary = ModelSummary.build(cfg, 2048)
            times.append(attention_time(summary, job, lo, rank_setup(summary, cluster, job, lo)))
        assert times[1][0] / times[0][0] == pytest.approx(ratio)
        assert times[1][1] / times[0][1] == pytest.approx(ratio)


def test_published_row_hsdp_and_its_own_network():
    """A row saying HSDP shards over a node's 8 GPUs and replicates across nodes; a JAX recipe's "FSDP=128 x DP=4"
    shards over 128 and replicates 4 times (and a degree that does not divide dp is refused); a row naming its
    scale-out bandwidth per GPU gets it (the preset's when it names none); recompute "partial" (a remat policy
    re-running about half the forward) is priced as half, "full (...)" as full, and a policy stating the share of the
    forward it re-runs ("about 90% of the forward FLOPs") weighs the no- and full-recompute estimates by it."""
    from meshlm.planner.published import layouts_of
    from meshlm.planner.published_rows import (HALF_RECOMPUTE, cluster_for, model_of, recompute_fraction,
                                               recompute_of, zero_of)

    row = {"row_id": "X", "group": "P_fms_fsdp", "model": "Llama2-7b", "layers": "32", "hidden": "4096",
           "heads": "32", "kv_heads": "32", "ffn": "11008", "vocab": "32000", "seq_len": "4096", "n_gpus": "96",
           "tp": "1", "pp": "1", "cp": "1", "ep": "", "dp": "96", "vpp": "", "mbs": "2", "sp": "no",
           "recompute": "none", "zero_fsdp": "HSDP (shard within node, replicate across)", "gpu": "H100 80GB",
           "internode_bw_per_gpu": "100 Gb/s (800 Gbps per node)"}
    assert zero_of(row) == 3
    (lo,) = layouts_of(row, model_of(row))
    assert (lo.dp_shard, lo.dp_replicate, lo.zero_stage) == (8, 12, 3)
    assert cluster_for(row).scaleout_bw == pytest.approx(100e9 / 8)
    assert cluster_for({**row, "internode_bw_per_gpu": ""}).scaleout_bw == get_cluster("h100").scaleout_bw
    # The figure with a unit, not the count of links before it (once read as 8 Gb/s).
    assert cluster_for({**row, "internode_bw_per_gpu": "8 x 200 Gb/s HDR"}).scaleout_bw == pytest.approx(200e9 / 8)
    jax = {**row, "group": "U_maxtext_llama2_70b_h100_fsdp", "n_gpus": "512", "dp": "512",
           "zero_fsdp": "FSDP=128 x DP=4 (MaxText fsdp and data mesh axes)", "recompute": "partial (remat policy)"}
    assert zero_of(jax) == 3 and recompute_of(jax) == HALF_RECOMPUTE
    assert recompute_of({**jax, "recompute": "full (remat_policy=save_qkv_proj)"}) == "full"
    stated = recompute_of({**jax, "recompute": "full (save_qkv_proj: about 90% of the forward FLOPs)"})
    assert recompute_fraction(stated) == pytest.approx(0.9)
    (lo,) = layouts_of(jax, model_of(jax))
    assert (lo.dp_shard, lo.dp_replicate, lo.zero_stage) == (128, 4, 3)
    with pytest.raises(ValueError, match="FSDP degree 96"):
        layouts_of({**jax, "zero_fsdp": "FSDP=96 x DP=5"}, model_of(jax))


def test_eager_norms_in_fp32_cost_their_bytes_exactly():
    """Eager bf16: each of a layer's two norms runs in fp32 (36 bytes per element, 18 two-byte elements; meshlm's,
    HF's, torchtitan's and fms' RMSNorm upcast) or, `fp32_norms=False`, as one bf16 kernel (2 elements, MPT's
    low-precision LayerNorm): the forward differs by exactly 2 x 16 x hidden x tokens x 2 bytes at HBM rate, the
    backward by twice that; fp32 activations keep 7 elements per norm whatever the flag; fused kernels ignore it."""
    from meshlm.planner.timing import elementwise_time

    cfg = _gpt(layers=4, hidden=1024)
    lo = Layout(dp_shard=8, micro_batch_size=2)
    cluster = get_cluster("h100")

    def elem(**kw):
        job = Job(seq_len=2048, global_batch_size=16, **kw)
        summary = ModelSummary.build(cfg, 2048, eager=not job.fused_elementwise)
        r = rank_setup(summary, cluster, job, lo)
        return elementwise_time(summary, job, r, gemms=[], imbalance=1.0), r

    (f32, b32), r = elem(fused_elementwise=False)
    (f16, b16), _ = elem(fused_elementwise=False, fp32_norms=False)
    expected = 2 * (18 - 2) * cfg.hidden_size * r.tokens_mb * 2 / r.hbm_bw
    assert f32 - f16 == pytest.approx(expected)
    assert b32 - b16 == pytest.approx(2 * expected)
    assert elem(fused_elementwise=True)[0] == elem(fused_elementwise=True, fp32_norms=False)[0]
    fp32 = [elem(fused_elementwise=False, precision="fp32", runtime="meshlm", fp32_norms=x)[0][0] for x in (True, False)]
    assert fp32[0] - fp32[1] == pytest.approx(2 * (7 - 2) * cfg.hidden_size * r.tokens_mb * 4 / r.hbm_bw)


def test_fms_rows_run_eager_unless_their_source_is_the_compiled_table():
    """fms-fsdp's README tables of Feb-Mar 2024 ran with --use_torch_compile=False; the table of 2024-05-09 says
    its numbers are with torch.compile: the row's source decides Job.fused_elementwise."""
    from meshlm.planner.published import job_of
    from meshlm.planner.published_rows import model_of

    row = {"row_id": "X", "group": "P_fms_fsdp", "model": "Llama2-7b", "layers": "32", "hidden": "4096",
           "heads": "32", "kv_heads": "32", "ffn": "11008", "vocab": "32000", "seq_len": "4096", "n_gpus": "96",
           "tp": "1", "pp": "1", "cp": "1", "ep": "", "dp": "96", "vpp": "", "mbs": "2", "sp": "no", "gbs_seqs": "192",
           "recompute": "none", "zero_fsdp": "FSDP", "gpu": "H100 80GB", "precision": "bf16",
           "source": "IBM / PyTorch, fms-fsdp README.md (2024)"}
    cfg = model_of(row)
    assert not job_of(row, cfg).fused_elementwise
    compiled = {**row, "source": "fms-fsdp README.md (revision of 2024-05-09, 'numbers are updated with torch.compile')"}
    assert job_of(compiled, cfg).fused_elementwise
    titan = {**row, "source": "pytorch/torchtitan benchmarks (Trainy)"}  # eager unless the row says compiled
    assert not job_of(titan, cfg).fused_elementwise  # its own flag says so too (group AN):
    assert job_of({**titan, "notes": "--training.compile --model.converters float8"}, cfg).fused_elementwise
    assert not job_of({**titan, "notes": "eager PyTorch, no torch.compile"}, cfg).fused_elementwise  # (group AO)
    assert job_of({**row, "source": "MosaicML llm-foundry benchmarking README (Composer FSDP)"}, cfg).fp32_norms is False
    assert job_of(row, cfg).fp32_norms is True
    # TP communication overlapped where the row names it (torchtitan's async TP, Megatron's --tp-comm-overlap).
    assert not job_of(row, cfg).tp_comm_overlap
    assert job_of({**row, "notes": "FSDP + TP with async TP"}, cfg).tp_comm_overlap
    assert job_of({**row, "notes": "--tp-comm-overlap"}, cfg).tp_comm_overlap


def test_published_row_recompute_not_stated_takes_the_fastest_that_fits_and_deepspeed_fp16_reduces_in_fp16():
    """A row whose recomputation is "not stated" is priced with none, half and full and keeps the fastest layout that
    fits, exactly the one the row would get with that recomputation written in; DeepSpeed's fp16 ZeRO-1 rows (GPT-NeoX,
    BigScience's fp16 benchmark) reduce 16-bit gradients, BLOOM-176B's BF16_Optimizer fp32 ones."""
    from meshlm.planner.published import job_of, predict_row
    from meshlm.planner.published_rows import model_of, recompute_choices

    row = {"row_id": "X", "group": "T_float8_fsdp2_blog_h100", "model": "Llama 3 70B (torchtitan)", "layers": "80",
           "hidden": "8192", "heads": "64", "kv_heads": "8", "ffn": "28672", "vocab": "128256", "seq_len": "8192",
           "n_gpus": "512", "tp": "1", "pp": "1", "cp": "1", "ep": "1", "dp": "512", "vpp": "", "mbs": "",
           "sp": "no", "gbs_seqs": "", "recompute": "not stated", "zero_fsdp": "FSDP2", "gpu": "H100 80GB",
           "precision": "bf16", "source": "float8 / FSDP2 blog, 2024", "internode_bw_per_gpu": "",
           "tokens_per_s_per_gpu": "960", "step_time_s": "", "pct_peak_type": ""}
    assert recompute_choices(row) == ["none", "half", "full"]
    got = predict_row(row)
    spelled = [predict_row({**row, "recompute": rc}) for rc in ("none", "selective op", "full")]
    fitting = [p for p in spelled if p["fits"]]
    assert fitting and got["fits"]
    assert got["predicted"] == max(p["predicted"] for p in fitting)
    assert got["layout"] in {p["layout"] for p in fitting}
    neox = {**row, "group": "Q_gpt_neox_20b", "model": "GPT-NeoX-20B", "precision": "fp16", "recompute": "full"}
    cfg = model_of(neox)
    assert not job_of(neox, cfg).grad_reduce_in_fp32
    bloom = {**neox, "model": "BLOOM-176B", "source": "BigScience 2022 (Megatron-DeepSpeed, DeepSpeed pipeline engine)"}
    assert not job_of(bloom, cfg).grad_reduce_in_fp32
    assert job_of({**bloom, "precision": "bf16"}, cfg).grad_reduce_in_fp32


def test_one_hot_embedding_gemm_and_unfused_dropout_cost_their_flops_and_bytes():
    """Paxml's GPT configs look the tied embedding up as a one-hot matmul (`Job.embedding_gemm`): per micro-batch
    a forward GEMM and the table's gradient, 4 x tokens x vocab x hidden FLOPs at the bf16 rate (also under fp8:
    no input gradient, so not the 6 x of a layer GEMM) plus the one-hot written once; the 5B drops each block's
    input as a pass of its own (`Job.unfused_dropouts`): 2 x hidden elements per token forward, twice that
    backward; a remat policy keeping only dot outputs (`Job.remat_saves_dots`) re-runs the whole elementwise forward.
    The published rows set them from their configs (the 175B drops nothing; MaxText gathers)."""
    from meshlm.planner.published import job_of
    from meshlm.planner.published_rows import model_of
    from meshlm.planner.timing import elementwise_time

    cfg = _gpt(layers=4, hidden=1024, vocab=51200)
    cluster = get_cluster("h100")
    lo = Layout(dp_shard=8, micro_batch_size=2, recompute="none")
    tokens, (v, h) = 2 * 2048, (cfg.vocab_size, cfg.hidden_size)

    def compute(**kw):
        est = estimate(cfg, cluster, Job(seq_len=2048, global_batch_size=32, **kw), lo, gpus=8)
        return est.time_s["compute"] / est.num_microbatches

    rate = cluster.peak("bf16") * cluster.matmul_efficiency
    hbm = rank_setup(ModelSummary.build(cfg, 2048), cluster, Job(seq_len=2048, global_batch_size=32), lo).hbm_bw
    floor = 4 * tokens * v * h / rate + tokens * v * 2 / hbm
    for precision in ("bf16", "fp8"):
        added = compute(precision=precision, embedding_gemm=True) - compute(precision=precision)
        assert floor <= added <= 1.05 * floor  # a K-tile's fixed cost at most; no third (input-gradient) GEMM

    def elem(n):
        job = Job(seq_len=2048, global_batch_size=32, unfused_dropouts=n)
        summary = ModelSummary.build(cfg, 2048)
        return elementwise_time(summary, job, rank_setup(summary, cluster, job, lo), gemms=[], imbalance=1.0)

    (f0, b0), (f1, b1) = elem(0), elem(1)
    assert f1 - f0 == pytest.approx(2 * h * tokens * 2 / hbm)
    assert b1 - b0 == pytest.approx(2 * (f1 - f0))
    with pytest.raises(ValueError, match="unfused_dropouts"):
        Job(seq_len=2048, global_batch_size=32, unfused_dropouts=-1).validate()
    # A remat policy keeping only the dot outputs re-runs all of a layer's elementwise forward, not half of it.
    sel = replace(lo, recompute="selective")
    rc = [estimate(cfg, cluster, Job(seq_len=2048, global_batch_size=32, remat_saves_dots=x), sel, gpus=8)
          for x in (False, True)]
    assert rc[1].time_s["recompute"] - rc[0].time_s["recompute"] == pytest.approx(
        0.5 * f0 * cfg.num_layers * rc[0].num_microbatches)
    assert rc[1].time_s["compute"] == rc[0].time_s["compute"]

    row = _row(group="W_paxml_gpt_h100_fsdp", model="GPT-3 5B (Paxml)", layers="24", hidden="4096", heads="32",
               kv_heads="32", ffn="16384", vocab="50304", n_gpus="16", dp="16", mbs="4", gbs_seqs="64",
               recompute="selective", zero_fsdp="FSDP=8 x DP=2", gpu="H100 80GB", precision="BF16",
               source="dgxc-benchmarking (2025)")
    paxml_5b = job_of(row, model_of(row))
    assert paxml_5b.embedding_gemm and paxml_5b.unfused_dropouts == 1
    big = {**row, "group": "X_jaxtoolbox_paxml_gpt_fsdp256", "model": "GPT-3 175B (Paxml)"}
    assert job_of(big, model_of(big)).embedding_gemm and job_of(big, model_of(big)).unfused_dropouts == 0
    maxtext = {**row, "group": "Y_jaxtoolbox_maxtext_llama2_7b_h100", "model": "Llama 2 7B (MaxText)"}
    job = job_of(maxtext, model_of(maxtext))
    assert not job.embedding_gemm and job.unfused_dropouts == 0


def test_zero1_gradients_all_reduced_over_every_rank_cost_an_all_reduce_not_a_reduce_scatter():
    """`Job.zero1_grad_all_reduce` (InternLM's HybridZeroOptimizer): under ZeRO-1 over all 32 data-parallel ranks,
    with nothing overlapped, the step's data-parallel time grows by exactly an all-reduce less a reduce-scatter of
    the gradients; the parameters' gather is unchanged."""
    from dataclasses import replace

    from meshlm.config import ModelConfig
    from meshlm.planner.cluster import GiB
    from meshlm.planner.collectives import collective_time, group_span
    from meshlm.planner.cost import Job, Layout, ModelSummary, estimate_layout

    cfg, cluster = ModelConfig.from_preset("llama3-8b"), get_cluster("a100")
    job, summary = Job(seq_len=2048, global_batch_size=64, dp_comm_overlap=False), ModelSummary.build(cfg, 2048)
    lo = Layout(dp_shard=32, zero_stage=1, micro_batch_size=2)
    base = estimate_layout(summary, cluster, job, lo, num_microbatches=1)
    internlm = estimate_layout(summary, cluster, replace(job, zero1_grad_all_reduce=True), lo, num_microbatches=1)
    grads, span = base.memory_gib["gradients"] * GiB, group_span(1, 32, cluster.scaleup_size)
    extra = collective_time("all_reduce", grads, span, cluster) - collective_time("reduce_scatter", grads, span, cluster)
    assert extra > 0.1
    assert internlm.time_s["dp_comm"] - base.time_s["dp_comm"] == pytest.approx(extra, rel=1e-3)


def test_a_recompute_that_does_not_stop_early_runs_the_layers_last_collective_again():
    """`Job.recompute_early_stop` False (Megatron's and DeepSpeed's CheckpointFunction: the whole forward of a layer
    again): a fully recomputed layer issues its last tensor-parallel collective once more than torch's non-reentrant
    checkpoint, which stops once the saved tensors are rebuilt -- one all-reduce (no SP) or reduce-scatter (SP) a
    layer and micro-batch, exactly; meshlm's runtime always stops early; published rows by their stack."""
    from meshlm.planner.collectives import group_span
    from meshlm.planner.published import job_of
    from meshlm.planner.timing import tp_collectives

    cfg, cluster = _gpt(), get_cluster("a100")
    kw = dict(tp=4, tokens=4096, act_bytes=2, recompute="full")
    for sp, kind in ((False, "all_reduce"), (True, "reduce_scatter")):
        stops, reruns = (dict((k, n) for k, _, n in tp_collectives(cfg, sequence_parallel=sp, early_stop=e, **kw)[0])
                         for e in (True, False))
        assert reruns[kind] == stops[kind] + 1 and {k: n for k, n in reruns.items() if k != kind} == \
            {k: n for k, n in stops.items() if k != kind}
    job = Job(seq_len=2048, global_batch_size=8)
    lo = Layout(tp=4, dp_shard=2, micro_batch_size=2, recompute="full", sequence_parallel=False)
    t = {e: estimate(cfg, cluster, replace(job, recompute_early_stop=e), lo, gpus=8).time_s["tp_comm"]
         for e in (True, False)}
    x = 2 * 2048 * cfg.hidden_size * 2  # one micro-batch's hidden states, bf16
    extra = 2 * cfg.num_layers * collective_time("all_reduce", x, group_span(1, 4, cluster.scaleup_size), cluster)
    assert t[False] - t[True] == pytest.approx(extra, rel=1e-6)  # two micro-batches of 24 layers
    meshlm = Job(seq_len=2048, global_batch_size=8, runtime="meshlm", precision="fp32")
    assert (estimate(cfg, cluster, meshlm, lo, gpus=8).time_s["tp_comm"]
            == estimate(cfg, cluster, replace(meshlm, recompute_early_stop=True), lo, gpus=8).time_s["tp_comm"])
    row = {**_row(), "tp": "4", "recompute": "full"}
    assert not job_of(row, cfg).recompute_early_stop
    assert job_of({**row, "source": "KempnerForge's MFU report"}, cfg).recompute_early_stop


# Groups added for issue 25 from its eleventh round on, each bounded apart (never fitted): group -> the bound of its
# median |error| (the test's docstring says what each came in at).
APART = {
    "AF_hagemann_layouts_a100": 0.10,  # the eleventh round: 87 rows of one tp x pp sweep
    "AG_yafsdp_fsdp_a100": 0.40,  # the twelfth: FULL_SHARD, one sequence per GPU
    "AH_kempnerforge_h200": 0.20,  # the thirteenth: FSDP2 / DTensor TP on 1-32 H200s
    "AI_thunder_litgpt_h100_fsdp": 0.25,  # the fourteenth: 7-8B, FSDP ZeRO-2 on 8 H100s
    "AJ_flagperf_megatron_llama3_8b": 0.20,  # the same round: Megatron-Core's 8B, a pp x tp sweep on 8 A800s
    "AK_swallow_megatron_abci_a100": 0.20,  # the fifteenth: Llama 2 7B-70B, tp x pp on 16-256 A100 40GB
    "AL_megatron_bridge_cards_moe": 0.15,  # the seventeenth: MoE recipes on H100 / GB200 / GB300
    "AM_flagperf_flagscale_aquila2_7b": 0.10,  # the eighteenth: Aquila2-7B, tp x pp on one A800 node
    "AN_trainy_torchtitan_h200_fsdp": 0.20,  # the eighteenth: torchtitan's fp8 FSDP2 on 32 / 64 H200s
    "AO_atorch_fsdp_llama2_7b_a100": 0.20,  # the nineteenth: ATorch's FSDP1 Llama 2 7B on 8-64 A100s
    "AP_atorch_ds3d_llama2_7b_a100": 0.20,  # the same: ATorch's tp x pp of it under DeepSpeed's pipeline engine
    "AR_jubench_megatron_gpt13b_a100": 0.20,  # the twenty-second: Megatron-LM's GPT 13B, tp 2 x pp 4 on 32 A100s
}


def test_published_runs_median_error_within_ten_percent():
    """The planner on the published runs of benchmarks/data/ (each run with its own layout, `planner.published`,
    as benchmarks/planner_published.py prints it): the median |error| of the predicted throughput stays <= 9% over
    every row, and over the rows of the groups not bounded apart <= 10% (on the groups the constants were chosen with
    and on the others), <= 8% on their dense-model rows, <= 10% in every group of several rows and <= 25% in a group
    of one (its median is that row's error: GPT-NeoX-20B's pipeline, 17% too fast).
    A group that came in above 10% when added is bounded apart, never fitted: those of issue 25's fourth to eighth
    rounds in `apart` below (MaxText's and Paxml's JAX / XLA runs U-X and OLMo-core's FSDP2, AA, at 20%;
    Megatron-LLaMA's 13B, AB, at 30%; torchao's float8 runs of torchtitan, AC, at 40%), those of its eleventh round on
    in `APART` (each with its round); BigScience's topology benchmark, S, at 15% since DeepSpeed's partitioned pipeline
    sends were priced (its slow Omni-Path links had carried whole activations: 7.7% -> 12%). NeMo's long-context table,
    AD, bounded at 30% until its H100 rows' attention was read as the FlashAttention-2 its launcher ran (18% -> 6%), is
    held to 10% like the rest, and the dense rows' 9% back to 8%. benchmarks/data/README.md tells each group's
    story -- what it came in at, what was then priced, what is left (e.g. AG, FULL_SHARD at one sequence per GPU,
    issue 25's kind (1): 33% too fast, 43-56% at 2K tokens; AP, ATorch's tp x pp of Llama 2 7B on A100: 11% too
    fast) -- and benchmarks/planner_published.py each round's change to the model."""
    from pathlib import Path

    from meshlm.planner.published import read_runs, score_runs, summarize

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "published_runs_dev.csv"
    results, everything = score_runs(read_runs(path))
    assert everything["median_abs_error"] <= 0.09, everything
    over = {g: everything["per_group_median_abs_error"][g] for g, bound in APART.items()
            if everything["per_group_median_abs_error"][g] > bound}
    assert not over, (over, everything)
    summary = summarize([r for r in results if r["group"] not in APART])
    assert summary["rows_used"] >= 60
    assert summary["median_abs_error"] <= 0.10, summary
    assert summary["fit_groups_median_abs_error"] <= 0.10, summary
    assert summary["held_out_median_abs_error"] <= 0.10, summary
    assert summary["median_abs_error_dense"] <= 0.08, summary
    sizes = summary["per_group_rows"]
    groups = summary["per_group_median_abs_error"]
    apart = {"U_maxtext_llama2_70b_h100_fsdp": 0.20, "V_maxtext_llama3_70b_h100_fsdp": 0.20,
             "W_paxml_gpt_h100_fsdp": 0.20, "X_jaxtoolbox_paxml_gpt_fsdp256": 0.20,
             "AA_olmo_core_h100_fsdp": 0.20, "AB_megatron_llama_13b_a100": 0.30,
             "AC_torchao_float8_torchtitan_8b": 0.40,
             "S_bloom_prequel_a100_pipeline": 0.15}  # 7.7% until DeepSpeed's partitioned sends were priced
    assert max(err for g, err in groups.items() if sizes[g] > 1 and g not in apart) <= 0.10, summary
    assert all(groups[g] <= bound for g, bound in apart.items()), summary
    assert max(err for g, err in groups.items() if g not in apart) <= 0.25, summary


def test_a_step_leaning_on_overlap_says_so_and_counts_its_collectives_whole(capsys):
    """`Estimate.dp_comm_alone_s` is the step's data-parallel / ZeRO collectives with nothing overlapping them: for
    FSDP's FULL_SHARD, unit by unit, two gathers and one fp32 reduce-scatter per block and one of each for the root
    (embedding and head), exactly; without overlap (Megatron-LM 2021's exposed all-reduce) what the step exposes.
    Where they alone outlast the compute, `meshlm plan estimate` (and the search's explanation) says the step leans on
    overlap and what the published runs of that regime did (`explain.OVERLAP_SPREAD`, checked against the dev rows
    below); at 8K tokens per GPU the same layout does not."""
    from meshlm.planner.collectives import group_span
    from meshlm.planner.cost import estimate_layout
    from meshlm.planner.explain import overlap_caution
    from test_planner import _cli

    cfg, cluster = ModelConfig.from_preset("llama3-8b"), get_cluster("a100")
    lo = Layout(dp_shard=64, zero_stage=3, micro_batch_size=1)
    short, long = (estimate_layout(ModelSummary.build(cfg, s), cluster, Job(seq_len=s, global_batch_size=64), lo,
                                   num_microbatches=1) for s in (2048, 8192))
    span = group_span(1, 64, cluster.scaleup_size)
    summary = ModelSummary.build(cfg, 2048)
    block = summary.layer_tp + summary.layer_rep
    root = summary.embed + summary.head + cfg.hidden_size
    per_unit = lambda n: 2 * collective_time("all_gather", 2 * n, span, cluster) + collective_time(  # noqa: E731
        "reduce_scatter", 4 * n, span, cluster)
    whole = cfg.num_layers * per_unit(block) + per_unit(root) - collective_time("all_gather", 2 * root, span, cluster)
    assert short.dp_comm_alone_s == pytest.approx(whole, rel=1e-6)
    assert short.dp_comm_alone_s > short.time_s["compute"] > short.time_s["dp_comm"] > 0
    assert "Caution" in overlap_caution(short) and overlap_caution(long) is None
    no_overlap = Job(seq_len=2048, global_batch_size=64, dp_comm_overlap=False)
    exposed = estimate_layout(ModelSummary.build(cfg, 2048), cluster, no_overlap,
                              Layout(dp_shard=64, zero_stage=1, micro_batch_size=1), num_microbatches=1)
    assert exposed.dp_comm_alone_s == pytest.approx(exposed.time_s["dp_comm"], rel=1e-12)
    rc, out = _cli(["plan", "estimate", "--model", "llama3-8b", "--cluster", "a100", "--gpus", "64", "--seq-len",
                    "2048", "--global-batch-size", "64", "--layout", "dp_shard=64,zero_stage=3,micro_batch_size=1"],
                   capsys)
    assert rc == 0 and "Caution: its ZeRO-3 gathers and reduce-scatters alone take" in out


# Megatron's vocab-parallel cross entropy over 2-byte logits cast to fp32, bytes per logit: the cast (2 + 4), the max
# (4), the shifted copy (4 + 4), exp in place (4 + 4), the sum (4), the softmax divided in place (4 + 4); backward the
# product with the loss's gradient in place (4 + 4) and the cast back (4 + 2).
LOSS_BYTES_BF16 = (2 + 4) + 4 + (4 + 4) + (4 + 4) + 4 + (4 + 4) + (4 + 4) + (4 + 2)


def test_the_loss_costs_megatrons_cross_entropy_passes_per_logit():
    """The loss at HBM bandwidth as Megatron's vocab-parallel cross entropy runs it op by op (the logits cast to
    fp32, max, shift, exp, sum, the softmax kept, its product with the loss's gradient, the cast back): 52 bytes per
    logit of the rank's vocabulary shard with bf16 logits, 40 with fp32 ones (no casts); Megatron-Core's fused one
    (`Job.cross_entropy_fusion`) 28 either way; over tp ranks each its shard. Of the published rows, NVIDIA's recipes
    (NeMo / Megatron-Bridge, whose configs set cross_entropy_loss_fusion) and only they run the fused one."""
    from pathlib import Path

    from meshlm.planner import published
    from meshlm.planner.timing import loss_time

    cfg, cluster = ModelConfig.from_preset("llama3-8b"), get_cluster("h100")
    # Megatron-Core's fused one: the cast with the max (2 + 4), shift, exp and sum in one kernel (4 + 4), the
    # division (4 + 4), the backward in one (4 + 2); with fp32 logits the max reads them (4) and the backward writes 4.
    fused_bf16, fused_fp32 = (2 + 4) + (4 + 4) + (4 + 4) + (4 + 2), 4 + (4 + 4) + (4 + 4) + (4 + 4)
    cases = (("bf16", False, LOSS_BYTES_BF16), ("fp32", False, LOSS_BYTES_BF16 - (2 + 4) - (4 + 2)),
             ("bf16", True, fused_bf16), ("fp32", True, fused_fp32))
    for precision, fused, per_logit in cases:
        job = Job(seq_len=4096, global_batch_size=8, precision=precision)
        for tp in (1, 4):
            lo = Layout(dp_shard=8 // tp, tp=tp, micro_batch_size=2)
            r = rank_setup(ModelSummary.build(cfg, 4096), cluster, job, lo)
            expected = 2 * 4096 * cfg.vocab_size / tp * per_logit / r.hbm_bw
            assert loss_time(cfg, r, fused=fused) == pytest.approx(expected, rel=1e-12), (precision, fused, tp)
    rows = published.read_runs(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "published_runs_dev.csv")
    fused_groups = {r["group"] for r in rows if published.job_of(r, published.model_of(r)).cross_entropy_fusion}
    assert fused_groups == {"H_nemo_2407_h100_fp8", "I_megatron_bridge_h100", "AD_nemo_long_sequence_cp",
                            "AE_megatron_bridge_blackwell", "AL_megatron_bridge_cards_moe"}


def test_a_loss_over_gathered_logits_costs_an_all_gather_and_the_whole_vocabulary_per_rank():
    """`Job.tp_loss_replicated` (DTensor's head with a Replicate output and no loss_parallel: KempnerForge's rows,
    group AH): the loss's three 4-byte all-reduces per token become one all-gather of the logits (tokens x vocab x
    2 bytes), the loss's passes run over the whole vocabulary on every rank, and every rank holds all the fp32 logits
    and their gradient -- exactly those differences in the step and the memory; Megatron's vocab-parallel loss (the
    default) keeps each rank's vocabulary shard. Only KempnerForge's rows and Aleph Alpha's Scaling's (group AF: its
    head all-gathers the logits for a whole-vocabulary loss) are read so."""
    from pathlib import Path

    from meshlm.planner import published
    from meshlm.planner.cost import GiB
    from meshlm.planner.timing import loss_time

    cfg, cluster = ModelConfig.from_preset("llama3-8b"), get_cluster("h200")
    lo, tp = Layout(dp_shard=1, tp=4, sequence_parallel=True, micro_batch_size=2), 4
    summary, job = ModelSummary.build(cfg, 4096), Job(seq_len=4096, global_batch_size=2)
    shard, whole = (estimate(cfg, cluster, j, lo, gpus=4) for j in (job, replace(job, tp_loss_replicated=True)))
    r = rank_setup(summary, cluster, job, lo)
    tokens, span = 2 * 4096, r.spans["tp"]
    comm = (r.times("all_gather", tokens * cfg.vocab_size * 2, span) - 3 * r.times("all_reduce", 4 * tokens, span))
    assert whole.time_s["tp_comm"] - shard.time_s["tp_comm"] == pytest.approx(comm, rel=1e-9)
    loss = loss_time(cfg, r, replicated=True) - loss_time(cfg, r)
    assert loss == pytest.approx(tokens * cfg.vocab_size * LOSS_BYTES_BF16 * (1 - 1 / tp) / r.hbm_bw, rel=1e-12)
    assert whole.time_s["compute"] - shard.time_s["compute"] == pytest.approx(loss, rel=1e-9)
    logits = tokens * cfg.vocab_size * 4 * 2 * (1 - 1 / tp) / GiB
    assert whole.memory_gib["activations"] - shard.memory_gib["activations"] == pytest.approx(logits, rel=1e-9)
    rows = published.read_runs(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "published_runs_dev.csv")
    replicated = {r["group"] for r in rows if published.job_of(r, published.model_of(r)).tp_loss_replicated}
    assert replicated == {"AH_kempnerforge_h200", "AF_hagemann_layouts_a100"}


def test_a_model_cast_to_bf16_keeps_eight_bytes_of_state_per_parameter():
    """`Job.bf16_states` (KempnerForge casts its model to bf16 before training, group AH): parameters, gradients and
    the Adam moments 2 bytes each, no fp32 master -- 8 bytes per parameter where mixed precision keeps 2 + 4 + 12 -- in
    the memory and in the optimizer step's traffic; gradients still reduced in fp32 where the job says so."""
    from meshlm.planner.placement import bytes_per

    assert bytes_per("bf16", bf16_states=True) == dict(param=2, grad=2, optim=4, act=2, reduce=4)
    assert bytes_per("bf16") == dict(param=2, grad=4, optim=12, act=2, reduce=4)
    cfg, cluster = ModelConfig.from_preset("llama3-8b"), get_cluster("h200")
    lo, job = Layout(dp_shard=4, zero_stage=3, micro_batch_size=1), Job(seq_len=4096, global_batch_size=4)
    mixed, cast = (estimate(cfg, cluster, j, lo, gpus=4) for j in (job, replace(job, bf16_states=True)))
    states = lambda e: sum(e.memory_gib[k] for k in ("weights", "gradients", "optimizer"))  # noqa: E731
    assert states(cast) / states(mixed) == pytest.approx(8 / 18, rel=1e-9)
    assert cast.time_s["optimizer"] < mixed.time_s["optimizer"]
    assert cast.memory_gib["activations"] == mixed.memory_gib["activations"]
    # Megatron-Core's precision-aware optimizer with bf16 moments (`Job.bf16_moments`, group AL's recipes) keeps the
    # fp32 master beside them: 4 + 2 + 2 bytes of optimizer state where 12; with a bf16 cast there is no master
    assert bytes_per("bf16", bf16_moments=True) == dict(param=2, grad=4, optim=8, act=2, reduce=4)
    moments = estimate(cfg, cluster, replace(job, bf16_moments=True), lo, gpus=4)
    assert moments.memory_gib["optimizer"] / mixed.memory_gib["optimizer"] == pytest.approx(8 / 12, rel=1e-9)
    with pytest.raises(ValueError, match="bf16_moments"):
        replace(job, bf16_moments=True, bf16_states=True).validate()


def test_the_overlap_caution_states_what_the_dev_rows_show():
    """`explain.overlap_caution`'s spread is the published over the predicted step of the dev rows of its regime (ZeRO-3
    with collectives alone longer than the compute), recomputed here from the rows: a change of the model or of the
    data that moves it fails until the caution says so. 24 rows: AS's eleven, W's five, AG's eight."""
    from pathlib import Path

    from meshlm.planner.explain import OVERLAP_SPREAD
    from meshlm.planner.published import read_runs, score_runs

    results, _ = score_runs(read_runs(Path(__file__).resolve().parents[1] / "benchmarks" / "data" /
                                      "published_runs_dev.csv"))
    leaning = [r for r in results if "error" in r and "/z3" in r["layout"] and r["collectives_over_compute"] > 1]
    assert sorted({r["group"][:2] for r in leaning}) == ["AG", "AS", "W_"] and len(leaning) == 24
    steps = [1 + r["error"] for r in leaning]  # every metric is a rate: predicted over measured is the steps' ratio
    assert (min(steps), max(steps)) == pytest.approx(OVERLAP_SPREAD, abs=0.005)


def test_each_dev_row_is_read_as_of_one_of_the_issues_three_kinds_or_none():
    """`published_rows.issue_kind` by the issue's words: ZeRO-3 on >= 128 GPUs at <= 2 sequences a GPU (1), a 6-10B
    dense model under ZeRO-3 on H100 (2), a pipelined GPT of 1.5-30B on A100 (3); the summary's per-kind medians."""
    from meshlm.planner.published_rows import cluster_for, issue_kind, model_of

    fsdp = _row(model="Llama 2 7B", layers="32", hidden="4096", heads="32", ffn="11008", vocab="32000", n_gpus="128",
                dp="128", gbs_seqs="256", zero_fsdp="FSDP (FULL_SHARD)", gpu="H100 80GB")
    kind = lambda r: issue_kind(r, model_of(r), cluster_for(r))  # noqa: E731
    assert kind(fsdp) == 1 and kind({**fsdp, "gbs_seqs": "512"}) == 2  # 4 sequences a GPU: an 8B on H100 still
    assert kind({**fsdp, "gbs_seqs": "512", "gpu": "A100 80GB"}) is None
    assert kind({**fsdp, "n_gpus": "64", "dp": "64", "gbs_seqs": "128"}) == 2
    gpt = _row(model="GPT 13B", layers="40", hidden="5120", heads="32", ffn="20480", vocab="50432", n_gpus="32",
               tp="2", pp="4", dp="4", gbs_seqs="1024", gpu="A100 40GB")
    assert kind(gpt) == 3 and kind({**gpt, "pp": "1", "dp": "16"}) is None
    assert kind({**gpt, "model": "LLaMA 13B", "ffn": "13824"}) is None  # the issue's kind (3) is GPT's
    assert kind({**gpt, "gpu": "H100 80GB"}) is None
    from meshlm.planner.published import summarize
    rows = [{"group": g, "error": e, "moe": False, "issue_kind": k, "collectives_over_compute": 0.1, "layout": "x"}
            for g, e, k in (("A", 0.1, 3), ("B", 0.3, 3), ("C", -0.2, 1), ("D", 0.0, None))]
    assert summarize(rows)["median_error_by_issue_kind"] == {1: {"rows": 1, "median_error": -0.2, "groups": ["C"]},
                                                             3: {"rows": 2, "median_error": 0.2, "groups": ["A", "B"]}}
