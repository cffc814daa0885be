"""Serving on several ranks: one engine on rank 0; the model split over "tp", the KV cache over "cp".

Responsible for:
  - `build_runner`: the one place a rank's `ModelRunner` is made, for any tp x cp (one rank included): the
    model split over tp, attention over this rank's blocks under cp.
  - `ParallelRunner`, what rank 0's `Engine` calls in place of its `ModelRunner`: each step it sends the
    `StepInput` (plain data, as JSON) to every rank (over "cp", then over "tp"), runs its own part of the
    step, and returns the full logits; `run_worker`, the loop of the other ranks (receive a step, run it,
    take part in its collectives, until rank 0 says stop).
  - tensor parallelism (`shard_for_serving`): the training's transform without sequence parallelism
    (`apply_tensor_parallel`): attention heads, MLP columns and the vocabulary split over tp, so each
    rank's paged KV cache holds only its kv heads (the same memory per rank holds tp times the tokens);
    the vocab-parallel logits are all-gathered.
  - context parallelism (`ContextParallelAttention`): a sequence's j-th KV block lives on cp rank j % cp
    (the block manager's groups), so every rank holds ~1/cp of every long sequence and a sequence longer
    than one rank's cache is served. Each new token is computed by the rank that holds its KV slot (its
    block's owner), so a prefill is split over the ranks block by block and a decode token runs on one
    rank (the weights are whole on every cp rank). Per layer each rank first writes the keys/values it
    computed into its own blocks; then
      prefill chunks (the other sequences; all of a step's share one pass): a ring. Each rank's
        keys/values of the prefilling sequences -- cached and new, only the kv heads, no padding -- go
        round the cp ranks (cp-1 hops, each posted before the compute so it overlaps it: the training's
        ring loop, `parallel.context.ring_pass`); the queries stay with their owner, which attends them to
        the block in hand under a causal mask by position (key position <= query position), in tiles of
        query rows that read only the keys their last row sees (rows that see none of a block, and a
        (sequence, source rank) pair where no query sees a key, are skipped), and merges the partials with
        `parallel.context.merge_partials`. Per layer and rank: cp-1 sends of K+V of the blocks in hand
        (~2 * (cp-1)/cp * L * kv_heads * head_dim values for a prompt of L tokens), nothing all-gathered;
      decode tokens (one new token -- or, under speculative decoding, a token and its k proposals: k + 1
        queries, each over the keys up to its position, owned by whichever ranks hold their slots): split-KV.
        The decode queries are all-gathered; every rank attends them over its own blocks of their sequences
        (one `DecodeBatch`, as `PagedAttention` runs decodes); one all-gather of (output, lse) lets each
        owner merge its queries' partials exactly (`merge_partials`, its own partial first).
    A step with both runs the ring, then the split-KV. The sampled rows' hidden states reach every rank by
    one all-reduce.
The scheduler, block manager and sampler live on rank 0 alone (torch-free and unchanged apart from the
groups); the other ranks never see a request.
Not responsible for: launching ranks (`meshlm generate --tp N --cp M` starts them through torch's
launcher; under torchrun every rank builds `LLM(..., tp=N, cp=M)`), scheduling or sampling.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import threading
import time

import torch
import torch.nn.functional as F

from meshlm import comm
from meshlm.infer.attention import DecodeBatch, read_slots, write_kv
from meshlm.infer.kv_tier_store import KVTierStore, kv_signature, model_fingerprint
from meshlm.infer.kv_tiers import KVTierConfig
from meshlm.infer.model_runner import ModelRunner, StepInput
from meshlm.mesh import Mesh
from meshlm.models.moe import MoE
from meshlm.parallel.context import merge_partials, ring_pass
from meshlm.models.transformer import Transformer

_STOP = {"stop": True}
_KEEPALIVE = {"keepalive": True}
KEEPALIVE_S = 1.0  # an idle driver tells the other ranks it is alive this often (far below any collective timeout)


# The `ModelRunner` arguments of `LLM`/`Engine` (the KV cache, its attention and the tiers below it), as
# `build_runner` takes them.
RUNNER_ARGS = ("block_size", "num_blocks", "kv_cache_memory_bytes", "native_attention", "kv_host_mb", "kv_disk_dir",
               "kv_disk_mb")


def build_runner(model: Transformer, mesh: Mesh | None = None, *, kv_host_mb: float | None = None,
                 kv_disk_dir: str | None = None, kv_disk_mb: float | None = None, **runner_kwargs) -> ModelRunner:
    """This rank's `ModelRunner` over `model` (the full weights): on one rank (`mesh` None) the model as it
    is; on tp x cp ranks split in place over "tp" (`shard_for_serving`) and, with cp > 1, attending over this
    rank's blocks (`context_parallel_attention`). `runner_kwargs`: `ModelRunner`'s (`RUNNER_ARGS`).
    `kv_host_mb`, `kv_disk_dir`, `kv_disk_mb`: KV tiers below the cache (`infer/kv_tiers.py`), per rank: the
    runner gets a `KVTierStore` for its share of every block."""
    tiers = KVTierConfig.of(kv_host_mb, kv_disk_dir, kv_disk_mb)
    fingerprint = model_fingerprint(model) if tiers is not None and tiers.disk_dir is not None else ""
    if mesh is None:
        runner = ModelRunner(model, **runner_kwargs)
    else:
        runner = ModelRunner(shard_for_serving(model, mesh), **runner_kwargs,
                             attention=context_parallel_attention(mesh) if mesh.size("cp") > 1 else None)
    if tiers is not None:
        tp, cp = (mesh.size("tp"), mesh.size("cp")) if mesh is not None else (1, 1)
        k = runner.k_caches[0]
        signature = kv_signature(fingerprint, layers=len(runner.k_caches), kv_heads=k.shape[0], head_dim=k.shape[2],
                                 dtype=runner.kv_dtype, block_size=runner.block_size, tp=tp, cp=cp)
        ranks = dict(tp_rank=mesh.local_rank("tp"), cp_rank=mesh.local_rank("cp"), cp=cp) if mesh is not None else {}
        runner.tier_store = KVTierStore(runner.k_caches, runner.v_caches, tiers, block_size=runner.block_size,
                                        signature=signature, **ranks)
    return runner


def shard_for_serving(model: Transformer, mesh: Mesh) -> Transformer:
    """`model` (the full weights, the same on every rank) split in place over "tp" for inference."""
    if mesh.size("tp") == 1:
        return model
    from meshlm.parallel.tensor import apply_tensor_parallel, check_tensor_parallel

    tp = mesh.size("tp")
    check_tensor_parallel(model.config, tp, sequence_parallel=False)
    num = model.config.num_experts
    if model.config.is_moe and num % tp != 0:  # checked before the model is touched
        choices = ",".join(str(d) for d in range(1, num + 1) if num % d == 0)
        raise ValueError(f"model.num_experts={num} is not divisible by tp={tp} (serving splits the experts "
                         f"over the tp ranks); choose tp in {{{choices}}}")
    model = apply_tensor_parallel(model, mesh, sequence_parallel=False)
    return split_experts(model, mesh)


def split_experts(model: Transformer, mesh: Mesh) -> Transformer:
    """Every MoE layer of `model` with its experts split over the tp ranks (in place; a dense model is
    returned as it is). Inference is dropless (`ModelRunner` turns the capacity rule off), so each token
    reaches its top-k experts whichever rank holds them. num_experts must be divisible by tp
    (`shard_for_serving` checks it; `apply_expert_parallel` refuses otherwise)."""
    from meshlm.parallel.expert import AXIS, apply_expert_parallel

    moes = [m for m in model.modules() if isinstance(m, MoE)]
    tp = mesh.size("tp")
    if not moes or tp == 1:
        return model
    # The tp group itself is the expert group: no new process group; its traffic is counted as "ep".
    ep_mesh = mesh.with_axes({AXIS: (mesh.ranks("tp"), mesh.group("tp"))})
    apply_expert_parallel(model, ep_mesh)
    for moe in moes:
        # An instance attribute shadows MoE.forward (as apply_expert_parallel does for the experts).
        moe.forward = functools.partial(_moe_on_own_tokens, moe, mesh=ep_mesh)
    return model


def _moe_on_own_tokens(moe: MoE, x: torch.Tensor, *, mesh: Mesh) -> torch.Tensor:
    """The MoE of `x` (the same on every rank of the group): each rank routes and dispatches a contiguous
    1/n of the tokens (the last ranks may have fewer, or none), then the outputs are all-gathered."""
    from meshlm.parallel.expert import AXIS

    shape = x.shape
    x_td = x.reshape(-1, shape[-1])
    tokens, n, me = x_td.shape[0], mesh.size(AXIS), mesh.local_rank(AXIS)
    per = -(-tokens // n)
    mine = MoE.forward(moe, x_td[me * per:(me + 1) * per])
    # Padded to the same rows on every rank: all_gather moves equal shares.
    out = comm.all_gather(F.pad(mine, (0, 0, 0, per - mine.shape[0])), mesh, AXIS, dim=0)
    return out[:tokens].reshape(shape)


def _send(message, mesh: Mesh):
    """Rank 0's `message` on every rank: over its cp group, then each of those over its tp group."""
    if mesh.local_rank("tp") == 0:
        message = comm.broadcast_json(message, mesh, "cp")
    return comm.broadcast_json(message, mesh, "tp")


