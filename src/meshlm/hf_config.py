"""Hugging Face `config.json` <-> `ModelConfig`: reading the supported model types, and writing one back.

Responsible for: mapping the config.json of llama, mistral, phi3, qwen2, qwen3, mixtral, qwen2_moe and qwen3_moe
to a `ModelConfig` (refusing, with a `ConfigError` naming the option, what the reference model does not
implement: another activation, MLP or o_proj biases, Qwen's use_sliding_window, RoPE scaling other than llama3 /
yarn / linear, a partial rotary dimension, a MoE layer pattern other than every n-th layer after a leading dense
run; Mistral's and Phi-3's sliding window caps the context at the window instead), and the inverse for
export: the simplest model type that expresses a config exactly. `ModelConfig.from_hf`, `from_hf_dict` and
`to_hf_dict` delegate here.
Not responsible for: the weights (`meshlm.models.hf`), or touching torch.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from meshlm.config import ROPE_SCALING_KEYS, ConfigError, ModelConfig


def read_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face `config.json` (file or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"no Hugging Face config at {str(path)!r}; pass a model directory with config.json")
    hf = load_config_json(path)
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} holds a JSON {type(hf).__name__}, not an object; pass a model directory with "
                          "its config.json")
    try:
        return model_config_from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def load_config_json(path: Path) -> Any:
    """What a config.json holds, or a ConfigError naming the file where it is not JSON."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a JSON file ({e}); pass a model directory with its config.json") from None


@contextlib.contextmanager
def reading_fields(hf: dict, where: str = "config.json"):
    """Reading `hf`'s fields inside: a missing one (KeyError) or one of the wrong type -- a null, a string, a list, a
    zero divided by -- becomes one ConfigError naming it; a ConfigError passes as it is."""
    try:
        yield
    except ConfigError:
        raise
    except KeyError as e:
        raise ConfigError(f"{where} lacks {e.args[0]!r}, which a {hf.get('model_type') or 'model'} config.json "
                          "holds") from None
    except (TypeError, AttributeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"{where} has a field of the wrong type ({e})") from None


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The model a Hugging Face `config.json`'s contents describe (validated), or a ConfigError naming
    what the reference model does not implement, or the field it lacks or cannot read."""
    with reading_fields(hf):
        return _model_config_from_hf(hf)


def _model_config_from_hf(hf: dict) -> ModelConfig:
    arch = (hf.get("architectures") or [""])[0]
    model_type = hf.get("model_type", "")
    supported = {"llama", "mistral", "phi3", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"}
    if model_type not in supported:
        raise ConfigError(f"Hugging Face model_type={model_type!r} ({arch}) is not supported; "
                          f"supported: {sorted(supported)}")
    _check_hf_supported(hf, model_type)
    num_heads = hf["num_attention_heads"]
    max_seq_len = _scaled_context(hf.get("max_position_embeddings", 2048), _hf_rope_scaling(hf))
    # Mistral's (and Phi-3's) sliding window only changes attention beyond `sliding_window` tokens; up to there
    # full causal attention is exact, so cap the length rather than refuse the model.
    window = hf.get("sliding_window") if model_type in ("mistral", "phi3") else None
    if window:
        max_seq_len = min(max_seq_len, window)
    if model_type == "qwen2_moe":  # transformers names the q/k/v bias flag differently here
        attention_bias = bool(hf.get("qkv_bias", hf.get("attention_bias", True)))
    else:
        attention_bias = bool(hf.get("attention_bias", model_type == "qwen2"))
    kw: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or (hf["hidden_size"] // num_heads if num_heads else 0),  # 0 heads: refused
        intermediate_size=hf.get("intermediate_size") or hf.get("moe_intermediate_size"),
        max_seq_len=max_seq_len,
        rope_theta=float(_hf_rope_theta(hf)),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        init_std=hf.get("initializer_range", 0.02),
    )
    rs = _hf_rope_scaling(hf)
    if rs is not None:
        kw["rope_scaling"] = rs
    if model_type == "mixtral":
        kw.update(num_experts=hf["num_local_experts"], num_experts_per_token=hf["num_experts_per_tok"],
                  norm_topk_prob=True, router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.02))
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        # transformers 5 writes qwen3_moe's expert count as num_local_experts; older files say num_experts.
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        first_dense, freq = _hf_moe_layer_pattern(hf, num_experts)
        kw.update(num_experts=num_experts, num_experts_per_token=hf["num_experts_per_tok"],
                  moe_intermediate_size=hf["moe_intermediate_size"],
                  norm_topk_prob=bool(hf.get("norm_topk_prob", model_type == "qwen3_moe")),
                  moe_layer_freq=freq, first_dense_layers=first_dense,
                  router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
        if model_type == "qwen2_moe" and hf.get("shared_expert_intermediate_size", 0):
            kw.update(num_shared_experts=1, shared_expert_gate=True,
                      shared_expert_intermediate_size=hf["shared_expert_intermediate_size"])
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


def hf_config_of(cfg: ModelConfig) -> dict:
    """The Hugging Face `config.json` of this model (the inverse of `model_config_from_hf`).

    The model type is the simplest one that expresses the config exactly: qwen3 (q/k norm),
    qwen2 (q/k/v bias) or llama when dense; qwen3_moe (q/k norm), qwen2_moe (gated shared
    expert) or mixtral when MoE. A config no Hugging Face type expresses raises ConfigError.
    """
    cfg.validate()
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    model_type = _hf_model_type(cfg, moe_layers)
    archs = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM"}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None if cfg.rope_scaling is None else {"rope_type": cfg.rope_type, **cfg.rope_scaling}
    if scaling is not None:
        rope = {**scaling, "rope_theta": cfg.rope_theta}
    hf: dict[str, Any] = dict(
        architectures=[archs[model_type]], model_type=model_type,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        # rope_parameters is what transformers 5 reads; rope_theta + rope_scaling what 4.x reads.
        rope_parameters=rope, rope_theta=cfg.rope_theta,
        rope_scaling=scaling,
        hidden_act="silu", tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        hf["attention_bias"] = False
    if model_type == "llama":
        hf["mlp_bias"] = False
    if model_type.startswith("qwen"):
        hf["use_sliding_window"] = False
    if model_type == "mixtral":
        hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
                  router_aux_loss_coef=cfg.router_aux_loss_coef)
    elif cfg.is_moe:
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_token,
                  moe_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                  decoder_sparse_step=1, router_aux_loss_coef=cfg.router_aux_loss_coef,
                  mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe_layers])
        if model_type == "qwen2_moe":
            hf.update(qkv_bias=cfg.attention_bias,
                      shared_expert_intermediate_size=cfg.shared_intermediate_size)
    return hf


def _hf_model_type(cfg: ModelConfig, moe_layers: list[int]) -> str:
    """The simplest Hugging Face model type that expresses `cfg` exactly, or a ConfigError naming the field."""
    if not cfg.is_moe:
        model_type = "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"
    elif cfg.qk_norm:
        model_type = "qwen3_moe"
    elif cfg.shared_intermediate_size > 0 or cfg.attention_bias:
        model_type = "qwen2_moe"
    else:
        model_type = "mixtral"
    if cfg.qk_norm and cfg.attention_bias:
        raise ConfigError("model.attention_bias=True with model.qk_norm=True has no Hugging Face "
                          "equivalent (Qwen3 puts a bias on o_proj too); set one of them to False")
    if model_type == "qwen2_moe" and not (cfg.shared_expert_gate and cfg.num_shared_experts == 1):
        raise ConfigError(f"model.num_shared_experts={cfg.num_shared_experts} with shared_expert_gate="
                          f"{cfg.shared_expert_gate} has no Hugging Face equivalent; Qwen2-MoE needs exactly "
                          "one shared expert with a sigmoid gate (model.shared_expert_gate=true)")
    if model_type in ("qwen3_moe", "mixtral") and cfg.shared_intermediate_size > 0:
        raise ConfigError(f"model.num_shared_experts={cfg.num_shared_experts} is only expressible as "
                          f"qwen2_moe (no q/k norm); {model_type} has no shared expert")
    if model_type == "mixtral" and (not cfg.norm_topk_prob or len(moe_layers) != cfg.num_layers):
        raise ConfigError("a MoE without q/k norm, bias or shared expert maps to mixtral, which needs "
                          "model.norm_topk_prob=true and every layer MoE (first_dense_layers=0, "
                          "moe_layer_freq=1); set model.qk_norm=true to export as qwen3_moe instead")
    return model_type


def _check_hf_supported(hf: dict, model_type: str) -> None:
    """Refuse Hugging Face options the reference model does not implement (instead of loading wrongly)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported; only SwiGLU ('silu') is")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported; the MLP projections have no bias")
    if hf.get("attention_bias") and model_type not in ("qwen2", "qwen2_moe"):
        raise ConfigError(f"attention_bias=true on {model_type} (a bias on o_proj too) is not supported")
    if hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported; set it to false (full attention)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported; RoPE rotates "
                          "every dimension of a head here")


