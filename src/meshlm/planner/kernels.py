"""Kernel times on one GPU: the GEMMs of a layer by shape, and the memory-bound work around them.

Responsible for: the matrix shapes one rank multiplies in an (average) decoder layer and the head under a
given tp / ep (`layer_gemms`), the time of one GEMM from its shape (`gemm_time`), the share of the 16-bit rate
weight-only 4-bit GEMMs were measured at (`WEIGHT_ONLY_GEMM_FACTOR`, the default of `Cluster.weight_only_gemm_factor`),
and the HBM traffic of fp8 casting (`fp8_cast_bytes`) and of a MoE layer's token permutations (`moe_dispatch_elements`).
Not responsible for: attention (priced in `cost.py` as its own fused kernel), communication
(`collectives.py`), or deciding what runs when (`cost.py`).

GEMM model. A GEMM of M x K times K x N runs at the cluster's large-GEMM rate (`peak x matmul_efficiency`,
cited in cluster.py) scaled by K / (K + k_overhead), and never faster than its operands stream
through HBM (roofline: max of the two). The K term is the fixed per-output-tile cost of a tiled GEMM:
each thread block fills its multi-stage shared-memory pipeline before the first tensor-core instruction
and drains an epilogue after the last (NVIDIA, "Matrix Multiplication Background User's Guide",
deeplearning performance docs: tile and pipeline overheads make small-K and thin GEMMs run below peak;
Anthony et al. 2024, "The Case for Co-Designing Model Architectures with Hardware", arXiv:2401.14489,
measure the same rise of GEMM throughput with the hidden size on A100/H100). CUTLASS/cuBLAS Ampere and
Hopper kernels use K-steps of 32-64 with 3-4 stages plus an epilogue about one stage long: ~4 x 64 = 256
elements of K of fixed cost per tile. So thin tensor-parallel shards (K = h/tp) and small experts run
below the rate of a big square GEMM; the backward's weight-gradient GEMM (K = tokens) runs near it. The
constant is `Cluster.gemm_k_overhead` (256 on the GPU presets), in 2-byte elements: a stage holds a
fixed number of bytes of K (128 B per row), so 1-byte fp8 inputs take twice as many elements per stage
(CUTLASS's Hopper GEMMs tile K by 64 bf16 or 128 fp8 elements: 128 B either way) and the same fixed time is
512 fp8 elements of K at the fp8 rate.
"""

from __future__ import annotations

from meshlm.config import ModelConfig
from meshlm.planner.mla import MLA, forward_gemms



# Weight-only 4-bit GEMMs (W4A16: 4-bit weights dequantized inside the kernel, 16-bit activations -- gpt-oss's MXFP4
# experts on Ampere and Hopper, AWQ / GPTQ checkpoints) run, once compute-bound, at a share of the 16-bit large-GEMM
# rate (`Cluster.weight_only_gemm_factor`; this is the default, the Hopper presets' own is cited in cluster.py).
# Marlin, the W4A16 kernel vLLM runs there (vLLM's gpt-oss recipe for 0.10-0.11: "Marlin MXFP4 MoE" on Ampere and
# Hopper; quantization/mxfp4.py picks it below SM90 and wherever triton_kernels is not installed), dequantizes in its
# main loop on Ampere's mma instructions and past 64 rows runs its 64-row kernel again for each further 64 (its
# author, IST-DASLab/marlin issue #2), so it stops gaining from about 128 rows where the 16-bit GEMM keeps gaining.
# Measured in one harness (Marlin's bench.py: its kernel against torch.matmul in FP16 on the same shape, group size
# 128; vllm-project/vllm PR #2497, a comment whose GPU is not named): 141 TFLOP/s from 128 to 4,000 rows, "speedup"
# 1.01 at 128, 0.66 at 1,024, 0.60 at 2,048 and 0.61 at 4,000 rows -- the last, the large-GEMM regime the rate
# stands for, taken. Where a 16-bit GEMM is bound by its weights' bytes the roofline keeps W4A16's quarter of them.
WEIGHT_ONLY_GEMM_FACTOR = 0.61


