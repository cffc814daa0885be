"""Pipeline parallelism x ZeRO-3 under the Trainer reproduces the single-process Trainer.

fp64 parity (tests/parity.py, FP64_TOL): losses, grad norms and every weight after 3 steps, for
pp=2 x dp_shard=2 x ZeRO-3 under each schedule (gpipe, 1f1b, interleaved with 2 chunks, zero_bubble, also
with full recomputation) with parallel.zero3_reshard_after_forward unset (false under pp), true and false, and for
pp=2 x tp=2 x dp_shard=2 at 8 ranks. The parameter all-gathers of every step over "dp_shard" are
counted exactly against zero.py's formulas (per rank: reshard true, m x (2 x the stage's block units
+ its root unit, once more unless it holds just the embedding); false, every unit once), the most
units full at once (resharding: 2, a unit and its prefetched successor; keeping: all of the stage's),
and every parameter is freed between steps. The pp=2 ZeRO-3 checkpoint (each stage's flat shards) reloads in
one process and continues like the single-process run.
One launch per world size; each rank trains every configuration in turn.
"""

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch.distributed as dist

from dist import run_distributed
from meshlm.parallel.parallelize import check_layout
from meshlm.train.trainer import Trainer
from parity import FP64_TOL, assert_close_seq, assert_state_close
from runs import TRAIN, full_weights, gathered_weights, train_config

STEPS = 3
GLOBAL_BATCH = 8
RESHARD = "parallel.zero3_reshard_after_forward"
# (name, overrides) at 4 ranks (pp=2 x dp_shard=2) and 8 (pp=2 x tp=2 x dp_shard=2)
LAYOUTS = {
    4: [("gpipe", ["parallel.pp_schedule=gpipe"]),  # unset: false under pp
        ("1f1b_reshard", ["parallel.pp_schedule=1f1b", f"{RESHARD}=true"]),
        ("interleaved_reshard", ["parallel.pp_schedule=interleaved", "parallel.pp_chunks=2", f"{RESHARD}=true"]),
        ("interleaved_keep", ["parallel.pp_schedule=interleaved", "parallel.pp_chunks=2", f"{RESHARD}=false"]),
        ("zero_bubble_reshard", ["parallel.pp_schedule=zero_bubble", f"{RESHARD}=true"]),
        ("zero_bubble_keep", ["parallel.pp_schedule=zero_bubble", f"{RESHARD}=false"]),
        # full recomputation: W walks the chunk's chain again (SplitBackward's fallback) and gathers again
        ("zero_bubble_full_reshard", ["parallel.pp_schedule=zero_bubble", "parallel.recompute=full",
                                      f"{RESHARD}=true"])],
    8: [("1f1b_tp2", ["parallel.pp_schedule=1f1b", "parallel.tp=2", f"{RESHARD}=true"])],
}
SAVED = "1f1b_reshard"  # the layout whose checkpoint reloads in one process


