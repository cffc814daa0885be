"""ZeRO-1/2/3 and hybrid sharding over tensor-parallel shards ("2-D") reproduce the single-process run.

Exactness in float64 (`train.precision=fp64`): losses, grad norms and final weights within 1e-9 of
the single-process Trainer. fp32 runs: losses and grad norms within 1e-5 relative. A checkpoint
saved at tp=2 x ZeRO-3 resumes in one process and at dp=4 with the same next loss. And ZeRO-3's
parameter gathers (prefetched one unit ahead) keep the collective order of every rank consistent
even when a parameter gets no gradient on some rank.

One launch per world size: each rank runs every configuration in turn.
"""

import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dist import run_distributed
from meshlm.mesh import ParallelDims, build_mesh
from meshlm.parallel.zero import apply_zero
from meshlm.models import build_model
from meshlm.checkpoint import load_weights
from meshlm.checkpoint.shards import checkpoint_state
from meshlm.train.trainer import Trainer
from parity import FP32_REL, FP64_TOL, assert_close_seq, assert_state_close
from runs import TRAIN, full_weights, grad_norms, step_losses, train_config

STEPS = 5


SETTINGS = [*TRAIN, "train.progress=false", "train.global_batch_size=8", "train.micro_batch_size=2", "train.lr=3e-3",
            "train.grad_clip=0.5", "train.val_batches=0", "train.sample_tokens=0", "parallel.bucket_size_mb=0.02"]
make_cfg = partial(train_config, settings=SETTINGS, steps=STEPS)


def run(run_dir, text_file, *extra, steps=STEPS) -> tuple[list[float], list[float], dict]:
    trainer = Trainer(make_cfg(run_dir, text_file, *extra, steps=steps))
    trainer.train()
    weights = full_weights(trainer)
    if dist.is_initialized():
        dist.barrier()  # rank 0 has written metrics.jsonl
    return step_losses(run_dir), grad_norms(run_dir), weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    """Single process, fp64 and fp32; and the fp64 run resumed for a 6th step (the loss a resumed run
    must reproduce: the LR schedule depends on train.steps, so it is not the 6th step of a 6-step run)."""
    root = tmp_path_factory.mktemp("ref")
    losses64, norms64, weights64 = run(root / "fp64", text_file, "train.precision=fp64")
    Trainer(make_cfg(root / "fp64", text_file, "train.precision=fp64", steps=STEPS + 1), resume=True).train()
    next_loss = step_losses(root / "fp64")[-1]
    losses32, norms32, _ = run(root / "fp32", text_file, "train.precision=fp32")
    assert losses32[-1] < losses32[0] - 0.3  # parity is not trivial
    return {"fp64": (losses64, norms64, weights64), "fp64_next_loss": next_loss,
            "fp32": (losses32, norms32)}


LAYOUTS_4 = {  # 4 ranks: tp=2 x dp_shard=2
    "tp2_zero1": ["parallel.tp=2", "parallel.zero_stage=1"],
    "tp2_zero2": ["parallel.tp=2", "parallel.zero_stage=2"],
    "tp2_zero3": ["parallel.tp=2", "parallel.zero_stage=3"],
}


def layouts_worker(rank, world_size, root: Path, text_file: Path, layouts: dict, fp32: bool, resume: bool):
    out = {}
    for name, extra in layouts.items():
        out[name, "fp64"] = run(root / name / "fp64", text_file, "train.precision=fp64", *extra)
        if fp32:
            out[name, "fp32"] = run(root / name / "fp32", text_file, "train.precision=fp32", *extra)[:2]
    if resume:
        # the tp=2 x ZeRO-3 fp64 checkpoint (5 steps), resumed for a 6th step at dp=4 (plain DP)
        src = root / "tp2_zero3" / "fp64"
        if rank == 0:
            shutil.copytree(src, root / "as_dp4")
            shutil.copytree(src, root / "as_single")  # for the parent, in one process
        dist.barrier()
        resumed = Trainer(make_cfg(root / "as_dp4", text_file, "train.precision=fp64", steps=STEPS + 1), resume=True)
        assert resumed.step == STEPS and resumed.dp_size == 4
        assert "tp=2" in resumed.resume_note and "dp_shard=4" in resumed.resume_note  # not "the same layout"
        resumed.train()
        dist.barrier()
        out["dp4_next_loss"] = step_losses(root / "as_dp4")[-1]
        out["probe"] = probe_save_and_load(root / "probe", text_file)
    return out


