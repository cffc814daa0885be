"""ZeRO-1/2/3 under the Trainer reproduce the single-process run (ZeRO-3 with parameters resharded
after each forward, and kept gathered for the step), move exactly the padded flat-buffer bytes, hold
1/dp of the optimizer state, and checkpoint in the unsharded per-parameter layout (bit-identical resume; a ZeRO-2 checkpoint resumes with zero_stage=0).

Parity (tests/parity.py): a configuration run with train.precision=fp64 must match the fp64
single-process run in losses, grad norms and every weight to FP64_TOL; one run in fp32 (the real
dtype) in losses and grad norms to FP32_REL. Every stage, and hybrid sharding, runs in both
precisions somewhere below; the byte counts are checked in both (4 or 8 bytes an element).

One launch per world size: each rank runs every configuration in turn. Steps are driven with
`Trainer.train_step()` so the communication of each step can be read from the mesh's CommStats.
"""

import gc
import shutil
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist import run_distributed
from meshlm.config import ModelConfig, TrainConfig
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models import build_model
from meshlm.parallel.parallelize import check_layout
from meshlm.parallel.zero import apply_zero
from meshlm.train.optim import build_optimizer
from meshlm.train.trainer import Trainer
from parity import FP32_REL, FP64_TOL, assert_close_seq, assert_state_close
from runs import TRAIN, gathered_weights, train_config

STEPS = 5
RESUME_AT = 3
PRECISIONS = {"fp32": (4, FP32_REL), "fp64": (8, FP64_TOL)}  # bytes an element, tolerance


SETTINGS = [*TRAIN, "train.progress=false", "train.global_batch_size=8", "train.micro_batch_size=8", "train.lr=3e-3",
            "train.grad_clip=0.5", "train.val_batches=0", "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, settings=SETTINGS, steps=STEPS)


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
    """The single-process run in each precision."""
    out = {}
    for precision, (size, _) in PRECISIONS.items():
        trainer = Trainer(make_cfg(tmp_path_factory.mktemp("ref") / "run", text_file, f"train.precision={precision}"))
        rows = run_steps(trainer, STEPS)
        assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # parity is not trivial
        # clipping is active (grad_clip=0.5), so a wrong norm would change the weights too
        assert max(r["grad_norm"] for r in rows) > 0.5
        numel = trainer.base_model.num_params()
        out[precision] = {"rows": rows, "weights": gathered_weights(trainer), "numel": numel,
                          "state_bytes": 2 * numel * size}  # exp_avg + exp_avg_sq
    return out


def zero_worker(rank, world_size, root: Path, text_file: Path, configs: list[tuple], with_resume: bool):
    out = {}
    for key in configs:
        stage, micro, extra, precision = key
        trainer = Trainer(make_cfg(root / f"s{stage}m{micro}{extra}{precision}", text_file,
                                   f"parallel.zero_stage={stage}", f"train.micro_batch_size={micro}",
                                   f"train.precision={precision}", *([extra] if extra else [])))
        zero = trainer.parallel.zero
        assert zero is not None and trainer.parallel.data_parallel is None
        rows = run_steps(trainer, STEPS)
        padded = [b.padded for b in zero.buckets]
        out[key] = {"rows": rows, "weights": gathered_weights(trainer), "padded": padded,
                    "micro_steps": 8 // world_size // micro,
                    "bucket_numels": [b.numel for b in zero.buckets], "num_shards": zero.num_shards,
                    "state_bytes": trainer.optimizer.state_bytes(),
                    "grads_kept": any(p.grad is not None for p in trainer.base_model.parameters()),
                    "params_freed": all(p.untyped_storage().nbytes() == 0 for p in trainer.base_model.parameters())}
        # A deleted trainer takes its model along: the gradient hooks (held where the garbage collector cannot
        # see them) must not keep the strategy, and through it the model and its shards, alive.
        model = weakref.ref(trainer.base_model)
        del trainer, zero
        gc.collect()
        out[key]["model_outlived_trainer"] = model() is not None
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
        out["split"] = {"rows": first + rest, "weights": gathered_weights(resumed)}
        out["padding"] = {dtype: padding_check(rank, dtype) for dtype in (torch.float32, torch.float64)}
    return out


def padding_check(rank, dtype) -> dict:
    """A toy model whose sizes do not divide by 2: padded buckets, parity with torch AdamW."""
    mesh = build_mesh(ParallelDims(dp_shard=2).resolve(2), device_type="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1)).to(dtype)  # 15, 5, 5, 1 elements
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    zero = apply_zero(model, mesh, stage=2, bucket_size_mb=1 / 2**20)  # 1 byte: a bucket per tensor
    tcfg = TrainConfig(lr=0.1, weight_decay=0.5)
    opt = build_optimizer(model, tcfg, zero=zero)
    ref_model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1)).to(dtype)
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), ref):
            p.copy_(r)
    ref_opt = build_optimizer(ref_model, tcfg)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=dtype)
    mesh.stats.reset()
    for _ in range(2):
        opt.zero_grad()
        model(x[rank * 2:rank * 2 + 2]).sum().backward()  # each rank half the batch: grads sum
        opt.step()
        ref_opt.zero_grad()
        ref_model(x).sum().backward()
        ref_opt.step()
    return {"numels": [b.numel for b in zero.buckets], "padded": [b.padded for b in zero.buckets],
            "rs": mesh.stats.total(op="reduce_scatter", axis="dp_shard").bytes,
            "ag": mesh.stats.total(op="all_gather", axis="dp_shard").bytes,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "want": {n: p.detach().clone() for n, p in ref_model.named_parameters()}}


