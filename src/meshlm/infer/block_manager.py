"""Fixed-size KV-cache blocks: allocation, reference counts, and prefix caching.

Responsible for: which physical block of the paged KV cache holds which 16 (block_size) tokens of
which sequence; sharing full blocks between sequences whose token prefixes are equal (prefix
caching), keyed by a hash of the block's tokens chained on the previous block's hash, and checked
token for token on a hit; keeping freed blocks that hold a cached prefix reusable until their space
is needed (least recently freed first); hit counters.
Not responsible for: the tensors themselves (model_runner.py, attention.py) or deciding who gets blocks
(scheduler.py). No torch import here.

Tiers below the pool (`tiers`, a `kv_tiers.KVTiers`): a cached block whose space is reused is handed to the
tiers (host memory, then disk) instead of forgotten, and `fetch` brings the blocks of waiting sequences' prefixes
back from them into free blocks, registered as cached, before the scheduler matches prefixes; hits are counted
per tier (a block brought back counts for its tier at its first hit).

Groups (context-parallel serving, `num_groups` = cp ranks): block b lives on rank b % num_groups, and a
sequence's j-th block is always taken from group j % num_groups, so every rank holds an equal share of
every long sequence and the capacity is that of all the ranks together. One group: plain paging.

Only full blocks are ever shared, and a sequence only writes at positions at or beyond its
`num_computed_tokens`, which always lie past its shared blocks: a shared block is never written.
"""

from __future__ import annotations

from collections import OrderedDict

from meshlm.infer.kv_tiers import KVTiers
from meshlm.infer.sequence import Sequence

# The KV cache's memory per rank when none is given, in MiB: `ModelRunner` makes as many blocks as fit in it,
# and `meshlm serve --kv-cache-mb` defaults to it. Defined here, torch-free, so the command line's parser
# reads it without importing torch.
DEFAULT_KV_CACHE_MB = 256


