"""Serving on a cluster, one iteration at a time: where the weights and the KV cache sit under a serving layout,
how much KV fits, and how long one engine iteration (decodes + prefill tokens) takes on one GPU.

Responsible for: `Serving` (model, cluster, layout, precisions: weights and KV bytes per GPU, KV capacity, the
longest sequence that fits) and `iteration_time` (seconds of one iteration of one data-parallel rank, by component,
with what bounds it).
Not responsible for: the layout type and its checks (`serving_layout.py`), batching policy, arrivals or
disaggregation (`serving_modes.py`), the model's
quantities (`serving_model.py`: what a sequence caches, sliding-window layers at most their window), or the
runtime engine (`meshlm.infer`, which serves tp x cp).

Layout. A deployment of `world = dp x pp x tp x cp` GPUs: pp stages (outermost); inside a stage dp attention
ranks, each a tp x cp group that holds its own sequences (vLLM/TRT-LLM replicas, or DeepSeek-style attention
data parallelism). Routed experts: with ep = 1 split by tp inside each dp rank; with ep > 1 spread over all the
stage's dp x tp x cp ranks, ep-way by expert and the rest by width (TRT-LLM's moe_tp x moe_ep; DeepSeek's EP32 /
EP144 with attention DP; SGLang's DP-attention + DeepEP), so the MoE layers of a stage run as one group.

One iteration (every running sequence advances a token, plus prefill tokens mixed in: Sarathi-Serve, Agrawal
et al. OSDI'24; Orca, Yu et al. OSDI'22), per GPU, each term from the roofline of LLM inference (Williams et
al. 2009; Yuan et al. 2024, "LLM Inference Unveiled", arXiv:2402.16363):
  * GEMMs: 2 x params FLOPs per token (the output head's only for the rows sampled) at `Cluster.matmul_rate`
    (peak x matmul_efficiency, fp8 on Hopper and fp4 on Blackwell at their measured lower fractions of their
    peaks: cluster.py; 4-bit weights multiplied in 16 bits, W4A16, at the dequantizing kernel's measured share of
    the 16-bit rate: `Cluster.weight_only_gemm_factor`), each GEMM's tiles paying their fixed K cost as the training
    side prices them (`kernels.k_scale`: thin tp shards of K run below the rate), never faster than the weights
    stream through HBM once per (micro-)step; MoE reads only experts some token routed to (uniform routing:
    an expert is idle with probability (1 - k/E)^tokens); compute and memory time meet at a rounded corner
    (serving_engine.roofline, from DeepGEMM's kernel benchmarks) -- on a CPU (`Cluster.gemm_weight_bw`) they
    add: its BLAS packs the weights at the measured rate, then multiplies (one row: a matrix-vector product
    streaming them once at its own measured rate);
  * attention: decode reads each sequence's KV once (bandwidth-bound; once per query head where the engine's
    kernel does not share a GQA group's loads, serving_engine.Engine), prefill runs the causal square
    (compute-bound, FlashAttention's rate: `attention_efficiency`);
  * tp: two all-reduces of the tokens' hidden states per layer (Megatron, Shoeybi et al. 2019), exposed;
  * cp: decode -- each cp rank attends over its KV shard and the partial outputs + log-sum-exps are merged per
    layer (flash-decoding's split-KV merge, Dao et al. 2023; meshlm's cp serving); prefill -- ring attention
    passes KV blocks (Liu et al. 2023), overlapped with the attention it feeds;
  * ep: per MoE layer a dispatch (fp8) and a combine (bf16) all-to-all (DeepSeek-V3 report, arXiv:2412.19437,
    Sec. 3.4) -- DeepEP's low-latency kernels in decode iterations, its normal ones (holding SMs) with prefill
    (collectives.expert_all_to_all) --, where the engine does so overlapped with compute by two micro-batches
    that each read the weights (DeepSeek "Day 6" inference overview; SGLang TBO), else exposed; overlapped, each
    dispatch and combine hides only under the compute DeepSeek's published schedules run beside it
    (`serving_engine.overlapped_half`: in decode nothing hides the routed experts, which wait for their dispatch and
    feed their combine; in prefill SGLang's three stages per layer share one compute stream, whose waits hold back
    what is queued after them);
  * MTP speculative decoding: each decoding sequence carries its k drafts as extra query tokens (one KV read),
    the MTP module drafts the next k, and a step yields 1 + p + ... + p^k tokens (DeepSeek-V3 report, Sec. 5.4.3);
  * pp: each stage runs pp micro-batches per iteration (the batch split pp ways, a hand-off per boundary), so
    the weights stream pp times per iteration; a batch smaller than pp leaves stages idle (the serving bubble).
  * the engine's host work that nothing overlaps (`serving_engine.Engine.host_per_*`): vLLM V0's per-sequence
    scheduling, V1's (before async scheduling) per-sequence host work between steps, what async scheduling was
    measured to take off a step; meshlm's own engine (`--cluster local`: fp32 weights, activations and KV) measured
    by `meshlm plan calibrate` per step, sequence, decoder layer and (layer, sequence), plus its driver rank's
    messages (the step's input broadcast, the tp logits gathered, the cp sampled rows summed).
  * a CPU host (`Cluster.compute_slots`): ranks beyond its cores time-share them -- compute, memory and the
    collectives' copies -- as the training side prices it (placement.rank_setup).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshlm.planner.cluster import Cluster, time_shared
from meshlm.planner.kernels import k_scale
from meshlm.planner.serving_comm import act_bytes, dispatch_bytes, driver_comm, step_comm
from meshlm.planner.serving_engine import (DEEPEP_NORMAL_SMS, ENGINES, HOST_LAUNCH_S, KERNEL_FLOOR_S, Engine,
                                           expert_imbalance, kernel_floored, overlapped_half, roofline, stage_kernels,
                                           vllm_cascades)
from meshlm.planner.serving_layout import ServingLayout, check_serving_layout
from meshlm.planner.serving_model import KV_BYTES, WEIGHT_BYTES, ServedModel

# DeepSeek-V3 report (arXiv:2412.19437, Sec. 5.4.3): the second token predicted by its MTP module is accepted
# 85-90% of the time "across various generation topics" (1.8x the tokens per second). Later drafts are taken to be
# accepted at the same rate given the previous one was -- a chain, so a step yields sum_{i<=k} p^i tokens.
MTP_ACCEPTANCE = 0.875

# Share of the memory left after weights that the engine gives the KV cache: TensorRT-LLM's
# `free_gpu_memory_fraction` default 0.9 (of free memory after the weights; the rest holds activations, CUDA graphs
# and the sampler: the workspace). vLLM's `gpu_memory_utilization` and SGLang's `mem_fraction_static` are of the
# whole device (`Engine.device_share`).
KV_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class Serving:
    """A model deployed on a cluster with a layout and precisions: its memory per GPU."""

    sm: ServedModel
    cluster: Cluster
    layout: ServingLayout
    precision: str = "bf16"  # weights and GEMMs
    kv_precision: str = "bf16"
    engine: Engine = ENGINES["default"]  # the serving software's kernels and scheduling (serving_engine.py)
    # Weights and GEMMs of everything but the routed experts (attention, dense MLPs, shared experts, head); None:
    # `precision`. NVIDIA's NVFP4 DeepSeek-R1 checkpoint quantizes only the MoE layers to FP4 and keeps the rest in
    # DeepSeek's FP8 ("Optimizing DeepSeek R1 Throughput on NVIDIA Blackwell GPUs", TensorRT-LLM tech blog 3,
    # "Precision strategy"; nvidia/DeepSeek-R1-FP4 model card).
    dense_precision: str | None = None
    # The routed experts' GEMMs where they run wider than their weights (mixed-input quantization; None: the weights'
    # precision). TensorRT-LLM runs gpt-oss's MXFP4 experts with MXFP8 activations on Blackwell and BF16 ones on
    # Hopper (its gpt-oss README's "MoE Support Matrix", PR #6908, 2025-08; ModelConfig.get_mxfp4_quant_algo:
    # W4A8_MXFP4_MXFP8 on SM100, W4A16_MXFP4 before). An MXFP4 x MXFP8 product is Blackwell's mixed f8f6f4 MMA kind,
    # priced at the FP8 rate: the B200 datasheet rates FP8 and FP6 alike (4.5 PFLOP/s dense) and only FP4 x FP4 at 9
    # (read from the instruction kind, not from a kernel benchmark of the mixed GEMM).
    expert_gemm_precision: str | None = None
    # Speculative decoding with the model's own multi-token-prediction module (DeepSeek-V3's MTP, reused for each
    # draft as TensorRT-LLM's "MTP Eagle" and SGLang do): draft tokens per step, and the chance each draft token is
    # accepted given the one before it was (MTP_ACCEPTANCE).
    mtp_tokens: int = 0
    mtp_acceptance: float = MTP_ACCEPTANCE
    # ... or with a separate, smaller model of the same vocabulary proposing those drafts (draft-target speculative
    # decoding: TensorRT-LLM's draft-target model, vLLM's draft model, meshlm's method "draft"): each draft token is one
    # decode step of it over the sequences' context, on the deployment's layout; its weights and its KV share the
    # GPUs' memory with the model's (`draft_serving`).
    draft_model: ServedModel | None = None

    def __post_init__(self):
        if self.mtp_tokens < 0 or not 0.0 <= self.mtp_acceptance < 1.0:
            raise ValueError(f"MTP draft tokens {self.mtp_tokens} must be >= 0 and the acceptance "
                             f"{self.mtp_acceptance} in [0, 1)")
        if self.draft_model is not None:
            if not self.mtp_tokens:
                raise ValueError("a draft model proposes draft tokens: give how many per step (--mtp-tokens K)")
            if self.draft_model.cfg.vocab_size != self.sm.cfg.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({self.draft_model.cfg.vocab_size} tokens) is not the "
                                 f"model's ({self.sm.cfg.vocab_size}): a draft must share the tokenizer")
        for flag, value in (("--precision", self.precision), ("dense precision", self.dense_precision),
                            ("expert GEMM precision", self.expert_gemm_precision)):
            if value is not None and value not in WEIGHT_BYTES:
                raise ValueError(f"{flag} {value!r}: choose one of {sorted(WEIGHT_BYTES)}")
        if self.dense_precision is not None and _gemm(self.dense_precision) not in self.cluster.peak_flops:
            raise ValueError(f"--dense-precision {self.dense_precision}: {self.cluster.name} has no "
                             f"{_gemm(self.dense_precision)} tensor cores; choose one it has "
                             f"({', '.join(sorted(self.cluster.peak_flops))})")
        if self.expert_gemm_precision is not None and \
                WEIGHT_BYTES[self.expert_gemm_precision] < WEIGHT_BYTES[self.precision]:
            raise ValueError(f"expert GEMM precision {self.expert_gemm_precision!r} is narrower than the "
                             f"{self.precision!r} weights it multiplies: give one at least as wide, or none")
        if self.kv_precision not in KV_BYTES:
            raise ValueError(f"--kv-precision {self.kv_precision!r}: choose one of {sorted(KV_BYTES)}")
        if self.gemm_precision not in self.cluster.peak_flops and self.expert_gemm_precision is None:
            raise ValueError(f"{self.cluster.name} has no {self.gemm_precision} tensor cores: {self.precision} weights "
                             "run there with 16-bit activations (W4A16 -- gpt-oss's MXFP4 on Hopper or Ampere; 4-bit "
                             "AWQ / GPTQ checkpoints alike): give --expert-gemm-precision bf16 (every GEMM of a dense "
                             "model, the routed experts' of an MoE one), or a --precision it has "
                             f"({', '.join(sorted(self.cluster.peak_flops))})")
        self.cluster.peak(self.gemm_precision)  # any other GEMM precision the GPU lacks, naming the choices
        check_serving_layout(self.sm, self.layout)
        self.draft_serving()  # a draft model the layout cannot split, named

    @property
    def gemm_precision(self) -> str:
        """The routed experts' GEMMs: `expert_gemm_precision` where set, else the weights' (and every other GEMM's
        unless `dense_precision` says otherwise: `dense_gemm_precision`)."""
        return _gemm(self.expert_gemm_precision or self.precision)

    @property
    def dense_gemm_precision(self) -> str:
        """Every GEMM but the routed experts': `dense_precision`'s, else the weights' -- or, where the GPU has no
        tensor cores of the weights' precision, the experts' wider one (`expert_gemm_precision`: a weight-only
        checkpoint dequantizes every matrix in its kernel, W4A16)."""
        if self.dense_precision is None and self.expert_gemm_precision is not None \
                and _gemm(self.precision) not in self.cluster.peak_flops:
            return _gemm(self.expert_gemm_precision)
        return _gemm(self.dense_precision or self.precision)

    def weight_bytes_per_gpu(self) -> dict:
        """{"dense": attention, MLPs, shared experts, embedding and head; "experts": routed experts}."""
        p, lo = self.sm.params(), self.layout
        whole = p["attention_replicated"]  # MLA's down-projections: on every tp rank
        dense = (p["attention"] - whole + p["mlp"] + p["other"]) / (lo.tp * lo.pp) + whole / lo.pp
        expert_split = lo.stage if lo.ep > 1 else lo.tp
        return {"dense": dense * WEIGHT_BYTES[self.dense_precision or self.precision],
                "experts": p["experts"] / (lo.pp * expert_split) * WEIGHT_BYTES[self.precision]}

    def draft_serving(self) -> "Serving | None":
        """The draft model (`draft_model`) as served beside the model: same GPUs, layout, precisions and engine."""
        if self.draft_model is None:
            return None
        try:
            return replace(self, sm=self.draft_model, draft_model=None, mtp_tokens=0, dense_precision=None,
                           expert_gemm_precision=None)
        except ValueError as e:
            raise ValueError(f"the draft model on this layout: {e}") from None

    def kv_share(self) -> float:
        """The share of the KV cache that holds the model's own KV: all of it, or beside a draft model's its part of
        the bytes a token writes in both (exact where neither has sliding-window layers)."""
        draft = self.draft_serving()
        if draft is None:
            return 1.0
        own = self.kv_bytes_per_token_per_gpu()
        return own / (own + draft.kv_bytes_per_token_per_gpu())

    def mtp_tokens_per_step(self) -> float:
        """Tokens a decoding sequence gains per step: 1 + p + ... + p^k (k draft tokens, acceptance p)."""
        return sum(self.mtp_acceptance ** i for i in range(self.mtp_tokens + 1))

    def expert_imbalance(self) -> float:
        """The busiest expert-parallel rank's routed load over the mean (1 without ep)."""
        return expert_imbalance(self.sm.cfg.num_experts, self.layout.ep, self.engine.expert_balance)

    def kv_bytes_per_token_per_gpu(self) -> float:
        """What one new token of a sequence writes to the KV cache of one GPU (every layer caches it)."""
        lo = self.layout
        return self.sm.kv_bytes_per_token_per_gpu(KV_BYTES[self.kv_precision], tp=lo.tp, pp=lo.pp, cp=lo.cp)

    def kv_bytes_per_gpu(self, tokens: float) -> float:
        """KV bytes one sequence of `tokens` holds on a GPU (sliding-window layers at most their window)."""
        lo = self.layout
        return self.sm.kv_bytes_per_gpu(tokens, KV_BYTES[self.kv_precision], tp=lo.tp, pp=lo.pp, cp=lo.cp)

    def decode_kv_bytes(self, sequences: float, tokens: float, shared: float = 0.0) -> float:
        """KV bytes `sequences` decodes of `tokens` each read on a GPU, the first `shared` tokens read once for all
        (`ServedModel.decode_kv_bytes_per_gpu`)."""
        lo = self.layout
        return self.sm.decode_kv_bytes_per_gpu(sequences, tokens, shared, KV_BYTES[self.kv_precision], tp=lo.tp,
                                               pp=lo.pp, cp=lo.cp)

    def max_sequences(self, tokens: int, *, shared_prefix: int = 0) -> int:
        """Sequences of `tokens` whose KV one dp rank holds; with `shared_prefix`, their first tokens one prefix they
        all share, held once (`ServedModel.sequences_sharing_a_prefix`)."""
        lo = self.layout
        return self.sm.sequences_sharing_a_prefix(self.memory()["kv_capacity"] * self.kv_share(), tokens, shared_prefix,
                                                  KV_BYTES[self.kv_precision], tp=lo.tp, pp=lo.pp, cp=lo.cp)

    def memory(self) -> dict:
        """Bytes per GPU: weights (a draft model's too), workspace (what the engine keeps beside the KV cache, its
        profile run's peak `profile` among it), KV capacity (a draft model's KV in it too: `kv_share`) -- so capacity =
        HBM - reserved - weights - workspace exactly. The KV cache gets a share of what the weights leave
        (`Engine.free_memory_fraction`, default KV_MEMORY_FRACTION), or, for an engine that budgets a share of the whole
        device (`Engine.device_share`: vLLM, SGLang), that share less the weights, the reserve and the peak of the
        engine's profile run (`Engine.profile_peak_bytes`: vLLM's sampler)."""
        hbm, reserved = self.cluster.hbm_bytes, self.cluster.reserved_bytes
        draft = self.draft_serving()
        weights = sum(self.weight_bytes_per_gpu().values()) + (sum(draft.weight_bytes_per_gpu().values())
                                                                 if draft is not None else 0.0)
        free = max(hbm - reserved - weights, 0.0)
        lo = self.layout
        share = self.engine.device_share(hbm, parallel=lo.tp * lo.pp, dp_attention=lo.attention_dp,
                                         draft=self.mtp_tokens > 0)
        if share is None:
            profile = 0.0
            kv = (self.engine.free_memory_fraction or KV_MEMORY_FRACTION) * free
        else:
            profile = self.engine.profile_peak_bytes(self.sm.cfg.vocab_size, self.cluster)
            kv = min(max(share * hbm - reserved - weights - profile, 0.0), free)
        return {"weights": weights, "workspace": free - kv, "kv_capacity": kv, "reserved": reserved, "hbm": hbm,
                "profile": profile}

    def max_tokens(self) -> int:
        """The longest single sequence whose KV one dp rank holds (its tp x cp x pp GPUs together); where the KV
        stops growing (every layer of a stage windowed, Mistral 7B v0.1) the model's own position limit."""
        lo = self.layout
        n = self.sm.max_cached_tokens(self.memory()["kv_capacity"] * self.kv_share(), KV_BYTES[self.kv_precision],
                                      tp=lo.tp, pp=lo.pp, cp=lo.cp)
        return self.sm.cfg.max_seq_len if n is None else n


