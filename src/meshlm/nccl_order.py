"""NCCL's ordering rules, checked without a GPU: replay what every rank issued and find where it would hang.

Responsible for: the record of one rank's communication as NCCL sees it (`TracedOp`: a collective or one
group of sends and receives on one communicator; `TracedWait`: the rank waited for an earlier op), and
`replay`, which runs the records of all ranks under NCCL's rules and returns the problems it finds --
a deadlock (naming every stuck rank and what it waits in), a collective that the members issue
differently, a send and receive that NCCL would pair although they do not belong together, or an op whose
partner never comes. `comm_stats.CommStats(keep_trace=True)` records what `meshlm.comm` issues in this form.
Not responsible for: recording (comm.py) or running anything; it is torch-free.

The rules (what gloo, the CPU backend the tests run on, does not enforce: its sends are buffered, its
receives match by tag, its timeouts raise):
- every communicator runs its ops in the order a rank issued them, one at a time (one stream per
  communicator and rank): an op starts when the previous op on that communicator has completed;
- an op issued after the rank waited for another op starts only after that one completed (the wait makes
  the compute stream wait, and the next op's stream waits for the compute stream);
- a collective completes once every member runs it; the members' n-th collectives on a communicator are
  one op, so they must be the same collective with the same size (an all-to-all's sizes may differ);
- a group of sends and receives (`batch_isend_irecv`) runs as one: each send completes once the matching
  receive runs on the peer, and the other way round (no buffering); the group completes when all of its
  ops have. Sends and receives are paired in issue order per (sender, receiver) on a communicator -- NCCL
  has no tags -- so the k-th send from a to b is the k-th receive at b from a.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TracedOp:
    """One op as NCCL runs it: a collective (`op` its name) or a group of point-to-point ops (`op` = "p2p",
    `p2p` = ((kind "send"/"recv", peer global rank, bytes, tag), ...)) on the communicator `group`."""

    group: str  # the communicator: the same name on every member
    ranks: tuple[int, ...]  # its members' global ranks
    op: str
    nbytes: int = 0
    p2p: tuple[tuple[str, int, int, int], ...] = ()
    axis: str = ""  # the mesh axis it was issued on (for messages)

    def describe(self) -> str:
        if self.op != "p2p":
            return f"{self.op} of {self.nbytes} B on {self.axis or self.group} {list(self.ranks)}"
        parts = [f"{kind} {nbytes} B {'to' if kind == 'send' else 'from'} rank {peer} (tag {tag})"
                 for kind, peer, nbytes, tag in self.p2p]
        return f"[{', '.join(parts)}] on {self.axis or self.group} {list(self.ranks)}"


@dataclass(frozen=True)
class TracedWait:
    """The rank waited (wait(), a blocking call) for its op number `op` (an index among its TracedOps)."""

    op: int


@dataclass
class _Item:
    rank: int
    index: int  # among the rank's ops
    op: TracedOp
    after: int | None = None  # the op issued before it on the same communicator
    waits: int = 0  # how many of the rank's waits came before it
    pending: set = field(default_factory=set)  # p2p: indices of ops not yet matched
    done: bool = False


def replay(traces: dict[int, list] | list[list]) -> list[str]:
    """Run every rank's record (`TracedOp`s and `TracedWait`s in issue order, by global rank) under NCCL's
    rules; return the problems found, [] when the records would complete on NCCL."""
    by_rank = dict(enumerate(traces)) if isinstance(traces, list) else dict(traces)
    items: dict[tuple[int, int], _Item] = {}
    problems: list[str] = []
    # (group, sender, receiver) -> [(rank, index, op index) of the k-th send] / of the k-th receive
    sends, recvs = defaultdict(list), defaultdict(list)
    collectives = defaultdict(list)  # (group, rank) -> indices of its collectives on the group, in order
    waited = defaultdict(list)  # rank -> the ops it waited for, in order
    for rank, trace in sorted(by_rank.items()):
        last_on_group: dict[str, int] = {}
        ops: list[_Item] = []
        for entry in trace:
            if isinstance(entry, TracedWait):
                waited[rank].append(entry.op)
                continue
            i = len(ops)
            item = _Item(rank, i, entry, after=last_on_group.get(entry.group), waits=len(waited[rank]))
            last_on_group[entry.group] = i
            if entry.op == "p2p":
                item.pending = set(range(len(entry.p2p)))
                for j, (kind, peer, _, _) in enumerate(entry.p2p):
                    key = (entry.group, rank, peer) if kind == "send" else (entry.group, peer, rank)
                    (sends if kind == "send" else recvs)[key].append((rank, i, j))
            else:
                collectives[(entry.group, rank)].append(i)
            items[(rank, i)] = item
            ops.append(item)

    partner = _pair_messages(items, sends, recvs, problems)
    coll_peer = _match_collectives(items, collectives, problems)
    if problems:
        return problems
    return _run(items, partner, coll_peer, waited, ranks=list(by_rank))


def _pair_messages(items, sends, recvs, problems: list[str]) -> dict:
    """(rank, op, index in its group) -> its partner's: the k-th send from a to b with the k-th receive at b
    from a (NCCL's pairing); a pair whose sizes or tags differ, and an op left over, are problems."""
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for key in set(sends) | set(recvs):
        s, r = sends.get(key, []), recvs.get(key, [])
        for a, b in zip(s, r):
            partner[a], partner[b] = b, a
            sop, rop = items[a[:2]].op.p2p[a[2]], items[b[:2]].op.p2p[b[2]]
            if sop[2] != rop[2] or sop[3] != rop[3]:
                problems.append(f"rank {a[0]}'s send ({sop[2]} B, tag {sop[3]}) and rank {b[0]}'s receive "
                                f"({rop[2]} B, tag {rop[3]}) on {items[a[:2]].op.axis or key[0]} are paired by "
                                "NCCL (the same place in the order between the two ranks) but do not belong together")
        for who, extra in (("send", s[len(r):]), ("receive", r[len(s):])):
            for rank, i, _ in extra:
                problems.append(f"rank {rank}: {items[(rank, i)].op.describe()} has a {who} that no peer matches")
    return partner


def _match_collectives(items, collectives, problems: list[str]) -> dict:
    """(rank, op) -> every member's (rank, op) of the same collective: each member's n-th on a communicator."""
    group_members: dict[str, tuple[int, ...]] = {}
    for (group, rank), idx in collectives.items():
        group_members[group] = items[(rank, idx[0])].op.ranks
    coll_peer: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for group, members in group_members.items():
        lists = {m: collectives.get((group, m), []) for m in members}
        n = max(len(v) for v in lists.values())
        for k in range(n):
            present = {m: v[k] for m, v in lists.items() if k < len(v)}
            ops = {m: items[(m, i)].op for m, i in present.items()}
            if len(present) < len(members):
                missing = sorted(set(members) - set(present))
                first = next(iter(ops.values()))
                problems.append(f"ranks {missing} never issue the {first.describe()} that ranks "
                                f"{sorted(present)} issue")
                continue
            # an all-to-all's members send what their splits say (uneven under expert parallelism)
            kinds = {(o.op, o.nbytes if o.op != "all_to_all" else 0) for o in ops.values()}
            if len(kinds) > 1:
                problems.append("collective number {} on {} differs between ranks: {}".format(
                    k, next(iter(ops.values())).axis or group,
                    "; ".join(f"rank {m}: {o.op} of {o.nbytes} B" for m, o in sorted(ops.items()))))
            for m, i in present.items():
                coll_peer[(m, i)] = sorted(present.items())
    return coll_peer


def _run(items, partner, coll_peer, waited, *, ranks) -> list[str]:
    """Advance every op that may start and finds its partners running, until nothing moves; what is left
    is a deadlock, described by each stuck rank's running ops."""

    # The waits a rank has passed: the compute stream is past its k-th wait once the ops of waits 0..k are done.
    passed = dict.fromkeys(ranks, 0)

    def started(item: _Item) -> bool:
        return (not item.done and (item.after is None or items[(item.rank, item.after)].done)
                and passed[item.rank] >= item.waits)

    progress = True
    while progress:
        progress = False
        for rank, ws in waited.items():
            while passed[rank] < len(ws) and items[(rank, ws[passed[rank]])].done:
                passed[rank] += 1
                progress = True
        for item in items.values():
            if not started(item):
                continue
            if item.op.op != "p2p":
                if all(started(items[(m, i)]) for m, i in coll_peer[(item.rank, item.index)]):
                    for m, i in coll_peer[(item.rank, item.index)]:
                        items[(m, i)].done = True
                    progress = True
                continue
            for j in list(item.pending):
                prank, pindex, pj = partner[(item.rank, item.index, j)]
                peer = items[(prank, pindex)]
                if started(peer) and pj in peer.pending:
                    item.pending.discard(j)
                    peer.pending.discard(pj)
                    peer.done = not peer.pending
                    progress = True
            item.done = not item.pending
    stuck = [item for item in items.values() if not item.done]
    if not stuck:
        return []
    lines = []
    for rank in sorted({i.rank for i in stuck}):
        mine = [i for i in stuck if i.rank == rank]
        running = [i for i in mine if started(i)]
        first = running[0] if running else mine[0]
        waits = [i.op.describe() for i in running] or [f"(nothing running; next: {first.op.describe()})"]
        lines.append(f"rank {rank} waits in op {first.index}: " + " | ".join(waits))
    return ["deadlock under NCCL's ordering: " + "; ".join(lines)]
