"""Pipeline parallelism that runs: the stage split of the model and one executor for every schedule.

Responsible for: splitting a `Transformer` over the "pp" axis (`split_model`: a rank keeps only the
blocks of its chunks, the embedding on stage 0, the final norm and output head on the last stage; the
others become None, and every kept parameter keeps its full-model name, so checkpoints stay
layout-independent), and `run_pipeline_step`, which executes one rank's action list of any schedule
of `meshlm.schedules` (gpipe, 1f1b, interleaved, zero_bubble) on real ranks: forwards,
backwards (fused, or split into input gradient B and weight gradient W for zero_bubble), the
point-to-point transfers of activations and their gradients through `comm.batch_isend_irecv` on the
"pp" axis (counted in `CommStats`), the loss of the last stage, the activations held per
(microbatch, chunk) and freed after their backward, and a timeline of every action (`meshlm.timeline`); also
the gradient norm summed over stages (`pipeline_grad_norm`) and the whole model's state dict gathered
from the stages for the end-of-training sample (`full_state_dict`).
Not responsible for: the order of actions (`schedules.build_schedule`), the rule behind the default
layer counts per stage (`schedules.balanced_split`), splitting the global batch into micro-batches (the trainer), or
reducing gradients over data-parallel ranks (the trainer runs every backward of the step under
`no_sync()` and then reduces once). Tensor parallelism composes from outside: `apply_tensor_parallel`
runs on the split model, the trainer passes the vocab-parallel loss and `sequence_shards`; so does ZeRO-3,
whose gathers hook the modules `PipelineStage.chunk_modules` lists, and which a split W tells, through
`PipelineStage.weight_pass`, that it reads no weight.

How a step runs. There are S = pp * pp_chunks stages; rank r holds chunks c = 0..v-1, stage c * pp + r.
  F(mb, c)  receive the activation of microbatch mb from the rank of stage s - 1 (stage 0 embeds the
            tokens instead), run the chunk, send the output to the rank of stage s + 1 -- or, on the last
            stage, compute the micro-batch loss: sum of token losses / tokens of the global batch (the
            trainer's convention, so gradients summed over micro-batches are those of the global mean).
  B(mb, c)  receive the output gradient from the next stage (the last stage starts from its loss),
            backpropagate, send the gradient of the chunk input to the previous stage. zero_bubble's B
            (`SplitBackward`) walks the chunk's gradient chain once, keeping the graph, for the input
            gradient and the gradients arriving at the outputs of the modules that own parameters
            (recorded by forward hooks during F); no weight-gradient node runs ...
  W(mb, c)  ... and W later the weight gradients: from each recorded module output to that module's own
            parameters only (a matmul, elementwise-product or embedding node each), so B + W run the ops
            of one fused backward (tests/test_pipeline.py counts FLOPs and aten ops), and the input
            gradient the previous stage waits for leaves first. Under full recomputation (and the other
            cases `SplitBackward` lists) W falls back to walking the chain again from the chunk output.
Shapes are known in advance (micro-batch x seq x hidden, the activation dtype), so receives need no
handshake. What travels where is `schedules.exchanges`: after each action, one group (`batch_isend_irecv`)
holds its output, sent on, together with the next action's input, received (in the interleaved steady
state a forward and a backward share one four-way group, as in Megatron). That is NCCL's order: a send
completes only once its receive runs and each rank's groups run one after another, so a send in a group
of its own, or behind a receive of a later action, could wait on a peer that waits on it -- gloo, whose
sends are buffered, would never show it; `tests/test_nccl_order.py` replays every schedule and real runs
under NCCL's rules. Every message also carries a tag naming (activation or gradient, stage,
microbatch) for gloo; NCCL ignores tags and pairs each two ranks' messages in posting order, which the
same replay checks agree message for message.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from meshlm import comm
from meshlm.mesh import Mesh
from meshlm.models.moe import MoE
from meshlm.models.transformer import Transformer, rope_positions
from meshlm import schedules
from meshlm.schedules import Schedule, balanced_split
from meshlm.timeline import TimedAction
from meshlm.rules import check_pipeline_model

# --------------------------------------------------------------------------------------------
# Stage split
# --------------------------------------------------------------------------------------------


def default_layers_per_stage(config, *, pp: int, pp_chunks: int = 1, seq_len: int) -> list[int]:
    """Blocks per stage (stage order) when `parallel.pp_layers` is empty: `schedules.balanced_split`,
    the planner's split, with the output head's compute measured against a block's at `seq_len`
    (`models.stats.pipeline_units`); every stage keeps at least one block."""
    from meshlm.models.stats import pipeline_units  # torch-free arithmetic on the config

    head_units, embed_units = pipeline_units(config, seq_len)
    return balanced_split(config.num_layers, pp=pp, pp_chunks=pp_chunks, head_units=head_units,
                          embed_units=embed_units)


class _WithAuxLoss(torch.autograd.Function):
    """Identity on `h`; in backward it also differentiates `aux` (a loss term computed on this stage) with
    gradient 1, so a stage adds its own loss terms to the one backward that reaches it."""

    @staticmethod
    def forward(ctx, h, aux):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


@dataclass
class PipelineStage:
    """This rank's part of the model: the chunks of stages c * pp + rank, c = 0..pp_chunks - 1."""

    model: Transformer  # pruned in place: only this rank's blocks, embed / norm / lm_head where they live
    rank: int  # coordinate on the pp axis
    pp: int
    pp_chunks: int
    layers_per_stage: list[int]  # over all stages, stage order
    chunk_layers: list[list[str]]  # per chunk of this rank: its block names, in order
    # Entered around each weight-gradient-only pass of a split W (ZeRO-3's `weight_pass`: no weight is read,
    # none gathered); None: nothing to tell
    weight_pass: Callable[[], contextlib.AbstractContextManager] | None = None

    @property
    def num_stages(self) -> int:
        return self.pp * self.pp_chunks

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def is_first(self, chunk: int) -> bool:
        return self.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage(chunk) == self.num_stages - 1

    def forward_chunk(self, chunk: int, x: torch.Tensor, *, seq_len: int | None = None,
                      positions: torch.Tensor | None = None, aux_scale: float = 0.0,
                      documents: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [b, s] (first stage) or hidden states [b, s, h] in; hidden states, or logits on the
        last stage, out. RoPE's cos/sin are recomputed from the positions, as Transformer.forward does:
        `positions` of the tokens this rank holds (context parallelism: its chunks' true positions), or
        0..seq_len-1, `seq_len` the whole sequence's (under sequence parallelism the hidden states are a chunk);
        `documents`: the micro-batch's document ids (document masking, `Transformer.forward`), or None."""
        m = self.model
        h = m.embed(x) if self.is_first(chunk) else x
        positions = rope_positions(seq_len or h.shape[1], positions=positions, documents=documents, device=h.device)
        cos, sin = m.rope(positions, h.dtype)
        for name in self.chunk_layers[chunk]:
            h = m.layers[name](h, cos, sin, documents=documents)
        if aux_scale and torch.is_grad_enabled():
            # The MoE load-balancing losses of this chunk's blocks join the backward here, on their own
            # stage: the loss is computed on the last stage only.
            aux = [b.mlp.last_aux_loss for b in map(m.layers.__getitem__, self.chunk_layers[chunk])
                   if isinstance(b.mlp, MoE) and b.mlp.last_aux_loss is not None]
            if aux:
                h = _WithAuxLoss.apply(h, torch.stack(aux).sum() * aux_scale)
        if self.is_last(chunk):
            h = m.lm_head(m.norm(h))
        return h

    def chunk_modules(self, chunk: int) -> list[nn.Module]:
        """The modules one chunk's forward calls, in order (`forward_chunk`): the embedding on the first
        stage, the chunk's blocks, the final norm and the head on the last (ZeRO-3 gathers around them)."""
        m = self.model
        return ([m.embed] if self.is_first(chunk) else []) + [m.layers[n] for n in self.chunk_layers[chunk]] \
            + ([m.norm, m.lm_head] if self.is_last(chunk) else [])

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The trainable parameters one chunk's forward uses (zero_bubble's W differentiates these)."""
        return [p for mod in self.chunk_modules(chunk) for p in mod.parameters() if p.requires_grad]


def split_model(model: Transformer, *, pp_rank: int, pp: int, pp_chunks: int = 1,
                layers_per_stage: Sequence[int] | None = None) -> PipelineStage:
    """Prune `model` in place to rank `pp_rank`'s chunks and return the stage that runs them.

    `layers_per_stage` (one count per stage, stage order, each >= 1) defaults to
    `default_layers_per_stage` at the model's max_seq_len (the trainer passes the split for
    train.seq_len, `parallelize.pp_layers`). Blocks keep their
    global names ("0".."L-1") in `model.layers`; the blocks of other ranks are dropped, and embed / norm /
    lm_head become None on the ranks that do not hold the first / last stage.
    """
    num_stages = pp * pp_chunks
    config = model.config
    check_pipeline_model(config, num_stages)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} must be in 0..{pp - 1}")
    counts = (list(layers_per_stage) if layers_per_stage is not None
              else default_layers_per_stage(config, pp=pp, pp_chunks=pp_chunks, seq_len=config.max_seq_len))
    if len(counts) != num_stages or sum(counts) != config.num_layers or min(counts) < 1:
        raise ValueError(f"layers per stage {counts} must be {num_stages} counts (pp x pp_chunks), each >= 1, "
                         f"summing to model.num_layers={config.num_layers}")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    chunk_layers = [[str(i) for i in range(starts[c * pp + pp_rank], starts[c * pp + pp_rank] + counts[c * pp + pp_rank])]
                    for c in range(pp_chunks)]
    keep = {n for names in chunk_layers for n in names}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if pp_rank != 0:
        model.embed = None
    if pp_rank != pp - 1:
        model.norm = None
        model.lm_head = None
    return PipelineStage(model=model, rank=pp_rank, pp=pp, pp_chunks=pp_chunks, layers_per_stage=counts,
                         chunk_layers=chunk_layers)


# --------------------------------------------------------------------------------------------
# Executor
# --------------------------------------------------------------------------------------------


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies of one micro-batch (bf16 logits promoted; fp64 stays fp64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


@dataclass
class PipelineStepResult:
    loss: torch.Tensor  # sum over micro-batches of their loss shares, the same on every pp rank
    timeline: list[TimedAction] = field(default_factory=list)  # this rank's actions, in execution order
    peak_activations: int = 0  # most (microbatch, chunk) activations held at once on this rank
    seconds: float = 0.0  # wall time of the whole step on this rank
    t0_wall: float = 0.0  # time.time() at the step's start: aligns the timelines of different ranks

    @property
    def busy(self) -> float:
        return sum(t.end - t.start for t in self.timeline)


class StepClock:
    """Points in time within one step, in seconds from its start: the host's clock on a CPU, where an action's
    host time is its work; CUDA events on a GPU, where the host only queues kernels (read once, after the
    step, so timing adds no synchronisation inside it)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """From the start to `mark` (on CUDA: waits for the mark's event)."""
        if not self.cuda:
            return mark - self.t0
        mark.synchronize()
        return self.t0.elapsed_time(mark) / 1e3


