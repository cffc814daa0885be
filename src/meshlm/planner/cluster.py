"""Cluster descriptions: GPU type, scale-up domain (NVLink) and scale-out network, plus `local`.

Responsible for: the preset clusters (public datasheet figures, dense, per GPU), the per-GPU-type
efficiency constants the cost model uses, and building the `local` cluster from the JSON file that
`meshlm plan calibrate` writes.
Not responsible for: any cost formula (see `cost.py`) or measuring anything (see `calibrate.py`).

Units: FLOP/s, bytes, bytes/s and seconds everywhere inside the planner. Bandwidths are per GPU and
per direction ("450 GB/s each way" for H100 NVLink); network figures are per GPU (one NIC per GPU).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshlm.planner.kernels import WEIGHT_ONLY_GEMM_FACTOR, k_scale

# Elements of K of fixed cost per output tile of a tensor-core GEMM (kernels.py), the GPU presets' `gemm_k_overhead`.
GEMM_K_OVERHEAD = 256.0

GiB = 2**30


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: str
    peak_flops: dict  # precision -> dense FLOP/s per GPU ("bf16", "fp8", "fp32")
    hbm_bytes: float  # capacity per GPU
    hbm_bw: float  # bytes/s per GPU
    scaleup_size: int  # GPUs per scale-up (NVLink) domain
    scaleup_bw: float  # bytes/s per GPU per direction inside the domain
    scaleout_bw: float  # bytes/s per GPU across domains
    scaleup_latency: float  # seconds per hop of a collective inside the domain
    scaleout_latency: float  # seconds per hop across domains
    # Achievable fractions (per GPU type, not per run): see PRESETS for the justification.
    matmul_efficiency: float  # of peak, for the matmuls of a transformer layer
    attention_efficiency: float  # of peak, fused causal attention forward + backward, on the FLOPs it runs
    link_efficiency: float  # of the link bandwidth, for large collectives (NCCL bus bandwidth)
    hbm_efficiency: float  # of the HBM bandwidth, for streaming elementwise kernels / decode
    reserved_bytes: float  # per GPU: CUDA context, NCCL, allocator pools that training cannot use
    # Attention runs at attention_efficiency * L / (L + this) for kernel calls over L query tokens:
    # FlashAttention's published curves rise like that with L0 ~ 256 (~0.8 of the long-sequence
    # rate at 1K tokens, ~0.97 at 8K); `local` measures its own.
    attention_block_overhead: float = 256.0
    # FlashAttention-2's fraction where it is below `attention_efficiency` (Job.flash_attention_2: stacks whose
    # kernel is FA2, e.g. PyTorch SDPA's flash backend); 0: the same as attention_efficiency. See PRESETS.
    fa2_attention_efficiency: float = 0.0
    # Fraction of the compute units a collective occupies while it overlaps compute (NCCL runs as
    # kernels on SMs), i.e. how much slower the overlapped compute runs. See PRESETS.
    comm_sm_fraction: float = 0.0
    # Streaming multiprocessors per GPU, as CUDA reports them (multi_processor_count): what vLLM's rule for cascade
    # attention weighs (serving_engine.vllm_cascades). 0: none -- AMD's parts (vLLM's ROCm attention backends do not
    # cascade) and a CPU. See PRESETS.
    sm_count: int = 0
    # Compute units the ranks of one scale-up domain share; 0 = every rank has its own (a GPU). On a
    # CPU host it is the core count: more ranks than cores time-share them, so each rank computes at
    # cores / ranks of the measured single-core rate, and a collective has no idle core to run on
    # while the others compute (see cost.estimate_layout).
    compute_slots: int = 0
    # Every scale-up domain on one host (an emulated cluster, `meshlm plan calibrate --emulated`): the ranks
    # of all domains share `compute_slots`, and the scale-out link is a shaped link measured as such (not
    # the host's memory copies), so core sharing slows only the scale-up link.
    host_shared_by_domains: bool = False
    # Collectives of a group spanning both tiers run as one flat ring over all its ranks (gloo), not
    # hierarchically (NCCL): see collectives.collective_time. Set for emulated clusters, which run gloo.
    flat_rings: bool = False
    # Seconds every training step costs beyond its FLOPs and bytes (the framework's fixed work: Python,
    # dispatch, the optimizer's per-tensor loops), counted with the optimizer. Measured on an emulated
    # cluster (calibrate.measure_step_overhead); 0 elsewhere, where it is small next to a step.
    step_overhead: float = 0.0
    # Elements of K of fixed cost per output tile of a GEMM (kernels.py: pipeline fill + epilogue of a
    # tiled tensor-core GEMM); 0 on `local`, whose measured matmul rate already is what its sizes get.
    gemm_k_overhead: float = GEMM_K_OVERHEAD
    # Power under training load, watts per GPU (see PRESETS): the GPU's board power (datasheet TDP; a
    # training job holds it near TDP), the rest of its server (CPUs, memory, NICs, fans, PSU losses: the
    # system's datasheet maximum less its GPUs, per GPU), and its share of the network (switches + optics).
    gpu_power_w: float = 0.0
    node_power_w: float = 0.0
    network_power_w: float = 0.0
    # Data-centre overhead (cooling, power conversion): facility power / IT power.
    pue: float = 1.0
    # meshlm's serving engine's host work (`calibrate_serving.measure_serving_host`): {"step_s", "layer_s", "seq_s",
    # "layer_seq_s"} seconds; empty where not measured (presets, older calibration files). The serving planner's
    # `meshlm` engine reads it (serving_engine.meshlm_engine).
    serving_host: dict = field(default_factory=dict)
    # Bytes/s at which a GEMM passes its weights apart from its FLOPs, where that pass adds to the FLOPs' time
    # instead of meeting it at the roofline's corner: a CPU BLAS packs the weights before it multiplies
    # (`calibrate_serving.measure_gemm_weight_pass`); 0: the roofline (GPUs stream the weights while they compute).
    # Read by the serving model, whose decode GEMMs have few rows (the training side's are large); with it, the
    # seconds each GEMM call adds to its weights' pass (`gemm_call_s`, the same measurement).
    gemm_weight_bw: float = 0.0
    gemm_call_s: float = 0.0
    # The same for a GEMM of one row where the BLAS streams the weights once without packing them (a matrix-vector
    # product); 0: one row is priced as the packed GEMM (files from before it was measured).
    gemv_weight_bw: float = 0.0
    gemv_call_s: float = 0.0
    # Per-collective fits that replace the link's default: {"scale-up" | "scale-out": {kind: (latency
    # per hop in s, achieved bandwidth in bytes/s[, seconds per call])}}, kind one of collectives.KINDS. The default for a
    # kind not listed is (the tier's latency, its bandwidth x link_efficiency). `local` fills it from
    # the fits `meshlm plan calibrate` measures for each collective.
    collective_fits: dict = field(default_factory=dict)
    # Share of `matmul_efficiency` a precision's GEMMs keep, where it differs from bf16's ({"fp8": 0.88}): the
    # ratio of the measured maximum achievable matmul FLOPS (fraction of each precision's peak) -- see PRESETS.
    # Read by the serving model (serving.py) and the training cost model (timing.layer_compute) alike.
    matmul_precision_factor: dict = field(default_factory=dict)
    # Share of the 16-bit large-GEMM rate that GEMMs of 4-bit weights and 16-bit activations (W4A16: the weights
    # dequantized in the kernel) reach: kernels.WEIGHT_ONLY_GEMM_FACTOR by default, Hopper's own (see PRESETS).
    # Read by the serving model.
    weight_only_gemm_factor: float = WEIGHT_ONLY_GEMM_FACTOR

    def matmul_rate(self, precision: str) -> float:
        """FLOP/s of a large transformer GEMM in `precision`: peak x matmul_efficiency x the precision's factor."""
        return self.peak(precision) * self.matmul_efficiency * self.matmul_precision_factor.get(precision, 1.0)

    def collective_fit(self, kind: str, tier: str) -> tuple[float, float]:
        """(latency per hop, bandwidth) of one collective kind on "scale-up" or "scale-out"."""
        fit = self.collective_fits.get(tier, {}).get(kind)
        if fit is not None:
            return float(fit[0]), float(fit[1])
        if tier == "scale-up":
            return self.scaleup_latency, self.scaleup_bw * self.link_efficiency
        return self.scaleout_latency, self.scaleout_bw * self.link_efficiency

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ValueError(f"precision={precision!r} is not known for cluster {self.name!r}; "
                             f"choose one of {sorted(self.peak_flops)}")
        return self.peak_flops[precision]

    def check_trains_in(self, precision: str) -> None:
        """Refuse training in a narrow precision the GPU has no tensor cores of: an fp8 entry no faster than bf16
        (A100's) prices a serving checkpoint's fp8 weights run at the 16-bit rate, which Transformer Engine does not
        train in."""
        self.peak(precision)
        if self.name == "local":  # measured: one matmul rate stands for every precision (calibrate.py)
            return
        if precision in ("fp8", "fp4") and self.peak_flops[precision] <= self.peak_flops.get("bf16", 0.0):
            raise ValueError(f"precision={precision!r}: {self.gpu} has no {precision} tensor cores to train in "
                             f"(its {precision} entry prices served {precision} weights at the bf16 rate): train in "
                             "bf16, or pick a cluster with them (Ada, Hopper or later)")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _gbit(x: float) -> float:
    return x * 1e9 / 8


