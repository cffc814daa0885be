"""Collective costs: where a parallel group sits on the cluster, and how long one collective takes there.

Responsible for: placing a group of ranks on the two link tiers (`group_span`, `link_name`) and the
time of one all-reduce, all-gather, reduce-scatter, all-to-all or point-to-point message
(`collective_time`), from the cluster's per-collective, per-tier fits (`Cluster.collective_fit`:
latency per hop + achieved bandwidth); one MoE layer's expert dispatch + combine by DeepEP-style kernels, which send
a token to each other node once (`expert_all_to_all`: serving's large-EP engines, training's flex dispatcher);
`CollectiveTimes`, the same answers remembered for one cluster
(a layout search asks a few thousand distinct questions millions of times).
Not responsible for: which collectives a layout issues, how many, or what overlaps them (`cost.py`).

Algorithms (NCCL's, as in its documentation and nccl-tests' "bus bandwidth" convention):
  * reduce-scatter / all-gather: a ring moving (n - 1) / n of the buffer per rank; all-reduce is one of
    each. Latency: a ring pays a hop per step; past 16 ranks NCCL switches all-reduce to trees (latency
    ~ log n), but all-gather and reduce-scatter have no tree: one ring over all n ranks, n - 1 steps of
    which n_out - 1 cross domains (NCCL's own cost model, src/graph/tuning.cc: nsteps = nRanks - 1,
    nInterSteps = nNodes - 1 for both), so their latency grows linearly with the ranks -- what NCCL 2.23's
    PAT algorithm was added to cut at one GPU per node (NVIDIA, "New Scaling Algorithm and Initialization
    with NCCL 2.23", 2024). A many-node ZeRO-3 / FSDP gather per layer pays it every call.
  * a group spanning both tiers runs hierarchically: inside each scale-up domain on the whole buffer, then
    across domains on 1/n_in of it, each GPU on its own NIC (rail-optimised fabrics, one NIC per GPU).
  * all-to-all: every rank sends (n - 1) / n of its bytes; the part leaving the domain rides the NICs, the
    rest NVLink, concurrently; one message per peer.
  * p2p: one message, one hop.
  * a fit may carry seconds per call (`call_overhead`), paid once per collective on the tier it crosses
    (scale-out when it leaves the domain): on an emulated cluster, what a call waits for busy peers
    sharing the host's cores, which does not grow with the ring's hops.
  * On a cluster with `flat_rings` (gloo, e.g. an emulated one) a group spanning both tiers runs one ring over
    all its ranks instead, paced by its node-crossing hops: one per domain and direction, each carrying the
    whole ring's traffic. The scale-out fit is one rank's share of its node's link with every rank of the
    node crossing at once (calibrate.measure_tiers); a group with n_in ranks in a node has 1 / n_in of those
    ranks' rings crossing, so its crossing hop gets n_in such shares. Where the cluster also has a "flat"
    fit (one ring over all the ranks of an emulated cluster, timed as such), a crossing hop gets that
    ring's bandwidth, shared by the rings crossing the same link (scale-up size / n_in of them).
"""

from __future__ import annotations

import math

