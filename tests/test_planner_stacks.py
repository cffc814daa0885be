"""How a published run's software stack becomes the planner's `Job`: what Megatron-LM's legacy model and its
Megatron-LLaMA fork run (the first FlashAttention, ops left eager, unfused gradient accumulation, what "selective"
recomputes), how each stack gets its fp8 weights (`planner/published.py`'s `job_of`), and which part a GPU cell names.
Arithmetic only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest


def _row(**cells: str) -> dict:
    """A published-run row (benchmarks/data's columns) with `cells` over one A100 of pure data parallelism."""
    base = {"row_id": "X", "group": "ZZ_held_out", "source": "", "model": "", "layers": "", "hidden": "", "heads": "",
            "kv_heads": "", "ffn": "", "vocab": "", "seq_len": "2048", "n_gpus": "1", "tp": "1", "pp": "1", "cp": "1",
            "ep": "", "dp": "", "vpp": "", "mbs": "1", "sp": "no", "gbs_seqs": "", "recompute": "none", "zero_fsdp": "",
            "gpu": "A100 80GB", "precision": "bf16"}
    return {**base, **cells}


def test_megatron_llama_rows_and_rows_naming_the_first_flash_attention():
    """Megatron-LLaMA's code (group AB) runs flash-attn 1.x, RoPE / SwiGLU / the attention layout copies as torch ops
    and --no-gradient-accumulation-fusion; another Megatron row is read so only when it names them. A Megatron-LM row
    of 2023 attends with flash attention only where it says so; any row saying its attention is unfused, or that its
    RMSNorm ran as torch ops, is read so."""
    from meshlm.planner.layout import EAGER_OPS
    from meshlm.planner.published import job_of, recompute_as_run
    from meshlm.planner.published_rows import model_of

    row = _row(model="LLaMA-13B (Megatron-LLaMA)", layers="40", hidden="5120", heads="40", kv_heads="40", ffn="13824",
               vocab="32000", n_gpus="256", tp="2", dp="128", mbs="4", sp="yes", gbs_seqs="2048", recompute="selective",
               zero_fsdp="DistributedOptimizer", source="Alibaba, alibaba/Megatron-LLaMA README.md (2023)")
    job = job_of(row, model_of(row))
    legacy = frozenset(EAGER_OPS) - {"rmsnorm"}  # its RMSNorm is apex's fused kernel
    assert job.flash_attention_1 and job.eager_ops == legacy and not job.gradient_accumulation_fusion
    plain = {**row, "model": "LLaMA-13B", "source": "NVIDIA Megatron-LM (2023)"}
    job = job_of(plain, model_of(plain))
    assert not job.flash_attention_1 and job.gradient_accumulation_fusion
    # Megatron-LM's --use-flash-attn was opt-in until Transformer Engine's attention became its default (2024); its
    # legacy model runs RoPE and SwiGLU as torch ops, and copies q, k, v around flash-attn when it has it.
    assert not job.flash_attention and job.eager_ops == {"rope", "swiglu"}
    te = job_of({**plain, "source": "NVIDIA Megatron-LM (2024)"}, model_of(plain))
    assert te.flash_attention and not te.eager_ops
    flash = job_of({**plain, "notes": "--use-flash-attn"}, model_of(plain))
    assert flash.flash_attention and flash.eager_ops == legacy
    assert not job_of({**plain, "notes": "without FlashAttention"}, model_of(plain)).flash_attention
    gpt = {**plain, "model": "GPT 22B", "notes": "--use-flash-attn"}
    assert job_of(gpt, model_of(gpt)).eager_ops == {"attention_layout"}
    # ... and checkpoints its core attention only on the non-flash path: "selective" with flash recomputes nothing.
    assert recompute_as_run("selective", plain, flash) == "none"
    assert recompute_as_run("selective", plain, job) == "selective"
    assert recompute_as_run("selective", {**plain, "source": "NVIDIA Megatron-LM (2024)"}, te) == "selective"
    assert recompute_as_run("full", plain, flash) == "full"
    # A row saying its attention is unfused, or its RMSNorm ran as torch ops, is read so whatever its stack (AA-Scaling
    # runs RoPE and SwiGLU as torch ops of its own: `published_stacks.EAGER_ROPE_SWIGLU_STACKS`).
    sweep = {**row, "model": "LLaMA 13B (AA-Scaling)", "source": "Hagemann et al. 2023, AA-Scaling's run sheets"}
    swept = job_of(sweep, model_of(sweep))
    assert swept.flash_attention and swept.eager_ops == {"rope", "swiglu"}
    unfused = {**sweep, "notes": "unfused attention: the softmax as torch ops; RMSNorm as torch ops"}
    job = job_of(unfused, model_of(unfused))
    assert not job.flash_attention and job.eager_ops == {"rope", "swiglu", "rmsnorm"}
    for words, fa1 in (("flash-attn 1.0.4", True), ("FlashAttention v1", True), ("FlashAttention v1.0.8", True),
                       ("FlashAttention-2", False),
                       ("flash-attn 2.3.3", False), ("flash-attn 12", False)):
        named = {**plain, "notes": f"{words}; --no-gradient-accumulation-fusion"}
        job = job_of(named, model_of(named))
        assert job.flash_attention_1 is fa1 and not job.gradient_accumulation_fusion, words


def test_fp8_rows_get_their_stacks_weight_casts():
    """torchtitan's float8 (torchao, dynamic scaling, float8 all-gather off by default) casts the weights in every
    forward; OLMo-core's (Float8Config: enable_fsdp_float8_all_gather=True) casts shards before FSDP gathers them in
    fp8, as does a torchtitan row naming the float8 all-gather; Transformer Engine stacks cache them, except NVIDIA's
    recipes, which hold them as fp8 parameters (fp8_param_gather)."""
    from meshlm.planner.published import job_of
    from meshlm.planner.published_rows import model_of

    row = _row(model="Llama 3 8B (torchtitan)", n_gpus="8", dp="8", zero_fsdp="FSDP2", gpu="H100 80GB",
               precision="fp8 (float8 linear layers)", gbs_seqs="8", source="PyTorch, pytorch/torchtitan (2024)")
    cfg = model_of(row)
    assert job_of(row, cfg).fp8_weights == "dynamic"
    assert job_of({**row, "notes": "enable_fsdp_float8_all_gather"}, cfg).fp8_weights == "fsdp_all_gather"
    olmo = {**row, "model": "Llama 3 8B shape", "source": "Ai2, allenai/OLMo-core (2024)"}
    assert job_of(olmo, cfg).fp8_weights == "fsdp_all_gather"
    assert job_of({**olmo, "source": "NVIDIA Megatron-Bridge (2025)"}, cfg).fp8_weights == "params"
    assert job_of({**olmo, "source": "BAAI FlagPerf, Megatron-LM with Transformer Engine"}, cfg).fp8_weights == "cached"


def test_gpu_cells_name_their_part_for_training_and_serving_tables():
    """An H100 cell naming HBM2e or 2.4 TB/s is the HBM2e part (its memory-bound work 3.35 / 2.41 slower than the
    HBM3 part's, its GEMMs as fast); the serving tables read GPU cells with the same reader."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.cost import Job, Layout, ModelSummary
    from meshlm.planner.placement import rank_setup
    from meshlm.planner.published_rows import cluster_for, cluster_of, model_of
    from meshlm.planner.published_serving import Skip, deployment_of, read_rows
    from meshlm.planner.timing import elementwise_time

    assert cluster_of("H100 (Meta's variant: 2.4 TB/s HBM)") == "h100-hbm2e" == cluster_of("H100 96GB HBM2e")
    assert cluster_of("H100 80GB") == "h100" and cluster_of("MI300X-192GB") == "mi300x"
    row = _row(model="Llama 3 8B", n_gpus="8", dp="8", gpu="H100 HBM2e")
    fast, slow = get_cluster("h100"), cluster_for(row)
    assert (slow.hbm_bw, slow.peak("bf16")) == (2.41e12, fast.peak("bf16"))
    cfg, job, lo = model_of(row), Job(seq_len=2048, global_batch_size=8), Layout(dp_shard=8, micro_batch_size=1)
    summary = ModelSummary.build(cfg, 2048)
    times = [elementwise_time(summary, job, rank_setup(summary, c, job, lo), gemms=[], imbalance=1.0)
             for c in (fast, slow)]
    assert times[1][0] / times[0][0] == pytest.approx(3.35 / 2.41)
    served = read_rows(Path(__file__).resolve().parents[1] / "benchmarks/data/serving_runs_dev.csv")[0]
    assert deployment_of({**served, "gpu": "H100-SXM5 HBM2e"}).cluster.name == "h100-hbm2e"
    with pytest.raises(Skip, match="no cluster preset for 'TPU v5p'"):
        deployment_of({**served, "gpu": "TPU v5p"})


# MI355X's GEMMs over MI300X's, as fractions of their peaks: 1565 TFLOP/s of 2516.6 carried from H100 (0.62 of peak at
# 80.3% MAMF), against MI300X's measured 0.47
_MI355X_OVER_MI300X = 0.62 * (1565 / 2516.6) / 0.803 / 0.47


@pytest.mark.parametrize("name, fused, fa2", [("mi300x", 229e12, 229e12), ("b200", 1150e12, 360e12),
                                              ("gb200-nvl72", 1150e12 * 1822 / 1745, 360e12 * 1822 / 1745),
                                              ("gb300-nvl72", 1150e12 * 1822 / 1745, 360e12 * 1822 / 1745),
                                              ("b300", 1150e12 * 78.6 / 77.6, 360e12 * 78.6 / 77.6),
                                              ("mi355x", 229e12 / 1307 * _MI355X_OVER_MI300X * 2516.6,
                                               229e12 / 1307 * _MI355X_OVER_MI300X * 2516.6)])
def test_attention_at_the_measured_kernel_rates(name, fused, fa2):
    """MI300X attends at the rate ROCm's FlashAttention-2 measured (229 TFLOP/s forward + backward at head dim 128,
    16K tokens), whatever the stack's kernel; B200 at cuDNN's measured 1150 and FlashAttention-2's 360, GB200 at those
    times the two parts' achievable-matmul ratio -- none at Hopper's fraction of its larger peak. The parts without an
    attention measurement carry one: GB300 GB200's, B300 B200's by their MAMF ratio, MI355X MI300X's fraction of peak
    scaled as its GEMMs' fraction is."""
    from meshlm.config import ModelConfig
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.cost import Job, Layout, ModelSummary
    from meshlm.planner.placement import rank_setup
    from meshlm.planner.timing import attention_time

    cfg = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, max_seq_len=16384)
    cluster, lo = get_cluster(name), Layout(dp_shard=8, micro_batch_size=1)
    summary = ModelSummary.build(cfg, 16384)
    for flash_attention_2, rate in ((False, fused), (True, fa2)):
        job = Job(seq_len=16384, global_batch_size=8, flash_attention_2=flash_attention_2)
        fwd, bwd = attention_time(summary, job, lo, rank_setup(summary, cluster, job, lo))
        block = 16384 / (16384 + cluster.attention_block_overhead)
        ran = summary.flops_attn * 16384 * 0.5 * 3.5  # the unmasked half, backward 2.5x the forward
        assert ran / (fwd + bwd) == pytest.approx(rate * block)