# Efficiency constants, per GPU type (never per run):
#  * matmul_efficiency: the fraction of dense peak that well-shaped bf16 GEMMs of transformer sizes
#    reach in public cuBLAS/Megatron measurements. A100: ~250 of 312 TFLOP/s (0.80). Hopper and
#    Blackwell peaks assume boost clocks that a 700 W+ part does not hold under sustained GEMM load,
#    and their higher peaks are harder to feed; public H100 SXM bf16 GEMM measurements at transformer
#    shapes sustain ~600-650 of 989 TFLOP/s (0.62), and fp8 the same fraction of the fp8 peak (corrected by
#    `matmul_precision_factor`). Blackwell carries H100's 0.62 by the ratio of its Maximum Achievable Matmul FLOPS
#    fraction to H100's (Stas Bekman's MAMF table, ml-engineering compute/accelerator/README.md, best of a shape sweep:
#    H100 SXM 794.5 of 989 = 80.3%, B200 1745 of 2250 = 77.6%, GB200 1822 of 2500 = 72.9%): B200 0.62 x 77.6 / 80.3,
#    GB200 0.62 x 72.9 / 80.3 of its own, higher peak. This is the rate of a large GEMM; kernels.py lowers it for small K
#    (`gemm_k_overhead`, in 2-byte elements: fp8 pays twice as many) and bounds it by HBM for thin shapes. Attention has its own constant below.
#    (Set from these GEMM figures, not from any end-to-end training run.)
#  * attention_efficiency: fused causal attention (FlashAttention-class), forward + backward, counted
#    on the FLOPs the kernel runs (the unmasked half; backward 2.5x forward, as its authors count),
#    at long sequences (scaled down for short blocks by `attention_block_overhead`). A100: FlashAttention-2 reaches
#    ~190-200 of 312 TFLOP/s fwd+bwd causal at head dim 128 and 8-16K tokens (Dao 2023) -> 0.65.
#    H100: FlashAttention-2 reaches only ~1/3 of peak; FlashAttention-3 / cuDNN fused attention
#    ~600-650 forward and ~500 backward at long sequences (Shah et al. 2024), ~0.55 combined with the
#    1:2.5 weighting -> 0.55, the 2024-era kernel. B200: cuDNN 9.10.2's fused attention, measured by NVIDIA
#    (NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_bf16_training, f937055, 2025-06: Llama-3.1-405B heads, causal,
#    head dim 128, batch 1, PyTorch 2.8's SDPA): 1143-1205 TFLOP/s forward + backward at 16K-128K tokens, median
#    1150 of 2250 -> 0.51.
#    (From kernel benchmarks, not from any end-to-end run.)
#  * fa2_attention_efficiency: on Hopper FlashAttention-2 reaches "only 35% utilization" of the H100's peak
#    (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, Sec. 1) -> 0.35 on H100 / H200 / H800 (forward;
#    its backward is no faster). On A100 FA2 is the kernel attention_efficiency already rates (0: the same). On B200
#    FlashAttention-2 (PyTorch SDPA's flash backend; flash-attn 2.7.3 within 7% of it) reaches 348-364 TFLOP/s forward
#    + backward at 16K-128K tokens in the same NVIDIA benchmark, median 360 of 2250 -> 0.16.
#  * link_efficiency: NCCL bus bandwidth over the nominal link rate for large messages, ~0.8 on NVLink
#    and InfiniBand alike (e.g. ~360 of 450 GB/s on H100 NVLink; ~45 of 50 GB/s per 400G NIC is higher,
#    the common figure is used for both so the constant stays one number per GPU type).
#  * scaleup_latency: the time per hop of the ring the collectives are priced as (collectives.py: 2 (n - 1) hops for an
#    all-reduce), 5 us on A100, 4 us on Hopper and Blackwell. Not NCCL's bare latency: Azure's nccl-tests all-reduce on
#    8 GPUs of one node (Azure/AI-benchmarking-guide, Azure_Results: ND A100 v4 with NCCL 2.18.5, ND H200 v5 with
#    2.20.5; bus bandwidth from 1 KB to 8 GB) takes 42-45 us on A100 and 30-31 us on H200 up to 256 KB, i.e. 3.0 and 2.2
#    us per hop. Priced at those, both dev sets predict worse (training: fitted groups 4.9% -> 5.1%, held-out 8.9% ->
#    9.1%, AG 33% -> 34%; serving: TPOT 17.5% -> 21%, TTFT 24% -> 25%, throughput 11.6% -> 12.0%): the presets' values
#    carry what the stacks' collectives cost beyond nccl-tests' loop, so they stay. On MI300X the same harness's RCCL
#    curve (ND MI300X v5, RCCL 2.22.3: 45-51 us up to 64 KB, 82 us at 1 MB) is fitted best at 3.8-4.1 us per hop and
#    280-308 GB/s: its preset (Hopper's 4 us, RCCL's 317 GB/s) is that curve's (tests/test_planner_stacks.py).
#  * comm_sm_fraction: an overlapped collective is not free -- NCCL runs it as kernels holding one
#    SM per channel, and large collectives on NVSwitch/InfiniBand systems use ~16 channels, so
#    compute overlapped with them runs on 16 of the SMs fewer (A100 108 SMs, H100 132, B200 148).
#  * sm_count: NVIDIA's architecture whitepapers and datasheets: A100 108, H100 SXM 132 (H200, H800, GH200 and the
#    NVL parts the same die), H100 PCIe 114, L40S 142, L4 58, B200 and GB200 148, B300 and GB300 160, RTX PRO 6000
#    Blackwell 188 (the counts the comm_sm_fraction entries divide by).
#  * hbm_efficiency: STREAM-like kernels reach ~0.8-0.9 of the HBM datasheet bandwidth; 0.8 used. NVIDIA's own
#    memory-bound kernel benchmark agrees on Hopper and Blackwell: cuDNN's RMSNorm forward over transformer-sized
#    activations (NVIDIA/cudnn-frontend benchmark/norms/results, 2026-02, cuDNN 9.19) moves 3.71-3.85 TB/s on H200
#    (0.77-0.80 of 4.8) and 6.0-6.4 TB/s on GB200 (0.75-0.80 of 8.0).
#  * matmul_precision_factor: fp8 GEMMs reach a smaller fraction of their (doubled) peak than bf16 ones on Hopper.
#    Stas Bekman's "Maximum Achievable Matmul FLOPS" table (ml-engineering, compute/accelerator/README.md; torch
#    matmul / _scaled_mm, best of a shape sweep): H100 SXM bf16 80.3%, fp8 70.9%; H200 fp8 73.4% (bf16 as
#    H100); B200 bf16 77.6%, fp8 76.3%; GB200 bf16 72.9%, fp8 72.3%. The factor is fp8's fraction over bf16's
#    (H800: H100's die). No fp4 or MI300X fp8 measurement there. Blackwell's NVFP4 GEMMs, measured against bf16 ones
#    in one harness on one B200 (vLLM's benchmarks/kernels/bench_nvfp4_gemm.py, vllm-project/vllm PR #20578, 2025-07:
#    Llama-3.1-8B's N=6144 K=4096 at 8,192 and 16,384 tokens; CUTLASS NVFP4 without the activation-quantization
#    kernel, which engines fuse into the kernel before): 3779 / 3904 TFLOP/s against torch bf16's 1421 / 1360, i.e.
#    2.77x bf16's speed where the peaks say 4x; at that K (4096) the tiles' fixed cost takes 1.25x the time of fp4's
#    FLOPs and 1.06x bf16's (kernels.k_scale), so the large GEMMs run 3.25x bf16's -> fp4's factor 3.25 / 4 = 0.81 on
#    B200 and, its tensor cores the same, GB200. (The same harness's bf16 figures, 0.60-0.63 of 2250, bear out
#    B200's matmul_efficiency.)
#  * weight_only_gemm_factor: GEMMs of 4-bit weights with 16-bit activations (W4A16) at large row counts, as a share of
#    the bf16 large-GEMM rate (kernels.WEIGHT_ONLY_GEMM_FACTOR, 0.61, Marlin against torch's FP16 GEMM in one harness,
#    where no GPU of the part's own was measured). Hopper (H100, H200, H800, GH200) its own: vLLM's CUDA Marlin MoE
#    kernel, the baseline column of FlagGems PR #4350 (flagos-ai/FlagGems, 2026-06; its H100 table -- the PR tunes "H100
#    / full Hopper" and "H20 / reduced Hopper" apart, and these rates exceed an H20's 148 TFLOP/s peak): Mixtral's
#    experts (8 x 4096 x 14336, top 2; 7.05e8 FLOPs a token) at 4,096, 16,384 and 32,768 tokens in 9.91, 39.0 and 78.8
#    ms, i.e. 291-296 TFLOP/s, 0.48 of H100's bf16 rate here (989 x 0.62): Marlin issues Ampere's mma, not Hopper's
#    wgmma, "at best ~75% of peak" (vLLM PR #7174), and dequantizes in the same loop. Where vLLM later runs
#    triton_kernels' MXFP4 matmul on Hopper instead (its default since PR #28788), it measured that path slower
#    still end to end (PR #27523: gpt-oss-120b 1.58 s against Marlin's 1.17): the rate is an upper bound there.
# Power (watts per GPU), from the datasheets:
#  * A100 SXM 400 W; DGX A100 6.5 kW max for 8 GPUs -> (6500 - 8 x 400) / 8 = 412 W of server per GPU.
#  * H100 SXM 700 W (H200 the same); DGX H100 10.2 kW max -> (10200 - 5600) / 8 = 575 W per GPU.
#  * B200 1000 W; DGX B200 14.3 kW max -> (14300 - 8000) / 8 = 787 W per GPU.
#  * GB200 NVL72: 1200 W per Blackwell GPU (GB200 superchip configuration); the rack's ~120 kW (NVIDIA
#    GB200 NVL72 spec) less 72 x 1200 W leaves ~470 W per GPU for Grace CPUs, NVLink switch trays and fans.
#    Its GPU is rated above HGX B200's (NVIDIA GB200 NVL72 datasheet, per GPU, dense: bf16 2.5, fp8 5, fp4 10
#    PFLOP/s; 186 GB HBM3E at 8 TB/s; up to 1,200 W against HGX B200's 2.25 / 4.5 / 9 at up to 1,000 W).
#  * network: a two/three-tier InfiniBand NDR fat tree has ~3 switch ports and 2 transceivers per GPU
#    (QM9700: 64 ports, ~1.7 kW with its optics -> ~27 W per port; NDR OSFP transceivers ~15-17 W each):
#    ~3 x 27 + 2 x 16 = ~110 W per GPU (A100 HDR: the same topology, 100 W).
#  * PUE 1.2: a modern GPU data centre (hyperscalers report 1.1; the Uptime Institute's 2023 survey
#    average is 1.58); override with --pue.
# The measured figures several presets derive from (sources in the notes above): Bekman's MAMF fractions, %, of each
# part's own peak (bf16, fp8); H100's transformer-shape GEMM fraction; NVIDIA's B200 SDPA benchmark, TFLOP/s.
_MAMF_BF16 = {"H100": 80.3, "B200": 77.6, "GB200": 72.9, "B300": 78.6, "GH200": 83.8}
_MAMF_FP8 = {"H100": 70.9, "H200": 73.4, "B200": 76.3, "GB200": 72.3, "B300": 74.5, "GH200": 77.6}
# MI355X's bf16 MAMF in TFLOP/s (the table's later edition, torch 2.8 on ROCm 7.0.2: 1565, best of its sweep), taken
# against each CDNA4 part's own peak (the table divides by 2300; AMD's MI355X data sheet says 2.5 PFLOP/s).
_MI355X_MAMF_BF16_TFLOPS = 1565.0
_H100_MATMUL = 0.62
_H100_BF16 = 989e12  # dense bf16 FLOP/s (H100 SXM datasheet)
_B200_ATTENTION = {"cudnn": 1150, "fa2": 360}
# vLLM's bench_nvfp4_gemm.py on B200 (PR #20578), N=6144 K=4096 at 8,192 and 16,384 tokens, TFLOP/s: NVFP4 (no
# activation quantization) and torch bf16; Blackwell's fp4 peak is 4x its bf16 peak (B200 9 / 2.25, GB200 10 / 2.5).
# At that K the tiles' fixed cost (kernels.k_scale: 256 bf16 elements of K, four times as many fp4 ones) slows fp4
# more than bf16; taken out, the factor is of the large-GEMM rate, as matmul_efficiency is.
_B200_NVFP4_GEMM = {"nvfp4": (3778.8, 3904.3), "bf16": (1421.0, 1360.1), "k": 4096}
# vLLM's Marlin MoE on H100 (FlagGems PR #4350's baseline): Mixtral's experts, (tokens, milliseconds) at its three
# largest token counts, and the FLOPs of one token through them (top 2 of gate, up and down, 4096 x 14336 each).
_MARLIN_MOE_H100 = {"runs": ((4096, 9.909706), (16384, 38.999008), (32768, 78.78656)),
                    "flops_per_token": 2 * 2 * 3 * 4096 * 14336}


