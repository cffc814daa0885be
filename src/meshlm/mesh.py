"""The device mesh: parallel degrees, their validation, and the named process groups.

Responsible for: the pure mapping from a global rank to its coordinate on each axis of resolved
`ParallelDims` (`rank_coords`, `group_ranks`; the degrees themselves and their checks against the world
size are `meshlm.dims`, re-exported here), and `Mesh`, an explicit object that owns the process group of
every axis and the `CommStats` that count what moves over them.
Not responsible for: starting the default process group (`meshlm.distributed`), collectives
(`meshlm.comm`), or model-dependent checks such as heads divisible by tp (each strategy checks its own).

Rank order. Axes are laid out row-major in the order ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
tp is innermost, so the ranks of one tp group are consecutive global ranks, which launchers place on
one node -- tp all-reduces/all-gathers every layer and needs the fastest links (NVLink). cp exchanges
KV blocks every layer, next in bandwidth need. dp_shard (FSDP/ZeRO gathers) and dp_replicate (one
gradient all-reduce per step) tolerate slower links. pp is outermost: it moves only activations
between neighbouring stages, point to point, the least traffic, so it is the axis that crosses nodes.

Flattened views: "dp" = dp_replicate x dp_shard (gradient reduction, data sharding) and
"dp_cp" = dp_replicate x dp_shard x cp (the ranks that see different tokens of one model replica;
loss and gradients are reduced over them when cp > 1), and "dp_shard_cp" = dp_shard x cp (what ZeRO
shards over when cp > 1: the cp ranks hold the same parameters, so they share the shard). ep does not get an axis of its own here:
experts are spread over dp_shard x cp (see `ParallelDims.resolve`); the expert-parallel transform
builds its groups from those ranks and attaches them with `Mesh.with_axes` (`meshlm.parallel.expert.expert_mesh`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshlm.comm_stats import CommStats
from meshlm.dims import ALL_AXES, AXES, FLAT_AXES, ParallelDims

__all__ = ["ALL_AXES", "AXES", "FLAT_AXES", "Mesh", "ParallelDims", "build_mesh", "create_groups", "every_group",
           "group_ranks", "rank_coords"]

def rank_coords(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Coordinate of global `rank` on every axis (AXES and the flattened ones), tp fastest-varying."""
    world = dims.world_size
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside the mesh of world size {world}")
    coords: dict[str, int] = {}
    rest = rank
    for axis in reversed(AXES):
        coords[axis] = rest % dims.degree(axis)
        rest //= dims.degree(axis)
    for flat, parts in FLAT_AXES.items():
        c = 0
        for part in parts:  # row-major, like the global order
            c = c * dims.degree(part) + coords[part]
        coords[flat] = c
    return {a: coords[a] for a in ALL_AXES}


def _rank_of(dims: ParallelDims, coords: dict[str, int]) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * dims.degree(axis) + coords[axis]
    return rank


def group_ranks(dims: ParallelDims, rank: int, axis: str) -> list[int]:
    """Global ranks of the group of `rank` along `axis`, ordered by their coordinate on it."""
    coords = rank_coords(dims, rank)
    parts = FLAT_AXES.get(axis, (axis,))
    dims.degree(axis)  # validates the name
    ranks = []
    for c in range(dims.degree(axis)):
        member = dict(coords)
        for part in reversed(parts):
            member[part] = c % dims.degree(part)
            c //= dims.degree(part)
        ranks.append(_rank_of(dims, member))
    return ranks


def every_group(world_size: int, members_of) -> list[list[int]]:
    """The groups of one axis, each once, in the order of their lowest rank (the same on every rank):
    `members_of(rank)` gives the global ranks of `rank`'s group."""
    every = []
    for r in range(world_size):
        ranks = members_of(r)
        if ranks not in every:
            every.append(ranks)
    return every