SETTINGS = [*TRAIN, "model.num_layers=4", "train.progress=false", f"train.global_batch_size={GLOBAL_BATCH}",
            "train.micro_batch_size=1", "train.lr=3e-3", "train.grad_clip=0.5", "train.val_batches=0",
            "train.precision=fp64", "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, settings=SETTINGS, steps=STEPS + 1)


def weights(trainer) -> dict:
    """The weights to compare: ZeRO-3's gathered (it frees them between uses), under tp the full tensors."""
    if trainer.parallel.zero is not None and trainer.parallel.tensor_parallel:
        return full_weights(trainer)
    return gathered_weights(trainer)


def run_steps(trainer, until: int) -> list[dict]:
    out = []
    while trainer.step < until:
        row = trainer.train_step()
        gathers = trainer.mesh.stats.total(op="all_gather", axis="dp_shard")
        out.append({"loss": row["loss"], "grad_norm": row["grad_norm"], "ag": gathers.bytes, "ag_calls": gathers.calls})
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    trainer = Trainer(make_cfg(tmp_path_factory.mktemp("ref") / "run", text_file))
    rows = run_steps(trainer, STEPS)
    out = {"rows": rows, "weights": weights(trainer)}
    out["next"] = run_steps(trainer, STEPS + 1)[0]  # what the reloaded checkpoint must do next
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1  # parity is not trivial
    assert max(r["grad_norm"] for r in rows) > 0.5  # clipping is active: a wrong norm changes the weights
    return out


def expected_gathers(zero, *, micro_batches: int, backward_passes: int = 1) -> tuple[int, int]:
    """zero.py's formula for the dp_shard parameter all-gathers of one step on this rank: (calls, bytes).
    `backward_passes`: per micro-batch, the passes that walk the chain (2 where zero_bubble's W falls
    back to walking it again after B, under full recomputation; on the first stage B then has no input
    gradient to compute and W alone walks)."""
    if not zero.reshard_after_forward:  # every unit once
        return len(zero.buckets), sum(b.nbytes for b in zero.buckets)
    # forward, and each backward pass unless the unit is just the embedding
    per_unit = [1 + backward_passes * b.backward_gather for b in zero.buckets]
    return (micro_batches * sum(per_unit),
            micro_batches * sum(n * b.nbytes for n, b in zip(per_unit, zero.buckets)))


def watch_gathered(zero) -> list[int]:
    """[the most units full (or being gathered) at once], kept up to date as gathers start."""
    peak, start = [0], zero._start_gather

    def counting(bucket):
        start(bucket)
        peak[0] = max(peak[0], sum(b.gathered or b.gather_handle is not None for b in zero.buckets))

    zero._start_gather = counting
    return peak


def pp_zero3_worker(rank, world_size, root: Path, text_file: Path):
    out = {}
    for name, extra in LAYOUTS[world_size]:
        trainer = Trainer(make_cfg(root / name, text_file, "parallel.pp=2", "parallel.zero_stage=3", *extra))
        zero = trainer.parallel.zero
        assert zero.stage == 3 and trainer.mesh.size("dp_shard") == 2
        peak = watch_gathered(zero)
        rows = run_steps(trainer, STEPS)
        peak_gathered = peak[0]  # (full_params below gathers every unit)
        freed = all(p.untyped_storage().nbytes() == 0 for p in trainer.base_model.parameters())
        if name == SAVED:
            trainer.save()
        full = weights(trainer)
        out[name] = {"rows": rows, "weights": full, "keys": sorted(full), "freed": freed,
                     "reshard": zero.reshard_after_forward, "pp_rank": trainer.mesh.local_rank("pp"),
                     "want_ag": expected_gathers(zero, micro_batches=GLOBAL_BATCH // trainer.dp_size,
                                                 backward_passes=1 + ("parallel.recompute=full" in extra
                                                                      and trainer.mesh.local_rank("pp") > 0)),
                     "units": len(zero.buckets), "root": zero.root is not None, "peak_gathered": peak_gathered,
                     "root_backward": zero.root is not None and zero.root.backward_gather}
    dist.barrier()
    return out


def check(results, reference, world_size):
    for name, extra in LAYOUTS[world_size]:
        what = f"pp=2 ZeRO-3 {name} ({world_size} ranks)"
        for r, res in enumerate(results):
            got = res[name]
            assert_close_seq([x["loss"] for x in got["rows"]], [x["loss"] for x in reference["rows"]],
                             rtol=FP64_TOL, what=f"{what} rank {r}: loss")
            assert_close_seq([x["grad_norm"] for x in got["rows"]], [x["grad_norm"] for x in reference["rows"]],
                             rtol=FP64_TOL, what=f"{what} rank {r}: grad norm")
            assert_state_close(got["weights"], {k: reference["weights"][k] for k in got["keys"]}, atol=FP64_TOL,
                               what=f"{what} rank {r}: weights")
            assert got["reshard"] == (f"{RESHARD}=true" in extra), (what, got["reshard"])
            assert got["freed"], f"{what} rank {r}: parameters left gathered after the step"
            # memory: resharding holds a unit and the next one's prefetch, keeping every unit of the stage
            want_peak = min(2, got["units"]) if got["reshard"] else got["units"]
            assert got["peak_gathered"] == want_peak, (what, r, got["peak_gathered"], want_peak)
            # exact all-gather bytes per step; the stage's root unit: embedding (rank 0, no backward
            # gather), norm + head (the last rank)
            assert got["root"] and got["root_backward"] == (got["pp_rank"] == 1), (what, got)
            for step, row in enumerate(got["rows"]):
                assert (row["ag_calls"], row["ag"]) == got["want_ag"], (what, r, step, row, got["want_ag"])
        assert {k for res in results for k in res[name]["keys"]} == set(reference["weights"]), what


def test_pp2_dp2_zero3_every_schedule_matches_one_process(tmp_path, text_file, reference):
    results = run_distributed(pp_zero3_worker, 4, tmp_path, text_file, timeout=300)
    check(results, reference, 4)
    # reshard true moves more than false: per micro-batch against once per step
    for res in results:
        assert res["interleaved_reshard"]["want_ag"][1] > res["interleaved_keep"]["want_ag"][1]
    # the pp=2 x dp_shard=2 ZeRO-3 checkpoint (each stage's flat shards) reloads in one process
    shutil.copytree(tmp_path / SAVED, tmp_path / "one")
    resumed = Trainer(make_cfg(tmp_path / "one", text_file), resume=True)
    assert resumed.step == STEPS and resumed.parallel.zero is None
    merged = {}
    for res in results:
        merged.update(res[SAVED]["weights"])
    assert_state_close(weights(resumed), merged, atol=0.0, what="pp=2 ZeRO-3 checkpoint loaded on one process")
    row = run_steps(resumed, STEPS + 1)[0]
    for metric in ("loss", "grad_norm"):
        assert_close_seq([row[metric]], [reference["next"][metric]], rtol=FP64_TOL,
                         what=f"pp=2 ZeRO-3 checkpoint resumed on one process: {metric}")


def test_pp2_tp2_dp2_zero3_matches_one_process(tmp_path, text_file, reference):
    results = run_distributed(pp_zero3_worker, 8, tmp_path, text_file, timeout=300)
    check(results, reference, 8)


def test_check_layout_accepts_pp_with_zero3(tmp_path, text_file):
    cfg = make_cfg(tmp_path, text_file, "parallel.pp=2", "parallel.zero_stage=3")
    assert cfg.parallel.zero3_reshard_after_forward is None
    assert check_layout(cfg, 4).pp == 2