def _tiles_at(k: float, in_bytes: float) -> float:
    """The tiles' fixed-K slowdown of one GEMM of depth `k` (kernels.k_scale) at the presets' overhead."""
    return k_scale([(1.0, k)], k_overhead=GEMM_K_OVERHEAD, in_bytes=in_bytes)


_NVFP4_OVER_BF16 = sum(f / b for f, b in zip(_B200_NVFP4_GEMM["nvfp4"], _B200_NVFP4_GEMM["bf16"])) / 2  # 2.77x
_FP4_FACTOR = (_NVFP4_OVER_BF16 * _tiles_at(_B200_NVFP4_GEMM["k"], 0.5) / _tiles_at(_B200_NVFP4_GEMM["k"], 2.0)
               / 4)  # of the large-GEMM rate; the peaks' ratio is 4
_MARLIN_MOE_H100_TFLOPS = sum(n * _MARLIN_MOE_H100["flops_per_token"] / (ms * 1e-3)
                              for n, ms in _MARLIN_MOE_H100["runs"]) / len(_MARLIN_MOE_H100["runs"]) / 1e12  # 293
_HOPPER_WEIGHT_ONLY = _MARLIN_MOE_H100_TFLOPS * 1e12 / (_H100_BF16 * _H100_MATMUL)  # 0.48
_A100 = dict(gpu="A100-SXM-80G", peak_flops={"bf16": 312e12, "fp8": 312e12, "fp32": 19.5e12},
             hbm_bytes=80 * GiB, hbm_bw=2.0e12, scaleup_size=8, scaleup_bw=300e9, scaleout_bw=_gbit(200),
             scaleup_latency=5e-6, scaleout_latency=10e-6, matmul_efficiency=0.80, attention_efficiency=0.65, link_efficiency=0.8,
             hbm_efficiency=0.8, reserved_bytes=2 * GiB, comm_sm_fraction=16 / 108, sm_count=108,
             gpu_power_w=400.0, node_power_w=412.0, network_power_w=100.0, pue=1.2)