def check_parity(results, reference, configs):
    for key in configs:
        stage, micro, extra, precision = key
        size, tol = PRECISIONS[precision]
        ref = reference[precision]
        for r, result in enumerate(results):
            got = result[key]
            what = " ".join(x for x in (f"zero_stage={stage} micro={micro}", extra, precision, f"rank {r}") if x)
            assert_close_seq([x["loss"] for x in got["rows"]], [x["loss"] for x in ref["rows"]], rtol=tol,
                             what=f"{what}: loss")
            assert_close_seq([x["grad_norm"] for x in got["rows"]], [x["grad_norm"] for x in ref["rows"]], rtol=tol,
                             what=f"{what}: grad norm")
            if precision == "fp64":
                assert_state_close(got["weights"], ref["weights"], atol=tol, what=f"{what}: weights")
            # exact bytes: one reduce-scatter and one all-gather of every padded bucket per step
            n = got["num_shards"]
            assert sum(got["bucket_numels"]) == ref["numel"]
            assert all(p == -(-b // n) * n for p, b in zip(got["padded"], got["bucket_numels"]))
            padded_bytes = size * sum(got["padded"])
            # ZeRO-3 gathers every block for each micro-step's forward and backward instead, and the
            # root unit (embedding, norm, head; the last bucket) once: it stays gathered from its
            # forward into its backward
            # ... unless parallel.zero3_reshard_after_forward=false: every unit once per step, kept from the
            # first forward to the last micro-step's backward
            gathered = padded_bytes
            if stage == 3 and "zero3_reshard_after_forward=false" not in extra:
                gathered = got["micro_steps"] * (2 * padded_bytes - size * got["padded"][-1])
            for row in got["rows"]:
                assert (row["rs"], row["ag"]) == (padded_bytes, gathered), (key, row, padded_bytes)
                replicas = len(results) // n
                assert row["ar_rep"] == (padded_bytes // n if replicas > 1 else 0), (key, row)
            # optimizer state: 1/dp of the unsharded AdamW's, up to the padding
            assert got["state_bytes"] * n == ref["state_bytes"] + 2 * size * (sum(got["padded"]) - ref["numel"])
            # ZeRO-2/3 free the full gradients during backward; ZeRO-1 keeps them
            assert got["grads_kept"] == (stage == 1), key
            # ZeRO-3 frees the full parameters between uses
            assert got["params_freed"] == (stage == 3), key
            assert not got["model_outlived_trainer"], key


def test_zero_dp2_matches_single_process_and_checkpoints(tmp_path, text_file, reference):
    # per-rank batch 4: one micro-batch; or 2 accumulated
    configs = [(1, 4, "", "fp64"), (2, 2, "", "fp32"), (3, 2, "", "fp64"),
               (3, 2, "parallel.zero3_reshard_after_forward=false", "fp64")]
    results = run_distributed(zero_worker, 2, tmp_path, text_file, configs, True, timeout=150)
    check_parity(results, reference, configs)

    for r, result in enumerate(results):
        straight = result[(2, 2, "", "fp32")]
        assert [(x["loss"], x["grad_norm"]) for x in result["split"]["rows"]] == \
            [(x["loss"], x["grad_norm"]) for x in straight["rows"]], r
        for name, w in straight["weights"].items():
            assert torch.equal(w, result["split"]["weights"][name]), (r, name)

    for r, result in enumerate(results):
        for dtype, size in ((torch.float32, 4), (torch.float64, 8)):
            pad = result["padding"][dtype]
            assert pad["numels"] == [1, 5, 5, 15] and pad["padded"] == [2, 6, 6, 16]
            assert pad["rs"] == pad["ag"] == 2 * size * 30  # 2 steps x 30 padded elements
        pad = result["padding"][torch.float64]
        assert_state_close(pad["weights"], pad["want"], atol=FP64_TOL, what=f"padded toy rank {r}: weights")

    # the ZeRO-2 dp=2 checkpoint (per-parameter layout) resumes in one process with zero_stage=0
    single = Trainer(make_cfg(tmp_path / "to_stage0", text_file), resume=True)
    assert single.step == RESUME_AT and single.parallel.zero is None
    row = run_steps(single, RESUME_AT + 1)[0]
    assert_close_seq([row["loss"]], [reference["fp32"]["rows"][RESUME_AT]["loss"]], rtol=FP32_REL,
                     what="ZeRO-2 checkpoint resumed with zero_stage=0: loss")


def test_zero_dp4_and_hybrid_match_single_process(tmp_path, text_file, reference):
    # per-rank batch 2: one micro-batch, then 2 accumulated; hybrid: 2 replicas x 2 shards
    hybrid = "parallel.dp_replicate=2"
    configs = [(1, 1, "", "fp32"), (2, 2, "", "fp64"), (3, 2, "", "fp32"), (2, 1, hybrid, "fp64"),
               (3, 1, hybrid, "fp32")]
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
    rows, want = run_steps(zero, STEPS), reference["fp32"]["rows"][RESUME_AT:]
    for metric in ("loss", "grad_norm"):
        assert_close_seq([x[metric] for x in rows], [x[metric] for x in want], rtol=FP32_REL,
                         what=f"plain checkpoint resumed under zero_stage={stage}: {metric}")


def test_zero3_over_part_of_a_model_has_units_only_where_that_part_has_parameters():
    """Expert parallelism's two ZeRO-3 shardings of one model (here both in one process): the experts'
    has a unit per MoE block and no root unit, the rest's a unit per block plus the root; together they
    compute the plain model's gradients and leave every parameter freed."""
    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=32,
                      max_seq_len=16, num_experts=4, num_experts_per_token=2, moe_intermediate_size=8,
                      first_dense_layers=1)
    model, ref = (build_model(cfg, seed=0, dtype=torch.float64) for _ in range(2))
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    rest = apply_zero(model, mesh, stage=3, bucket_size_mb=1.0, params=dense)
    expert_zero = apply_zero(model, mesh, stage=3, bucket_size_mb=1.0, params=experts, replicate_axis=None)
    blocks = list(model.layers.values())
    assert [b.unit for b in rest.buckets] == [*reversed(blocks), model] and rest.root is rest.buckets[-1]
    assert [b.unit for b in expert_zero.buckets] == [blocks[2], blocks[1]] and expert_zero.root is None  # 0 is dense
    first, second = expert_zero.buckets[1], expert_zero.buckets[0]  # blocks 1 and 2
    assert (first.next_forward, second.next_forward, second.next_backward, first.next_backward) == \
        (second, None, first, None)
    assert all(len(b.params) == 3 for b in expert_zero.buckets)  # w_gate, w_up, w_down
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    for m in (model, ref):
        m(tokens).sum().backward()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    for part in (rest, expert_zero):
        grads = {id(p): r.grad for p, r in zip(model.parameters(), ref.parameters())}
        want = part.local_shard(
            lambda name, p, start, end: grads[id(p)].reshape(-1)[start:end] if id(p) in grads else None)
        torch.testing.assert_close(part.grad_shard, want, rtol=0, atol=FP64_TOL)