class AllocationProbe(TorchDispatchMode):
    """Records every floating-point tensor an op allocates (an output whose storage is none of its inputs'):
    the largest one, and the bytes of all of them. Views, in-place ops and copies into existing tensors
    allocate none; byte tensors (the pickled plans and metadata ranks exchange) are not counted."""

    def __init__(self):
        super().__init__()
        self.largest, self.total = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.is_floating_point():
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in inputs:
                    self.largest, self.total = max(self.largest, storage.nbytes()), self.total + storage.nbytes()
        return out


def probe_save_and_load(run_dir: Path, text_file: Path) -> dict:
    """tp=2 x ZeRO-3 (dp_shard=2): save and load a checkpoint with every allocation recorded."""
    trainer = Trainer(make_cfg(run_dir, text_file, "train.precision=fp32", "parallel.tp=2", "parallel.zero_stage=3",
                               "train.checkpoint_interval=0", steps=1))
    trainer.train()
    zero = trainer.parallel.zero
    state = trainer.optimizer.state[zero.param_shard]
    shard_bytes = sum(t.numel() * t.element_size() for t in (zero.param_shard, state["exp_avg"], state["exp_avg_sq"]))
    full_bytes = [p.numel() * p.element_size() * (2 if getattr(p, "_meshlm_shard", None) else 1)
                  for p in trainer.base_model.parameters()]  # each parameter unsharded (tp=2)
    pieces = checkpoint_state(trainer.base_model, trainer.optimizer, trainer.mesh)["model"].values()
    largest_piece = max(p.tensor.numel() * p.tensor.element_size() for s in pieces for p in s.pieces)
    with AllocationProbe() as saving:
        path = trainer.save()
    with AllocationProbe() as loading:
        trainer.load(path)
    # inference's copy: the safetensors pieces (ZeRO ranges of tp shards) put together equal the weights
    weights = full_weights(trainer)
    model = build_model(trainer.cfg.model, seed=1)
    load_weights(path, model)
    assert all(torch.equal(t, weights[k]) for k, t in model.state_dict().items())
    return {"save": (saving.largest, saving.total), "load": (loading.largest, loading.total),
            "shard_bytes": shard_bytes, "largest_full": max(full_bytes), "largest_piece": largest_piece}


def check(results, reference, layouts: dict, *, fp32: bool):
    ref_losses, ref_norms, ref_weights = reference["fp64"]
    for name in layouts:
        losses, norms, _ = results[0][name, "fp64"]
        assert_close_seq(losses, ref_losses, rtol=FP64_TOL, what=f"{name} fp64 losses")
        assert_close_seq(norms, ref_norms, rtol=FP64_TOL, what=f"{name} fp64 grad norms")
        for r, result in enumerate(results):
            assert_state_close(result[name, "fp64"][2], ref_weights, atol=FP64_TOL, what=f"{name} fp64 rank {r} weights")
        if fp32:
            losses, norms = results[0][name, "fp32"]
            assert_close_seq(losses, reference["fp32"][0], rtol=FP32_REL, what=f"{name} fp32 losses")
            assert_close_seq(norms, reference["fp32"][1], rtol=FP32_REL, what=f"{name} fp32 grad norms")