_H100 = dict(gpu="H100-SXM", peak_flops={"bf16": _H100_BF16, "fp8": 1979e12, "fp32": 67e12},
             hbm_bytes=80 * GiB, hbm_bw=3.35e12, scaleup_size=8, scaleup_bw=450e9, scaleout_bw=_gbit(400),
             scaleup_latency=4e-6, scaleout_latency=8e-6, matmul_efficiency=_H100_MATMUL, attention_efficiency=0.55,
             link_efficiency=0.8,
             hbm_efficiency=0.8, reserved_bytes=2 * GiB, comm_sm_fraction=16 / 132, sm_count=132,
             fa2_attention_efficiency=0.35,
             gpu_power_w=700.0, node_power_w=575.0, network_power_w=110.0, pue=1.2,
             matmul_precision_factor={"fp8": _MAMF_FP8["H100"] / _MAMF_BF16["H100"]},
             weight_only_gemm_factor=_HOPPER_WEIGHT_ONLY)
_B200 = dict(gpu="B200", peak_flops={"bf16": 2250e12, "fp8": 4500e12, "fp4": 9000e12, "fp32": 80e12},
             hbm_bytes=180 * GiB, hbm_bw=8.0e12, scaleup_size=8, scaleup_bw=900e9, scaleout_bw=_gbit(400),
             scaleup_latency=4e-6, scaleout_latency=8e-6,
             matmul_efficiency=_H100_MATMUL * _MAMF_BF16["B200"] / _MAMF_BF16["H100"],
             attention_efficiency=_B200_ATTENTION["cudnn"] / 2250,
             fa2_attention_efficiency=_B200_ATTENTION["fa2"] / 2250,
             link_efficiency=0.8,
             hbm_efficiency=0.8, reserved_bytes=2 * GiB, comm_sm_fraction=16 / 148, sm_count=148,
             gpu_power_w=1000.0, node_power_w=787.0, network_power_w=110.0, pue=1.2,
             matmul_precision_factor={"fp8": _MAMF_FP8["B200"] / _MAMF_BF16["B200"], "fp4": _FP4_FACTOR})

