"""Activation recomputation (parallel.recompute = selective | full): the same loss and gradients as
without it (bit for bit in one process; to 1e-9 in fp64 under dp=2, tp=2 and ZeRO-3), less memory
kept for backward (measured with a saved-tensor hook and compared with the planner's prediction),
the hooks on a block firing once per step, and refusals of bad modes.

One launch of 2 ranks runs every distributed configuration in turn.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.config import ModelConfig
from meshlm.models import KVCache, build_model
from meshlm.parallel.parallelize import check_layout
from meshlm.parallel.recompute import apply_recompute, saved_activation_bytes
from meshlm.models.stats import activation_elems_per_token
from meshlm.train.trainer import Trainer
from runs import TRAIN, full_weights, train_config

DENSE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
             max_seq_len=64, qk_norm=True, attention_bias=True)
MOE = dict(DENSE, num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
           shared_expert_gate=True, first_dense_layers=1)
MODES = ("selective", "full")


def _loss_and_grads(config: ModelConfig, mode: str, tokens: torch.Tensor):
    model = build_model(config, seed=3, dtype=torch.float64)
    apply_recompute(model, mode)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_every_gradient_are_bit_identical(preset, mode):
    config = ModelConfig(**preset)
    tokens = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    want_loss, want = _loss_and_grads(config, "none", tokens)
    loss, grads = _loss_and_grads(config, mode, tokens)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want.keys()
    for name, g in grads.items():
        assert torch.equal(g, want[name]), name


@pytest.mark.parametrize("mode", MODES)
def test_inference_paths_are_unchanged(mode):
    config = ModelConfig(**DENSE)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    plain, model = build_model(config, seed=3), build_model(config, seed=3)
    apply_recompute(model, mode)
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))
    # A KV cache with gradients on: the block runs plainly (a recomputed cache update would write twice).
    outs = []
    for m in (plain, model):
        cache = KVCache(config, 2, 16)
        outs.append(torch.cat([m(tokens[:, :5], cache=cache), m(tokens[:, 5:], cache=cache)], dim=1))
    assert torch.equal(outs[0], outs[1])
    outs[1].sum().backward()


def test_block_hooks_fire_once_and_inner_hooks_again_in_recomputation():
    """ZeRO-3 gathers a block's parameters in a pre-hook on the Block: under full recomputation that
    hook must run once per step, not again when backward recomputes the block."""
    config = ModelConfig(**DENSE)
    model = apply_recompute(build_model(config, seed=3), "full")
    calls = {"block_pre": 0, "block_post": 0, "attn_pre": 0}
    block = model.layers["0"]
    block.register_forward_pre_hook(lambda m, a: calls.__setitem__("block_pre", calls["block_pre"] + 1))
    block.register_forward_hook(lambda m, a, o: calls.__setitem__("block_post", calls["block_post"] + 1))
    block.attn.register_forward_pre_hook(lambda m, a: calls.__setitem__("attn_pre", calls["attn_pre"] + 1))
    model(torch.randint(0, 64, (1, 8))).sum().backward()
    # tensor parallelism's hooks sit on attn / mlp: they run again in the recomputation
    assert calls == {"block_pre": 1, "block_post": 1, "attn_pre": 2}


def test_refusals():
    config = ModelConfig(**DENSE)
    with pytest.raises(ValueError, match="parallel.recompute='some'.*none, selective, full"):
        apply_recompute(build_model(config), "some")
    model = apply_recompute(build_model(config), "full")
    with pytest.raises(ValueError, match=r"\(full\) was applied to this model already"):
        apply_recompute(model, "selective")
    with pytest.raises(ValueError, match="expects the reference Transformer"):
        apply_recompute(torch.nn.Linear(2, 2), "full")
    assert apply_recompute(build_model(config), "none") is not None  # none changes nothing


# --------------------------------------------------------------------------------------------
# Memory: measured vs the planner
# --------------------------------------------------------------------------------------------

# SMALL_MODEL's shape: h=32, 4 heads of 8 (kv heads 2), SwiGLU width 64.
MEM = dict(vocab_size=256, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64, max_seq_len=64)
BATCH, SEQ = 2, 16
# The planner's per-layer elements (model_stats.activation_elems_per_token) with eager=True describe
# this model run op by op, as the CPU runs it: they must equal what autograd keeps, byte for byte.


def _per_layer_bytes(mode: str) -> float:
    """Bytes kept per layer: the difference between 3 layers and 1 (embedding, head, loss and the RoPE
    tables, which every layer shares, cancel out)."""
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    total = {}
    for layers in (1, 3):
        model = apply_recompute(build_model(ModelConfig(**MEM, num_layers=layers), seed=0), mode)
        loss_fn = lambda logits: F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())  # noqa: E731
        total[layers] = saved_activation_bytes(model, tokens[:, :-1], loss_fn)
    return (total[3] - total[1]) / 2


def _predicted_per_layer_bytes(mode: str) -> float:
    tp_sharded, sequence_only = activation_elems_per_token(ModelConfig(**MEM, num_layers=1), 0, recompute=mode,
                                                           eager=True)
    return (tp_sharded + sequence_only) * BATCH * SEQ * 4  # fp32, as the planner's precision="fp32"


@pytest.fixture(scope="module")
def memory():
    rows = {mode: (_per_layer_bytes(mode), _predicted_per_layer_bytes(mode)) for mode in ("none", *MODES)}
    print(f"\nbytes kept for backward per layer ({BATCH}x{SEQ} tokens, fp32): measured vs planner")
    for mode, (got, want) in rows.items():
        print(f"  {mode:9s} {got:9.0f} {want:9.0f}  x{got / want:.2f}   "
              f"ratio to none {got / rows['none'][0]:.3f} vs {want / rows['none'][1]:.3f}")
    return rows


def test_recomputation_keeps_what_the_planner_predicts(memory):
    (none, pred_none), (selective, pred_selective), (full, pred_full) = (memory[m] for m in ("none", "selective", "full"))
    assert none > selective > full > 0
    # every mode: exactly the planner's eager count (full: the block input alone)
    assert (none, selective, full) == (pred_none, pred_selective, pred_full)
    # and what selective drops is what lives inside the recomputed core and activation: silu(gate), the
    # GQA-expanded k and v, the log-sum-exp
    c = MEM
    q_dim, kv_dim = c["hidden_size"], c["num_kv_heads"] * c["hidden_size"] // c["num_heads"]
    inside = c["intermediate_size"] + 2 * (q_dim - kv_dim) + c["num_heads"]
    assert none - selective == inside * BATCH * SEQ * 4


# --------------------------------------------------------------------------------------------
# The Trainer: one process, and 2 ranks under dp, tp and ZeRO-3
# --------------------------------------------------------------------------------------------

STEPS = 5
TOL = 1e-9  # fp64: layouts differ only by summation order
LAYOUTS = {"dp2": [], "tp2": ["parallel.tp=2"], "zero3": ["parallel.zero_stage=3"]}


SETTINGS = [*TRAIN, "train.progress=false", "train.global_batch_size=8", "train.micro_batch_size=2", "train.lr=3e-3",
            "train.grad_clip=0.5", "train.val_batches=0", "train.precision=fp64", "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, settings=SETTINGS, steps=STEPS)


def run_trainer(cfg) -> dict:
    trainer = Trainer(cfg)
    rows = [trainer.train_step() for _ in range(STEPS)]
    weights = full_weights(trainer)  # ZeRO-3 frees them between uses: gathered
    return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
            "activation_mib": rows[0]["activation_mib"], "weights": weights, "comm_mb": rows[-1]["comm_mb"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    """Single process: without recomputation, and with each mode (which must change nothing at all)."""
    root = tmp_path_factory.mktemp("ref")
    runs = {mode: run_trainer(make_cfg(root / mode, text_file, f"parallel.recompute={mode}"))
            for mode in ("none", *MODES)}
    assert runs["none"]["loss"][-1] < runs["none"]["loss"][0] - 0.3  # parity is not trivial
    assert max(runs["none"]["grad_norm"]) > 0.5  # clipping is active: a wrong norm would change the weights
    return runs


def test_trainer_one_process_is_bit_identical_and_reports_activation_memory(reference):
    none = reference["none"]
    for mode in MODES:
        run = reference[mode]
        assert (run["loss"], run["grad_norm"]) == (none["loss"], none["grad_norm"]), mode
        assert all(torch.equal(w, none["weights"][k]) for k, w in run["weights"].items()), mode
    assert none["activation_mib"] > reference["selective"]["activation_mib"] > reference["full"]["activation_mib"] > 0


def test_check_layout_accepts_recompute(tmp_path, text_file):
    for mode in MODES:
        assert check_layout(make_cfg(tmp_path, text_file, f"parallel.recompute={mode}"), 2).dp == 2


def recompute_worker(rank, world_size, root: Path, text_file: Path):
    return {(layout, mode): run_trainer(make_cfg(root / f"{layout}-{mode}", text_file, *extra,
                                                 f"parallel.recompute={mode}"))
            for layout, extra in LAYOUTS.items() for mode in ("none", *MODES)}


def test_dp_tp_zero3_with_recompute_match_single_process(tmp_path, text_file, reference):
    want = reference["none"]
    results = run_distributed(recompute_worker, 2, tmp_path, text_file, timeout=180)
    for r, result in enumerate(results):
        for key, got in result.items():
            for step in range(STEPS):
                for metric in ("loss", "grad_norm"):
                    a, b = got[metric][step], want[metric][step]
                    assert abs(a - b) <= TOL * abs(b), (key, r, step, metric, a, b)
            for name, w in want["weights"].items():
                diff = float((got["weights"][name] - w).abs().max())
                assert diff <= TOL, f"{key} rank {r} {name}: max |difference| {diff:.2e}"
        for layout in LAYOUTS:
            # Recomputation adds no data-parallel / ZeRO traffic (ZeRO-3 gathers a block once for its
            # forward and once for its backward, not again for the recomputation); under full
            # recomputation the tensor-parallel collectives of each block's forward run again.
            plain, selective, full = (result[(layout, mode)]["comm_mb"] for mode in ("none", *MODES))
            assert selective == plain, (layout, selective, plain)
            assert {a: v for a, v in full.items() if a != "tp"} == {a: v for a, v in plain.items() if a != "tp"}
            if layout == "tp2":
                # Each block's recomputation re-runs attn's all-gather and reduce-scatter and mlp's
                # all-gather, of x = tokens x hidden x 8 bytes each; the checkpoint stops recomputing
                # once w_down's input is back (torch's early stop), before mlp's reduce-scatter.
                x = 2 * 32 * 32 * 8  # micro-batch of 2 x 32 tokens, hidden 32, fp64
                extra = 3 * x * 2 * 4  # per block, 2 blocks, 4 micro-batches per step
                assert full["tp"] - plain["tp"] == pytest.approx(extra / 2**20, rel=1e-12), (full, plain)
            else:
                assert "tp" not in full, (layout, full)