def test_blackwell_ultra_and_cdna4_parts_at_their_datasheets_and_measured_gemms():
    """B300 / GB300 NVL72 (NVIDIA's data sheets) and MI355X / MI350X (AMD's): per GPU dense peaks, 288 GB at 8 TB/s,
    their links; GEMMs at Bekman's measured maximum (B300 bf16 1769 and fp8 3353 TFLOP/s, MI355X bf16 1565) carried from
    H100's transformer-shape fraction (0.62 at 794.5 of 989) as Blackwell's are; GB300 multiplies as GB200 does but fp4
    1.5x faster. Published tables' GPU cells name them, and a 405B model's 1M-token context fits on fewer of them."""
    from meshlm.planner.cluster import GiB, get_cluster
    from meshlm.planner.published_rows import cluster_of
    from meshlm.planner.serving import Serving
    from meshlm.planner.serving_layout import ServingLayout
    from meshlm.planner.serving_context import smallest_deployment
    from meshlm.planner.serving_model import served_model

    h100_fraction = 0.62 / (794.5 / 989)
    b300, gb300, gb200 = get_cluster("b300"), get_cluster("gb300-nvl72"), get_cluster("gb200-nvl72")
    mi355x, mi350x, mi300x = get_cluster("mi355x"), get_cluster("mi350x"), get_cluster("mi300x")
    assert [b300.peak(p) for p in ("bf16", "fp8", "fp4")] == [2250e12, 4500e12, 108e15 / 8]
    assert [gb300.peak(p) for p in ("bf16", "fp8", "fp4")] == [2500e12, 5000e12, 1080e15 / 72]
    assert [mi355x.peak(p) for p in ("bf16", "fp8", "fp4")] == [2516.6e12, 5033e12, 10066e12]
    for part in (b300, gb300, mi355x, mi350x):
        assert (part.hbm_bytes, part.hbm_bw) == (288 * GiB, 8e12)
    assert (b300.scaleup_size, gb300.scaleup_size, mi355x.scaleup_size) == (8, 72, 8)
    assert (b300.scaleup_bw, mi355x.scaleup_bw, b300.scaleout_bw, gb300.scaleout_bw) == (900e9, 7 * 76.8e9, 100e9, 100e9)
    assert b300.matmul_rate("bf16") == pytest.approx(1769e12 * h100_fraction, rel=2e-3)
    assert b300.matmul_rate("fp8") == pytest.approx(3353.3e12 * h100_fraction, rel=2e-3)
    assert mi355x.matmul_rate("bf16") == pytest.approx(1565e12 * h100_fraction, rel=1e-3)
    assert mi355x.matmul_rate("bf16") / mi300x.matmul_rate("bf16") == pytest.approx(1.97, abs=0.01)
    assert mi350x.peak("bf16") / mi355x.peak("bf16") == pytest.approx(2.2 / 2.4, rel=0.01)
    assert gb300.matmul_rate("fp8") == gb200.matmul_rate("fp8")
    assert gb300.matmul_rate("fp4") == pytest.approx(1.5 * gb200.matmul_rate("fp4"))
    cells = {"GB300 NVL72": "gb300-nvl72", "B300-SXM-288GB": "b300", "GB200": "gb200-nvl72", "B200-SXM-180GB": "b200",
             "MI355X": "mi355x", "AMD Instinct MI350X 288GB HBM3e": "mi350x", "MI325X": "mi325x",
             "NVIDIA RTX PRO 6000 Blackwell Server Edition": "rtx-pro-6000", "rtx_pro_6000": "rtx-pro-6000",
             "AMD MI-300X": "mi300x", "H100 SXM5 80GB": "h100", "A100-SXM4-40GB": "a100-40gb",
             "A100 40 GB": "a100-40gb", "A100 80GB (400 W)": "a100", "A800 SXM4 80GB": "a800",
             "NVIDIA_A800-SXM4-80GB": "a800"}
    assert {cell: cluster_of(cell) for cell in cells} == cells

    def gpus(cluster):
        sv = Serving(served_model("llama3-405b"), get_cluster(cluster), ServingLayout(), precision="bf16",
                     kv_precision="bf16")
        return smallest_deployment(sv, 2**20, 1, max_gpus=64)["gpus"]

    assert gpus("gb300-nvl72") == gpus("mi355x") < gpus("mi300x") < gpus("gb200-nvl72")

