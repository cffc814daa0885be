"""Models built sharded: each rank gives values only to the parameters, and the parts of them, that it holds.

Responsible for: where a rank's shard sits in a full tensor (`placement`: from the `_meshlm_shard = (axis, dim)`
tag every strategy puts on what it splits; checkpoints place their pieces by the same rule), the value of
a rank's shard of one parameter at initialisation (`ShardInit`: the rows of the full value that hold the rank's
rectangle, drawn alone from the model's per-(seed, name, block of rows) streams, `models.transformer.init_param`,
then the rectangle -- the same numbers the single-device model has there; a ZeRO-3 flat shard asks for the
element range it holds, `flat_range`), and `materialize`, which turns the meta-device parameters the transforms
left into real ones on the rank's device: filled, or "hollow" (right shape, no storage) for ZeRO-3, which
fills its flat shard unit by unit from the same `ShardInit` and never holds a whole parameter set.
Not responsible for: the splits themselves (each strategy's file) or the initial values (models/).

Why: the models that need ZeRO-3, tensor or pipeline parallelism are the ones that cannot be built whole on
every rank. `build_model(..., materialize=False)` gives the model on the meta device (shapes, no memory);
`parallelize(..., init=ShardInit(...))` applies the transforms to it and calls `materialize`, so a rank's
peak is its shards plus the rows of one parameter at a time, and the values it draws are about what it holds:
rows for a ZeRO-3 shard, a row-split (dim 0) tensor-parallel slice or an expert slice; whole rows where tensor
parallelism splits columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshlm.config import ModelConfig
from meshlm.models.transformer import init_param


def placement(local_shape, tag, mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(full shape, offsets of this rank's shard) of a tensor of `local_shape` tagged `(axis, dim)` or None."""
    shape, offsets = list(local_shape), [0] * len(local_shape)
    if tag is not None:
        axis, dim = tag
        assert mesh is not None, "a sharded tensor needs its mesh to be placed"
        offsets[dim] = mesh.local_rank(axis) * shape[dim]
        shape[dim] *= mesh.size(axis)
    return tuple(shape), tuple(offsets)


@dataclass(frozen=True)
class ShardInit:
    """The initial value of this rank's part of any parameter (named as in the unsharded model)."""

    config: ModelConfig
    seed: int
    mesh: object
    device: torch.device
    dtype: torch.dtype

    @torch.no_grad()
    def __call__(self, name: str, param: torch.Tensor) -> torch.Tensor:
        return self.rows(name, param, 0, param.shape[0] if param.dim() else 1)

    @torch.no_grad()
    def rows(self, name: str, param: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (along dim 0) of this rank's part of parameter `name`, drawing only those rows of
        the full value (`init_param`'s blocks)."""
        full_shape, offsets = placement(param.shape, getattr(param, "_meshlm_shard", None), self.mesh)
        if not full_shape:
            return init_param(name, full_shape, self.config, self.seed).to(device=self.device, dtype=self.dtype)
        rows = init_param(name, full_shape, self.config, self.seed, rows=(offsets[0] + start, offsets[0] + stop))
        part = rows[(slice(None), *(slice(o, o + n) for o, n in zip(offsets[1:], param.shape[1:])))]
        return part.to(device=self.device, dtype=self.dtype).contiguous()

    def flat_range(self, name: str, param: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of this rank's part of parameter `name`, flattened (a ZeRO-3 shard's piece)."""
        row = math.prod(param.shape[1:]) if param.dim() > 1 else 1
        first, last = start // row, (end - 1) // row + 1
        return self.rows(name, param, first, last).reshape(-1)[start - first * row:end - first * row]


@torch.no_grad()
def materialize(model: nn.Module, init: ShardInit, *, hollow: bool = False) -> None:
    """Replace every meta-device parameter of `model` by a real one on `init.device` (its `_meshlm_shard` tag and
    requires_grad kept; a parameter shared by several modules stays shared): filled by `init`, or with
    `hollow=True` of the right shape but no storage (ZeRO-3 points it into its gathered buffers)."""
    from meshlm.parallel.buckets import trainable_parameters

    names = {id(p): name for name, p in trainable_parameters(model)}
    names.update({id(p): name for name, p in model.named_parameters() if id(p) not in names})
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            new = replaced.get(id(p))
            if new is None:
                if hollow:
                    value = torch.empty(p.shape, dtype=init.dtype, device=init.device)
                    value.untyped_storage().resize_(0)
                else:
                    value = init(names[id(p)], p)
                new = nn.Parameter(value, requires_grad=p.requires_grad)
                if hasattr(p, "_meshlm_shard"):
                    new._meshlm_shard = p._meshlm_shard
                replaced[id(p)] = new
            module._parameters[key] = new
