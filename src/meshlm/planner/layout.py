"""The planner's inputs: the job (`Job`) and the parallel layout (`Layout`), parsed and validated.

Responsible for: what a job and a layout are, parsing `tp=8,pp=4,...`, and `validate_layout`, which
refuses (ValueError naming the value and the fix) every layout the runtime would refuse -- by calling the
runtime's own rules (`meshlm.rules.check_layout_numbers`, the one definition: sizes tp does not divide,
sequences cp / SP / Ulysses cannot split, experts ep cannot spread, stages, schedules, batches) after the
planner's own: degrees that do not multiply to the GPU count, and what only a Megatron-Core run has
(expert_tp folding ep over the tp ranks, expert-parallel overlap where Megatron-Core refuses it).
Not responsible for: enumerating layouts (`search.py`) or costing them (`cost.py`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from meshlm.config import ModelConfig, zero3_reshards
from meshlm.dims import ParallelDims
from meshlm.rules import CP_METHODS  # noqa: F401 (re-exported to cost and search)
from meshlm.rules import RECOMPUTE_MODES, check_ep_groups, check_layout_numbers

RECOMPUTE = RECOMPUTE_MODES  # parallel.recompute's (`meshlm.rules`)
PRECISIONS = ("bf16", "fp8", "fp32")
# Whose runtime the accounting follows: "megatron" (Megatron-Core / FSDP conventions: bf16 weights, fp32
# gradients, a distributed optimizer, norm gradients reduced once per step) or "meshlm" (meshlm's own
# parallel/data.py + parallel/zero.py, fp32, exactly as they allocate and communicate; what `--cluster
# local` runs and tests/test_planner_measured.py counts).
RUNTIMES = ("megatron", "meshlm")
# Elementwise work a fused stack may still run op by op (`Job.eager_ops`): "rope" (the rotary embedding as torch
# ops: slices, a negation, a concatenation, two products and a sum), "swiglu" (F.silu(x1) * x2: two kernels),
# "attention_layout" (q, k and v copied into the attention kernel's [batch, seq] layout and its output copied back:
# Megatron-LM's legacy `ParallelAttention` does `rearrange(...).contiguous()` around its flash-attn call), "rmsnorm"
# (each RMSNorm as torch ops in fp32, as Llama's reference code writes it, where a fused kernel would read and write
# once).
EAGER_OPS = ("rope", "swiglu", "attention_layout", "rmsnorm")
# How fp8 training gets its weights into fp8 (`Job.fp8_weights`): "cached" (Transformer Engine: cast once per step,
# reused by every micro-batch, the fp8 copies kept beside the bf16 weights), "params" (Megatron's fp8 parameters,
# `--fp8-param-gather`, which NVIDIA's NeMo / Megatron-Bridge fp8 recipes set: the weights themselves held in fp8,
# cast from the fp32 master by the optimizer step, no bf16 copy; the distributed optimizer gathers them in one byte),
# "dynamic" (torchao's dynamic tensorwise scaling: every forward casts every weight), "fsdp_all_gather" (torchao's
# `enable_fsdp_float8_all_gather` under FSDP2: each rank casts its shard before the all-gather, which then moves one
# byte per weight).
FP8_WEIGHTS = ("cached", "params", "dynamic", "fsdp_all_gather")
# How the expert all-to-all moves the routed tokens (`Job.ep_dispatcher`): "alltoall" (NCCL's all-to-all of every
# routed copy: Megatron-Core's alltoall token dispatcher, meshlm's parallel/expert.py) or "flex" (Megatron-Core's flex
# dispatcher with its DeepEP or HybridEP backend: a token sent once to each other node holding one of its experts).
EP_DISPATCHERS = ("alltoall", "flex")
# The attention kernels `meshlm plan --attention` names, as Job fields: "fused" (FlashAttention-3 / cuDNN class, the
# cluster's attention_efficiency), "fa2" (`Job.flash_attention_2`), "unfused" (`Job.flash_attention` False).
ATTENTION_KERNELS = ("fused", "fa2", "unfused")
# How Layout.short() marks each method after "cp<n>" (ring, the default, unmarked).
CP_METHOD_MARKS = {"ring": "", "allgather": "ag", "ulysses": "u"}
# FlashAttention-1's rate over FlashAttention-2's: the midpoints of the two utilisation ranges Dao 2023 gives on A100
# (25-40% and 50-73%; `Job.flash_attention_1`).
FA1_RATE_OF_FA2 = (25 + 40) / (50 + 73)
# Bytes of the compute dtype in which context-parallel attention keeps its log-sum-exp and the ring
# passes its partial dK/dV: fp32 whatever the activation dtype (`parallel/context.py`, for accuracy).
CP_COMPUTE_BYTES = 4
# Layout.pp_split: how the blocks are spread over the pipeline stages.
PP_SPLITS = ("balanced", "uniform")


@dataclass(frozen=True)
class Job:
    seq_len: int
    global_batch_size: int  # sequences per optimizer step
    precision: str = "bf16"  # bf16 | fp8 | fp32
    # Fused (flash) attention stores no s x s scores; False models 2021-era unfused softmax kernels.
    flash_attention: bool = True
    # The fused kernel is FlashAttention-2 (PyTorch SDPA's flash backend, the flash-attn 2 package), which on
    # Hopper runs well below the FA3 / cuDNN kernels the cluster's attention_efficiency rates
    # (`Cluster.fa2_attention_efficiency`); the same on A100, where FA2 is the rated kernel.
    flash_attention_2: bool = False
    # The fused kernel is the first FlashAttention (the flash-attn 1.x package, whose entry point was
    # `flash_attn_unpadded_func`): FlashAttention-2 is "around 2x" faster, "reaching 50-73% of the theoretical maximum
    # FLOPs/s on A100" where the first reached "25-40%" (Dao 2023, "FlashAttention-2", arXiv:2307.08691, abstract and
    # Sec. 1), so it runs at `FA1_RATE_OF_FA2` of FlashAttention-2's rate.
    flash_attention_1: bool = False
    # Norms, RoPE, SwiGLU and residual adds as fused kernels (Megatron/TE, torch.compile); False
    # models eager PyTorch, one memory pass per op (meshlm's model uncompiled, e.g. the CPU runs).
    fused_elementwise: bool = True
    # Eager only: the norms run in fp32 (meshlm's RMSNorm upcasts, as Hugging Face's Llama, torchtitan's and IBM
    # fms' do: seven passes, 36 bytes per element); False: one fused norm kernel in the activations' dtype
    # (llm-foundry MPT's default `low_precision_layernorm`: F.layer_norm on bf16, read + write).
    fp32_norms: bool = True
    # Ops of `EAGER_OPS` a stack that otherwise fuses its elementwise work still runs op by op, each one memory pass
    # per op as under `fused_elementwise=False` (with that False, every op already is).
    eager_ops: frozenset = frozenset()
    # PyTorch FSDP2 (`fully_shard`): after each all-gather, its copy-out (torch/distributed/fsdp/_fully_shard/
    # _fsdp_collectives.py `foreach_all_gather_copy_out`: `split_with_sizes_copy` from the all-gather buffer into each
    # parameter's own tensor) runs on the compute stream, which waits for it: every gather reads and writes the
    # unit's whole parameters once more, exposed. FSDP1's flat parameters are views of its all-gather output (False).
    fsdp_copy_out: bool = False
    # ZeRO-3 as DeepSpeed ran it before v0.6 (2022-01): every parameter tensor all-gathered by its own collective,
    # synchronously -- `_allgather_param` called torch.cuda.synchronize() before each all_gather, and the fetch of a
    # sub-module synchronized the device after its gathers ("the async version is not async at all, because each
    # all_gather calls torch.cuda.synchronize()", DeepSpeed PR #1188, 2021-10; prefetching overlapped with compute came
    # with its coalesced all-gathers, #1453, v0.6.0): no gather hides under compute, each pays its ring's latency.
    zero3_serial_gathers: bool = False
    # ZeRO-2 as PyTorch FSDP's SHARD_GRAD_OP (llm-foundry's / Composer's ZeRO-2): the parameters gathered unit by unit
    # (each wrapped block, then the root) before every micro-step's forward and kept for its backward, the gradients
    # reduce-scattered unit by unit after it -- one collective per unit and pass, each paying its ring's latency,
    # prefetched as FULL_SHARD's are (`timing_dp.fsdp_comm_time` without the backward's gathers). False: Megatron's
    # distributed optimizer and DeepSpeed's ZeRO-2, which reduce-scatter the gradients in large buckets and gather
    # the updated parameters once per step.
    zero2_unit_collectives: bool = False
    # FSDP's gradient accumulation without synchronization (FSDP2's `set_requires_gradient_sync(False)`, FSDP1's
    # `no_sync()`) on every micro-step but the last: each unit's unsharded gradient is kept -- FSDP2 upcasts it to its
    # reduce dtype to accumulate (`FSDPParam.to_accumulated_grad_if_needed`) -- and reduce-scattered once, in the last
    # micro-step's backward: one reduction per step, and the rank's whole unsharded gradients in memory at the
    # reduce dtype's width (KempnerForge's training/grad.py `maybe_no_sync`). False: every micro-step's backward
    # reduce-scatters its units (PyTorch FSDP's default, Composer's and OLMo-core's trainers). FSDP (ZeRO-2 / 3 under
    # runtime megatron) only; meshlm's ZeRO accumulates without synchronizing already (`memory.py`).
    fsdp_no_sync: bool = False
    # Tensor parallelism with the output head's logits gathered for a loss every tp rank computes over the whole
    # vocabulary (DTensor's ColwiseParallel head with a Replicate output and no loss_parallel: KempnerForge's
    # distributed/tensor_parallel.py): one all-gather of tokens x vocab activations per micro-batch, and the loss and
    # logit memory of the whole vocabulary on every rank. False: Megatron's vocab-parallel cross entropy (and meshlm's,
    # torchtitan's loss_parallel), three all-reduces of 4 bytes per token and a vocabulary shard per rank.
    tp_loss_replicated: bool = False
    # The model cast to bf16 before training (KempnerForge's scripts/train.py: `model.to(dtype=param_dtype)`):
    # parameters, their gradients and the Adam moments 2 bytes each, no fp32 master copy -- 8 bytes of state per
    # parameter where mixed precision keeps 18 (`placement.bytes_per`); the optimizer step streams as many fewer.
    bf16_states: bool = False
    # Megatron-Core's precision-aware optimizer with bf16 Adam moments (`use_precision_aware_optimizer`,
    # `exp_avg_dtype` / `exp_avg_sq_dtype` torch.bfloat16: Megatron-Bridge's DeepSeek-V3 and MXFP8 MoE recipes,
    # group AL) beside the fp32 master copy: 8 bytes of optimizer state per parameter where 12
    # (`placement.bytes_per`); the optimizer step streams as many fewer. Mixed precision only.
    bf16_moments: bool = False
    # Megatron-Core's recompute_modules "mla_up_proj" (transformer_config.py: "recompute the MLA up projection and
    # RoPE applying parts", an output-discarding checkpoint: multi_latent_attention.py frees q, k and v once the
    # attention core has run and rebuilds them in the same storage before the core's backward): a layer of latent
    # attention keeps of it the compressed latents and the core's output only, and its backward runs the
    # up-projection GEMMs once more (`mla.up_projection_gemms`). A model with latent attention on Megatron's runtime
    # (Megatron-Bridge's DeepSeek-V3 H100 and GB200 recipes); a model without it has nothing to re-run.
    recompute_mla_up_proj: bool = False
    # A full recomputation that stops once the tensors the backward needs are rebuilt: torch.utils.checkpoint
    # without reentrancy (PyTorch >= 2.1 stops early by default) -- meshlm's runtime (parallel/recompute.py),
    # torchtitan's and KempnerForge's checkpoint wrappers -- so a layer's last tensor-parallel collective, whose
    # output no saved tensor needs, is not run again (`timing.tp_collectives`). False: the whole forward of the layer
    # runs again, its last collective included (Megatron's and DeepSpeed's CheckpointFunction, torch's reentrant
    # checkpoint, Aleph Alpha's Scaling's copy of the older non-reentrant one). The meshlm runtime is always True.
    recompute_early_stop: bool = False
    # Megatron-Core's fused cross entropy (`cross_entropy_loss_fusion`, from core_v0.8; NeMo's and Megatron-Bridge's
    # GPT configs default it on): its jit-fused kernels move fewer bytes per logit than the op-by-op loss
    # (`timing.loss_time`).
    cross_entropy_fusion: bool = False
    # fp8 only: how the GEMMs' weights reach fp8 (`FP8_WEIGHTS`; HBM bytes per weight element in kernels.py's
    # `fp8_cast_bytes`, after torchao's own roofline model, torchao/float8/roofline_utils.py).
    fp8_weights: str = "cached"
    # Megatron's gradient-accumulation fusion (the default): the weight-gradient GEMM accumulates straight into the
    # fp32 main_grad. False (`--no-gradient-accumulation-fusion`): every micro-batch's weight gradient is written in
    # the activation dtype and added into main_grad by a pass of its own (read it, read and write main_grad).
    gradient_accumulation_fusion: bool = True
    # Tensor-parallel collectives pipelined under the GEMMs (Megatron-Core / Transformer Engine
    # `tp_comm_overlap`, MegaScale Sec. 3.3); meshlm's own TP does not overlap them (False).
    tp_comm_overlap: bool = False
    # Gradient reduce-scatter / all-reduce and parameter all-gather overlapped with the backward / forward
    # (meshlm's DP and ZeRO, PyTorch DDP/FSDP, Megatron-Core's overlap_grad_reduce / overlap_param_gather).
    # False: issued after the backward, exposed (Megatron-LM before 2023); ZeRO-3 always prefetches.
    dp_comm_overlap: bool = True
    # Every pipeline send and receive its own blocking transfer, in schedule order (DeepSpeed's pipeline engine:
    # runtime/pipe/p2p.py's send / recv are synchronous, one per SendActivation / RecvActivation / SendGrad /
    # RecvGrad instruction; Aleph Alpha's Scaling runs the same schedule over blocking torch.distributed.send / recv):
    # an interior stage waits for four transfers per micro-batch, an end stage for two.
    # False: Megatron's / meshlm's schedules, a send and a receive issued together (two per micro-batch).
    pp_p2p_serial: bool = False
    # Pipeline sends split over the tensor-parallel ranks (DeepSpeed's pipeline engine with tp > 1, its
    # `pipe_partitioned` / `grad_partitioned`, on by default: runtime/pipe/engine.py sends each tp rank's 1/tp slice of
    # the activation and of its gradient as a PartitionedTensor, and the receiving stage all-gathers it over the tp
    # group, `PartitionedTensor.full`). False: each tp rank sends the whole tensor (Megatron without sequence
    # parallelism), or its sequence-parallel slice.
    pp_partitioned_sends: bool = False
    runtime: str = "megatron"  # one of RUNTIMES: whose memory and communication accounting applies
    # Megatron-Core's gradient buffer (main_grad) and its reduce-scatter / all-reduce in fp32 (its
    # `grad_reduce_in_fp32`, the planner's default) or, False, in the bf16 parameter dtype: what NVIDIA's
    # NeMo / Megatron-Bridge performance recipes set (`plugins.grad_reduce_in_fp32 = False`), halving the
    # gradients' memory and the data-parallel traffic. Mixed precision only (fp32 training keeps fp32).
    grad_reduce_in_fp32: bool = True
    # Expert-parallel all-to-all (dispatch, combine) hidden under another microbatch's compute: Megatron-Core's
    # `overlap_moe_expert_parallel_comm` (Megatron-Bridge's `moe_a2a_overlap`) runs the forward of one
    # microbatch and the backward of another layer by layer, each one's all-to-all under the other's
    # compute. Megatron refuses it with full recomputation, or with pp > 1 without an interleaved schedule
    # (`validate_layout` likewise). False: exposed (meshlm's parallel/expert.py, Megatron's default).
    ep_comm_overlap: bool = False
    # Routed tokens the busiest expert-parallel rank receives over the mean (>= 1; at most ep, every token).
    # Dropless routing waits for the slowest rank: its expert GEMMs, their activation and its all-to-all set
    # the pace. 1.0: balanced, what NVIDIA's published MoE benchmarks force (Megatron-Core's
    # moe_router_force_load_balancing); a real router's imbalance is the user's figure (none is assumed).
    expert_imbalance: float = 1.0
    # The expert all-to-all's kernels (`EP_DISPATCHERS`). "flex": DeepEP's normal kernels and HybridEP send each token
    # across to each other node holding one of its experts once and forward it inside that node over NVLink, all
    # peers at once (`collectives.expert_all_to_all`, as serving prices DeepEP's prefill kernels), where NCCL's
    # all-to-all sends every routed copy to its expert's GPU. Megatron-Core only (meshlm's expert.py is "alltoall").
    ep_dispatcher: str = "alltoall"
    # The input embedding as a GEMM: a one-hot [tokens, vocab] matrix times the table (praxis' embedding
    # `lookup_style="matmul"`, what Paxml's LM configs set), forward and its weight gradient, each tokens x vocab
    # x hidden, plus writing the one-hot. False: a row gather (Megatron, PyTorch, MaxText), not priced.
    embedding_gemm: bool = False
    # Dropouts per layer over the hidden states (tokens x hidden) that run as a memory pass of their own, read +
    # write, not fused into a neighbouring kernel: Paxml's GPT-3 5B drops the input of every repeated block
    # (praxis StackedTransformer `input_dropout_prob`). Megatron's hidden dropout is fused into its
    # bias-dropout-add kernel, and 2021's attention dropout is counted with the unfused softmax: 0 for those.
    unfused_dropouts: int = 0
    # Selective recomputation as a JAX remat policy that saves only the GEMM outputs (praxis' SAVE_DOT_ONLY /
    # SAVE_DOT_WITH_NO_BATCH_DIM: jax.checkpoint_policies.checkpoint_dots / ..._with_no_batch_dims): the backward
    # re-runs the attention core (a custom call, not a dot) and every elementwise op of the layer -- norms,
    # activation, residual adds, dropout, fp8 casts --, where Megatron's re-runs the core and about half the
    # elementwise work around it (False).
    remat_saves_dots: bool = False
    # ZeRO-1/2 gradients all-reduced over every data-parallel rank, each rank then keeping its shard's part, where
    # Megatron's distributed optimizer and DeepSpeed reduce-scatter them over the sharding group (False): InternLM's
    # HybridZeroOptimizer (internlm/solver/optimizer/hybrid_zero_optim.py: `reduce_tensor(..., dst_rank=None)`,
    # an all-reduce in its utils.py; Aleph Alpha's Scaling likewise, in fp32). The updated shards go back out as one
    # broadcast per rank of the sharding group (InternLM) or an all-gather (Scaling), priced as the all-gather they
    # add up to (NCCL's ring cost model, src/graph/tuning.cc: a broadcast's latency is one hop's when its channels
    # are the same, its bytes those every rank receives).
    zero1_grad_all_reduce: bool = False

    def validate(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be >= 1")
        if self.global_batch_size < 1:
            raise ValueError(f"global batch={self.global_batch_size} sequences must be >= 1 "
                             "(give --global-batch-size or --global-batch-tokens >= --seq-len)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {list(PRECISIONS)}")
        if not self.expert_imbalance >= 1.0:
            raise ValueError(f"expert_imbalance={self.expert_imbalance} must be >= 1 (the busiest expert rank's "
                             "routed tokens over the mean; 1.0 = balanced)")
        if self.unfused_dropouts < 0:
            raise ValueError(f"unfused_dropouts={self.unfused_dropouts} must be >= 0 (dropouts per layer)")
        if self.fp8_weights not in FP8_WEIGHTS:
            raise ValueError(f"fp8_weights={self.fp8_weights!r} must be one of {list(FP8_WEIGHTS)}")
        if not set(self.eager_ops) <= set(EAGER_OPS):
            raise ValueError(f"eager_ops={sorted(self.eager_ops)} must be among {list(EAGER_OPS)}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r} must be one of {list(RUNTIMES)}")
        if self.ep_dispatcher not in EP_DISPATCHERS:
            raise ValueError(f"ep_dispatcher={self.ep_dispatcher!r} must be one of {list(EP_DISPATCHERS)}")
        if self.ep_dispatcher == "flex" and self.runtime != "megatron":
            raise ValueError("ep_dispatcher='flex' is Megatron-Core's flex token dispatcher (DeepEP / HybridEP); "
                             "meshlm's expert parallelism runs NCCL's all-to-all: set ep_dispatcher='alltoall' or "
                             "runtime='megatron'")
        if self.bf16_moments and (self.precision == "fp32" or self.bf16_states):
            raise ValueError("bf16_moments is mixed precision's optimizer (an fp32 master copy beside bf16 Adam "
                             f"moments); precision={self.precision!r}, bf16_states={self.bf16_states} keep no master: "
                             "set bf16_moments=False")
        if self.recompute_mla_up_proj and self.runtime != "megatron":
            raise ValueError("recompute_mla_up_proj is Megatron-Core's recompute_modules 'mla_up_proj'; meshlm "
                             "implements no multi-head latent attention: set runtime='megatron'")
        if self.fsdp_no_sync and self.runtime != "megatron":
            raise ValueError("fsdp_no_sync is PyTorch FSDP's unsynchronized gradient accumulation; meshlm's ZeRO "
                             "already reduces once a step (its accounting prices that): leave out --fsdp-no-sync "
                             "(fsdp_no_sync=False)")
        if self.runtime == "meshlm" and self.precision != "fp32":
            raise ValueError(f"runtime='meshlm' trains in fp32 (precision={self.precision!r} given); use "
                             "precision='fp32', or runtime='megatron' for mixed precision")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch_size

    def fp8_weights_are(self, how: str) -> bool:
        """Whether the job trains in fp8 with its weights got into fp8 `how` (`FP8_WEIGHTS`)."""
        return self.precision == "fp8" and self.fp8_weights == how


@dataclass(unsafe_hash=True)
class Layout(ParallelDims):
    """A parallel layout: the degrees (`meshlm.dims.ParallelDims`, the type config and mesh share; dp_shard
    = -1 takes what the others leave of the GPUs, resolved by `cost.estimate`) plus the planner's knobs.
    Keys are the `parallel.*` config names plus micro_batch_size."""

    # ring: K/V blocks passed round the cp ranks, overlapped with attention; allgather: K/V of the whole
    # sequence gathered once per layer; ulysses: all-to-alls to split attention by heads instead of tokens
    # (parallel.cp_method). Only matters when cp > 1.
    cp_method: str = "ring"
    # parallel.cp_ulysses: > 1 (with cp_method=ring) the hybrid, Ulysses within groups of this many consecutive
    # cp ranks and the ring across the groups
    cp_ulysses: int = 1
    zero_stage: int = 0
    # ZeRO-3: free gathered units after each micro-batch's forward (True) or keep the stage's units gathered
    # for the whole step (False); None: False with pp > 1, True otherwise (parallel.zero3_reshard_after_forward)
    zero3_reshard_after_forward: bool | None = None
    pp_schedule: str = "1f1b"
    pp_chunks: int = 1
    # Blocks per pipeline stage: "balanced" (meshlm's default, `schedules.balanced_split`: the last stage, which
    # also runs the output head and loss, lightened) or "uniform" (num_layers / stages on every stage, the head
    # on top of the last: Megatron-LM's split, which runs as parallel.pp_layers with equal counts).
    pp_split: str = "balanced"
    num_microbatches: int = 0  # 0: derived, global_batch / (dp * micro_batch_size)
    micro_batch_size: int = 1
    sequence_parallel: bool = True
    recompute: str = "none"
    bucket_size_mb: float = 25.0
    # Megatron-Core's expert_tensor_parallel_size ("MoE parallel folding"): the routed experts split over
    # expert_tp ranks instead of tp, and the ep group carved out of dp_shard x cp x (tp / expert_tp) -- so
    # ep may span tensor-parallel ranks (e.g. tp=2, expert_tp=1, ep = 2 x dp). 0: expert_tp = tp, the ep group
    # within dp_shard x cp at stride tp -- meshlm's only choice, where each expert is then whole on every tp
    # rank (replicated, parallel/expert.py; `placement.rank_setup`); another value prices Megatron runs only.
    expert_tp: int = 0

    @property
    def world(self) -> int:
        return self.world_size

    @property
    def zero3_reshards(self) -> bool:
        """zero3_reshard_after_forward resolved (`config.zero3_reshards`: unset is False under pp)."""
        return zero3_reshards(self.zero3_reshard_after_forward, self.pp)

    @property
    def etp(self) -> int:
        """Ranks one routed expert is split over (expert_tp, or tp when 0)."""
        return self.expert_tp or self.tp

    def cp_name(self) -> str:
        """cp as `short` writes it: the degree and the method's mark (cp_ulysses as u<U> for the hybrid)."""
        if self.cp > 1 and self.cp_ulysses > 1:
            return f"{self.cp}u{self.cp_ulysses}"
        return f"{self.cp}{CP_METHOD_MARKS[self.cp_method] if self.cp > 1 else ''}"

    def short(self) -> str:
        parts = [f"tp{self.tp}" + ("sp" if self.sequence_parallel and self.tp > 1 else ""),
                 f"pp{self.pp}" + (f"x{self.pp_chunks}" if self.pp_chunks > 1 else ""),
                 (f"dp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp_shard}")
                 + f"/z{self.zero_stage}" + ("k" if self.zero_stage == 3 and not self.zero3_reshards else "")]
        if self.cp > 1:
            parts.append(f"cp{self.cp_name()}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}" + (f"etp{self.etp}" if self.etp != self.tp else ""))
        parts.append(f"mbs{self.micro_batch_size}")
        if self.pp > 1:
            parts.append(self.pp_schedule + (" uniform" if self.pp_split == "uniform" else ""))
        parts.append(f"rc:{self.recompute}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


_LAYOUT_TYPES = {f.name: f.type for f in fields(Layout)}


def parse_layout(text: str, *, gpus: int) -> Layout:
    """`tp=8,pp=4,dp_shard=2,zero_stage=1,recompute=full` -> Layout; dp_shard defaults to the rest."""
    kw: dict = {}
    for item in [t for t in text.replace(" ", "").split(",") if t]:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"layout item {item!r} must look like key=value (e.g. tp=8)")
        if key not in _LAYOUT_TYPES:
            raise ValueError(f"layout key {key!r} is unknown; valid keys: {', '.join(_LAYOUT_TYPES)}")
        if key in kw:
            raise ValueError(f"layout key {key!r} is given twice in {text!r}; give it once")
        kind = _LAYOUT_TYPES[key]
        if kind == "bool | None" and value.lower() in ("none", ""):
            kw[key] = None
        elif kind in ("bool", "bool | None"):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError(f"layout {key}={value!r} must be true or false")
            kw[key] = value.lower() in ("true", "1", "yes", "on")
        elif kind == "str":
            kw[key] = value
        else:
            try:
                kw[key] = float(value) if kind == "float" else int(value)
            except ValueError:
                raise ValueError(f"layout {key}={value!r} must be a number") from None
            if kind == "float" and not (math.isfinite(kw[key]) and kw[key] > 0):
                raise ValueError(f"layout {key}={value!r} must be a finite number > 0")
            if key in ("dp_replicate", "tp", "pp", "cp", "ep") and kw[key] < 1:
                raise ValueError(f"layout {key}={kw[key]} must be >= 1")
    layout = Layout(**kw)
    # keys that act only beside a degree above 1: set away from their default without it, named rather than ignored
    # (a default value asks for nothing: `Layout.to_dict()` carries every key)
    default = Layout()
    for key, degree in (("cp_method", "cp"), ("cp_ulysses", "cp"), ("pp_schedule", "pp"), ("pp_split", "pp")):
        if key in kw and kw[key] != getattr(default, key) and getattr(layout, degree) == 1:
            raise ValueError(f"layout {key}={kw[key]} acts only with {degree} > 1 ({degree}=1 in {text!r}): "
                             f"give {degree}=N with it, or leave {key} out")
    return resolve_layout(layout, gpus=gpus, text=text)


