"""Experiment tracking: train.tensorboard writes event files next to metrics.jsonl holding the same numbers
(read back with tensorboard's own event reader), train.wandb logs to an offline W&B run, and a missing
package is one line naming the pip command."""

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest

from meshlm.cli import main
from meshlm.config import load_config
from meshlm.train.metrics import MetricsLogger, tracker_scalars
from meshlm.train.trainer import Trainer
from runs import SMALL_MODEL, rows


def test_tensorboard_event_files_hold_the_metrics(tmp_path, text_file):
    pytest.importorskip("tensorboard", reason="the [tb] extra (tensorboard) is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    cfg = load_config(overrides=[*SMALL_MODEL, f"data.path={text_file}", f"train.run_dir={run_dir}",
                                 "train.progress=false", "train.seq_len=32", "train.global_batch_size=4",
                                 "train.steps=4", "train.val_interval=2", "train.val_batches=1",
                                 "train.sample_tokens=0", "data.val_fraction=0.1", "train.device=cpu",
                                 "train.peak_tflops=1.0", "train.tensorboard=true"])
    Trainer(cfg).train()
    assert list(run_dir.glob("events.out.tfevents.*")), "no event file next to metrics.jsonl"
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu",
                "train/memory_mib", "val/loss"):
        assert tag in tags, (tag, sorted(tags))
    logged = rows(run_dir)
    steps = [r for r in logged if "loss" in r]
    for tag, key, source in (("train/loss", "loss", steps), ("train/lr", "lr", steps),
                             ("train/grad_norm", "grad_norm", steps), ("val/loss", "val_loss",
                                                                        [r for r in logged if "val_loss" in r])):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [r["step"] for r in source], tag
        for (_, value), row in zip(got, source):
            assert value == pytest.approx(row[key], rel=1e-6), tag  # event files hold float32

    # A fresh run into the same run_dir (--overwrite) starts new charts: the old event file goes.
    old = set(run_dir.glob("events.out.tfevents.*"))
    Trainer(cfg, overwrite=True).train(until_step=1)
    assert not old & set(run_dir.glob("events.out.tfevents.*"))


def test_every_number_of_a_row_becomes_a_tag():
    row = {"step": 3, "loss": 2.5, "lr": 1e-3, "mfu": None, "comm_mb": {"dp": 1.5, "tp": 2.0},
           "comm_s": {"dp": 0.01}, "expert_load": {"min": 1, "max": 3, "imbalance": 1.5}}
    assert tracker_scalars(row) == {"train/loss": 2.5, "train/lr": 1e-3, "comm_mb/dp": 1.5, "comm_mb/tp": 2.0,
                                    "comm_s/dp": 0.01, "expert_load/min": 1.0, "expert_load/max": 3.0,
                                    "expert_load/imbalance": 1.5}
    assert tracker_scalars({"step": 4, "val_loss": 2.0}) == {"val/loss": 2.0}


def test_missing_tensorboard_names_the_extra_in_one_line(tmp_path, text_file, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    sets = [*SMALL_MODEL, "train.seq_len=32", "train.global_batch_size=4", "train.steps=1", "train.sample_tokens=0",
            f"data.path={text_file}", f"train.run_dir={tmp_path / 'run'}", "train.tensorboard=true"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install tensorboard" in err[0], err


def test_wandb_logs_the_same_scalars_offline(tmp_path, monkeypatch):
    """W&B is not a dependency: a stand-in module records what the logger hands it."""
    calls = []
    run = types.SimpleNamespace(log=lambda data, step: calls.append(("log", step, data)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(tmp_path, total_steps=1, progress=False, wandb_config={"train": {"lr": 1.0}})
    row = {"step": 1, "loss": 2.0, "lr": 0.5, "grad_norm": 1.0, "tokens_per_s": 10.0, "comm_mb": {"dp": 1.0}}
    logger.log(row)
    logger.close()
    (_, init), log, finish = calls
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path) and init["config"] == {"train": {"lr": 1.0}}
    assert log == ("log", 1, {"train/loss": 2.0, "train/lr": 0.5, "train/grad_norm": 1.0,
                              "train/tokens_per_s": 10.0, "comm_mb/dp": 1.0}) and finish == ("finish",)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == row
