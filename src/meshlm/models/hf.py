"""Hugging Face checkpoints: load one into the reference `Transformer`, save one that transformers loads.

Responsible for: reading `config.json` plus `model.safetensors` (or a sharded checkpoint with
`model.safetensors.index.json`) for llama, mistral, phi3, qwen2, qwen3, mixtral, qwen2_moe and qwen3_moe;
mapping Hugging Face tensor names to ours (Phi-3's fused qkv_proj and gate_up_proj split into ours), stacking
per-expert weights into our `[E, ...]` tensors
(from the classic one-module-per-expert layout and from transformers 5's fused `gate_up_proj`
layout); refusing missing, unexpected, duplicated or misshapen tensors with a ValueError that names
the tensor; and writing our model back as a classic per-expert checkpoint (a Phi-3 as the llama it equals).
Not responsible for: tokenization (`meshlm.tokenizer`), the
sharded checkpoints of training runs (`meshlm.checkpoint`), or quantised weights.
transformers itself is not imported: the safetensors library reads and writes the files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshlm.config import ModelConfig
from meshlm.models.transformer import Transformer

# Hugging Face name inside one decoder layer -> our name inside layers.{i}.
_LAYER_RENAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "self_attn.q_proj.bias": "attn.wq.bias",
    "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.bias": "attn.wv.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.w_gate.weight",
    "mlp.up_proj.weight": "mlp.w_up.weight",
    "mlp.down_proj.weight": "mlp.w_down.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "block_sparse_moe.gate.weight": "mlp.router.weight",
    "mlp.shared_expert.gate_proj.weight": "mlp.shared.w_gate.weight",
    "mlp.shared_expert.up_proj.weight": "mlp.shared.w_up.weight",
    "mlp.shared_expert.down_proj.weight": "mlp.shared.w_down.weight",
    "mlp.shared_expert_gate.weight": "mlp.shared_gate.weight",
}
_TOP_RENAMES = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
                "lm_head.weight": "lm_head.weight"}
# One expert's projection, classic layout: Mixtral's w1/w3/w2 and Qwen-MoE's gate/up/down_proj.
_EXPERT_PARTS = {"w1": "w_gate", "w3": "w_up", "w2": "w_down",
                 "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_FUSED_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")
# Buffers some old checkpoints carry; recomputed from the config.
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, *,
                    device: str | torch.device = "cpu") -> Transformer:
    """Build a `Transformer` from a Hugging Face checkpoint directory (config.json + safetensors)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} must be a floating torch.dtype, e.g. torch.float32")
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a torch device; give 'cpu' or 'cuda'") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is available here; use 'cpu'")
    if kind == "meta":
        raise ValueError("device='meta' holds no weights to load into; give 'cpu' or 'cuda'")
    path = Path(path)
    config = ModelConfig.from_hf(path)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_embeddings:  # to_empty unties; one tensor must back both
        model.lm_head.weight = model.embed.weight
    params = dict(model.named_parameters())  # tied lm_head is listed once, as embed.weight
    filled: dict[str, set[int] | bool] = {}  # stacked expert tensors: which experts are in
    with torch.no_grad():
        for hf_name, tensor in _read_safetensors(path):
            for ours, expert, value in _to_ours(hf_name, tensor, config):
                if ours == "lm_head.weight" and config.tie_embeddings:
                    continue  # some tied checkpoints also store the head; the embedding is the one used
                if ours not in params:
                    raise ValueError(f"unexpected tensor {hf_name!r} (as {ours!r}) in {str(path)!r}: the "
                                     f"model from its config.json has no such parameter")
                if expert is not None and expert >= params[ours].shape[0]:
                    raise ValueError(f"tensor {hf_name!r} is expert {expert}, but config.json has "
                                     f"{params[ours].shape[0]} experts")
                target = params[ours] if expert is None else params[ours][expert]
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"tensor {hf_name!r} has shape {tuple(value.shape)}, but {ours!r}"
                                     f"{'' if expert is None else f'[{expert}]'} needs {tuple(target.shape)}; "
                                     "config.json and the weights disagree")
                _check_values(hf_name, value, path)
                _mark_filled(filled, ours, expert, hf_name)
                target.copy_(value.to(device=target.device, dtype=target.dtype))
    missing = []
    for name, p in params.items():
        got = filled.get(name)
        if name.startswith("layers.") and ".experts." in name:
            if not isinstance(got, set) or len(got) != p.shape[0]:
                have = sorted(got) if isinstance(got, set) else []
                missing.append(f"{name} (experts present: {have} of {p.shape[0]})")
        elif got is not True:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks tensors for: {', '.join(missing)}")
    return model


def _check_values(hf_name: str, value: torch.Tensor, path: Path) -> None:
    """Refuse weights a cast would silently corrupt: integer or 8-bit float tensors (a quantized checkpoint's, whose
    scales live elsewhere), and NaN or infinite values (a damaged or diverged checkpoint)."""
    if not value.is_floating_point() or value.element_size() < 2:
        raise ValueError(f"tensor {hf_name!r} in {str(path)!r} is {str(value.dtype).removeprefix('torch.')}: a "
                         "quantized checkpoint, which meshlm does not load; give its bf16 / fp16 / fp32 weights")
    if not torch.isfinite(value).all():
        raise ValueError(f"tensor {hf_name!r} in {str(path)!r} holds NaN or infinite values: the checkpoint is "
                         "damaged (or saved from a diverged run); give a sound one")


