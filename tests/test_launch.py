"""`meshlm train --nproc N` through PyTorch's elastic launcher, as a user runs it: subprocesses.

Each launch imports torch in the launcher and in every rank (seconds each on a shared machine), so
the file keeps to three launches: 4 ranks, two agents of one rank each acting as two nodes, a bad layout.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.processes import free_port

# train.micro_batch_size is left at its default (the whole per-rank batch), as `meshlm train --nproc N`
# in the README does: the same settings must run on 2 (two agents) and on 4 ranks.
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.intermediate_size=64", "model.max_seq_len=64", "train.progress=false", "train.seq_len=32",
        "train.global_batch_size=8", "train.steps=3", "train.val_batches=1",
        "train.val_interval=3", "train.sample_tokens=0", "train.device=cpu", "data.val_fraction=0.1"]
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 3}\n\n" for i in range(200)))
    return path


def train_command(run_dir, text_file, *flags, overrides=()) -> list[str]:
    sets = [*TINY, f"data.path={text_file}", f"train.run_dir={run_dir}", *overrides]
    return [sys.executable, "-m", "meshlm.cli", "train", *flags, *[a for s in sets for a in ("--set", s)]]


def clean_env() -> dict:
    """This test process may itself run under a launcher; the command must not think it is a rank."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}


def check_one_run(run_dir: Path, world_size: int, output: str) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3], output  # rank 0 alone logs: no duplicated rows
    assert all(sum(r["comm_mb"].values()) > 0 for r in rows if "loss" in r)  # dp, or dp_shard under ZeRO
    checkpoint = run_dir / "checkpoints" / "step_000003"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    assert sorted(p.name for p in checkpoint.glob("rank_*.json")) == [f"rank_{r:05d}.json" for r in range(world_size)]


def test_nproc_launches_local_ranks(tmp_path, text_file):
    """`--nproc 4`: hybrid ZeRO-3 (2 replicas x 2 shards), ending with the sample every rank must take part in.
    (Two ranks of plain data parallelism go through the same launcher in `test_two_agents_act_as_two_nodes`.)"""
    run_dir, temp = tmp_path / "run", tmp_path / "tmp"
    temp.mkdir()  # the launch's temporary directory: the launcher's logs go there, and are gone after it
    overrides = ("parallel.dp_replicate=2", "parallel.zero_stage=3", "train.sample_tokens=8")
    proc = subprocess.run(train_command(run_dir, text_file, "--nproc", "4", overrides=overrides),
                          capture_output=True, text=True, timeout=240, env={**clean_env(), "TMPDIR": str(temp)})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "meshlm: 4 ranks" in proc.stdout
    assert "--- sample ---" in proc.stdout
    check_one_run(run_dir, 4, output)
    assert not [p.name for p in temp.iterdir() if p.name.startswith(("torchelastic_", "meshlm-launch-"))]


def test_two_agents_act_as_two_nodes(tmp_path, text_file):
    run_dir = tmp_path / "run"  # both "nodes" share this filesystem, as a cluster's nodes would
    flags = ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "t"]
    agents = [subprocess.Popen(train_command(run_dir, text_file, *flags), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=clean_env()) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=240)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    output = "\n----- agent 2 -----\n".join(outputs)
    assert [a.returncode for a in agents] == [0, 0], output
    assert output.count("meshlm: 2 ranks") == 1, output  # one run of 2 ranks, logged once
    check_one_run(run_dir, 2, output)


def test_bad_layout_exits_2_with_one_line_before_any_rank_starts(tmp_path, text_file):
    proc = subprocess.run(train_command(tmp_path / "run", text_file, "--nproc", "4",
                                        overrides=["parallel.tp=3"]),
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tp=3" in lines[0] and "world size 4" in lines[0] and "choose tp in" in lines[0], \
        proc.stderr
    assert not (tmp_path / "run").exists()
