"""ZeRO-1/2 under the Trainer reproduce the single-process run (losses, grad norms, weights), move
exactly the padded flat-buffer bytes, hold 1/dp of the optimizer state, and checkpoint in the
unsharded per-parameter layout (bit-identical resume; a ZeRO-2 checkpoint resumes with zero_stage=0).

One launch per world size: each rank runs every configuration in turn. Steps are driven with
`Trainer.train_step()` so the communication of each step can be read from the mesh's CommStats.
"""

import contextlib
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist import run_distributed
from meshlm.config import TrainConfig, load_config
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.parallel.parallelize import check_layout
from meshlm.parallel.zero import apply_zero
from meshlm.train.optim import build_optimizer
from meshlm.train.trainer import Trainer
from runs import SMALL_MODEL

STEPS = 5
RESUME_AT = 3
TOL = 1e-5


def make_cfg(run_dir, text_file, *extra):
    return load_config(overrides=[*SMALL_MODEL, f"data.path={text_file}", f"train.run_dir={run_dir}",
                                  "train.progress=false", "train.seq_len=32", "train.global_batch_size=8",
                                  "train.micro_batch_size=8", f"train.steps={STEPS}", "train.warmup_steps=2",
                                  "train.lr=3e-3", "train.grad_clip=0.5", "train.val_batches=0",
                                  "data.val_fraction=0.1", "train.device=cpu", "parallel.bucket_size_mb=0.02",
                                  *extra])


def weights(trainer) -> dict:
    zero = trainer.parallel.zero
    with zero.full_params() if zero is not None else contextlib.nullcontext():  # ZeRO-3 frees them
        return {k: v.detach().clone() for k, v in trainer.base_model.state_dict().items()}


def run_steps(trainer, until: int) -> list[dict]:
    out = []
    while trainer.step < until:
        row = trainer.train_step()
        stats = trainer.mesh.stats
        # train_step's own metric reduction (the loss, over "dp") comes after; count only ZeRO's ops
        out.append({"loss": row["loss"], "grad_norm": row["grad_norm"],
                    "rs": stats.total(op="reduce_scatter", axis="dp_shard").bytes,
                    "ag": stats.total(op="all_gather", axis="dp_shard").bytes,
                    "ar_rep": stats.total(op="all_reduce", axis="dp_replicate").bytes})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    trainer = Trainer(make_cfg(tmp_path_factory.mktemp("ref") / "run", text_file))
    rows = run_steps(trainer, STEPS)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # parity is not trivial
    # clipping is active (grad_clip=0.5), so a wrong norm would change the weights too
    assert max(r["grad_norm"] for r in rows) > 0.5
    full_state = sum(2 * p.numel() * 4 for p in trainer.base_model.parameters())  # exp_avg + exp_avg_sq
    return {"rows": rows, "weights": weights(trainer), "numel": trainer.base_model.num_params(),
            "state_bytes": full_state}


def zero_worker(rank, world_size, root: Path, text_file: Path, configs: list[tuple], with_resume: bool):
    out = {}
    for stage, micro, extra in configs:
        key = (stage, micro, extra)
        trainer = Trainer(make_cfg(root / f"s{stage}m{micro}{extra}", text_file, f"parallel.zero_stage={stage}",
                                   f"train.micro_batch_size={micro}", *([extra] if extra else [])))
        zero = trainer.parallel.zero
        assert zero is not None and trainer.parallel.data_parallel is None
        rows = run_steps(trainer, STEPS)
        padded = [b.padded for b in zero.buckets]
        out[key] = {"rows": rows, "weights": weights(trainer), "padded": padded, "micro_steps": 8 // world_size // micro,
                    "bucket_numels": [b.numel for b in zero.buckets], "num_shards": zero.num_shards,
                    "state_bytes": trainer.optimizer.state_bytes(),
                    "grads_kept": any(p.grad is not None for p in trainer.base_model.parameters()),
                    "params_freed": all(p.untyped_storage().nbytes() == 0 for p in trainer.base_model.parameters())}
    if with_resume:
        # ZeRO-2, 2 accumulated micro-batches: 5 straight == 3 + save + resume + 2, bit for bit
        cfg = make_cfg(root / "split", text_file, "parallel.zero_stage=2", "train.micro_batch_size=2")
        trainer = Trainer(cfg)
        first = run_steps(trainer, RESUME_AT)
        trainer.save()
        dist.barrier()
        if rank == 0:  # for the parent: resume this ZeRO-2 checkpoint with zero_stage=0 on one process
            shutil.copytree(root / "split", root / "to_stage0")
        dist.barrier()
        resumed = Trainer(cfg, resume=True)
        assert resumed.step == RESUME_AT and resumed.resume_note is None
        rest = run_steps(resumed, STEPS)
        out["split"] = {"rows": first + rest, "weights": weights(resumed)}
        out["padding"] = padding_check(rank)
    return out


def padding_check(rank) -> dict:
    """A toy model whose sizes do not divide by 2: padded buckets, parity with torch AdamW."""
    mesh = build_mesh(ParallelDims(dp_shard=2).resolve(2), device_type="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))  # 15, 5, 5, 1 elements
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    zero = apply_zero(model, mesh, stage=2, bucket_size_mb=1 / 2**20)  # 1 byte: a bucket per tensor
    tcfg = TrainConfig(lr=0.1, weight_decay=0.5)
    opt = build_optimizer(model, tcfg, zero=zero)
    ref_model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), ref):
            p.copy_(r)
    ref_opt = build_optimizer(ref_model, tcfg)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    mesh.stats.reset()
    for _ in range(2):
        opt.zero_grad()
        model(x[rank * 2:rank * 2 + 2]).sum().backward()  # each rank half the batch: grads sum
        opt.step()
        ref_opt.zero_grad()
        ref_model(x).sum().backward()
        ref_opt.step()
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref_model.parameters()))
    return {"numels": [b.numel for b in zero.buckets], "padded": [b.padded for b in zero.buckets],
            "rs": mesh.stats.total(op="reduce_scatter", axis="dp_shard").bytes,
            "ag": mesh.stats.total(op="all_gather", axis="dp_shard").bytes, "diff": diff}


