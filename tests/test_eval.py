"""`meshlm eval`: loss and perplexity of a checkpoint, the same on one process and under a 2-rank layout,
and one-line errors for what a user can get wrong."""

import json
import math
from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.config import load_config
from meshlm.train.trainer import Trainer
from runs import SMALL_MODEL, write_corpus


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step run of the small model (fp64, so that layouts agree to rounding)."""
    root = tmp_path_factory.mktemp("eval")
    corpus = write_corpus(root / "corpus.txt", 400)
    cfg = load_config(overrides=[*SMALL_MODEL, f"data.path={corpus}", f"train.run_dir={root / 'run'}",
                                 "train.progress=false", "train.seq_len=32", "train.global_batch_size=8",
                                 "train.steps=3", "train.val_batches=1", "train.val_interval=3",
                                 "train.sample_tokens=0", "data.val_fraction=0.2", "train.precision=fp64",
                                 "train.device=cpu"])
    Trainer(cfg).train()
    return root / "run", corpus


def _eval_json(capsys, *args) -> dict:
    assert main(["eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_reports_loss_and_perplexity_of_the_validation_split(run, capsys):
    run_dir, corpus = run
    result = _eval_json(capsys, "--checkpoint", str(run_dir), "--set", "train.global_batch_size=1")
    assert result["step"] == 3 and result["samples"] > 8 and result["skipped_samples"] == 0
    assert result["tokens"] == result["samples"] * 32
    assert math.isclose(result["perplexity"], math.exp(result["loss"]))
    assert "validation split" in result["data"]
    # against the plain model on every sample of the split, computed here without any of meshlm's loss code
    import torch
    import torch.nn.functional as F

    from meshlm.checkpoint import load_checkpoint_for_inference
    from meshlm.tokenizer import ByteTokenizer
    from meshlm.data.text import pack, read_documents, split_documents

    model, cfg, _ = load_checkpoint_for_inference(run_dir, dtype=torch.float64)
    _, docs = split_documents(read_documents(cfg.data), cfg.data.val_fraction)
    samples = pack(ByteTokenizer().encode_documents(docs), 32).samples(torch.arange(result["samples"]))
    with torch.no_grad():
        logits = model(samples[:, :-1])
    want = F.cross_entropy(logits.flatten(0, 1), samples[:, 1:].flatten()).item()
    assert abs(result["loss"] - want) < 1e-9 * want, (result["loss"], want)
    whole = _eval_json(capsys, "--checkpoint", str(run_dir), "--data", str(corpus))
    assert whole["samples"] > result["samples"] and whole["data"] == str(corpus)  # --data: all of it


def eval_rank(rank, world_size, run_dir, overrides):
    from meshlm import evaluate

    return evaluate.evaluate(checkpoint=str(run_dir), overrides=overrides).to_dict()


def test_one_process_and_two_ranks_agree(run, capsys, monkeypatch):
    """`meshlm eval --nproc 2 --set parallel.tp=2` starts 2 ranks of `meshlm eval` with the same arguments;
    each rank evaluates under tp=2 and gets what one process gets."""
    from dist import run_distributed

    import meshlm.cli.eval

    run_dir, _ = run
    single = _eval_json(capsys, "--checkpoint", str(run_dir))
    layout = ["parallel.tp=2", "train.micro_batch_size=2"]
    started = []
    monkeypatch.setattr(meshlm.cli.eval, "run_torchrun", lambda launcher, rank_args: started.append(
        (launcher, rank_args)) or 0)
    assert main(["eval", "--checkpoint", str(run_dir), "--nproc", "2", *[a for o in layout for a in ("--set", o)],
                 "--json"]) == 0
    (launcher, rank_args), = started
    assert launcher[launcher.index("--nproc-per-node") + 1] == "2"
    assert rank_args == ["eval", "--checkpoint", str(run_dir), "--set", layout[0], "--set", layout[1], "--json"]
    # the ranks themselves (the test harness starts them faster than the elastic launcher)
    ranks = run_distributed(eval_rank, 2, run_dir, layout, timeout=120)
    for result in ranks:
        assert result["world_size"] == 2
        assert result["samples"] == single["samples"] and result["tokens"] == single["tokens"]
        assert abs(result["loss"] - single["loss"]) < 1e-9 * single["loss"], (result, single)


@pytest.mark.parametrize("args, expected", [
    (["--data", "no/such/file.txt"], "--data 'no/such/file.txt' does not exist"),
    (["--set", "model.num_layers=1"], "the model comes from the checkpoint"),
    (["--set", "train.global_batch_size=100000"], "fewer than one global batch"),
    (["--nproc", "2", "--set", "parallel.tp=3"], "does not divide world size 2"),
])
def test_mistakes_print_one_line_and_exit_2(run, capsys, args, expected):
    run_dir, _ = run
    assert main(["eval", "--checkpoint", str(run_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshlm eval: error: ") and expected in err[0], err


def test_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_human_output_names_the_model_and_the_data(run, capsys):
    run_dir, _ = run
    assert main(["eval", "--checkpoint", str(Path(run_dir))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"meshlm eval: {run_dir} (step 3) on the validation split of ")
    assert out[1].startswith("loss ") and "perplexity" in out[1]


def test_a_hugging_face_export_of_the_run_evaluates_the_same(run, tmp_path, capsys):
    pytest.importorskip("tokenizers", reason="the [hf] extra (tokenizers) is not installed")
    from meshlm import convert

    run_dir, corpus = run
    convert.to_hf(str(run_dir), str(tmp_path / "hf"), overwrite=False, dtype=None)
    ours = _eval_json(capsys, "--checkpoint", str(run_dir), "--data", str(corpus))
    # a Hugging Face directory has no run config: the sequence length and batch are set here
    theirs = _eval_json(capsys, "--hf", str(tmp_path / "hf"), "--data", str(corpus), "--set", "train.seq_len=32",
                        "--set", "train.global_batch_size=8")
    assert theirs["step"] is None and theirs["tokens"] == ours["tokens"]
    assert abs(theirs["loss"] - ours["loss"]) < 1e-5 * ours["loss"]  # fp32 (HF default) against the fp64 run


def test_the_runs_data_gone_asks_for_data(run, capsys):
    run_dir, corpus = run
    moved = corpus.rename(corpus.with_suffix(".moved"))
    try:
        assert main(["eval", "--checkpoint", str(run_dir)]) == 2
    finally:
        moved.rename(corpus)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(the run's data) does not exist here; pass --data PATH" in err[0], err


def test_validation_takes_one_pass_of_the_split_at_most(tmp_path):
    """Found by fuzzing: train.val_batches=1000000000 built the index of every repeated sample at once (256 GB) and
    died in a traceback; now a validation covers the split once, the loss that of exactly one pass."""
    corpus = write_corpus(tmp_path / "corpus.txt", 200)
    base = [*SMALL_MODEL, f"data.path={corpus}", "train.seq_len=32", "train.global_batch_size=4", "train.steps=1",
            "train.sample_tokens=0", "data.val_fraction=0.2", "train.precision=fp64", "train.device=cpu"]
    trainer = Trainer(load_config(overrides=[*base, f"train.run_dir={tmp_path / 'a'}", "train.val_batches=1000000000"]))
    once = -(-len(trainer.val_data) // 4)
    assert 1 < once < 1000
    exact = trainer.loss_totals(trainer.val_data, num_global_batches=once)
    assert trainer.evaluate() == pytest.approx(exact[0] / exact[1], rel=1e-12)
    assert exact[1] == len(trainer.val_data) * 32 + (once * 4 - len(trainer.val_data)) * 32  # the last batch wraps