def _square_model_serving(cluster, precision, tp=1):
    """A model whose every GEMM has K = 4096 at tp = 1 (hidden, attention width and MLP width 4096): the shape vLLM's
    NVFP4 benchmark measured."""
    from meshlm.config import ModelConfig
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.serving import Serving
    from meshlm.planner.serving_layout import ServingLayout
    from meshlm.planner.serving_model import ServedModel

    cfg = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                      intermediate_size=4096, max_seq_len=16384)
    return Serving(ServedModel(cfg), get_cluster(cluster), ServingLayout(tp=tp), precision=precision,
                   kv_precision="bf16")


def test_a_torchao_float8_linear_at_the_speed_torchaos_own_benchmark_measured():
    """torchao's float8 README (pytorch/ao e2dad4a, 2024-09, "Performance"; benchmarks/float8/float8_roofline.py of
    then: GPU kernel time of a compiled LayerNorm -> Linear -> Sigmoid, forward + backward, bf16 against float8 with
    dynamic tensorwise scaling, on Meta's H100, 2.4 TB/s): 1.39x at M, K, N = 4096, 8192, 16384, 0.80x at 1024, 2048,
    1024. The planner's three GEMMs (bf16, then fp8) and torchao's casts (`fp8_cast_bytes`, "dynamic") on the
    h100-hbm2e preset, the Linear alone (the LayerNorm and Sigmoid, the same in both, would only pull the large
    shape's ratio toward 1): within 5% of the large shape's speedup; the small one is slower than bf16 as measured, by
    less (its kernels' launch costs are not priced), and within 10%."""
    from meshlm.planner.cluster import PRESETS
    from meshlm.planner.kernels import fp8_cast_bytes, gemms_fwd_bwd

    c = PRESETS["h100-hbm2e"]
    hbm = c.hbm_bw * c.hbm_efficiency

    def speedup(m, k, n):
        gemms = [(m, n, k, 1.0)]
        bf16 = sum(gemms_fwd_bwd(gemms, rate=c.matmul_rate("bf16"), hbm_bw=hbm, in_bytes=2,
                                 k_overhead=c.gemm_k_overhead))
        fp8 = sum(gemms_fwd_bwd(gemms, rate=c.matmul_rate("fp8"), hbm_bw=hbm, in_bytes=1,
                                k_overhead=c.gemm_k_overhead))
        return bf16 / (fp8 + sum(fp8_cast_bytes(gemms, weights="dynamic")) / hbm)

    assert speedup(4096, 8192, 16384) == pytest.approx(1.39, rel=0.05)
    assert speedup(1024, 2048, 1024) < 1 and speedup(1024, 2048, 1024) == pytest.approx(0.80, rel=0.10)


