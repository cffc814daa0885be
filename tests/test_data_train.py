"""Training on prepared data (`meshlm data prepare` -> `data.path` / `data.sources`), through the CLI.

A run resumed under other layouts (dp2 -> dp4 -> tp2) continues with exactly the samples and the losses of
the uninterrupted one-process run: the loader's position is a few integers that name no rank. Prepared data
is refused, before any rank starts, without the tokenizer it was prepared with.
"""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from meshlm.cli import main as cli_main  # noqa: E402
from meshlm.data.dataset import open_dataset  # noqa: E402
from meshlm.data.prepare import prepare  # noqa: E402
from parity import assert_close_seq  # noqa: E402
from prepared_data import make_docs, make_tokenizer, write_jsonl  # noqa: E402
from runs import LAUNCH_ENV, SMALL_MODEL, rows, run_cli, step_losses  # noqa: E402

SEQ, GBS = 32, 8
BASE = [*SMALL_MODEL, "model.vocab_size=512", f"train.seq_len={SEQ}", f"train.global_batch_size={GBS}",
        "train.micro_batch_size=2", "train.precision=fp64", "train.lr=3e-3", "train.lr_schedule=constant",
        "train.warmup_steps=0", "train.sample_tokens=0", "train.progress=false", "train.device=cpu",
        "train.checkpoint_interval=2", "train.keep_checkpoints=3", "train.val_batches=1", "train.val_interval=2",
        "parallel.bucket_size_mb=0.02"]


@pytest.fixture(autouse=True)
def _not_a_rank(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("prepared")
    tok = make_tokenizer(root / "tokenizer.json")
    out = {"tokenizer": tok}
    for name, seed in (("web", 1), ("code", 2)):
        src = write_jsonl(root / f"{name}.jsonl", make_docs(600, seed=seed))
        prepare([str(src)], tokenizer_path=str(tok), out=str(root / name), val_fraction=0.1, progress=False)
        out[name] = root / name
    return out


def argv(run_dir: Path, corpus: dict, *extra: str, resume: bool = False, data=None) -> list[str]:
    data = data or [f"data.path={corpus['web']}"]
    sets = [*BASE, *data, f"data.tokenizer={corpus['tokenizer']}", f"train.run_dir={run_dir}", *extra]
    return ["train", *(["--resume"] if resume else []), *[a for s in sets for a in ("--set", s)]]


def loader_state(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "rank_00000.json").read_text())["loader"]


def test_a_prepared_run_resumed_as_dp2_dp4_tp2_sees_the_uninterrupted_runs_samples(tmp_path, corpus):
    ref = tmp_path / "ref"
    assert cli_main(argv(ref, corpus, "train.steps=6")) == 0
    want = step_losses(ref)
    assert len(want) == 6
    assert all(r["data_wait_s"] >= 0 for r in rows(ref) if "loss" in r)
    assert any("val_loss" in r for r in rows(ref))  # the prepared 'val' split is evaluated

    run = tmp_path / "run"
    run_cli([(argv(run, corpus, "train.steps=2"), 2),
             (argv(run, corpus, "train.steps=4", "parallel.dp_shard=4", resume=True), 4),
             (argv(run, corpus, "train.steps=6", "parallel.tp=2", resume=True), 2)], tmp_path)
    got = [r["loss"] for r in rows(run) if "loss" in r]
    assert_close_seq(got, want, rtol=1e-9, what="dp2 -> dp4 -> tp2 on prepared data")
    # The samples: each checkpoint's loader position equals the uninterrupted run's, and from it the
    # dataset's order gives the same sample ids.
    data = open_dataset(str(corpus["web"]), seq_len=SEQ)
    for step in (2, 4, 6):
        mine, theirs = loader_state(run, step), loader_state(ref, step)
        assert mine == theirs
        ids = data.order(mine["seed"], mine["epoch"], np.arange(mine["position"], mine["position"] + GBS))
        assert len(set(ids.tolist())) == GBS


def test_a_blend_trains_and_bad_sources_are_refused_before_work(tmp_path, corpus, capsys):
    blend = [f'data.sources=[{{path = "{corpus["web"]}", weight = 0.7}}, {{path = "{corpus["code"]}", weight = 0.3}}]']
    assert cli_main(argv(tmp_path / "blend", corpus, "train.steps=2", data=blend)) == 0
    assert len(step_losses(tmp_path / "blend")) == 2

    bad = [f'data.sources=[{{path = "{corpus["web"]}", weight = 0}}]']
    assert cli_main(argv(tmp_path / "bad", corpus, "train.steps=1", data=bad)) == 2
    assert "data.sources[0].weight" in capsys.readouterr().err
    not_prepared = [f'data.sources=[{{path = "{tmp_path}", weight = 1}}]']
    assert cli_main(argv(tmp_path / "bad2", corpus, "train.steps=1", data=not_prepared)) == 2
    assert "manifest.json" in capsys.readouterr().err


def test_prepared_data_needs_the_tokenizer_it_was_prepared_with(tmp_path, corpus, capsys):
    sets = [*BASE, f"data.path={corpus['web']}", f"train.run_dir={tmp_path / 'r'}", "train.steps=1"]
    assert cli_main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert "data.tokenizer" in err and str(corpus["tokenizer"]) in err
    other = make_tokenizer(tmp_path / "other.json", eos=False)
    assert cli_main(argv(tmp_path / "r2", corpus, "train.steps=1", f"data.tokenizer={other}")) == 2
    assert "prepared with" in capsys.readouterr().err


def test_a_damaged_validation_shard_fails_the_run_instead_of_turning_validation_off(tmp_path, corpus, capsys):
    import shutil

    damaged = shutil.copytree(corpus["web"], tmp_path / "web")
    shard = json.loads((damaged / "manifest.json").read_text())["splits"]["val"]["shards"][0]
    with open(damaged / shard["bin"], "r+b") as f:
        f.truncate(8)
    assert cli_main(argv(tmp_path / "run", corpus, "train.steps=1", data=[f"data.path={damaged}"])) != 0
    assert shard["bin"] in capsys.readouterr().err


def test_document_mask_on_prepared_data_matches_one_process_under_cp2(tmp_path, corpus):
    """The document starts the shards' index keeps mask attention as they do in memory: cp2 (ring) equals
    one process, and masking changes the loss (the samples hold several documents)."""
    mask = ["data.document_mask=true", "train.steps=2", "train.val_batches=0"]
    assert cli_main(argv(tmp_path / "one", corpus, *mask)) == 0
    run_cli([(argv(tmp_path / "cp2", corpus, *mask, "parallel.cp=2", "parallel.cp_method=ring"), 2)], tmp_path)
    assert_close_seq(step_losses(tmp_path / "cp2"), step_losses(tmp_path / "one"), rtol=1e-9,
                     what="document mask on prepared data, cp2 vs one process")
    assert cli_main(argv(tmp_path / "unmasked", corpus, "train.steps=2", "train.val_batches=0")) == 0
    assert abs(step_losses(tmp_path / "unmasked")[0] - step_losses(tmp_path / "one")[0]) > 1e-6
