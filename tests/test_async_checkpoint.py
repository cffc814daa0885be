"""train.async_checkpoint: checkpoints staged in CPU memory and written while training goes on give the same
run and the same checkpoints as synchronous saves (one process and two ranks), and every one is published
complete (its manifest verifies)."""

import pytest
import torch
from safetensors.torch import load_file

from dist import run_distributed
from meshlm.config import load_config
from meshlm.checkpoint import verify_checkpoint
from runs import SMALL_MODEL, step_losses

SETTINGS = [*SMALL_MODEL, "train.progress=false", "train.seq_len=16", "train.global_batch_size=4", "train.steps=5",
            "train.warmup_steps=1", "train.val_batches=0", "train.sample_tokens=0", "train.device=cpu",
            "data.val_fraction=0.1", "train.checkpoint_interval=1", "train.keep_checkpoints=3"]


def train(rank, world_size, run_dir, text_file, asynchronous):
    from meshlm.train.trainer import Trainer

    cfg = load_config(overrides=[*SETTINGS, f"data.path={text_file}", f"train.run_dir={run_dir}",
                                 f"train.async_checkpoint={str(asynchronous).lower()}"])
    Trainer(cfg).train()


def checkpoints(run_dir):
    root = run_dir / "checkpoints"
    found = sorted(p for p in root.iterdir() if p.name.startswith("step_"))
    for path in found:
        verify_checkpoint(path)
    return {p.name: load_file(str(p / "model_rank_00000.safetensors")) for p in found}


@pytest.mark.parametrize("world_size", [1, 2])
def test_async_checkpoints_equal_synchronous_ones(tmp_path, text_file, world_size):
    runs = {}
    for asynchronous in (False, True):
        run_dir = tmp_path / f"async{asynchronous}"
        if world_size == 1:
            train(0, 1, run_dir, text_file, asynchronous)
        else:
            run_distributed(train, world_size, run_dir, text_file, asynchronous, timeout=120)
        runs[asynchronous] = run_dir
    assert step_losses(runs[True]) == step_losses(runs[False])
    sync, asyn = checkpoints(runs[False]), checkpoints(runs[True])
    assert sorted(asyn) == sorted(sync) == ["step_000003", "step_000004", "step_000005"]
    for name in sync:
        for key in sync[name]:
            assert torch.equal(asyn[name][key], sync[name][key]), (name, key)
