"""Disaggregated prefill and decode: one launch, two engines, each its own tp x cp layout, KV moved between them.

Responsible for:
  - (the layouts, "tp=2" or "tp=1,cp=2" per instance, are `infer/instances.py`'s, torch-free)
  - the ranks (`disaggregated_engine`): global ranks 0 .. P-1 are the prefill instance, P .. P+D-1 the decode
    instance, each a mesh of its own (`mesh.build_sub_meshes`) running the ordinary tp x cp serving ranks
    (`infer/parallel.py`); a "kv" axis over all ranks carries the KV blocks, a "pd" axis (rank 0 and rank P)
    carries the decode instance's steps and logits;
  - rank 0's `DisaggregatedEngine`, which the server drives like an `Engine`: a request is prefilled by the
    prefill `Engine` (chunked, preempted, prefix-cached as usual) in a thread of its own, which samples its first
    token; it is then handed off (`Engine.hand_off`) to the decode `Engine` (`Engine.take_over`: the tokens the
    decode side's prefix cache holds are not sent) and its missing KV goes from the prefill ranks to the decode
    ranks (`KVTransfer`), while the server's thread steps the decode engine. A request that does not fit on the
    decode side yet waits, its prefill blocks held. The decode engine preempts and recomputes as usual.
  - `KVTransfer`: the resharding. Prefill tp rank t holds kv heads [t H / tp_p, (t + 1) H / tp_p), decode tp
    rank t' [t' H / tp_d, ...); a token's KV lives on the cp rank that owns its block (block b on cp rank
    b % cp, as the block managers place them). Each (prefill rank, decode rank) pair sharing heads and tokens
    exchanges one tensor per transfer [layers, K|V, heads, tokens, head_dim]: every key and value crosses once,
    2 x layers x kv_heads x head_dim x tokens x element size bytes in all, counted on "kv" (op "send" on the
    prefill ranks, "recv" on the decode ranks). All sends and receives of a transfer are one batch
    (`comm.batch_isend_irecv`: grouped under NCCL, matched by peer on gloo), and every rank learns of a transfer
    from its engine's message stream, in the order rank 0 issued it.
Not responsible for: HTTP (server.py; `meshlm serve --prefill/--decode` puts a front process before rank 0,
cli/serve.py), scheduling policy (scheduler.py), KV tiers or speculative decoding (refused here), or where the
ranks run (the launcher's: over --nnodes, the prefill instance's ranks on the first nodes).
"""

from __future__ import annotations

import itertools
import threading
import time

import torch

from meshlm import comm
from meshlm.comm import CollectiveError
from meshlm.infer.attention import read_slots, write_kv
from meshlm.infer.engine import Engine, RequestOutput, run_to_completion
from meshlm.infer.instances import InstanceLayout, check_instances
from meshlm.infer.parallel import RUNNER_ARGS, ParallelRunner, build_runner, run_worker
from meshlm.infer.sequence import SamplingParams, Sequence
from meshlm.mesh import Mesh, ParallelDims, build_sub_meshes, create_groups

TRANSFER = "kv_transfer"  # the message key of a KV transfer in the engines' message streams


# ---------------------------------------------------------------------------------------------
# The KV transfer (every rank)
# ---------------------------------------------------------------------------------------------