def check_parity(results, reference, configs):
    for stage, micro, extra in configs:
        key = (stage, micro, extra)
        for r, result in enumerate(results):
            got = result[key]
            for step, (row, want) in enumerate(zip(got["rows"], reference["rows"])):
                assert abs(row["loss"] - want["loss"]) <= TOL * abs(want["loss"]), (key, r, step, row, want)
                assert abs(row["grad_norm"] - want["grad_norm"]) <= TOL * want["grad_norm"], (key, r, step, row)
            for name, want in reference["weights"].items():
                diff = float((got["weights"][name] - want).abs().max())
                assert diff <= TOL, f"{key} rank {r} {name}: max |difference| {diff:.2e}"
            # exact bytes: one reduce-scatter and one all-gather of every padded bucket per step
            n = got["num_shards"]
            assert sum(got["bucket_numels"]) == reference["numel"]
            assert all(p == -(-b // n) * n for p, b in zip(got["padded"], got["bucket_numels"]))
            padded_bytes = 4 * sum(got["padded"])
            # ZeRO-3 gathers every unit's parameters for each micro-step's forward and backward instead
            gathers = 2 * got["micro_steps"] if stage == 3 else 1
            for row in got["rows"]:
                assert (row["rs"], row["ag"]) == (padded_bytes, gathers * padded_bytes), (key, row, padded_bytes)
                replicas = len(results) // n
                assert row["ar_rep"] == (padded_bytes // n if replicas > 1 else 0), (key, row)
            # optimizer state: 1/dp of the unsharded AdamW's, up to the padding
            assert got["state_bytes"] * n == reference["state_bytes"] + 8 * (sum(got["padded"]) - reference["numel"])
            # ZeRO-2/3 free the full gradients during backward; ZeRO-1 keeps them
            assert got["grads_kept"] == (stage == 1), key
            # ZeRO-3 frees the full parameters between uses
            assert got["params_freed"] == (stage == 3), key


def test_zero_dp2_matches_single_process_and_checkpoints(tmp_path, text_file, reference):
    configs = [(1, 4, ""), (2, 2, ""), (3, 2, "")]  # per-rank batch 4: one micro-batch; or 2 accumulated
    results = run_distributed(zero_worker, 2, tmp_path, text_file, configs, True, timeout=150)
    check_parity(results, reference, configs)

    for r, result in enumerate(results):
        straight = result[(2, 2, "")]
        assert [(x["loss"], x["grad_norm"]) for x in result["split"]["rows"]] == \
            [(x["loss"], x["grad_norm"]) for x in straight["rows"]], r
        for name, w in straight["weights"].items():
            assert torch.equal(w, result["split"]["weights"][name]), (r, name)

    pad = results[0]["padding"]
    assert pad["numels"] == [1, 5, 5, 15] and pad["padded"] == [2, 6, 6, 16]
    assert pad["rs"] == pad["ag"] == 2 * 4 * 30  # 2 steps x 30 padded fp32 elements
    assert pad["diff"] <= 1e-6

    # the ZeRO-2 dp=2 checkpoint (per-parameter layout) resumes in one process with zero_stage=0
    single = Trainer(make_cfg(tmp_path / "to_stage0", text_file), resume=True)
    assert single.step == RESUME_AT and single.parallel.zero is None
    row = run_steps(single, RESUME_AT + 1)[0]
    want = reference["rows"][RESUME_AT]["loss"]
    assert abs(row["loss"] - want) <= TOL * abs(want), (row, want)


def test_zero_dp4_and_hybrid_match_single_process(tmp_path, text_file, reference):
    # per-rank batch 2: one micro-batch, then 2 accumulated; hybrid: 2 replicas x 2 shards
    configs = [(1, 1, ""), (2, 2, ""), (3, 2, ""), (2, 1, "parallel.dp_replicate=2"),
               (3, 1, "parallel.dp_replicate=2")]
    results = run_distributed(zero_worker, 4, tmp_path, text_file, configs, False, timeout=180)
    check_parity(results, reference, configs)


def test_check_layout_accepts_every_zero_stage(tmp_path, text_file):
    for stage in (1, 2, 3):
        cfg = make_cfg(tmp_path, text_file, f"parallel.zero_stage={stage}", "train.micro_batch_size=4")
        assert check_layout(cfg, 2).dp == 2


@pytest.mark.parametrize("stage", [2, 3])
def test_plain_checkpoint_resumes_under_zero(tmp_path, text_file, reference, stage):
    # the other direction, in one process (dp_shard=1: ZeRO's shard is the whole flat buffer)
    plain = Trainer(make_cfg(tmp_path / "run", text_file))
    run_steps(plain, RESUME_AT)
    plain.save()
    zero = Trainer(make_cfg(tmp_path / "run", text_file, f"parallel.zero_stage={stage}"), resume=True)
    assert zero.step == RESUME_AT and zero.parallel.zero is not None
    for row, want in zip(run_steps(zero, STEPS), reference["rows"][RESUME_AT:]):
        assert abs(row["loss"] - want["loss"]) <= TOL * abs(want["loss"]), (row, want)
        assert abs(row["grad_norm"] - want["grad_norm"]) <= TOL * want["grad_norm"], (row, want)
