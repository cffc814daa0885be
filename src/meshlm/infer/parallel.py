"""Serving on several ranks: one engine on rank 0, the model's tensor-parallel shards on every rank.

Responsible for: `TensorParallelRunner`, what rank 0's `Engine` calls in place of its `ModelRunner`: each
step it sends the `StepInput` (plain data, as JSON) to the other ranks over "tp", runs its own shard of
the step, and all-gathers the vocab-parallel logits; `run_worker`, the loop of the other ranks (receive a
step, run it, take part in the gather, until rank 0 says stop); and `shard_for_serving`, the training's
tensor-parallel transform without sequence parallelism (`apply_tensor_parallel`): attention heads, MLP
columns and the vocabulary split over tp, so each rank's paged KV cache holds only its kv heads -- the
same memory per rank holds tp times the tokens.
Every rank runs the same modules on the same tokens, and the scheduler, block manager and sampler live
on rank 0 alone (torch-free and unchanged); the others never see a request.
Not responsible for: launching ranks (`meshlm generate --tp N` starts them through torch's launcher;
under torchrun every rank builds `LLM(..., tp=N)`), scheduling or sampling (rank 0's engine).
"""

from __future__ import annotations

import dataclasses

import torch

from meshlm import comm
from meshlm.infer.model_runner import ModelRunner, StepInput
from meshlm.mesh import Mesh
from meshlm.models.transformer import Transformer

AXIS = "tp"
_STOP = {"stop": True}


def shard_for_serving(model: Transformer, mesh: Mesh) -> Transformer:
    """`model` (the full weights, the same on every rank) split in place over "tp" for inference."""
    from meshlm.parallel.tensor import apply_tensor_parallel, check_tensor_parallel

    check_tensor_parallel(model.config, mesh.size(AXIS), sequence_parallel=False)
    return apply_tensor_parallel(model, mesh, sequence_parallel=False)


def _run_step(runner: ModelRunner, mesh: Mesh, step: StepInput) -> torch.Tensor:
    """This rank's part of a step, then the full logits (the vocab slices of every rank, in order)."""
    logits = runner.execute(step)
    return comm.all_gather(logits, mesh, AXIS, dim=1)


class TensorParallelRunner:
    """Rank 0's runner: the same interface as `ModelRunner` (block_size, num_blocks, execute)."""

    def __init__(self, runner: ModelRunner, mesh: Mesh):
        assert mesh.local_rank(AXIS) == 0, "rank 0 of the tp group drives; the others run `run_worker`"
        self.runner, self.mesh = runner, mesh
        self.block_size, self.num_blocks = runner.block_size, runner.num_blocks
        self.closed = False

    def execute(self, step: StepInput) -> torch.Tensor:
        comm.broadcast_json(dataclasses.asdict(step), self.mesh, AXIS)
        return _run_step(self.runner, self.mesh, step)

    def close(self) -> None:
        """Release the other ranks from `run_worker` (once; the engine is unusable afterwards)."""
        if not self.closed:
            comm.broadcast_json(_STOP, self.mesh, AXIS)
            self.closed = True


def run_worker(runner: ModelRunner, mesh: Mesh) -> int:
    """A rank other than 0: run the steps rank 0 sends until it closes; return how many ran."""
    steps = 0
    while True:
        message = comm.broadcast_json(None, mesh, AXIS)
        if message == _STOP:
            return steps
        _run_step(runner, mesh, StepInput(**message))
        steps += 1