def _read_safetensors(path: Path):
    """Yield (name, tensor) over model.safetensors or every shard listed by the index."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {str(path)!r}; "
                         "pass a Hugging Face model directory saved with safetensors")
    for file in files:
        if not (path / file).is_file():
            raise ValueError(f"{str(path / file)!r}, which {index.name} lists, is missing; download the model's "
                             "every shard")
        try:
            handle = safe_open(str(path / file), framework="pt")
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own SafetensorError on a damaged file
            raise ValueError(f"{str(path / file)!r} is not a readable safetensors file ({e}); download it "
                             "again") from None
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _to_ours(hf_name: str, tensor: torch.Tensor, config: ModelConfig):
    """[(our parameter name, expert index or None, value)] for one Hugging Face tensor."""
    if hf_name in _TOP_RENAMES:
        return [(_TOP_RENAMES[hf_name], None, tensor)]
    if _IGNORED_RE.fullmatch(hf_name):
        return []
    m = _LAYER_RE.fullmatch(hf_name)
    if m is None:
        raise ValueError(f"unexpected tensor {hf_name!r}: not a known Hugging Face decoder weight")
    layer, rest = m.group(1), m.group(2)
    prefix = f"layers.{layer}."
    if rest in _LAYER_RENAMES:
        return [(prefix + _LAYER_RENAMES[rest], None, tensor)]
    if rest in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):  # Phi-3's fused projections
        sizes = [config.num_heads * config.head_dim, *[config.num_kv_heads * config.head_dim] * 2] \
            if rest.startswith("self_attn") else [config.intermediate_size] * 2
        if tensor.dim() != 2 or tensor.shape[0] != sum(sizes):
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}; expected [{sum(sizes)}, "
                             f"{config.hidden_size}] (the fused {' + '.join(map(str, sizes))} rows)")
        names = ("attn.wq", "attn.wk", "attn.wv") if rest.startswith("self_attn") else ("mlp.w_gate", "mlp.w_up")
        return [(f"{prefix}{name}.weight", None, part) for name, part in zip(names, tensor.split(sizes))]
    if e := _EXPERT_RE.fullmatch(rest):
        return [(prefix + f"mlp.experts.{_EXPERT_PARTS[e.group(2)]}", int(e.group(1)), tensor)]
    if f := _FUSED_RE.fullmatch(rest):
        # transformers 5 keeps experts as [E, 2 * inter, hidden] (gate rows first, then up) and
        # [E, hidden, inter]: the same orientation as ours, one tensor per kind.
        if f.group(1) == "down_proj":
            return [(prefix + "mlp.experts.w_down", e, tensor[e]) for e in range(tensor.shape[0])]
        if tensor.dim() != 3 or tensor.shape[1] != 2 * config.expert_intermediate_size:
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(tensor.shape)}; expected "
                             f"[num_experts, 2 * {config.expert_intermediate_size}, {config.hidden_size}]")
        gate, up = tensor.chunk(2, dim=1)
        return ([(prefix + "mlp.experts.w_gate", e, gate[e]) for e in range(tensor.shape[0])]
                + [(prefix + "mlp.experts.w_up", e, up[e]) for e in range(tensor.shape[0])])
    raise ValueError(f"unexpected tensor {hf_name!r}: not a known Hugging Face decoder weight")


def _mark_filled(filled: dict, ours: str, expert: int | None, hf_name: str) -> None:
    if expert is None:
        if ours in filled:
            raise ValueError(f"tensor {hf_name!r} fills {ours!r} a second time; the checkpoint is duplicated")
        filled[ours] = True
        return
    experts = filled.setdefault(ours, set())
    if expert in experts:
        raise ValueError(f"tensor {hf_name!r} fills expert {expert} of {ours!r} a second time")
    experts.add(expert)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


def save_pretrained(model: Transformer, path: str | Path) -> None:
    """Write config.json + model.safetensors (classic per-expert layout) that transformers loads."""
    path = Path(path)
    config = model.config
    hf_config = config.to_hf_dict()
    dtype = next(model.parameters()).dtype
    hf_config["dtype"] = str(dtype).removeprefix("torch.")
    tensors = to_hf_state_dict(model, model_type=hf_config["model_type"])
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def to_hf_state_dict(model: Transformer, *, model_type: str) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names; stacked experts split one tensor per expert."""
    reverse_layer = {ours: hf for hf, ours in _LAYER_RENAMES.items() if not hf.startswith("block_sparse_moe")}
    reverse_top = {ours: hf for hf, ours in _TOP_RENAMES.items()}
    moe_prefix = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    if model_type == "mixtral":
        reverse_layer["mlp.router.weight"] = "block_sparse_moe.gate.weight"
    expert_names = ({"w_gate": "w1", "w_up": "w3", "w_down": "w2"} if model_type == "mixtral"
                    else {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"})
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # a tied head is listed once, as embed.weight
        value = p.detach().cpu().contiguous()
        if name in reverse_top:
            out[reverse_top[name]] = value
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        assert m is not None, f"parameter {name} has no Hugging Face name"
        layer, rest = m.group(1), m.group(2)
        if rest.startswith("mlp.experts."):
            part = expert_names[rest.removeprefix("mlp.experts.")]
            for e in range(value.shape[0]):
                out[f"model.layers.{layer}.{moe_prefix}.experts.{e}.{part}.weight"] = value[e].clone()
        else:
            assert rest in reverse_layer, f"parameter {name} has no Hugging Face name"
            out[f"model.layers.{layer}.{reverse_layer[rest]}"] = value
    return out
