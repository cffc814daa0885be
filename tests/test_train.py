"""The single-process training stack: loss goes down, accumulation is exact, resume is bit-identical,
checkpoints are atomic and refuse a different model, schedule and clipping behave."""

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from meshlm.config import load_config
from meshlm.checkpoint import (latest_checkpoint, load_checkpoint_for_inference, resolve_checkpoint,
                                     save_checkpoint)
from meshlm.train.optim import clip_grad_norm, lr_at
from meshlm.train.trainer import Trainer
from parity import FP32_REL, FP64_TOL, assert_close_seq, assert_state_close
from runs import TRAIN, grad_norms, rows, step_losses, train_config, write_corpus



@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 600)


SETTINGS = [*TRAIN, "train.progress=false", "train.global_batch_size=8", "train.micro_batch_size=8", "train.lr=1e-2",
            "train.val_interval=5", "train.val_batches=2"]
make_cfg = partial(train_config, settings=SETTINGS, steps=10)


def test_a_few_steps_lower_the_loss(tmp_path, text_file):
    cfg = make_cfg(tmp_path / "run", text_file, "train.steps=25", "train.val_interval=25")
    summary = Trainer(cfg).train()
    assert summary["steps"] == 25
    assert summary["val_loss"] < summary["first_val_loss"] - 1.0
    losses = step_losses(tmp_path / "run")
    assert len(losses) == 25 and losses[-1] < losses[0] - 1.0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_mib", "step_time_s"} <= set(row)
    assert "loss_tokens" not in row  # every target of a text counts
    assert (tmp_path / "run" / "checkpoints" / "step_000025").is_dir()


@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_grad_accumulation_matches_one_micro_batch(tmp_path, text_file, precision):
    """fp64: losses, grad norms and weights to FP64_TOL; fp32: losses and grad norms to FP32_REL."""
    runs = {}
    for micro in (8, 2):
        run_dir = tmp_path / f"m{micro}"
        trainer = Trainer(make_cfg(run_dir, text_file, f"train.micro_batch_size={micro}", "train.steps=3",
                                   "train.val_batches=0", f"train.precision={precision}"))
        trainer.train()
        runs[micro] = (step_losses(run_dir), grad_norms(run_dir), trainer.base_model.state_dict())
    (losses, norms, weights), (want_losses, want_norms, want_weights) = runs[2], runs[8]
    tol = FP64_TOL if precision == "fp64" else FP32_REL
    assert_close_seq(losses, want_losses, rtol=tol, what=f"{precision} 4 x 2 accumulated vs 1 x 8: loss")
    assert_close_seq(norms, want_norms, rtol=tol, what=f"{precision} 4 x 2 accumulated vs 1 x 8: grad norm")
    if precision == "fp64":
        assert_state_close(weights, want_weights, atol=tol, what="fp64 4 x 2 accumulated vs 1 x 8: weights")


