"""Which replica of `meshlm serve --replicas R` gets a request: the router's policies.

Responsible for: `CacheAwarePolicy`, SGLang's cache-aware routing -- each replica keeps an approximate record
of the prompts it was sent (`PrefixRecord`), and a request goes to the replica whose record holds the longest
prefix of it when that prefix covers at least `threshold` of the prompt and the replicas' loads are balanced
(max - min in-flight requests at most `balance_abs`, or max at most `balance_rel` x min); otherwise to the least
loaded replica (ties: the one with the smaller record, which has the most room for new prefixes). Why: a
replica's engine keeps the KV blocks of the prompts it served (prefix caching), so a prompt sent where its
prefix was sent before skips most of its prefill; `RoundRobinPolicy`, the replicas in turn; `routing_key`,
the part of a request body a policy looks at (the prompt, or the chat messages in one string).
Not responsible for: HTTP or the replicas' processes (`infer/replicas.py`); what the engines really hold (a
record is the router's guess: an engine may have evicted those blocks since).

The record is a prefix tree kept as a chain of digests: a key (text, or token ids) is cut into chunks of
`chunk` items and chunk i is recorded as the digest of the key's first (i + 1) x `chunk` items. The digests
live in one LRU order per replica, bounded by `capacity` chunks; a key's chunks are refreshed from the last
to the first, so a prefix is always fresher than what extends it and eviction removes the longest branches
first, never the start of a recorded prefix. A match is a count of leading chunks, so a prefix shorter than
one chunk never matches. A text prompt and the token ids of the same text are different keys.

Both policies keep the records and count a prefix hit when the chosen replica's record held at least
`threshold` of the prompt, so their hit rates compare. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from meshlm.infer.openai_responses import input_messages
from meshlm.infer.requests import APIError

POLICIES = ("cache_aware", "round_robin")


def routing_key(body: bytes, *, chat: bool) -> str | tuple[int, ...]:
    """What of a request body the policies route by: a completion's (first) prompt, as text or token ids,
    or a chat's messages as one string (`<|role|>\\ncontent\\n` each, so a longer conversation extends the key
    of its start; a Responses request's instructions and input likewise). Anything unreadable is the empty key:
    routed by load, and the replica answers the error."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return ""
    if not isinstance(data, dict):
        return ""
    if chat:
        messages = data.get("messages")
        if messages is None and "input" in data:  # a Responses request: the chat's messages it asks for
            try:
                messages = input_messages(data)
            except APIError:
                return ""
        if not isinstance(messages, list):
            return ""
        return "".join(f"<|{m.get('role')}|>\n{m.get('content')}\n" for m in messages if isinstance(m, dict))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # several prompts: routed by the first
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return tuple(prompt)
    return ""


def prefix_digests(key: str | Sequence[int], chunk: int) -> list[bytes]:
    """Digest i covers the key's first (i + 1) x `chunk` items (whole chunks only)."""
    digests, previous = [], b"t" if isinstance(key, str) else b"i"
    for start in range(0, len(key) - chunk + 1, chunk):
        piece = key[start:start + chunk]
        data = piece.encode("utf-8", "surrogatepass") if isinstance(piece, str) else repr(tuple(piece)).encode()
        previous = hashlib.blake2b(previous + data, digest_size=16).digest()
        digests.append(previous)
    return digests


class PrefixRecord:
    """The prefixes one replica was sent: chunk digests in LRU order, at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._chunks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def match(self, digests: Sequence[bytes]) -> int:
        """How many leading chunks of a key (its `prefix_digests`) the record holds."""
        n = 0
        while n < len(digests) and digests[n] in self._chunks:
            n += 1
        return n

    def insert(self, digests: Sequence[bytes]) -> None:
        """Record a key; the least recently used chunks go beyond `capacity`."""
        for d in reversed(digests):  # the first chunk last: the freshest
            self._chunks[d] = None
            self._chunks.move_to_end(d)
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)


@dataclass(frozen=True)
class Decision:
    """Where a request went: `replica`; `matched`, the items of its key that replica's record held; `hit`,
    whether that is at least the policy's threshold of the key."""
    replica: int
    matched: int
    hit: bool


class NoReplica(RuntimeError):
    """No replica is alive to take a request."""


