"""The software stacks the published training rows ran, named from what a row says it is (`stack_of`: its source and
model columns), and what each runs beyond the layout (the tuples below, each read by `published.job_of` /
`layouts_of` as Job and Layout fields).

Responsible for: the names a stack goes by and which stacks share each behaviour, cited from their code.
Not responsible for: reading the other cells of a row (`published_rows.py`) or pricing it (`published.py`).

What each stack runs, as `published.job_of` and `layouts_of` price it (the stacks named since the groups A-Z; the
choices made for every row are `published`'s module docstring; a function named below and not defined here is
`published`'s (`job_of`, `legacy_megatron`, `recompute_as_run`) or `published_rows`' (`cluster_for`, `recompute_of`)):
  * Alibaba's Megatron-LLaMA (group AB, LLaMA-13B at tp 2 with sequence parallelism and selective recomputation):
    its OverlappedDistributedOptimizer overlaps the gradient reduce-scatter with the backward and the parameter
    all-gather with the forward (the planner's ZeRO-1 default); Megatron-LM's DistributedOptimizer rows of its README
    leave both exposed (its README: Megatron-LM's "does not fully overlap GPU computation with communication");
    its code (e3d671a) attends with flash-attn 1.x (`Job.flash_attention_1`), runs RoPE, SwiGLU and the copies of
    q, k, v into the kernel's layout and back as torch ops (`Job.eager_ops`; its RMSNorm is apex's fused kernel),
    and its LLaMA-13B script turns gradient-accumulation fusion off (`Job.gradient_accumulation_fusion`); a row of
    another stack naming the first FlashAttention or `--no-gradient-accumulation-fusion` is read the same way. The
    RoPE / SwiGLU / layout copies are Megatron-LM's legacy model code (its own runs before 2024 too, `legacy_megatron`),
    whose "selective" recomputation with flash-attn recomputes nothing (`recompute_as_run`);
  * OLMo-core's training scripts (group AA, Ai2's README of 2024-11): FSDP2 over a node's 8 GPUs (HSDP across
    nodes: its `init_hybrid_shard_mesh` when there is more than one), torch.compile, attention through PyTorch's SDPA
    (compile turns flash-attn off: `llama_like`'s `use_flash`), so FlashAttention-2 kernels; QK-norm for the
    OLMo-1124 shapes (`ARCHS`); gradients reduced in fp32 (`reduce_dtype`), the planner's default;
  * PyTorch FSDP2 (torchtitan, OLMo-core, and rows naming FSDP2 or fully_shard: groups K, T, AA) copies each
    all-gather's output into the parameters' own tensors on the compute stream (`Job.fsdp_copy_out`); FSDP1's flat
    parameters (llm-foundry, fms-fsdp) are views of it;
  * ZeRO-2 as PyTorch FSDP's SHARD_GRAD_OP (llm-foundry's large-scale rows, group O) gathers and reduce-scatters
    unit by unit, as FULL_SHARD does but without the backward's gathers (`Job.zero2_unit_collectives`); Megatron's
    distributed optimizer and DeepSpeed's ZeRO-2 reduce in buckets and gather once per step;
  * ZeRO-3 as DeepSpeed ran it before v0.6 (a ZeRO-3 row of 2021 or before that is not FSDP, or one naming such a
    release): every parameter tensor gathered by its own collective, synchronously (`Job.zero3_serial_gathers`);
  * fp8 through torchao's float8 linear layers (torchtitan, OLMo-core) casts the weights with a dynamic scale in every
    forward, or, with FSDP's float8 all-gather (OLMo-core's default), each rank its shard before the gather
    (`Job.fp8_weights`); Transformer Engine (NVIDIA's recipes) casts them once per step;
  * what Paxml's GPT configs run beyond the blocks (google/paxml scripts_gpu/configs.py and tasks/lm/params/c4.py,
    praxis layers/embedding_softmax.py and transformers.py, as `job_of` cites): the tied embedding looked up as a
    one-hot matmul (`Job.embedding_gemm`: a GEMM of tokens x vocab x hidden forward and one for the table's
    gradient), and for the 5B a dropout (p 0.1) of each repeated block's input (`Job.unfused_dropouts` = 1:
    its own pass, the next kernel being Transformer Engine's LayerNorm); no other dropout (DROPOUT_PROB 0);
  * Hagemann et al.'s sweep (group AF) as Aleph Alpha's Scaling library runs it (`BLOCKING_PIPE_STACKS`):
    RoPE and SwiGLU as torch ops, blocking pipeline sends and receives, gradients all-reduced in fp32 after the flush;
    and what each row says: FlashAttention-2 or v1.0.8, or unfused attention (Megatron's fused softmax kernel, or torch
    ops), and whether its RMSNorm ran as flash-attn's fused kernel or as torch ops in fp32 (`Job.eager_ops`
    "rmsnorm"); a row of any stack saying either is read so;
  * Hugging Face transformers with accelerate's FSDP1 (stack "hf-transformers": YaFSDP's table, group AG, as its
    repository's patched run_clm.py runs it): eager PyTorch (the Trainer compiles nothing by default), RMSNorm in
    fp32, FlashAttention-2 (`attn_implementation="flash_attention_2"`), FULL_SHARD unit by unit with fp32 reduction;
    ATorch's examples (groups AO, AP) alike but reducing in bf16, or its "DS 3D" under DeepSpeed's pipeline engine
    (`STACKS`: "atorch-fsdp", "atorch-ds3d");
  * whole blocks checkpointed in k of L layers ("full, first 10 of 80 layers": YaFSDP's `num-ckpt-layers`): the
    no-recompute and full-recompute estimates of the layout weighted (L - k) / L and k / L (time and memory: each
    layer re-runs its forward or not, keeps its inputs or all its activations), as "half" weighs them equally;
  * KempnerForge (group AH, its MFU report of 2026-04): FSDP2 (`Job.fsdp_copy_out`) accumulating gradients without
    synchronizing (`Job.fsdp_no_sync`), DTensor tensor parallelism with sequence parallelism, SDPA attention (FA2),
    compiled unless the row says not, its tensor-parallel head's logits gathered for a loss over the whole vocabulary
    on every rank (`Job.tp_loss_replicated`), its model states bf16 (the trainer casts the model: `Job.bf16_states`);
    its nodes of 4 GPUs from the row's node cell (`cluster_for`);
  * lightning-thunder's benchmark_litgpt.py (group AI): the model cast to bf16 (`Job.bf16_states`, its gradients
    reduced in bf16), attention through SDPA (FlashAttention-2), its --shard_mode zero2 as FSDP's ZeRO-2 unit by unit
    (FSDP2 without resharding after the forward, FSDP1's SHARD_GRAD_OP: what the row's sharding cell says);
  * a Megatron-LM row run without --overlap-grad-reduce (FlagPerf's Megatron-Core 0.6 script, group AJ, passes
    neither overlap flag) exposes its distributed optimizer's reduce-scatter and all-gather; an A800 row takes the
    `a800` preset (A100's die, NVLink 400 GB/s);
  * a Megatron-LM row naming `--transformer-impl local` ran its legacy model code whatever its year (the Swallow
    team's fork of late 2023, logs of 2023-11 to 2024-01, group AK; the JUPITER suite's GPT 13B, group AR;
    `legacy_megatron`): the layout copies, RoPE and SwiGLU as torch ops (a GPT's rotary positions where the row names
    them), and a "selective" recomputation its flash path never runs;
  * NeMo Automodel (group AQ, its performance summary of 2026-04): Hugging Face-shaped models under PyTorch FSDP2
    (`Job.fsdp_copy_out`) reducing in bf16, attention through SDPA (FlashAttention-2), context parallelism as
    PyTorch's `context_parallel` (`ALLGATHER_CP_STACKS`), each layer's attention and MLP checkpointed by torch's
    non-reentrant checkpoint (`Job.recompute_early_stop`); eager unless the row names torch.compile;
  * Modalities (group AS, the scaling sweep of its throughput notebook, 2025-09): its own models under PyTorch FSDP2
    (`Job.fsdp_copy_out`; MixedPrecisionPolicy with bf16 parameters and reduction), eager unless the row names
    torch.compile, attention through SDPA (FlashAttention-2) after repeating the key / value heads, and torch's
    LayerNorm on bf16 weights: one kernel, not an fp32 upcast (`ONE_KERNEL_NORM_STACKS`, with llm-foundry's MPT).
"""

