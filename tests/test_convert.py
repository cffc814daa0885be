"""`meshlm convert`: meshlm checkpoints -> Hugging Face folders (transformers loads them, same logits) and
Hugging Face folders -> meshlm run directories (generate works, same logits, training resumes from them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
tokenizers = pytest.importorskip("tokenizers")

from meshlm.cli import main  # noqa: E402
from meshlm.config import Config, ModelConfig, TrainConfig  # noqa: E402
from meshlm.models import build_model  # noqa: E402
from meshlm.checkpoint import load_checkpoint_for_inference, rng_state, save_checkpoint  # noqa: E402
from runs import randomize_weights

VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))



def _tokenizer_file(path: Path) -> Path:
    """A word-level tokenizer.json of VOCAB tokens: "w0" .. "w126" and [UNK]."""
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(VOCAB - 1)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(path))
    return path


def _meshlm_run(run_dir: Path, model_cfg: ModelConfig, *, seed: int, tokenizer: Path | None = None):
    """A checkpoint as the trainer writes it (weights + AdamW state + meta + manifest), of a random model."""
    model = build_model(model_cfg, seed=seed)
    randomize_weights(model, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = Config(model=model_cfg, train=TrainConfig(run_dir=str(run_dir), seq_len=16))
    save_checkpoint(run_dir, step=7, model=model, optimizer=optimizer, config=cfg,
                    rank_extra={"rng": rng_state()}, files={"tokenizer.json": tokenizer} if tokenizer else None)
    return model.eval()


def _hf_logits(path: Path) -> torch.Tensor:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                 output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    with torch.no_grad():
        return hf.eval()(TOKENS).logits


DENSE = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=96, max_seq_len=64)
CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", dict(qk_norm=True, head_dim=32, tie_embeddings=True)),
    "qwen2": ("Qwen2ForCausalLM", dict(attention_bias=True)),
    "mixtral": ("MixtralForCausalLM", dict(num_experts=4, num_experts_per_token=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(qk_norm=True, num_experts=4, num_experts_per_token=2,
                                              moe_intermediate_size=32, first_dense_layers=1, norm_topk_prob=False)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(attention_bias=True, num_experts=4, num_experts_per_token=2,
                                              moe_intermediate_size=32, num_shared_experts=1,
                                              shared_expert_gate=True, shared_expert_intermediate_size=48)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_meshlm_to_hf_logits_match(case, tmp_path, capsys):
    arch, extra = CASES[case]
    tok = _tokenizer_file(tmp_path / "tok.json") if case == "llama" else None
    ours = _meshlm_run(tmp_path / "run", ModelConfig(**DENSE, **extra), seed=len(case), tokenizer=tok)
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(out)]) == 0
    assert f"wrote {out}: {arch}" in capsys.readouterr().out
    hf_config = json.loads((out / "config.json").read_text())
    assert (hf_config["model_type"], hf_config["architectures"]) == (case, [arch])
    tok_files = ["tokenizer.json", "tokenizer_config.json"] if tok else []
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors", *tok_files])
    # The model meshlm's own inference loads from the checkpoint, against transformers on the converted folder.
    model, _, _ = load_checkpoint_for_inference(tmp_path / "run")
    with torch.no_grad():
        expected = model(TOKENS)
        assert torch.equal(expected, ours(TOKENS))
    assert (_hf_logits(out) - expected).abs().max().item() <= 1e-5
    if tok is not None:
        assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()


def test_to_hf_dtype_step_dir_and_byte_tokenizer(tmp_path):
    """A step_N directory converts too; --dtype; a byte-level run gets an equivalent tokenizer.json."""
    from meshlm.tokenizer import ByteTokenizer

    _meshlm_run(tmp_path / "run", ModelConfig(**{**DENSE, "vocab_size": 256}), seed=1)
    step = tmp_path / "run" / "checkpoints" / "step_000007"
    assert main(["convert", str(step), "--to-hf", str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def fib(n):\n    return  héllo ✓ 😀\t"
    assert tok(text)["input_ids"] == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random transformers Llama saved with its own save_pretrained, with a tokenizer.json."""
    path = tmp_path_factory.mktemp("hf_llama")
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, intermediate_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_weights(hf, seed=5)
    hf.save_pretrained(path)
    _tokenizer_file(path / "tokenizer.json")
    with torch.no_grad():
        logits = hf.eval()(TOKENS).logits
    return path, logits


