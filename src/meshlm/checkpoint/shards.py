"""What each rank holds of every full tensor of a checkpoint, as rectangles ("pieces") of the full tensor.

Responsible for: the state a checkpoint stores -- `{"model": {...}, "optim": {"state": ..., "param_groups":
...}}`, keyed as one unsharded model with `torch.optim.AdamW` names it, whatever layout is running -- with
every tensor a `ShardedState`: its full shape and the pieces of it this rank holds, each a view of the
live storage (parameters, moments, ZeRO's flat shards) with its offsets in the full tensor.
torch.distributed.checkpoint (DCP) writes every piece with its offsets (a piece several ranks hold, once)
and on load reads into each piece exactly the parts of the saved pieces it overlaps, so no rank ever
builds a full tensor, on save or on load, whatever the two layouts are.

Where the pieces come from:
  - a tensor- or expert-parallel shard (`_meshlm_shard = (axis, dim)`): one piece, at offset
    local_rank(axis) x its size along `dim` (shards are equal: the mesh checks divisibility);
  - a tensor every rank holds whole (replicated): one piece at offset 0;
  - ZeRO's flat shards (the fp32 master weights and the two moments): each parameter part a shard holds
    is a contiguous range of the flattened (TP-local) parameter, cut into the few rectangles it covers
    (`rectangles`: at most 2 x ndim - 1), placed at the TP shard's offset.
Also: which rank writes which piece of the weights into the safetensors copy that inference reads
(`assign_writers`: one holder per piece, spread over the holders), and full tensors put back together
from such pieces (`assemble`).
Not responsible for: files, checksums, publication (`checkpoint/`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from meshlm.parallel.materialize import placement


@dataclass(frozen=True)
class Piece:
    """A rectangle of a full tensor: where it starts (`offsets`) and this rank's data for it (`tensor`, a view)."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)


class ShardedState(torch.Tensor):
    """A full tensor of `shape` of which this rank holds `pieces` (maybe none): what DCP saves and loads.

    It has no data of its own (like DTensor it is a wrapper subclass) and implements the hooks DCP asks
    any tensor for: the write items of its pieces with their offsets, the chunks a load must fill, and the
    piece for a given offset. Any other operation on it is an error."""

    pieces: list[Piece]

    @staticmethod
    def __new__(cls, shape, pieces: list[Piece], *, dtype: torch.dtype, device: torch.device):
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        self.pieces = pieces
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{func} on a ShardedState: it only carries this rank's pieces to a checkpoint")

    def __repr__(self) -> str:
        return f"ShardedState({list(self.shape)}, {[(p.offsets, p.sizes) for p in self.pieces]})"

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)),
                              properties=TensorProperties.create_from_tensor(p.tensor), size=self.shape))
                for p in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes)) for p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for p in self.pieces:
            if torch.Size(p.offsets) == index.offset:
                return p.tensor
        raise ValueError(f"{index.fqn}: this rank holds no piece at {list(index.offset or [])}")

    def local(self) -> torch.Tensor:
        """The one piece of a tensor this rank holds in one piece (not a ZeRO range)."""
        assert len(self.pieces) == 1, f"{len(self.pieces)} pieces"
        return self.pieces[0].tensor


# --------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------


