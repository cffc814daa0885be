"""The reference model against Hugging Face transformers: same weights -> same logits, same greedy tokens.

Tiny random models of each supported architecture are built with transformers, saved with its own
save_pretrained, loaded with `meshlm.models.hf.load_pretrained`, and compared in fp32. Our own
checkpoints go the other way (save_pretrained -> transformers loads them).
"""

from __future__ import annotations

import json

import pytest
import torch

# transformers 5: its config names (rope_parameters), its in-memory fused expert layout.
transformers = pytest.importorskip("transformers", minversion="5.0")
from safetensors.torch import load_file, save_file  # noqa: E402

from meshlm.config import ConfigError, ModelConfig  # noqa: E402
from meshlm.models.generation import generate  # noqa: E402
from meshlm.models import build_model  # noqa: E402
from meshlm.models.hf import load_pretrained, save_pretrained  # noqa: E402
from meshlm.tokenizer import HFTokenizer  # noqa: E402
from meshlm.models.transformer import rope_inv_freq  # noqa: E402
from runs import randomize_weights  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, intermediate_size=96, max_position_embeddings=128, attn_implementation="eager")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ARCHS = {
    "llama": ("llama", {}),
    # Llama-3 rope scaling that really moves frequencies at this head_dim, and tied embeddings.
    "llama3-tied": ("llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=4096)),
    "qwen2": ("qwen2", {}),  # q/k/v bias
    # YaRN (Qwen2.5's long-context setting): interpolated low frequencies and cos/sin scaled by 0.1 ln 4 + 1
    "yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                  "original_max_position_embeddings": 32})),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, split on loading; a sliding window caps the context
    "phi3": ("phi3", dict(sliding_window=96, pad_token_id=0)),
    "qwen3": ("qwen3", dict(head_dim=32)),  # q/k norm, head_dim != hidden / heads
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True)),
    # Shared expert with its sigmoid gate; a leading dense layer through mlp_only_layers.
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, mlp_only_layers=[0])),
}
PROMPT_LEN, NEW_TOKENS = 8, 20
SEEDS = {name: i for i, name in enumerate(["llama", "llama3-tied", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                                           "qwen3_moe", "yarn", "phi3"])}  # each case's seed, fixed as cases join