from __future__ import annotations

import re

# The software stack a row ran, read from what the row says it is (its source and model columns), never from the
# group id the CSV gives it: a held-out table of the same stack is priced as its development rows are. The first
# name found wins (Megatron-LLaMA is a Megatron-LM fork; MegaScale's source names Megatron-LM as its baseline).
STACKS = (
    ("megatron-llama", ("megatron-llama",)),
    ("megascale", ("megascale",)),
    ("torchtitan", ("torchtitan",)),
    ("fms-fsdp", ("fms-fsdp", "foundation-model-stack")),
    ("llm-foundry", ("llm-foundry", "mosaicml", "composer")),
    ("olmo-core", ("olmo-core",)),
    ("internlm", ("internlm",)),
    ("paxml", ("paxml",)),
    ("maxtext", ("maxtext",)),
    ("gpt-neox", ("gpt-neox",)),  # DeepSpeed's pipeline engine
    ("megatron-deepspeed", ("megatron-deepspeed", "bigscience")),  # DeepSpeed's pipeline engine
    # NVIDIA's NeMo Automodel: Hugging Face models under PyTorch FSDP2, not Megatron-Core (ahead of "nemo")
    ("nemo-automodel", ("automodel",)),
    ("nemo", ("megatron-bridge", "nemo")),  # NVIDIA's NeMo / Megatron-Bridge performance recipes
    ("megatron-lm", ("megatron", "korthikanti")),  # Megatron-LM itself (Korthikanti et al. 2022: its authors' runs)
    ("aa-scaling", ("aa-scaling",)),  # Aleph Alpha's Scaling library (Hagemann et al. 2023): `BLOCKING_PIPE_STACKS`
    # Ant Group's ATorch examples (dlrover's atorch/examples/llama2): Hugging Face Llama layers under PyTorch FSDP1, or
    # under DeepSpeed's pipeline engine with ATorch's tensor parallelism ("DS 3D")
    ("atorch-fsdp", ("atorch fsdp",)),
    ("atorch-ds3d", ("atorch ds 3d",)),
    ("hf-transformers", ("hugging face transformers",)),  # transformers + accelerate (YaFSDP's example)
    ("kempnerforge", ("kempnerforge",)),  # the Kempner Institute's FSDP2 / DTensor trainer
    ("lightning-thunder", ("lightning-thunder",)),  # its benchmark_litgpt.py: litgpt's models under PyTorch FSDP
    ("modalities", ("modalities",)),  # Fraunhofer IAIS' Modalities: FSDP2 of its own models, eager unless compiled
)
PYTORCH_FSDP_STACKS = ("torchtitan", "fms-fsdp")  # their "selective" checkpointing re-runs about half the forward
# Stacks recomputing through torch.utils.checkpoint without reentrancy, which stops once the tensors the backward
# needs are rebuilt (`Job.recompute_early_stop`): torchtitan's and KempnerForge's checkpoint_wrapper (NO_REENTRANT),
# ATorch's checkpoint strategy with no_reentrant, NeMo Automodel's (NO_REENTRANT around each layer's attention and MLP
# under torch.compile); the others' recompute re-runs the whole forward of a layer.
EARLY_STOP_STACKS = ("torchtitan", "kempnerforge", "atorch-fsdp", "nemo-automodel")
DEEPSPEED_PIPE_STACKS = ("gpt-neox", "megatron-deepspeed", "atorch-ds3d")
# Aleph Alpha's Scaling library, the codebase of Hagemann et al.'s sweep (group AF, "AA-Scaling"), read as its public
# releases run it (Aleph-Alpha/scaling 0.1.0 of 2024-08 and 0.2.0 of 2024-10, read at commits 78489292 and 01b9d21),
# whose configuration names are the sweep's sheets' (model_parallel_size, pipe_parallel_size,
# activation_checkpointing_type 'every_layer' / 'disabled', the softmax kernel 'torch'):
#   * its pipeline engine is DeepSpeed's instruction schedule (core/nn/pipeline_schedule/train.py), each
#     SendActivation / RecvActivation / SendGrad / RecvGrad a blocking torch.distributed.send / recv of its own
#     (core/nn/parallel_module/communicator.py `PipeCommunicator`), and its optimizer step all-reduces the
#     data-parallel gradients after the pipeline's flush (core/optimizer/optimizer.py `Optimizer.step`):
#     `BLOCKING_PIPE_STACKS`;
#   * those gradients are all-reduced whole in fp32 (allreduce.py `allreduce_tensor_in_float32`), with ZeRO-1 each rank
#     then gathering the others' updated shards (parameter_group.py `step_sequel`): `ZERO1_ALL_REDUCE_STACKS`;
#   * RoPE and SwiGLU run as torch ops (core/nn/rotary.py `apply_rotary_pos_emb`: q * cos + rotate_half(q) * sin;
#     core/nn/mlp.py `ParallelSwiGLUMLP`: silu(x) * gate): `EAGER_ROPE_SWIGLU_STACKS`;
#   * its output head is a ColumnParallelLinear left at `parallel_output=False` (transformer/model/layers/lm_head.py),
#     which all-gathers the logits over the tp ranks (core/nn/linear/column_parallel_linear.py, `all_concat`), and
#     every rank takes the cross entropy of the whole vocabulary (transformer/model/losses/cross_entropy.py):
#     `TP_LOSS_REPLICATED_STACKS`.
# Its pipeline split (uniform over the embedding, the blocks, the final norm and the head as items) loads the busiest
# stage of every AF layout as the planner's balanced split does. The sweep's two kernels the release no longer has
# (Megatron's fused softmax, flash-attn's fused RMSNorm) are read from each row.
# Stacks whose pipeline sends and receives each block (`Job.pp_p2p_serial`) and whose gradients are reduced after the
# pipeline's flush, exposed: DeepSpeed's pipeline engine and Scaling's copy of its schedule.
BLOCKING_PIPE_STACKS = (*DEEPSPEED_PIPE_STACKS, "aa-scaling")
# Stacks whose ZeRO-1 all-reduces every gradient over all data-parallel ranks and then spreads the updated shards
# (`Job.zero1_grad_all_reduce`): InternLM's HybridZeroOptimizer, Scaling's optimizer.
ZERO1_ALL_REDUCE_STACKS = ("internlm", "aa-scaling")
# Stacks that fuse their elementwise work but run RoPE and SwiGLU as torch ops (`Job.eager_ops`; Megatron-LM's legacy
# model is read apart: `published.legacy_megatron`).
EAGER_ROPE_SWIGLU_STACKS = ("aa-scaling",)
# Stacks whose tensor parallelism gathers the head's logits for a loss over the whole vocabulary on every rank
# (`Job.tp_loss_replicated`): KempnerForge's DTensor head (Replicate output), Scaling's head.
TP_LOSS_REPLICATED_STACKS = ("kempnerforge", "aa-scaling")
# Stacks sharding with PyTorch FSDP2 (`fully_shard`, per-parameter DTensor shards: torchtitan since its 2024 releases,
# OLMo-core's `apply_fsdp`); a row naming FSDP2 or fully_shard is read so too.
FSDP2_STACKS = ("torchtitan", "olmo-core", "kempnerforge", "nemo-automodel", "modalities")
# Stacks training in fp8 through torchao's float8 linear layers (dynamic tensorwise scaling), not Transformer Engine.
TORCHAO_FP8_STACKS = ("torchtitan", "olmo-core")
# Stacks attending with FlashAttention-2 kernels (flash-attn or PyTorch SDPA's flash backend), not cuDNN / TE's.
FA2_STACKS = ("torchtitan", "llm-foundry", "fms-fsdp", "olmo-core", "hf-transformers", "kempnerforge",
              "lightning-thunder", "atorch-fsdp", "atorch-ds3d", "nemo-automodel", "modalities")