def test_resume_is_bit_identical(tmp_path, text_file):
    straight = Trainer(make_cfg(tmp_path / "straight", text_file))
    straight.train()

    first = Trainer(make_cfg(tmp_path / "split", text_file))
    assert first.train(until_step=5)["steps"] == 5
    assert latest_checkpoint(tmp_path / "split").name == "step_000005"
    with open(tmp_path / "split" / "metrics.jsonl", "a") as f:  # logged after the checkpoint, then a crash
        f.write(json.dumps({"step": 6, "loss": 99.0}) + "\n")
        f.write('{"step": 7, "lo')  # the crash hit in the middle of a write
    second = Trainer(make_cfg(tmp_path / "split", text_file), resume=True)
    assert second.step == 5
    summary = second.train()

    assert summary["steps"] == 10 and summary["first_val_loss"] == first.first_val_loss
    assert step_losses(tmp_path / "split") == step_losses(tmp_path / "straight")
    for (name, a), b in zip(straight.base_model.state_dict().items(), second.base_model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.optimizer.state_dict()["state"].values(), second.optimizer.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and torch.equal(a["step"], b["step"])


def test_unfinished_checkpoint_is_never_latest(tmp_path, text_file):
    run = tmp_path / "run"
    trainer = Trainer(make_cfg(run, text_file, "train.steps=2", "train.val_batches=0"))
    trainer.train()
    root = run / "checkpoints"
    # A crash between writing and renaming leaves step_N.tmp/ behind: it must be ignored.
    crashed = root / "step_000007.tmp"
    crashed.mkdir()
    (crashed / "meta.json").write_text("{}")
    assert latest_checkpoint(run) == root / "step_000002"
    resumed = Trainer(make_cfg(run, text_file, "train.steps=2", "train.val_batches=0"), resume=True)
    assert resumed.step == 2
    # A pointer to something that is not a complete checkpoint: inference refuses it (naming the newest
    # complete one), --resume falls back to that one and says so.
    (root / "latest").write_text("step_000007.tmp")
    with pytest.raises(ValueError, match="does not name a checkpoint.*newest intact checkpoint is step_000002"):
        latest_checkpoint(run)
    resumed = Trainer(make_cfg(run, text_file, "train.steps=2", "train.val_batches=0"), resume=True)
    assert resumed.step == 2 and "newest complete checkpoint, step_000002" in resumed.fallback_note


def test_keeps_only_the_last_checkpoints(tmp_path, text_file):
    run = tmp_path / "run"
    Trainer(make_cfg(run, text_file, "train.steps=4", "train.checkpoint_interval=1", "train.keep_checkpoints=2",
                     "train.val_batches=0")).train()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000003", "step_000004"]


def test_keeps_the_newest_checkpoints_past_a_million_steps(tmp_path):
    # step_1000000 sorts before step_999999 as a name: pruning must go by the step number.
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (999_998, 999_999, 1_000_000):
        save_checkpoint(tmp_path, step=step, model=model, optimizer=optimizer, config=load_config(),
                        rank_extra={}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1000000", "step_999999"]


def test_run_dir_that_cannot_be_created_is_a_user_error(tmp_path, text_file):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"train.run_dir=.*a_file/run.* cannot be created"):
        Trainer(make_cfg(tmp_path / "a_file" / "run", text_file))


def test_mismatched_or_corrupt_checkpoint_is_refused(tmp_path, text_file):
    run = tmp_path / "run"
    Trainer(make_cfg(run, text_file, "train.steps=1", "train.val_batches=0")).train()
    with pytest.raises(ValueError, match=r"model\.num_layers: checkpoint 2, now 3"):
        Trainer(make_cfg(run, text_file, "model.num_layers=3"), resume=True)
    ckpt = latest_checkpoint(run)
    data_file = next(ckpt.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"{data_file.name} has 100 bytes.*truncated"):
        Trainer(make_cfg(run, text_file), resume=True)
    (ckpt / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"\.metadata is missing"):
        Trainer(make_cfg(run, text_file), resume=True)
    with pytest.raises(ValueError, match="no checkpoint at"):
        resolve_checkpoint(tmp_path / "nothing")


def test_checkpoint_loads_for_inference_and_samples(tmp_path, text_file):
    run = tmp_path / "run"
    trainer = Trainer(make_cfg(run, text_file, "train.steps=2", "train.val_batches=0"))
    trainer.train()
    latest = latest_checkpoint(run)
    assert resolve_checkpoint(run) == resolve_checkpoint(run / "checkpoints") == resolve_checkpoint(latest) == latest
    model, cfg, tokenizer = load_checkpoint_for_inference(run)
    assert cfg.model == trainer.cfg.model and not model.training
    tokens = torch.tensor([tokenizer.encode("def f1(x):")])
    trainer.base_model.eval()
    assert torch.equal(model(tokens), trainer.base_model(tokens))
    assert isinstance(trainer.sample("def ", 5), str)


def test_moe_model_trains_with_aux_loss(tmp_path, text_file):
    cfg = make_cfg(tmp_path / "moe", text_file, "model.num_experts=4", "model.num_experts_per_token=2",
                   "model.moe_intermediate_size=32", "train.steps=3", "train.micro_batch_size=4",
                   "train.val_batches=0")
    summary = Trainer(cfg).train()
    assert summary["steps"] == 3 and math.isfinite(summary["loss"])


def test_lr_schedule():
    cfg = load_config(overrides=["train.steps=110", "train.warmup_steps=10", "train.lr=1.0",
                                 "train.min_lr_ratio=0.1"]).train
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway through the cosine
    assert lr_at(109, cfg) == pytest.approx(0.1, abs=1e-3) and lr_at(500, cfg) == pytest.approx(0.1)
    cfg.lr_schedule = "linear"
    assert lr_at(60, cfg) == pytest.approx(0.55)
    cfg.lr_schedule = "constant"
    assert lr_at(60, cfg) == 1.0


def test_epochs_set_the_steps_and_the_schedule_spans_them(tmp_path, text_file, capsys):
    cfg = make_cfg(tmp_path / "run", text_file, "train.epochs=1.5", "train.steps=1000", "train.warmup_steps=2",
                   "train.val_interval=1000", "train.checkpoint_interval=0", "train.min_lr_ratio=0.1")
    trainer = Trainer(cfg)
    per_epoch = len(trainer.train_data) // 8  # whole global batches of 8 samples
    assert per_epoch >= 4 and trainer.cfg.train.steps == int(1.5 * per_epoch + 0.5)
    summary = trainer.train()
    assert summary["steps"] == int(1.5 * per_epoch + 0.5) and trainer.loader.epoch == 1  # into the second pass
    assert "(1.5 epochs: " in capsys.readouterr().out
    lrs = [r["lr"] for r in rows(tmp_path / "run") if "lr" in r]
    assert len(lrs) == summary["steps"] and lrs[-1] == pytest.approx(lr_at(summary["steps"] - 1, cfg.train))
    assert lrs[-1] < 0.11 * 1e-2  # the cosine ended with the run
    with pytest.raises(ValueError, match=r"train.epochs=-1(\.0)? must be >= 0"):
        load_config(overrides=["train.epochs=-1"])
    from meshlm import verify

    proof = verify.prepare(cfg, steps=3, precision="fp64", run_dir=tmp_path / "proof")
    assert Trainer(proof).cfg.train.steps == 3  # verify runs the steps it is asked for, whatever the epochs


def test_clip_grad_norm_and_norm_hook():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert float(clip_grad_norm(params, 0.0)) == pytest.approx(5.0)  # 0: measure only
    assert float(clip_grad_norm(params, 1.0)) == pytest.approx(5.0)
    assert float(torch.linalg.vector_norm(torch.cat([p.grad for p in params]))) == pytest.approx(1.0, rel=1e-5)
    # A distributed strategy reports a larger global norm: every rank scales by it.
    norm = clip_grad_norm(params, 0.5, norm_fn=lambda grads: torch.tensor(2.0))
    assert float(norm) == 2.0 and float(params[0].grad[0]) == pytest.approx(0.6 * 0.25, rel=1e-5)


def test_bf16_autocast_keeps_fp32_master_weights(tmp_path, text_file):
    trainer = Trainer(make_cfg(tmp_path / "bf16", text_file, "train.precision=bf16", "train.steps=2",
                               "train.val_batches=1"))
    summary = trainer.train()
    assert math.isfinite(summary["loss"]) and math.isfinite(summary["val_loss"])
    assert all(p.dtype == torch.float32 for p in trainer.base_model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())


def test_resume_applies_the_configs_optimizer_settings_and_says_so(tmp_path, text_file):
    run = tmp_path / "run"
    Trainer(make_cfg(run, text_file, "train.steps=2", "train.val_batches=0")).train()
    resumed = Trainer(make_cfg(run, text_file, "train.steps=3", "train.val_batches=0", "train.beta2=0.9"), resume=True)
    assert all(tuple(g["betas"])[1] == 0.9 for g in resumed.optimizer.param_groups)
    assert "betas (0.9, 0.95) -> (0.9, 0.9)" in resumed.optimizer_note
    same = Trainer(make_cfg(run, text_file, "train.steps=3", "train.val_batches=0"), resume=True)
    assert same.optimizer_note is None


def test_mfu_is_not_invented_on_cpu(tmp_path, text_file, capsys):
    """Without a known peak (CPU, no train.peak_tflops) MFU is null and the step line shows tokens/s only."""
    Trainer(make_cfg(tmp_path / "a", text_file, "train.steps=1", "train.val_batches=0")).train()
    row = [r for r in rows(tmp_path / "a") if "loss" in r][0]
    assert row["mfu"] is None
    out = capsys.readouterr().out
    assert "MFU: not shown on CPU" in out and "tok/s" in out and "MFU 0" not in out
    Trainer(make_cfg(tmp_path / "b", text_file, "train.steps=1", "train.val_batches=0", "train.peak_tflops=1")).train()
    assert [r for r in rows(tmp_path / "b") if "loss" in r][0]["mfu"] > 0


@pytest.mark.parametrize("reuse", [True, False])
def test_trainer_on_a_cpu_reuses_freed_host_memory_as_configured(tmp_path, text_file, monkeypatch, reuse):
    """train.reuse_host_memory (default true) raises malloc's thresholds for the rank's process on a CPU
    (meshlm/host_memory.py, whose effect on page faults test_engine measures); false leaves malloc alone."""
    import meshlm.train.trainer as trainer_module

    calls = []
    monkeypatch.setattr(trainer_module, "reuse_freed_host_memory", lambda: calls.append(1) or True)
    Trainer(make_cfg(tmp_path / "run", text_file, f"train.reuse_host_memory={str(reuse).lower()}", "train.steps=1"))
    assert calls == ([1] if reuse else [])