from meshlm.planner.cluster import Cluster

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def group_span(stride: int, size: int, scaleup_size: int) -> tuple[int, int]:
    """(members per scale-up domain, domains) of a group of `size` ranks spaced `stride` apart."""
    if size <= 1:
        return 1, 1
    if stride >= scaleup_size:
        return 1, size
    n_in = max(1, min(size, scaleup_size // stride))
    return n_in, math.ceil(size / n_in)


def link_name(n_in: int, n_out: int) -> str:
    if n_in * n_out <= 1:
        return "none"
    if n_out == 1:
        return "scale-up"
    return "scale-out" if n_in == 1 else "hierarchical"


def _hops(n: int) -> float:
    # Ring latency grows with n; at scale NCCL switches to trees, whose latency grows with log n.
    return n - 1 if n <= 16 else 2 * math.ceil(math.log2(n))


def _ring(nbytes: float, n: int, fit: tuple[float, float]) -> float:
    """One reduce-scatter (or all-gather) phase of a `nbytes` buffer over a ring of n ranks."""
    if n <= 1:
        return 0.0
    latency, bandwidth = fit
    return (n - 1) / n * nbytes / bandwidth + _hops(n) * latency


def call_overhead(cluster: Cluster, kind: str, tier: str) -> float:
    """Seconds one call of `kind` costs on `tier` beyond its hops and bytes, where the cluster's fit has
    it (the optional third element; 0 otherwise)."""
    fit = cluster.collective_fits.get(tier, {}).get(kind)
    return float(fit[2]) if fit is not None and len(fit) > 2 else 0.0


def collective_time(kind: str, nbytes: float, span: tuple[int, int], cluster: Cluster) -> float:
    """Seconds for one collective; `nbytes` is the full (unsharded) buffer, or for all_to_all the
    bytes each rank sends in total, or for p2p the message."""
    if nbytes <= 0:  # nothing to move: no collective is issued (a dense model's expert gradients)
        return 0.0
    n_in, n_out = span
    base = _collective_time(kind, nbytes, span, cluster)
    if n_in * n_out <= 1 and kind != "p2p":
        return base
    tier = "scale-up" if n_out == 1 else "scale-out"
    if (cluster.flat_rings and n_in > 1 and n_out > 1 and kind in ("reduce_scatter", "all_gather", "all_reduce")
            and kind in cluster.collective_fits.get("flat", {})):
        tier = "flat"
    return base + call_overhead(cluster, kind, tier)


class CollectiveTimes:
    """`collective_time` on one cluster, each answer remembered by (kind, bytes, span). Made for one search or
    estimate (`placement.world_setup`) and dropped with it: never module-global, never shared between clusters.
    It holds one entry per distinct question: 1,856 for the 180k layouts of llama3-405b on 16,384 H100s,
    which ask 2.4M times."""

    __slots__ = ("cluster", "_known")

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._known: dict = {}

    def __call__(self, kind: str, nbytes: float, span: tuple[int, int]) -> float:
        key = (kind, nbytes, span)
        t = self._known.get(key)
        if t is None:
            t = self._known[key] = collective_time(kind, nbytes, span, self.cluster)
        return t

    def __len__(self) -> int:
        return len(self._known)


def _collective_time(kind: str, nbytes: float, span: tuple[int, int], cluster: Cluster) -> float:
    n_in, n_out = span
    up = lambda k: cluster.collective_fit(k, "scale-up")  # noqa: E731
    out = lambda k: cluster.collective_fit(k, "scale-out")  # noqa: E731
    if kind == "p2p":
        latency, bandwidth = up("p2p") if n_out == 1 else out("p2p")
        return nbytes / bandwidth + latency
    if cluster.flat_rings and n_out > 1 and kind in ("reduce_scatter", "all_gather", "all_reduce"):
        flat = cluster.collective_fits.get("flat", {}).get(kind) if n_in > 1 else None
        if flat is not None:  # measured on one ring of every rank: a node-crossing hop's own bandwidth,
            # shared by the scaleup_size / n_in rings of such groups that cross a node's link at once
            latency, bandwidth = float(flat[0]), float(flat[1]) * n_in / max(n_in, cluster.scaleup_size)
        else:
            latency, bandwidth = out(kind)
            bandwidth *= n_in
        phase = _ring(nbytes, n_in * n_out, (latency, bandwidth))
        return 2 * phase if kind == "all_reduce" else phase
    if kind in ("reduce_scatter", "all_gather"):
        # Bytes: inside the domain on the full buffer, then across domains on 1/n_in of it (one NIC per GPU).
        # Latency: one ring over all n_in x n_out ranks (no tree for these): n - n_out hops inside, n_out - 1 across.
        (lat_up, bw_up), (lat_out, bw_out) = up(kind), out(kind)
        t = _ring(nbytes, n_in, (0.0, bw_up)) + _ring(nbytes / n_in, n_out, (0.0, bw_out))
        if n_out == 1:
            return t + (n_in - 1) * lat_up
        return t + (n_in * n_out - n_out) * lat_up + (n_out - 1) * lat_out
    if kind == "all_reduce":
        return 2 * _ring(nbytes, n_in, up(kind)) + 2 * _ring(nbytes / n_in, n_out, out(kind))
    if kind == "all_to_all":
        n = n_in * n_out
        if n <= 1:
            return 0.0
        (lat_up, bw_up), (lat_out, bw_out) = up(kind), out(kind)
        inside = nbytes * (n_in - 1) / n / bw_up
        across = nbytes * (n - n_in) / n / bw_out if n_out > 1 else 0.0
        return max(inside, across) + (n - 1) * (lat_out if n_out > 1 else lat_up)
    raise AssertionError(f"unknown collective {kind}")


def other_nodes_reached(n_out: int, top_k: int, groups: tuple[int, int] = (1, 1)) -> float:
    """Expected nodes other than its own that one token's `top_k` expert copies land on, over an expert group of
    `n_out` nodes holding the experts in order (expert-parallel rank e the e-th block of them: Megatron-Core, DeepEP).
    Routing uniform over the experts, or group-limited (`groups` = (n_group, topk_group): the experts in n_group
    contiguous groups, a token's top_k taken from the topk_group groups its router picks -- DeepSeek-V3's node-limited
    routing, "each token will be sent to at most M nodes", M = 4 (arXiv:2412.19437, Sec. 2.1.2; its config.json
    n_group 8, topk_group 4; Megatron-Core's moe_router_num_groups / moe_router_group_topk, which Megatron-Bridge
    reads from it). The router ranks the groups by their best experts' scores (DeepSeek-V3: the sum of the top two),
    so each chosen group receives some of the copies, top_k / topk_group of them on average, spread over the nodes
    it lies on; the groups drawn uniformly (forced load balancing's random logits). A Monte Carlo of that router
    agrees within 5% (tests/test_planner_moe.py). Where the groups do not fall on whole nodes (n_group and n_out
    dividing neither way) routing is taken as unlimited."""
    n_group, topk_group = groups
    limited = 1 <= topk_group < n_group
    if limited and n_out % n_group == 0:  # each group on g whole nodes
        g = n_out // n_group
        hit = topk_group * g * (1 - (1 - 1 / g) ** (top_k / topk_group))
    elif limited and n_group % n_out == 0:  # several groups a node: each node a chosen one lies on
        per_node = n_group // n_out
        hit = n_out * (1 - math.comb(n_group - per_node, topk_group) / math.comb(n_group, topk_group))
    else:
        hit = n_out * (1 - (1 - 1 / n_out) ** top_k)  # nodes receiving at least one copy
    return hit * (n_out - 1) / n_out  # less its own (one of the n_out, alike in every node)


def expert_all_to_all(token_bytes: float, *, top_k: int, span: tuple[int, int], up: tuple[float, float],
                      out: tuple[float, float], low_latency: bool, groups: tuple[int, int] = (1, 1)) -> float:
    """Seconds of one MoE layer's dispatch + combine of the tokens one GPU holds (`token_bytes`: their hidden
    states, dispatch + combine bytes summed) over an expert group of `span` (GPUs per scale-up domain, domains);
    `up` / `out`: (latency, bandwidth) of the all-to-all on each tier.

    Low-latency kernels (decode; DeepEP V1 README, "Low-latency kernels with pure RDMA"): each of a token's top-k
    copies goes to its expert's GPU on its own -- those on other nodes over the NIC, the rest over NVLink, at
    once. DeepEP's table (H800, CX7 400 Gb/s, 128 tokens, hidden 7168, top-8, FP8 dispatch + BF16 combine) fits
    it: at EP32 (3/4 of the copies leave the node) dispatch 155 us / combine 273 us against 142 / 275 us here with
    the NIC at 40 GB/s (0.8 x 50 GB/s); at EP128 192 / 369 us against 178 / 345 us. Normal kernels (prefill;
    DeepEP's "Normal kernels with NVLink and RDMA forwarding", DeepSeek-V3 report Sec. 3.4): a token crosses to
    each other node holding one of its experts once and is forwarded inside it over NVLink. Either way all peers
    are written concurrently, so a call pays one latency per tier, not one per peer. `groups`: the router's
    (n_group, topk_group) where it limits a token's nodes (`other_nodes_reached`): fewer crossings for the normal
    kernels; a low-latency kernel's copies leave the node as often either way (its own node is chosen as often as
    any)."""
    n_in, n_out = span
    n = n_in * n_out
    if n <= 1:
        return 0.0
    (lat_up, bw_up), (lat_out, bw_out) = up, out
    local = token_bytes * top_k * (n_in - 1) / n
    if low_latency:
        across = token_bytes * top_k * (n - n_in) / n
    else:
        across = token_bytes * other_nodes_reached(n_out, top_k, groups) if n_out > 1 else 0.0
    latency = 2 * (lat_out if n_out > 1 else lat_up)
    return max(local / bw_up, across / bw_out if n_out > 1 else 0.0) + latency