@pytest.mark.parametrize("name", ["h100", "mi300x", "b200"])
def test_training_gemms_run_at_their_precisions_measured_rate_as_serving_ones_do(name):
    """One GEMM model for training and serving: a training layer's fp8 GEMMs run at the fp8 peak times the measured fp8
    share of it (`Cluster.matmul_rate("fp8")`: Bekman's MAMF fp8 / bf16 fractions on H100 and B200, hipBLASLt's on
    MI300X), not at bf16's share of the doubled peak; bf16 at bf16's."""
    from meshlm.config import ModelConfig
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.cost import Job, Layout, ModelSummary
    from meshlm.planner.kernels import gemms_fwd_bwd, layer_gemms
    from meshlm.planner.placement import rank_setup
    from meshlm.planner.timing import layer_compute

    cfg = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8,
                      intermediate_size=14336, max_seq_len=4096)
    c, lo, summary = get_cluster(name), Layout(dp_shard=1, micro_batch_size=1), ModelSummary.build(cfg, 4096)
    for precision, in_bytes in (("fp8", 1), ("bf16", 2)):
        job = Job(seq_len=4096, global_batch_size=1, precision=precision)
        r = rank_setup(summary, c, job, lo)
        gemms = layer_gemms(cfg, tokens=r.tokens_mb, tp=1, ep=1, moe_fraction=0.0)
        want = gemms_fwd_bwd(gemms, rate=c.matmul_rate(precision), hbm_bw=r.hbm_bw, in_bytes=in_bytes,
                             k_overhead=c.gemm_k_overhead)
        layer = layer_compute(summary, job, lo, r, imbalance=1.0)
        assert (layer.dense, layer.dense_bwd) == pytest.approx(want, rel=1e-12)
    assert c.matmul_rate("fp8") < 2 * c.matmul_rate("bf16")  # the factor is below 1: the test can fail without it


@pytest.mark.parametrize("name", ["b200", "gb200-nvl72"])
def test_blackwell_fp4_gemms_at_their_measured_speed_over_bf16(name):
    """GEMMs of K = 4096 in NVFP4 run 2.77x as fast as in bf16 on Blackwell, as vLLM's NVFP4 GEMM benchmark measured on
    B200 at that K (3779 / 3904 against 1421 / 1360 TFLOP/s at 8K / 16K tokens), not the 4x of the datasheet peaks."""
    from meshlm.planner.serving import iteration_time

    def gemm_seconds(precision):
        sv = _square_model_serving(name, precision)
        return iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=16384, prefill_ctx=8192)["gemm_compute"]

    measured = (3778.8 / 1421.0 + 3904.3 / 1360.1) / 2
    assert gemm_seconds("bf16") / gemm_seconds("fp4") == pytest.approx(measured, rel=1e-3)
    assert gemm_seconds("bf16") / gemm_seconds("fp4") < 3.0


def test_serving_gemms_pay_their_tiles_fixed_k_like_training():
    """Serving prices a GEMM's tiles as the training side does (kernels.gemm_time: 256 bf16 elements of K of fixed
    cost per tile): split four ways, the row-parallel GEMMs (attention output, MLP down) keep K = 1024 of 4096 and run
    at 1024 / (1024 + 256) of the rate, the column-parallel ones (qkv, gate + up, head) at 4096 / (4096 + 256)."""
    from meshlm.planner.serving import iteration_time

    def gemm_seconds(tp):
        sv = _square_model_serving("h100", "bf16", tp=tp)
        return iteration_time(sv, decodes=256, kv_len=1024)["gemm_compute"]

    h, layers, vocab = 4096, 2, 32000
    column = layers * (h * (h + 2 * 1024) + 2 * h * h) + vocab * h  # qkv, gate + up: K = h; the head
    row = layers * 2 * h * h  # attention output, MLP down: K = 4096 / tp
    expected = (column * (4096 + 256) / 4096 + row * (1024 + 256) / 1024) / ((column + row) * (4096 + 256) / 4096)
    assert 4 * gemm_seconds(4) / gemm_seconds(1) == pytest.approx(expected, rel=1e-9)


