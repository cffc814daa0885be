"""What a served model is, in the quantities serving costs: weights by how they shard, KV-cache bytes per
token, and matmul / attention FLOPs per token -- including DeepSeek's multi-head latent attention (MLA).

Responsible for: `ServedModel` (a `ModelConfig` plus, for MLA models, the latent-attention dimensions, and each
layer's sliding window), built from a preset or a Hugging Face config.json (`served_model`, `layer_windows`), its
weights per GPU under a serving layout, its KV bytes per token and per sequence (whole model, and per GPU), and its
FLOPs per token. Torch-free.
Not responsible for: any time (`serving.py`), the latent attention's own shapes (`mla.py`, which the training
side prices too), or running the model (`meshlm.models`, which implements no MLA: `ModelConfig` models DeepSeek's
attention as GQA of the same width).

MLA (DeepSeek-V2, Liu et al. 2024, arXiv:2405.04434, Sec. 2.1; DeepSeek-V3 config.json): per layer and token
the cache holds one compressed latent c_KV of `kv_lora_rank` elements plus one decoupled RoPE key of
`qk_rope_head_dim` elements, shared by all heads (so tensor parallelism over heads does not split it: every tp
rank keeps the whole latent, which is why DeepSeek serves attention data-parallel). Its weights: W_DQ (h x
q_lora), W_UQ (q_lora x heads (nope + rope)), W_DKV + W_KR (h x (kv_lora + rope)), W_UK and W_UV (kv_lora x
heads (nope + v)), W_O (heads v x h). Prefill runs it as ordinary attention with head dims nope + rope (q, k)
and v; decode absorbs W_UK into the query and W_UV into the output (DeepSeek-V2 Sec. 2.1.2; FlashMLA), so
each head reads the latent: 2 (kv_lora + rope) + 2 kv_lora FLOPs per head and cached token.

Sliding-window layers (`ServedModel.windows`, read from config.json by `layer_windows`: gpt-oss's `layer_types`
with a 128-token `sliding_window`, Gemma 2/3's interleaved local layers, Mistral 7B v0.1's window on every layer,
Qwen2's `use_sliding_window` above `max_window_layers`): a token attends at most the `window` tokens before it,
so such a layer caches at most min(tokens, window) tokens of a sequence -- the convention of vLLM's hybrid KV
cache manager, which frees a request's blocks once they fall out of the window (vllm/v1/core/
single_type_kv_cache_manager.py, SlidingWindowManager: get_num_skipped_tokens = computed - window + 1, whole
blocks handed back by remove_skipped_blocks) into the one pool all layers share; the partial block at the window's
edge is ignored, as block rounding is for full layers. A decode step reads min(context, window) cached tokens
there, and a prompt of s tokens attends s^2 / 2 pairs up to s = window, s window - window^2 / 2 beyond.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from meshlm.config import ConfigError, ModelConfig
from meshlm.hf_config import load_config_json, model_config_from_hf, reading_fields
from meshlm.models import stats as model_stats
from meshlm.planner.mla import MLA, LatentConfig, matmul_params, model_latent_attention
from meshlm.planner.mla import matrices as mla_matrices

# Bytes per weight / KV element. NVFP4: 4-bit values plus one fp8 (E4M3) scale per 16-element block
# (NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference", 2025): 0.5 + 1/16 bytes.
# fp32: meshlm serves in float32 on CPUs (weights, activations and KV cache).
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5 + 1 / 16}
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}


@dataclass(frozen=True)
class ServedModel:
    cfg: ModelConfig
    mla: MLA | None = None
    # each layer's sliding window in tokens, 0 where it attends the whole sequence; () when no layer is windowed
    windows: tuple[int, ...] = ()

    def __post_init__(self):
        if self.windows and (len(self.windows) != self.layers or min(self.windows) < 0):
            raise ValueError(f"windows {self.windows}: expected one window >= 0 (0: full attention) per layer, "
                             f"{self.layers} layers")

    @property
    def layers(self) -> int:
        return self.cfg.num_layers

    def context_note(self, tokens: int) -> str | None:
        """Words for a sequence of `tokens` longer than the model's own context window (`max_seq_len`: the
        config's max_position_embeddings), None within it: the planner prices memory and time at any length, but
        the model was not trained for more, and the engines refuse it unless told to."""
        window = self.cfg.max_seq_len
        if tokens <= window:
            return None
        return (f"{tokens:,} tokens is beyond the model's context window of {window:,} (its max_position_embeddings): "
                f"memory and time are priced as asked, but the model was not trained that long, and engines refuse "
                f"longer requests unless told to (vLLM's --max-model-len, SGLang's --context-length)")

    def layer_window(self, layer: int) -> int:
        """Tokens layer `layer` attends back (0: every earlier token)."""
        return self.windows[layer] if self.windows else 0

    def cached_tokens(self, tokens: float, layers: range | None = None) -> float:
        """Tokens of KV one sequence of `tokens` holds, summed over `layers` (default all): `tokens` in a full
        layer, min(tokens, window) in a windowed one."""
        out = 0.0
        for i in layers if layers is not None else range(self.layers):
            w = self.layer_window(i)
            out += min(tokens, w) if w else tokens
        return out

    def attended_tokens(self, context: float, *, decode: bool) -> float:
        """Earlier tokens one query token attends, summed over the layers: `context` cached tokens in decode; in
        prefill `context` is the mean over a prompt of s = 2 context tokens (s / 2 each in full causal attention),
        and a windowed layer's mean is s / 2 up to s = window, window - window^2 / (2 s) beyond (its s window -
        window^2 / 2 pairs over s tokens)."""
        if decode:
            return self.cached_tokens(context)
        out = 0.0
        for i in range(self.layers):
            w, s = self.layer_window(i), 2 * context
            out += context if not w or s <= w else w - w * w / (2 * s)
        return out

    def attention_params_per_layer(self) -> float:
        if self.mla is None:
            return model_stats.layer_params(self.cfg, 0).attention
        return sum(matmul_params(self.cfg, self.mla))

    def params(self) -> dict:
        """Parameters by how a serving layout shards them: attention (tp; of it attention_replicated, MLA's
        down-projections, whole on every tp rank as vLLM runs them -- v0.11's deepseek_v2.py: fused_qkv_a_proj
        with disable_tp, else ReplicatedLinear), mlp (dense MLPs and shared experts, tp), experts
        (routed, ep), experts_active (top-k of one token), other (embedding, head, norms, router).
        Counted once per model (every iteration's pricing asks): a copy of `_params`."""
        return dict(self._params)

    @cached_property
    def _params(self) -> dict:
        p = model_stats.count_params(self.cfg)
        attention = self.attention_params_per_layer() * self.layers
        active = sum(model_stats.layer_params(self.cfg, i).experts_active for i in range(self.layers))
        other = p["embedding"] + p["lm_head"] + p["norms_router"]
        replicated = matmul_params(self.cfg, self.mla)[1] * self.layers if self.mla is not None else 0
        return {"attention": attention, "attention_replicated": replicated, "mlp": p["mlp"], "experts": p["experts"],
                "experts_active": active, "other": other, "total": attention + p["mlp"] + p["experts"] + other}

    def kv_elems_per_token_layer(self) -> int:
        """Cached elements per token and layer, all heads: K and V of each kv head, or MLA's latent + rope key."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.cfg.num_kv_heads * self.cfg.head_dim

    def kv_bytes_per_token(self, kv_bytes: float) -> float:
        """KV-cache bytes one new token of one sequence writes, whole model (every layer caches it)."""
        return self.layers * self.kv_elems_per_token_layer() * kv_bytes

    def kv_bytes(self, tokens: float, kv_bytes: float) -> float:
        """KV-cache bytes one sequence of `tokens` holds, whole model (what disaggregation ships of a prompt)."""
        return self.cached_tokens(tokens) * self.kv_elems_per_token_layer() * kv_bytes

    def kv_bytes_per_token_per_gpu(self, kv_bytes: float, *, tp: int, pp: int, cp: int) -> float:
        """Per GPU, what one new token writes: layers split by pp, the sequence by cp, kv heads by tp (replicated
        where tp exceeds them; MLA's latent is shared by all heads, so every tp rank keeps it whole)."""
        return math.ceil(self.layers / pp) * self._kv_layer_bytes(kv_bytes, tp=tp) / cp

    def kv_bytes_per_gpu(self, tokens: float, kv_bytes: float, *, tp: int, pp: int, cp: int) -> float:
        """KV bytes one sequence of `tokens` holds on the GPU that holds most of it: the stage (ceil(layers / pp)
        consecutive layers) caching the most tokens, the sequence split by cp, kv heads by tp."""
        return max(self.cached_tokens(tokens, stage) for stage in self._stages(pp)) \
            * self._kv_layer_bytes(kv_bytes, tp=tp) / cp

    def decode_kv_bytes_per_gpu(self, sequences: float, tokens: float, shared: float, kv_bytes: float, *, tp: int,
                                pp: int, cp: int) -> float:
        """KV bytes `sequences` decodes of `tokens` each read on the GPU that reads most: each its `kv_bytes_per_gpu`,
        but where their first `shared` tokens are one prefix read once for all (cascade attention), that prefix once
        in the full-attention layers (a windowed layer reads each sequence's own window)."""
        unit = self._kv_layer_bytes(kv_bytes, tp=tp) / cp  # one layer's bytes per token on one GPU
        return max(sequences * self.cached_tokens(tokens, stage)
                   - max(sequences - 1, 0.0) * self._full_layers(stage) * shared
                   for stage in self._stages(pp)) * unit

    def sequences_sharing_a_prefix(self, budget: float, tokens: float, prefix: float, kv_bytes: float, *, tp: int,
                                   pp: int, cp: int) -> int:
        """Sequences of `tokens` that fit `budget` bytes of KV per GPU (`kv_bytes_per_gpu` each), or, where their first
        `prefix` tokens are one prefix they all share, held once (the prefix caches of vLLM, SGLang and meshlm share
        its blocks among the running requests): on every stage the prefix once in its full-attention layers, and each
        sequence its own tokens past it there; a windowed layer is counted per sequence as without sharing (what it
        keeps of the prefix is gone once the sequence has moved a window past it). The least over the stages."""
        unit = self._kv_layer_bytes(kv_bytes, tp=tp) / cp  # one layer's bytes per token on one GPU
        fits = []
        for stage in self._stages(pp):
            shared = self._full_layers(stage) * prefix  # layer-tokens held once
            fits.append(max(0, int((budget - shared * unit) // ((self.cached_tokens(tokens, stage) - shared) * unit))))
        return min(fits)

    def max_cached_tokens(self, budget: float, kv_bytes: float, *, tp: int, pp: int, cp: int) -> int | None:
        """The longest sequence whose KV (`kv_bytes_per_gpu`) fits `budget` bytes per GPU, or None where its KV
        stops growing within the budget (every layer of some stage windowed: any length fits)."""
        unit = self._kv_layer_bytes(kv_bytes, tp=tp) / cp  # one layer's bytes per token on one GPU
        longest = None
        for stage in self._stages(pp):
            full = self._full_layers(stage)
            windows = sorted(self.layer_window(i) for i in stage if self.layer_window(i))
            # between the k-th and (k+1)-th smallest window the stage holds (the k windows) + (full + windows
            # left) x tokens; the first segment whose longest fitting length stays below its end holds the answer
            fits, saturated = None, 0.0
            for k in range(len(windows) + 1):
                slope = full + len(windows) - k
                if slope == 0:
                    break  # every window filled within the budget: the stage's KV no longer grows
                n = int((budget - saturated * unit) // (slope * unit))
                if n < (windows[k] if k < len(windows) else math.inf):
                    fits = max(n, 0)
                    break
                saturated += windows[k]
            if fits is not None:
                longest = fits if longest is None else min(longest, fits)
        return longest

    def _kv_layer_bytes(self, kv_bytes: float, *, tp: int) -> float:
        if self.mla is not None:
            return self.kv_elems_per_token_layer() * kv_bytes
        return 2 * max(1, self.cfg.num_kv_heads // tp) * self.cfg.head_dim * kv_bytes

    def _full_layers(self, stage: range) -> int:
        """The layers of `stage` that attend over the whole sequence (no sliding window)."""
        return sum(1 for i in stage if not self.layer_window(i))

    def _stages(self, pp: int) -> list[range]:
        per = math.ceil(self.layers / pp)
        return [range(s, min(s + per, self.layers)) for s in range(0, self.layers, per)]

    def matmul_flops_per_token(self) -> dict:
        """Forward matmul FLOPs of one token: `dense` (attention projections, dense MLPs, shared experts,
        router, head) and `experts` (its top-k routed experts)."""
        p = self._params
        router = self.cfg.hidden_size * self.cfg.num_experts * self.moe_layers()
        head = self.cfg.vocab_size * self.cfg.hidden_size
        return {"dense": 2.0 * (p["attention"] + p["mlp"] + router + head), "experts": 2.0 * p["experts_active"]}

    def gemm_pieces(self, *, tp: int, expert_tp: int) -> dict:
        """The GEMMs of one token's forward as (parameters, K) pairs -- their FLOPs are twice the parameters -- by
        `matmul_flops_per_token`'s parts: "body" (attention projections, dense MLPs, shared experts, router), "head"
        and "experts" (one routed expert's pair in each MoE layer; every routed expert has the same shapes).
        Column-parallel projections keep K whole, row-parallel ones (attention output, MLP down) split it by tp; a
        routed expert's down projection by `expert_tp` (how many ways each expert's width is split: tp without
        expert parallelism, the stage's GPUs over ep with it).
        Used for the tiles' fixed K cost (`kernels.k_scale`)."""
        return {name: [(p, k) for p, k, _ in pieces] for name, pieces in self._gemms(tp, expert_tp).items()}

    def gemm_kernels(self) -> dict:
        """The same GEMMs as (parameters of one kernel, kernels per forward) pairs: a piece of "body" runs once in
        each layer that has it (attention in every layer, a dense MLP in the dense ones, router and shared expert in
        the MoE ones), the head once, a routed expert's pair once per MoE layer (as one grouped GEMM each)."""
        return {name: [(p / n, n) for p, _, n in pieces] for name, pieces in self._gemms(1, 1).items()}

    def _gemms(self, tp: int, expert_tp: int) -> dict:
        """`gemm_pieces` with each piece's kernels per forward: (parameters over the model, K, kernels)."""
        c, m, h = self.cfg, self.mla, self.cfg.hidden_size
        H, moe = c.num_heads, self.moe_layers()
        dense = self.layers - moe
        if m is None:
            q, kv = H * c.head_dim, c.num_kv_heads * c.head_dim
            attn = [(h * (q + 2 * kv), h), (q * h, q / tp)]
        else:  # DeepSeek's latent attention (mla.py): the output projection's K split by tp, the rest's whole
            attn = [(n * k, k / tp if split == "k" else k) for n, k, split in mla_matrices(c, m)]
        body = [(p * self.layers, k, self.layers) for p, k in attn]
        if dense:
            f = c.intermediate_size
            body += [(2 * h * f * dense, h, dense), (f * h * dense, f / tp, dense)]
        if moe:
            s = c.shared_intermediate_size
            body += [(h * c.num_experts * moe, h, moe)]
            body += [(2 * h * s * moe, h, moe), (s * h * moe, s / tp, moe)] if s else []
        e = c.expert_intermediate_size if c.is_moe else 0
        experts = [(2 * h * e * moe, h, moe), (e * h * moe, e / expert_tp, moe)] if e else []
        return {"body": body, "head": [(c.vocab_size * h, h, 1)], "experts": experts}

    def attention_flops(self, context: float, *, decode: bool) -> float:
        """Attention-core FLOPs of one query token over `context` cached tokens (prefill: the prompt's mean), all
        layers (the FLOPs run; windowed layers over what they attend, `attended_tokens`)."""
        c, m = self.cfg, self.mla
        if m is None:
            per_head = 2 * c.head_dim + 2 * c.head_dim
        elif decode:  # absorbed: scores over latent + rope key, weighted sum of latents
            per_head = 2 * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank
        else:
            per_head = 2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 2 * m.v_head_dim
        return c.num_heads * per_head * self.attended_tokens(context, decode=decode)

    def elementwise_elems_per_token(self, *, tp: int, expert_split: int) -> float:
        """Activation elements one token's elementwise kernels read + write on one GPU, all layers (vLLM's decoder
        layer: two fused residual-add + RMSNorm read x and the residual and write both, 4 h each; rotary embedding
        reads and writes q and k; SiluAndMul reads 2 x ffn and writes ffn; a MoE layer permutes each token's
        hidden state to its k experts and sums them back, 3 k h, its k experts' activations spread over
        `expert_split` GPUs)."""
        c, h = self.cfg, self.cfg.hidden_size
        qk = (c.num_heads + max(1, c.num_kv_heads // tp)) * c.head_dim
        dense, moe = self.layers - self.moe_layers(), self.moe_layers()
        total = self.layers * (8 * h + 2 * qk / tp) + dense * 3 * c.intermediate_size / tp
        if moe:
            k = c.num_experts_per_token
            total += moe * ((3 * k * c.expert_intermediate_size + 3 * k * h) / expert_split
                            + 3 * c.shared_intermediate_size / tp)
        return total

    def moe_layers(self) -> int:
        return self._moe_layers

    @cached_property
    def _moe_layers(self) -> int:
        return sum(1 for i in range(self.layers) if self.cfg.is_moe_layer(i))


# transformers' defaults where a Gemma config.json names no layer_types: one full layer in every `pattern`
# (Gemma2Config: every other layer; Gemma3TextConfig: sliding_window_pattern 6)
_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}


def layer_windows(hf: dict) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention) a Hugging Face config.json describes, as transformers reads
    it: `layer_types` ("sliding_attention" / "full_attention") where given; else Qwen2's `use_sliding_window`
    (false: no window, whatever `sliding_window` says; true: the layers from `max_window_layers` on); else Gemma's
    `sliding_window_pattern` (every pattern-th layer full); else, with a `sliding_window`, every layer (Mistral)."""
    window, layers = hf.get("sliding_window") or 0, hf["num_hidden_layers"]
    if not window or hf.get("use_sliding_window") is False:
        return ()
    window = int(window)
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != layers:
            raise ConfigError(f"layer_types {unknown or types}: the serving planner reads one 'sliding_attention' or "
                             f"'full_attention' per layer ({layers} layers)")
        out = tuple(window if t == "sliding_attention" else 0 for t in types)
    elif hf.get("use_sliding_window"):
        out = tuple(window if i >= hf.get("max_window_layers", layers) else 0 for i in range(layers))
    elif hf.get("sliding_window_pattern") or hf.get("model_type") in _WINDOW_PATTERN:
        pattern = int(hf.get("sliding_window_pattern") or _WINDOW_PATTERN[hf["model_type"]])
        out = tuple(window if (i + 1) % pattern else 0 for i in range(layers))
    else:
        out = (window,) * layers
    return out if any(out) else ()


def served_model(spec: str | ModelConfig) -> ServedModel:
    """A preset name (MLA for the DeepSeek presets), a `ModelConfig`, or a Hugging Face config.json / directory
    (DeepSeek-V2/V3's `kv_lora_rank` / `qk_rope_head_dim` and the sliding windows, `layer_windows`, read here; the
    rest as `ModelConfig.from_hf`, which builds trainable models and so refuses windows: its copy is read without
    them, keeping the config's own `max_position_embeddings`)."""
    if isinstance(spec, ModelConfig):
        return ServedModel(spec, model_latent_attention(spec))
    hf = config_json(spec)
    if hf is not None:
        read = planner_only(hf)
        if read is not None:
            return read
        with reading_fields(hf, where=f"{spec}: config.json"):
            windows = layer_windows(hf)
        if windows:
            full = {k: v for k, v in hf.items() if k not in ("sliding_window", "use_sliding_window", "layer_types")}
            return ServedModel(model_config_from_hf(full), windows=windows)
    from meshlm.planner.inputs import resolve_model

    cfg = resolve_model(spec)
    return ServedModel(cfg, model_latent_attention(cfg))


# the deepest model the planner prices: its summaries, window lists and pipeline splits walk every layer, so a
# config.json of a billion layers would hang every command (found by fuzzing); published LLMs have a few hundred
MAX_LAYERS = 4096


def config_json(spec: str) -> dict | None:
    """The language model's part of the config.json `spec` names (or of the directory holding one), None where it
    names none. Gemma 3's multimodal config.json nests it as `text_config`."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix != ".json" or not path.exists():
        return None
    hf = load_config_json(path)
    if not isinstance(hf, dict) or not isinstance(hf.get("text_config") or {}, dict):
        raise ValueError(f"{path} holds a JSON {type(hf).__name__}, not a config.json object; pass a model "
                         "directory with its config.json")
    hf = hf.get("text_config") or hf
    layers = hf.get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise ValueError(f"--model {spec!r} has {layers:,} layers; the planner prices at most {MAX_LAYERS:,} (it "
                         "walks every layer; published LLMs have a few hundred at most)")
    return hf


def planner_only(hf: dict) -> ServedModel | None:
    """A config.json (`config_json`) of a model meshlm's runtime does not build, as the planner reads it: a
    DeepSeek-style one (`kv_lora_rank`) or one of `PLANNER_ONLY_TYPES`; None for the rest."""
    with reading_fields(hf):
        if hf.get("kv_lora_rank"):
            return _from_deepseek_hf(hf)
        if hf.get("model_type") in PLANNER_ONLY_TYPES:
            return _from_planner_only_hf(hf)
    return None


# config.json model types the serving planner reads though meshlm's model does not implement them (their weights
# could not be loaded into it): only the quantities serving costs -- shapes, experts, windows -- are taken.
PLANNER_ONLY_TYPES = ("gpt_oss", "gemma2", "gemma3", "gemma3_text")


def _from_planner_only_hf(hf: dict) -> ServedModel:
    """gpt-oss (every layer MoE: `num_local_experts` of `intermediate_size`, `num_experts_per_tok`, q/k/v/o biases)
    and Gemma 2 / 3 (dense, a gated GELU MLP of the same three matrices as SwiGLU, tied embeddings) as the planner
    prices them, with their sliding windows (`layer_windows`). What the planner does not price: gpt-oss's attention
    sinks and Gemma's extra norms (elementwise work of a few h per layer) and logit soft-capping."""
    kw = _hf_shapes(hf, head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                    max_seq_len=8192)
    if hf["model_type"] == "gpt_oss":
        kw.update(num_experts=hf["num_local_experts"], num_experts_per_token=hf.get("num_experts_per_tok", 4),
                  moe_intermediate_size=hf["intermediate_size"], attention_bias=bool(hf.get("attention_bias", True)),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    else:
        kw.update(tie_embeddings=bool(hf.get("tie_word_embeddings", True)))
    cfg = ModelConfig(**kw)
    cfg.validate()
    return ServedModel(cfg, windows=layer_windows(hf))


def _hf_shapes(hf: dict, *, head_dim: int, max_seq_len: int) -> dict:
    """The `ModelConfig` sizes every config.json the planner reads itself names alike (`max_seq_len`: where it gives
    no max_position_embeddings)."""
    heads = hf["num_attention_heads"]
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
                intermediate_size=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", max_seq_len))


def _from_deepseek_hf(hf: dict) -> ServedModel:
    """A DeepSeek-V2/V3 config.json: the MoE body (attention as GQA of the same width, as the deepseek-v3 preset), the
    latent attention `MLA` and the router's groups (n_group, topk_group), one `LatentConfig`."""
    mla = MLA(int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"]), int(hf.get("q_lora_rank") or 0),
              int(hf["qk_nope_head_dim"]), int(hf["v_head_dim"]))
    cfg = LatentConfig(**_hf_shapes(hf, head_dim=mla.v_head_dim, max_seq_len=4096), mla=mla,
                       router_groups=(int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)),
                       num_experts=hf.get("n_routed_experts") or 0,
                       num_experts_per_token=hf.get("num_experts_per_tok", 2),
                       moe_intermediate_size=hf.get("moe_intermediate_size"),
                       num_shared_experts=hf.get("n_shared_experts") or 0,
                       first_dense_layers=hf.get("first_k_dense_replace", 0),
                       moe_layer_freq=hf.get("moe_layer_freq", 1))
    cfg.validate()
    return ServedModel(cfg, mla)