# Stacks that cast the model to bf16 before training: parameters, gradients and optimizer states all 16-bit, no fp32
# master (`Job.bf16_states`).
BF16_STATE_STACKS = ("kempnerforge", "lightning-thunder")
# Stacks accumulating FSDP gradients without synchronizing until the last micro-step (`Job.fsdp_no_sync`):
# KempnerForge's training/grad.py `maybe_no_sync` (FSDP2's set_requires_gradient_sync(False) on the others).
NO_SYNC_STACKS = ("kempnerforge",)
# Stacks reducing their gradients in bf16 whatever the row says (`Job.grad_reduce_in_fp32` False): fms-fsdp's bf16
# policy (every dtype bf16); lightning-thunder's benchmark_litgpt.py, whose bf16 model's gradients are reduced as they
# are (FSDP2's MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), FSDP1 with no mixed-precision policy); ATorch's FSDP
# example, whose amp_native bf16 under FSDP becomes MixedPrecision(bf16, bf16, bf16) (atorch/auto/model_context.py);
# NeMo Automodel's FSDP2 default MixedPrecisionPolicy (reduce_dtype bf16: components/distributed/config.py).
BF16_REDUCE_STACKS = ("fms-fsdp", "lightning-thunder", "atorch-fsdp", "nemo-automodel", "modalities")
# Stacks that ran eager PyTorch unless the row says torch.compile was on (their defaults when the figures were
# published: torchtitan's `compile = false`, fms-fsdp's `--use_torch_compile=False` of Feb-Mar 2024, llm-foundry's
# Composer FSDP before torch 2.0; ATorch's examples, whose strategy lists compile nothing); the others fuse their
# elementwise work (TE / apex kernels, XLA, torch.compile).
EAGER_STACKS = ("torchtitan", "fms-fsdp", "llm-foundry", "hf-transformers", "atorch-fsdp", "atorch-ds3d",
                "nemo-automodel", "modalities")