def test_trtllm_mxfp4_experts_multiply_at_the_activations_precision():
    """TensorRT-LLM's gpt-oss rows keep the MXFP4 experts' bytes but multiply them with MXFP8 activations on Blackwell
    (the fp8 rate, not fp4's) and BF16 ones on Hopper; an NVFP4 checkpoint's experts stay at the fp4 rate."""
    from dataclasses import replace

    from meshlm.planner.published_serving import deployment_of, read_rows
    from meshlm.planner.serving import iteration_time

    rows = {r["row_id"]: r for r in read_rows(Path(__file__).resolve().parents[1]
                                              / "benchmarks/data/serving_runs_dev.csv")}
    sv = deployment_of(rows["J153"])
    assert (sv.precision, sv.expert_gemm_precision, sv.gemm_precision) == ("fp4", "fp8", "fp8")
    fp4 = replace(sv, expert_gemm_precision=None)
    assert sv.weight_bytes_per_gpu() == fp4.weight_bytes_per_gpu()  # the same MXFP4 bytes
    work = dict(decodes=0, kv_len=0, prefill_tokens=8192, prefill_ctx=512)
    cl = sv.cluster
    assert iteration_time(sv, **work)["gemm_compute"] > iteration_time(fp4, **work)["gemm_compute"]
    assert cl.matmul_rate("fp8") < cl.matmul_rate("fp4")
    hopper = deployment_of({**rows["J153"], "gpu": "H200-SXM-141GB"})
    assert (hopper.precision, hopper.gemm_precision) == ("fp4", "bf16")
    assert deployment_of(rows["A028"]).expert_gemm_precision is None  # NVFP4 DeepSeek-R1: FP4 activations too


def test_pcie_and_nvl_cards_are_their_own_parts(monkeypatch):
    """H100 PCIe / NVL and H200 NVL cards (NVIDIA's data sheets, dense): the Hopper die at card power and clocks, its
    memory, NVLink bridges of 2 or 4 cards; a table's GPU cell and a device's name pick them, not the SXM presets
    (benchmarks/train_step.py predicts no card it has no preset for)."""
    import importlib.util

    from meshlm.planner.cluster import GiB, get_cluster
    from meshlm.planner.published_rows import cluster_of

    pcie, nvl, h200_nvl, sxm = (get_cluster(n) for n in ("h100-pcie", "h100-nvl", "h200-nvl", "h100"))
    assert [c.peak("bf16") for c in (pcie, nvl, h200_nvl)] == [756e12, 835e12, 835e12] and sxm.peak("bf16") == 989e12
    assert [(c.hbm_bytes / GiB, c.hbm_bw) for c in (pcie, nvl, h200_nvl)] == [(80, 2.0e12), (94, 3.9e12), (141, 4.8e12)]
    assert [(c.scaleup_size, c.scaleup_bw) for c in (pcie, nvl, h200_nvl)] == [(2, 300e9), (2, 300e9), (4, 450e9)]
    assert pcie.matmul_rate("bf16") / sxm.matmul_rate("bf16") == pytest.approx(756 / 989)
    cells = {"H100 PCIe 80GB": "h100-pcie", "NVIDIA H100-NVL-94GB": "h100-nvl", "H200 NVL": "h200-nvl",
             "GH200 NVL2": "gh200", "GB200-186GB (NVL72)": "gb200-nvl72", "H100 (DGX-H100)": "h100"}
    assert {cell: cluster_of(cell) for cell in cells} == cells
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # its _common
    spec = importlib.util.spec_from_file_location("train_step", benchmarks / "train_step.py")
    train_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_step)
    names = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200 NVL": "h200-nvl",
             "NVIDIA GB200": "gb200-nvl72", "AMD Instinct MI355X": "mi355x", "NVIDIA A100 80GB PCIe": "a100-pcie",
             "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb", "NVIDIA L40S": "l40s", "NVIDIA GeForce RTX 4090": None}
    assert {n: train_step.cluster_of("auto", n) for n in names} == names


def test_a100_pcie_grace_hopper_and_ada_parts_are_their_own():
    """A100 PCIe (its GEMMs at Bekman's measured 252.9 against the SXM part's 271.2 TFLOP/s), GH200 (144 GB HBM3e, or the
    first version's 96 GB HBM3; its GEMMs at Bekman's 828.6 / 1535 TFLOP/s bf16 / fp8 carried from H100's fraction),
    L40S and L4 (NVIDIA's data sheets, dense; PCIe cards of 8 per server at 32 GB/s each way): a table's GPU cell names
    them -- "L4" is not the L40S, a GH200 not the H200 -- and a 70B model's weights in fp8 fit 2 L40S but not 2 L4 with
    room for a request."""
    from meshlm.planner.cluster import GiB, get_cluster
    from meshlm.planner.published_rows import cluster_of
    from meshlm.planner.serving import Serving
    from meshlm.planner.serving_layout import ServingLayout
    from meshlm.planner.serving_model import served_model

    sxm, pcie, pcie40 = get_cluster("a100"), get_cluster("a100-pcie"), get_cluster("a100-pcie-40gb")
    assert pcie.matmul_rate("bf16") / sxm.matmul_rate("bf16") == pytest.approx(252.9 / 271.2, rel=2e-3)
    assert (pcie.hbm_bw, pcie40.hbm_bw, pcie40.hbm_bytes, pcie.scaleup_size) == (1.935e12, 1.555e12, 40 * GiB, 2)
    h100_fraction = 0.62 / (794.5 / 989)
    gh, gh96 = get_cluster("gh200"), get_cluster("gh200-96gb")
    assert gh.matmul_rate("bf16") == pytest.approx(828.6e12 * h100_fraction, rel=2e-3)
    assert gh.matmul_rate("fp8") == pytest.approx(1535e12 * h100_fraction, rel=2e-3)
    assert (gh.hbm_bytes, gh.hbm_bw, gh96.hbm_bytes, gh96.hbm_bw) == (144 * GiB, 4.9e12, 96 * GiB, 4.0e12)
    l40s, l4 = get_cluster("l40s"), get_cluster("l4")
    assert [l40s.peak(p) for p in ("bf16", "fp8")] == [362e12, 733e12] and (l40s.hbm_bytes, l40s.hbm_bw) == (48 * GiB, 864e9)
    assert [l4.peak(p) for p in ("bf16", "fp8")] == [121e12, 242.5e12] and (l4.hbm_bytes, l4.hbm_bw) == (24 * GiB, 300e9)
    assert (l40s.scaleup_size, l40s.scaleup_bw, l4.gpu_power_w, l40s.gpu_power_w) == (8, 32e9, 72.0, 350.0)
    cells = {"NVIDIA L40S": "l40s", "L40S-48GB": "l40s", "NVIDIA L4": "l4", "L4 24GB": "l4", "l4": "l4",
             "A100-PCIe-80GB": "a100-pcie", "NVIDIA A100 PCIe 40GB": "a100-pcie-40gb", "A100-SXM4-80GB": "a100",
             "NVIDIA GH200-GraceHopper-Superchip_GH200-96GB_aarch64x1": "gh200-96gb",
             "NVIDIA GH200 Grace Hopper 144GB HBM3e": "gh200", "NVIDIA GH200 480GB": "gh200-96gb",
             "NVIDIA GH200 144G HBM3e": "gh200", "H200-SXM-141GB": "h200"}
    assert {cell: cluster_of(cell) for cell in cells} == cells
    with pytest.raises(ValueError, match="no cluster preset"):
        cluster_of("NVIDIA L40")

    def fits(cluster, tp):
        sv = Serving(served_model("llama3-70b"), get_cluster(cluster), ServingLayout(tp=tp), precision="fp8",
                     kv_precision="fp8")
        return sv.max_sequences(2048) >= 1

    assert fits("l40s", 2) and not fits("l4", 2) and fits("l4", 4)


