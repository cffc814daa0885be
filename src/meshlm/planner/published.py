"""The planner against published training runs: each row of a table of runs priced with its own layout, and
the predicted throughput compared with the reported one.

Responsible for: reading a table of published runs (`read_runs`: the CSV of benchmarks/data/, one dict per
row), turning a row -- its cells as `published_rows` reads them: model, cluster, stack, ZeRO stage, precision,
recomputation, schedule -- into the job and layout it describes, the row's OWN layout (tp, pp, interleaving, dp,
cp, ep, ZeRO/FSDP, micro-batch, recompute, precision), never the planner's favourite --
and comparing the planner's step time with the row's figure (`predict_row`), and the medians of the errors
(`summarize`; `score_runs` does both). It compares:
  * tokens/s per GPU where the row gives it (MegaScale, NeMo, Megatron-Bridge, torchtitan): no FLOP
    convention can differ;
  * else the step time (Korthikanti 2022 gives it), else the whole run's tokens/s over its GPUs;
  * else TFLOP/s per GPU with the row's own FLOP formula (Megatron 2021: eq. 3, for that paper's rows or a row
    saying so; GPT-NeoX's 6 N + 60 s h l), else model TFLOP/s per GPU in the planner's convention (models/stats.py:
    PaLM's and Megatron's 6 N + 12 l h s, the head in, no recomputation), else MFU;
  * and, where the row prints its memory per GPU, the planner's memory of its layout in the measure the row names
    (`_memory_compared`: peak allocated, peak reserved or the device's used memory).
Rows the planner cannot express (no layout, no architecture, a GPU without a preset, no figure to compare) come
back with a "skip" and the reason; no row stops the table.
Not responsible for: any estimate (`cost.py`), the data itself (benchmarks/data/README.md says where each
row comes from), or reporting (benchmarks/planner_published.py prints the JSON; tests/test_planner_training_kinds.py
checks the medians).

Nothing is fitted to any row: the constants are those of `meshlm.planner.cluster` (each cited there). The
groups looked at while choosing them are `FIT_GROUPS`; the others are reported apart ("held_out").
Choices the rows leave open, made the same way for every row (never from the reported throughput):
  * the software stack a row ran is read from its own source and model columns (`published_stacks.stack_of`), never from
    the group id the CSV gives it, so that a held-out table of a stack gets what that stack's development rows
    get (the groups named below are where each choice was first needed);
  * tp / pp left blank: 1 beside the other named, and both 1 where the row names its data parallelism's sharding
    (`model_parallel_as_run`); a row with no layout at all is skipped, not guessed;
  * micro-batch size when not given, and interleaving depth when "v not stated": the fastest predicted
    choice that fits (fastest overall if none fits);
  * missing architectures from the published model cards / papers (`published_rows.ARCHS`, each cited);
  * GPT-style models (4h GeLU MLP, squared-ReLU for Nemotron) are mapped to SwiGLU with intermediate =
    2/3 * ffn rounded to a multiple of 128 (so tp divides it; the same parameters and FLOPs per token up to
    that rounding); Llama-family ffn sizes are SwiGLU sizes already;
  * runs of Megatron-LM before it took up FlashAttention (2023: the `--use-flash-attn` flag) use its
    unfused attention (`flash_attention=False`), and so do its 2023 runs unless the row names a fused attention
    (the flag was opt-in until Transformer Engine became the default implementation in 2024): the 2021 paper, and
    Korthikanti et al. 2022, whose
    selective recomputation exists to drop the unfused kernel's s x s scores; and
    MegaScale's Megatron-LM baseline, Megatron-LM's default core attention (`--use-flash-attn` is opt-in;
    MegaScale's "efficient operators" (its Sec. 3) list FlashAttention-2 among its changes over that baseline);
  * NVIDIA's NeMo / Megatron-Bridge rows that say "DDP (FSDP=0)" or nothing use Megatron's
    distributed optimizer (ZeRO-1), the default of their recipes; "FSDP" rows ZeRO-3;
    Megatron-Bridge tables with the precision column blank are the FP8 recipe tables;
  * DP communication exposed for Megatron-LM before 2023 (2021/2022 papers, MegaScale's baseline);
  * torchtitan's A100 table ran eager (`fused_elementwise=False`);
  * TP communication overlapped with GEMMs where the stack does it (MegaScale's runs, NVIDIA's recipes);
  * NVIDIA's NeMo / Megatron-Bridge performance recipes keep and reduce gradients in bf16 (they set
    `grad_reduce_in_fp32 = False`); the others in fp32;
  * NVIDIA's MoE recipes: routed experts not tensor-parallel (`expert_tensor_parallel_size = 1` in every
    Megatron-Bridge MoE performance config: `Layout.expert_tp = 1`, so ep may span the tp ranks), and the
    expert all-to-all overlapped (`moe_a2a_overlap`: `Job.ep_comm_overlap`) wherever Megatron-Core allows
    it (ep > 1, no full recompute, a virtual pipeline when pp > 1), as the late-2025 H100 configs set it
    for DeepSeek-V3 and both Qwen3 models; GPT-OSS (pp 4, no virtual pipeline) runs without. Older
    containers' recipes set it for DeepSeek-V3 only, so the rule overlaps three rows that likely ran
    exposed (Qwen3-30B in 25.09 and 25.11, Qwen3-235B in 25.09): their predictions are too fast by that;
  * recompute blank: none (the NeMo/Megatron-Bridge performance recipes), except the MegaScale rows,
    which run Megatron's selective recomputation with sequence parallelism (MegaScale Sec. 3.2);
  * torchtitan's "selective layer" / "selective op" checkpointing re-runs about half of the forward
    (`HALF_RECOMPUTE`): the mean of the no-recompute and full-recompute estimates; fms-fsdp's "selective AC"
    (a fraction of the blocks checkpointed, the fraction not published) the same;
  * PyTorch FSDP's HYBRID_SHARD ("HSDP"): ZeRO-3 over the 8 GPUs of a node, replicated across nodes;
  * the row's scale-out bandwidth per GPU where it names one (`cluster_for`), a measured figure over the link
    efficiency where one was published (Jean Zay's Omni-Path: 135 Gbps per node measured, groups R and S);
    A100 40GB rows the `a100-40gb` preset;
  * llm-foundry's tables ran eager PyTorch (Composer FSDP, before torch.compile: the README's "update with
    torch 2.0" note) and reduce gradients in bf16 with mixed_precision PURE (fp32 with DEFAULT); fms-fsdp
    reduces in bf16 (its bf16 mixed-precision policy) and ran eager for the README's tables of Feb-Mar 2024
    (`--use_torch_compile=False` in its scripts/train.sh then), compiled for the table of 2024-05-09 ("numbers
    are updated with torch.compile": rows whose `source` names torch.compile);
  * eager norms in fp32 (torchtitan's and fms' RMSNorm upcast, as meshlm's does), except MPT's, whose
    low-precision LayerNorm is one bf16 kernel (`Job.fp32_norms`);
  * the PyTorch-native stacks (torchtitan, also in the float8 / FSDP2 blog; llm-foundry, fms-fsdp), and NeMo in the
    containers whose launcher turned cuDNN attention off, attend with FlashAttention-2 kernels (`Job.flash_attention_2`:
    slower on Hopper), NVIDIA's other recipes with cuDNN / Transformer Engine's;
  * the loss as Megatron's vocab-parallel cross entropy runs it op by op, 52 bytes per logit with bf16 logits
    (`timing.loss_time`); NVIDIA's recipes with Megatron-Core's fused one (`Job.cross_entropy_fusion`: their
    configs set cross_entropy_loss_fusion), 28;
  * recompute "not stated" (the float8 / FSDP2 blog, group T): none, half and full each tried, the fastest that
    fits kept (`recompute_choices`), as for a micro-batch size not given;
  * DeepSpeed's fp16 ZeRO-1 (GPT-NeoX; BigScience's fp16 topology benchmark, group S) reduces the fp16
    gradients as they are (its communication data type defaults to the gradients'); BLOOM-176B's BF16_Optimizer
    accumulates and reduces them in fp32;
  * GPT-NeoX and BLOOM (DeepSpeed's pipeline engine) reduce gradients after the flush, exposed; GPT-NeoX's
    TFLOP/s are its own count of the time, 6 N + 60 s h l per token (BLOOM's row gives its step time); each
    pipeline send and receive is a blocking transfer of its own (`Job.pp_p2p_serial`), and under tensor parallelism
    moves the tp rank's slice of the activation, gathered over the tp ranks on receipt (`Job.pp_partitioned_sends`:
    the engine's pipe_partitioned / grad_partitioned); BLOOM's
    partition counts the embedding as a block ('type:transformer|embedding'): the planner's balanced split;
  * Megatron-LM's own pipeline split for the Megatron-LM / NeMo 24.07 rows (groups A, C, E, H) and
    DeepSpeed's "type:transformer" partition (GPT-NeoX, group Q; BigScience's 02-25 benchmark, group S): num_layers /
    stages blocks on every stage, the head and loss on top of the last (`Layout.pp_split = "uniform"`);
    Megatron-Bridge's recipes (group I) lighten the end stages where the layer count does not divide
    (`account_for_embedding_in_pipeline_split` / `..._loss_...`): the planner's balanced split;
  * the JAX / XLA stacks of NVIDIA's DGX Cloud recipes (MaxText, groups U and V; Paxml, group W) and of its
    JAX-Toolbox READMEs (Paxml, group X; MaxText, group Y), from each recipe's own configure.sh / run script:
    elementwise work fused (XLA compiles the step, its fusion passes), attention in cuDNN's fused kernel
    (MaxText `attention=cudnn_flash_te`; Paxml `ENABLE_TE=1`, `NVTE_FUSED_ATTN=1`), the FSDP all-gathers and
    gradient reduce-scatters overlapped with compute (XLA flags `--xla_gpu_enable_latency_hiding_scheduler=true`,
    `--xla_gpu_enable_pipelined_all_gather=true`, `..._pipelined_reduce_scatter=true`), gradients of the fp32
    parameters reduced in fp32 (MaxText's default `weight_dtype: float32`; Paxml's fp32 parameters, bf16
    `FPROP_DTYPE`): the planner's defaults for all four;
  * "FSDP=<n> x DP=<k>" (the JAX recipes' fsdp and data mesh axes): parameters sharded over n GPUs, replicated
    k times (`shard_degree`), as HSDP with a shard group of n;
  * a remat policy that keeps some projections and re-runs the rest, its recompute cell stating the share of the
    forward it re-runs (MaxText's `save_dot_except_mlpwi`, about 57%; Paxml's `SAVE_QKV_OUT_PROJ`, about 67%;
    MaxText's `save_dot_except_mlp`, about 83%, and `save_qkv_proj`, about 90%): the no-recompute and full-recompute
    estimates weighted by that share (`recompute_fraction`, as for some layers checkpointed); "partial" without a
    share as `HALF_RECOMPUTE`; Paxml's `SAVE_NOTHING` as full recomputation; Paxml's `SAVE_DOT_ONLY` and
    `SAVE_DOT_WITH_NO_BATCH_DIM` (every projection output kept, the fused attention and the elementwise ops
    re-run) as selective recomputation that re-runs all the elementwise work (`Job.remat_saves_dots`; Megatron's
    re-runs about half); MaxText's `minimal_flash` (the attention output kept too) as
    none. The CSV's recompute column names the policy and its share;
  * InternLM's Hybrid ZeRO (group Z) "zero1=<n>": ZeRO-1 with the optimizer states sharded over n data-parallel
    ranks (one node) and replicated across the groups (`shard_degree`; zero1=-1: over all of them), its gradient and
    parameter syncs overlapped (`overlap_sync_grad` / `overlap_sync_param` in its configs/7B_sft.py), FlashAttention,
    fused kernels: the planner's defaults; its gradients all-reduced over every data-parallel rank and its updated
    shards broadcast, rank by rank (`Job.zero1_grad_all_reduce`, `job_of` cites its optimizer); its packed samples of
    micro_bsz x 2048 tokens read as micro_bsz sequences;
  * what each software stack named since runs -- Megatron-LLaMA, OLMo-core, PyTorch FSDP2 and SHARD_GRAD_OP,
    DeepSpeed's ZeRO-3 before v0.6, torchao's float8, Paxml, Aleph Alpha's Scaling, Hugging Face with accelerate,
    ATorch, KempnerForge, lightning-thunder, FlagPerf's Megatron-Core, the Swallow team's Megatron-LM, NeMo
    Automodel -- is listed stack by stack in `published_stacks`' module docstring, beside the stack names it reads.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import replace
from pathlib import Path

from meshlm.config import ModelConfig
from meshlm.planner.cluster import GiB
from meshlm.planner.cost import MIN_HEADROOM, Estimate, Job, Layout, ModelSummary, estimate_layout, validate_layout
from meshlm.planner.memory import memory_measures
from meshlm.planner.published_rows import (cell_float, cell_int, cluster_for, compiled, gpt_style, hybrid_shard,
                                           interleaved, issue_kind, memory_of, model_of, moe_comm_as_run, nvidia_recipe,
                                           precision_of, predict_each, read_table, recompute_choices,
                                           recompute_fraction, recompute_of, recomputes_mla_up_proj, row_text,
                                           schedule_named, seq_len_of, shard_degree, source_year, token_count,
                                           zero_of)
from meshlm.planner.published_stacks import (ALLGATHER_CP_STACKS, BF16_REDUCE_STACKS, BF16_STATE_STACKS,
                                             BLOCKING_PIPE_STACKS, DEEPSPEED_PIPE_STACKS, EAGER_ROPE_SWIGLU_STACKS,
                                             EAGER_STACKS, EARLY_STOP_STACKS, FSDP2_STACKS, NO_SYNC_STACKS,
                                             ONE_KERNEL_NORM_STACKS, TORCHAO_FP8_STACKS, TP_LOSS_REPLICATED_STACKS,
                                             ZERO1_ALL_REDUCE_STACKS, attends_with_fa2, stack_of)

# The groups looked at while choosing the planner's constants; the others are held out (reported
# separately, never looked at row by row while adjusting the model).
FIT_GROUPS = ("A_megatron2021_weak_scaling", "E_megascale_175b_strong_scaling", "I_megatron_bridge_h100")


def read_runs(path: str | Path) -> list[dict]:
    """The rows of a published-runs CSV (benchmarks/data/published_runs_dev.csv's columns; a column it lacks reads
    as blank: `published_rows.read_table`)."""
    return read_table(path)


def score_runs(rows: list[dict]) -> tuple[list[dict], dict]:
    """Every row predicted (`predict_row`) and the medians of their errors (`summarize`). A row the planner fails on
    is reported as skipped with the error, not left to stop the table."""
    results = predict_each(rows, predict_row, ("row_id", "group", "model"))
    return results, summarize(results)


def eq3_flops_per_step(cfg: ModelConfig, job: Job) -> float:
    """Megatron-LM's eq. 3 (Narayanan et al. 2021): 96 B s l h^2 (1 + s / 6h + V / 16 l h) FLOPs a step, for the row's
    global batch B of sequences of s tokens through l layers of width h and a vocabulary of V."""
    B, s, l, h, V = job.global_batch_size, job.seq_len, cfg.num_layers, cfg.hidden_size, cfg.vocab_size  # noqa: E741
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def job_of(row: dict, cfg: ModelConfig) -> Job:
    """The row's job: its sequence, batch and precision, and what its software stack overlaps and fuses."""
    n = cell_int(row["n_gpus"])
    year, text = source_year(row), row_text(row)
    # The global batch in sequences, or its tokens over the sequence length ("16M tokens"), else a micro-batch per GPU.
    gbs_tokens = token_count(row.get("gbs_tokens", ""))
    gbs = (cell_int(row["gbs_seqs"]) or (gbs_tokens // seq_len_of(row) if gbs_tokens else 0)
           or (cell_int(row["mbs"]) or 1) * n)
    # TP communication overlapped with the GEMMs: MegaScale's own runs (its Sec. 3.3), and NVIDIA's NeMo /
    # Megatron-Bridge recipes (`tp_comm_overlap` on in their performance configs); not Megatron 2021/2022
    # nor MegaScale's Megatron-LM baseline.
    nvidia = nvidia_recipe(row)
    # A row that names it ("async TP": torchtitan's enable_async_tensor_parallel; Megatron's --tp-comm-overlap) too.
    named_overlap = re.search(r"(?<!no )(async(hronous)? (tp|tensor[ -]parallel)|tp[-_]comm[-_]overlap)", text)
    overlap = "(megascale)" in row["model"].lower() or nvidia or bool(named_overlap)
    # Gradient all-reduce after the backward, exposed: Megatron-LM before `--overlap-grad-reduce` (2023),
    # i.e. the 2021 / 2022 papers and MegaScale's Megatron-LM baseline (overlapping it is MegaScale's Sec. 3.3).
    megascale_baseline = "(megatron-lm)" in row["model"].lower()
    # DeepSpeed's pipeline engine (GPT-NeoX, BLOOM) likewise reduces the gradients after the pipeline flush.
    # (S: BigScience's topology benchmark of 2022-02, the same engine and Megatron-DeepSpeed.) So does Aleph Alpha's
    # Scaling (group AF), whose pipeline runs DeepSpeed's schedule (`BLOCKING_PIPE_STACKS`).
    stack = stack_of(row)
    deepspeed_pipe = stack in DEEPSPEED_PIPE_STACKS
    blocking_pipe = stack in BLOCKING_PIPE_STACKS
    # Megatron-LLaMA's rows with Megatron-LM's own DistributedOptimizer (group AB): its README, "the solution provided
    # by Megatron-LM does not fully overlap GPU computation with communication" (its OverlappedDistributedOptimizer does).
    megatron_llama_plain = stack == "megatron-llama" and "overlapped" not in row["zero_fsdp"].lower()
    # A Megatron-LM row whose script passes neither --overlap-grad-reduce nor --overlap-param-gather (Megatron-Core's
    # defaults were off: FlagPerf's Llama 3 8B, group AJ), or a Megatron-Bridge recipe setting overlap_grad_reduce False
    # (group AL's DeepSeek-V3 on H100), says so: its distributed optimizer's collectives run exposed.
    no_overlap_flags = bool(re.search(r"without --overlap-grad-reduce|overlap_grad_reduce false", text))
    megatron_old = ((stack == "megatron-lm" and year < 2023) or blocking_pipe or megascale_baseline
                    or megatron_llama_plain or no_overlap_flags)
    # torchtitan's published A100 figures ran eager PyTorch (torch.compile off, its default then): one
    # memory pass per elementwise op. fms-fsdp's README figures before its revision of 2024-05-09 ran eager too
    # (scripts/train.sh: --use_torch_compile=False; its configuration doc then: "recommended to NOT use compile at
    # this stage"); that revision's table ("numbers are updated with torch.compile") compiled.
    # (`compiled`: what the row says; `EAGER_STACKS`: those stacks' defaults then.)
    says = compiled(row)
    eager = says is False or (says is None and stack in EAGER_STACKS)
    # Gradients reduced in 16 bits: llm-foundry's FSDP mixed_precision PURE, `BF16_REDUCE_STACKS`, DeepSpeed's fp16
    # ZeRO-1 optimizer (GPT-NeoX, BigScience's fp16 benchmark: fp16 gradients, reduced in their own dtype, DeepSpeed's
    # communication_data_type default); BLOOM-176B's BF16_Optimizer reduces fp32 ones.
    bf16_reduce = ("pure" in row["precision"].lower() or stack in BF16_REDUCE_STACKS
                   or (deepspeed_pipe and "fp16" in row["precision"].lower()))
    # The JAX / XLA recipes (MaxText, groups U, V and Y; Paxml, groups W and X) take the defaults: XLA fuses the
    # elementwise work, cuDNN's fused attention (not FA2), the FSDP collectives overlapped by XLA's latency-hiding
    # scheduler, fp32 gradients (fp32 parameters); the module docstring cites each recipe's setting.
    # LayerNorm as one kernel in bf16 (`ONE_KERNEL_NORM_STACKS`: MPT's low_precision_layernorm, Modalities'
    # nn.LayerNorm on FSDP2's bf16 parameters); the Llama stacks' RMSNorm upcasts to fp32.
    one_kernel_norm = stack in ONE_KERNEL_NORM_STACKS
    # Paxml's GPT configs (groups W, X): the tied embedding looked up as a one-hot matmul (paxml
    # tasks/lm/params/c4.py TransformerLmSpmdAdam: EMBEDDING_LOOKUP_STYLE = 'matmul', SEPARATE_EMBEDDING False;
    # scripts_gpu/configs.py configure_gpt3_task sets it on the shared softmax; praxis
    # SharedEmbeddingSoftmax.emb_lookup: jax.nn.one_hot(ids, num_classes) @ emb_var); the 5B drops the input of
    # each of its 24 repeated one-layer blocks (configs.py GPT5BBase.task: input_dropout_prob = 0.1, applied by
    # praxis' StackedTransformer before its layer; DROPOUT_PROB 0.0 leaves attention / residual dropout off,
    # also inside Transformer Engine's layer: praxis te_helper). MaxText looks rows up (nn.Embed).
    paxml = stack == "paxml"
    paxml_5b = paxml and row["model"].lower().startswith("gpt-3 5b")
    # Their "selective" rows run praxis' SAVE_DOT_ONLY (W: the recipe's paxml_mod_configs.py) or
    # SAVE_DOT_WITH_NO_BATCH_DIM (X: configs.py GPT5BBase): only dot outputs kept (praxis
    # layers/checkpoint_policy.py custom_policy), every other op re-run.
    dots_saved = paxml and recompute_of(row) == "selective"
    # InternLM's HybridZeroOptimizer (group Z) all-reduces every gradient bucket over the whole data-parallel group
    # (hybrid_zero_optim.py `_reduce_and_copy`: reduce_tensor with dst_rank None, an all-reduce) and broadcasts each
    # rank's updated shard (`broadcast_params`): `Job.zero1_grad_all_reduce` (Scaling's too: `ZERO1_ALL_REDUCE_STACKS`).
    # KempnerForge's tensor parallelism gathers the head's logits for a loss over the whole vocabulary on every rank
    # (its distributed/tensor_parallel.py: "Output head: ColwiseParallel (split vocab, gather to Replicate for loss)"):
    # `tp_loss_replicated` (so does Scaling's head: `TP_LOSS_REPLICATED_STACKS`). It casts the model to bf16 before
    # training (scripts/train.py), as lightning-thunder's benchmark_litgpt.py does (`init_model`:
    # model.to(dtype=torch.bfloat16)): `bf16_states` (`BF16_STATE_STACKS`).
    # A Megatron-Bridge recipe keeping its Adam moments in bf16 (precision-aware optimizer) says so: `bf16_moments`.
    # NVIDIA's recipes run Megatron-Core's fused cross entropy (`Job.cross_entropy_fusion`): NeMo-Framework-Launcher's
    # base configs (e.g. auto_configurator/base_configs/llama3_8b.yaml) and NeMo 2.0's GPTConfig set
    # cross_entropy_loss_fusion, Megatron-Bridge's GPT provider defaults it on. The others are priced op by op; XLA
    # fuses MaxText's and Paxml's loss too, not counted apart (priced as fused, their rows would move under a point).
    return Job(seq_len=seq_len_of(row), global_batch_size=gbs, precision=precision_of(row),
               tp_comm_overlap=overlap, dp_comm_overlap=not megatron_old, fused_elementwise=not eager,
               grad_reduce_in_fp32=not (nvidia or bf16_reduce), **moe_comm_as_run(row, cfg, nvidia=nvidia),
               fp32_norms=not one_kernel_norm, pp_p2p_serial=blocking_pipe,
               pp_partitioned_sends=deepspeed_pipe, embedding_gemm=paxml,
               unfused_dropouts=1 if paxml_5b else 0, remat_saves_dots=dots_saved,
               zero1_grad_all_reduce=stack in ZERO1_ALL_REDUCE_STACKS,
               tp_loss_replicated=stack in TP_LOSS_REPLICATED_STACKS, bf16_states=stack in BF16_STATE_STACKS,
               bf16_moments=bool(re.search(r"bf16 (main gradients and )?adam moments", text)),
               cross_entropy_fusion=nvidia, recompute_early_stop=stack in EARLY_STOP_STACKS,
               recompute_mla_up_proj=recomputes_mla_up_proj(row, cfg), fsdp_no_sync=stack in NO_SYNC_STACKS,
               **_attention_and_ops(row, stack, year, text, megascale_baseline=megascale_baseline),
               **_sharding_and_fp8(row, stack, year, text))


def _attention_and_ops(row: dict, stack: str, year: int, text: str, *, megascale_baseline: bool) -> dict:
    """`job_of`'s attention kernel and the ops a fusing stack still runs one by one: Job fields."""
    # FlashAttention from 2023 on; Megatron-LM's own runs only where the row names it until its Transformer Engine
    # default (`--use-flash-attn` was opt-in from 2022-12-08, commit d693034e; `--transformer-impl` defaults to
    # transformer_engine, whose attention is fused, from 2024-04-02, commit e7b74a4b): a 2023 Megatron-LM row that
    # does not say otherwise ran Megatron's own softmax kernel.
    fused_attention = r"(flash|fused attention|cudnn attention|transformer engine)"
    names_flash = bool(re.search(r"(?<!no )(?<!without )(?<!w/o )" + fused_attention, text))
    names_unfused = bool(re.search(r"unfused attention|attention unfused", text))  # a softmax over the scores
    flash = (year >= 2023 and not megascale_baseline and not names_unfused
             and (stack != "megatron-lm" or year >= 2024 or names_flash))
    # FlashAttention-2 kernels: the PyTorch-native stacks (torchtitan's and fms-fsdp's SDPA flash backend, llm-foundry's
    # flash-attn 2 / triton kernels; OLMo-core's compiled model, group AA, through SDPA's FA2 kernel), and NeMo where
    # its launcher turned cuDNN attention off (2024-02 to 2024-08); NVIDIA's other recipes run cuDNN / TE attention.
    fa2 = attends_with_fa2(stack, text)
    # Megatron-LLaMA (group AB; its megatron/model/transformer.py, rotary_pos_embedding.py and
    # examples/LLaMA/LLaMA_13_slurm.sh at e3d671a): flash-attn 1.x (`flash_attn_unpadded_func`; its README promises
    # FlashAttention-2 "in the future") and --no-gradient-accumulation-fusion. Like Megatron-LM's own legacy model until
    # 2024 (megatron/model/transformer.py, e.g. at cfbf55d7, 2023-08), it copies q, k, v into flash-attn's layout and
    # the output back, and runs the rotary embedding and SwiGLU as torch ops (its norms are apex's fused kernels; a
    # GPT-style model has no SwiGLU, and rotary positions only where the row names them: the JUPITER suite's GPT 13B).
    # A row naming the first FlashAttention or that flag is read the same way.
    megatron_llama = stack == "megatron-llama"
    fa1 = megatron_llama or bool(re.search(r"flash-?att(entio)?n[ -]?(v|version ?)?1(\.\d+)*(?![\d.])", text))
    eager_ops = frozenset()
    if legacy_megatron(row):  # the layout copies on its flash path only; RoPE and SwiGLU where the model has them
        gpt = gpt_style(row)  # learned positions unless the row names rotary ones (--position-embedding-type rope)
        rope = not gpt or bool(re.search(r"position-embedding-type rope|rotary", text))
        eager_ops = frozenset(({"attention_layout"} if flash else set()) | ({"rope"} if rope else set())
                              | (set() if gpt else {"swiglu"}))
    if stack in EAGER_ROPE_SWIGLU_STACKS:  # Aleph Alpha's Scaling: RoPE and SwiGLU as torch ops
        eager_ops = eager_ops | {"rope", "swiglu"}
    # A row whose RMSNorm ran as torch ops (in fp32, as Llama's reference code writes it) though the rest is fused.
    if re.search(r"rms ?norm as torch ops", text):
        eager_ops = eager_ops | {"rmsnorm"}
    wgrad_fusion = not (megatron_llama or "no-gradient-accumulation-fusion" in text)
    return dict(flash_attention=flash, flash_attention_2=fa2, flash_attention_1=flash and fa1, eager_ops=eager_ops,
                gradient_accumulation_fusion=wgrad_fusion)


def _sharding_and_fp8(row: dict, stack: str, year: int, text: str) -> dict:
    """`job_of`'s data-parallel sharding as the stack runs it, and how it gets fp8 weights: Job fields."""
    # PyTorch FSDP2's all-gather copy-out on the compute stream (`Job.fsdp_copy_out`): torchtitan, OLMo-core (groups K,
    # T, AA), or a row naming FSDP2 / fully_shard.
    fsdp2 = stack in FSDP2_STACKS or bool(re.search(r"\bfsdp-?2\b|fully_shard", text))
    # fp8 through torchao (torchtitan, OLMo-core, a row naming torchao; `Job.fp8_weights`): every forward casts the
    # weights (torchtitan's --float8.enable_fsdp_float8_all_gather is off by default, its config_manager.py of 2024),
    # or each rank its shard before FSDP gathers them in fp8 (OLMo-core's Float8Config at e27ba7455:
    # enable_fsdp_float8_all_gather=True; a row naming the float8 all-gather). Transformer Engine caches them, except
    # under NVIDIA's recipes, whose fp8 precision configs (NeMo's and Megatron-Bridge's mixed_precision.py:
    # bf16_with_fp8_mixed and its current-scaling / MXFP8 kin) set fp8_param_gather = True: fp8 parameters.
    torchao = stack in TORCHAO_FP8_STACKS or "torchao" in text
    fp8_gathered = stack == "olmo-core" or bool(re.search(r"(float8|fp8)[ _-]all[ _-]?gather", text))
    fp8_weights = (("fsdp_all_gather" if fp8_gathered else "dynamic") if torchao
                   else "params" if nvidia_recipe(row) else "cached")
    # ZeRO-3 in 2021 or before, not FSDP (FairScale's / PyTorch's), is DeepSpeed's before v0.6 -- as is a row naming a
    # DeepSpeed 0.x release before 0.6: its gathers one per tensor and synchronous (`Job.zero3_serial_gathers`).
    sharding = (row.get("zero_fsdp") or "").lower()
    old_deepspeed = bool(re.search(r"deepspeed v?0\.[0-5](\.\d+)?\b", text))
    serial_z3 = (zero_of(row) == 3 and not re.search(r"fsdp|fully.?shard", sharding)
                 and (year <= 2021 or old_deepspeed))
    # ZeRO-2 as PyTorch FSDP's SHARD_GRAD_OP (llm-foundry's Composer rows): collectives unit by unit
    # (`Job.zero2_unit_collectives`).
    fsdp_z2 = zero_of(row) == 2 and "shard_grad_op" in sharding
    return dict(fsdp_copy_out=fsdp2, fp8_weights=fp8_weights, zero3_serial_gathers=serial_z3,
                zero2_unit_collectives=fsdp_z2)


def legacy_megatron(row: dict) -> bool:
    """Megatron-LM's legacy model code: Megatron-LM's own runs before Transformer Engine became its default
    implementation (2024) or that name its local implementation (`--transformer-impl local`, the Swallow logs of
    group AK), and Megatron-LLaMA's fork of it."""
    stack = stack_of(row)
    local = re.search(r"transformer[-_]impl(ementation)?[ =]+local", row_text(row))
    return stack == "megatron-llama" or (stack == "megatron-lm" and (source_year(row) < 2024 or bool(local)))


def recompute_as_run(rc: str, row: dict, job: Job) -> str:
    """The recomputation a row's code runs for the one it names: Megatron-LM's legacy attention checkpoints its core
    only on its non-flash path (`checkpoint_core_attention` is not consulted when `use_flash_attn`), so with flash
    attention its "selective" recomputes nothing."""
    return "none" if rc == "selective" and job.flash_attention and legacy_megatron(row) else rc


def layouts_of(row: dict, cfg: ModelConfig, rc: str | None = None) -> list[Layout]:
    """The layouts the row describes: its own degrees, with each micro-batch size and interleaving depth it
    leaves open, recomputing as `rc` (default: as the row says; "half" is priced as the mean of "none" and
    "full": `predict_row`)."""
    n = cell_int(row["n_gpus"])
    tp, pp = cell_int(row["tp"]), cell_int(row["pp"])
    cp, ep = cell_int(row["cp"]) or 1, cell_int(row["ep"]) or 1
    dp = cell_int(row["dp"]) or n // (tp * pp * cp)
    if dp < 1:
        raise ValueError(f"row {row['row_id']}: tp x pp x cp = {tp * pp * cp} exceeds its {n} GPUs")
    vpp_text = row["vpp"].strip().lower()
    rc = rc or recompute_of(row)
    named = schedule_named(row)
    if cell_int(vpp_text, 1) > 1:
        schedules = [("interleaved", cell_int(vpp_text))]
    elif interleaved(row):  # v not stated: each depth tried
        schedules = [("interleaved", c) for c in range(2, 9) if pp * c <= cfg.num_layers]
    elif named in ("gpipe", "zero_bubble"):
        schedules = [(named, 1)]
    else:
        schedules = [("1f1b", 1)]
    mbs_given = cell_int(row["mbs"])
    mbs_list = [mbs_given] if mbs_given else [1, 2, 4, 8]
    # Sequence parallelism: as the row says; NVIDIA's recipes turn it on with tp > 1 for dense models.
    sp_text = row["sp"].strip().lower()
    # (Megatron-Core requires it for MoE with tp > 1.)
    sp = sp_text.startswith("yes") or (not sp_text and tp > 1)
    # NVIDIA's MoE recipes: experts not tensor-parallel (expert_tensor_parallel_size = 1 in every
    # Megatron-Bridge MoE performance config).
    nvidia_moe = nvidia_recipe(row) and cfg.is_moe
    # Megatron-LM (the 2021 / 2022 papers, MegaScale, NeMo 24.07) gives every pipeline stage num_layers / stages
    # blocks, the output head and loss on top of the last (its num_layers % pipeline size == 0 rule; the options
    # that lighten the end stages came to Megatron-Core later and are set by newer recipes, e.g. Megatron-Bridge's).
    # DeepSpeed's pipeline (GPT-NeoX, partition method "type:transformer") splits the blocks evenly too.
    stack = stack_of(row)
    # Where the layers do not divide into the stages, those splits cannot be even: the balanced one (DeepSpeed's
    # partitioner then, BLOOM's 70 layers over 12 stages; Megatron-LM refuses such a layout).
    uniform = (stack in ("megatron-lm", "megascale", *DEEPSPEED_PIPE_STACKS)
               or (stack == "nemo" and "megatron-bridge" not in row["source"].lower()))
    split = "uniform" if uniform and cfg.num_layers % pp == 0 else "balanced"
    # HSDP: shard within a node (its 8 GPUs), replicate across nodes; the JAX recipes' "FSDP=<n> x DP=<k>": over n;
    # InternLM's "zero1=<n>": the optimizer states over n.
    shard = shard_degree(row) or (min(dp, 8) if hybrid_shard(row) else dp)
    if dp % shard:
        raise ValueError(f"row {row['row_id']}: FSDP degree {shard} does not divide the data parallelism {dp}")
    # Context parallelism as the stack runs it: DeepSpeed-Ulysses' all-to-alls where the row names them; PyTorch's
    # context_parallel all-gathers the keys and values (`ALLGATHER_CP_STACKS`); else Megatron / TE's p2p ring.
    cp_method = ("ulysses" if "ulysses" in row_text(row) else "allgather" if stack in ALLGATHER_CP_STACKS else "ring")
    return [Layout(dp_shard=shard, dp_replicate=dp // shard, tp=tp, pp=pp if pp > 1 else 1, cp=cp, ep=ep, zero_stage=zero_of(row),
                   cp_method=cp_method if cp > 1 else "ring",
                   pp_schedule=sched if pp > 1 else "1f1b", pp_chunks=v if pp > 1 else 1,
                   micro_batch_size=mbs, sequence_parallel=sp, pp_split=split, expert_tp=1 if nvidia_moe else 0,
                   recompute="none" if recompute_fraction(rc) is not None else rc)
            for mbs in mbs_list for sched, v in schedules]


def _mixed_recompute_estimate(pair: list, cluster, rc: str) -> Estimate:
    """The no-recompute and full-recompute estimates of one layout (`pair`, time and memory by component) weighted
    by the share of the forward `rc` re-runs (`recompute_fraction`), fitting as the planner decides
    (`cost.MIN_HEADROOM`); labelled with `rc`."""
    (a, b), w = pair, recompute_fraction(rc)
    time_s = {k: (1 - w) * a.time_s[k] + w * b.time_s[k] for k in a.time_s}
    mem = {k: (1 - w) * a.memory_gib[k] + w * b.memory_gib[k] for k in a.memory_gib}
    fits = mem["total"] * GiB <= cluster.hbm_bytes * (1 - MIN_HEADROOM)
    return replace(a, layout=replace(a.layout, recompute=rc), time_s=time_s, memory_gib=mem, fits=fits)


def _eq3_row(row: dict) -> bool:
    """TFLOP/s counted by Megatron-LM's eq. 3 (Narayanan et al. 2021): the row says so, or it is that paper's."""
    kind = row["pct_peak_type"].lower()
    return "eq.3" in kind or "eq. 3" in kind or "2104.04473" in row["source"] or "narayanan et al. 2021" in row["source"].lower()


def _compare(row: dict, cfg: ModelConfig, job: Job, *, step: float, n: int, model_flops_per_token: float,
             peak: float) -> tuple[str, float, float] | None:
    """(metric, measured, predicted) of a row with the planner's step time: tokens/s per GPU, else 1 / step time, else
    the whole run's tokens/s over its GPUs, else TFLOP/s per GPU by the row's own FLOP formula (Megatron 2021's eq. 3,
    GPT-NeoX's 6 N + 60 s h l), else model TFLOP/s per GPU (the planner's convention, `models/stats.py`: PaLM's and
    Megatron's 6 N + 12 l h s, the head included, no recomputation), else MFU; None when the row gives none."""
    tok_gpu = cell_float(row["tokens_per_s_per_gpu"])
    if tok_gpu:
        return "tokens_per_s_per_gpu", tok_gpu, job.tokens / step / n
    if cell_float(row["step_time_s"]):
        return "1/step_time", 1 / cell_float(row["step_time_s"]), 1 / step
    tok_total = cell_float(row.get("tokens_per_s_total", ""))
    if tok_total:
        return "tokens_per_s_per_gpu(total)", tok_total / n, job.tokens / step / n
    tflops, kind = cell_float(row["tflops_per_gpu"]), row["pct_peak_type"]
    if tflops and "6 N + 60 s h l" in kind and cell_float(row["params_b"]):  # GPT-NeoX's own count (N: its params_b)
        B, s, l, h = job.global_batch_size, job.seq_len, cfg.num_layers, cfg.hidden_size  # noqa: E741
        flops = B * s * (6 * cell_float(row["params_b"]) * 1e9 + 60 * s * h * l)
        return "tflops_per_gpu(6N+60shl)", tflops, flops / step / n / 1e12
    if tflops and _eq3_row(row):
        return "tflops_per_gpu(eq.3)", tflops, eq3_flops_per_step(cfg, job) / step / n / 1e12
    model_tflops = model_flops_per_token * job.tokens / step / n / 1e12
    if tflops:
        return "tflops_per_gpu(model FLOPs)", tflops, model_tflops
    mfu = cell_float(row["pct_peak"])
    if mfu and "mfu" in kind.lower():
        return "mfu", mfu / 100, model_tflops * 1e12 / peak
    return None


def model_parallel_as_run(row: dict) -> dict:
    """tp and pp where a row leaves one or both blank: the other named, the blank one is 1 (no tensor / no pipeline
    parallelism); both blank, 1 and 1 where the row names its data parallelism's sharding (FSDP, ZeRO-n, "DDP":
    such runs shard or replicate the whole model unless they name a model-parallel degree); otherwise left blank --
    a Megatron run whose layout the source does not print is not guessed."""
    tp, pp = cell_int(row["tp"]), cell_int(row["pp"])
    if tp or pp:
        return {**row, "tp": str(tp or 1), "pp": str(pp or 1)}
    if row["zero_fsdp"].strip():
        return {**row, "tp": "1", "pp": "1"}
    return row


def predict_row(row: dict) -> dict:
    """One row with its own layout: the planner's prediction of the row's metric and its error (predicted /
    measured - 1), or a "skip" with the reason the planner cannot express the row."""
    base = {"row_id": row["row_id"], "group": row["group"], "model": row["model"]}
    n = cell_int(row["n_gpus"])
    if not n:
        return {**base, "skip": "the row gives no GPU count"}
    row = model_parallel_as_run(row)
    if not cell_int(row["tp"]) or not cell_int(row["pp"]):
        return {**base, "skip": "the row gives no parallel layout"}
    try:
        cfg = model_of(row)
        cluster = cluster_for(row)
        job = job_of(row, cfg)
        rcs = dict.fromkeys(recompute_as_run(rc, row, job) for rc in recompute_choices(row))
        layouts = [(rc, lo) for rc in rcs for lo in layouts_of(row, cfg, rc)]
    except (LookupError, ValueError) as e:  # no architecture, no preset, a layout the row's numbers contradict
        return {**base, "skip": str(e)}
    summary = ModelSummary.for_job(cfg, job)
    candidates, reasons = [], []
    for rc, lo in layouts:
        mixed = recompute_fraction(rc) is not None
        try:
            m = validate_layout(cfg, job, lo, gpus=n)
        except ValueError as e:
            reasons.append(str(e))
            continue
        if mixed:
            pair = [estimate_layout(summary, cluster, job, replace(lo, recompute=x), num_microbatches=m)
                    for x in ("none", "full")]
            candidates.append(_mixed_recompute_estimate(pair, cluster, rc))
        else:
            candidates.append(estimate_layout(summary, cluster, job, lo, num_microbatches=m))
    if not candidates:
        return {**base, "skip": f"layout not expressible: {reasons[0] if reasons else 'no schedule fits its layers'}"}
    fitting = [e for e in candidates if e.fits]
    best = min(fitting or candidates, key=lambda e: e.time_s["step"])
    step = best.time_s["step"]
    compared = _compare(row, cfg, job, step=step, n=n, model_flops_per_token=summary.model_flops_per_token,
                        peak=cluster.peak(job.precision))
    if compared is None:
        return {**base, "skip": "the row gives no throughput, step time, TFLOP/s or MFU to compare"}
    metric, measured, predicted = compared
    memory = _memory_compared(row, best.memory_gib)
    return {**base, "gpus": n, "cluster": cluster.name, "precision": job.precision, "moe": cfg.is_moe,
            "layout": best.layout.short(), "fits": best.fits, "memory_gib": round(best.memory_gib["total"], 1),
            "metric": metric, "measured": measured, "predicted": round(predicted, 3),
            "error": round(predicted / measured - 1, 4),
            "collectives_over_compute": round(best.collectives_over_compute, 3),  # its lean on overlap (`summarize`)
            "issue_kind": issue_kind(row, cfg, cluster),
            "time_breakdown": {k: round(v / step, 3) for k, v in best.time_s.items() if k != "step" and v > 0},
            **({"memory": memory} if memory else {})}


def _memory_compared(row: dict, gib: dict) -> dict | None:
    """The row's memory figure against the planner's memory of its layout (`Estimate.memory_gib`) in the measure the
    row names (`published_rows.memory_of`), each with its own part of the memory model (`memory.memory_measures`);
    None where the row gives no such figure."""
    read = memory_of(row)
    if read is None:
        return None
    measure, measured = read
    predicted = memory_measures(gib)[measure]
    return {"measure": measure, "measured_gib": round(measured, 2), "predicted_gib": round(predicted, 2),
            "error": round(predicted / measured - 1, 4)}


def _median_abs(rows: list[dict]) -> float | None:
    errs = [abs(r["error"]) for r in rows if "error" in r]
    return round(statistics.median(errs), 4) if errs else None


# Bins of a ZeRO-3 / FSDP row's collectives over its compute (`predict_row`'s "collectives_over_compute"): how much
# its step leans on overlap, where the model hides every collective that each pass's compute covers.
OVERLAP_BINS = (0.0, 0.2, 0.5, 1.0)


def _by_overlap(used: list[dict]) -> dict:
    """The median error (signed) and row count of the ZeRO-3 rows in each `OVERLAP_BINS` bin."""
    sharded = [r for r in used if "/z3" in r["layout"]]
    out = {}
    for lo, hi in zip(OVERLAP_BINS, (*OVERLAP_BINS[1:], float("inf"))):
        rows = [r for r in sharded if lo <= r["collectives_over_compute"] < hi]
        median = round(statistics.median(r["error"] for r in rows), 4) if rows else None
        out[f"{lo:g}-{hi:g}"] = {"rows": len(rows), "median_error": median}
    return out


def summarize(results: list[dict]) -> dict:
    """Rows used and skipped, and the median |error| per group, over `FIT_GROUPS` and the others, over dense
    and MoE models, and overall; the ZeRO-3 rows' median error by how much their step leans on overlap; and the
    median error of the rows of each of issue 25's three kinds (`published_rows.issue_kind`)."""
    used = [r for r in results if "error" in r]
    groups = sorted({r["group"] for r in used})
    return {
        "rows_used": len(used),
        "rows_skipped": len(results) - len(used),
        "per_group_rows": {g: sum(r["group"] == g for r in used) for g in groups},
        "per_group_median_abs_error": {g: _median_abs([r for r in used if r["group"] == g]) for g in groups},
        "per_group_median_error": {g: round(statistics.median(r["error"] for r in used if r["group"] == g), 4)
                                   for g in groups},
        "fit_groups_median_abs_error": _median_abs([r for r in used if r["group"] in FIT_GROUPS]),
        "held_out_median_abs_error": _median_abs([r for r in used if r["group"] not in FIT_GROUPS]),
        "median_abs_error_dense": _median_abs([r for r in used if not r["moe"]]),
        "median_abs_error_moe": _median_abs([r for r in used if r["moe"]]),
        "median_abs_error": _median_abs(used),
        "median_error": round(statistics.median(r["error"] for r in used), 4) if used else None,
        "zero3_median_error_by_collectives_over_compute": _by_overlap(used),
        "median_error_by_issue_kind": _by_kind(used),
        "memory": _memory_summary(used),
    }


def _by_kind(used: list[dict]) -> dict:
    """Per issue-25 kind (`published_rows.issue_kind`): its rows, their median signed error, the groups they are of."""
    kinds = {k: [r for r in used if r.get("issue_kind") == k] for k in (1, 2, 3)}
    return {k: {"rows": len(rs), "median_error": round(statistics.median(r["error"] for r in rs), 4),
                "groups": sorted({r["group"] for r in rs})} for k, rs in kinds.items() if rs}


def _memory_summary(used: list[dict]) -> dict:
    """The rows whose memory figure was compared (`_memory_compared`): their median |error|, overall and per group
    (with the measure each group's rows name), and the median signed error."""
    rows = [r for r in used if "memory" in r]
    errs = lambda rs: [r["memory"]["error"] for r in rs]  # noqa: E731
    by_group = {g: [r for r in rows if r["group"] == g] for g in sorted({r["group"] for r in rows})}
    return {"rows": len(rows),
            "median_abs_error": round(statistics.median(map(abs, errs(rows))), 4) if rows else None,
            "median_error": round(statistics.median(errs(rows)), 4) if rows else None,
            "per_group": {g: {"rows": len(rs), "measure": "/".join(sorted({r["memory"]["measure"] for r in rs})),
                              "median_abs_error": round(statistics.median(map(abs, errs(rs))), 4),
                              "median_error": round(statistics.median(errs(rs)), 4)} for g, rs in by_group.items()}}