# Stacks whose LayerNorm runs as one kernel in the activations' 16 bits (`Job.fp32_norms` False): llm-foundry's MPT
# (its default low_precision_layernorm, llmfoundry/models/layers/norm.py LPLayerNorm), Modalities (torch.nn.LayerNorm,
# its weights cast to bf16 by FSDP2's MixedPrecisionPolicy: models/gpt2/gpt2_model.py LayerNorms, model_factory.py).
ONE_KERNEL_NORM_STACKS = ("llm-foundry", "modalities")
# Stacks whose context parallelism is PyTorch's `context_parallel` (SDPA under DTensor), which all-gathers the keys and
# values (torch.distributed.tensor.experimental._attention: `_ContextParallelOptions.rotate_method` ALLGATHER by
# default): torchtitan, NeMo Automodel (its cp_utils.create_context_parallel_ctx; cp > 1 needs attn_implementation
# sdpa). The others run Megatron / Transformer Engine's p2p ring.
ALLGATHER_CP_STACKS = ("torchtitan", "nemo-automodel")
# NeMo in the containers whose launcher turned Transformer Engine's cuDNN attention off: NVIDIA's
# NeMo-Framework-Launcher from its 24.01 release to its 24.07 (launcher_scripts/conf/config.yaml, `NVTE_FUSED_ATTN: 0
# # Disable cudnn FA until we've tested it more`, from 562dcb45 of 2024-02-13 until 04b8d098 "enable fused attention"
# of 2024-08-29; its examples/training/<model>/h100/*.sh carry the layouts of NeMo's 24.07 performance table, and the
# long-context table, which names only its container, is read as run the same way). Transformer Engine then attends
# with flash-attn 2 (the containers' `pip install flash-attn`; flash-attn 3 came to it in 2024-08, 901e5d2b3). A row
# naming one of those containers (group H, AD's H100 rows) attends with FlashAttention-2.
NEMO_LAUNCHER_FA2 = re.compile(r"nemo ?24\.0[1-7](?!\d)")


def attends_with_fa2(stack: str, text: str) -> bool:
    """Whether the row's attention runs FlashAttention-2's kernels (`Job.flash_attention_2`): a stack of FA2_STACKS,
    or NeMo in a container whose launcher turned cuDNN attention off (NEMO_LAUNCHER_FA2); `text` is the row's
    (`published_rows.row_text`)."""
    return stack in FA2_STACKS or (stack == "nemo" and bool(NEMO_LAUNCHER_FA2.search(text)))


def stack_of(row: dict) -> str:
    """The software stack the row names in its source or model columns (`STACKS`, each name a whole word: "NeMo" is
    not in "Nemotron"), "" when none."""
    text = f"{row.get('source', '')} {row.get('model', '')}".lower()
    named = lambda key: re.search(rf"(?<![a-z]){re.escape(key)}(?![a-z])", text)  # noqa: E731
    return next((name for name, keys in STACKS if any(named(k) for k in keys)), "")
