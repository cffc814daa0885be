"""Checkpoint integrity, as a user meets it through `meshlm train` / `meshlm generate`.

Every damaged checkpoint is refused with exit code 2 and exactly one line on stderr that names the file
and the fix, no traceback, and nothing on disk changes. A damaged `latest` pointer makes `--resume` fall
back to the newest complete checkpoint (inference refuses it instead). No code in a checkpoint runs, on
inference, on --resume or on a restart; a fix named points at an intact checkpoint only; a crash during a save leaves the previous checkpoint loadable, and resuming from it ends
bit-identical to the uninterrupted run.

Two tiny runs are trained once per module (one checkpoint; two checkpoints) and copied for each test.
"""

import hashlib
import io
import json
import os
import pathlib
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshlm.cli import main as cli_main
from meshlm.config import load_config
from meshlm import checkpoint as ckpt
from meshlm.checkpoint import find as ckpt_find
from meshlm.checkpoint import save as ckpt_save
from runs import SMALL_MODEL, write_corpus

TINY = [*SMALL_MODEL, "train.progress=false", "train.seq_len=16", "train.global_batch_size=4", "train.steps=2",
        "train.warmup_steps=1", "train.val_batches=0", "train.sample_tokens=0", "train.device=cpu",
        "data.val_fraction=0.1"]
TWO = ["train.checkpoint_interval=1", "train.keep_checkpoints=2"]  # step_000001 and step_000002
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 200)


def train_argv(run_dir, text_file, *flags, extra=()) -> list[str]:
    sets = [*TINY, f"data.path={text_file}", f"train.run_dir={run_dir}", *extra]
    return ["train", *flags, *[a for s in sets for a in ("--set", s)]]


def generate_argv(path) -> list[str]:
    return ["generate", "--checkpoint", str(path), "--prompt", "def", "--max-new-tokens", "2"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones included) -> sha256; directories too, so a new empty one shows."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def one_line(capsys) -> str:
    """The single line the command wrote to stderr (and it is no traceback)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def refuses(capsys, argv, *wanted) -> str:
    code = cli_main(argv)
    line = one_line(capsys)
    assert code == 2, line
    for text in wanted:
        assert text in line, f"{text!r} not in: {line}"
    return line


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file) -> dict[str, Path]:
    """{"one": a run with step_000002 only, "two": the same run with step_000001 and step_000002}."""
    runs = {}
    for name, extra in (("one", ()), ("two", TWO)):
        run = tmp_path_factory.mktemp("trained") / name
        assert cli_main(train_argv(run, text_file, extra=extra)) == 0
        runs[name] = run
    return runs


def fresh(trained, kind, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained[kind], run)
    return run


def reseal(checkpoint: Path) -> None:
    """Rewrite the manifest to match the files as they are now: only the parser can stop them."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def garble(f: Path) -> None:
    f.write_bytes(bytes((b + 1) % 256 for b in f.read_bytes()))  # same size, every byte different


