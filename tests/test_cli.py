"""The command line: help texts, one-line user errors with exit code 2, info, plan, and a tiny
train -> generate round trip through `meshlm.cli.main` (in process, to stay fast)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.cli import main


def test_help_is_instant_and_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "meshlm.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("train", "generate", "info", "plan", "serve"):
        assert command in out.stdout
    # `python -m meshlm` is the same command (for an environment whose scripts are not on PATH), exit code included
    run = subprocess.run([sys.executable, "-m", "meshlm", "plan", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("usage: meshlm plan"), run
    assert subprocess.run([sys.executable, "-m", "meshlm", "no-such-command"], capture_output=True).returncode == 2
    # --help must not pay for importing torch.
    probe = "import sys, meshlm.cli; meshlm.cli.build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`meshlm plan context ... | head -1`: the pipe closed before the command writes is one quiet exit 1, no
    traceback (the read end is closed before the child starts writing, so the write always fails)."""
    child = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "plan", "context", "--model", "llama3-8b",
                              "--cluster", "h100", "--context", "64K"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 1 and err == "", err


@pytest.mark.parametrize("override, expected", [
    ("model.num_heads=7", "model.num_heads=7 must divide model.hidden_size=256"),
    ("train.lr=-1", "train.lr=-1.0 must be > 0"),
    ("train.nope=1", "unknown key train.nope; valid keys in [train]:"),
    ("model.num_kv_heads=3", "model.num_kv_heads=3 must divide model.num_heads=4"),
    ("train.seq_len=100000", "train.seq_len=100000 must be <= model.max_seq_len=256"),
    ("parallel.collective_wait=block", "parallel.collective_wait='block' must be \"stream\""),
])
def test_bad_config_prints_one_line_and_exits_2(capsys, override, expected):
    assert main(["train", "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert expected in err


def test_srun_tasks_are_ranks_and_need_a_master_address(capsys, monkeypatch):
    # `srun -n 8 meshlm train` (one task per GPU, no torchrun): each task is one rank of 8. Without
    # MASTER_ADDR/MASTER_PORT it stops with one line saying what to export, before any work.
    from meshlm.distributed import read_launch_env

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert read_launch_env(slurm) == (5, 8, 1)
    assert read_launch_env({**slurm, "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}) == (2, 4, 2)  # torchrun wins
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "MASTER_ADDR" in err, err


def test_launch_exit_code_is_2_when_the_ranks_failed_on_a_user_mistake():
    from meshlm.launch import launch_exit_code

    # rank 0 raised a ValueError (exit 2); the launcher then stopped rank 1 with SIGTERM (-15)
    assert launch_exit_code([-15, 2]) == 2 and launch_exit_code([2]) == 2
    assert launch_exit_code([1, 2]) == 1 and launch_exit_code([-9]) == 1


def test_info_json_counts_parameters(capsys):
    assert main(["info", "--model", "llama3-8b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["params"]["total"] == 8_030_261_248  # Llama-3-8B, as published
    assert info["train_flops_per_token"] == 3 * info["forward_flops_per_token"]
    assert "params_with_latent_attention" not in info
    # meshlm's deepseek-v3 is GQA of its width (688B); with its latent attention, as the planner prices it, 671B
    assert main(["info", "--model", "deepseek-v3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["params"]["total"], info["params_with_latent_attention"]) == (688_268_342_272, 671_026_404_352)


def test_plan_estimate_json_keys(capsys):
    assert main(["plan", "estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8",
                 "--layout", "tp=2,dp_shard=4,zero_stage=1", "--seq-len", "4096",
                 "--global-batch-tokens", "1M", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    for key in ("fits", "memory_gib", "time_s", "mfu", "tokens_per_s", "tflops_per_gpu"):
        assert key in est
    assert "total" in est["memory_gib"] and "step" in est["time_s"]
    for sub in (["estimate", "--layout", "tp=1"], []):  # once "layout dp_shard=0 must be >= 1"
        assert main(["plan", *sub, "--model", "llama3-8b", "--gpus", "0", "--global-batch-tokens", "1M"]) == 2
        assert capsys.readouterr().err.strip() == "meshlm plan: error: --gpus 0 must be >= 1"


def test_train_then_generate_from_the_checkpoint(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    run_dir = tmp_path / "run"
    overrides = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
                 "model.intermediate_size=64", "train.seq_len=32", "train.global_batch_size=4",
                 "train.micro_batch_size=4", "train.steps=3", "train.val_interval=3", "train.sample_tokens=8",
                 "train.progress=false", f"train.run_dir={run_dir}", f"data.path={data}"]
    assert main(["train", *sum((["--set", o] for o in overrides), [])]) == 0
    assert "--- sample ---" in capsys.readouterr().out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(k in steps[0] for k in ("loss", "lr", "grad_norm", "tokens_per_s"))
    assert any("val_loss" in r for r in rows)

    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "def ", "--max-new-tokens", "0"]) == 2
    assert main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    # --chat: the prompt as a user's message (a system message first) through the chat template; the reply alone
    from meshlm.infer.llm import LLM
    from meshlm.infer.sequence import SamplingParams

    capsys.readouterr()
    chat = ["generate", "--checkpoint", str(run_dir), "--prompt", "def ", "--max-new-tokens", "5", "--chat"]
    assert main([*chat, "--system", "code"]) == 0
    want = LLM(str(run_dir)).chat([{"role": "system", "content": "code"}, {"role": "user", "content": "def "}],
                                  SamplingParams(temperature=0, max_tokens=5))[0].text
    assert capsys.readouterr().out == want + "\n"
    assert main([*chat[:-1], "--system", "code"]) == 2
    assert "--system is a chat's system message: give --chat with it" in capsys.readouterr().err


def test_serve_without_its_extra_names_it_in_one_line(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", "--model", "anything"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "uvicorn" in err[0] and "[serve]" in err[0], err


def test_train_ends_with_the_checkpoint_and_the_next_commands(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    sets = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
            "model.intermediate_size=64", "model.max_seq_len=32", "train.seq_len=16", "train.global_batch_size=2",
            "train.steps=1", "train.val_batches=0", "train.sample_tokens=0", "train.progress=false",
            "train.device=cpu", f"data.path={text_file}", f"train.run_dir={run}"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2] == f"checkpoint: {run / 'checkpoints' / 'step_000001'}", out[-2:]
    assert out[-1].startswith(f"next: meshlm generate --checkpoint {run}") and "meshlm serve --model" in out[-1]


def test_nproc_zero_is_refused_like_any_count_below_one(capsys, tmp_path):
    for bad in ("0", "-1"):
        assert main(["train", "--nproc", bad, "--set", f"train.run_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--nproc={bad} " in err and ">= 1" in err, err
    assert not (tmp_path / "run").exists()


def test_a_rank_takes_its_own_gpu_or_the_one_slurm_binds_to_its_task():
    from meshlm.distributed import cuda_device_index

    assert [cuda_device_index(r, 8) for r in range(8)] == list(range(8))  # torchrun: cuda:LOCAL_RANK
    assert [cuda_device_index(r, 1) for r in range(8)] == [0] * 8  # srun --gpus-per-task=1: each sees one
    with pytest.raises(ValueError, match="LOCAL_RANK=9 but only 8 CUDA devices"):
        cuda_device_index(9, 8)


def test_one_srun_task_per_node_with_nproc_is_an_agent_not_a_rank(capsys, monkeypatch):
    """examples/slurm.sbatch: `srun --ntasks-per-node=1 meshlm train --nnodes 2 --nproc 8 ...` on 2 nodes. Each task
    starts its node's ranks through torchrun; SLURM_NTASKS=2 must not make it one of 2 ranks (which refused --nproc)."""
    from meshlm.distributed import srun_agent

    agents = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NNODES": "2"}
    assert srun_agent(agents) and srun_agent({**agents, "SLURM_NNODES": "", "SLURM_JOB_NUM_NODES": "2"})
    assert not srun_agent({**agents, "SLURM_NTASKS": "16"})  # 8 tasks a node: ranks
    assert not srun_agent({**agents, "RANK": "1", "WORLD_SIZE": "16"})  # a rank torchrun started
    assert not srun_agent({})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for k, v in agents.items():
        monkeypatch.setenv(k, v)
    # taken as an agent, it reaches the launch's own check (here: no rendezvous endpoint), not "already one of 2"
    assert main(["train", "--nproc", "1", "--nnodes", "2", "--set", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--rdzv-endpoint" in err and "already one of" not in err, err
    # the same task without --nproc is one rank of 2 (one task per node, one GPU each)
    assert main(["train", "--set", "train.steps=1"]) == 2
    assert "MASTER_ADDR" in capsys.readouterr().err


def test_the_sbatch_example_resumes_only_when_there_is_a_checkpoint(tmp_path):
    """examples/slurm.sbatch run with stand-ins for srun and scontrol: the first submission starts fresh (no
    --resume, which would refuse an empty run directory), a later one resumes."""
    import os
    import stat
    import subprocess

    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", 'printf "%s\\n" "$@" > "$SRUN_ARGS"'), ("scontrol", "echo node1")):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/bash\n{body}\n")
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "meshlm",
           "SRUN_ARGS": str(tmp_path / "argv")}

    def submitted() -> list[str]:
        subprocess.run(["bash", str(root / "examples" / "slurm.sbatch"), "--set", "train.steps=3"], env=env,
                       cwd=tmp_path, check=True)
        return (tmp_path / "argv").read_text().split("\n")

    first = submitted()
    assert "--resume" not in first and "train.run_dir=runs/meshlm" in first and first[-2:] == ["train.steps=3", ""]
    (tmp_path / "runs" / "meshlm" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "meshlm" / "checkpoints" / "latest").write_text("step_000010")
    assert "--resume" in submitted()