class SplitBackward:
    """zero_bubble's backward split into B (input gradient) and W (weight gradients) without W walking
    the chunk's gradient chain again.

    Every leaf module of a chunk that owns trainable parameters (Linear, RMSNorm and tensor
    parallelism's GradReducedRMSNorm, the embedding, the output head, qk-norms) gets a forward hook
    that records its output tensors during the chunk's F. B differentiates the chunk output with
    respect to its input *and* those outputs in one `torch.autograd.grad` call (the chain is walked
    once; no weight-gradient node runs, since no parameter is asked for); W then backpropagates each
    captured gradient from its module output to that module's own parameters only -- the matmul (or
    elementwise product, or embedding) node of the module, nothing upstream: B + W together run the
    nodes of one fused backward. Hooks firing while a block is recomputed inside B are ignored: the
    recomputed tensors only refill saved tensors, the gradient flows through the graph of the F pass.
    Memory: from B to W a (mb, chunk) holds the captured gradients (one tensor the size of each module
    output) instead of the one output gradient, and B keeps the whole graph (retain_graph), also the
    tensors only the input gradient needed.

    A chunk falls back to W = `torch.autograd.backward(y, grad_out, inputs=chunk params)` (walking
    the chain again) when the split cannot be proven exact: under full recomputation (each per-module
    W call would be a new backward and recompute the block again), when a parameter-owning module has
    submodules or shares a parameter with another module, when a trainable parameter of the chunk is
    owned by no such module, and for a microbatch in which a module ran twice, the second time on an
    input that depends on its first output (its own parameters upstream of itself would be counted twice).
    """

    def __init__(self, stage: PipelineStage):
        self.stage = stage
        full = getattr(stage.model, "_meshlm_recompute", None) == "full"
        self.owners: dict[int, list[tuple[nn.Module, list[nn.Parameter]]] | None] = {}  # chunk -> modules
        self.recording: tuple[int, int] | None = None  # the (mb, chunk) whose F is running
        self.outputs: dict[tuple[int, int], list[tuple[nn.Module, torch.Tensor]] | None] = {}
        self.grads: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._chunk_of: dict[nn.Module, int] = {}
        self._handles = []
        for c in range(stage.pp_chunks):
            want = {id(p): p for p in stage.chunk_parameters(c)}
            owners, seen, ok = [], set(), not full
            for mod in stage.model.modules():
                own = [p for p in mod.parameters(recurse=False) if id(p) in want]
                if not own:
                    continue
                if next(mod.children(), None) is not None or seen & {id(p) for p in own}:
                    ok = False
                seen |= {id(p) for p in own}
                owners.append((mod, own))
            ok = ok and seen == want.keys()
            self.owners[c] = owners if ok else None
            if ok:
                for mod, _ in owners:
                    self._chunk_of[mod] = c
                    self._handles.append(mod.register_forward_hook(self._record))

    def _record(self, mod: nn.Module, args, out) -> None:
        key = self.recording
        if key is None or self._chunk_of.get(mod) != key[1] or self.outputs.get(key) is None:
            return  # not in an F of this chunk (a recomputation inside B, or a fallback microbatch)
        if not isinstance(out, torch.Tensor) or out.grad_fn is None:
            self.outputs[key] = None  # an output we cannot differentiate from: fall back
            return
        outs = self.outputs[key]
        earlier = {t.grad_fn for m, t in outs if m is mod}
        if earlier and _reaches(args, earlier):
            self.outputs[key] = None  # called on its own earlier output: fall back
            return
        outs.append((mod, out))

    def forward(self, key: tuple[int, int], fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run F of (mb, chunk) = key through `fn`, recording the outputs W will need."""
        self.outputs[key] = [] if self.owners[key[1]] is not None else None
        self.recording = key
        try:
            return fn()
        finally:
            self.recording = None

    def backward_input(self, key: tuple[int, int], y: torch.Tensor, x: torch.Tensor | None,
                       grad_out: torch.Tensor | None) -> tuple[torch.Tensor | None, object]:
        """B: the gradient of the chunk input `x` (None: the chunk input is token ids) and what W needs."""
        outs = self.outputs.get(key)
        if outs is None:  # fallback: W walks the chain again from the output
            gx = torch.autograd.grad(y, x, grad_out, retain_graph=True)[0] if x is not None else None
            return gx, grad_out
        wanted = ([x] if x is not None else []) + [t for _, t in outs]
        got = torch.autograd.grad(y, wanted, grad_out, retain_graph=True, allow_unused=True)
        if x is None:
            return None, list(got)
        return got[0], list(got[1:])

    def backward_weight(self, key: tuple[int, int], y: torch.Tensor, saved) -> None:
        """W: the weight gradients of (mb, chunk) = key, accumulated into `.grad`."""
        outs = self.outputs.pop(key, None)
        if outs is None:
            torch.autograd.backward(y, saved, inputs=self.stage.chunk_parameters(key[1]))
            return
        params = dict(self.owners[key[1]])
        weight_pass = getattr(self.stage, "weight_pass", None)  # (a stand-in stage may lack it)
        with weight_pass() if weight_pass is not None else contextlib.nullcontext():
            for (mod, t), g in zip(outs, saved):
                if g is not None:  # None: this output did not reach the chunk output (no gradient)
                    torch.autograd.backward(t, g, inputs=params[mod])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _reaches(args, nodes: set) -> bool:
    """Whether the autograd graph upstream of the tensors in `args` contains one of `nodes`."""
    stack = [a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None]
    seen = set()
    while stack:
        n = stack.pop()
        if n in nodes:
            return True
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(f for f, _ in n.next_functions)
    return False


class _Exchanges:
    """One step's point-to-point traffic on one rank: `exchange(i)` sends and receives group i of the plan
    (`schedules.exchanges`), `take` gives an action its received input, `outbox` holds outputs until their group."""

    def __init__(self, groups: list, mesh: Mesh, axis: str, *, num_stages: int, num_microbatches: int,
                 buffer: Callable[[], torch.Tensor]):
        self.groups, self.mesh, self.axis, self.buffer = groups, mesh, axis, buffer
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        self.sends: list[tuple[comm.CommHandle, torch.Tensor]] = []  # waited late (reaped once done)
        self.outbox: dict[tuple, torch.Tensor] = {}  # (payload, receiving stage, mb) -> computed, not yet sent
        self.inbox: dict[tuple, tuple[comm.CommHandle, torch.Tensor]] = {}  # the same key -> its receive in flight

    def tag(self, msg: schedules.Message) -> int:
        """The same number on the sender and the receiver (gloo matches by it)."""
        kind = ("act", "grad").index(msg.payload)
        return (kind * self.num_stages + msg.stage) * self.num_microbatches + msg.microbatch

    def exchange(self, i: int) -> None:
        ops, received = [], []
        for msg in self.groups[i]:
            key = (msg.payload, msg.stage, msg.microbatch)
            if msg.kind == "send":
                ops.append(comm.P2P("send", self.outbox.pop(key), msg.peer, self.tag(msg)))
            else:
                buf = self.buffer()
                ops.append(comm.P2P("recv", buf, msg.peer, self.tag(msg)))
                received.append((key, buf))
        if ops:
            handle = comm.batch_isend_irecv(ops, self.mesh, self.axis)
            self.sends.extend((handle, op.tensor) for op in ops if op.kind == "send")
            self.inbox.update((key, (handle, buf)) for key, buf in received)

    def take(self, payload: str, stage: int, mb: int) -> torch.Tensor:
        handle, buf = self.inbox.pop((payload, stage, mb))
        handle.wait()
        return buf

    def reap(self) -> None:
        """Drop what finished sends held (a sent gradient would otherwise live until the step ends)."""
        in_flight = []
        for h, t in self.sends:
            h.wait() if h.is_completed() else in_flight.append((h, t))
        self.sends[:] = in_flight

    def finish(self) -> None:
        for handle, _ in self.sends:
            handle.wait()


def _check_step(stage: PipelineStage, schedule: Schedule | None, num_microbatches: int, *, mesh: Mesh, axis: str,
                forward_only: bool) -> None:
    """Refuse a step whose stage, mesh and schedule disagree (before any communication)."""
    pp, v = stage.pp, stage.pp_chunks
    if mesh.size(axis) != pp or (schedule is not None and (schedule.pp, schedule.pp_chunks) != (pp, v)):
        raise ValueError(f"stage (pp={pp}, pp_chunks={v}), mesh {axis}={mesh.size(axis)} and schedule "
                         f"{schedule and (schedule.pp, schedule.pp_chunks)} must agree")
    if schedule is None and not forward_only:
        raise ValueError("a training step needs a schedule (schedules.build_schedule)")
    m = num_microbatches
    if schedule is not None and schedule.num_microbatches != m:
        raise ValueError(f"{m} micro-batches for a schedule of {schedule.num_microbatches}")


def run_pipeline_step(stage: PipelineStage, schedule: Schedule | None,
                      micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, mesh: Mesh, num_tokens: int,
                      loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
                      activation_dtype: torch.dtype | None = None, forward_only: bool = False,
                      sequence_shards: int = 1, positions: torch.Tensor | None = None,
                      aux_scale: float = 0.0, axis: str = "pp") -> PipelineStepResult:
    """Run this rank's actions of `schedule` over `micro_batches` ((inputs, targets) pairs, tokens
    [b, s]; every rank passes the same shapes, only the last stage reads targets; or (inputs, targets,
    documents) with the document ids of document masking, which every stage reads); collective over `axis`.

    Gradients accumulate into the parameters' `.grad` (the caller zeroes them and reduces over data
    parallelism afterwards). `forward_only=True` runs only forwards, under no_grad, chunk by chunk
    (validation; `schedule` may then be None).
    Returns the summed loss (sum over micro-batches of loss_fn / num_tokens), all-reduced over `axis`
    so every stage reports the last stage's value. `sequence_shards`: the hidden states between blocks
    hold seq / sequence_shards positions (tensor parallelism with sequence parallelism: tp). `positions`:
    the true positions of the tokens (context parallelism: this rank's chunks); None: 0..seq-1.
    `aux_scale`: the weight of each micro-batch's MoE load-balancing loss (coefficient / micro-batches of
    the global batch), added on the stage that computes it.
    """
    pp, v = stage.pp, stage.pp_chunks
    m = len(micro_batches)
    _check_step(stage, schedule, m, mesh=mesh, axis=axis, forward_only=forward_only)
    S, rank = stage.num_stages, stage.rank
    bsz, seq = micro_batches[0][0].shape
    device = micro_batches[0][0].device
    if activation_dtype is None:
        activation_dtype = next(stage.model.parameters()).dtype
    shape = (bsz, seq // sequence_shards, stage.model.config.hidden_size)
    if forward_only:
        actions = list(schedules.forward_only_actions(pp, v, m))
    else:
        actions = list(schedule.ranks[rank])
    # What is sent and received where: the previous action's output together with the next action's input,
    # in one group (NCCL's order: a send completes only when its receive runs; see schedules.exchanges).
    groups = schedules.exchanges(tuple(actions), rank=rank, pp=pp, num_stages=S,
                                 pairs=range(0) if forward_only else schedule.steady_pairs(rank))
    clock, t0_wall = StepClock(device), time.time()
    p2p = _Exchanges(groups, mesh, axis, num_stages=S, num_microbatches=m,
                     buffer=lambda: torch.empty(shape, dtype=activation_dtype, device=device))

    # -- compute --------------------------------------------------------------------------------
    # (mb, chunk) -> [chunk input, chunk output (or loss), output gradient (split: what B leaves for
    # W)]; held from F to the backward that frees it (B when fused, W when split).
    held: dict[tuple[int, int], list] = {}
    peak = 0
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    marks: list[tuple] = []  # (action, its start, its end) as StepClock marks
    grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
    split = SplitBackward(stage) if not forward_only and schedule.split_backward else None

    with grad_mode:
        for i, a in enumerate(actions):
            s = stage.stage(a.chunk)
            key = (a.microbatch, a.chunk)
            p2p.exchange(i)
            if a.kind != "W" and (s > 0 if a.kind == "F" else s < S - 1):  # its input comes from a neighbour
                received = p2p.take("act" if a.kind == "F" else "grad", s, a.microbatch)
            start = clock.mark()  # after the input arrived: waiting is not the action's time
            if a.kind == "F":
                if s == 0:
                    x = micro_batches[a.microbatch][0].to(device)
                else:
                    x = received.requires_grad_(not forward_only)
                mb = micro_batches[a.microbatch]
                documents = mb[2].to(device) if len(mb) > 2 and mb[2] is not None else None
                run = functools.partial(stage.forward_chunk, a.chunk, x, seq_len=seq, positions=positions,
                                        aux_scale=aux_scale, documents=documents)
                y = split.forward(key, run) if split is not None else run()
                if s == S - 1:
                    y = loss_fn(y, micro_batches[a.microbatch][1].to(device)) / num_tokens
                    loss_total += y.detach().to(torch.float64)
                else:
                    p2p.outbox[("act", s + 1, a.microbatch)] = y.detach().contiguous()
                if not forward_only:
                    held[key] = [x, y, None]
                    peak = max(peak, len(held))
            elif a.kind == "B":
                x, y, _ = held[key]
                grad_out = received if s < S - 1 else None  # the last stage's y is the loss
                if split is not None:  # zero_bubble: the input gradient (and the module outputs' for W)
                    gx, held[key][2] = split.backward_input(key, y, x if s > 0 else None, grad_out)
                    if s > 0:
                        p2p.outbox[("grad", s - 1, a.microbatch)] = gx.detach().contiguous()
                else:
                    torch.autograd.backward(y, grad_out)
                    if s > 0:
                        p2p.outbox[("grad", s - 1, a.microbatch)] = x.grad.detach().contiguous()
                    del held[key]
            else:  # W: the weight gradients of a split backward
                x, y, saved = held.pop(key)
                split.backward_weight(key, y, saved)
            marks.append((a, start, clock.mark()))
            p2p.reap()

    p2p.exchange(len(actions))  # the last action's output
    p2p.finish()
    end = clock.mark()
    timeline = [TimedAction(a, clock.seconds(start), clock.seconds(stop)) for a, start, stop in marks]
    if split is not None:
        split.remove()
    assert not held and not p2p.inbox and not p2p.outbox, \
        "every activation is freed and every message sent by the step's end"
    loss = comm.all_reduce(loss_total, mesh, axis)  # only the last stage holds a nonzero sum
    return PipelineStepResult(loss=loss, timeline=timeline, peak_activations=peak,
                              seconds=clock.seconds(end), t0_wall=t0_wall)


def pipeline_grad_norm(grads: Sequence[torch.Tensor], mesh: Mesh, *, axis: str = "pp") -> torch.Tensor:
    """Global L2 norm of gradients that each live on one stage: squares summed over `axis` (collective).
    Data-parallel replicas must hold the reduced (whole) gradients already."""
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        sq += torch.linalg.vector_norm(g.detach(), dtype=torch.promote_types(g.dtype, torch.float32)).double() ** 2
    return comm.all_reduce(sq, mesh, axis).sqrt()


@torch.no_grad()
def full_state_dict(stage: PipelineStage, full_model: nn.Module, mesh: Mesh, *, mine: dict | None = None,
                    axis: str = "pp") -> dict:
    """The state dict of the whole model on every pp rank (collective): each tensor broadcast over `axis`
    from the rank whose stage holds it. `full_model` is an unsplit model of the same config; it
    supplies names, shapes and dtypes. `mine`: this stage's full tensors (default: its state dict; under
    tensor parallelism pass them gathered over tp). For the end-of-training sample, not for checkpoints."""
    pp, counts = stage.pp, stage.layers_per_stage
    starts = [sum(counts[:s]) for s in range(len(counts))]

    def owner(name: str) -> int:
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            s = max(i for i, start in enumerate(starts) if start <= layer)
            return s % pp
        return 0 if name.startswith("embed.") else pp - 1

    mine = stage.model.state_dict() if mine is None else mine
    out = {}
    for name, t in full_model.state_dict().items():
        src = owner(name)
        buf = mine[name].detach().clone().contiguous() if src == stage.rank else torch.empty_like(t)
        out[name] = comm.broadcast(buf, mesh, axis, src=src)
    return out
