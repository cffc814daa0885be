"""What the trainer tests share: a small model, a small corpus, their configs, the weights a run ends
with, readers of metrics.jsonl, `meshlm train` runs on ranks started as torchrun would (`run_cli`), and the
moment a launched run's ranks are where a fault drill strikes (`ranks_when`)."""

import contextlib
import json
import os
import time
from pathlib import Path

from dist import run_distributed
from meshlm.cli import main as cli_main
from meshlm.processes import children, free_port

# 2 layers of width 32 with GQA (4 heads, 2 kv heads): 35k parameters, a step in milliseconds.
SMALL_MODEL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.intermediate_size=64", "model.max_seq_len=64"]


def write_corpus(path: Path, num_functions: int) -> Path:
    """A small, regular Python-like text: the loss falls quickly, so parity checks are not trivial."""
    path.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 3}\n\n" for i in range(num_functions)))
    return path


# What every trainer test's settings start from: the small model on a CPU, sequences of 32 tokens, 2 warm-up
# steps, a tenth of the corpus held out for validation.
TRAIN = [*SMALL_MODEL, "train.seq_len=32", "train.warmup_steps=2", "train.device=cpu", "data.val_fraction=0.1"]


def train_config(run_dir, text_file, *extra, settings, steps=None):
    """A trainer test's config: its file's `settings` (TRAIN and what the file adds), the corpus, the run
    directory (None: the default, or one in `extra`), `train.steps` when `steps` is given, then the
    test's `extra` (a later value of a field wins). A test file binds its settings once:
    `make_cfg = partial(train_config, settings=SETTINGS)`."""
    from meshlm.config import load_config

    run = [f"train.run_dir={run_dir}"] if run_dir is not None else []
    num_steps = [f"train.steps={steps}"] if steps is not None else []
    return load_config(overrides=[*settings, f"data.path={text_file}", *run, *num_steps, *extra])


def weights(trainer) -> dict:
    """Copies of the weights this rank holds (its own pieces where a strategy splits them)."""
    return {k: v.detach().clone() for k, v in trainer.base_model.state_dict().items()}


def gathered_weights(trainer) -> dict:
    """`weights`, with ZeRO-3's parameters gathered for the copy (it frees them between uses; collective)."""
    zero = trainer.parallel.zero
    with zero.full_params() if zero is not None else contextlib.nullcontext():
        return weights(trainer)


def full_weights(trainer) -> dict:
    """The single-device model's weights: ZeRO-3's parameters gathered, tp shards gathered (collective)."""
    from meshlm.parallel.tensor import full_state_dict

    zero = trainer.parallel.zero
    with zero.full_params() if zero is not None else contextlib.nullcontext():
        return full_state_dict(trainer.base_model, trainer.mesh)


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir) -> list[float]:
    return [r["loss"] for r in rows(run_dir) if "loss" in r]


def grad_norms(run_dir) -> list[float]:
    return [r["grad_norm"] for r in rows(run_dir) if "loss" in r]


def val_losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in rows(run_dir) if "val_loss" in r]


def train_ranks(rank, world_size, cfg):
    """One rank of a layout run as `meshlm train` runs it (for `verify.run(..., launch=harness_launch)`)."""
    from meshlm.train.trainer import Trainer

    Trainer(cfg).train()


def harness_launch(cfg, nproc):
    """`meshlm verify`'s launch seam through the test harness: faster than torch elastic's start-up."""
    from dist import run_distributed

    run_distributed(train_ranks, nproc, cfg, timeout=240)


def randomize_weights(model, seed: int) -> None:
    """Weights of a visible scale: a fresh Hugging Face model has zero biases and routers and near-uniform
    logits, which would hide a wrong mapping."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE",
              "TORCHELASTIC_USE_AGENT_STORE")


def cli_ranks(rank: int, world_size: int, runs: list[tuple[list[str], int]], store_path: str) -> list[float]:
    """One process of a launch that runs `meshlm train` once per (argv, ranks) of `runs`, in turn, on
    ranks 0..ranks-1 as torchrun would start them: each run makes (and tears down) its own process group
    on a fresh port. The other ranks wait; every rank waits for the run to end before the next starts.
    Returns how long each run took."""
    import torch.distributed as dist

    # init_distributed refuses to start a group while a default one exists: the harness's goes, and
    # a file store takes over sharing the ports and waiting between runs.
    dist.destroy_process_group()
    store = dist.FileStore(store_path, world_size)
    for name in LAUNCH_ENV:
        os.environ.pop(name, None)
    seconds = []
    for i, (argv, ranks) in enumerate(runs):
        t0 = time.perf_counter()
        if rank == 0:
            store.set(f"port{i}", str(free_port()))
        if rank < ranks:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                              LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=store.get(f"port{i}").decode())
            code = cli_main(argv)
            assert code == 0, f"rank {rank}: `meshlm {' '.join(argv)}` exited {code}"
        store.add(f"done{i}", 1)
        while int(store.add(f"done{i}", 0)) < world_size:
            time.sleep(0.01)
        seconds.append(time.perf_counter() - t0)
    return seconds


def run_cli(runs: list[tuple[list[str], int]], tmp_path: Path) -> list[float]:
    """`meshlm train ...` for each (argv, ranks) in turn; one-process runs in this process, consecutive
    multi-rank runs on one launch of the harness. Every rank must exit 0. Returns each run's seconds."""
    seconds = []
    i = 0
    while i < len(runs):
        argv, ranks = runs[i]
        if ranks == 1:
            t0 = time.perf_counter()
            assert cli_main(argv) == 0, argv
            seconds.append(time.perf_counter() - t0)
            i += 1
            continue
        j = i
        while j < len(runs) and runs[j][1] > 1:
            j += 1
        launch = runs[i:j]
        store = tmp_path / f"store{i}"
        seconds += run_distributed(cli_ranks, max(r for _, r in launch), launch, str(store), timeout=120)[0]
        i = j
    return seconds


def ranks_when(proc, ready, *, timeout_s: float, count: int = 2, every_s: float = 0.05) -> list[int]:
    """The process ids of launcher `proc`'s `count` ranks at the first poll (every `every_s`) where they all run and
    `ready()` holds -- the moment a fault drill stops or kills one; [] if the launcher exits or `timeout_s`
    passes first."""
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline:
        time.sleep(every_s)
        ranks = children(proc.pid)
        if len(ranks) == count and ready():
            return ranks
    return []
