"""Sliding-window layers in the serving planner (planner/serving_model.py): a windowed layer holds, reads and
attends at most its window; config.json's windows read as transformers lays them out; a model without windows
priced exactly as before. Expected numbers are worked by hand (the docstrings' formulas), torch-free."""

import json

import pytest

from meshlm.config import ModelConfig
from meshlm.planner.cluster import get_cluster
from meshlm.planner.published_serving import model_of
from meshlm.planner.serving import Serving, iteration_time, kv_transfer_bytes
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_model import ServedModel, layer_windows, served_model
from meshlm.planner.serving_modes import estimate_serving
from meshlm.planner.serving_workload import Workload

# openai/gpt-oss-120b's config.json, as far as the serving planner reads it (shapes, experts, alternate windows).
GPT_OSS_120B = {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 36,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                "max_position_embeddings": 131072, "num_local_experts": 128, "num_experts_per_tok": 4,
                "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
                "tie_word_embeddings": False}

# 4 layers, 4 query heads, 2 kv heads of dim 8: a layer caches 2 x 2 x 8 = 32 elements per token (64 bytes bf16)
TINY = ModelConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=64, max_seq_len=4096)
ALTERNATING = ServedModel(TINY, windows=(128, 0, 128, 0))  # gpt-oss's layout: sliding first, window 128


def test_windowed_layers_hold_at_most_their_window():
    sm = ALTERNATING
    assert sm.kv_bytes_per_token(2.0) == 4 * 64  # each new token is written to every layer
    assert sm.kv_bytes(1000, 2.0) == (2 * 1000 + 2 * 128) * 64 == 144384
    assert sm.kv_bytes(100, 2.0) == 4 * 100 * 64  # below the window every layer holds every token
    assert sm.kv_bytes(128, 2.0) == 4 * 128 * 64
    # per GPU: pp=2 puts one windowed and one full layer on each stage; tp=2 one kv head each (32 bytes)
    assert sm.kv_bytes_per_gpu(1000, 2.0, tp=2, pp=2, cp=1) == (1000 + 128) * 32
    assert sm.kv_bytes_per_gpu(1000, 2.0, tp=1, pp=1, cp=2) == 144384 / 2
    # Qwen2-style windows only from layer 2 on: with pp=2 the first stage (two full layers) holds the most
    qwen = ServedModel(TINY, windows=(0, 0, 128, 128))
    assert qwen.kv_bytes_per_gpu(1000, 2.0, tp=1, pp=2, cp=1) == 2 * 1000 * 64
    assert kv_transfer_bytes(sm, prompt_tokens=1000, kv_precision="bf16") == 144384


@pytest.mark.parametrize("budget_units,expected", [(2256, 1000), (2255, 999), (400, 100), (513, 128), (0, 0)])
def test_longest_sequence_that_fits_a_budget(budget_units, expected):
    """2 T + 2 min(T, 128) layer-tokens of 64 bytes must fit the budget."""
    assert ALTERNATING.max_cached_tokens(budget_units * 64.0, 2.0, tp=1, pp=1, cp=1) == expected


def test_every_layer_windowed_stops_growing():
    mistral = ServedModel(TINY, windows=(128,) * 4)
    assert mistral.kv_bytes(10**6, 2.0) == 4 * 128 * 64
    assert mistral.max_cached_tokens(511 * 64.0, 2.0, tp=1, pp=1, cp=1) == 127
    assert mistral.max_cached_tokens(512 * 64.0, 2.0, tp=1, pp=1, cp=1) is None  # any length fits
    sv = Serving(mistral, get_cluster("h100"), ServingLayout())
    assert sv.max_tokens() == TINY.max_seq_len  # then the model's position limit binds


def test_attention_flops_over_the_window():
    # one query token, per head 2 x 8 (scores) + 2 x 8 (weighted sum) FLOPs per attended token, 4 heads
    per_token = 4 * 32
    assert ALTERNATING.attention_flops(1000, decode=True) == per_token * (2 * 1000 + 2 * 128)
    # prefill of s = 1000 (mean context 500): full layers s / 2, windowed 128 - 128^2 / (2 s) = 119.808
    assert ALTERNATING.attention_flops(500, decode=False) == pytest.approx(per_token * (2 * 500 + 2 * 119.808),
                                                                           rel=1e-12)
    assert ALTERNATING.attention_flops(50, decode=False) == per_token * 4 * 50  # s = 100 < window: causal square


def test_decode_kv_read_of_a_windowed_layer_stops_growing_past_the_window():
    cl = get_cluster("h100")

    def mem(sm, n):
        return iteration_time(Serving(sm, cl, ServingLayout()), decodes=8, kv_len=n)["attention_memory"]

    full = ServedModel(TINY)
    windowed = ServedModel(TINY, windows=(128,) * 4)
    assert mem(windowed, 200) == mem(windowed, 5000)
    assert mem(full, 5000) > mem(full, 200)
    # alternating: the read grows at exactly half the full model's rate past the window
    grow_alt, grow_full = mem(ALTERNATING, 3000) - mem(ALTERNATING, 1000), mem(full, 3000) - mem(full, 1000)
    assert grow_alt == pytest.approx(grow_full / 2, rel=1e-9)