# Serving-side presets (the published serving rows need them), from the datasheets named:
#  * H800 SXM (NVIDIA H800 datasheet; DeepSeek-V3 report, arXiv:2412.19437, Sec. 3.1): an H100 SXM with NVLink cut
#    to 400 GB/s bidirectional (200 GB/s each way), InfiniBand CX7 400 Gb/s per GPU.
#  * MI300X (AMD Instinct MI300X data sheet): 192 GB HBM3 at 5.3 TB/s, dense 1307 TFLOP/s bf16, 2615 fp8;
#    7 Infinity Fabric links of 64 GB/s each way to the 7 peers of an 8-GPU platform (448 GB/s each way per
#    GPU, all-to-all wired, no switch); 750 W. Server and network power taken as the H100 system's (assumed,
#    no AMD system maximum published per GPU). matmul_efficiency 0.47: SemiAnalysis's public GEMM benchmark
#    ("MI300X vs H100 vs H200 Benchmark Part 1: Training", Dec 2024) measured ~620 of 1307 TFLOP/s bf16 at
#    transformer shapes on ROCm 6.x; the other efficiencies as Hopper's (assumed), except attention (below) and two
#    measured on Azure's ND MI300X v5 (Azure/AI-benchmarking-guide, Azure_Results/ND_MI300X_v5_results.md; ROCm
#    6.2-era HIP): hipBLASLt
#    FP8 GEMMs peak at 1159.5 TFLOP/s (44% of 2615) against 60.1% of the bf16 peak in the MAMF table (ROCm 6.2),
#    so fp8 keeps (1159.5 / 2615) / (781.9 / 1300) of matmul_efficiency; RCCL all-reduce bus bandwidth levels
#    off at 317 GB/s of the 448 (link_efficiency 0.71). Its BabelStream HBM figures (4.1-4.3 TB/s) confirm 0.8.
#    Attention measured, not assumed: ROCm's port of FlashAttention-2 (ROCm/flash-attention, Composable Kernel
#    backend) at head dim 128 and 16K tokens on MI300X, ROCm 6.3.2, its own benchmarks/benchmark_flash_attention.py:
#    223-232 TFLOP/s forward + backward, batch 1-8 (353 forward, 194 backward; ROCm/flash-attention issue #142,
#    2025-05-18) -> 229 of 1307 for attention_efficiency, taken for every stack's kernel (PyTorch SDPA's AOTriton,
#    vLLM's Triton / AITER kernels: assumed no faster, none measured here).
#  * MI325X (AMD Instinct MI325X data sheet): MI300X compute with 256 GB HBM3E at 6 TB/s, 1000 W (efficiencies as
#    MI300X, the same compute die: its bf16 MAMF, 60.4%, matches MI300X's on ROCm 6.2).
#  * H100 SXM with HBM2e (NHR@FAU's Helma nodes: 94 GiB at 2.41 TB/s, arXiv:2604.11391's testbed; torchao's roofline
#    model, torchao/testing/training/roofline_utils.py: "2.4 TB per second, custom to Meta's H100 variant"): the H100
#    SXM's compute and links with that memory (power as the 700 W part: no cap published with either source).
#  * B300 (NVIDIA HGX B300 / DGX B300 data sheets; Blackwell Ultra, 8 GPUs on NVLink 5): per GPU dense bf16 2.25, fp8 4.5,
#    fp4 13.5 PFLOP/s (the HGX table's 108 PFLOP/s dense fp4 over 8 GPUs; bf16 / fp8 as printed with sparsity, halved),
#    288 GB HBM3e at 8 TB/s, NVLink 1.8 TB/s (900 GB/s each way), one ConnectX-8 800 Gb/s NIC per GPU, 1,100 W; 160 SMs.
#    Its GEMMs measured (Bekman's MAMF table, later edition: bf16 1769 of 2250 = 78.6%, fp8 3353 of 4500 = 74.5%), carried
#    from H100 as B200's are; attention at B200's measured rates times the two parts' MAMF ratio (as GB200's); fp4's
#    factor and the server's power B200's (assumed: none measured here).
#  * GB300 NVL72 (NVIDIA GB300 NVL72 data sheet): 72 Blackwell Ultra GPUs on one NVLink domain, per GPU dense bf16 2.5,
#    fp8 5, fp4 15 PFLOP/s (1,080 PFLOP/s dense fp4 over 72), 288 GB HBM3e at 8 TB/s (576 TB/s over 72), 1.8 TB/s NVLink,
#    ConnectX-8 800 Gb/s per GPU, 1,400 W. No GB300 GEMM or attention measured: GB200's (same peaks but fp4) assumed, and
#    GB200 NVL72's rack share per GPU.
#  * MI355X (AMD Instinct MI355X data sheet; CDNA4, 8 GPUs per platform): 288 GB HBM3E at 8 TB/s; dense bf16 2.5, fp8 5.0,
#    MXFP6 / MXFP4 10.1 PFLOP/s (2516.6 / 5033 / 10066 TFLOP/s); 7 Infinity Fabric links of 153.6 GB/s (76.8 GB/s each way)
#    to the 7 peers; 1,400 W; 256 CUs. Its GEMMs measured (Bekman's MAMF table: bf16 1565 TFLOP/s, 62.2% of 2516.6),
#    carried from H100 as Blackwell's are (rather than MI300X's SemiAnalysis figure: MI355X has no such measurement).
#    Everything else as MI300X's (assumed, none measured here): fp8's factor (fp4 keeps it too), RCCL's link fraction,
#    ROCm FlashAttention's rate scaled by the two parts' GEMM rates, the server's power.
#  * MI350X (AMD Instinct MI350X data sheet): the MI355X's silicon at 2.2 GHz against 2.4 and 1,000 W -- dense bf16 2.3,
#    fp8 4.6, fp4 9.2 PFLOP/s (2307 / 4614 / 9228 TFLOP/s), the same memory and links; MI355X's fractions (assumed).
#  * H100 PCIe, H100 NVL, H200 NVL (NVIDIA H100 / H200 data sheets; dense, the sheets' sparse figures halved): the
#    Hopper die at PCIe-card power -- H100 PCIe 756 bf16 / 1513 fp8 TFLOP/s, 80 GB HBM2e at 2.0 TB/s, 350 W; H100 NVL
#    835 / 1671, 94 GB HBM3 at 3.9 TB/s, 400 W; H200 NVL 835 / 1671, 141 GB HBM3e at 4.8 TB/s, 600 W. No NVSwitch:
#    NVLink bridges join 2 cards (H100: 600 GB/s, 300 each way) or 4 (H200 NVL: 900 GB/s, 450 each way); the rest
#    of a server and the network beyond them as H100's scale-out (a 400 Gb/s NIC per GPU; PCIe Gen5's 64 GB/s each
#    way inside the server is no slower). Efficiencies as the SXM part's (assumed: the same die; no measurement of
#    these cards here).
#  * RTX PRO 6000 Blackwell Server Edition (NVIDIA data sheet): 96 GB GDDR7 at 1.6 TB/s; 4 PFLOP/s fp4 with
#    sparsity (2 dense), fp8 1 dense, bf16 0.5 dense; no NVLink: PCIe Gen5 x16, 64 GB/s each way; 600 W.
#  * A100 PCIe (NVIDIA A100 data sheet): the SXM part's peaks at 300 W (80 GB HBM2e at 1,935 GB/s; 40 GB: 1,555 GB/s,
#    250 W); an NVLink bridge joins 2 cards (600 GB/s, 300 each way). Its GEMMs measured: Bekman's MAMF table, bf16
#    252.9 of 312 (81.1%) against the SXM part's 271.2 (86.9%) -> the SXM part's 0.80 times that ratio.
#  * GH200 (Grace Hopper superchip): the H100's compute with 144 GB HBM3e at 4.9 TB/s (NVIDIA GH200 data sheet) or, the
#    first version, 96 GB HBM3 at 4.0 TB/s (Bekman's memory table lists both); its GEMMs measured (Bekman's MAMF table:
#    bf16 828.6 of 989 = 83.8%, fp8 1535 of 1979 = 77.6%, "900W 141GiB HBM3e version") and carried from H100's 0.62 as
#    Blackwell's are, the 96 GB version at the same (the same die and module power: assumed); 900 W (that
#    measurement's module); NVLink 4 between the two superchips of an NVL2 pair (450 GB/s each way), beyond as H100's.
#  * L40S and L4 (NVIDIA L40S / L4 data sheets; Ada Lovelace, PCIe Gen4 x16 cards without NVLink: 32 GB/s each way,
#    peer traffic through the PCIe switches of a server of 8): L40S 48 GB GDDR6 at 864 GB/s, dense bf16 362, fp8 733,
#    fp32 91.6 TFLOP/s (the sheet's sparse figures halved; Bekman's table lists the same), 350 W, 142 SMs; L4 24 GB
#    GDDR6 at 300 GB/s, dense bf16 121, fp8 242.5, fp32 30.3 TFLOP/s, 72 W, 58 SMs. No GEMM, attention or NCCL
#    measurement of either here: the A100's fractions (the same generation of tensor-core instructions, mma.sync
#    without Hopper's wgmma / TMA) and fp8 at bf16's share, marked assumed; NCCL rings over PCIe at 4 channels.
_MI300X = dict(_H100, gpu="MI300X", peak_flops={"bf16": 1307e12, "fp8": 2615e12, "fp32": 163e12},
               hbm_bytes=192 * GiB, hbm_bw=5.3e12, scaleup_bw=448e9, comm_sm_fraction=16 / 304, sm_count=0,
               attention_efficiency=229 / 1307, fa2_attention_efficiency=0.0, gpu_power_w=750.0,
               matmul_efficiency=0.47, matmul_precision_factor={"fp8": (1159.5 / 2615) / (781.9 / 1300)},
               link_efficiency=317 / 448, weight_only_gemm_factor=WEIGHT_ONLY_GEMM_FACTOR)

