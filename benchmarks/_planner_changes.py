"""The changes made to the planner while reading the published training runs (`CHANGES`), printed by
planner_published.py beside its scores: each a mechanism or a row reading -- never a numeric constant -- with the
groups of benchmarks/data/published_runs_dev.csv whose rows prompted it and its source. The rounds they came in are
planner_published.py's docstring."""

# The issue-15 changes (mechanisms and row descriptions, no numeric constant), each with the groups whose
# rows prompted it. Every group's rows were read while making them.
CHANGES = (
    ("unfused attention for Megatron-LM before 2023 and MegaScale's Megatron-LM baseline",
     ("C_korthikanti2022_sp_selective", "E_megascale_175b_strong_scaling"),
     "FlashAttention reached Megatron-LM in 2023; MegaScale Sec. 3, efficient operators"),
    ("unfused attention's batched GEMMs priced by shape (kernels.py's K overhead)",
     ("A_megatron2021_weak_scaling", "C_korthikanti2022_sp_selective"), "kernels.py's GEMM model"),
    ("output head priced as its own GEMM, in bf16 under fp8", ("H_nemo_2407_h100_fp8",),
     "Megatron-Bridge performance guide: fp8 covers the blocks' linear layers only"),
    ("torchtitan's selective layer / op checkpointing re-runs about half the forward",
     ("K_torchtitan_a100_fsdp",), "torchtitan's activation-checkpointing options"),
    ("bf16 gradients (grad_reduce_in_fp32=False) for NVIDIA's performance recipes; fp8-saved GEMM inputs",
     ("H_nemo_2407_h100_fp8", "I_megatron_bridge_h100"), "NeMo performance recipes; Transformer Engine"),
    ("GPT-3-shaped MLP for every GPT row (MegaScale's read as SwiGLU of 4h)",
     ("E_megascale_175b_strong_scaling",), "MegaScale Table 1: GPT-3 175B"),
    ("a GEMM's fixed K cost in stages of fixed bytes: fp8 pays twice the elements",
     ("H_nemo_2407_h100_fp8", "I_megatron_bridge_h100"), "CUTLASS Hopper tile shapes (kernels.py)"),
    ("pipeline sends: with several pp ranks per node only one neighbour's send crosses nodes",
     ("H_nemo_2407_h100_fp8",), "the mesh's rank placement (placement.py)"),
    ("context-parallel attention kernels see one chunk (s / 2cp) of the load-balanced split",
     ("H_nemo_2407_h100_fp8", "I_megatron_bridge_h100"), "parallel/context.py; Transformer Engine's ring"),
    ("expert_tp: routed experts split over expert_tp ranks, ep spanning the tp ranks (MoE parallel folding); "
     "the Qwen3-235B rows (tp 2, ep 32 over 16 dp ranks) become expressible",
     ("I_megatron_bridge_h100",), "Megatron-Core expert_tensor_parallel_size; Megatron-Bridge MoE configs"),
    ("expert all-to-all overlapped with another microbatch's compute where the recipe sets moe_a2a_overlap "
     "(DeepSeek-V3's exposed all-to-all made it 37% too slow)",
     ("I_megatron_bridge_h100",), "Megatron-Core overlap_moe_expert_parallel_comm; Megatron-Bridge "
     "communication-overlap docs and performance configs"),
    ("MoE token permutations priced pass by pass (permute, regroup by local expert and back, weighted unpermute)",
     ("I_megatron_bridge_h100",), "Megatron-Core's all-to-all token dispatcher (kernels.moe_dispatch_elements)"),
    # Issue 25 (training side): three kinds of run the held-out runs showed too fast; rows of two of them added
    # (groups O and P, read row by row while making these), no numeric constant fitted to any row.
    ("FSDP / ZeRO-3 priced unit by unit: a gather per block before its forward and before its backward, a "
     "reduce-scatter (HSDP: + the replicas' all-reduce) after it, each with its ring latency; per pass what the "
     "collectives take beyond the compute is exposed; the root's gather opens each micro-step, the last "
     "reductions close the step", ("K_torchtitan_a100_fsdp", "O_llm_foundry_fsdp", "P_fms_fsdp"),
     "Zhao et al. 2023, PyTorch FSDP (VLDB), Sec. 4.2 prefetching (timing_dp.fsdp_comm_time)"),
    ("all-gather / reduce-scatter latency: one ring over all ranks (n - 1 steps, n_nodes - 1 across), no tree",
     ("O_llm_foundry_fsdp", "P_fms_fsdp"), "NCCL src/graph/tuning.cc; NCCL 2.23 PAT blog (collectives.py)"),
    ("FlashAttention-2 on Hopper at its own rate for the PyTorch-native stacks",
     ("O_llm_foundry_fsdp", "P_fms_fsdp"), "Shah et al. 2024, FlashAttention-3, Sec. 1: FA2 ~35% of H100 peak"),
    ("Megatron-LM's / DeepSpeed's uniform pipeline split (head and loss on top of the last stage), groups A, C, E, H, Q",
     ("H_nemo_2407_h100_fp8", "Q_gpt_neox_20b"),
     "Megatron-LM: num_layers divisible by the pipeline size; DeepSpeed PipelineModule partition type:transformer"),
    ("row descriptions: HSDP; the row's scale-out bandwidth; A100 40GB; MPT's GeLU MLP; llm-foundry eager, "
     "bf16 gradient reduction under PURE and in fms-fsdp; GPT-NeoX's gradients reduced after the flush and its "
     "own FLOP count", ("O_llm_foundry_fsdp", "P_fms_fsdp", "Q_gpt_neox_20b"),
     "llm-foundry benchmarking README and yamls; fms-fsdp README and config; gpt-neox configs/20B.yml, logging"),
    ("fms-fsdp's README tables before 2024-05-09 ran eager (torch.compile off), the table of that date compiled",
     ("P_fms_fsdp",), "fms-fsdp git history: scripts/train.sh --use_torch_compile=False and docs/configurations.md "
     "('recommended to NOT use compile at this stage') until the README's 'numbers are updated with torch.compile'"),
    ("row descriptions: BLOOM-176B (GeLU MLP; DeepSpeed's pipeline engine: gradients reduced after the flush)",
     ("R_bloom_176b",), "bigscience-workshop/bigscience train/tr11-176B-ml README and slurm script"),
    ("DeepSpeed's pipeline engine: every send and receive a blocking transfer of its own, four per micro-batch on "
     "an interior stage (Job.pp_p2p_serial); the pipeline runs at the slowest stage's cycle",
     ("Q_gpt_neox_20b", "R_bloom_176b"), "DeepSpeed runtime/pipe/p2p.py (send / recv: async_op must be False) "
     "and runtime/pipe/schedule.py (Send/RecvActivation, Send/RecvGrad instructions) (timing.pp_p2p_time)"),
    ("eager RMSNorm in fp32 with bf16 activations (36 bytes per element, not 14); MPT's low-precision LayerNorm one "
     "bf16 kernel (Job.fp32_norms)", ("K_torchtitan_a100_fsdp", "O_llm_foundry_fsdp", "P_fms_fsdp"),
     "meshlm models/transformer.py RMSNorm; fms modules/layernorm.py (use_high_precision_pow); torchtitan's "
     "RMSNorm; llm-foundry models/layers/norm.py LPLayerNorm (timing.elementwise_time)"),
    # Issue 25, third round: groups S and T added (read row by row while making these); descriptions only.
    ("DeepSpeed's fp16 ZeRO-1 optimizer reduces the fp16 gradients in fp16 (GPT-NeoX, BigScience's fp16 benchmark)",
     ("Q_gpt_neox_20b", "S_bloom_prequel_a100_pipeline"), "DeepSpeed runtime/zero/stage_1_and_2.py: "
     "communication_data_type defaults to the gradients' dtype; BLOOM-176B's BF16_Optimizer reduces fp32 ones"),
    ("a recomputation the row does not state: none, half or full, the fastest that fits (as a micro-batch size not "
     "given)", ("T_float8_fsdp2_blog_h100",), "the float8 / FSDP2 blog: 'the best batch size and activation "
     "checkpointing schemes' explored, not printed (published_rows.recompute_choices)"),
    ("Jean Zay's Omni-Path network at its measured 135 Gbps per node (16.9 Gb/s per GPU achieved; the row's figure is "
     "that over the planner's link efficiency), not the nominal 4 x 100 Gbps", ("R_bloom_176b",
                                                                            "S_bloom_prequel_a100_pipeline"),
     "Bekman, ml-engineering network/README.md, Omni-Path: 'I used this technology at JeanZay HPC in France in 2022. "
     "It was only 135Gbps'"),
    # Issue 25, fourth round: groups U to Y added (read row by row while making this); descriptions only.
    ("row descriptions for NVIDIA's JAX / XLA recipes: the FSDP degree of a row's 'FSDP=<n> x DP=<k>' mesh "
     "(published_rows.shard_degree: sharded over n, replicated k times); a remat policy re-running about half the forward "
     "('partial': MaxText save_dot_except_mlpwi, Paxml SAVE_QKV_OUT_PROJ) priced as half, MaxText's save_dot_except_mlp "
     "and save_qkv_proj (83% and 90%) as full, Paxml's SAVE_DOT_ONLY and SAVE_DOT_WITH_NO_BATCH_DIM as selective, "
     "SAVE_NOTHING as full, MaxText's minimal_flash as none; otherwise the planner's defaults",
     ("U_maxtext_llama2_70b_h100_fsdp", "V_maxtext_llama3_70b_h100_fsdp", "W_paxml_gpt_h100_fsdp",
      "X_jaxtoolbox_paxml_gpt_fsdp256", "Y_jaxtoolbox_maxtext_llama2_7b_h100"),
     "NVIDIA/dgxc-benchmarking maxtext/configure.sh and paxml/configure.sh (mesh axes, remat_policy, "
     "attention=cudnn_flash_te, NVTE_FUSED_ATTN=1, --xla_gpu_enable_latency_hiding_scheduler=true, pipelined "
     "all-gather / reduce-scatter); MaxText layers/models.py get_remat_policy; google/paxml scripts_gpu/configs.py; "
     "NVIDIA/JAX-Toolbox pax and maxtext READMEs and maxtext scripts/example_slurm.sub"),
    # Issue 25, fifth round: what Paxml's GPT-3 5B executes (groups W and X); costs from FLOPs and bytes.
    ("Paxml's GPT configs: the tied embedding as a one-hot matmul (Job.embedding_gemm), the 5B's dropout of each "
     "repeated block's input (Job.unfused_dropouts = 1), SAVE_DOT_ONLY / SAVE_DOT_WITH_NO_BATCH_DIM re-running every "
     "elementwise op (Job.remat_saves_dots)", ("W_paxml_gpt_h100_fsdp", "X_jaxtoolbox_paxml_gpt_fsdp256"),
     "google/paxml tasks/lm/params/c4.py (EMBEDDING_LOOKUP_STYLE 'matmul'), tasks/lm/model_params.py "
     "(SEPARATE_EMBEDDING False, DROPOUT_PROB 0.0), scripts_gpu/configs.py GPT5BBase (input_dropout_prob 0.1, "
     "USE_REPEATED_LAYER); google/praxis layers/embedding_softmax.py SharedEmbeddingSoftmax.emb_lookup, "
     "layers/transformers.py StackedTransformer, layers/checkpoint_policy.py custom_policy; NVIDIA/JAX-Toolbox "
     ".github/container/patches/paxml/PR-46.patch (PACKED_INPUT False under TE)"),
    ("row descriptions for InternLM's Hybrid ZeRO ('zero1=<n>': ZeRO-1 with the optimizer states sharded over n "
     "data-parallel ranks, replicated across the groups: published_rows.shard_degree), for OLMo-core's scripts "
     "(FSDP2 in a node, torch.compile, attention through SDPA's FlashAttention-2, QK-norm) and for Megatron-LLaMA "
     "(Megatron-LM's DistributedOptimizer rows with the data-parallel collectives exposed, its own overlapped "
     "optimizer's rows overlapped); otherwise the planner's defaults; no constant changed",
     ("Z_internlm_7b_a100_zero1", "AA_olmo_core_h100_fsdp", "AB_megatron_llama_13b_a100"),
     "InternLM/InternLM doc/en/train_performance.md and configs/7B_sft.py (zero1, overlap_sync_grad / "
     "overlap_sync_param, use_flash_attn); allenai/OLMo-core src/scripts/train/*.py, nn/transformer/config.py "
     "(llama_like: use_flash off under compile, qk_norm) and internal/experiment.py (init_hybrid_shard_mesh); "
     "alibaba/Megatron-LLaMA README.md ('does not fully overlap GPU computation with communication') and "
     "examples/LLaMA/LLaMA_13_slurm.sh"),
    # Issue 25, after the fifth round: what InternLM's optimizer issues, read in its source after group Z's rows
    ("InternLM's HybridZeroOptimizer all-reduces every gradient bucket over all data-parallel ranks and broadcasts "
     "each rank's updated shard (Job.zero1_grad_all_reduce: an all-reduce where ZeRO-1 prices a reduce-scatter; the "
     "broadcasts as the all-gather they add up to); group Z 21% -> 9.5%, the fall from 8 to 1024 GPUs at a fixed "
     "batch predicted 29% (published 44%, 14% before); no other group moves",
     ("Z_internlm_7b_a100_zero1",),
     "InternLM/InternLM internlm/solver/optimizer/hybrid_zero_optim.py (_reduce_and_copy: reduce_tensor with "
     "dst_rank None; broadcast_params) and utils.py reduce_tensor ('If dst_rank is None, all-reduce will be used'); "
     "NVIDIA/nccl src/graph/tuning.cc (a ring broadcast's latency: one hop with the same channels)"),
    # Issue 25, sixth round: what a held-out table's rows get. No mechanism, no constant; no dev row moves.
    ("Each row's software stack read from its own source and model columns (published_stacks.stack_of), not from the group "
     "id the CSV gives it; ZeRO stages read from any wording ('ZeRO-3', 'ZeRO stage 3', 'zero3': once read as "
     "Megatron's distributed optimizer, stage 1); fp8 from 'float8'; a row giving only TFLOP/s or MFU compared in "
     "model FLOPs unless it is Megatron 2021's (eq. 3); a GPU without a preset, or a row with nothing to compare, "
     "skipped with the reason instead of stopping the table; Llama 3 / 3.1 shapes for rows that leave them blank; a "
     "pipeline schedule named in the row's own cells (GPipe, ZB-1p / ZB-H1, 1F1B-I) priced as such",
     (),
     "Dubey et al. 2024 (Llama 3) Table 3; PaLM (Chowdhery et al. 2022) Appendix B's model FLOPs; "
     "models/stats.py's FLOP convention"),
    # Issue 25, seventh round: what a 2023 Megatron-LM fork ran on A100 (group AB, +37% -> +20-24%; no other row moves).
    ("the first FlashAttention at FA1_RATE_OF_FA2 of FlashAttention-2's rate (Job.flash_attention_1); ops a fusing "
     "stack still runs op by op (Job.eager_ops: RoPE, SwiGLU, the copies into and out of the attention kernel's "
     "layout); the weight gradients' own accumulation pass without gradient-accumulation fusion",
     ("AB_megatron_llama_13b_a100",),
     "Dao 2023, FlashAttention-2 (arXiv:2307.08691), abstract: 25-40% vs 50-73% of peak on A100; alibaba/Megatron-LLaMA "
     "at e3d671a: megatron/model/transformer.py (flash_attn_unpadded_func, rearrange(...).contiguous(), F.silu(x[0]) "
     "* x[1]), rotary_pos_embedding.py, examples/LLaMA/LLaMA_13_slurm.sh (--no-gradient-accumulation-fusion)"),
    ("PyTorch FSDP2's all-gather copy-out (split_with_sizes_copy into each parameter's tensor) on the compute stream: "
     "every gather reads and writes its unit's parameters once more, exposed (Job.fsdp_copy_out; torchtitan, "
     "OLMo-core, rows naming FSDP2 / fully_shard)",
     ("AA_olmo_core_h100_fsdp", "K_torchtitan_a100_fsdp", "T_float8_fsdp2_blog_h100"),
     "PyTorch torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_all_gather_copy_out (waits for the "
     "all-gather on the current stream, then split_with_sizes_copy) and _fsdp_param_group.py wait_for_unshard"),
    ("fp8 weights as the stack casts them (Job.fp8_weights): Transformer Engine once per step; torchao's dynamic "
     "scaling in every forward (6 bytes per weight element); under FSDP's float8 all-gather each rank its shard, the "
     "blocks gathered and copied out in one byte, the backward's transposed copy 2 bytes (AA's float8 rows 1-4 points "
     "faster: the gather's bytes halve)",
     ("AA_olmo_core_h100_fsdp",),
     "pytorch/ao torchao/float8/roofline_utils.py (get_tensor_memory_traffic_bytes, get_float8_mem_sympy) and "
     "config.py (enable_fsdp_float8_all_gather) of 2024-11; allenai/OLMo-core src/olmo_core/float8.py at e27ba7455 "
     "(Float8Config: enable_fsdp_float8_all_gather=True); pytorch/torchtitan config_manager.py of 2024 "
     "(--float8.enable_fsdp_float8_all_gather, default False)"),
    ("a Megatron-LM row of 2023 attends with flash attention only where it names it (no dev row moves)", (),
     "NVIDIA/Megatron-LM d693034e (2022-12-08: --use-flash-attn, store_true) and e7b74a4b (2024-04-02: "
     "--transformer-impl defaults to transformer_engine)"),
    ("DeepSpeed's ZeRO-3 before v0.6 (a ZeRO-3 row of 2021 or before, not FSDP): every parameter tensor gathered by "
     "its own synchronous collective, none hidden under compute (Job.zero3_serial_gathers; issue 25's kind (1); no dev "
     "row moves: no such row in the development set)", (),
     "microsoft/DeepSpeed partition_parameters.py _allgather_param (torch.cuda.synchronize() before each all_gather) "
     "and stage3.py _synchronize_communication as of 2021-06; PR #1188 (2021-10-31): 'the async version is not async "
     "at all'; PR #1453 (v0.6.0, 2022-01): coalesced all-gathers with prefetching"),
    ("Megatron-LM's legacy model (before 2024; Megatron-LLaMA's fork): RoPE and SwiGLU as torch ops, q / k / v copied "
     "around flash-attn; its 'selective' recomputation with flash-attn recomputes nothing (AB 22% -> 26%: faithful, "
     "not closer)", ("AB_megatron_llama_13b_a100",),
     "NVIDIA/Megatron-LM megatron/model/transformer.py at cfbf55d7 (2023-08): ParallelAttention.forward consults "
     "checkpoint_core_attention only when not use_flash_attn; rearrange(...).contiguous() around the flash call"),
    # Issue 25, eighth round: group AC added (read row by row); two parts priced as measured (no constant fitted).
    ("MI300X attends at ROCm FlashAttention-2's measured forward + backward rate, 229 of 1307 TFLOP/s, for every "
     "stack (it was Hopper's fraction, 0.55, assumed): AC's MI300X rows 66% -> 35% (bf16), 119% -> 61% (float8)",
     ("AC_torchao_float8_torchtitan_8b",),
     "ROCm/flash-attention issue #142 (2025-05-18): its benchmarks/benchmark_flash_attention.py on MI300X, ROCm 6.3.2, "
     "head dim 128, 16K tokens, batch 1-8: fwd + bwd 223-232 TFLOP/s"),
    ("the H100 with HBM2e, 94 GiB at 2.41 TB/s (preset h100-hbm2e), read from a GPU cell naming HBM2e or 2.4 TB/s: "
     "AC's H100 rows, whose repository models its authors' H100 at 2.4 TB/s, 24% -> 20% (bf16), 38% -> 30% (float8)",
     ("AC_torchao_float8_torchtitan_8b",),
     "arXiv:2604.11391 (H100 HBM2e 94 GiB, 2.41 TB/s); pytorch/ao torchao/testing/training/roofline_utils.py "
     "('2.4 TB per second, custom to Meta's H100 variant')"),
    ("B200 attends at cuDNN 9.10's measured forward + backward rate, 1150 of 2250 TFLOP/s (Hopper's fraction, 0.55, "
     "was assumed), FlashAttention-2 stacks at FA2's, 360: AD's B200 rows 17-27% -> 14-19%; serving rows on B200 / "
     "GB200 0.1-5 points nearer (overall 13.7% -> 13.6%)", ("AD_nemo_long_sequence_cp",),
     "NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_bf16_training at f937055 (2025-06-12): "
     "sdpa_benchmark_results_NVIDIA_B200.csv, causal, 128 query / 8 KV heads, head dim 128, batch 1, 16K-128K tokens"),
    ("GB200 at its own datasheet peaks (2.5 / 5 / 10 PFLOP/s bf16 / fp8 / fp4; it was priced as a B200, 2.25 / 4.5 / 9) "
     "and Blackwell's GEMMs at H100's transformer-shape fraction carried by each part's MAMF fraction (B200 0.62 x 77.6 / "
     "80.3, GB200 0.62 x 72.9 / 80.3; assumed 0.62 before): AE 8.5% -> 8.3%, the 8B's GB200 / B200 ratio 1.04 as "
     "measured; AD's B200 rows 1-2 points nearer; serving B200 rows 1-3 points nearer, GB200 ones 1-3 further",
     ("AE_megatron_bridge_blackwell",),
     "NVIDIA GB200 NVL72 datasheet (per-GPU specifications); stas00/ml-engineering compute/accelerator/README.md, "
     "'Maximum Achievable Matmul FLOPS comparison table' (H100 SXM 794.5 / 989, B200 1745 / 2250, GB200 1822 / 2500)"),
    ("training fp8 GEMMs at the fp8 peak times its measured share (Cluster.matmul_precision_factor: H100 70.9 / 80.3, "
     "B200 76.3 / 77.6, MI300X's hipBLASLt fp8 over bf16), as serving prices them (one GEMM model): overall 8.2% -> 7.9%, "
     "AA 14% -> 8.5%, H 8.1% -> 5.9%, X 11% -> 6.5%; MaxText's fp8 rows further (U 7.6% -> 10.0%, V 13% -> 17%)",
     ("AA_olmo_core_h100_fsdp", "AC_torchao_float8_torchtitan_8b", "H_nemo_2407_h100_fp8"),
     "stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table', FP8 and "
     "BF16 (H100 SXM 70.9% / 80.3%, B200 76.3% / 77.6%); Azure/AI-benchmarking-guide ND MI300X v5 results (hipBLASLt FP8)"),
    # Issue 25, tenth round: what FSDP's ZeRO-2 issues (group O's weak scaling); no constant.
    ("ZeRO-2 as FSDP's SHARD_GRAD_OP: a gather per unit before each micro-step's forward, a reduce-scatter per unit "
     "after its backward (Job.zero2_unit_collectives; FULL_SHARD's units without the backward's gathers), where "
     "Megatron's ZeRO-2 buckets them; no collective for zero bytes: O's MPT-1B / 3B at 512 GPUs 14% / 12% -> 9% / 7%",
     ("O_llm_foundry_fsdp",),
     "Zhao et al. 2023, 'PyTorch FSDP' (VLDB), Sec. 3.2-4.2 (units, SHARD_GRAD_OP, prefetching); mosaicml/llm-foundry "
     "scripts/train/benchmarking (sharding_strategy per row, blocks wrapped as FSDP units)"),
    # Issue 25, eleventh round: group AF added (chosen by a rule before pricing); row descriptions only.
    ("row descriptions: a row saying its attention is unfused, or its RMSNorm ran as torch ops (Job.eager_ops "
     "'rmsnorm', fp32 as Llama's reference code), is read so whatever its stack (group AF's kernels)",
     ("AF_hagemann_layouts_a100",),
     "Hagemann et al. 2023 (arXiv:2311.05610) and Aleph-Alpha/NeurIPS-WANT-submission-efficient-parallelization-"
     "layouts at e13c2cb, data/*.xlsx (kernel column: flash_attention2, + RMS kernel, flash_attentionv1.0.8, fused, "
     "torch)"),
    # Issue 25, twelfth round: group AG added (all 16 FSDP rows of its table); row descriptions only.
    ("row descriptions: Hugging Face transformers with accelerate's FSDP1 is eager with FlashAttention-2 (stack "
     "'hf-transformers'); whole blocks checkpointed in k of L layers weigh the no- and full-recompute estimates k / L",
     ("AG_yafsdp_fsdp_a100",),
     "yandex/YaFSDP at a61a4a6: README.md 'Benchmarks', docker/Dockerfile (transformers v4.39, accelerate v0.27), "
     "patches/transformers.diff (run_clm.py: flash_attention_2, MixedPrecision, wrap and checkpoint policies, "
     "IterTimeCallback), examples/fsdp_config.yaml (FULL_SHARD, forward prefetch, BACKWARD_PRE)"),
    # Issue 25, thirteenth round: group AH added (every row of its table); row descriptions only.
    ("row descriptions: a node cell's GPUs per scale-up domain where it differs from the preset's (nodes of 4 H200s); "
     "KempnerForge is FSDP2 with SDPA's FlashAttention-2 kernels, compiled unless the row says not; and a mechanism: "
     "a tensor-parallel head whose logits are gathered for the loss (Job.tp_loss_replicated): AH's tp rows 1-3 points "
     "nearer, their memory as measured; and model states cast to bf16 (Job.bf16_states: 8 bytes per parameter)",
     ("AH_kempnerforge_h200",),
     "KempnerInstitute/KempnerForge at 01b461a: benchmarks/mfu_scaling/mfu_scaling_2026-04-05.md (hardware, configs), "
     "kempnerforge/distributed/parallel.py (fully_shard, fp32 reduction), distributed/tensor_parallel.py (sequence "
     "parallelism, the head gathered to Replicate for the loss), model/attention.py (F.scaled_dot_product_attention), "
     "scripts/train.py (bf16 model)"),
    # Issue 25, fourteenth round: groups AI and AJ added (every row of their tables); row descriptions and a preset.
    ("row descriptions: lightning-thunder's benchmark_litgpt.py keeps bf16 model states and reduces in bf16, attends "
     "through SDPA's FlashAttention-2; a Megatron-LM row run without --overlap-grad-reduce exposes its distributed "
     "optimizer's collectives; the A800 preset (A100's die, NVLink 400 GB/s)",
     ("AI_thunder_litgpt_h100_fsdp", "AJ_flagperf_megatron_llama3_8b"),
     "Lightning-AI/lightning-thunder pull requests #940 (d425fe4) and #1528 (77c6a74): thunder/benchmarks/"
     "benchmark_litgpt.py (init_model's bf16 cast, fully_shard with reshard_after_forward=False and bf16 "
     "MixedPrecisionPolicy, FSDP1 SHARD_GRAD_OP, torchao Float8LinearConfig); FlagOpen/FlagPerf at 1b5a030: "
     "training/nvidia/llama3_8B-megatron/README.md and config/, training/benchmarks/llama3_8B/megatron/"
     "pretrain_llama3.sh and run_pretraining.py; NVIDIA's A800 datasheet"),
    # Issue 25, fifteenth round: group AK added (one row per logged configuration); one row description.
    ("row descriptions: a Megatron-LM row naming --transformer-impl local runs the legacy model code (torch-op RoPE, "
     "SwiGLU and layout copies; its \"selective\" recomputes nothing on the flash path) whatever its year",
     ("AK_swallow_megatron_abci_a100",),
     "okoge-kaz/Megatron-LM-ABCI at 54209cd (branch feature/llama-2): outputs/ (the training logs' argument dumps and "
     "per-iteration times), megatron/model/transformer.py and rms_norm.py, installed_packages.txt; aistabci/abci-docs "
     "en/docs/system-overview.md (Compute Node (A))"),
    ("mechanism: the loss as the code runs it, Megatron's vocab-parallel cross entropy op by op (52 bytes per logit "
     "with bf16 logits, where 20 had been assumed for every stack), Megatron-Core's fused one for NVIDIA's recipes (28)",
     ("AJ_flagperf_megatron_llama3_8b", "AK_swallow_megatron_abci_a100"),
     "NVIDIA/Megatron-LM core_v0.6.0 and core_v0.9.0: megatron/core/tensor_parallel/cross_entropy.py, "
     "megatron/core/fusions/fused_cross_entropy.py, megatron/core/models/common/language_module/language_module.py; "
     "NeMo-Framework-Launcher's llama3 base configs and NeMo 2.0's GPTConfig (cross_entropy_loss_fusion)"),
    # Issue 25, sixteenth round: group AF's stack read from its public release; row descriptions only.
    ("row descriptions: Aleph Alpha's Scaling (AA-Scaling) runs RoPE and SwiGLU as torch ops, DeepSpeed's pipeline "
     "schedule with blocking sends and receives, all-reduces its gradients in fp32 after the flush (ZeRO-1 shards "
     "gathered back), exposed, and gathers the head's logits for a whole-vocabulary loss on every tp rank",
     ("AF_hagemann_layouts_a100",),
     "Aleph-Alpha/scaling 0.1.0 / 0.2.0 (2024-08 / 2024-10; at 78489292 and 01b9d21): src/scaling/core/nn/rotary.py, "
     "mlp.py, "
     "pipeline_schedule/train.py, parallel_module/communicator.py and pipeline_partitioning.py, "
     "core/optimizer/optimizer.py, allreduce.py and parameter_group.py, core/topology/topology_config.py, "
     "core/nn/linear/column_parallel_linear.py, transformer/model/layers/lm_head.py and losses/cross_entropy.py"),
    # Issue 25, seventeenth round: group AL added (all 14 runs of four model cards); a mechanism and row descriptions.
    ("mechanism: Megatron-Core's flex token dispatcher (DeepEP / HybridEP backends) sends a token across once to each "
     "other node holding one of its experts and forwards it there over NVLink (Job.ep_dispatcher 'flex', "
     "collectives.expert_all_to_all, the model serving's DeepEP prefill kernels use), where NCCL's all-to-all sends "
     "every routed copy; row descriptions: recompute_modules without the attention core priced as none, a recipe's "
     "overlap_grad_reduce False exposes the distributed optimizer's collectives, a row saying no EP overlap has none, "
     "bf16 Adam moments beside the fp32 master where a recipe keeps them (Job.bf16_moments: 8 bytes of state, not 12)",
     ("AL_megatron_bridge_cards_moe",),
     "NVIDIA-NeMo/Megatron-Bridge at 067f987: examples/model_verification_cards/{qwen3-30b-a3b, qwen3-235b-a22b, "
     "gpt-oss-120b, deepseek-v3}/card.yaml and each run's recipe at its commit (src/megatron/bridge/perf_recipes/, "
     "recipes/); NVIDIA/Megatron-LM at d98e8a6 megatron/core/transformer/moe/README.md (DeepEP: 'Removes redundant "
     "tokens during cross-node communication'); deepseek-ai/DeepEP branch hybrid-ep at 94a9f8f "
     "docs/Hybrid-EP_Implementation.md (IB to each node's peer GPU, then distributed inside the node)"),
    ("mechanism: DeepSeek-V3 trains with its multi-head latent attention (planner/mla.py, the shapes serving "
     "already priced), not grouped-query attention of the same width: down-projections whole on every tp rank over "
     "its share of the tokens, up- and output projections split by heads, the core on 192-dim q / k and 128-dim v; "
     "671.0B parameters, 37.6B active (GQA of its width: 688B / 54.8B)",
     ("AL_megatron_bridge_cards_moe", "I_megatron_bridge_h100"),
     "DeepSeek-V3 technical report (arXiv:2412.19437: 671B parameters, 37B activated) and config.json "
     "(deepseek-ai/DeepSeek-V3: kv_lora_rank 512, q_lora_rank 1536, qk_nope / qk_rope / v head dims 128 / 64 / "
     "128); NVIDIA/Megatron-LM at d98e8a6 megatron/core/transformer/multi_latent_attention.py and "
     "models/gpt/gpt_layer_specs.py (the down-projections TELinear 'duplicated', the up-projections column-parallel)"),
    # Issue 25, eighteenth round: two mechanisms and a row description; groups AM and AN added (every row of each).
    ("mechanism: Megatron-Core's recompute_modules 'mla_up_proj' (Job.recompute_mla_up_proj): a latent-attention "
     "layer keeps its latents and the core's output, not the heads' q, k and v, and its backward runs the "
     "up-projections again; row descriptions: a recompute cell naming it, or an NVIDIA recipe of a latent-attention "
     "model on H100 / GB200 whose cell is blank, runs it",
     ("AL_megatron_bridge_cards_moe", "I_megatron_bridge_h100"),
     "NVIDIA/Megatron-LM at d98e8a6 megatron/core/transformer/transformer_config.py (recompute_modules: 'mla_up_proj': "
     "recompute the MLA up projection and RoPE applying parts, output-discarding checkpointing) and "
     "multi_latent_attention.py (CheckpointWithoutOutput, discard_output_and_register_recompute); "
     "NVIDIA-NeMo/Megatron-Bridge scripts/performance/run_script.py at f37f883a8 ('dsv3 2509': mla_up_proj and mlp "
     "on H100, moe_act too on GB200) and the AL cards' recipes"),
    ("mechanism: the pipeline's fill and drain run at the other ranks' pace (timing.pipeline_bubble others=: their "
     "mean load over the busiest rank's), where (p - 1) x the busiest rank's time was charged; exact against "
     "meshlm.schedules.simulate with per-rank times when the busiest rank is the last (the head's)",
     ("AM_flagperf_flagscale_aquila2_7b", "S_bloom_prequel_a100_pipeline", "AF_hagemann_layouts_a100"),
     "meshlm's own schedule simulator (meshlm/schedules.py simulate, durations per rank and action); "
     "FlagOpen/FlagPerf at 1b5a030 training/nvidia/aquila2_7b-flagscale/README.md (group AM's pp 8 row)"),
    ("mechanism: DeepSeek's group-limited routing (n_group 8, topk_group 4: mla.router_groups) bounds the nodes a "
     "token's experts lie on, so the flex dispatcher sends it across to fewer (collectives.other_nodes_reached, "
     "within 5% of a Monte Carlo of the router with forced balancing's random logits)",
     ("AL_megatron_bridge_cards_moe",),
     "DeepSeek-V3 technical report (arXiv:2412.19437, Sec. 2.1.2, node-limited routing, M = 4) and config.json "
     "(n_group 8, topk_group 4); NVIDIA/Megatron-LM at d98e8a6 megatron/core/transformer/moe/router.py "
     "(moe_router_num_groups / moe_router_group_topk, kept under moe_router_force_load_balancing); "
     "NVIDIA-NeMo/Megatron-Bridge at 067f987 (the recipe's provider from the HF config.json, n_group -> "
     "moe_router_num_groups)"),
    # Issue 25, nineteenth round: groups AO and AP added (every full-training row of their table); row descriptions.
    ("row descriptions: ATorch's examples as their scripts run them -- FSDP1 FULL_SHARD per decoder layer with its "
     "amp_native bf16 made MixedPrecision(bf16, bf16, bf16), eager Hugging Face Llama layers with flash-attention "
     "(module_replace); DS 3D as DeepSpeed's pipeline engine (partition by decoder layer, blocking sends, gradients "
     "reduced after the flush, fp16 ZeRO-1), ATorch's tensor parallelism without sequence parallelism",
     ("AO_atorch_fsdp_llama2_7b_a100", "AP_atorch_ds3d_llama2_7b_a100"),
     "intelligent-machine-learning/dlrover at 3a442b728b7d atorch/examples/llama2/{fsdp_llama2.py, "
     "fsdp_llama2_entry.sh, ds_3d_llama2.py, ds_3d_llama2_entry.sh, example_utils.py}, atorch/auto/model_context.py "
     "(fsdp with amp_native: MixedPrecision) and atorch/utils/ds_pipe_utils.py (partition_method 'type:' the layer "
     "class, tie_first)"),
    ("mechanism: a full recomputation that re-runs the whole forward of a layer repeats its last tensor-parallel "
     "collective too (one all-reduce, or reduce-scatter under SP, a layer and micro-batch), where torch's "
     "non-reentrant checkpoint stops once the saved tensors are rebuilt (Job.recompute_early_stop: meshlm, "
     "torchtitan, KempnerForge, ATorch's FSDP example)",
     ("A_megatron2021_weak_scaling", "S_bloom_prequel_a100_pipeline", "AF_hagemann_layouts_a100",
      "AP_atorch_ds3d_llama2_7b_a100"),
     "NVIDIA/Megatron-LM at d98e8a6 megatron/core/tensor_parallel/random.py (CheckpointFunction.backward re-runs "
     "run_function); deepspeed/runtime/activation_checkpointing/checkpointing.py (the same); torch.utils.checkpoint "
     "(non-reentrant early stop, PyTorch 2.1); Aleph-Alpha/scaling activation_checkpointing.py at 01b9d21 (its "
     "_checkpoint_without_reentrant re-runs the function whole); KempnerForge distributed/parallel.py at 01b461a "
     "(CheckpointImpl.NO_REENTRANT); meshlm parallel/recompute.py (use_reentrant=False)"),
    # Issue 25, twentieth round.
    ("mechanism: FSDP accumulating gradients unsynchronized until the last micro-step (Job.fsdp_no_sync) holds the "
     "rank's whole unsharded gradients in the reduce dtype and reduce-scatters once a step", ("AH_kempnerforge_h200",),
     "KempnerForge at 01b461a training/grad.py (maybe_no_sync); torch FSDPParam.to_accumulated_grad_if_needed"),
    ("row reading: GPT is a word in a model's name (not inside the trainer litgpt: a Llama 2 7B's SwiGLU had been "
     "read as a 4h MLP)", ("AI_thunder_litgpt_h100_fsdp",), "the rows' shape columns (ffn 11008 / 14336)"),
    ("row reading: torchtitan's --training.compile says torch.compile was on, \"no torch.compile\" that it was off",
     ("AN_trainy_torchtitan_h200_fsdp", "AO_atorch_fsdp_llama2_7b_a100"), "the rows' command lines and notes"),
    ("row reading: GPT-style models tie embedding and head, but GPT-NeoX-20B and Nemotron",
     ("O_llm_foundry_fsdp", "W_paxml_gpt_h100_fsdp"), "the rows' params_b; gpt-neox configs/20B.yml (no_weight_tying)"),
    # Issue 25, twenty-first round.
    ("row reading: a row's memory figure in the measure it names (torch.cuda max_memory_allocated / peak allocated, "
     "max_memory_reserved / torchtitan's logged peak reserved, nvidia-smi's used) and unit (GiB; GB where divided by "
     "1e9), compared with that part of the memory model (published.py `_memory_compared`)",
     ("AC_torchao_float8_torchtitan_8b", "AH_kempnerforge_h200", "AI_thunder_litgpt_h100_fsdp",
      "AJ_flagperf_megatron_llama3_8b", "AM_flagperf_flagscale_aquila2_7b", "AN_trainy_torchtitan_h200_fsdp"),
     "pytorch/ao benchmarks/float8/training/parse_torchtitan_logs.py; FlagPerf's nvidia_monitor (nvidia-smi every 5 s); "
     "lightning-thunder benchmark_litgpt.py (max_memory_allocated / 1e9)"),
    ("mechanism: Transformer Engine's cached fp8 weights kept row- and column-wise beside the bf16 weights (2 bytes per "
     "layer GEMM weight); NVIDIA's recipes hold fp8 parameters instead (Job.fp8_weights \"params\": no bf16 copy, "
     "the distributed optimizer's all-gather in one byte)",
     ("AJ_flagperf_megatron_llama3_8b", "H_nemo_2407_h100_fp8", "I_megatron_bridge_h100"),
     "TransformerEngine pytorch/module/linear.py (weight quantizer row- and column-wise usage while training, "
     "get_weight_workspace cache); NeMo and Megatron-Bridge mixed_precision.py (bf16_with_fp8_mixed and the "
     "current-scaling recipe: fp8_param_gather = True)"),
    ("row reading: NeMo Automodel (stack \"nemo-automodel\", named before NeMo's recipes): PyTorch FSDP2 with its "
     "copy-out, SDPA's FlashAttention-2 kernels, PyTorch's all-gather context parallelism, torch's non-reentrant "
     "checkpoint, bf16 gradient reduction, eager unless torch.compile is named",
     ("AQ_nemo_automodel_fsdp2_h100",),
     "NVIDIA-NeMo/Automodel at 2013a4dd6: custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml, "
     "components/distributed/parallelizer.py (checkpoint_wrapper NO_REENTRANT under compile), config.py "
     "(MixedPrecisionPolicy reduce_dtype bf16), cp_utils.py (torch context_parallel), models/llama/model.py"),
    ("row reading: a remat policy whose recompute cell states the share of the forward it re-runs (\"about 90% of "
     "the forward FLOPs\") weighs the no- and full-recompute estimates by that share, not half or full",
     ("U_maxtext_llama2_70b_h100_fsdp", "V_maxtext_llama3_70b_h100_fsdp", "W_paxml_gpt_h100_fsdp"),
     "the rows' recompute cells (MaxText's remat policies, Paxml's checkpoint policies, as the CSV reads them)"),
    # Issue 25, twenty-second round.
    ("row reading: Megatron-LM's legacy model runs a GPT-style row's rotary positions as torch ops where the row names "
     "them (--position-embedding-type rope); a node cell's pair bandwidth (\"100 GB/s each way\": a 4-GPU A100 "
     "board without NVSwitch, each pair on 4 of the GPU's 12 NVLink3 links) is the row's scale-up bandwidth",
     ("AR_jubench_megatron_gpt13b_a100",),
     "FZJ-JSC/jubench-megatron-lm nlp_benchmark.yaml; Megatron-LM f7727433 megatron/model/transformer.py and "
     "megatron/core/models/common/rotary_pos_embedding.py; JSC's JUWELS Booster overview (NVLink3, 4 x HDR200)"),
    ("row reading: Modalities (stack \"modalities\"): PyTorch FSDP2 with its copy-out, bf16 reduce-scatters, eager, "
     "SDPA's FlashAttention-2 kernels, torch's LayerNorm on bf16 weights as one kernel (with llm-foundry's MPT: "
     "ONE_KERNEL_NORM_STACKS); Leonardo's custom A100 64GB as the a100-64gb preset",
     ("AS_modalities_fsdp2_leonardo_a100",),
     "Modalities/modalities at 3710ce53: configs/sweep_8B_fsdp2.yaml, models/model_factory.py (fully_shard, "
     "MixedPrecisionPolicy bf16 / bf16), models/gpt2/gpt2_model.py (nn.LayerNorm, repeat_kv_heads before SDPA); "
     "CINECA's Leonardo system page (4 x custom A100 64 GB HBM2, 2 x dual-port HDR, 400 Gbps a node)"),
    ("mechanism: DeepSpeed's pipeline engine under tensor parallelism sends each tp rank's 1/tp slice of the "
     "activation and of its gradient, and the receiving stage all-gathers it over the tp ranks "
     "(Job.pp_partitioned_sends)",
     ("AT_vtrain_megatron_deepspeed_a100", "R_bloom_176b", "S_bloom_prequel_a100_pipeline"),
     "DeepSpeed runtime/pipe/engine.py: is_pipe_partitioned / is_grad_partitioned with model parallelism, "
     "PartitionedTensor(...).to_meta() / .data() sent, PartitionedTensor.from_meta(...).full() on receipt"),
    # Issue 25, twenty-fifth round.
    ("row reading: NeMo in a container whose launcher turned Transformer Engine's cuDNN attention off (24.01-24.07) "
     "attends with flash-attn 2 (Job.flash_attention_2: FlashAttention-2's Hopper rate)",
     ("H_nemo_2407_h100_fp8", "AD_nemo_long_sequence_cp"),
     "NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/config.yaml at tags 24.01-24.07 (NVTE_FUSED_ATTN: 0, "
     "562dcb45 to 04b8d098) and examples/training/<model>/h100/*.sh; TransformerEngine v1.4 "
     "transformer_engine/pytorch/attention.py (the FusedAttention / FlashAttention choice)"),
)
