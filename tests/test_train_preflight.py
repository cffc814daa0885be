"""`meshlm train` refuses, before any rank starts, a run the planner predicts its ranks' memory cannot hold.

- The planner's inputs follow the config: ZeRO-3 over 4 ranks holds a quarter of the weights, tp 2 half of the
  blocks', fp64 twice the fp32 bytes, a smaller micro-batch fewer activations.
- The refusal names the bytes, their parts, what each rank has and the fixes; a smaller micro-batch then fits.
- The host's memory is split between the ranks that run on it.
- From the command line: one line, exit 2, nothing started (no run folder, no ranks under --nproc);
  --no-memory-check starts it, and reaches the ranks' own command lines.
"""

from types import SimpleNamespace

import pytest

from meshlm import host_memory
from meshlm.cli import main
from meshlm.config import load_config
from meshlm.launch import train_args
from meshlm.planner import preflight
from meshlm.planner.preflight import GiB, check_train_memory, rank_memory_bytes

SMALL = ["model.preset=tiny", "train.seq_len=64", "train.global_batch_size=8"]


def test_the_prediction_follows_the_layout_and_the_precision():
    one = rank_memory_bytes(load_config(None, SMALL), 1, device="cpu")
    zero3 = rank_memory_bytes(load_config(None, [*SMALL, "parallel.zero_stage=3"]), 4, device="cpu")
    tp2 = rank_memory_bytes(load_config(None, [*SMALL, "parallel.tp=2"]), 2, device="cpu")
    fp64 = rank_memory_bytes(load_config(None, [*SMALL, "train.precision=fp64"]), 1, device="cpu")
    micro = rank_memory_bytes(load_config(None, [*SMALL, "train.micro_batch_size=2"]), 1, device="cpu")
    assert zero3["weights"] == pytest.approx(one["weights"] / 4, rel=0.02)
    assert one["weights"] / 2 < tp2["weights"] < one["weights"]  # the embedding and head are split too, norms not
    assert fp64["total"] == pytest.approx(2 * one["total"]) and fp64["weights"] == pytest.approx(2 * one["weights"])
    assert micro["activations"] == pytest.approx(one["activations"] / 4, rel=0.05)
    assert micro["weights"] == one["weights"] and one["total"] == pytest.approx(
        sum(one[k] for k in preflight.PARTS))


def test_a_run_that_cannot_fit_is_refused_with_its_parts_and_fixes(monkeypatch):
    cfg = load_config(None, SMALL)
    need = rank_memory_bytes(cfg, 1, device="cpu")["total"]
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: int(need * 0.9))
    with pytest.raises(ValueError) as e:
        check_train_memory(cfg, 1, ranks_here=1)
    text = str(e.value)
    assert "\n" not in text and "per rank" in text and "activations" in text and "weights" in text
    assert "train.micro_batch_size" in text and "parallel.zero_stage" in text and "--no-memory-check" in text
    smaller = load_config(None, [*SMALL, "train.micro_batch_size=1"])
    assert check_train_memory(smaller, 1, ranks_here=1).startswith("memory: ")
    # the ranks on this host share its memory: each has its share
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: 8 * GiB)
    assert preflight.memory_per_rank("cpu", 4) == (2 * GiB, "this host's 8.0 GiB / 4 ranks")
    assert check_train_memory(cfg, 1, ranks_here=4).endswith("of 2.00 GiB (this host's 8.0 GiB / 4 ranks)")


def test_the_command_line_refuses_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    huge = ["--set", "model.preset=tiny", "--set", "model.vocab_size=400000000", "--set", f"train.run_dir={tmp_path}/r"]
    assert main(["train", *huge]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("meshlm train: error: this run needs at least") and "TiB" in err
    assert main(["train", "--nproc", "2", *huge]) == 2  # the launcher's parent refuses: no rank is started
    assert "error: this run needs at least" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    args = SimpleNamespace(config=None, overrides=["train.steps=1"], resume=False, overwrite=False,
                           no_memory_check=True)
    assert train_args(args)[-1] == "--no-memory-check"


def test_the_host_memory_is_its_total_or_a_smaller_cgroup_limit():
    total = host_memory.host_memory_bytes()
    assert total is None or 64 * 2**20 < total < 2**60
    assert GiB == 2**30


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "llama3-8b", "mixtral-8x7b", "deepseek-v3"])
def test_the_parameter_floor_never_exceeds_the_count(preset):
    from meshlm.models.stats import count_params

    cfg = load_config(None, [f"model.preset={preset}"])
    assert 0 < preflight.params_lower_bound(cfg) <= count_params(cfg.model)["total"]


def test_a_billion_layers_is_refused_from_the_floor_without_walking_them():
    """The planner's summary walks every layer (found by fuzzing: `--set model.num_layers=1000000000` hung)."""
    cfg = load_config(None, ["model.preset=tiny", "model.num_layers=1000000000"])
    with pytest.raises(ValueError, match=r"needs at least .* TiB per rank \(its [0-9,]+ or more parameters"):
        check_train_memory(cfg, 1, ranks_here=1)