# Bekman's MAMF table, bf16 (the A100 PCIe and SXM parts' measured fractions of the same 312 TFLOP/s peak).
_A100_PCIE_MATMUL = _A100["matmul_efficiency"] * 81.1 / 86.9
_A100_PCIE = dict(_A100, gpu="A100-PCIe-80G", hbm_bw=1.935e12, scaleup_size=2, gpu_power_w=300.0,
                  matmul_efficiency=_A100_PCIE_MATMUL)
_GH200 = dict(_H100, gpu="GH200", hbm_bytes=144 * GiB, hbm_bw=4.9e12, scaleup_size=2, gpu_power_w=900.0,
              matmul_efficiency=_H100_MATMUL * _MAMF_BF16["GH200"] / _MAMF_BF16["H100"],
              matmul_precision_factor={"fp8": _MAMF_FP8["GH200"] / _MAMF_BF16["GH200"]})
_ADA = dict(_A100, scaleup_size=8, scaleup_bw=32e9)  # efficiencies assumed (above)
_L40S = dict(_ADA, gpu="L40S", peak_flops={"bf16": 362e12, "fp8": 733e12, "fp32": 91.6e12}, hbm_bytes=48 * GiB,
             hbm_bw=864e9, comm_sm_fraction=4 / 142, sm_count=142, gpu_power_w=350.0)
_L4 = dict(_ADA, gpu="L4", peak_flops={"bf16": 121e12, "fp8": 242.5e12, "fp32": 30.3e12}, hbm_bytes=24 * GiB,
           hbm_bw=300e9, comm_sm_fraction=4 / 58, sm_count=58, gpu_power_w=72.0)

_B300 = dict(_B200, gpu="B300", peak_flops={"bf16": 2250e12, "fp8": 4500e12, "fp4": 13500e12, "fp32": 80e12},
             hbm_bytes=288 * GiB, scaleout_bw=_gbit(800), comm_sm_fraction=16 / 160, sm_count=160, gpu_power_w=1100.0,
             matmul_efficiency=_H100_MATMUL * _MAMF_BF16["B300"] / _MAMF_BF16["H100"],
             attention_efficiency=_B200_ATTENTION["cudnn"] / 2250 * _MAMF_BF16["B300"] / _MAMF_BF16["B200"],
             fa2_attention_efficiency=_B200_ATTENTION["fa2"] / 2250 * _MAMF_BF16["B300"] / _MAMF_BF16["B200"],
             matmul_precision_factor={"fp8": _MAMF_FP8["B300"] / _MAMF_BF16["B300"], "fp4": _FP4_FACTOR})
_MI355X_PEAK = {"bf16": 2516.6e12, "fp8": 5033e12, "fp4": 10066e12, "fp32": 157.3e12}
_MI355X_MATMUL = _H100_MATMUL * (_MI355X_MAMF_BF16_TFLOPS * 1e12 / _MI355X_PEAK["bf16"]) / (_MAMF_BF16["H100"] / 100)
_MI355X = dict(_MI300X, gpu="MI355X", peak_flops=_MI355X_PEAK, hbm_bytes=288 * GiB, hbm_bw=8.0e12, scaleup_bw=7 * 76.8e9,
               comm_sm_fraction=16 / 256, gpu_power_w=1400.0, matmul_efficiency=_MI355X_MATMUL,
               # MI300X's measured fraction of peak, scaled as the two parts' GEMM fractions are
               attention_efficiency=_MI300X["attention_efficiency"] * _MI355X_MATMUL / _MI300X["matmul_efficiency"],
               matmul_precision_factor={"fp8": _MI300X["matmul_precision_factor"]["fp8"],
                                        "fp4": _MI300X["matmul_precision_factor"]["fp8"]})

# GB200's attention: B200's measured rates (no GB200 one here) times the two parts' MAMF ratio, 1822 / 1745.
_GB200 = dict(_B200, gpu="GB200 (NVL72)", scaleup_size=72,
              peak_flops={"bf16": 2500e12, "fp8": 5000e12, "fp4": 10000e12, "fp32": 80e12}, hbm_bytes=186 * GiB,
              matmul_efficiency=_H100_MATMUL * _MAMF_BF16["GB200"] / _MAMF_BF16["H100"],
              attention_efficiency=_B200_ATTENTION["cudnn"] / 2500 * 1822 / 1745,
              fa2_attention_efficiency=_B200_ATTENTION["fa2"] / 2500 * 1822 / 1745,
              gpu_power_w=1200.0, node_power_w=470.0,
              matmul_precision_factor={"fp8": _MAMF_FP8["GB200"] / _MAMF_BF16["GB200"], "fp4": _FP4_FACTOR})