def test_layout_sweep_rows_inferred_batch_agrees_with_every_rows_mfu():
    """Group AF's sheets print MFU (PaLM's 6N + 12LHQT per token of 312 TFLOP/s), step time and world size, not the
    batch or vocabulary: the inferred 4,194,304 tokens a step and vocabulary of 128000 (inferred_fields) give every
    row's MFU back within 1% (half within 0.1%) -- and LLaMA's own 32000 none."""
    from meshlm.planner.published import read_runs

    rows = [r for r in read_runs(Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "published_runs_dev.csv")
            if r["group"] == "AF_hagemann_layouts_a100"]
    assert len(rows) == 87

    def mfu(row, vocab):
        n_layers, h, ffn, seq = (int(row[k]) for k in ("layers", "hidden", "ffn", "seq_len"))
        params = n_layers * (4 * h * h + 3 * h * ffn + 2 * h) + 2 * vocab * h + h
        per_token = 6 * params + 12 * n_layers * h * seq
        return int(row["gbs_tokens"]) * per_token / (float(row["step_time_s"]) * int(row["n_gpus"]) * 312e12)

    off = sorted(abs(mfu(r, int(r["vocab"])) / (float(r["pct_peak"]) / 100) - 1) for r in rows)
    assert off[-1] < 1e-2 and off[len(off) // 2] < 1e-3
    assert all(abs(mfu(r, 32000) / (float(r["pct_peak"]) / 100) - 1) > 1e-2 for r in rows)


# RCCL's all-reduce on 8 MI300X of one node as Azure measured it (Azure/AI-benchmarking-guide,
# Azure_Results/ND_MI300X_v5_results.md, RCCL 2.22.3): message bytes and bus bandwidth in GB/s.
_RCCL_MI300X_ALL_REDUCE = {2**10: 0.04, 2**11: 0.07, 2**12: 0.15, 2**13: 0.29, 2**14: 0.59, 2**15: 1.13, 2**16: 2.22,
                           2**17: 4.18, 2**18: 7.50, 2**19: 13.01, 2**20: 22.41, 2**21: 43.41, 2**22: 82.53,
                           2**23: 131.57, 2**24: 171.46, 2**25: 230.35, 2**26: 266.34, 2**27: 290.81, 2**28: 302.80,
                           2**29: 308.89, 2**30: 313.92, 2**31: 315.06, 2**32: 314.85, 2**33: 316.82}


def test_mi300x_scale_up_all_reduce_follows_rccls_measured_curve():
    """The MI300X preset's ring all-reduce over its 8 GPUs against RCCL's measured times from 1 KB to 8 GB (bus
    bandwidth b of n = 8 ranks: t = 2 (n - 1) / n x bytes / b): within 26% at every size (the two-parameter ring
    cannot follow the protocol switch around 1 MB), and the ring that fits the curve best (least squares of the
    relative error, latency and bandwidth free) has the preset's hop latency and bandwidth within 10%."""
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.collectives import collective_time

    c, n = get_cluster("mi300x"), 8
    factor = 2 * (n - 1) / n
    measured = {s: factor * s / (b * 1e9) for s, b in _RCCL_MI300X_ALL_REDUCE.items()}
    errors = [collective_time("all_reduce", s, (n, 1), c) / t - 1 for s, t in measured.items()]
    assert max(abs(e) for e in errors) < 0.26
    # t = 2 (n - 1) x latency + factor x bytes / bandwidth, fitted as x / t + y x bytes / t = 1 (normal equations)
    rows = [(1 / t, s / t) for s, t in measured.items()]
    aa, ab, bb = sum(p * p for p, _ in rows), sum(p * q for p, q in rows), sum(q * q for _, q in rows)
    a1, b1 = sum(p for p, _ in rows), sum(q for _, q in rows)
    det = aa * bb - ab * ab
    x, y = (a1 * bb - b1 * ab) / det, (aa * b1 - ab * a1) / det
    _, bw = c.collective_fit("all_reduce", "scale-up")
    assert x / (2 * (n - 1)) == pytest.approx(c.scaleup_latency, rel=0.10)
    assert factor / y == pytest.approx(bw, rel=0.10)


def test_fsdp_accumulating_unsynchronized_holds_unsharded_gradients_and_reduces_once(capsys):
    """`Job.fsdp_no_sync` (KempnerForge's maybe_no_sync: FSDP2's set_requires_gradient_sync(False) on every micro-step
    but the last): the rank's whole gradients unsharded, at the reduce dtype's width, in place of their shard -- as
    many bytes as plain data parallelism keeps, exactly --, and each unit's gradient reduced once a step where every
    micro-step reduced it; nothing changes at one micro-step. Published rows by their stack; `meshlm plan
    --fsdp-no-sync`, refused on meshlm's runtime (whose ZeRO reduces once a step already)."""
    import json

    from test_planner import _cli

    from meshlm.config import ModelConfig
    from meshlm.planner.cluster import get_cluster
    from meshlm.planner.collectives import collective_time, group_span
    from meshlm.planner.cost import Job, Layout, ModelSummary, estimate
    from meshlm.planner.published import job_of

    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=16,
                      intermediate_size=4096, max_seq_len=2048)
    cluster, m = get_cluster("h100"), 4
    job = Job(seq_len=2048, global_batch_size=8 * m)
    fsdp, ddp = Layout(dp_shard=8, zero_stage=3), Layout(dp_shard=8)
    est = {(k, sync): estimate(cfg, cluster, replace(job, global_batch_size=8 * k, fsdp_no_sync=not sync), fsdp,
                               gpus=8) for k in (1, m) for sync in (True, False)}
    plain = estimate(cfg, cluster, job, ddp, gpus=8).memory_gib["gradients"]
    assert est[m, False].memory_gib["gradients"] == pytest.approx(plain, rel=1e-12)
    assert est[m, True].memory_gib["gradients"] < plain / 7  # the shard alone
    bucketed = Layout(dp_shard=8, zero_stage=2)  # Megatron's / DeepSpeed's ZeRO-2: not FSDP, the flag changes nothing
    assert (estimate(cfg, cluster, replace(job, fsdp_no_sync=True), bucketed, gpus=8).memory_gib
            == estimate(cfg, cluster, job, bucketed, gpus=8).memory_gib)
    assert est[1, False].memory_gib == est[1, True].memory_gib and est[1, False].time_s == est[1, True].time_s
    # The reductions per micro-step: a reduce-scatter of each block's fp32 gradients and of the root's.
    summary = ModelSummary.for_job(cfg, job)
    block, root = summary.layer_tp + summary.layer_rep, summary.embed + summary.head + cfg.hidden_size
    span = group_span(1, 8, cluster.scaleup_size)
    reduce = (cfg.num_layers * collective_time("reduce_scatter", block * 4, span, cluster)
              + collective_time("reduce_scatter", root * 4, span, cluster))
    assert est[m, True].dp_comm_alone_s == pytest.approx(m * est[1, True].dp_comm_alone_s, rel=1e-12)
    assert est[m, True].dp_comm_alone_s - est[m, False].dp_comm_alone_s == pytest.approx((m - 1) * reduce, rel=1e-9)
    row = {**_row(), "n_gpus": "8", "dp": "8", "gbs_seqs": "32", "zero_fsdp": "FSDP2 (fully_shard)"}
    assert not job_of(row, cfg).fsdp_no_sync
    assert job_of({**row, "source": "KempnerForge's MFU report"}, cfg).fsdp_no_sync
    argv = ["plan", "estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "64", "--seq-len", "8192",
            "--global-batch-size", "256", "--layout", "dp_shard=64,zero_stage=3,recompute=full", "--json"]
    grads = [json.loads(_cli(argv + flag, capsys)[1])["memory_gib"]["gradients"] for flag in ([], ["--fsdp-no-sync"])]
    assert grads[1] > 60 * grads[0]  # every gradient where a 64th was
    with pytest.raises(ValueError, match="leave out --fsdp-no-sync"):
        _cli(argv + ["--runtime", "meshlm", "--precision", "fp32", "--fsdp-no-sync"], capsys)