def _run_step(runner: ModelRunner, mesh: Mesh, step: StepInput) -> torch.Tensor:
    """This rank's part of a step, then the full logits (every tp rank's vocab slice, in order)."""
    return comm.all_gather(runner.execute(step), mesh, "tp", dim=1)


def _move_kv(runner: ModelRunner, mesh: Mesh, moves: list[list]) -> list[int]:
    """This rank's share of KV tier moves; then the indices of the loads that failed on any rank (a flag per
    move, summed over tp and cp)."""
    flags = torch.zeros(len(moves), dtype=torch.int32, device=runner.device)
    flags[runner.move_kv(moves)] = 1
    comm.all_reduce(comm.all_reduce(flags, mesh, "tp"), mesh, "cp")
    return torch.nonzero(flags).flatten().tolist()


class ParallelRunner:
    """Rank 0's runner: the interface of `ModelRunner` (block_size, num_blocks, execute) over every rank;
    `num_blocks` counts the blocks of all cp ranks, `num_groups` tells the block manager where they are.

    The other ranks wait for rank 0's next step inside a collective, which the process group's timeout bounds
    (gloo raises, NCCL's watchdog aborts the process). So that a server idle for longer than that timeout still
    answers, a keepalive thread sends a no-op message after `keepalive_s` without a step; a lock keeps it and
    the steps in one order on rank 0, as the other ranks receive them."""

    def __init__(self, runner: ModelRunner, mesh: Mesh, *, keepalive_s: float = KEEPALIVE_S):
        assert mesh.is_first, "the mesh's first rank drives; the others run `run_worker`"
        self.runner, self.mesh = runner, mesh
        self._start(block_size=runner.block_size, num_groups=mesh.size("cp"),
                    num_blocks=runner.num_blocks * mesh.size("cp"), keepalive_s=keepalive_s)

    def _start(self, *, block_size: int, num_groups: int, num_blocks: int, keepalive_s: float) -> None:
        self.block_size, self.num_groups, self.num_blocks = block_size, num_groups, num_blocks
        self.closed = False
        self.keepalive_s = keepalive_s
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closing = threading.Event()
        # a CUDA device is per thread: the keepalive's collectives run on the driver's device
        self._cuda = torch.cuda.current_device() if self.mesh.device_type == "cuda" else None
        self._keepalive = threading.Thread(target=self._keep_alive, name="meshlm-keepalive", daemon=True)
        self._keepalive.start()

    def _post(self, message) -> None:
        """`message` to every other rank (each is waiting in `run_worker`)."""
        _send(message, self.mesh)

    def _compute(self, step: StepInput) -> torch.Tensor:
        """This rank's part of a posted step; the full logits."""
        return _run_step(self.runner, self.mesh, step)

    def execute(self, step: StepInput) -> torch.Tensor:
        with self._lock:
            self._post(dataclasses.asdict(step))
            out = self._compute(step)
            self._last = time.monotonic()
        return out

    def run_exclusive(self, message: dict, work):
        """Post `message` (one `run_worker` hands to its `handlers`), then `work()` here, with no step or keepalive
        in between; returns what `work` returns."""
        with self._lock:
            self._post(message)
            out = work()
            self._last = time.monotonic()
        return out

    @property
    def tier_store(self):
        """Rank 0's `KVTierStore` (each rank has its own, over its share of the blocks), or None."""
        return self.runner.tier_store

    def move_kv(self, moves: list[list]) -> list[int]:
        """KV tier moves on every rank, before a step; the indices of the loads that failed on any of them."""
        with self._lock:
            self._post({"tier_moves": moves})  # (a step's own moves travel as its "kv_moves")
            failed = _move_kv(self.runner, self.mesh, moves)
            self._last = time.monotonic()
        return failed

    def close(self) -> None:
        """Release the other ranks from `run_worker` (once; the engine is unusable afterwards)."""
        self._closing.set()
        with self._lock:
            if not self.closed:
                self._post(_STOP)
                self.closed = True

    def _keep_alive(self) -> None:
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)
        while not self._closing.wait(self.keepalive_s / 4):
            with self._lock:
                if self.closed or time.monotonic() - self._last < self.keepalive_s:
                    continue
                try:
                    self._post(_KEEPALIVE)
                except comm.CollectiveError:
                    return  # a rank is gone: the next step raises it to the engine, which reports it
                self._last = time.monotonic()