def test_config_json_windows_are_read(tmp_path):
    base = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                max_position_embeddings=32768, tie_word_embeddings=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(base, sliding_window=128,
                                    layer_types=["sliding_attention", "full_attention"] * 2)))
    sm = served_model(str(path))
    assert sm.windows == (128, 0, 128, 0) and sm.cfg.num_layers == 4
    # Qwen2: use_sliding_window false ignores sliding_window; true windows the layers from max_window_layers on
    assert layer_windows(dict(base, sliding_window=32768, use_sliding_window=False)) == ()
    qwen2 = dict(base, model_type="qwen2", sliding_window=4096, use_sliding_window=True, max_window_layers=3)
    assert layer_windows(qwen2) == (0, 0, 0, 4096)
    path.write_text(json.dumps(qwen2))  # the training reader refuses use_sliding_window; the planner reads it
    assert served_model(str(path)).windows == (0, 0, 0, 4096)
    # Mistral 7B v0.1: every layer; the position limit kept (the training reader caps it at the window)
    mistral = dict(base, model_type="mistral", sliding_window=4096)
    path.write_text(json.dumps(mistral))
    sm = served_model(str(path))
    assert sm.windows == (4096,) * 4 and sm.cfg.max_seq_len == 32768
    # Gemma 2 (every other layer, sliding first) and Gemma 3 (one full layer in sliding_window_pattern)
    assert layer_windows(dict(base, model_type="gemma2", sliding_window=4096)) == (4096, 0, 4096, 0)
    assert layer_windows(dict(base, num_hidden_layers=6, sliding_window=1024, sliding_window_pattern=3)) \
        == (1024, 1024, 0, 1024, 1024, 0)
    assert layer_windows(dict(base)) == ()
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows(dict(base, sliding_window=8, layer_types=["chunked_attention"] * 4))


def test_gpt_oss_row_architecture_has_its_windows():
    sm = model_of({"model": "gpt-oss-120b"})
    assert sm.windows == (128, 0) * 18
    # 2 x 8 kv heads x 64 x 2 bytes = 2048 bytes per layer and token
    assert sm.kv_bytes_per_token(2.0) == 36 * 2048
    assert sm.kv_bytes(2048, 2.0) == 18 * (2048 + 128) * 2048


def test_model_without_windows_is_priced_as_before():
    """llama3-8b on one H100 (bf16): the numbers the planner gave before windows existed (moved since only by the
    GEMM tiles' fixed K cost, kernels.k_scale, which windows do not touch)."""
    sv = Serving(served_model("llama3-8b"), get_cluster("h100"), ServingLayout(tp=1))
    assert sv.sm.windows == ()
    assert sv.kv_bytes_per_gpu(1000) == 1000 * 32 * 2 * 8 * 128 * 2
    r = estimate_serving(sv, Workload(1024, 1024, batch=8))
    assert (r["max_context_tokens"], r["max_concurrency"], r["kv_bytes_per_token"]) == (464799, 226, 131072.0)
    assert r["tpot_ms"] == pytest.approx(7.141750260245813, rel=1e-12)
    assert r["ttft_ms"] == pytest.approx(216.8954769297056, rel=1e-12)
    sv = Serving(served_model("llama3-70b"), get_cluster("h100"), ServingLayout(tp=4, pp=2))
    assert sv.max_tokens() == 1452687
    it = iteration_time(sv, decodes=16, kv_len=3000, prefill_tokens=512, prefill_ctx=700)
    assert it["total"] == pytest.approx(0.029264655610279855, rel=1e-12)


def test_gpt_oss_and_gemma_config_json_read_for_planning_only(tmp_path):
    """config.json model types meshlm's model does not implement (gpt-oss, Gemma 2 / 3) are read by the serving
    planner: their shapes, experts and windows; Gemma 3's multimodal config nests the language model."""
    gpt_oss = GPT_OSS_120B
    (tmp_path / "oss.json").write_text(json.dumps(gpt_oss))
    sm = served_model(str(tmp_path / "oss.json"))
    c = sm.cfg
    assert (c.num_experts, c.num_experts_per_token, c.expert_intermediate_size, c.head_dim) == (128, 4, 2880, 64)
    assert c.attention_bias and not c.tie_embeddings and all(c.is_moe_layer(i) for i in range(36))
    assert sm.windows == (128, 0) * 18
    gemma3 = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504,
        "max_position_embeddings": 131072, "sliding_window": 1024}}
    (tmp_path / "gemma.json").write_text(json.dumps(gemma3))
    sm = served_model(str(tmp_path / "gemma.json"))
    assert (sm.cfg.hidden_size, sm.cfg.num_layers, sm.cfg.num_kv_heads) == (5376, 62, 16) and sm.cfg.tie_embeddings
    assert sm.windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(62))  # every 6th layer full
    assert sm.cached_tokens(8192) == 10 * 8192 + 52 * 1024