# Bytes of one GEMM operand element by the precision it runs in (fp4: 4 bits, its block scales aside).
ELEMENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "fp4": 0.5}


def _gemm(precision: str) -> str:
    return "bf16" if precision == "fp16" else precision


def weight_only(weights: str, gemm: str) -> bool:
    """Whether GEMMs of `weights`-precision weights in `gemm` precision are weight-only: 4-bit weights dequantized
    into 16-bit GEMMs (W4A16)."""
    return weights == "fp4" and gemm == "bf16"


def _weight_only(cl: Cluster, weights: str, gemm: str) -> float:
    """The share of the `gemm`-precision GEMM rate GEMMs of `weights`-precision weights reach: the GPU's measured
    `weight_only_gemm_factor` where they are W4A16 (`weight_only`), 1 for weights and activations of one precision."""
    return cl.weight_only_gemm_factor if weight_only(weights, gemm) else 1.0


def _work(sv: Serving, *, d: float, kv_len: float, p: float, p_ctx: float, p_rank: float, shared: float = 0.0) -> dict:
    """FLOPs and HBM bytes per GPU of one micro-step: d decode tokens over kv_len cached tokens each (the first
    `shared` of them one prefix they all share, read once where the engine cascades: `_cascades`), p prefill tokens
    (the mean over dp ranks; `p_rank` on this rank) attending over p_ctx earlier tokens on average, through one
    stage's layers. Routed experts see every dp rank's tokens (the mean); the rest only this rank's."""
    sm, lo, cfg = sv.sm, sv.layout, sv.sm.cfg
    f = 1.0 / lo.pp
    q = d * (1 + sv.mtp_tokens)  # query tokens of the decoding sequences: each verifies its MTP drafts too
    # decode tokens run the projections on every cp rank (or only on the one holding their KV slot:
    # Engine.cp_decode_on_owner); prefill is split
    q_here = q / lo.cp if sv.engine.cp_decode_on_owner else q
    gemm_tokens = q_here + p_rank / lo.cp
    fl = sm.matmul_flops_per_token()
    if lo.ep > 1:
        expert_flops = lo.dp * (q + p) * fl["experts"] * f / lo.stage * sv.expert_imbalance()
        routed_tokens = lo.dp * (q + p)
    else:
        expert_flops, routed_tokens = gemm_tokens * fl["experts"] * f / lo.tp, q + p_rank
    w = sv.weight_bytes_per_gpu()
    touched = 1.0 - (1.0 - cfg.num_experts_per_token / cfg.num_experts) ** routed_tokens if cfg.is_moe else 0.0
    attn = (q * sm.attention_flops(kv_len, decode=True) + p_rank * sm.attention_flops(p_ctx, decode=False)) * f
    kv_tok = sv.kv_bytes_per_token_per_gpu()
    once = shared if _cascades(sv, requests=d, prefix=shared, decode_only=p_rank == 0) else 0.0
    elems = sm.elementwise_elems_per_token(tp=lo.tp, expert_split=lo.stage if lo.ep > 1 else lo.tp)
    # the output head runs only for the rows an engine samples (vLLM's logits indices, TensorRT-LLM without
    # gather_context_logits, SGLang, meshlm's engine): each decode query token, and one per prompt -- a prompt of
    # 2 x p_ctx tokens on average, so p_rank / (2 p_ctx) of them per prompt token passing
    head = 2.0 * cfg.vocab_size * cfg.hidden_size
    sampled = q_here + (p_rank / (2 * p_ctx) if p_ctx > 0 else p_rank)
    whole = 2.0 * sm.params()["attention_replicated"]  # MLA's down-projections: every tp rank runs them whole
    body_flops = gemm_tokens * ((fl["dense"] - head - whole) / lo.tp + whole) * f
    head_flops = sampled * head * f / lo.tp
    dense_flops = body_flops + head_flops
    # what they cost at the large-GEMM rate, each GEMM's tiles paying their fixed K (kernels.k_scale: thin tp shards
    # of K -- attention output, MLP down -- run below the rate, as the training side prices them)
    pieces = sm.gemm_pieces(tp=lo.tp, expert_tp=lo.stage // lo.ep if lo.ep > 1 else lo.tp)  # the width split
    tile = lambda name, precision: k_scale(pieces[name], k_overhead=sv.cluster.gemm_k_overhead,  # noqa: E731
                                           in_bytes=ELEMENT_BYTES[precision])
    dense_p = sv.dense_gemm_precision
    return {"gemm_rows": gemm_tokens, "gemm_flops": dense_flops + expert_flops, "dense_gemm_flops": dense_flops,
            "expert_gemm_flops": expert_flops,
            "dense_gemm_tile_flops": body_flops * tile("body", dense_p) + head_flops * tile("head", dense_p),
            "expert_gemm_tile_flops": expert_flops * tile("experts", sv.gemm_precision),
            "elementwise_bytes": act_bytes(sv) * gemm_tokens * elems * f,
            "weight_bytes": w["dense"] + w["experts"] * touched, "dense_weight_bytes": w["dense"],
            "expert_weight_bytes": w["experts"] * touched,
            "attn_flops": attn / (lo.tp * lo.cp),
            # read the cache (once per query head where the kernel does not share a GQA group's loads; once for
            # a sequence's MTP query tokens together; a windowed layer its window; a shared prefix once for all
            # where the engine cascades), write the new tokens
            "kv_bytes": sv.decode_kv_bytes(d, kv_len, once) * _kv_reads(sv) + (q + p_rank / lo.cp) * kv_tok}


def _cascades(sv: Serving, *, requests: float, prefix: float, decode_only: bool) -> bool:
    """Whether the engine attends a step's `requests` decodes by cascade attention over the `prefix` they share
    (`Engine.cascade_attention`: vLLM's rule, `vllm_cascades`, with this GPU's heads and SMs; never for latent
    attention, whose vLLM backends do not cascade)."""
    if not (prefix and sv.engine.cascade_attention) or sv.sm.mla is not None:
        return False
    cfg, tp = sv.sm.cfg, sv.layout.tp
    return vllm_cascades(prefix=prefix, requests=requests, q_heads=cfg.num_heads // tp,
                         kv_heads=max(1, cfg.num_kv_heads // tp), sms=sv.cluster.sm_count, decode_only=decode_only)


def _kv_reads(sv: Serving) -> float:
    """Times the decode-attention kernel reads each cached KV head: 1, or the query heads sharing it where the
    engine's kernel does not share their loads (`Engine.gqa_shared_kv`; MLA's latent is always read once)."""
    cfg, tp = sv.sm.cfg, sv.layout.tp
    if sv.engine.gqa_shared_kv or sv.sm.mla is not None:
        return 1.0
    return max(1.0, (cfg.num_heads / tp) / max(1, cfg.num_kv_heads // tp))


def _host_shared(sv: Serving) -> tuple[Cluster, float]:
    """The cluster as one rank sees it, and by how much its ranks time-share compute (`cluster.time_shared`, as
    the training side's placement.world_setup prices it): 1 on GPUs."""
    return time_shared(sv.cluster, sv.layout.world)


def iteration_time(sv: Serving, *, decodes: float, kv_len: float, prefill_tokens: float = 0.0,
                   prefill_ctx: float = 0.0, rank_prefill: float | None = None, shared_prefix: float = 0.0) -> dict:
    """One iteration of one dp rank: `decodes` sequences each advance a token over `kv_len` cached tokens, the
    first `shared_prefix` of them one prefix they all share (`Workload.shared_prefix_len`), and `prefill_tokens`
    prompt tokens (attending over `prefill_ctx` earlier tokens on average) ride along -- `rank_prefill` of them on
    this rank where dp ranks differ (the routed experts see the mean).
    Returns seconds: "total" and by component, and "bound" (what the largest part is).

    Each stage runs pp micro-batches per iteration (a batch below pp leaves stages idle). Where the engine
    hides the expert all-to-all behind two micro-batches (`Engine.two_batch_overlap`, ep > 1), each half of
    the batch runs every layer -- reading the weights again -- while the other half's tokens travel, each
    dispatch and combine under the piece of compute the schedule pairs it with (`serving_engine.overlapped_half`).

    With MTP drafts (`Serving.mtp_tokens` = k > 0) one step verifies each sequence's k drafts with the main model
    (k + 1 query tokens over one read of its KV; TensorRT-LLM tech blog 2, "Attention for MTP") and drafts the next
    k with the MTP module, one decoder layer run k times (priced as 1 / layers of a plain step each) -- or with a
    draft model (`Serving.draft_model`), k decode steps of it (TensorRT-LLM's draft-target, vLLM's draft model); it
    yields `Serving.mtp_tokens_per_step` tokens per sequence. The times returned are per generated token: the step over
    that yield (and the prefill tokens given are per generated token too, so a step carries that many more)."""
    proposer = sv.draft_serving()
    if not (sv.mtp_tokens and decodes > 0):
        step = _step(sv, decodes=decodes, kv_len=kv_len, prefill_tokens=prefill_tokens, prefill_ctx=prefill_ctx,
                     rank_prefill=rank_prefill, shared_prefix=shared_prefix)
        if proposer is None or not prefill_tokens:
            return step
        # a draft model prefills the prompt tokens too (its own KV)
        draft = _step(proposer, decodes=0, kv_len=0, prefill_tokens=prefill_tokens, prefill_ctx=prefill_ctx,
                      rank_prefill=rank_prefill)["total"]
        return dict(step, total=step["total"] + draft, mtp_draft=draft)
    a = sv.mtp_tokens_per_step()
    prompt = dict(prefill_tokens=prefill_tokens * a, prefill_ctx=prefill_ctx,
                  rank_prefill=None if rank_prefill is None else rank_prefill * a)
    step = _step(sv, decodes=decodes, kv_len=kv_len, shared_prefix=shared_prefix, **prompt)
    if proposer is None:  # the MTP module: one decoder layer a draft token
        draft = sv.mtp_tokens * _step(replace(sv, mtp_tokens=0), decodes=decodes, kv_len=kv_len,
                                      shared_prefix=shared_prefix)["total"] / sv.sm.layers
    else:  # a draft model: one decode step of it a draft token, the first with the step's prompt tokens
        decode = dict(decodes=decodes, kv_len=kv_len, shared_prefix=shared_prefix)
        draft = _step(proposer, **decode, **prompt)["total"] + (sv.mtp_tokens - 1) * _step(proposer, **decode)["total"]
    out = {k: v / a for k, v in step.items() if k != "bound"}
    return dict(out, total=(step["total"] + draft) / a, mtp_draft=draft / a, bound=step["bound"])


def _step(sv: Serving, *, decodes: float, kv_len: float, prefill_tokens: float = 0.0, prefill_ctx: float = 0.0,
          rank_prefill: float | None = None, shared_prefix: float = 0.0) -> dict:
    """One engine step of one dp rank (iteration_time without the MTP accounting)."""
    lo = sv.layout
    split = lambda x: x / lo.pp if decodes + prefill_tokens >= lo.pp else x  # noqa: E731
    d, p = split(decodes), split(prefill_tokens)
    p_rank = p if rank_prefill is None else split(rank_prefill)
    halves = 2 if lo.ep > 1 and sv.engine.two_batch_overlap and _splits_in_two(d, p) else 1
    m = _micro_step(sv, d=d / halves, kv_len=kv_len, p=p / halves, p_ctx=prefill_ctx, p_rank=p_rank / halves,
                    shared=shared_prefix)
    work, ep, host, stages = m.pop("work"), m.pop("ep"), m.pop("host"), m.pop("stages")
    micro = overlapped_half(stages, decode=p == 0) if halves == 2 else work + ep
    scale = lo.pp * halves
    # the engine's per-step CPU work that the GPU waits for (Engine.host_per_seq_s ...), once per iteration
    sched = _engine_host(sv, decodes=decodes, prefill_tokens=prefill_tokens, prefill_ctx=prefill_ctx)
    gpu = scale * max(micro, host)
    bound = "host" if host > micro or sched > gpu else max(m["parts"], key=m["parts"].get)
    return {"total": gpu + sched, "bound": bound, **{k: scale * v for k, v in m.pop("parts").items()},
            **{k: scale * v for k, v in m.items()}, "host": scale * host + sched, "scheduler": sched,
            "ep_exposed": scale * (max(micro, host) - max(work, host))}


def _engine_host(sv: Serving, *, decodes: float, prefill_tokens: float, prefill_ctx: float) -> float:
    """Seconds of one iteration's host work that nothing overlaps (`Engine.host_per_*`): per step, per running
    sequence, and per decoder layer and (layer, sequence) of a stage -- these on every rank at once, so
    time-shared cores stretch them (`_host_shared`) -- plus a driver rank's own messages. The sequences are the
    decoding ones and those prefilling: `prefill_tokens` over their prompts (2 x `prefill_ctx`, the callers'
    mean context of a prompt token being half its prompt), one where no context is given."""
    e, lo = sv.engine, sv.layout
    prefill_seqs = (prefill_tokens / (2 * prefill_ctx) if prefill_ctx > 0 else 1.0) if prefill_tokens > 0 else 0.0
    seqs = decodes + prefill_seqs
    cl, share = _host_shared(sv)
    layers = sv.sm.layers / lo.pp
    out = e.host_per_step_s + e.host_per_seq_s * seqs + share * layers * (e.host_per_layer_s
                                                                         + e.host_per_layer_seq_s * seqs)
    if e.driver_broadcast and lo.world > 1:
        out += driver_comm(sv, cl, sampled=seqs)
    return out


def _splits_in_two(d: float, p: float) -> bool:
    """Whether a micro-step holds two micro-batches' worth of work for two-batch overlap: at least two decoding
    sequences (SGLang's TBO and DeepSeek's dual micro-batch split a decode batch by sequences), or a prefill-only
    step of at least two tokens (its tokens split in two halves of equal work). One sequence cannot be split:
    overlapping it would only read the weights twice."""
    return d >= 2 or (d == 0 and p >= 2)


def _micro_step(sv: Serving, *, d: float, kv_len: float, p: float, p_ctx: float, p_rank: float,
                shared: float = 0.0) -> dict:
    """Seconds of one micro-batch through one stage: "work" (GEMMs, attention, elementwise kernels, tp/cp/pp
    communication, one after another), "ep" (the expert all-to-all), "host" (launching it without CUDA graphs),
    "parts" (by what bounds each) and the roofline's components."""
    cl, share = _host_shared(sv)
    w = _work(sv, d=d, kv_len=kv_len, p=p, p_ctx=p_ctx, p_rank=p_rank, shared=shared)
    hbm = cl.hbm_bw * cl.hbm_efficiency / share
    rate = cl.matmul_rate(sv.gemm_precision) / share * _weight_only(cl, sv.precision, sv.gemm_precision)
    dense_rate = (cl.matmul_rate(sv.dense_gemm_precision) / share
                  * _weight_only(cl, sv.dense_precision or sv.precision, sv.dense_gemm_precision))
    # attention in the model's 16-bit type (bf16 under fp8 / fp4 weights), or fp32 where it is served so
    attn_rate = cl.peak("fp32" if sv.precision == "fp32" else "bf16") * cl.attention_efficiency / share
    dense_c, dense_m = w["dense_gemm_tile_flops"] / dense_rate, w["dense_weight_bytes"] / hbm
    expert_c, expert_m = w["expert_gemm_tile_flops"] / rate, w["expert_weight_bytes"] / hbm
    gemm_c, gemm_m = dense_c + expert_c, dense_m + expert_m
    attn_c, attn_m = w["attn_flops"] / attn_rate, w["kv_bytes"] / hbm
    comm = step_comm(sv, d=d, p=p, cl=cl)
    ep = sum(t for (kind, _), t in comm.items() if kind == "ep")
    if cl.gemm_weight_bw:  # a CPU BLAS: the weights' packing pass, then the FLOPs (Cluster.gemm_weight_bw)
        pack = cl.gemm_weight_bw / share
        dense, dense_m = _cpu_dense_gemms(sv, share, rows=w["gemm_rows"], flops_s=dense_c,
                                          nbytes=w["dense_weight_bytes"])
        experts = expert_c + w["expert_weight_bytes"] / pack
        gemm_m = dense_m + w["expert_weight_bytes"] / pack
    else:  # the dense GEMMs and the routed experts' grouped GEMMs are separate kernels, each at its own corner
        dense, experts = roofline(dense_c, dense_m), roofline(expert_c, expert_m)
    attn = roofline(attn_c, attn_m)
    if not cl.gemm_weight_bw and not sv.engine.eager_host:  # each kernel lasts at least its launch
        dense, experts, attn = kernel_floored(sv.sm.gemm_kernels(), layers=sv.sm.layers, pp=sv.layout.pp,
                                              dense=dense, experts=experts, attn=attn)
    if ep and p > 0 and sv.engine.ep_all_to_all == "deepep" and sv.engine.two_batch_overlap:
        dense, experts, attn = (x / (1 - DEEPEP_NORMAL_SMS * cl.comm_sm_fraction / 16) for x in (dense, experts, attn))
    gemm = dense + experts
    small, kernels = stage_kernels(layers=sv.sm.layers / sv.layout.pp, moe=sv.sm.moe_layers() / sv.layout.pp,
                                   tp=sv.layout.tp, ep=sv.layout.ep)
    # an eager engine's measured per-layer host work already holds these kernels' dispatch (_engine_host)
    elementwise = max(0.0 if sv.engine.eager_host else small * KERNEL_FLOOR_S, w["elementwise_bytes"] / hbm)
    other_comm = sum(t for (kind, _), t in comm.items() if kind != "ep")
    stages = _stages(sv, dense=dense, experts=experts, attn=attn, elementwise=elementwise, ep=ep, other=other_comm)
    parts = {"compute": (gemm if gemm_c > gemm_m else 0.0) + (attn if attn_c > attn_m else 0.0),
             "memory bandwidth": (gemm if gemm_m >= gemm_c else 0.0) + (attn if attn_m >= attn_c else 0.0)
             + elementwise}
    for (kind, tier), t in comm.items():
        parts[tier] = parts.get(tier, 0.0) + t
    return {"work": gemm + attn + elementwise + other_comm, "ep": ep, "stages": stages,
            "host": 0.0 if sv.engine.cuda_graphs else kernels * HOST_LAUNCH_S, "parts": parts,
            "gemm_compute": gemm_c, "gemm_memory": gemm_m, "attention_compute": attn_c, "attention_memory": attn_m,
            "elementwise": elementwise}


def _stages(sv: Serving, *, dense: float, experts: float, attn: float, elementwise: float, ep: float,
            other: float) -> dict:
    """One micro-batch's seconds through its stage as the pieces a two-batch-overlap schedule pairs up, summed
    over the MoE layers: "attn_in" (attention projections before the core and the elementwise kernels), "attn_out"
    (core attention, output projection, routing gate), "shared" (shared experts), "experts" (routed experts'
    GEMMs), "dispatch" and "combine" (the all-to-all split by bytes: out in fp8 or the weights' 16 bits, back in
    bf16), and "rest" (the dense layers, the head, tp/cp/pp messages) that no all-to-all runs beside. The dense
    GEMM time is shared out by parameters (the same tokens pass every dense projection, so FLOPs and bytes both go
    as parameters)."""
    sm, cfg = sv.sm, sv.sm.cfg
    moe, layers, h = sm.moe_layers(), sm.layers, cfg.hidden_size
    attn_layer = sm.attention_params_per_layer()
    out_proj = cfg.num_heads * (sm.mla.v_head_dim if sm.mla is not None else cfg.head_dim) * h
    dense_params = sm.matmul_flops_per_token()["dense"] / 2
    share = lambda params: dense * params / dense_params if dense_params else 0.0  # noqa: E731
    at_moe = moe / layers  # the MoE layers' share of what every layer runs
    shared = share(moe * 3 * h * cfg.shared_intermediate_size)
    attn_in = share(moe * (attn_layer - out_proj)) + elementwise * at_moe
    attn_out = attn * at_moe + share(moe * (out_proj + h * cfg.num_experts))
    dispatch = ep * dispatch_bytes(sv) / (dispatch_bytes(sv) + 2.0)
    rest = dense + attn + elementwise + other - shared - attn_in - attn_out
    return {"attn_in": attn_in, "attn_out": attn_out, "shared": shared, "experts": experts, "dispatch": dispatch,
            "combine": ep - dispatch, "rest": rest}


def _cpu_dense_gemms(sv: Serving, share: float, *, rows: float, flops_s: float, nbytes: float) -> tuple[float, float]:
    """Seconds of one rank's dense GEMMs of a micro-step on a CPU BLAS, and of their weights' pass within them. From
    two rows on, the BLAS packs the weights (`Cluster.gemm_weight_bw`, `gemm_call_s` per matrix), then multiplies
    (`flops_s`); one row is a matrix-vector product that streams them once, unpacked (`gemv_weight_bw`,
    `gemv_call_s`), where the calibration measured it. Between one and two rows (a mean over iterations) the
    share above one packs. The output head is counted at the body's rows (a prompt's one sampled row packs with
    them; the head is a few percent of a model's weights)."""
    cl, calls = sv.cluster, share * _gemm_calls(sv)
    packed = nbytes / (cl.gemm_weight_bw / share) + calls * cl.gemm_call_s
    if not cl.gemv_weight_bw or rows >= 2:
        return flops_s + packed, packed
    gemv = nbytes / (cl.gemv_weight_bw / share) + calls * cl.gemv_call_s
    two = max(0.0, rows - 1.0)
    return two * (flops_s + packed) + (1 - two) * gemv, two * packed + (1 - two) * gemv


def _gemm_calls(sv: Serving) -> float:
    """Weight matrices one rank multiplies per micro-step through its stage: meshlm's decoder layer runs seven
    (q, k, v, o, gate, up, down; a MoE layer's experts are counted as one such set), the head one (its stage's
    share of it)."""
    return (7 * sv.sm.layers + 1) / sv.layout.pp


def kv_transfer_bytes(sm: ServedModel, *, prompt_tokens: int, kv_precision: str) -> float:
    """Bytes a disaggregated deployment ships per request: the prompt's KV (2 x kv_heads x head_dim x bytes per
    token and layer; MLA: kv_lora_rank + rope), of each windowed layer only the window it keeps."""
    return sm.kv_bytes(prompt_tokens, KV_BYTES[kv_precision])