PRESETS: dict[str, Cluster] = {
    "a100": Cluster(name="a100", **_A100),
    # A100 SXM 40GB (NVIDIA A100 datasheet): 40 GB HBM2 at 1555 GB/s, otherwise the 80 GB part.
    "a100-40gb": Cluster(name="a100-40gb", **{**_A100, "gpu": "A100-SXM-40G", "hbm_bytes": 40 * GiB, "hbm_bw": 1.555e12}),
    # NVIDIA's custom A100 64GB, as CINECA's Leonardo Booster has it (its system page: "4x NVIDIA custom Ampere A100 GPU
    # 64 GB HBM2" and "2x dual-port HDR network interface (400 Gbps aggregated)" a node): nodes of 4 at 100 Gb/s a GPU;
    # the HBM bandwidth is not published, the HBM2 part's (the 40 GB one's) taken; otherwise the 80 GB part.
    "a100-64gb": Cluster(name="a100-64gb", **{**_A100, "gpu": "A100-SXM-64G", "hbm_bytes": 64 * GiB, "hbm_bw": 1.555e12,
                                               "scaleup_size": 4, "scaleout_bw": _gbit(100)}),
    "h100": Cluster(name="h100", **_H100),
    "h100-hbm2e": Cluster(name="h100-hbm2e", **{**_H100, "gpu": "H100-SXM (HBM2e)", "hbm_bytes": 94 * GiB,
                                                 "hbm_bw": 2.41e12}),
    "h200": Cluster(name="h200", **{**_H100, "gpu": "H200", "hbm_bytes": 141 * GiB, "hbm_bw": 4.8e12,
                                     "matmul_precision_factor": {"fp8": _MAMF_FP8["H200"] / _MAMF_BF16["H100"]}}),
    "h100-pcie": Cluster(name="h100-pcie", **{**_H100, "gpu": "H100 PCIe", "peak_flops": {"bf16": 756e12,
                                                                                          "fp8": 1513e12,
                                                                                          "fp32": 51e12},
                                               "hbm_bw": 2.0e12, "scaleup_size": 2, "scaleup_bw": 300e9,
                                               "comm_sm_fraction": 16 / 114, "sm_count": 114,
                                               "gpu_power_w": 350.0}),
    "h100-nvl": Cluster(name="h100-nvl", **{**_H100, "gpu": "H100 NVL", "peak_flops": {"bf16": 835e12, "fp8": 1671e12,
                                                                                      "fp32": 60e12},
                                             "hbm_bytes": 94 * GiB, "hbm_bw": 3.9e12, "scaleup_size": 2,
                                             "scaleup_bw": 300e9, "gpu_power_w": 400.0}),
    "h200-nvl": Cluster(name="h200-nvl", **{**_H100, "gpu": "H200 NVL", "peak_flops": {"bf16": 835e12, "fp8": 1671e12,
                                                                                      "fp32": 60e12},
                                             "hbm_bytes": 141 * GiB, "hbm_bw": 4.8e12, "scaleup_size": 4,
                                             "scaleup_bw": 450e9, "gpu_power_w": 600.0,
                                             "matmul_precision_factor": {"fp8": _MAMF_FP8["H200"] / _MAMF_BF16["H100"]}}),
    "a100-pcie": Cluster(name="a100-pcie", **_A100_PCIE),
    "a100-pcie-40gb": Cluster(name="a100-pcie-40gb", **{**_A100_PCIE, "gpu": "A100-PCIe-40G", "hbm_bytes": 40 * GiB,
                                                         "hbm_bw": 1.555e12, "gpu_power_w": 250.0}),
    "l40s": Cluster(name="l40s", **_L40S),
    "l4": Cluster(name="l4", **_L4),
    "gh200": Cluster(name="gh200", **_GH200),
    "gh200-96gb": Cluster(name="gh200-96gb", **{**_GH200, "gpu": "GH200 (96 GB)", "hbm_bytes": 96 * GiB,
                                                 "hbm_bw": 4.0e12}),
    "b200": Cluster(name="b200", **_B200),
    "h800": Cluster(name="h800", **{**_H100, "gpu": "H800-SXM", "scaleup_bw": 200e9}),
    # A800 SXM4 80GB (NVIDIA A800 datasheet): the A100 SXM's die and memory with NVLink cut to 400 GB/s
    # bidirectional (200 GB/s each way), as H800 is to H100.
    "a800": Cluster(name="a800", **{**_A100, "gpu": "A800-SXM-80G", "scaleup_bw": 200e9}),
    "mi300x": Cluster(name="mi300x", **_MI300X),
    "mi325x": Cluster(name="mi325x", **{**_MI300X, "gpu": "MI325X", "hbm_bytes": 256 * GiB, "hbm_bw": 6.0e12,
                                       "gpu_power_w": 1000.0}),
    "rtx-pro-6000": Cluster(name="rtx-pro-6000", **{**_B200, "gpu": "RTX PRO 6000 Blackwell Server",
                                                   "peak_flops": {"bf16": 500e12, "fp8": 1000e12, "fp4": 2000e12,
                                                                  "fp32": 125e12},
                                                   "hbm_bytes": 96 * GiB, "hbm_bw": 1.6e12, "scaleup_bw": 64e9,
                                                   "comm_sm_fraction": 16 / 188, "sm_count": 188,
                                                   "gpu_power_w": 600.0,
                                                   # its own die (sm120): no GEMM or attention measured here,
                                                   # Hopper's fractions assumed, not B200's
                                                   "matmul_efficiency": _H100_MATMUL, "attention_efficiency": 0.55,
                                                   "fa2_attention_efficiency": 0.0,
                                                   "matmul_precision_factor": {}}),
    "gb200-nvl72": Cluster(name="gb200-nvl72", **_GB200),
    "b300": Cluster(name="b300", **_B300),
    "gb300-nvl72": Cluster(name="gb300-nvl72", **{**_GB200, "gpu": "GB300 (NVL72)",
                                                 "peak_flops": {**_GB200["peak_flops"], "fp4": 15000e12},
                                                 "hbm_bytes": 288 * GiB, "scaleout_bw": _gbit(800),
                                                 "comm_sm_fraction": 16 / 160, "sm_count": 160,
                                                 "gpu_power_w": 1400.0}),
    "mi355x": Cluster(name="mi355x", **_MI355X),
    "mi350x": Cluster(name="mi350x", **{**_MI355X, "gpu": "MI350X", "gpu_power_w": 1000.0,
                                       "peak_flops": {"bf16": 2307e12, "fp8": 4614e12, "fp4": 9228e12,
                                                      "fp32": 144.2e12}}),
}


def get_cluster(name: str, *, calibration: str | Path | None = None) -> Cluster:
    """A preset by name, or `local` from a calibration file (default `plan_calibration.json`)."""
    if name == "local":
        return local_cluster(calibration or "plan_calibration.json")
    if name not in PRESETS:
        raise ValueError(f"cluster={name!r} is unknown; choose one of {sorted(PRESETS) + ['local']}")
    return PRESETS[name]