def _hf_moe_layer_pattern(hf: dict, num_experts: int) -> tuple[int, int]:
    """(first_dense_layers, moe_layer_freq) reproducing Qwen-MoE's decoder_sparse_step/mlp_only_layers."""
    num_layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1) or 1
    dense_only = set(hf.get("mlp_only_layers") or [])
    moe = [i for i in range(num_layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0]
    if not moe:
        raise ConfigError(f"num_experts={num_experts}, decoder_sparse_step={step}, mlp_only_layers="
                          f"{sorted(dense_only)} leave no MoE layer; use a dense model type instead")
    first = moe[0]
    freq = moe[1] - moe[0] if len(moe) > 1 else 1
    expected = [i for i in range(first, num_layers) if (i - first) % freq == 0]
    if moe != expected:
        raise ConfigError(f"MoE layers {moe} (decoder_sparse_step={step}, mlp_only_layers={sorted(dense_only)}) "
                          "are not 'every n-th layer after a leading dense run', the only pattern supported")
    return first, freq


def _hf_rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return hf["rope_theta"]
    params = hf.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


YARN_OPTIONS = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")


def _hf_rope_scaling(hf: dict) -> dict | None:
    """A config's RoPE scaling as ModelConfig.rope_scaling (its `rope_type` and keys), None if it has none."""
    rs = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_KEYS:
        raise ConfigError(f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_SCALING_KEYS)} "
                          "(dynamic and longrope change with the sequence's length)")
    rs = dict(rs)
    if kind == "yarn":  # transformers' default for a yarn config without it
        rs.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    optional = YARN_OPTIONS if kind == "yarn" else ()
    return {**({} if kind == "llama3" else {"rope_type": kind}),  # llama3: the default, as configs saved before
            **{k: rs[k] for k in sorted(ROPE_SCALING_KEYS[kind]) if k in rs},
            **{k: rs[k] for k in optional if rs.get(k) is not None}}


def _scaled_context(max_positions: int, rope_scaling: dict | None) -> int:
    """The context a RoPE scaling stretches a model to: yarn's original context times its factor (as vLLM
    derives its max_model_len; Qwen2.5's configs give 32K and a factor of 4); the others' configs give theirs."""
    if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn":
        return max(max_positions, int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"]))
    return max_positions