class BlockManager:
    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_groups: int = 1,
                 tiers: KVTiers | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1 (give the KV cache more memory)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if num_groups < 1 or num_blocks % num_groups:
            raise ValueError(f"num_blocks={num_blocks} must be a multiple of num_groups={num_groups} (>= 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_groups = num_groups
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks of each group in eviction order (oldest freed first); a free block may still hold a
        # cached prefix.
        self.free_lists: list[OrderedDict[int, None]] = [
            OrderedDict((b, None) for b in range(g, num_blocks, num_groups)) for g in range(num_groups)]
        # Prefix cache: chained hash -> block, and per cached block (hash, parent's hash, tokens). The
        # parent is named by hash, not block: the sequence that cached a block may hold a duplicate of
        # the cached parent (both computed it at once), and the child must still be found.
        self.cached: dict[int, int] = {}
        self.block_info: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}
        # Per sequence: hashes of its leading full blocks already registered (the chain so far).
        self.seq_hashes: dict[int, list[int]] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.tiers = tiers if enable_prefix_caching else None
        self.loaded_from: dict[int, str] = {}  # block brought back by `fetch`, not hit yet -> its tier
        self.tier_hit_tokens = {"host": 0, "disk": 0}
        self._seq_tier_hits: dict[int, list[tuple[int, str]]] = {}  # for `unmatch`

    # ---- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return sum(map(len, self.free_lists))

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def used_blocks_per_group(self) -> list[int]:
        return [self.num_blocks // self.num_groups - len(f) for f in self.free_lists]

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------

    @staticmethod
    def _chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent_hash, tokens))

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks of its longest cached prefix.

        At least one token is left uncached: its logits are needed to sample the next token.
        Returns the number of tokens whose KV is now cached (and sets `num_computed_tokens`).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.seq_hashes[seq.seq_id] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self.num_queried_tokens += seq.num_tokens
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:  # the latter: every prompt
            return 0  # token's logits are wanted, so none may come from the cache
        parent_hash = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = self._chain_hash(parent_hash, tokens)
            block = self.cached.get(h)
            if block is None or self.block_info[block][1:] != (parent_hash, tokens):
                break  # a miss, or a hash collision caught by the token comparison
            if self.ref_counts[block] == 0:
                del self.free_lists[block % self.num_groups][block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            self.seq_hashes[seq.seq_id].append(h)
            parent_hash = h
            tier = self.loaded_from.pop(block, None)
            if tier is not None:
                self.tier_hit_tokens[tier] += self.block_size
                self._seq_tier_hits.setdefault(seq.seq_id, []).append((block, tier))
        num_cached = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        self.num_hit_tokens += num_cached
        return num_cached

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's blocks that became full (all their tokens computed) in the cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            block = seq.block_table[i]
            parent_hash = hashes[-1] if hashes else None
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = self._chain_hash(parent_hash, tokens)
            hashes.append(h)
            if h not in self.cached and block not in self.block_info:
                self.cached[h] = block
                self.block_info[block] = (h, parent_hash, tokens)
            # else: another sequence computed the same block concurrently (its copy stays the cached
            # one; this block is simply freed later), or this block was itself a cache hit.

    # ---- tiers below the pool ----------------------------------------------------------------------

    def fetch(self, seqs: list[Sequence]) -> int:
        """Bring back from the tiers the blocks of the waiting `seqs`' prefixes that follow on from what the pool
        holds, each into a free block of its group (possibly evicting an older cached block to the tiers), and
        register them as cached; the copies are the tiers' pending moves. Returns the blocks brought back.

        Every block of a prefix found is held while the next is brought in (so bringing one back never evicts
        another of the same prefix), then freed again, the first blocks last: the most recently used."""
        if self.tiers is None or self.tiers.is_empty():
            return 0
        loaded = 0
        for seq in seqs:
            assert not seq.block_table
            held, parent = [], None
            for i in range((seq.num_tokens - 1) // self.block_size):
                group = i % self.num_groups
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                h = self._chain_hash(parent, tokens)
                block = self.cached.get(h)
                if block is not None:
                    if self.block_info[block][1:] != (parent, tokens):
                        break  # a hash collision
                    if self.ref_counts[block] == 0:
                        del self.free_lists[group][block]
                    self.ref_counts[block] += 1
                elif not self.free_lists[group] or self.tiers.claim(group, h, parent, tokens) is None:
                    break
                else:
                    block = self._take_free_block(group)
                    self.loaded_from[block] = self.tiers.load(block)
                    self.cached[h] = block
                    self.block_info[block] = (h, parent, tokens)
                    loaded += 1
                held.append(block)
                parent = h
            for block in reversed(held):
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self.free_lists[block % self.num_groups][block] = None
        return loaded

    def loads_failed(self, blocks: list[int]) -> None:
        """Blocks `fetch` brought back whose copy failed (a disk file that did not check out): not cached after
        all, first in line to be reused; their tier forgets them."""
        for block in blocks:
            h = self.block_info.pop(block)[0]
            del self.cached[h]
            self.loaded_from.pop(block, None)
            group = block % self.num_groups
            self.free_lists[group].move_to_end(block, last=False)
            self.tiers.load_failed(group, h)

    # ---- allocation ------------------------------------------------------------------------------

    def _take_free_block(self, group: int) -> int:
        block, _ = self.free_lists[group].popitem(last=False)
        info = self.block_info.pop(block, None)
        if info is not None:  # evict the cached prefix this block held (to the tiers below, if any)
            del self.cached[info[0]]
            self.loaded_from.pop(block, None)
            if self.tiers is not None:
                self.tiers.evicted(group, *info, block)
        assert self.ref_counts[block] == 0
        self.ref_counts[block] = 1
        return block

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens` tokens; False (and no change) if blocks run out."""
        have, want = len(seq.block_table), self.blocks_needed(num_tokens)
        needed = [0] * self.num_groups
        for j in range(have, want):
            needed[j % self.num_groups] += 1
        if any(n > len(f) for n, f in zip(needed, self.free_lists)):
            return False
        for j in range(have, want):
            seq.block_table.append(self._take_free_block(j % self.num_groups))
        return True

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching zero go to the free list.

        The tail is freed first so that, under memory pressure, a sequence's last blocks are evicted
        before its first ones (a prefix is only useful from its beginning).
        """
        for block in reversed(seq.block_table):
            assert self.ref_counts[block] > 0
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_lists[block % self.num_groups][block] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.seq_hashes.pop(seq.seq_id, None)
        self._seq_tier_hits.pop(seq.seq_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens' (the slots of rejected speculative tokens).

        They hold no cached prefix (only blocks of computed tokens are registered, and those lie before
        `num_tokens`), so they go to the front of their free list: reused before any block that does."""
        assert num_tokens >= seq.num_computed_tokens
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            assert self.ref_counts[block] == 1 and block not in self.block_info
            self.ref_counts[block] = 0
            free = self.free_lists[block % self.num_groups]
            free[block] = None
            free.move_to_end(block, last=False)

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match_prefix` for a sequence that could not be admitted after all (and its counters)."""
        self.num_queried_tokens -= seq.num_tokens
        self.num_hit_tokens -= seq.num_cached_tokens
        for block, tier in self._seq_tier_hits.pop(seq.seq_id, ()):
            self.tier_hit_tokens[tier] -= self.block_size
            self.loaded_from[block] = tier
        seq.num_cached_tokens = 0
        self.free(seq)

    def check_invariants(self, live: list[Sequence]) -> None:
        """Reference counts equal the number of live block tables holding each block (for tests)."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block in seq.block_table:
                counts[block] += 1
        assert counts == self.ref_counts, (counts, self.ref_counts)
        assert {b for f in self.free_lists for b in f} == {b for b in range(self.num_blocks) if counts[b] == 0}
        assert all(b % self.num_groups == g for g, f in enumerate(self.free_lists) for b in f)
        assert all(b % self.num_groups == j % self.num_groups for seq in live for j, b in enumerate(seq.block_table))
        assert all(self.cached[info[0]] == b for b, info in self.block_info.items())
        assert len(self.cached) == len(self.block_info)
