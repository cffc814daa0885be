"""The README's "Quick tour", run end to end: every `meshlm ...` command of its ```bash blocks, read from the
README itself (so the tour cannot drift from what works), in a fresh directory.

Two changes only, both for the test's sake: `meshlm train` gets overrides that make it a small model on a
small corpus for a few steps (seconds instead of minutes; the later commands then use that run as written),
and `meshlm serve` gets a free --port (and is stopped after the README's own `curl` request). A command whose
extra is not installed is skipped, and the skip names the extra.
"""

import contextlib
import importlib.util
import io
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.processes import free_port
from runs import SMALL_MODEL, write_corpus

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"plot": ("plot", ["matplotlib"]), "serve": ("serve", ["fastapi", "uvicorn"])}


def tour_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Quick tour")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def bash_lines(section: str) -> list[str]:
    """The lines of the section's ```bash blocks, with backslash continuations joined."""
    lines, inside, pending = [], False, ""
    for line in section.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            lines.append(pending.strip())
            pending = ""
    return lines


COMMANDS = [line for line in bash_lines(tour_section()) if line.startswith("meshlm ")]
FAST_TRAIN = [*SMALL_MODEL, "model.max_seq_len=128", "train.seq_len=32", "train.global_batch_size=4",
              "train.steps=4", "train.val_interval=2", "train.val_batches=1", "train.sample_tokens=16",
              "train.warmup_steps=1", "data.val_fraction=0.1", "train.device=cpu"]


def argv(command: str) -> list[str]:
    return shlex.split(command, comments=True)[1:]


def run_main(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """A fresh directory where the tour's `meshlm train` has run (with FAST_TRAIN); its output."""
    root = tmp_path_factory.mktemp("tour")
    corpus = write_corpus(root / "corpus.txt", 400)
    train = argv(COMMANDS[0])
    assert train[0] == "train", COMMANDS[0]
    previous = os.getcwd()
    os.chdir(root)  # the tour's paths (runs/default, loss.png) are relative; each test goes back there
    try:
        code, out, err = run_main([*train, *[a for o in [*FAST_TRAIN, f"data.path={corpus}"] for a in ("--set", o)]])
    finally:
        os.chdir(previous)
    assert code == 0, err
    return root, out


def test_the_tour_goes_train_plot_generate_eval_serve_plan():
    assert [argv(c)[0] for c in COMMANDS] == ["train", "plot", "generate", "eval", "serve", "plan"], COMMANDS


def test_train_leaves_a_checkpoint_and_says_what_to_run_next(tour):
    root, out = tour
    assert (root / "runs" / "default" / "checkpoints" / "latest").exists()
    assert "--- sample ---" in out
    last = out.strip().splitlines()[-1]
    for command in ("generate", "eval", "serve"):
        assert f"meshlm {command}" in last, last


def _skip_without_extra(command: str) -> None:
    name = argv(command)[0]
    if name in EXTRAS:
        extra, modules = EXTRAS[name]
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"`{command}` needs the [{extra}] extra ({', '.join(missing)} not installed)")


@pytest.mark.parametrize("command", [c for c in COMMANDS if argv(c)[0] not in ("train", "serve")],
                         ids=lambda c: argv(c)[0])
def test_tour_command(tour, command, monkeypatch):
    _skip_without_extra(command)
    root, _ = tour
    monkeypatch.chdir(root)  # where the tour's `meshlm train` ran: its paths (runs/default, loss.png) are relative
    code, out, err = run_main(argv(command))
    assert code == 0, f"`{command}` exited {code}: {err}"
    name = argv(command)[0]
    if name == "plot":
        png = root / argv(command)[argv(command).index("--out") + 1]
        assert png.read_bytes()[:4] == b"\x89PNG" and out.startswith(f"wrote {png.name}")
    elif name == "generate":
        prompt = argv(command)[argv(command).index("--prompt") + 1]
        assert out.startswith(prompt) and len(out.strip()) > len(prompt)
    elif name == "eval":
        assert out.splitlines()[1].startswith("loss ") and "perplexity" in out
    elif name == "plan":  # (its wording is the planner's; the tour only needs it to answer)
        assert argv(command)[argv(command).index("--model") + 1] in out


def test_serve_answers_the_tours_request(tour):
    command = next(c for c in COMMANDS if argv(c)[0] == "serve")
    _skip_without_extra(command)
    root, _ = tour
    curl = shlex.split(next(line for line in bash_lines(tour_section()) if line.startswith("curl ")), comments=True)
    body = json.loads(curl[curl.index("-d") + 1])
    path = urllib.parse.urlsplit(next(a for a in curl if a.startswith("http://"))).path
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "meshlm.cli", *argv(command), "--port", str(port)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "meshlm serve did not come up in 120 s"
                time.sleep(0.3)
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert answer["model"] == body["model"] and isinstance(answer["choices"][0]["text"], str)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
