"""The geometry of checkpoint pieces (`meshlm.checkpoint.shards`): ZeRO ranges cut into rectangles, and full
tensors put back together from pieces (what inference does with a sharded run's safetensors)."""

import math

import pytest
import torch

from meshlm.checkpoint.shards import assemble, assign_writers, rectangles


@pytest.mark.parametrize("shape", [(7,), (4, 6), (3, 4, 5), (2, 3, 1, 4)])
def test_rectangles_cover_a_range_in_memory_order(shape):
    n = math.prod(shape)
    index = torch.arange(n).view(shape)
    for start in range(n):
        for end in range(start + 1, n + 1):
            rects = rectangles(start, end, shape)
            assert len(rects) <= 2 * len(shape) - 1, (start, end, rects)
            got = torch.cat([index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                             for offsets, sizes in rects])
            assert torch.equal(got, torch.arange(start, end)), (start, end, rects)


def test_assemble_puts_pieces_together_and_refuses_gaps_and_misfits():
    full = torch.arange(24.0).view(4, 6)
    names, layout = {}, {}
    for i, (offsets, sizes) in enumerate(rectangles(0, 13, full.shape) + rectangles(13, 24, full.shape)):
        name = f"w@{i}"
        names[name] = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()
        layout[name] = {"key": "w", "offsets": list(offsets), "shape": [4, 6]}
    names["b"] = torch.ones(3)  # a whole tensor keeps its own name
    out = assemble(names, layout)
    assert torch.equal(out["w"], full) and torch.equal(out["b"], torch.ones(3))
    gap = dict(names)
    del gap["w@0"]
    with pytest.raises(ValueError, match="cover 12 of its 24"):
        assemble(gap, layout)
    with pytest.raises(ValueError, match="does not fit"):
        assemble({"w@0": torch.zeros(2, 6)}, {"w@0": {"key": "w", "offsets": [3, 0], "shape": [4, 6]}})


def test_each_replicated_piece_has_exactly_one_writer():
    idents = [("w", (0,), (4,)), ("w", (4,), (4,)), ("b", (0,), (3,))]
    everyone = [idents, idents[:1] + idents[2:], idents]  # rank 1 lacks the second piece
    writers = {}
    for rank, mine in enumerate(everyone):
        for ident in assign_writers({i: i for i in mine}, everyone, rank):
            writers.setdefault(ident, []).append(rank)
    assert sorted(writers) == sorted(idents) and all(len(r) == 1 for r in writers.values())
    assert writers[("w", (4,), (4,))] != [1]