def local_cluster(path: str | Path) -> Cluster:
    """The current machine, from what `meshlm plan calibrate` measured.

    Measured numbers are achieved rates, so every efficiency is 1. All ranks share one host, so the
    scale-up domain is the whole world and both links are the measured collective bandwidth. The
    matmul rate and memory bandwidth were measured on one core; the recorded core count tells the
    cost model how many ranks can run at that rate at once (older files without it: no sharing).
    A file from `meshlm plan calibrate --emulated` describes two tiers instead: a node's ranks are one
    scale-up domain (their fits), the nodes are joined by the measured scale-out link, and the ranks of
    every node share the host's cores.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"calibration file {str(path)!r} does not exist; run `meshlm plan calibrate "
                         f"--out {path}` first, or pick a preset cluster")
    try:
        data = json.loads(path.read_text())
        flops = float(data["matmul_flops"])
        bw = float(data["link"]["bandwidth"])
        lat = float(data["link"]["latency"])
        mem_bw = float(data.get("memory_bandwidth", 10e9))
        mem = float(data.get("memory_bytes", 16 * GiB))
    except KeyError as e:
        raise ValueError(f"calibration file {str(path)!r} lacks {e}; rerun `meshlm plan calibrate`") from None
    except (TypeError, ValueError, AttributeError) as e:  # not JSON, not an object, a field of the wrong type
        raise ValueError(f"calibration file {str(path)!r} cannot be read ({e}); rerun `meshlm plan calibrate`") from None
    bad = [f"{name}={value:g}" for name, value in (("matmul_flops", flops), ("link.bandwidth", bw),
                                                   ("memory_bandwidth", mem_bw), ("memory_bytes", mem))
           if not (math.isfinite(value) and value > 0)] + ([] if math.isfinite(lat) and lat >= 0 else [f"link.latency={lat:g}"])
    if bad:
        raise ValueError(f"calibration file {str(path)!r} holds {', '.join(bad)}, which no machine measures; rerun "
                         "`meshlm plan calibrate`")
    fits = _tier_fits(data)
    out_fits, out_bw, out_lat, domain, shared = fits, bw, lat, int(data.get("world_size_max", 1 << 20)), False
    emulated = data.get("emulated")
    if emulated:  # two tiers (calibrate_emulated): a node's ranks are a scale-up domain; nodes share the host
        try:
            out = data["scale_out"]
            out_fits, out_bw, out_lat = _tier_fits(out), float(out["link"]["bandwidth"]), float(out["link"]["latency"])
            domain, shared = int(emulated["procs_per_node"]), True
        except (KeyError, TypeError) as e:
            raise ValueError(f"calibration file {str(path)!r} lacks {e}; rerun `meshlm plan calibrate --emulated`") from None
    # An emulated cluster's ring over all its ranks, where measured: see collectives.collective_time.
    flat = {"flat": _tier_fits(data["flat"])} if emulated and data.get("flat") else {}
    return Cluster(name="local", gpu=data.get("device", "cpu"),
                   collective_fits={"scale-up": fits, "scale-out": out_fits, **flat},
                   peak_flops={"fp32": flops, "bf16": flops, "fp8": flops}, hbm_bytes=mem, hbm_bw=mem_bw,
                   scaleup_size=domain, scaleup_bw=bw, scaleout_bw=out_bw, host_shared_by_domains=shared,
                   flat_rings=shared,
                   scaleup_latency=lat, scaleout_latency=out_lat, matmul_efficiency=1.0,
                   attention_efficiency=min(1.0, float(data.get("attention_flops", flops)) / flops),
                   attention_block_overhead=float(data.get("attention_block_overhead", 0.0)), link_efficiency=1.0,
                   hbm_efficiency=1.0, reserved_bytes=0.0, compute_slots=int(data.get("cpu_cores", 0)),
                   step_overhead=float(data.get("step_overhead_s", 0.0)) if emulated else 0.0,
                   gemm_k_overhead=0.0, serving_host=_serving_host(data, path),
                   gemm_weight_bw=float(data.get("gemm_weight_bandwidth", 0.0)),
                   gemm_call_s=float(data.get("gemm_call_s", 0.0)),
                   gemv_weight_bw=float(data.get("gemv_weight_bandwidth", 0.0)),
                   gemv_call_s=float(data.get("gemv_call_s", 0.0)))


def _serving_host(data: dict, path: Path) -> dict:
    """The serving engine's measured host seconds ({} in a file from before `measure_serving_host`)."""
    host = data.get("serving_host")
    if not host:
        return {}
    try:
        return {k: float(host[k]) for k in ("step_s", "layer_s", "seq_s", "layer_seq_s")}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"calibration file {str(path)!r}: serving_host lacks {e}; rerun `meshlm plan calibrate`") from None


def _tier_fits(data: dict) -> dict:
    """Each collective's own fit (calibrate.py fits `t = latency + factor * bytes / bandwidth` at its world
    size, factor the ring's), its latency spread over the hops collectives.collective_time counts there."""
    n = max(2, int(data.get("world_size", 2)))
    hops = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1, "p2p": 1}
    # A third element, where measured (`calibrate_emulated`): seconds per call, whatever the ring's size
    # (collectives.collective_time adds it).
    return {kind: (float(f["latency"]) / hops[kind], float(f["bandwidth"]),
                   *([float(f["call_overhead"])] if "call_overhead" in f else []))
            for kind, f in (data.get("collectives") or {}).items() if kind in hops}


def with_overrides(cluster: Cluster, **kw) -> Cluster:
    return replace(cluster, **kw)


def slowed_links(cluster: Cluster, factor: float) -> Cluster:
    """`cluster` with every link (defaults and per-collective fits) `factor` times slower in bandwidth:
    ranks time-sharing the cores of one host share its memory copies too (cost.estimate_layout). On an
    emulated cluster only the scale-up tier is memory copies; its scale-out link is shaped, measured as is."""
    tiers = ("scale-up",) if cluster.host_shared_by_domains else ("scale-up", "scale-out")
    fits = {tier: {k: (fit[0], fit[1] / factor if tier in tiers else fit[1], *fit[2:]) for k, fit in kinds.items()}
            for tier, kinds in cluster.collective_fits.items()}
    out_factor = factor if "scale-out" in tiers else 1.0
    return replace(cluster, scaleup_bw=cluster.scaleup_bw / factor, scaleout_bw=cluster.scaleout_bw / out_factor,
                   collective_fits=fits)


def ranks_per_host(cluster: Cluster, ranks: int) -> int:
    """How many of `ranks` share one host's compute units: a scale-up domain's, or all of them on an emulated
    cluster, whose domains are the one host."""
    return ranks if cluster.host_shared_by_domains else min(ranks, cluster.scaleup_size)


def time_shared(cluster: Cluster, ranks: int) -> tuple[Cluster, float]:
    """`cluster` as one of `ranks` ranks sees it, and how many ranks share each compute unit (>= 1): on a CPU
    host (`Cluster.compute_slots`) ranks beyond its cores each compute and stream memory at slots / ranks of
    one core's rate, and so copy the collectives' bytes (`slowed_links`); GPUs never share (1)."""
    if not cluster.compute_slots:
        return cluster, 1.0
    share = max(1.0, ranks_per_host(cluster, ranks) / cluster.compute_slots)
    return (slowed_links(cluster, share) if share > 1 else cluster), share