def test_nemo_automodel_rows_run_pytorch_fsdp2_not_nvidias_megatron_recipes():
    """A row naming NeMo Automodel is read as that trainer runs (stack "nemo-automodel", ahead of NeMo's Megatron
    recipes, whose fp8 parameters, bf16 gradients and TP overlap it does not share): FSDP2's copy-out, SDPA's FA2
    kernels, PyTorch's all-gather context parallelism, torch's non-reentrant checkpoint, bf16 reduction, compiled where
    it says torch.compile; the same row under "NeMo" alone is NVIDIA's recipe."""
    from meshlm.planner.published import job_of, layouts_of
    from meshlm.planner.published_rows import model_of
    from meshlm.planner.published_stacks import stack_of

    row = _row(model="Llama 3 8B", n_gpus="16", dp="8", cp="2", zero_fsdp="FSDP2 (fully_shard)", gpu="H100 80GB",
               seq_len="8192", gbs_seqs="16", recompute="full", notes="torch.compile",
               source="NVIDIA, NVIDIA-NeMo/Automodel docs/performance-summary.md (2026)")
    cfg = model_of(row)
    assert stack_of(row) == "nemo-automodel"
    job = job_of(row, cfg)
    assert job.fsdp_copy_out and job.flash_attention_2 and job.recompute_early_stop and job.fused_elementwise
    assert not job.grad_reduce_in_fp32 and not job.tp_comm_overlap and not job.cross_entropy_fusion
    assert {lo.cp_method for lo in layouts_of(row, cfg, "full")} == {"allgather"}
    recipe = {**row, "source": "NVIDIA NeMo performance docs (2026)"}
    assert stack_of(recipe) == "nemo" and job_of(recipe, cfg).cross_entropy_fusion
    assert not job_of({**row, "notes": ""}, cfg).fused_elementwise  # eager unless it names torch.compile