class KVTransfer:
    """Who sends which keys/values to whom when a sequence moves from the prefill to the decode instance, and
    this rank's part of it (the module docstring). Decided from the plan alone, the same on every rank.

    A plan is a list of [first token, end token, prefill block table, decode block table] per sequence."""

    def __init__(self, prefill: InstanceLayout, decode: InstanceLayout, *, num_kv_heads: int, block_size: int,
                 rank: int):
        self.prefill, self.decode, self.block_size, self.rank = prefill, decode, block_size, rank
        self.num_kv_heads = num_kv_heads
        self.first_decode = prefill.ranks

    def _heads(self, tp: int, t: int) -> tuple[int, int]:
        per = self.num_kv_heads // tp
        return t * per, (t + 1) * per

    def pairs(self, plan: list) -> dict[tuple[int, int], tuple[list[int], list[int], tuple[int, int]]]:
        """(prefill global rank, decode global rank) -> (prefill local slots, decode local slots, the kv heads
        [lo, hi) they share), for every pair that exchanges anything."""
        bs, p, d = self.block_size, self.prefill, self.decode
        by_cp: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for start, end, src_table, dst_table in plan:
            for pos in range(start, end):
                sb, db = src_table[pos // bs], dst_table[pos // bs]
                src, dst = by_cp.setdefault((sb % p.cp, db % d.cp), ([], []))
                src.append(sb // p.cp * bs + pos % bs)
                dst.append(db // d.cp * bs + pos % bs)
        out = {}
        for (c, c2), (src, dst) in by_cp.items():
            for t, t2 in itertools.product(range(p.tp), range(d.tp)):
                (a, b), (a2, b2) = self._heads(p.tp, t), self._heads(d.tp, t2)
                lo, hi = max(a, a2), min(b, b2)
                if lo < hi:
                    out[c * p.tp + t, self.first_decode + c2 * d.tp + t2] = (src, dst, (lo, hi))
        return out

    def num_bytes(self, plan: list, *, num_layers: int, head_dim: int, element_size: int) -> int:
        """Bytes `plan` moves from all the prefill ranks to the decode ranks: the tensors of every pair."""
        return sum(num_layers * 2 * (hi - lo) * len(src) * head_dim * element_size
                   for src, _, (lo, hi) in self.pairs(plan).values())

    def run(self, runner, mesh: Mesh, plan: list) -> None:
        """This rank's sends (a prefill rank) or receives and writes (a decode rank) of `plan`, as one batch over
        "kv" (whose coordinates are the global ranks)."""
        me = self.rank
        sending = me < self.first_decode
        lo_mine = self._heads(*((self.prefill.tp, me % self.prefill.tp) if sending else
                                (self.decode.tp, (me - self.first_decode) % self.decode.tp)))[0]
        k_caches, v_caches = runner.k_caches, runner.v_caches
        dim, device, dtype = v_caches[0].shape[-1], v_caches[0].device, v_caches[0].dtype
        ops, writes = [], []
        for (src, dst), (src_slots, dst_slots, (lo, hi)) in sorted(self.pairs(plan).items()):
            heads = slice(lo - lo_mine, hi - lo_mine)
            if src == me:
                slots = torch.tensor(src_slots, dtype=torch.long, device=device)
                kv = torch.stack([torch.stack(read_slots(k, v, slots))[:, heads] for k, v in zip(k_caches, v_caches)])
                ops.append(comm.P2P("send", kv.contiguous(), dst))
            elif dst == me:
                buf = torch.empty(len(k_caches), 2, hi - lo, len(dst_slots), dim, dtype=dtype, device=device)
                ops.append(comm.P2P("recv", buf, src))
                writes.append((heads, torch.tensor(dst_slots, dtype=torch.long, device=device), buf))
        if ops:
            comm.batch_isend_irecv(ops, mesh, "kv").wait()
        for heads, slots, buf in writes:
            for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
                write_kv(k[heads], v[heads], slots, buf[layer, 0], buf[layer, 1])


# ---------------------------------------------------------------------------------------------
# Rank 0: the decode instance's runner, and the engine over both instances
# ---------------------------------------------------------------------------------------------


class RemoteRunner(ParallelRunner):
    """Rank 0's runner of the decode instance, whose ranks are P .. P+D-1: a step goes to rank P over "pd" (which
    passes it on to its mesh, `run_worker`'s `upstream`), the logits come back the same way."""

    def __init__(self, mesh: Mesh, *, block_size: int, num_blocks: int, num_groups: int, vocab_size: int):
        self.runner, self.mesh, self.vocab_size = None, mesh, vocab_size
        self._start(block_size=block_size, num_groups=num_groups, num_blocks=num_blocks * num_groups,
                    keepalive_s=1.0)

    tier_store = None

    def _post(self, message) -> None:
        comm.broadcast_json(message, self.mesh, "pd")

    def _compute(self, step) -> torch.Tensor:
        out = torch.empty(len(step.logits_indices), self.vocab_size, dtype=torch.float32,
                          device=comm._comm_device(self.mesh))
        return comm.recv(out, self.mesh, "pd", src=1)


class InstanceFailed(CollectiveError):
    """A rank of one instance (or the link between them) is gone; the message names the instance."""


class DisaggregatedEngine:
    """Rank 0's engine over a prefill and a decode instance, with `Engine`'s interface as the server and
    `run_to_completion` use it (make_sequence, add_sequence, add_request, abort, step, has_unfinished, requests,
    stats). The prefill engine runs in a thread of its own; `step` steps the decode engine and returns what both
    produced since the last call (a request's first token, from the prefill, before the decode's tokens)."""

    def __init__(self, prefill: Engine, decode: Engine, transfer: KVTransfer, *, prefill_local, mesh: Mesh,
                 names: tuple[str, str]):
        self.prefill, self.decode, self.transfer = prefill, decode, transfer
        self.prefill_local, self.mesh = prefill_local, mesh  # rank 0's own ModelRunner (its share of the KV)
        self.names = names  # how errors name the prefill and the decode instance
        self.model, self.tokenizer, self.max_model_len = decode.model, decode.tokenizer, decode.max_model_len
        self.speculative, self.tiers = None, None
        self._decode_lock = threading.Lock()  # the decode engine's state: its steps, hand-offs, aborts
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, object]] = []  # ("add", seq) | ("abort", request id), for the prefill thread
        self._outbox: list[RequestOutput] = []  # the prefill engine's outputs, for `step`
        self._handoffs: list[tuple[Sequence, Sequence, tuple]] = []  # prefilled, waiting for room on the decode side
        self._in_prefill = 0  # requests added and not yet finished by the prefill or taken over by the decode
        self._prefill_ids: set[str] = set()
        self.failed: Exception | None = None
        self._stopping = False
        self._next_id = 0
        self.num_transfers = 0
        self.transferred_tokens = 0  # tokens whose KV went to the decode instance
        self.transferred_bytes = 0  # their keys and values, sent by all the prefill ranks
        self.handed_off_tokens = 0  # tokens whose KV the decode instance needed (transferred or found cached)
        self.transfer_seconds = 0.0
        self._thread = threading.Thread(target=self._prefill_loop, name="meshlm-prefill", daemon=True)
        self._cuda = torch.cuda.current_device() if mesh.device_type == "cuda" else None
        self._thread.start()

    # ---- requests (any thread but the prefill's) ------------------------------------------------

    def make_sequence(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None) -> Sequence:
        hold = min(engine.scheduler.most_tokens_per_sequence() for engine in (self.prefill, self.decode))
        seq = self.prefill.make_sequence(prompt, params, request_id=request_id, hold=hold)
        self.decode.scheduler.check(seq)  # it must fit the decode instance's cache too
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        with self._cv:
            if seq.request_id in self._prefill_ids or seq.request_id in self.decode.requests:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self._prefill_ids.add(seq.request_id)
            self._inbox.append(("add", seq))
            self._in_prefill += 1
            self._cv.notify_all()

    def add_request(self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None) -> Sequence:
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        seq = self.make_sequence(prompt, params, request_id=request_id)
        self.add_sequence(seq)
        return seq

    def abort(self, request_id: str) -> None:
        with self._decode_lock:
            if request_id in self.decode.requests:
                self.decode.abort(request_id)
                return
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify_all()

    @property
    def requests(self) -> dict:
        with self._cv:
            return {**dict.fromkeys(self._prefill_ids), **self.decode.requests}

    def has_unfinished(self) -> bool:
        with self._cv:
            return bool(self._in_prefill or self._outbox or self.decode.has_unfinished())

    def generate(self, prompts, params) -> list[RequestOutput]:
        return run_to_completion(self, prompts, params)

    # ---- the decode side (the caller's thread) ----------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One decode step (when the decode engine has work), and the prefill's outputs since the last call; waits
        a moment for the prefill when neither has anything."""
        if self.failed is not None:
            raise self.failed
        try:
            with self._decode_lock:
                outs = self.decode.step() if self.decode.has_unfinished() else []
                with self._cv:  # after the step: a first token is queued before its hand-off, so it comes first
                    firsts, self._outbox = self._outbox, []
        except CollectiveError as e:
            self.failed = InstanceFailed(f"the decode instance ({self.names[1]}) failed: {e}")
            raise self.failed from e
        if not outs and not firsts:
            with self._cv:
                self._cv.wait_for(lambda: self._outbox or self.failed is not None, timeout=0.005)
        return firsts + outs

    def stats(self) -> dict:
        """The decode engine's counters (what the server exports), each instance's own under "prefill" and
        "decode", and the KV transfers' (tokens handed off = transferred + skipped, the decode instance's prefix
        cache holding the skipped ones)."""
        d, p = self.decode.stats(), self.prefill.stats()
        return {**d, "generated_tokens": d["generated_tokens"] + p["generated_tokens"], "prefill": p, "decode": d,
                "kv_transfers": self.num_transfers, "kv_transferred_tokens": self.transferred_tokens,
                "kv_transferred_bytes": self.transferred_bytes, "kv_handed_off_tokens": self.handed_off_tokens,
                "kv_transfer_skipped_tokens": self.handed_off_tokens - self.transferred_tokens,
                "kv_transfer_seconds": self.transfer_seconds}

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        for runner in (self.prefill.runner, self.decode.runner):
            try:
                runner.close()
            except CollectiveError:
                pass  # that instance is gone already

    # ---- the prefill side (its own thread) ------------------------------------------------------------

    def _prefill_loop(self) -> None:
        if self._cuda is not None:
            torch.cuda.set_device(self._cuda)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self._inbox or self._handoffs
                                  or self.prefill.has_unfinished(), timeout=0.005 if self._handoffs else None)
                if self._stopping:
                    return
                inbox, self._inbox = self._inbox, []
            try:
                for kind, item in inbox:
                    if kind == "add":
                        self.prefill.add_sequence(item)
                    else:
                        self._abort_here(item)
                outs = self.prefill.step() if self.prefill.has_unfinished() else []
                leaving = [self.prefill.hand_off(o.request_id) for o in outs if not o.finished]
                with self._cv:
                    self._outbox.extend(outs)
                    self._done_here([o.request_id for o in outs if o.finished])
                    self._cv.notify_all()
                self._handoffs.extend(leaving)
                self._move()
            except Exception as e:  # noqa: BLE001 -- this thread ends: every request fails, the server says why
                where = "the KV transfer between the instances" if self._moving else \
                    f"the prefill instance ({self.names[0]})"
                why = str(e) if isinstance(e, CollectiveError) else f"{type(e).__name__}: {e}"
                with self._cv:
                    self.failed = InstanceFailed(f"{where} failed: {why}")
                    self._cv.notify_all()
                return

    _moving = False

    def _abort_here(self, request_id: str) -> None:
        if request_id in self.prefill.requests:
            self.prefill.abort(request_id)
        else:
            for i, (seq, _, _) in enumerate(self._handoffs):
                if seq.request_id == request_id:
                    self.prefill.block_manager.free(seq)
                    self.prefill.finish_reasons["abort"] += 1
                    del self._handoffs[i]
                    break
            else:  # taken over meanwhile (or finished): the decode engine's
                with self._decode_lock:
                    self.decode.abort(request_id)
                return
        with self._cv:
            self._done_here([request_id])

    def _done_here(self, request_ids: list[str]) -> None:
        """(Under `_cv`.) Requests that left the prefill side: finished, aborted or taken over."""
        for request_id in request_ids:
            if request_id in self._prefill_ids:
                self._prefill_ids.discard(request_id)
                self._in_prefill -= 1

    def _move(self) -> None:
        """Hand the prefilled requests, oldest first, to the decode engine while it has room, and send their
        missing KV (no decode step runs meanwhile); then free their prefill blocks."""
        if not self._handoffs:
            return
        moved, plan = [], []
        with self._decode_lock:
            while self._handoffs:
                seq, copy, state = self._handoffs[0]
                n = seq.num_computed_tokens
                cached = self.decode.take_over(copy, state, n)
                if cached is None:
                    break
                self._handoffs.pop(0)
                moved.append(seq)
                self.handed_off_tokens += n
                if cached < n:
                    plan.append([cached, n, list(seq.block_table), list(copy.block_table)])
                    self.transferred_tokens += n - cached
            if plan:
                t0 = time.perf_counter()
                self._moving = True
                message = {TRANSFER: plan}
                self.decode.runner.run_exclusive(message, lambda: self.prefill.runner.run_exclusive(
                    message, lambda: self.transfer.run(self.prefill_local, self.mesh, plan)))
                self._moving = False
                self.num_transfers += 1
                self.transfer_seconds += time.perf_counter() - t0
                v = self.prefill_local.v_caches[0]
                self.transferred_bytes += self.transfer.num_bytes(
                    plan, num_layers=len(self.prefill_local.v_caches), head_dim=v.shape[-1],
                    element_size=v.element_size())
        for seq in moved:
            self.prefill.block_manager.free(seq)
        with self._cv:
            self._done_here([seq.request_id for seq in moved])


# ---------------------------------------------------------------------------------------------
# Every rank
# ---------------------------------------------------------------------------------------------


def disaggregated_engine(model, prefill: InstanceLayout, decode: InstanceLayout, *, device: str = "auto",
                         dtype: torch.dtype | None = None, tokenizer=None, comm_stats=None,
                         prefill_options: dict | None = None, decode_options: dict | None = None,
                         **engine_kwargs) -> DisaggregatedEngine | None:
    """On every rank of a launch of prefill.ranks + decode.ranks ranks (each calls it with the same arguments):
    on rank 0, the `DisaggregatedEngine` (close it to release the others); on the others, their part of every
    step and transfer, returning None once rank 0 closes. `model`: a path (`LLM`'s) or a `Transformer` (the full
    weights on every rank); `engine_kwargs`: `Engine`'s and the KV cache's (`LLM`'s), for both instances;
    `prefill_options` / `decode_options`: those that differ (e.g. num_blocks, max_num_batched_tokens). KV tiers
    and speculative decoding are refused."""
    from meshlm.infer.llm import model_for_serving, serving_device

    from meshlm.infer.kv_tiers import KVTierConfig

    prefill_options, decode_options = dict(prefill_options or {}), dict(decode_options or {})
    for opts in (engine_kwargs, prefill_options, decode_options):
        tiers = KVTierConfig.of(opts.pop("kv_host_mb", None), opts.pop("kv_disk_dir", None), opts.pop("kv_disk_mb", None))
        if tiers is not None or opts.get("speculative") is not None or opts.get("draft_model") is not None:
            raise ValueError("KV tiers and speculative decoding are not combined with disaggregated prefill/decode "
                             "yet; leave them out")
        opts.pop("speculative", None)
    device, dtype = serving_device(device, dtype)
    net, tok = model_for_serving(model, tokenizer, dtype=dtype, device=device, engine_kwargs=engine_kwargs)
    check_instances(net.config, prefill, decode)
    device_type = torch.device(device).type
    parts = [ParallelDims(tp=lo.tp, cp=lo.cp, dp_shard=1).resolve(lo.ranks) for lo in (prefill, decode)]
    mesh = build_sub_meshes(parts, device_type=device_type, stats=comm_stats)
    world, first_decode = prefill.ranks + decode.ranks, prefill.ranks
    kv_group = create_groups([list(range(world))], mesh.rank)
    pd_group = create_groups([[0, first_decode]], mesh.rank)
    axes = {"kv": (list(range(world)), kv_group)}
    if mesh.rank in (0, first_decode):
        axes["pd"] = ([0, first_decode], pd_group)
    mesh = mesh.with_axes(axes)
    if device_type == "cuda":  # NCCL: the first p2p batch on a group must involve all its ranks; this call does
        comm.all_reduce(torch.zeros(1, device=comm._comm_device(mesh)), mesh, "kv")
    options = [{**engine_kwargs, **(opts or {})} for opts in (prefill_options, decode_options)]
    mine = options[0 if mesh.rank < first_decode else 1]
    runner = build_runner(net, mesh, **{k: mine.pop(k) for k in RUNNER_ARGS if k in mine})
    for opts in options:
        for k in RUNNER_ARGS:
            opts.pop(k, None)
    transfer = KVTransfer(prefill, decode, num_kv_heads=net.config.num_kv_heads, block_size=runner.block_size,
                          rank=mesh.rank)
    handlers = {TRANSFER: transfer.run}
    if mesh.rank == first_decode:
        comm.broadcast_json({"num_blocks": runner.num_blocks, "block_size": runner.block_size}, mesh, "pd", src=1)
        reply = lambda logits: comm.send(logits.contiguous(), mesh, "pd", dst=0)  # noqa: E731
        run_worker(runner, mesh, handlers=handlers, upstream=(lambda: comm.broadcast_json(None, mesh, "pd"), reply))
        return None
    if not mesh.is_first:
        run_worker(runner, mesh, handlers=handlers)
        return None
    remote = comm.broadcast_json(None, mesh, "pd", src=1)
    decode_runner = RemoteRunner(mesh, block_size=remote["block_size"], num_blocks=remote["num_blocks"],
                                 num_groups=decode.cp, vocab_size=net.config.vocab_size)
    names = (f"{prefill.label()}, ranks 0-{first_decode - 1}", f"{decode.label()}, ranks {first_decode}-{world - 1}")
    return DisaggregatedEngine(Engine(runner.model, tok, runner=ParallelRunner(runner, mesh), **options[0]),
                               Engine(runner.model, tok, runner=decode_runner, **options[1]), transfer,
                               prefill_local=runner, mesh=mesh, names=names)