def create_groups(every: list[list[int]], rank: int):
    """Create one process group per entry of `every` (the ranks of each group of one axis) and return
    the one holding `rank` (None if none does). Collective over the world: every rank must call it
    with the same `every`, since every rank takes part in creating every group, in the same order."""
    mine = None
    for ranks in every:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def cuda_marker():
    """A CUDA event recorded on the current stream now (`CommStats.device_clock`)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class Mesh:
    """Named process groups over the world, plus the `CommStats` of everything sent over them.

    Build it with `build_mesh`. A world of one process needs no process group: every axis then has
    size 1, `group()` returns None, and `meshlm.comm` skips collectives on one-rank axes.
    """

    def __init__(self, dims: ParallelDims, *, device_type: str, rank: int, device_mesh=None,
                 views: dict | None = None, stats: CommStats | None = None, groups: dict | None = None,
                 extra_axes: dict | None = None, first_rank: int = 0, wait_timeout_s: float | None = None):
        """`first_rank`: the mesh covers global ranks first_rank .. first_rank + dims.world_size - 1 of a larger
        world (`build_sub_meshes`); `rank` is this process's global rank."""
        assert dims.is_resolved
        self.dims = dims
        self.device_type = device_type
        self.rank = rank
        self.first_rank = first_rank
        self.world_size = dims.world_size
        self.device_mesh = device_mesh  # torch DeviceMesh (for DTensor users); None for one process
        self._views = views or {}  # flattened axis name -> its 1-D DeviceMesh
        self.stats = stats if stats is not None else CommStats()
        if device_type == "cuda" and self.stats.device_clock is None:
            self.stats.device_clock = cuda_marker  # collectives' seconds are the GPU's, not the host's queueing
        # parallel.collective_wait = "blocking" on a GPU: seconds the host waits for each collective to complete
        # on the device before it raises CollectiveError (`comm._await_device`); None: the host runs ahead
        self.wait_timeout_s = wait_timeout_s
        self._groups = groups or {}  # axis -> ProcessGroup replacing the device mesh's (see `duplicate`)
        # axis -> (global ranks of this rank's group by coordinate, its ProcessGroup, the ranks of every
        # group of the axis or None); see `with_axes`
        self._extra_axes = extra_axes or {}
        self.coords = rank_coords(dims, rank - first_rank)

    @property
    def is_first(self) -> bool:
        """This process is the mesh's first rank (the one that drives a serving engine)."""
        return self.rank == self.first_rank

    def size(self, axis: str) -> int:
        if axis in self._extra_axes:
            return len(self._extra_axes[axis][0])
        return self.dims.degree(axis)

    def local_rank(self, axis: str) -> int:
        """This rank's coordinate along `axis` (its rank within the axis group)."""
        if axis in self._extra_axes:
            return self._extra_axes[axis][0].index(self.rank)
        self.dims.degree(axis)
        return self.coords[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, by coordinate."""
        if axis in self._extra_axes:
            return list(self._extra_axes[axis][0])
        return [self.first_rank + r for r in group_ranks(self.dims, self.rank - self.first_rank, axis)]

    def global_rank(self, axis: str, coord: int) -> int:
        """Global rank of the member with coordinate `coord` in this rank's `axis` group."""
        return self.ranks(axis)[coord]

    def group(self, axis: str):
        """The ProcessGroup of this rank's group along `axis` (None in a one-process world)."""
        if axis in self._extra_axes:
            return self._extra_axes[axis][1]
        self.dims.degree(axis)
        if axis in self._groups:
            return self._groups[axis]
        if self.device_mesh is None:
            return None
        if axis in self._views:
            return self._views[axis].get_group()
        return self.device_mesh.get_group(axis)

    def duplicate(self, *axes: str) -> "Mesh":
        """The same layout with new, independent process groups for `axes` (the other axes keep
        this mesh's groups) and this mesh's CommStats; collective over the world (every rank must
        call it, with the same axes). An axis added by `with_axes` can be duplicated when it was
        added with `every` (the ranks of each of its groups).

        For a strategy that issues two streams of collectives on one axis whose relative order is
        not the same on every rank (ZeRO-3's parameter gathers next to its gradient reduce-scatters):
        each stream on its own group stays in order."""
        if self.device_mesh is None:
            return self
        groups, extra_axes = dict(self._groups), dict(self._extra_axes)
        for axis in axes:
            if self.size(axis) == 1:
                continue
            if axis in extra_axes:
                ranks, _, every = extra_axes[axis]
                if every is None:
                    raise ValueError(f"axis {axis!r} was added by with_axes without `every`: its groups cannot "
                                     "be created again; pass every= to with_axes")
                extra_axes[axis] = (ranks, create_groups(every, self.rank), every)
            else:
                every = every_group(self.world_size, lambda r: group_ranks(self.dims, r, axis))  # noqa: B023
                groups[axis] = create_groups(every, self.rank)
        return Mesh(self.dims, device_type=self.device_type, rank=self.rank, device_mesh=self.device_mesh,
                    views=self._views, stats=self.stats, groups=groups, extra_axes=extra_axes,
                    wait_timeout_s=self.wait_timeout_s)

    def with_axes(self, axes: dict, *, every: dict | None = None) -> "Mesh":
        """This mesh (same groups, same CommStats) plus axes it does not derive from `dims`: `axes`
        maps a new axis name to (the global ranks of this rank's group in coordinate order, its
        ProcessGroup -- None where the group has one rank). The caller creates the groups (every
        rank takes part in creating every group, e.g. with `create_groups`); `every` may map an
        axis to the ranks of each of its groups, in the order they were created, which lets
        `duplicate` create them again. `meshlm.parallel.expert.expert_mesh` adds "ep" and "ep_dp" this way."""
        every = every or {}
        for axis, (ranks, _) in axes.items():
            if axis in ALL_AXES:
                raise ValueError(f"axis {axis!r} is one of the mesh's own axes {list(ALL_AXES)}; choose another name")
            if self.rank not in ranks:
                raise ValueError(f"axis {axis!r}: rank {self.rank} is not in its own group {list(ranks)}")
        return Mesh(self.dims, device_type=self.device_type, rank=self.rank, device_mesh=self.device_mesh,
                    views=self._views, stats=self.stats, groups=self._groups,
                    extra_axes={**self._extra_axes, **{a: (list(r), g, every.get(a)) for a, (r, g) in axes.items()}},
                    first_rank=self.first_rank, wait_timeout_s=self.wait_timeout_s)

    def __repr__(self) -> str:
        degrees = ", ".join(f"{a}={self.size(a)}" for a in AXES)
        return f"Mesh({degrees}, ep={self.dims.ep}, rank={self.rank}, device_type={self.device_type!r})"


def build_mesh(dims: ParallelDims, *, device_type: str, stats: CommStats | None = None,
               wait_timeout_s: float | None = None) -> Mesh:
    """Resolve `dims` against the world and create every axis group (collective over all ranks).
    `wait_timeout_s`: `Mesh.wait_timeout_s` (a GPU's blocking collective waits).

    Needs the default process group when the world has more than one rank (`init_distributed`).
    """
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    dims = dims.resolve(world_size)
    if world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return Mesh(dims, device_type=device_type, rank=0, stats=stats, wait_timeout_s=wait_timeout_s)
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(device_type, tuple(dims.degree(a) for a in AXES), mesh_dim_names=AXES)
    # Flattened views are kept here rather than sliced from the root mesh later (torch deprecates that).
    views = {flat: device_mesh[parts]._flatten(flat) for flat, parts in FLAT_AXES.items()}
    rank = dist.get_rank()
    mesh = Mesh(dims, device_type=device_type, rank=rank, device_mesh=device_mesh, views=views, stats=stats,
                wait_timeout_s=wait_timeout_s)
    for axis in ALL_AXES:  # the torch groups must agree with our pure rank arithmetic
        assert dist.get_process_group_ranks(mesh.group(axis)) == mesh.ranks(axis), axis
    return mesh


def build_sub_meshes(parts: list[ParallelDims], *, device_type: str, stats: CommStats | None = None) -> Mesh:
    """One mesh per entry of `parts`, over consecutive global ranks of the world (the first part's ranks
    first), each with the process groups of its own axes; returns the mesh of the part holding this rank.
    Collective over the world: every rank creates every group, in the same order. For engines that run side by
    side in one launch, each its own layout (disaggregated serving's prefill and decode instances)."""
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    total = sum(d.world_size for d in parts)
    if total != world_size:
        raise ValueError(f"the parts' layouts use {total} ranks but this launch has {world_size}; start {total} ranks")
    rank = dist.get_rank() if world_size > 1 else 0
    mine, first = None, 0
    for dims in parts:
        groups = {}
        for axis in ALL_AXES:
            if dims.degree(axis) == 1:
                continue
            every = [[first + r for r in ranks]
                     for ranks in every_group(dims.world_size, lambda r: group_ranks(dims, r, axis))]  # noqa: B023
            groups[axis] = create_groups(every, rank)
        if first <= rank < first + dims.world_size:
            mine = Mesh(dims, device_type=device_type, rank=rank, stats=stats, groups=groups, first_rank=first)
        first += dims.world_size
    return mine