def test_a_legacy_megatron_gpt_with_rotary_positions_on_a_board_without_nvswitch():
    """The JUPITER suite's GPT 13B (group AR): Megatron-LM's legacy model runs its rotary embedding as torch ops (a
    GPT-style row gets them only where it names rotary positions), no SwiGLU, "selective" recomputing nothing on the
    flash path, the distributed optimizer exposed; its node cell's pair bandwidth ("100 GB/s each way": a 4-GPU A100
    board without NVSwitch) is the cluster's scale-up bandwidth, its 4 GPUs the scale-up domain, 200 Gb/s a GPU out."""
    from meshlm.planner.cost import estimate
    from meshlm.planner.published import job_of, layouts_of, recompute_as_run
    from meshlm.planner.published_rows import cluster_for, model_of
    from meshlm.planner.published_stacks import stack_of

    row = _row(model="GPT 13B (JUBE Megatron-LM benchmark)", layers="40", hidden="5120", heads="32", ffn="20480",
               vocab="50432", n_gpus="32", tp="2", pp="4", dp="4", sp="yes", gbs_seqs="1024", recompute="selective",
               zero_fsdp="Megatron-LM distributed optimizer", gpu="A100 SXM4 40GB (JUWELS Booster)",
               precision="fp16 (dynamic loss scaling)",
               node_nvlink="4 (JUWELS Booster: 4 A100 on NVLink3, each pair joined by 4 links, 100 GB/s each way)",
               internode_bw_per_gpu="200 Gb/s (4 x InfiniBand HDR200 per node of 4 GPUs)",
               source="FZJ-JSC/jubench-megatron-lm (2024): Megatron-LM f7727433 (2023), --transformer-impl local",
               notes="--use-flash-attn, --use-distributed-optimizer without --overlap-grad-reduce, "
                     "--position-embedding-type rope")
    cfg, cluster = model_of(row), cluster_for(row)
    assert stack_of(row) == "megatron-lm" and cfg.tie_embeddings and cfg.intermediate_size == 13696
    job = job_of(row, cfg)
    assert job.flash_attention and job.eager_ops == {"attention_layout", "rope"} and not job.dp_comm_overlap
    assert job_of({**row, "notes": "--use-flash-attn"}, cfg).eager_ops == {"attention_layout"}  # learned positions
    assert recompute_as_run("selective", row, job) == "none"
    assert (cluster.name, cluster.scaleup_size, cluster.scaleup_bw, cluster.scaleout_bw) == ("a100-40gb", 4, 100e9,
                                                                                             25e9)
    assert cluster_for({**row, "node_nvlink": "4 (nodes of 4 A100 on NVLink3)"}).scaleup_bw == 300e9
    # the pair's third of the GPU's links: the tp all-gathers and reduce-scatters take 2-3 times as long
    lo = next(iter(layouts_of(row, cfg, "none")))
    slow = estimate(cfg, cluster, job, lo).time_s["tp_comm"]
    fast = estimate(cfg, cluster_for({**row, "node_nvlink": "4"}), job, lo).time_s["tp_comm"]
    assert 2 < slow / fast < 3


def test_modalities_rows_run_fsdp2_eager_with_one_kernel_layernorms_on_leonardos_a100s():
    """Modalities' sweep on CINECA's Leonardo (group AS) is read as that trainer runs it: FSDP2's copy-out, SDPA's FA2
    kernels, eager (no torch.compile), bf16 reduce-scatters, and torch's LayerNorm as one bf16 kernel (fp32 norms cost
    MPT's rows and these nothing extra); its model name has no GPT in it (the trainer's "gpt2" variant is Llama-like:
    SwiGLU 11008, untied); the GPU cell names Leonardo's custom 64 GB A100 (the HBM2 part's bandwidth, its 64 GB) on
    nodes of 4 with 100 Gb/s a GPU."""
    from meshlm.planner.cluster import GiB, get_cluster
    from meshlm.planner.published import job_of
    from meshlm.planner.published_rows import cluster_for, cluster_of, model_of
    from meshlm.planner.published_stacks import stack_of

    row = _row(model="Modalities 6.1B Llama-like (the sweep's '8B' config)", layers="32", hidden="4096", heads="32",
               kv_heads="8", ffn="11008", vocab="50304", n_gpus="32", dp="32", zero_fsdp="FSDP2 (fully_shard)",
               gpu="A100 SXM4 64GB (Leonardo Booster)", node_nvlink="4 (Leonardo Booster: 4 A100 SXM4 64GB)",
               internode_bw_per_gpu="100 Gb/s (2 x dual-port HDR, 400 Gb/s per node of 4 GPUs)",
               source="Modalities/modalities throughput_analysis.ipynb (2025)", notes="no torch.compile")
    cfg, cluster = model_of(row), cluster_for(row)
    assert stack_of(row) == "modalities" and cfg.intermediate_size == 11008 and not cfg.tie_embeddings
    job = job_of(row, cfg)
    assert job.fsdp_copy_out and job.flash_attention_2 and not job.fused_elementwise
    assert not job.grad_reduce_in_fp32 and not job.fp32_norms
    other = {**row, "source": "a trainer of its own", "model": "Llama-like 6B"}
    assert stack_of(other) == "" and job_of(other, cfg).fp32_norms  # the Llama stacks' RMSNorm upcasts
    assert (cluster.name, cluster.hbm_bytes, cluster.hbm_bw) == ("a100-64gb", 64 * GiB, 1.555e12)
    assert (cluster.scaleup_size, cluster.scaleout_bw) == (4, 12.5e9)
    assert cluster_of("A100-SXM-64GB") == "a100-64gb" and cluster_of("A100 80GB") == "a100"
    leonardo = get_cluster("a100-64gb")  # the preset is Leonardo's node too: what `meshlm plan` gets without a row
    assert (leonardo.scaleup_size, leonardo.scaleout_bw) == (cluster.scaleup_size, cluster.scaleout_bw)