class Policy:
    """The records and counters both policies keep; a subclass's `pick` chooses among the live replicas.

    `chunk`: items (characters or token ids) per recorded chunk; `capacity`: chunks recorded per replica;
    `threshold`: the share of a key a replica's record must hold to count (and, cache-aware, to route) as a
    prefix hit."""

    name = ""

    def __init__(self, num_replicas: int, *, chunk: int = 16, capacity: int = 1 << 16, threshold: float = 0.5):
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, not {num_replicas}")
        if chunk < 1 or capacity < 1 or not 0 < threshold <= 1:
            raise ValueError(f"chunk={chunk} and capacity={capacity} must be >= 1, threshold={threshold} in (0, 1]")
        self.num_replicas, self.chunk, self.threshold = num_replicas, chunk, threshold
        self.records = [PrefixRecord(capacity) for _ in range(num_replicas)]
        self.routed = [0] * num_replicas
        self.requests = 0
        self.hits = 0

    @property
    def hit_rate(self) -> float:
        """Requests sent to a replica whose record held at least `threshold` of them / all requests."""
        return self.hits / self.requests if self.requests else 0.0

    def route(self, key: str | Sequence[int], loads: Sequence[int], live: Sequence[bool]) -> Decision:
        """Choose a replica for `key` given each replica's requests in flight and whether it is alive, and
        record the key there. NoReplica when none is alive."""
        candidates = [i for i in range(self.num_replicas) if live[i]]
        if not candidates:
            raise NoReplica("no replica is alive")
        digests = prefix_digests(key, self.chunk)
        matched = [record.match(digests) * self.chunk for record in self.records]
        i = self.pick(candidates, matched, loads, len(key))
        hit = self.is_hit(matched[i], len(key))
        self.records[i].insert(digests)
        self.routed[i] += 1
        self.requests += 1
        self.hits += hit
        return Decision(i, matched[i], hit)

    def is_hit(self, matched: int, length: int) -> bool:
        return matched > 0 and matched >= self.threshold * length

    def pick(self, candidates: list[int], matched: list[int], loads: Sequence[int], length: int) -> int:
        raise NotImplementedError


class CacheAwarePolicy(Policy):
    """The longest recorded prefix while loads are balanced, else the least loaded replica (module docstring).

    `balance_abs`, `balance_rel`: the loads are imbalanced when max - min > balance_abs and max > balance_rel x
    min (in-flight requests of the live replicas), as SGLang's router decides."""

    name = "cache_aware"

    def __init__(self, num_replicas: int, *, balance_abs: int = 8, balance_rel: float = 1.5, **kw):
        super().__init__(num_replicas, **kw)
        if balance_abs < 0 or balance_rel < 1:
            raise ValueError(f"balance_abs={balance_abs} must be >= 0 and balance_rel={balance_rel} >= 1")
        self.balance_abs, self.balance_rel = balance_abs, balance_rel

    def pick(self, candidates: list[int], matched: list[int], loads: Sequence[int], length: int) -> int:
        least = min(candidates, key=lambda i: (loads[i], len(self.records[i]), self.routed[i]))
        most = max(loads[i] for i in candidates)
        if most - loads[least] > self.balance_abs and most > self.balance_rel * loads[least]:
            return least
        best = max(candidates, key=lambda i: (matched[i], -loads[i]))
        return best if self.is_hit(matched[best], length) else least


class RoundRobinPolicy(Policy):
    """The live replicas in turn, whatever the request."""

    name = "round_robin"

    def __init__(self, num_replicas: int, **kw):
        super().__init__(num_replicas, **kw)
        self._next = 0

    def pick(self, candidates: list[int], matched: list[int], loads: Sequence[int], length: int) -> int:
        for step in range(self.num_replicas):
            i = (self._next + step) % self.num_replicas
            if i in candidates:
                self._next = i + 1
                return i
        raise NoReplica("no replica is alive")  # not reached: `route` passes at least one candidate


def make_policy(name: str, num_replicas: int, **kw) -> Policy:
    """The policy called `name` (one of POLICIES) over `num_replicas` replicas."""
    policies = {p.name: p for p in (CacheAwarePolicy, RoundRobinPolicy)}
    if name not in policies:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(POLICIES)}")
    return policies[name](num_replicas, **kw)
