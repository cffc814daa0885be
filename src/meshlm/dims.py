"""The parallel degrees: one type, `ParallelDims`, that config, mesh and planner share.

Responsible for: the degree of every parallelism (dp_replicate, dp_shard, tp, pp, cp, ep -- each field
defined here only), the mesh axes they make (`AXES` and the flattened `FLAT_AXES`), and `resolve`, which
fills in dp_shard=-1 and checks the degrees against a world size (ValueError naming the numbers and a fix).
`meshlm.config.ParallelConfig` (the [parallel] section: degrees plus their knobs), `meshlm.mesh` (which
builds process groups from resolved degrees) and `meshlm.planner.layout.Layout` (degrees plus the
planner's knobs) all are or extend this type. Torch-free: the planner and the config load without torch.
Not responsible for: process groups (`meshlm.mesh`), or model-dependent checks such as heads divisible
by tp (each strategy checks its own; the planner's `validate_layout` mirrors them).

Not frozen: `ParallelConfig` is edited in place (`cfg.parallel.tp = 2`), and a dataclass cannot mix
frozen and non-frozen classes along one hierarchy; `ParallelDims` and `Layout` hash by value all the same.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

from meshlm.rules import check_ep_groups

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
FLAT_AXES = {"dp": ("dp_replicate", "dp_shard"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
             "dp_shard_cp": ("dp_shard", "cp")}
ALL_AXES = AXES + tuple(FLAT_AXES)
_axis_degrees = operator.attrgetter(*AXES)  # the degree of each of AXES (the planner asks for world_size often)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt_set(values: list[int]) -> str:
    return "{" + ",".join(str(v) for v in values) + "}"


@dataclass(unsafe_hash=True)
class ParallelDims:
    """Degrees of each parallelism. `dp_shard = -1` takes what the others leave."""

    dp_replicate: int = 1  # data-parallel replicas (hybrid sharding with zero_stage > 0)
    dp_shard: int = -1  # data-parallel ranks that shard (ZeRO); -1: what the other degrees leave of the world
    tp: int = 1  # tensor parallelism (+ sequence parallelism below)
    pp: int = 1  # pipeline stages (schedule below)
    # context parallelism: every sequence split over cp ranks (parallel/context.py); dense models only (MoE: not
    # implemented yet)
    cp: int = 1
    ep: int = 1  # expert parallelism: each rank of an ep group holds num_experts / ep experts (parallel/expert.py)

    @classmethod
    def from_config(cls, parallel: "ParallelDims") -> "ParallelDims":
        """The degrees alone of a `ParallelConfig` or a planner `Layout` (which extend this type)."""
        return cls(**{f.name: getattr(parallel, f.name) for f in dataclasses.fields(cls)})

    @property
    def is_resolved(self) -> bool:
        return self.dp_shard != -1

    @property
    def world_size(self) -> int:
        self._require_resolved()
        return math.prod(_axis_degrees(self))

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of model replicas that see different sequences."""
        self._require_resolved()
        return self.dp_replicate * self.dp_shard

    def degree(self, axis: str) -> int:
        """Size of a mesh axis (one of ALL_AXES)."""
        if axis in FLAT_AXES:
            self._require_resolved()
            return math.prod(getattr(self, a) for a in FLAT_AXES[axis])
        if axis not in AXES:
            raise ValueError(f"axis={axis!r} is unknown; choose one of {list(ALL_AXES)}")
        return getattr(self, axis)

    def resolve(self, world_size: int) -> "ParallelDims":
        """Fill in dp_shard=-1 and check the degrees against `world_size`; returns a new ParallelDims.

        Raises ValueError naming the numbers and a fix, before any process group is touched.
        """
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be >= 1")
        for name in ("pp", "dp_replicate", "cp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value} must be an integer >= 1")
        if not isinstance(self.dp_shard, int) or (self.dp_shard != -1 and self.dp_shard < 1):
            raise ValueError(f"dp_shard={self.dp_shard} must be >= 1, or -1 to take what the other "
                             "degrees leave of the world size")
        fixed = [a for a in AXES if a != "dp_shard" or self.dp_shard != -1]
        product = math.prod(getattr(self, a) for a in fixed)
        terms = " x ".join(f"{a}={getattr(self, a)}" for a in fixed)
        if self.dp_shard == -1:
            if world_size % product != 0:
                more = (f"; or start {product} ranks (or a multiple), e.g. --nproc {product}"
                        if world_size < product else "")
                raise ValueError(f"{terms} = {product} does not divide world size {world_size}; "
                                 f"{self._fix_hint(fixed, world_size, exact=False)}{more}")
            dims = dataclasses.replace(self, dp_shard=world_size // product)
        else:
            if product != world_size:
                raise ValueError(f"{terms} = {product} != world size {world_size}; "
                                 f"{self._fix_hint(fixed, world_size, exact=True)}, "
                                 "or set dp_shard=-1 to take what the others leave")
            dims = self
        check_ep_groups(dims.ep, dp_shard=dims.dp_shard, cp=dims.cp)
        return dims

    def _fix_hint(self, fixed: list[str], world_size: int, *, exact: bool) -> str:
        """'choose tp in {1,2,4}' for each degree > 1 that could alone make the layout fit."""
        hints = []
        for axis in reversed(fixed):  # innermost first: the usual thing to change is tp
            value = getattr(self, axis)
            if value == 1:
                continue
            rest = math.prod(getattr(self, a) for a in fixed) // value
            if world_size % rest != 0:
                continue
            choices = [d for d in _divisors(world_size // rest) if not exact or d * rest == world_size]
            hints.append(f"choose {axis} in {_fmt_set(choices)}")
        if not hints:
            return f"choose degrees whose product divides {world_size}"
        return " or ".join(hints)

    def _require_resolved(self) -> None:
        if not self.is_resolved:
            raise ValueError("dp_shard=-1 is not resolved yet; call dims.resolve(world_size) first")