NO_OLDER = "start afresh (--overwrite) or restore the file from a copy"
# (what is damaged, how, what the line names: the file, the fix)
DAMAGE = {
    "truncated shard": (lambda c: truncate(c / "__0_0.distcp"), ["__0_0.distcp", "truncated", NO_OLDER]),
    "garbage shard": (lambda c: garble(c / "__0_0.distcp"), ["__0_0.distcp", "checksum", NO_OLDER]),
    "missing shard": (lambda c: (c / "__0_0.distcp").unlink(), ["__0_0.distcp is missing", NO_OLDER]),
    "missing rank file": (lambda c: (c / "rank_00000.json").unlink(), ["rank_00000.json is missing", NO_OLDER]),
    "truncated .metadata": (lambda c: truncate(c / ".metadata"), [".metadata has", "truncated", NO_OLDER]),
    "truncated meta.json": (lambda c: truncate(c / "meta.json"), ["meta.json has", "truncated", NO_OLDER]),
    "garbage meta.json": (lambda c: garble(c / "meta.json"), ["meta.json does not match", NO_OLDER]),
    "garbage manifest": (lambda c: garble(c / "manifest.json"), ["manifest.json is corrupt", NO_OLDER]),
    "missing safetensors": (lambda c: (c / "model_rank_00000.safetensors").unlink(),
                            ["model_rank_00000.safetensors is missing", NO_OLDER]),
    # No complete checkpoint left: --resume has nothing to fall back to.
    "missing manifest": (lambda c: (c / "manifest.json").unlink(),
                         ["no complete checkpoint", "manifest.json", "step_000002", "--overwrite"]),
    "missing manifest, garbage latest": (
        lambda c: ((c / "manifest.json").unlink(), (c.parent / "latest").write_bytes(b"\x80\x04garbage")),
        ["no complete checkpoint", "manifest.json", "step_000002", "--overwrite"]),
    "missing manifest, missing latest": (
        lambda c: ((c / "manifest.json").unlink(), (c.parent / "latest").unlink()),
        ["no complete checkpoint", "manifest.json", "step_000002", "--overwrite"]),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_checkpoint_is_refused_with_one_line_and_nothing_changes(trained, text_file, tmp_path, capsys, what):
    run = fresh(trained, "one", tmp_path)
    damage, wanted = DAMAGE[what]
    damage(run / "checkpoints" / "step_000002")
    before = snapshot(run)
    refuses(capsys, train_argv(run, text_file, "--resume"), *wanted)
    assert snapshot(run) == before
    # Inference refuses it as well (it verifies the whole checkpoint); the fix it names may differ.
    file_named = next(w for w in wanted if "." in w).split()[0]  # the file the line names
    refuses(capsys, generate_argv(run), file_named)
    assert snapshot(run) == before


def test_a_different_model_config_is_refused(trained, text_file, tmp_path, capsys):
    run = fresh(trained, "one", tmp_path)
    before = snapshot(run)
    refuses(capsys, train_argv(run, text_file, "--resume", extra=["model.num_layers=3"]),
            "step_000002 (meta.json)", "model.num_layers: checkpoint 2, now 3", "--set model.num_layers=2")
    assert snapshot(run) == before


def test_the_fix_names_the_older_checkpoint_and_works(trained, text_file, tmp_path, capsys):
    run = fresh(trained, "two", tmp_path)
    root = run / "checkpoints"
    truncate(root / "step_000002" / "__0_0.distcp")
    before = snapshot(run)
    fix = "resume from step_000001 instead (write step_000001 into"
    refuses(capsys, train_argv(run, text_file, "--resume", extra=TWO), "__0_0.distcp", fix)
    line = refuses(capsys, generate_argv(run), "__0_0.distcp", f"use the earlier checkpoint {root / 'step_000001'}")
    assert "resume" not in line  # inference is no resume
    assert snapshot(run) == before
    shard = "step_000002/__0_0.distcp"
    shutil.copyfile(trained["two"] / "checkpoints" / shard, root / shard)  # mend it, then damage a rank file
    garble(root / "step_000002" / "rank_00000.json")  # same size: only the checksum finds it
    before = snapshot(run)
    refuses(capsys, train_argv(run, text_file, "--resume", extra=TWO), "rank_00000.json", "checksum", fix)
    assert snapshot(run) == before
    # Following the fix continues the run: step 2 is trained again and replaces the damaged copy.
    (root / "latest").write_text("step_000001")
    assert cli_main(train_argv(run, text_file, "--resume", extra=TWO)) == 0
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert_same_weights(root / "step_000002", trained["two"] / "checkpoints" / "step_000002")


def test_the_fix_never_names_a_damaged_checkpoint(trained, text_file, tmp_path, capsys):
    """Both checkpoints damaged: no line points at the older one (it is checked, checksums included)."""
    run = fresh(trained, "two", tmp_path)
    root = run / "checkpoints"
    truncate(root / "step_000002" / "__0_0.distcp")
    garble(root / "step_000001" / "rank_00000.json")  # same size: only its checksum shows it
    before = snapshot(run)
    for argv, fix in ((train_argv(run, text_file, "--resume", extra=TWO), NO_OLDER),
                      (generate_argv(run), "no intact earlier checkpoint is left: restore the file from a copy")):
        line = refuses(capsys, argv, "step_000002/__0_0.distcp", fix)
        assert "step_000001" not in line, line
    assert "resume" not in line and "--overwrite" not in line  # what generate says
    assert snapshot(run) == before


def test_convert_errors_never_say_resume(trained, tmp_path, capsys):
    """`meshlm convert` of a damaged checkpoint names a fix a converter can take (no --resume, no --overwrite)."""
    run = fresh(trained, "two", tmp_path)
    root = run / "checkpoints"
    garble(root / "step_000002" / "model_rank_00000.safetensors")
    code = cli_main(["convert", str(root / "step_000002"), "--to-hf", str(tmp_path / "out")])
    line = one_line(capsys)
    assert code == 2 and "model_rank_00000.safetensors" in line, line
    assert f"use the earlier checkpoint {root / 'step_000001'}" in line and "resume" not in line, line


@pytest.mark.parametrize("pointer", ["garbage", "missing", "incomplete"])
def test_damaged_latest_resumes_from_the_newest_complete_checkpoint(trained, text_file, tmp_path, capsys, pointer):
    run = fresh(trained, "two", tmp_path)
    latest = run / "checkpoints" / "latest"
    if pointer == "garbage":
        latest.write_bytes(os.urandom(40))
    elif pointer == "missing":
        latest.unlink()
    else:
        latest.write_text("step_000002.tmp")
    before = snapshot(run / "checkpoints")
    # Inference is strict: it names the pointer and the newest complete checkpoint.
    refuses(capsys, generate_argv(run), str(latest), "newest intact checkpoint is step_000002")
    assert cli_main(train_argv(run, text_file, "--resume", extra=TWO)) == 0
    out = capsys.readouterr().out
    assert "resuming from the newest complete checkpoint, step_000002" in out and str(latest) in out, out
    assert snapshot(run / "checkpoints") == before  # at step 2 of 2 already: nothing trained, nothing saved


# -- a crash during a save ---------------------------------------------------------------------------


def assert_same_weights(a: Path, b: Path) -> None:
    got, want = load_file(str(a / "model_rank_00000.safetensors")), load_file(str(b / "model_rank_00000.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("left", ["tmp dir", "published without manifest"])
def test_a_crash_during_a_save_resumes_from_the_previous_checkpoint_bit_identically(trained, text_file, tmp_path,
                                                                                     capsys, left):
    run = fresh(trained, "two", tmp_path)
    root = run / "checkpoints"
    if left == "tmp dir":  # killed while the ranks were writing step 2: latest still names step 1
        (root / "step_000002").rename(root / "step_000002.tmp")
        for name in ("manifest.json", "meta.json", "model_rank_00000.safetensors"):
            (root / "step_000002.tmp" / name).unlink()
        truncate(root / "step_000002.tmp" / "__0_0.distcp")
        (root / "latest").write_text("step_000001")
    else:  # a filesystem that lost the manifest of the published step 2 (latest names it)
        (root / "step_000002" / "manifest.json").unlink()
    assert cli_main(train_argv(run, text_file, "--resume", extra=TWO)) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_000001 at step 1" in out, out
    assert ("newest complete checkpoint, step_000001" in out) == (left != "tmp dir"), out
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert (root / "latest").read_text().strip() == "step_000002"
    assert_same_weights(root / "step_000002", trained["two"] / "checkpoints" / "step_000002")


def test_publishing_a_step_again_keeps_the_old_copy_until_latest_names_the_new_one(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    cfg = load_config()

    def save(version):
        return ckpt.save_checkpoint(tmp_path, step=5, model=model, optimizer=optimizer, config=cfg,
                                    rank_extra={"version": version}, keep=1)

    final = save(1)
    root = final.parent
    seen = []
    write_atomic = ckpt_save.write_atomic

    def crash_at_latest(path, text):
        seen.append((path.name, text, sorted(p.name for p in root.iterdir()),
                     json.loads((root / "step_000005.old" / "rank_00000.json").read_text()),
                     json.loads((final / "rank_00000.json").read_text())))
        raise OSError("killed")

    monkeypatch.setattr(ckpt_save, "write_atomic", crash_at_latest)
    with pytest.raises(OSError, match="killed"):
        save(2)
    # When latest was about to be replaced, the new copy was complete in place and the old one set aside.
    assert seen == [("latest", "step_000005", ["latest", "step_000005", "step_000005.old"],
                     {"version": 1}, {"version": 2})]
    assert (root / "step_000005.old" / "manifest.json").is_file()  # a crash there leaves the old copy on disk
    monkeypatch.setattr(ckpt_save, "write_atomic", write_atomic)
    save(3)  # the next save of that step completes: the old copy is removed only after latest is written
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000005"]
    assert json.loads((final / "rank_00000.json").read_text()) == {"version": 3}
    ckpt.verify_checkpoint(final)


def test_a_resume_hashes_the_checkpoint_once_per_rank(trained, tmp_path, monkeypatch, text_file):
    """check_run_dir verifies the checksums; the trainer's load then checks presence and sizes only."""
    from meshlm.train.trainer import Trainer

    run = fresh(trained, "one", tmp_path)
    hashed = []
    real_sha256 = ckpt_find.sha256_file
    monkeypatch.setattr(ckpt_find, "sha256_file", lambda f: hashed.append(f.name) or real_sha256(f))
    cfg = load_config(overrides=[*TINY, f"data.path={text_file}", f"train.run_dir={run}", "train.steps=3"])
    Trainer(cfg, resume=True)
    assert sorted(hashed) == sorted(set(hashed)), hashed  # every file once


# -- no code runs from a checkpoint ----------------------------------------------------------------


class Plant:
    """A harmless pickle payload: unpickling it creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_pickle_planted_in_a_checkpoint_never_runs(trained, text_file, tmp_path, capsys):
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Plant(probe)))
    assert probe.exists()  # the payload works when unpickled
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Plant(marker))

    # (a) as a rank file, the manifest resealed to match: inference never reads it, --resume parses it as
    # JSON (before DCP reads anything) and refuses.
    run = fresh(trained, "one", tmp_path / "a")
    checkpoint = run / "checkpoints" / "step_000002"
    (checkpoint / "rank_00000.json").write_bytes(payload)
    reseal(checkpoint)
    assert cli_main(generate_argv(run)) == 0
    capsys.readouterr()
    refuses(capsys, train_argv(run, text_file, "--resume"), "rank_00000.json is not the JSON meshlm writes")
    assert not marker.exists()

    # (b) as DCP's .metadata (a pickle by design), resealed: inference reads safetensors + JSON only, and
    # `--resume` unpickles it admitting only DCP's metadata classes: refused in one line, the payload never runs.
    run = fresh(trained, "one", tmp_path / "b")
    checkpoint = run / "checkpoints" / "step_000002"
    (checkpoint / ".metadata").write_bytes(payload)
    reseal(checkpoint)
    assert cli_main(generate_argv(run)) == 0
    assert cli_main(generate_argv(checkpoint)) == 0
    capsys.readouterr()
    before = snapshot(run)
    refuses(capsys, train_argv(run, text_file, "--resume"), ".metadata is refused", "pathlib.Path.touch", NO_OLDER)
    assert not marker.exists() and snapshot(run) == before


def test_a_planted_pickle_never_runs_on_an_automatic_restart(trained, text_file, tmp_path, capsys, monkeypatch):
    """The launcher restarted the ranks (TORCHELASTIC_RESTART_COUNT): they resume by themselves from the
    newest checkpoint -- the same reading as --resume, so a planted .metadata is refused there too."""
    import meshlm.distributed

    marker = tmp_path / "pwned"
    run = fresh(trained, "one", tmp_path)
    checkpoint = run / "checkpoints" / "step_000002"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Plant(marker)))
    reseal(checkpoint)
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a rank of a one-rank launch, restarted once
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(meshlm.distributed, "exit_with_parent", lambda: None)  # not for the test process
    refuses(capsys, train_argv(run, text_file), ".metadata is refused")
    assert not marker.exists()


def test_a_pickle_planted_in_dcp_values_never_runs(trained, text_file, tmp_path, capsys):
    """DCP stores plain values (the optimizer's hyperparameters) with torch.save and its planner reads them
    with the full unpickler: a genuine-looking .metadata (only DCP's classes) pointing one of them at a
    planted pickle is refused when it is read (weights_only), and the payload never runs."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    marker = tmp_path / "pwned"
    run = fresh(trained, "one", tmp_path)
    checkpoint = run / "checkpoints" / "step_000002"
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # genuine: written by the run above
    planted = io.BytesIO()
    torch.save(Plant(marker), planted)
    shard = checkpoint / "__0_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(planted.getvalue())
    index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
    metadata.storage_data[index] = _StorageInfo(relative_path="__0_0.distcp", offset=offset,
                                                length=len(planted.getvalue()))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(checkpoint)
    refuses(capsys, train_argv(run, text_file, "--resume"), "cannot be loaded", "param_groups.0.lr")
    assert not marker.exists()


def test_inference_reads_only_the_files_the_manifest_lists(trained, tmp_path, capsys):
    run = fresh(trained, "one", tmp_path)
    checkpoint = run / "checkpoints" / "step_000002"
    weights = load_file(str(checkpoint / "model_rank_00000.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in weights.items()}, str(checkpoint / "model_rank_00009.safetensors"))
    (checkpoint / "tokenizer.json").write_text("{}")  # not a tokenizer: reading it would fail
    model, _, _ = ckpt.load_checkpoint_for_inference(run)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert cli_main(generate_argv(run)) == 0


# -- fresh run, --overwrite, --resume ----------------------------------------------------------------


def test_fresh_run_overwrite_and_resume_semantics(trained, text_file, tmp_path, capsys):
    run = fresh(trained, "one", tmp_path)
    before = snapshot(run)
    refuses(capsys, train_argv(run, text_file), f"train.run_dir={str(run)!r}", "--overwrite", "--resume",
            "newest: step_000002")
    refuses(capsys, train_argv(run, text_file, "--resume", "--overwrite"), "--resume", "--overwrite", "pass one")
    assert snapshot(run) == before
    # --overwrite replaces the earlier run (a 1-step run now: its step_000002 is gone).
    assert cli_main(train_argv(run, text_file, "--overwrite", extra=["train.steps=1"])) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000001"

    # What a crash during the first save leaves: not resumable, so only --overwrite is offered.
    partial = tmp_path / "partial"
    (partial / "checkpoints" / "step_000001.tmp").mkdir(parents=True)
    line = refuses(capsys, train_argv(partial, text_file), "no complete checkpoint: step_000001.tmp", "--overwrite")
    assert "--resume" not in line

    empty = tmp_path / "empty"
    empty.mkdir()
    refuses(capsys, train_argv(empty, text_file, "--resume"), "--resume", str(empty / "checkpoints"),
            "holds no checkpoint", "without --resume")
    assert list(empty.iterdir()) == []
    refuses(capsys, train_argv(tmp_path / "nowhere", text_file, "--resume"), "holds no checkpoint")
    assert not (tmp_path / "nowhere").exists()


def test_overwrite_deletes_only_what_meshlm_wrote(trained, text_file, tmp_path, capsys):
    """--overwrite removes step_N directories and `latest`; anything else in checkpoints/ is refused, by name,
    before any work (and nothing is deleted); files beside checkpoints/ stay."""
    run = fresh(trained, "two", tmp_path)
    root = run / "checkpoints"
    (root / "notes.txt").write_text("mine")
    (root / "best").mkdir()
    (root / "best" / "weights.bin").write_bytes(b"x")
    (run / "README").write_text("mine too")
    before = snapshot(run)
    for flags in (("--overwrite",), ()):
        refuses(capsys, train_argv(run, text_file, *flags), "meshlm did not write (best, notes.txt)", "move them")
        assert snapshot(run) == before
    shutil.rmtree(root / "best")
    (root / "notes.txt").unlink()
    (root / "step_000003.tmp").mkdir()  # a save cut short: meshlm's own, deleted too
    assert cli_main(train_argv(run, text_file, "--overwrite", extra=["train.steps=1"])) == 0
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert (run / "README").read_text() == "mine too"


# -- several ranks -----------------------------------------------------------------------------------


@pytest.fixture
def launcher_in_process(monkeypatch):
    """`meshlm train --nproc` run in this process: no launcher variables in, none of its state left behind
    (torch's elastic agent installs handlers for these signals and records them in the environment)."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")  # its default
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


def test_two_ranks_refuse_a_damaged_checkpoint(tmp_path, text_file, capfd, launcher_in_process):
    run = tmp_path / "run"
    assert cli_main(train_argv(run, text_file, "--nproc", "2")) == 0
    checkpoint = run / "checkpoints" / "step_000002"
    assert sorted(p.name for p in checkpoint.glob("rank_*.json")) == ["rank_00000.json", "rank_00001.json"]
    capfd.readouterr()
    intact = (checkpoint / "rank_00001.json").read_bytes()

    def refused(*wanted, extra=()):
        before = snapshot(run)
        code = cli_main(train_argv(run, text_file, "--resume", "--nproc", "2", extra=extra))
        err = capfd.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert all(w in lines[0] for w in wanted), err
        assert snapshot(run) == before

    # The launcher checks the checkpoint (and the model config) before it starts any rank: one line, once.
    (checkpoint / "rank_00001.json").unlink()
    refused("rank_00001.json is missing", NO_OLDER)
    (checkpoint / "rank_00001.json").write_bytes(intact)
    garble(checkpoint / "rank_00001.json")  # same size: only the checksum finds it
    refused("rank_00001.json does not match its checksum", NO_OLDER)
    (checkpoint / "rank_00001.json").write_bytes(b"\x80\x04 not JSON")
    reseal(checkpoint)  # intact as far as the manifest knows: the launcher parses every rank's file too
    refused("rank_00001.json is not the JSON meshlm writes", NO_OLDER)
    (checkpoint / "rank_00001.json").write_bytes(intact)
    reseal(checkpoint)
    refused("model.num_layers: checkpoint 2, now 3", extra=["model.num_layers=3"])
    # Mended, it resumes on both ranks (which take the launcher's verdict on the checksums).
    assert cli_main(train_argv(run, text_file, "--resume", "--nproc", "2")) == 0
    assert "resumed from" in capfd.readouterr().out


def resume_rank(rank, world_size, run, text_file):
    """One rank resuming `run` under torchrun-like start (no launcher pre-check): its refusal, or None."""
    from meshlm.train.trainer import Trainer

    cfg = load_config(overrides=[*TINY, f"data.path={text_file}", f"train.run_dir={run}", "train.steps=3"])
    hashed = []
    real = ckpt_find.sha256_file
    ckpt_find.sha256_file = lambda f: hashed.append(f.name) or real(f)
    try:
        Trainer(cfg, resume=True)
    except ckpt.CheckpointError as e:
        return str(e), hashed
    return None, hashed


def test_ranks_share_the_checksums_and_all_refuse_what_one_found(trained, tmp_path, text_file):
    from dist import run_distributed

    run = fresh(trained, "one", tmp_path)
    checkpoint = run / "checkpoints" / "step_000002"
    listed = sorted(json.loads((checkpoint / "manifest.json").read_text())["files"])
    (error0, hashed0), (error1, hashed1) = run_distributed(resume_rank, 2, run, text_file)
    assert error0 is None and error1 is None
    assert sorted(hashed0 + hashed1) == listed and not set(hashed0) & set(hashed1)  # each file once, in all
    victim = listed[1]  # hashed by rank 1 only
    garble(checkpoint / victim)
    (error0, _), (error1, _) = run_distributed(resume_rank, 2, run, text_file)
    assert error0 == error1 and victim in error0 and "checksum" in error0, (error0, error1)