def rectangles(start: int, end: int, shape) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the rectangles that elements [start, end) of a row-major tensor of `shape` cover,
    in memory order: each is contiguous (leading sizes 1, then a count, then whole trailing dims)."""
    shape = tuple(shape)
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:  # within one row: the rectangles of that row, one dim down
        return [((first, *o), (1, *s)) for o, s in rectangles(start - first * inner, end - first * inner, shape[1:])]
    out = []
    if start % inner:
        out += rectangles(start, (first + 1) * inner, shape)
    rows_from, rows_to = -(-start // inner), end // inner
    if rows_from < rows_to:
        out.append(((rows_from,) + (0,) * (len(shape) - 1), (rows_to - rows_from, *shape[1:])))
    if end % inner:
        out += rectangles(rows_to * inner, end, shape)
    return out


def _whole(t: torch.Tensor, tag, mesh) -> ShardedState:
    shape, offsets = placement(t.shape, tag, mesh)
    return ShardedState(shape, [Piece(offsets, t)], dtype=t.dtype, device=t.device)


def _ranged(flat: torch.Tensor, param: nn.Parameter, ranges, mesh) -> ShardedState:
    """The pieces of `param`'s full tensor held in `flat` (a ZeRO flat shard) at `ranges`:
    (start, end, shard_start) of the flattened TP-local parameter."""
    shape, tp_offsets = placement(param.shape, getattr(param, "_meshlm_shard", None), mesh)
    pieces = []
    for start, end, at in ranges:
        for offsets, sizes in rectangles(start, end, param.shape):
            n = math.prod(sizes)
            pieces.append(Piece(tuple(o + t for o, t in zip(offsets, tp_offsets)), flat[at:at + n].view(sizes)))
            at += n
    return ShardedState(shape, pieces, dtype=flat.dtype, device=flat.device)


# --------------------------------------------------------------------------------------------
# The state of a model and its optimizer
# --------------------------------------------------------------------------------------------


def _tags(model: nn.Module) -> dict[str, tuple[str, int] | None]:
    return {k: getattr(t, "_meshlm_shard", None) for k, t in model.state_dict(keep_vars=True).items()}


def _tied_names(model: nn.Module) -> dict[str, str]:
    """Under pipeline parallelism the last stage's copy of a tied embedding (`parallel.tied.TiedEmbedding`) is
    named "lm_head.weight" there; one process keeps its optimizer state as "embed.weight", and so does
    the checkpoint: {this rank's name: the checkpoint's}."""
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head.weight, "_meshlm_tied_copy", False):
        return {"lm_head.weight": "embed.weight"}
    return {}


def _renamed(optim: dict, names: dict[str, str]) -> dict:
    """An optimizer state dict with its per-parameter keys renamed by `names` (state and param groups)."""
    if not names:
        return optim
    out = dict(optim)
    if "state" in optim:
        out["state"] = {names.get(k, k): v for k, v in optim["state"].items()}
    if "param_groups" in optim:
        out["param_groups"] = [{**g, "params": [names.get(n, n) for n in g["params"]]} for g in optim["param_groups"]]
    return out


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh, *,
                     saving: bool = False) -> dict:
    """{"model": ..., "optim": ...} (no "optim" when `optimizer` is None) of `ShardedState`s over the live
    storage: DCP saves from it and loads into it in place (then `after_load`). Touches no data.
    `saving`: what this rank writes -- a tied embedding's copy (`_tied_names`) leaves its optimizer state to
    the first stage (its pieces, cut by another stage's ZeRO shards, would overlap that stage's); a load
    reads it like any other tensor."""
    state = _state(model, optimizer, mesh)
    names = _tied_names(model)
    if "optim" in state:
        state["optim"] = _renamed(state["optim"], names)
        if saving:
            for name in names.values():
                state["optim"]["state"].pop(name, None)
    return state


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, mesh) -> dict:
    if getattr(optimizer, "parts", None) is not None:  # ZeroAdamW: the flat shards are the state
        return _zero_state(model, optimizer, mesh)
    tags = _tags(model)
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": {k: _whole(t, tags.get(k), mesh) for k, t in model_sd.items()}}
    if optim_sd is not None:
        per_param = {fqn: {k: _whole(v, tags.get(fqn), mesh) if torch.is_tensor(v) and v.dim() > 0 else v
                           for k, v in s.items()} for fqn, s in optim_sd.get("state", {}).items()}
        state["optim"] = {**optim_sd, "state": per_param}
    return state


def _zero_state(model: nn.Module, optimizer, mesh) -> dict:
    """A ZeroAdamW's state: weights and moments from its flat shards (under ZeRO-3 the parameters
    themselves hold no data between uses); what the shards do not hold (buffers, frozen tensors) whole."""
    tags = _tags(model)
    model_sd = {k: t for k, t in model.state_dict(keep_vars=True).items()}
    by_param: dict[int, tuple[str, nn.Parameter, list]] = {}
    owner: dict[int, object] = {}
    for z in optimizer.parts:
        for name, p, start, end, at in z.param_ranges():
            by_param.setdefault(id(p), (name, p, []))[2].append((start, end, at))
        for b in z.buckets:
            for name, p in zip(b.names, b.params):
                by_param.setdefault(id(p), (name, p, []))
                owner[id(p)] = z
    state_of = {id(z): optimizer.state[z.param_shard] for z in optimizer.parts}
    model_out, optim_out = {}, {}
    for key, t in model_sd.items():
        if id(t) in by_param:
            model_out[key] = _ranged(owner[id(t)].param_shard.detach(), t, by_param[id(t)][2], mesh)
        else:
            model_out[key] = _whole(t.detach(), tags.get(key), mesh)
    for pid, (name, p, ranges) in by_param.items():
        s = state_of[id(owner[pid])]
        optim_out[name] = {"step": s["step"].clone(), "exp_avg": _ranged(s["exp_avg"], p, ranges, mesh),
                           "exp_avg_sq": _ranged(s["exp_avg_sq"], p, ranges, mesh)}
    return {"model": model_out, "optim": {"state": optim_out, "param_groups": optimizer.checkpoint_param_groups()}}


def unwrap(tree):
    """The same nesting with every `ShardedState` of one piece replaced by that piece's tensor."""
    if isinstance(tree, ShardedState):
        return tree.local()
    if isinstance(tree, dict):
        return {k: unwrap(v) for k, v in tree.items()}
    return tree