def run_worker(runner: ModelRunner, mesh: Mesh, *, handlers: dict | None = None, upstream=None) -> int:
    """A rank other than the mesh's first: run the steps it sends until it closes; return how many ran.

    `handlers`: message key -> `handler(runner, mesh, value)` for messages other than steps (disaggregated
    serving's KV transfers). `upstream`: on the first rank of an engine driven from elsewhere
    (`infer/disaggregated.py`), `(receive, reply)`: `receive()` gives the driver's next message, which this rank
    passes on to its mesh, and `reply(logits)` returns a step's logits."""
    steps = 0
    handlers = handlers or {}
    while True:
        message = _send(upstream[0]() if upstream is not None else None, mesh)
        if message == _STOP:
            return steps
        if message == _KEEPALIVE:
            continue
        if "tier_moves" in message:
            _move_kv(runner, mesh, message["tier_moves"])
            continue
        key = next((k for k in handlers if k in message), None)
        if key is not None:
            handlers[key](runner, mesh, message[key])
            continue
        logits = _run_step(runner, mesh, StepInput(**message))
        if upstream is not None:
            upstream[1](logits)
        steps += 1


def context_parallel_attention(mesh: Mesh):
    """The `attention` class a `ModelRunner` of a cp rank uses (bound to its mesh). It copies no block, so the
    runner's gather `buffers` go unused."""
    def make(k_caches, v_caches, step, block_size, *, dtype, buffers=None, native=True):
        return ContextParallelAttention(k_caches, v_caches, step, block_size, dtype=dtype, mesh=mesh, native=native)
    return make