def resolve_layout(layout: Layout, *, gpus: int, text: str | None = None) -> Layout:
    """dp_shard=-1 -> what the other degrees leave of `gpus` (as parallel.dp_shard=-1 does at run time)."""
    if layout.is_resolved:
        return layout
    others = layout.dp_replicate * layout.tp * layout.pp * layout.cp
    if others < 1 or gpus % others:
        what = f"layout {text!r}" if text is not None else "layout"
        raise ValueError(f"{what}: dp_replicate*tp*pp*cp={others} must divide --gpus={gpus}")
    return replace(layout, dp_shard=gpus // others)


def validate_layout(cfg: ModelConfig, job: Job, layout: Layout, *, gpus: int) -> int:
    """Raise ValueError naming the value and the fix; return the number of microbatches."""
    lo = resolve_layout(layout, gpus=gpus)
    for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "pp_chunks", "micro_batch_size", "cp_ulysses"):
        if getattr(lo, name) < 1:
            raise ValueError(f"layout {name}={getattr(lo, name)} must be >= 1")
    if lo.world != gpus:
        raise ValueError(f"layout dp_replicate*dp_shard*tp*pp*cp = {lo.world} must equal --gpus={gpus}")
    if lo.expert_tp and not cfg.is_moe:
        raise ValueError(f"layout expert_tp={lo.expert_tp} splits routed experts; {cfg.preset or 'the model'} is "
                         "dense: leave expert_tp out")
    if lo.recompute not in RECOMPUTE:
        raise ValueError(f"layout recompute={lo.recompute!r} must be one of {list(RECOMPUTE)}")
    if lo.pp_split not in PP_SPLITS:
        raise ValueError(f"layout pp_split={lo.pp_split!r} must be one of {list(PP_SPLITS)}")
    if lo.ep > 1:
        if lo.expert_tp < 0 or (lo.expert_tp and lo.tp % lo.expert_tp):
            raise ValueError(f"layout expert_tp={lo.expert_tp} must divide tp={lo.tp} (or be 0: expert_tp = tp)")
        if lo.etp != lo.tp and job.runtime != "megatron":
            raise ValueError(f"layout expert_tp={lo.expert_tp} differs from tp={lo.tp}: meshlm keeps experts whole "
                             "on the tp ranks (parallel/expert.py); use expert_tp=0, or runtime='megatron' to price "
                             "a Megatron-Core run")
        folded = lo.tp // lo.etp  # tensor-parallel ranks the ep group may also span (MoE parallel folding)
        if folded == 1:
            try:
                check_ep_groups(lo.ep, dp_shard=lo.dp_shard, cp=lo.cp)  # the runtime's rule (`dims.ParallelDims`)
            except ValueError as e:
                if lo.tp == 1:
                    raise
                raise ValueError(f"{e}; with a Megatron-Core run, expert_tp=1 lets ep span the tp ranks too") from None
        elif (lo.dp_shard * lo.cp * folded) % lo.ep:
            raise ValueError(f"layout ep={lo.ep} must divide dp_shard*cp*tp/expert_tp={lo.dp_shard * lo.cp * folded} "
                             "(experts are sharded over dp_shard x cp x tp/expert_tp ranks)")
    # Everything else the runtime refuses, by the runtime's own rules (`meshlm.rules`).
    m = check_layout_numbers(cfg, dp_replicate=lo.dp_replicate, dp_shard=lo.dp_shard, tp=lo.tp, pp=lo.pp, cp=lo.cp,
                             ep=lo.ep, zero_stage=lo.zero_stage, sequence_parallel=lo.sequence_parallel,
                             cp_method=lo.cp_method, cp_ulysses=lo.cp_ulysses, pp_schedule=lo.pp_schedule,
                             pp_chunks=lo.pp_chunks, seq_len=job.seq_len, global_batch_size=job.global_batch_size,
                             micro_batch_size=lo.micro_batch_size, num_microbatches=lo.num_microbatches)
    if lo.ep > 1 and job.expert_imbalance > lo.ep:
        raise ValueError(f"expert_imbalance={job.expert_imbalance} exceeds ep={lo.ep}: the busiest of ep ranks "
                         "receives at most every routed token (ep x the mean)")
    if job.ep_comm_overlap and lo.ep > 1:
        if job.runtime != "megatron":
            raise ValueError("ep_comm_overlap is Megatron-Core's overlap_moe_expert_parallel_comm; meshlm's "
                             "all-to-all is not overlapped: set ep_comm_overlap=False or runtime='megatron'")
        if lo.recompute == "full":
            raise ValueError("ep_comm_overlap needs recompute other than 'full' (Megatron-Core refuses "
                             "overlap_moe_expert_parallel_comm with full recomputation)")
        if lo.pp > 1 and lo.pp_schedule != "interleaved":
            raise ValueError(f"ep_comm_overlap with pp={lo.pp} needs pp_schedule=interleaved (Megatron-Core's "
                             "overlap_moe_expert_parallel_comm needs a virtual pipeline when pp > 1)")
    return m