def k_fixed(k_overhead: float, in_bytes: float) -> float:
    """Elements of K of fixed cost per output tile for inputs of `in_bytes` bytes: `k_overhead` 2-byte ones, twice
    as many 1-byte (fp8) ones, four times as many half-byte (fp4) ones -- a stage holds a fixed number of bytes of K
    (module docstring)."""
    return k_overhead * max(1.0, 2.0 / in_bytes)


def k_scale(pieces, *, k_overhead: float, in_bytes: float) -> float:
    """How much longer than at the large-GEMM rate a set of GEMMs takes, their tiles' fixed K cost included:
    the FLOP-weighted mean of (K + k_fixed) / K over `pieces`, (FLOPs or any weight proportional to them, K) pairs
    (1.0 for none, or without a K overhead)."""
    pieces = [(f, k) for f, k in pieces if f > 0 and k > 0]
    total = sum(f for f, _ in pieces)
    if not total or not k_overhead:
        return 1.0
    fixed = k_fixed(k_overhead, in_bytes)
    return sum(f * (k + fixed) / k for f, k in pieces) / total


def gemm_time(m: float, n: float, k: float, *, rate: float, hbm_bw: float, in_bytes: float,
              out_bytes: float = 2.0, k_overhead: float = 0.0) -> float:
    """Seconds for C[m, n] = A[m, k] @ B[k, n] at `rate` FLOP/s for large shapes, `k_overhead` 2-byte
    elements of K of fixed cost per output tile (`Cluster.gemm_k_overhead`; `k_fixed`)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    compute = 2.0 * m * n * k * k_scale([(1.0, k)], k_overhead=k_overhead, in_bytes=in_bytes) / rate
    memory = (in_bytes * (m * k + k * n) + out_bytes * m * n) / hbm_bw
    return max(compute, memory)


def layer_gemms(cfg: ModelConfig, *, tokens: float, tp: int, ep: int, moe_fraction: float,
                etp: int = 0, imbalance: float = 1.0, mla: MLA | None = None,
                sequence_parallel: bool = True) -> list[tuple]:
    """Forward GEMMs of one average layer on one rank, as (m, n, k, count) for a microbatch of `tokens`.

    Column-parallel layers split N by tp, row-parallel ones K; a MoE layer's routed experts are split
    over ep ranks (E / ep local experts, each seeing tokens * top_k * ep / E rows when balanced) and by
    tp within; `moe_fraction` of the layers are MoE (their dense MLP replaced by experts + shared
    experts + router). `etp` (Megatron's expert_tensor_parallel_size, 0: tp) splits the experts over etp
    ranks instead: under sequence parallelism each rank dispatches its tokens / tp, so an expert sees
    tokens * (etp / tp) * top_k * ep / E rows of a width e_inter / etp (the same FLOPs per rank).
    `imbalance` (`Job.expert_imbalance`, with ep > 1) scales the routed experts' rows: the busiest rank's.
    `mla`: the attention is DeepSeek's latent attention (`mla.forward_gemms`; its down-projections over the rank's
    share of the tokens under `sequence_parallel`), not q, k, v and o of `cfg`'s heads.
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    if mla is not None:
        out = forward_gemms(cfg, mla, tokens=tokens, tp=tp, sequence_parallel=sequence_parallel)
    else:
        out = [(tokens, (q + 2 * kv) / tp, h, 1.0), (tokens, h, q / tp, 1.0)]
    dense = 1.0 - moe_fraction
    if dense > 0:
        out += [(tokens, 2 * cfg.intermediate_size / tp, h, dense), (tokens, h, cfg.intermediate_size / tp, dense)]
    if moe_fraction > 0:
        etp = etp or tp
        e_inter, local = cfg.expert_intermediate_size, cfg.num_experts / ep
        rows = tokens * etp / tp * cfg.num_experts_per_token * ep / cfg.num_experts * (imbalance if ep > 1 else 1.0)
        out += [(rows, 2 * e_inter / etp, h, moe_fraction * local), (rows, h, e_inter / etp, moe_fraction * local),
                (tokens, cfg.num_experts, h, moe_fraction)]
        if cfg.shared_intermediate_size:
            s = cfg.shared_intermediate_size
            out += [(tokens, 2 * s / tp, h, moe_fraction), (tokens, h, s / tp, moe_fraction)]
            if cfg.shared_expert_gate:
                out.append((tokens, 1, h, moe_fraction))
    return out