def _hf_model(model_type: str, extra: dict, seed: int):
    config = transformers.AutoConfig.for_model(model_type, **TINY, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_weights(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 128, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained directory)."""
    model_type, extra = ARCHS[request.param]
    hf = _hf_model(model_type, extra, seed=SEEDS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, load_pretrained(path), path


def _logits_hf(hf, tokens):
    with torch.no_grad():
        return hf(tokens).logits


def test_logits_match_transformers(pair, prompts):
    hf, ours, _ = pair
    with torch.no_grad():
        diff = (ours(prompts) - _logits_hf(hf, prompts)).abs().max().item()
    assert diff <= 1e-4


def test_greedy_generation_matches_transformers(pair, prompts):
    hf, ours, _ = pair
    expected = hf.generate(prompts[:1], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, PROMPT_LEN:].tolist()
    assert generate(ours, prompts[0].tolist(), max_new_tokens=NEW_TOKENS) == expected


def test_save_pretrained_roundtrip_of_loaded_model(pair, prompts, tmp_path):
    hf, ours, _ = pair
    save_pretrained(ours, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert (_logits_hf(again, prompts) - _logits_hf(hf, prompts)).abs().max().item() <= 1e-4
    reloaded = load_pretrained(tmp_path)
    assert reloaded.config == ours.config
    _assert_same_params(reloaded, ours)


def test_batched_greedy_generation_matches_transformers(prompts, tmp_path):
    hf = _hf_model("qwen3_moe", ARCHS["qwen3_moe"][1], seed=11)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    expected = hf.generate(prompts, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[:, PROMPT_LEN:].tolist()
    assert generate(ours, prompts, max_new_tokens=8) == expected


@pytest.mark.parametrize("overrides", [
    dict(tie_embeddings=True, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=32)),
    dict(attention_bias=True),
    dict(qk_norm=True, head_dim=32, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
         first_dense_layers=1, norm_topk_prob=False),
    dict(attention_bias=True, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
         num_shared_experts=1, shared_expert_gate=True, shared_expert_intermediate_size=48),
    dict(num_experts=4, num_experts_per_token=2),
], ids=["llama3-tied", "qwen2", "qwen3_moe-dense0", "qwen2_moe", "mixtral"])
def test_our_model_saves_to_transformers(overrides, prompts, tmp_path):
    config = ModelConfig(vocab_size=128, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                         intermediate_size=96, max_seq_len=64, **overrides)
    ours = build_model(config, seed=3)
    randomize_weights(ours, seed=3)
    save_pretrained(ours, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                                 output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert (_logits_hf(hf.eval(), prompts) - ours(prompts)).abs().max().item() <= 1e-4
    reloaded = load_pretrained(tmp_path)
    assert reloaded.config == config
    _assert_same_params(reloaded, ours)
    if config.tie_embeddings:
        assert reloaded.lm_head.weight is reloaded.embed.weight


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_sharded_checkpoint_loads(prompts, tmp_path):
    hf = _hf_model("mixtral", ARCHS["mixtral"][1], seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    with torch.no_grad():
        assert (load_pretrained(tmp_path)(prompts) - _logits_hf(hf, prompts)).abs().max().item() <= 1e-4


def test_fused_expert_layout_loads(prompts, tmp_path):
    """transformers 5 keeps experts fused in memory (gate_up_proj [E, 2I, H]); such files load too."""
    hf = _hf_model("qwen2_moe", ARCHS["qwen2_moe"][1], seed=6)
    hf.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        assert (load_pretrained(tmp_path)(prompts) - _logits_hf(hf, prompts)).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_base")
    _hf_model("qwen2", {}, seed=9).save_pretrained(path)
    return path


def _edit_checkpoint(src, dst, edit) -> None:
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"), r"layers\.1\.attn\.wk\.bias"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}),
     r"model\.layers\.0\.self_attn\.o_proj\.bias"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}),
     r"model\.layers\.0\.mlp\.up_proj\.weight"),
    (lambda t: t.update({"model.vision_tower.weight": torch.zeros(2)}), r"model\.vision_tower\.weight"),
], ids=["missing", "unexpected", "shape", "unknown"])
def test_bad_checkpoints_name_the_tensor(qwen2_dir, tmp_path, edit, match):
    _edit_checkpoint(qwen2_dir, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match):
        load_pretrained(tmp_path / "bad")


def test_missing_expert_is_named(tmp_path):
    src = tmp_path / "src"
    _hf_model("mixtral", ARCHS["mixtral"][1], seed=4).save_pretrained(src)
    _edit_checkpoint(src, tmp_path / "bad",
                     lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.w_up \(experts present: \[0, 1, 3\]"):
        load_pretrained(tmp_path / "bad")
    extra = torch.zeros(96, 64)
    _edit_checkpoint(src, tmp_path / "bad2",
                     lambda t: t.update({"model.layers.0.block_sparse_moe.experts.4.w1.weight": extra}))
    with pytest.raises(ValueError, match=r"experts\.4\.w1\.weight' is expert 4, but config.json has 4 experts"):
        load_pretrained(tmp_path / "bad2")


def test_unsupported_configs_are_refused(qwen2_dir, tmp_path):
    hf = json.loads((qwen2_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({**hf, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf_dict({**hf, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf_dict({**hf, "model_type": "llama", "attention_bias": True})
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.75 is not supported"):  # Phi-4-mini's
        ModelConfig.from_hf_dict({**hf, "model_type": "phi3", "partial_rotary_factor": 0.75})
    with pytest.raises(ConfigError, match="rope_scaling type 'dynamic' is not supported"):  # yarn is, since
        ModelConfig.from_hf_dict({**hf, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="model.safetensors"):
        (tmp_path / "config.json").write_text(json.dumps(hf))
        load_pretrained(tmp_path)


def test_mistral_sliding_window_caps_max_seq_len():
    config = transformers.AutoConfig.for_model("mistral", **{**TINY, "max_position_embeddings": 32768},
                                               sliding_window=4096)
    assert ModelConfig.from_hf_dict(config.to_dict()).max_seq_len == 4096


def test_llama3_rope_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                      num_hidden_layers=1, vocab_size=128, intermediate_size=64,
                                      max_position_embeddings=131072, rope_parameters=rope)
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inv_freq(ModelConfig.from_hf_dict(config.to_dict()))
    assert attention_factor == 1.0
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    # Llama-3.x config.json files (written before transformers 5) spell it rope_theta + rope_scaling.
    legacy = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_hf_dict(legacy)), expected, rtol=0, atol=0)
    assert not torch.equal(ours, rope_inv_freq(ModelConfig(head_dim=128, num_heads=32, hidden_size=4096,
                                                           rope_theta=500000.0)))  # scaling did something


def test_yarn_and_linear_rope_match_transformers():
    """YaRN as Qwen2.5 (factor 4 over 32K) and DeepSeek-V3 (factor 40, mscale / mscale_all_dim) configure it, and
    linear scaling: the same frequencies as transformers, to the bit, and the same factor on cos and sin."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from meshlm.models.transformer import rope_attention_factor

    cases = [  # (rope parameters, max_position_embeddings, the context it stretches the model to: yarn's as vLLM's)
        ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
         32768, 131072),
        ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}, 163840, 163840),
        ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 4096,
          "attention_factor": 1.5, "truncate": False}, 4096, 8192),
        ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}, 4096, 4096)]
    for rope, positions, context in cases:
        config = transformers.Qwen2Config(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8,
                                          num_hidden_layers=1, vocab_size=128, intermediate_size=64,
                                          max_position_embeddings=positions, rope_parameters=rope)
        expected, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
        ours = ModelConfig.from_hf_dict(config.to_dict())
        torch.testing.assert_close(rope_inv_freq(ours), expected, rtol=0, atol=0)
        assert rope_attention_factor(ours) == attention_factor, rope
        assert not torch.equal(rope_inv_freq(ours), rope_inv_freq(ModelConfig(
            head_dim=128, num_heads=8, hidden_size=1024, rope_theta=rope["rope_theta"]))), rope
        assert ours.max_seq_len == context, rope
        assert ModelConfig.from_hf_dict(ours.to_hf_dict()) == ours  # and back, written as transformers reads it


def test_the_engine_serves_yarn_as_transformers_generates(prompts, tmp_path):
    """The paged engine's RoPE (its own cos / sin per position) scales as the model's: greedy tokens of a YaRN
    model equal transformers'."""
    from meshlm.infer.llm import LLM
    from meshlm.infer.sequence import SamplingParams

    hf = _hf_model(*ARCHS["yarn"], seed=5)
    hf.save_pretrained(tmp_path)
    expected = hf.generate(prompts, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[:, PROMPT_LEN:].tolist()
    llm = LLM(str(tmp_path), device="cpu", block_size=4)
    got = llm.generate(prompts.tolist(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [r.token_ids for r in got] == expected


def test_bf16_load_and_tokenizer(pair, prompts, tmp_path):
    hf, ours, path = pair
    half = load_pretrained(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    with torch.no_grad():
        assert (half(prompts).float() - ours(prompts)).abs().max().item() < 0.1 * ours(prompts).abs().max().item()
    if ours.config.tie_embeddings:
        assert half.lm_head.weight is half.embed.weight
    assert HFTokenizer.from_dir(path) is None  # no tokenizer.json there
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert HFTokenizer.from_dir(tmp_path).encode("hello world") == [1, 2]