@torch.no_grad()
def after_load(state: dict, *, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Finish a load into `checkpoint_state`'s views: the optimizer's step counts and hyperparameters, and
    under ZeRO-1/2 the full parameters from the loaded master shards."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_state_dict,
    )

    if "optim" in state:
        state = {**state, "optim": _renamed(state["optim"], {v: k for k, v in _tied_names(model).items()})}
    if getattr(optimizer, "parts", None) is not None:
        optimizer.load_sharded_state(state["optim"])
        return
    if optimizer is None:
        set_model_state_dict(model, unwrap(state["model"]))
    else:
        set_state_dict(model, optimizer, model_state_dict=unwrap(state["model"]),
                       optim_state_dict=_own_groups(unwrap(state["optim"]), model, optimizer))


def _own_groups(optim: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The loaded optimizer state with each param group listing this rank's own parameters: a checkpoint keeps
    one rank's param groups (DCP writes a non-tensor value once), whose parameters under pipeline parallelism
    are another stage's, and torch then rebuilds groups without their hyperparameters. Groups match by index
    (every optimizer here has the same groups: decayed, not decayed); the hyperparameters are the checkpoint's."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    loaded = optim.get("param_groups")
    current = get_optimizer_state_dict(model, optimizer)["param_groups"]
    if not loaded or len(loaded) != len(current):
        return optim
    return {**optim, "param_groups": [{**old, "params": now["params"]} for old, now in zip(loaded, current)]}


# --------------------------------------------------------------------------------------------
# The weights as safetensors pieces (what inference reads)
# --------------------------------------------------------------------------------------------


def assign_writers(mine: dict[tuple, object], everyone: list[list[tuple]], rank: int) -> list:
    """The values of `mine` (keyed by piece identity: key, offsets, sizes) this rank writes: of the ranks
    holding an identical piece (`everyone[r]`: rank r's identities), one, chosen by a hash of the piece so
    that replicas share the writing."""
    holders: dict[tuple, list[int]] = {}
    for r, ids in enumerate(everyone):
        for ident in ids:
            holders.setdefault(ident, []).append(r)
    out = []
    for ident, value in mine.items():
        ranks = holders[ident]
        if ranks[zlib.crc32(repr(ident).encode()) % len(ranks)] == rank:
            out.append(value)
    return out


def weight_pieces(state_model: dict) -> dict[tuple, tuple[str, tuple[int, ...], Piece]]:
    """{(key, offsets, sizes): (key, full shape, piece)} of this rank's weights (a `checkpoint_state`'s "model")."""
    return {(k, p.offsets, p.sizes): (k, tuple(s.shape), p) for k, s in state_model.items() for p in s.pieces}


def piece_name(key: str, shape, piece: Piece) -> str:
    """The tensor name in a safetensors file: the key itself for a whole tensor, else key@offsets."""
    if piece.sizes == tuple(shape):
        return key
    return f"{key}@{','.join(map(str, piece.offsets))}"


def assemble(named: dict[str, torch.Tensor], layout: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Full tensors from safetensors pieces: `named` name -> tensor, `layout` name -> {"key", "offsets",
    "shape"} for the pieces that are not whole tensors. Raises ValueError when a tensor is not covered
    exactly once."""
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for name, t in named.items():
        where = layout.get(name)
        if where is None:
            out[name], covered[name] = t, covered.get(name, 0) + t.numel()
            continue
        key, offsets, shape = where["key"], where["offsets"], tuple(where["shape"])
        full = out.setdefault(key, t.new_zeros(shape))
        if len(offsets) != full.dim() or any(o + s > n for o, s, n in zip(offsets, t.shape, shape)):
            raise ValueError(f"piece {name} of shape {list(t.shape)} does not fit in {key} {list(shape)}")
        full[tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))] = t
        covered[key] = covered.get(key, 0) + t.numel()
    for key, full in out.items():
        if covered[key] != full.numel():
            raise ValueError(f"{key}: the pieces cover {covered[key]} of its {full.numel()} elements")
    return out