def moe_dispatch_elements(cfg: ModelConfig, *, ep: int) -> float:
    """Hidden-state elements read + written per token of one MoE layer's forward by the token dispatcher's
    memory-bound permutations (Megatron-Core's all-to-all dispatcher, `moe_permute_fusion` or not: the
    same bytes; meshlm's parallel/expert.py likewise gathers, sorts and scatters), with k = top_k, h = hidden:
      permute     each token's hidden state copied to its k expert slots: read k h, write k h;
      sort        after the dispatch all-to-all the rows arrive grouped by source rank and are regrouped by
                  local expert (Megatron's `sort_chunks_by_idxs`), and the inverse before the combine
                  all-to-all: 2 x (read k h + write k h) -- only with ep > 1 and more than one local expert;
      unpermute   the k expert outputs read, weighted by their router probabilities and summed: k h + h.
    The backward moves the same passes' gradients (the caller's elementwise backward factor). The expert
    GEMMs' activation (SwiGLU on k x e_inter) is counted with the other SwiGLU elements by the caller."""
    if not cfg.is_moe:
        return 0.0
    k, h = cfg.num_experts_per_token, cfg.hidden_size
    sort = 4 * k * h if ep > 1 and cfg.num_experts // ep > 1 else 0.0
    return 2 * k * h + sort + k * h + h


def gemms_fwd_bwd(gemms: list[tuple], *, rate: float, hbm_bw: float, in_bytes: float,
                  k_overhead: float) -> tuple[float, float]:
    """(forward, backward) seconds of `gemms`: backward = the input-gradient GEMM (m x k from m x n by
    n x k: inner dim n) + the weight-gradient GEMM (k x n from k x m by m x n: inner dim m)."""
    kw = dict(rate=rate, hbm_bw=hbm_bw, in_bytes=in_bytes, k_overhead=k_overhead)
    fwd = bwd = 0.0
    for m, n, k, count in gemms:
        fwd += count * gemm_time(m, n, k, **kw)
        bwd += count * (gemm_time(m, k, n, **kw) + gemm_time(k, n, m, **kw))
    return fwd, bwd


def fp8_cast_bytes(gemms: list[tuple], *, weights: str = "cached", shard: int = 1) -> tuple[float, float]:
    """(forward, backward) HBM bytes of casting GEMM inputs to fp8 in one micro-batch: forward each activation
    input m x k is read in bf16 and written in fp8 twice (row-wise, and transposed for the weight gradient):
    2 + 2 x 1 bytes per element; backward the output gradient m x n the same (Transformer Engine; torchao's
    roofline model counts the same for activations and gradients whose scale is fused with the op before).
    The weights (k x n each), by `weights` (`Job.fp8_weights`):
      cached           cast once per step and reused by every micro-batch (Transformer Engine): not counted;
      dynamic          cast in every forward with a dynamic scale (torchao): a max-abs pass reading bf16, then
                       the cast reading bf16 and writing fp8 row- and column-major: 2 + 2 + 2 x 1 = 6 bytes per
                       element (torchao/float8/roofline_utils.py, `get_tensor_memory_traffic_bytes`, "dynamic",
                       not fused with a previous op), kept for the backward;
      fsdp_all_gather  each rank casts its 1 / `shard` of the weight before FSDP's all-gather (read bf16, write
                       fp8: 3 bytes per element; the scales come from one max-abs per step), and the backward,
                       which gathers the weight again, copies it into the transposed layout its input-gradient
                       GEMM reads (read + write fp8: 2 bytes)."""
    fwd = sum(count * 4.0 * m * k for m, n, k, count in gemms)
    bwd = sum(count * 4.0 * m * n for m, n, k, count in gemms)
    w = sum(count * k * n for m, n, k, count in gemms)
    if weights == "dynamic":
        fwd += 6.0 * w
    elif weights == "fsdp_all_gather":
        fwd += 3.0 * w / shard
        bwd += 2.0 * w
    return fwd, bwd