def test_hf_to_meshlm_generate_and_resume(hf_llama, tmp_path, capsys):
    hf_dir, hf_logits = hf_llama
    corpus = tmp_path / "corpus.txt"
    gen = torch.Generator().manual_seed(1)
    corpus.write_text("\n\n".join(" ".join(f"w{int(i)}" for i in torch.randint(0, 127, (40,), generator=gen))
                                  for _ in range(30)))
    run = tmp_path / "run"
    sets = [f"data.path={corpus}", "train.seq_len=16", "train.global_batch_size=2", "train.steps=1",
            "train.warmup_steps=0", "train.sample_tokens=0", "train.val_batches=1", "train.progress=false",
            "train.device=cpu"]
    assert main(["convert", str(hf_dir), "--to-meshlm", str(run), *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "step_000000" in out and f"--config {run / 'config.toml'} --resume" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000000"

    model, cfg, tok = load_checkpoint_for_inference(run)
    assert cfg.model.num_layers == 2 and cfg.model.vocab_size == VOCAB
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits).abs().max().item() <= 1e-5
    assert tok.encode("w1 w2") == [2, 3]  # the Hugging Face tokenizer.json travelled into the checkpoint

    assert main(["generate", "--checkpoint", str(run), "--prompt", "w1 w2 w3", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("w1 w2 w3")

    # Fine-tuning continues from those weights: one step, from step 0, saved as step 1.
    assert main(["train", "--config", str(run / "config.toml"), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000001"
    tuned, _, _ = load_checkpoint_for_inference(run)
    with torch.no_grad():
        diff = (tuned(TOKENS) - hf_logits).abs().max().item()
    assert 0 < diff < 5.0  # moved by one small step, not re-initialised

    # And back: the fine-tuned run exports again, and transformers agrees with it.
    assert main(["convert", str(run), "--to-hf", str(tmp_path / "hf2")]) == 0
    with torch.no_grad():
        assert (_hf_logits(tmp_path / "hf2") - tuned(TOKENS)).abs().max().item() <= 1e-5


def test_errors_are_one_line(hf_llama, tmp_path, capsys):
    hf_dir, _ = hf_llama

    def fails(argv, *needles):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("meshlm convert: error:"), err
        for needle in needles:
            assert needle in err, err

    missing = str(tmp_path / "nope")
    fails(["convert", missing, "--to-hf", str(tmp_path / "o")], "does not exist")
    fails(["convert", missing, "--to-meshlm", str(tmp_path / "o")], "does not exist")
    fails(["convert", str(hf_dir), "--to-hf", str(tmp_path / "o")], "--to-meshlm")  # wrong direction
    fails(["convert", str(tmp_path), "--to-hf", str(tmp_path / "o")], "no checkpoint")

    _meshlm_run(tmp_path / "run", ModelConfig(**DENSE), seed=2)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    fails(["convert", str(tmp_path / "run"), "--to-hf", str(busy)], "not empty", "--overwrite")
    fails(["convert", str(hf_dir), "--to-meshlm", str(busy)], "not empty", "--overwrite")
    assert (busy / "keep.txt").exists()
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(busy), "--overwrite"]) == 0
    assert sorted(os.listdir(busy)) == ["config.json", "model.safetensors"]  # vocab 128: no byte tokenizer
    capsys.readouterr()
    fails(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path), "--overwrite"], "overlaps")  # holds it
    step = tmp_path / "run" / "checkpoints" / "step_000007"
    fails(["convert", str(tmp_path / "run"), "--to-hf", str(step / "hf")], "overlaps")

    # A meshlm model no Hugging Face type expresses: the field is named, nothing is written.
    _meshlm_run(tmp_path / "odd", ModelConfig(**DENSE, qk_norm=True, attention_bias=True), seed=3)
    fails(["convert", str(tmp_path / "odd"), "--to-hf", str(tmp_path / "o")], "attention_bias")
    _meshlm_run(tmp_path / "odd2", ModelConfig(**DENSE, num_experts=4, first_dense_layers=1), seed=3)
    fails(["convert", str(tmp_path / "odd2"), "--to-hf", str(tmp_path / "o")], "first_dense_layers")
    assert not (tmp_path / "o").exists()

    # Aux-loss-free balancing: the learnt selection biases (rank file, not weights) have no HF equivalent.
    moe = ModelConfig(**DENSE, num_experts=4, router_bias_update_rate=0.01)
    model = build_model(moe, seed=4)
    save_checkpoint(tmp_path / "biased", step=3, model=model, optimizer=torch.optim.AdamW(model.parameters()),
                    config=Config(model=moe, train=TrainConfig(seq_len=16)),
                    rank_extra={"router_bias": {"layers.0.mlp": [0.01, -0.01, 0.0, 0.0]}})
    fails(["convert", str(tmp_path / "biased"), "--to-hf", str(tmp_path / "o")], "model.router_bias_update_rate")
    fails(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "o"), "--set", "train.lr=1"], "--to-meshlm only")
    fails(["convert", str(hf_dir), "--to-meshlm", str(tmp_path / "o"), "--dtype", "bfloat16"], "--to-hf only")

    # A Hugging Face model meshlm does not implement.
    gelu = tmp_path / "gelu"
    gelu.mkdir()
    (gelu / "config.json").write_text(json.dumps({**json.loads((hf_dir / "config.json").read_text()),
                                                  "hidden_act": "gelu"}))
    fails(["convert", str(gelu), "--to-meshlm", str(tmp_path / "o")], "hidden_act")
    fails(["convert", str(hf_dir), "--to-meshlm", str(tmp_path / "o"), "--set", "model.num_layers=1"], "model")
    assert not (tmp_path / "o").exists()
    # A failure half-way (too little text for one sample) leaves no half-written run behind.
    (tmp_path / "short.txt").write_text("w1 w2 w3")
    fails(["convert", str(hf_dir), "--to-meshlm", str(tmp_path / "o"), "--set", f"data.path={tmp_path / 'short.txt'}",
           "--set", "train.seq_len=16"], "fewer than one sample")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_help_explains_both_directions(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in ("--to-hf", "--to-meshlm", "--overwrite", "from_pretrained", "examples:",
                   "meshlm train --config", "--resume"):
        assert needle in text


def test_config_toml_reads_back(tmp_path):
    """The config.toml of a converted run reads back to the same config (rope scaling, MoE, None fields)."""
    from meshlm.config import load_config
    from meshlm.convert import config_toml

    model = ModelConfig(**DENSE, rope_theta=500000.0, norm_eps=1e-6, num_experts=4, moe_intermediate_size=32,
                        rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=32))
    cfg = Config(model=model, train=TrainConfig(run_dir=str(tmp_path / 'a "quoted" dir'), seq_len=16, lr=3e-5))
    (tmp_path / "config.toml").write_text(config_toml(cfg))
    again = load_config(tmp_path / "config.toml")
    assert again.to_dict() == cfg.to_dict()