def test_zero_1_2_3_over_tp2_match_one_process_and_checkpoint_moves(tmp_path, text_file, reference):
    results = run_distributed(layouts_worker, 4, tmp_path, text_file, LAYOUTS_4, True, True, timeout=240)
    check(results, reference, LAYOUTS_4, fp32=True)
    next_loss = reference["fp64_next_loss"]
    assert_close_seq([results[0]["dp4_next_loss"]], [next_loss], rtol=FP64_TOL, what="tp2 x ZeRO-3 -> dp=4 step 6")
    # Save and load never build a full tensor: no allocation is larger than the largest piece this rank
    # holds (a ZeRO range of a tp shard), which is smaller than the largest parameter; and all of a save's
    # allocations together (DCP's copy of each piece, the safetensors copy of the weights) stay within
    # twice this rank's shard.
    for r, result in enumerate(results):
        probe = result["probe"]
        for what in ("save", "load"):
            largest, total = probe[what]
            assert largest <= probe["largest_piece"] < probe["largest_full"], (r, what, probe)
            assert total <= 2 * probe["shard_bytes"], (r, what, probe)
    single = Trainer(make_cfg(tmp_path / "as_single", text_file, "train.precision=fp64", steps=STEPS + 1), resume=True)
    assert single.step == STEPS and "tp=2" in single.resume_note
    single.train()
    assert_close_seq([step_losses(tmp_path / "as_single")[-1]], [next_loss], rtol=FP64_TOL,
                     what="tp2 x ZeRO-3 -> one process step 6")


def test_hybrid_zero3_over_tp2_at_8_ranks(tmp_path, text_file, reference):
    layouts = {"hsdp2x2_tp2_zero3": ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2",
                                     "parallel.zero_stage=3"]}
    results = run_distributed(layouts_worker, 8, tmp_path, text_file, layouts, True, False, timeout=300)
    check(results, reference, layouts, fp32=True)


# -- ZeRO-3 on a toy model: prefetch, and a parameter that gets no gradient on one rank -------------


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.extra = nn.Linear(6, 6)  # used only when asked: on one rank, not the other

    def forward(self, x, use_extra: bool):
        y = torch.tanh(self.lin(x))
        return y + self.extra(x) if use_extra else y


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.layers = nn.ModuleList([ToyBlock() for _ in range(3)])
        self.head = nn.Linear(6, 1)

    def forward(self, x, use_extra: bool):
        h = self.embed(x)
        for i, block in enumerate(self.layers):
            h = block(h, use_extra and i == len(self.layers) - 1)  # two blocks run backward after it
        return self.head(h)


def _toy_loss(model, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
    return model(x, rank == 0).pow(2).sum()


def toy_worker(rank, world_size):
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    torch.manual_seed(0)
    model = Toy().double()
    reference = Toy().double()
    reference.load_state_dict(model.state_dict())
    zero = apply_zero(model, mesh, stage=3, bucket_size_mb=1)
    assert zero.gather_mesh.group("dp_shard") is not mesh.group("dp_shard")
    # prefetch: when a block's forward (or backward) starts, the next one's gather is already on its way
    in_flight = []
    for b in zero.buckets[:-1]:  # the blocks
        b.unit.register_forward_pre_hook(
            lambda m, a, b=b: in_flight.append(b.next_forward is None or b.next_forward.gather_handle is not None
                                               or b.next_forward.gathered))
    full = lambda: sum(b.gathered for b in zero.buckets)  # noqa: E731
    peak = []
    for b in zero.buckets[:-1]:
        b.unit.register_forward_hook(lambda m, a, o: peak.append(full()))
    for step in range(3):
        _toy_loss(model, rank, step).backward()  # rank 1 never uses layers[2].extra
        grads = zero.gather_full(zero.grad_shard)
        for r in range(world_size):  # the single-process gradient: the sum over both ranks' losses
            _toy_loss(reference, r, step).backward()
        for b in zero.buckets:
            for p, name in zip(b.params, b.names):
                ref = dict(reference.named_parameters())[name]
                want, got = ref.grad if ref.grad is not None else torch.zeros_like(ref), grads[id(p)]
                assert torch.allclose(got, want, atol=FP64_TOL, rtol=0), (step, name, float((got - want).abs().max()))
        reference.zero_grad()
        zero.grad_shard.zero_()
    assert in_flight and all(in_flight), in_flight
    assert max(peak) <= 3  # root + this block + the prefetched one
    assert all(not b.gathered and b.gather_handle is None for b in zero.buckets)
    return True


def test_zero3_prefetch_and_a_parameter_unused_on_one_rank():
    assert run_distributed(toy_worker, 2, timeout=60) == [True, True]
