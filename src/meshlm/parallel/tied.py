"""Tied embeddings under pipeline parallelism: the first stage's embedding and the last stage's output head.

Responsible for: the "pp_ends" axis (pp coordinates 0 and pp - 1 of each pipeline, Megatron's embedding group,
`tied_embedding_mesh`), keeping the two copies of one weight equal (`TiedEmbedding.sum_grads`, called before
the data-parallel reduction) and marking the head's copy so that gradient norms (`counted`, ZeRO's
`uncounted` mask) and checkpoints (`checkpoint.shards`) take the weight once.
Not responsible for: the stage split (`pipeline.split_model`, which leaves the head on the last stage) or the
initial values (`models.transformer.init_param` gives a tied head the embedding's stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh, create_groups, every_group, group_ranks
from meshlm.parallel.pipeline import PipelineStage


TIED_AXIS = "pp_ends"  # the first and the last pp rank of each pipeline (Megatron's embedding group)


def tied_embedding_mesh(mesh: Mesh, axis: str = "pp") -> Mesh:
    """`mesh` plus the axis "pp_ends": pp coordinates 0 and pp - 1 of each pipeline, the ranks holding the
    embedding and the output head; a middle rank's group is itself. Collective over the world."""
    def members_of(rank: int) -> list[int]:
        line = group_ranks(mesh.dims, rank, axis)
        return [line[0], line[-1]] if rank in (line[0], line[-1]) else [rank]

    pairs = [g for g in every_group(mesh.world_size, members_of) if len(g) > 1]
    group = create_groups(pairs, mesh.rank) if mesh.device_mesh is not None else None
    return mesh.with_axes({TIED_AXIS: (members_of(mesh.rank), group)}, every={TIED_AXIS: pairs})


@dataclass
class TiedEmbedding:
    """model.tie_embeddings under pp > 1: the first stage's embedding and the last stage's head are two
    copies of one weight, starting equal (`init_param` gives the head the embedding's values). Each gets
    the gradient of its own use; `sum_grads` adds the two over "pp_ends" before the data-parallel
    reduction, so both take the same optimizer step and stay equal. The last stage's copy is marked
    `_meshlm_tied_copy`: gradient norms count the weight once (on the first stage) and checkpoints
    write it once (as "embed.weight")."""

    param: nn.Parameter  # this rank's copy (embed.weight on stage 0, lm_head.weight on the last stage)
    mesh: Mesh

    @classmethod
    def of(cls, stage: PipelineStage, mesh: Mesh) -> TiedEmbedding | None:
        """This rank's copy (None on a middle stage, or without tied embeddings); marks the head's copy."""
        model = stage.model
        if not model.config.tie_embeddings or stage.pp == 1:
            return None
        if model.embed is not None:
            return cls(model.embed.weight, mesh)
        if model.lm_head is not None:
            model.lm_head.weight._meshlm_tied_copy = True
            return cls(model.lm_head.weight, mesh)
        return None

    def sum_grads(self) -> None:
        """Add the two copies' gradients (collective over "pp_ends"; a copy without gradient adds zero)."""
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        comm.all_reduce(self.param.grad, self.mesh, TIED_AXIS)


def counted(params) -> list[nn.Parameter]:
    """`params` without the copies of tied weights that a gradient norm must not count twice."""
    return [p for p in params if not getattr(p, "_meshlm_tied_copy", False)]