class ContextParallelAttention:
    """The attention context of one step on one cp rank: its own tokens and its own blocks; prefill chunks by
    a ring of the keys/values over "cp", decode tokens by split-KV partials (the module docstring).

    The step's block tables hold global block ids; block b is this rank's local block b // cp when
    b % cp == its cp coordinate. Everything below is decided from the step alone, so every rank knows how
    many keys each other rank holds and which of its queries may see them."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], step: StepInput, block_size: int,
                 *, dtype: torch.dtype, mesh: Mesh, tile_rows: int = 256, native: bool = True):
        """`tile_rows`: query rows the prefill ring attends at a time (bounds the scores' memory); `native`:
        as `ModelRunner`'s `native_attention` (the decode partials)."""
        self.k_caches, self.v_caches, self.mesh = k_caches, v_caches, mesh
        device = k_caches[0].device
        num_kv, num_blocks = k_caches[0].shape[:2]
        cp, me = mesh.size("cp"), mesh.local_rank("cp")
        self.cp, self.me = cp, me
        # Partials and their merge in at least fp32 (a log-sum-exp in bf16 is off by a few percent).
        self.cdt = torch.promote_types(dtype, torch.float32)

        def local_slot(slot: int) -> int:
            return (slot // block_size) // cp * block_size + slot % block_size

        # Each new token is computed by the rank that holds its KV slot: its block's owner. So a prefill is
        # split over the ranks block by block and every key/value is written where it is computed.
        owners = [(slot // block_size) % cp for slot in step.slot_mapping]
        self.rows_of = [[row for row, o in enumerate(owners) if o == r] for r in range(cp)]
        mine = self.rows_of[me]
        self.local_rows = torch.tensor(mine, dtype=torch.long, device=device)
        self.write_slots = torch.tensor([local_slot(step.slot_mapping[row]) for row in mine], dtype=torch.long,
                                        device=device)
        where = {row: i for i, row in enumerate(mine)}
        # The rows whose logits are wanted, and which of them this rank computes (at which local index).
        self.sampled_here = [(i, where[row]) for i, row in enumerate(step.logits_indices) if row in where]
        self.num_sampled = len(step.logits_indices)
        starts = [0]
        for n in step.query_lens:
            starts.append(starts[-1] + n)

        offset = torch.arange(block_size)

        def held(i: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
            """(positions, local slots on rank r) of every key of sequence i that rank r holds, in position order."""
            length = step.context_lens[i]
            table = torch.tensor(step.block_tables[i][:-(-length // block_size)], dtype=torch.long)
            j = torch.nonzero(table % cp == r).flatten()
            pos = (j[:, None] * block_size + offset).flatten()
            slots = (table[j, None] // cp * block_size + offset).flatten()
            return pos[pos < length], slots[pos < length]

        # Prefill chunks (more than one new token): the ring. What travels from rank r: the keys/values of
        # every prefilling sequence that r holds (cached and new), packed one sequence after the other.
        # Decode queries (a sequence's one new token, or its last token and proposals: a query each) and the
        # prefill chunks (every other sequence).
        rows, decode, lengths = step.decode_rows()
        prefill = sorted(set(range(len(step.query_lens))) - set(decode))
        keys = [[held(i, r) for r in range(cp)] for i in prefill]
        self.ring_sizes = [sum(len(k[r][0]) for k in keys) for r in range(cp)]
        self.ring_slots = torch.cat([k[me][1] for k in keys] or [torch.zeros(0, dtype=torch.long)]).to(device)
        # Per source rank, tile by tile: (this rank's query rows, first key column in the block, key columns,
        # visible keys per row or None). A rank's keys of a sequence are in position order, so a query sees a
        # prefix of them (causal by position: key position <= query position); its rows are in position order
        # too, so the rows that see none come first and are skipped, and each tile of rows reads only the
        # columns its last row sees (a pair where no query sees a key is skipped whole).
        self.ring_tiles: list[list[tuple[slice, int, int, torch.Tensor | None]]] = [[] for _ in range(cp)]
        offsets = [0] * cp
        for i, seq_keys in zip(prefill, keys):
            first = bisect.bisect_left(mine, starts[i])
            q_pos = torch.tensor([step.positions[row] for row in mine[first:bisect.bisect_left(mine, starts[i + 1])]],
                                 dtype=torch.long)
            for src in range(cp):
                k_pos = seq_keys[src][0]
                counts = torch.searchsorted(k_pos, q_pos, right=True)  # keys each query sees
                for lo in range(int((counts == 0).sum()), len(q_pos), tile_rows):
                    c = counts[lo:lo + tile_rows]
                    width = int(c[-1])
                    self.ring_tiles[src].append((slice(first + lo, first + lo + len(c)), offsets[src], width,
                                                 None if int(c[0]) == width else c[:, None].to(device)))
                offsets[src] += len(k_pos)

        self._plan_decodes(step, (rows, decode, lengths), owners, where, block_size=block_size,
                           num_kv=num_kv, num_blocks=num_blocks, native=native)

    def _plan_decodes(self, step: StepInput, decodes: tuple[list[int], list[int], list[int]], owners: list[int],
                      where: dict[int, int], *, block_size: int, num_kv: int, num_blocks: int, native: bool) -> None:
        """Decode queries (`StepInput.decode_rows`): split-KV. A decode's query is all-gathered; every rank attends
        it over its own blocks of that sequence, up to the query's position. `owners`: each row's rank; `where`:
        this rank's rows' local indices."""
        rows, decode, lengths = decodes
        cp, me, device = self.cp, self.me, self.k_caches[0].device
        self.num_decode = len(rows)
        self.decode_of = [[d for d, row in enumerate(rows) if owners[row] == r] for r in range(cp)]
        self.decode_mine = torch.tensor(self.decode_of[me], dtype=torch.long, device=device)
        self.decode_local = torch.tensor([where[rows[d]] for d in self.decode_of[me]], dtype=torch.long,
                                         device=device)
        # One DecodeBatch of every decode query (its rows are decode indices): it attends this rank's blocks of
        # each (a query with none here keeps an empty partial).
        blocks, counts = [], []
        for i, length in zip(decode, lengths):
            mine = [(j, b) for j, b in enumerate(step.block_tables[i][:-(-length // block_size)]) if b % cp == me]
            blocks.append([b // cp for _, b in mine])
            counts.append([min(block_size, length - j * block_size) for j, _ in mine])
        self.decode_batch = DecodeBatch(torch.arange(len(rows), device=device), blocks, counts,
                                        block_size=block_size, num_kv=num_kv, num_blocks=num_blocks,
                                        dtype=self.cdt, native=native) if rows else None

    def attend(self, layer: int, q_bhsd: torch.Tensor, k_bhsd: torch.Tensor, v_bhsd: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        assert q_bhsd.shape[2] == len(self.rows_of[self.me]), "the runner must pass this rank's tokens only"
        if self.write_slots.numel():  # the keys/values of this rank's tokens, into its own blocks
            write_kv(k_cache, v_cache, self.write_slots, k_bhsd[0], v_bhsd[0])
        q = q_bhsd[0].to(self.cdt)  # [heads, this rank's rows, dim]
        out = torch.zeros_like(q)
        if any(self.ring_sizes):
            self._ring(k_cache, v_cache, q, out)
        if self.num_decode:
            self._split_kv(k_cache, v_cache, q_bhsd[0], out)
        return out[None].to(q_bhsd.dtype)

    def _ring(self, k_cache, v_cache, q: torch.Tensor, out: torch.Tensor) -> None:
        """The prefill rows of `out`: this rank's queries attend the keys/values of every rank, which travel
        round the cp ring (`parallel.context.ring_pass`), partials merged by `merge_partials`."""
        num_kv, dim = v_cache.shape[0], v_cache.shape[-1]
        heads = q.shape[0]
        groups, scale = heads // num_kv, dim ** -0.5
        lse = q.new_full(q.shape[:-1], float("-inf"))
        block = torch.stack(read_slots(k_cache, v_cache, self.ring_slots))  # what travels: the kv heads only

        def visit(kv: torch.Tensor, src: int) -> None:
            k, v = kv[0, :, None].to(q.dtype), kv[1, :, None].to(q.dtype)  # [kv_heads, 1, keys, dim]
            for rows, col, width, counts in self.ring_tiles[src]:
                n = rows.stop - rows.start
                scores = torch.matmul(q[:, rows].reshape(num_kv, groups, n, dim),
                                      k[:, :, col:col + width].transpose(-1, -2)).mul_(scale)
                if counts is not None:  # row i sees the first counts[i] keys (every row sees one at least)
                    scores.masked_fill_(torch.arange(width, device=q.device) >= counts, float("-inf"))
                part_lse = torch.logsumexp(scores, dim=-1)
                part = torch.matmul(torch.exp(scores - part_lse[..., None]), v[:, :, col:col + width])
                out[:, rows], lse[:, rows] = merge_partials(out[:, rows], lse[:, rows], part.reshape(heads, n, dim),
                                                            part_lse.reshape(heads, n))

        ring_pass(block, self.mesh, "cp", visit,
                  incoming=lambda src: block.new_empty((2, num_kv, self.ring_sizes[src], dim)))

    def _split_kv(self, k_cache, v_cache, q_hsd: torch.Tensor, out: torch.Tensor) -> None:
        """The decode rows of `out`: every decode query all-gathered, attended over each rank's own blocks, and
        the partials (output, lse) all-gathered once and merged by each query's owner."""
        num_kv, dim = v_cache.shape[0], v_cache.shape[-1]
        heads = q_hsd.shape[0]
        groups = heads // num_kv
        # The decode queries of all ranks (in the model's dtype), padded to the most any rank has, for one
        # all-gather.
        most = max(map(len, self.decode_of))
        padded = q_hsd.new_zeros(heads, most, dim)
        padded[:, :self.decode_local.numel()] = q_hsd[:, self.decode_local]
        every = comm.all_gather(padded[None], self.mesh, "cp", dim=0).to(out.dtype)  # [cp, heads, most, dim]
        q = out.new_empty(heads, self.num_decode, dim)
        for r, ds in enumerate(self.decode_of):
            q[:, ds] = every[r, :, :len(ds)]
        # This rank's partials; sequences with no block here keep lse = -inf and weigh nothing in the merge.
        qb = q.view(num_kv, groups, self.num_decode, dim).transpose(1, 2)  # [kv, batch, groups, dim]
        o, lse = self.decode_batch.attend(qb, k_cache, v_cache, with_lse=True)
        part = o.transpose(1, 2).reshape(heads, self.num_decode, dim)
        part_lse = lse.transpose(1, 2).reshape(heads, self.num_decode)
        # One all-gather of (output, lse) over cp; each owner merges its queries' partials, its own first (it
        # holds the query's own key, so the running lse is finite from the start).
        both = comm.all_gather(torch.cat([part, part_lse[..., None]], dim=-1)[None], self.mesh, "cp", dim=0)
        both = both[:, :, self.decode_mine]  # [cp, heads, this rank's decodes, dim + 1]
        merged, merged_lse = both[self.me, ..., :dim], both[self.me, ..., dim]
        for r in range(self.cp):
            if r != self.me:
                merged, merged_lse = merge_partials(merged, merged_lse, both[r, ..., :dim], both[r, ..., dim])
        out[:, self.decode_local] = merged

    def select_rows(self, h: torch.Tensor) -> torch.Tensor:
        """The hidden states of the sampled rows [num_sampled, hidden] on every rank, from the ranks that
        computed them (`h`: this rank's rows, [1, local rows, hidden]): one all-reduce over cp."""
        out = h.new_zeros(self.num_sampled, h.shape[-1])
        for i, local in self.sampled_here:
            out[i] = h[0, local]
        return comm.all_reduce(out, self.mesh, "cp")
