"""Replica-group fault tolerance on torchft: data-parallel replica groups that drop out and rejoin.

Responsible for: `ReplicaTrainer`, the trainer of one replica group (parallel.fault_tolerance=replica): each
step asks torchft's Manager for a quorum of the live groups (through the lighthouse), averages the gradients over
them only, and commits the step only when every rank of the group got through; a group that fell behind (restarted,
or new) copies the model, optimizer and data position from a live group inside the quorum. `replica_group_config`
(this group's run_dir), `check_lighthouse` (one line when it cannot be reached), and `MembershipReplay`, the
one-process reference that applies a recorded sequence of quorum memberships (the drill's float64 check).
Not responsible for: starting the groups or the lighthouse (`meshlm.replica_launch`), the layout inside a group
(the usual transforms; `rules.check_replica_groups` says which ones), or storage checkpoints (as any run; each
group writes its own under run_dir/replica_<i>).

The numbers. Group g of N takes slice g of every global batch (B sequences: ranks g*d .. g*d+d-1 of N*d data
slices, d the group's own data-parallel degree), and its ranks' losses are normalised by the whole batch's tokens
as usual. With P groups live in a step, the gradients are SUMMED over them and scaled by N/P: the gradient of the
mean loss over the tokens the live groups processed (all groups hold the same number; of conversations, whose
loss counts the assistant's targets only, the groups' counts differ, and a step without some group scales as if
they did not). The reported loss is that mean too. `metrics.jsonl` rows carry `replicas` (the live groups of that
step) and `replica_group`; replaying those memberships in one process (`MembershipReplay`) gives the same weights.

A step whose cross-group reduction failed (a peer died mid-step) is not committed: the optimizer does not step,
the data position goes back, and the step is retried with the next quorum (torchft's `max_retries` bounds it).
Semi-synchronous (parallel.replica_sync_every = H > 1), for slow links between groups: torchft's LocalSGD
(replica_outer=average: the weights averaged) or DiLoCo (diloco: the moves since the last sync averaged and applied
by an outer Nesterov SGD), hooked on the optimizer. Every group then steps on its own slice alone (gradients x N:
the mean over its own tokens; of conversations, N x its counted targets' losses over the whole batch's count),
and every H-th step runs the quorum and the synchronisation; a failed one is simply
not committed (LocalSGD keeps the local weights, DiLoCo goes back to the last sync's). Rows of sync steps carry
`replicas` and `synced`.
Recovery state travels over torchft's HTTP transport and is read with `weights_only=True`: tensors and plain data,
nothing that runs code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch

from meshlm import comm
from meshlm.config import Config
from meshlm.mesh import AXES
from meshlm.parallel.parallelize import micro_batch_size
from meshlm.train.optim import clip_grad_norm, lr_at, set_lr
from meshlm.train.trainer import Trainer

MAX_RETRIES = 20  # consecutive uncommitted steps before a group gives up (torchft raises)
# The lighthouse `meshlm train --replica-groups` starts (`meshlm.replica_launch`): a new quorum waits this long for
# groups still heartbeating to ask for it; a group silent this long (dead) is left out of the next one.
JOIN_TIMEOUT_S = 10.0
HEARTBEAT_TIMEOUT_S = 3.0


class ReplicaRefused(ValueError):
    """This group cannot join the running ones (another model or layout)."""


def replica_group_config(cfg: Config) -> Config:
    """The config one replica group's job runs: its run_dir is run_dir/replica_<i> (checkpoints, metrics)."""
    p = cfg.parallel
    if p.fault_tolerance == "none" or Path(cfg.train.run_dir).name == f"replica_{p.replica_group}":
        return cfg
    if not p.lighthouse:
        raise ValueError("parallel.fault_tolerance=replica needs parallel.lighthouse=http://HOST:PORT (a running "
                         "torchft lighthouse), or start every group here with `meshlm train --replica-groups N`")
    train = dataclasses.replace(cfg.train, run_dir=str(Path(cfg.train.run_dir) / f"replica_{p.replica_group}"))
    return dataclasses.replace(cfg, train=train)


def check_lighthouse(address: str, *, timeout_s: float = 5.0) -> None:
    """One line naming `address` when nothing answers there (before any rank or quorum waits on it)."""
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        host, port = url.hostname, url.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise ValueError(f"parallel.lighthouse={address!r} is not an address; use http://HOST:PORT")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"the torchft lighthouse at {address} is unreachable ({e.strerror or e}); start it "
                         "(`torchft_lighthouse`, or `meshlm train --replica-groups N` starts one) or fix "
                         "parallel.lighthouse") from None


def fingerprint(cfg: Config, trainer: Trainer) -> dict:
    """What every group of one run must share: the model, the layout inside the group, the batch, the data."""
    p, t = cfg.parallel, cfg.train
    dims = trainer.mesh.dims
    return {"model": dataclasses.asdict(cfg.model), "layout": " ".join(f"{a}={dims.degree(a)}" for a in AXES),
            "replica_groups": p.replica_groups, "global_batch_size": t.global_batch_size, "seq_len": t.seq_len,
            "precision": t.precision, "samples": len(trainer.train_data),
            "sync": f"every {p.replica_sync_every} step(s), {p.replica_outer}"}


def mismatch(mine: dict, theirs: dict) -> str:
    """The first setting two fingerprints differ in, as `name: mine vs theirs`."""
    for key in mine:
        a, b = mine[key], theirs.get(key)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                diff = [k for k in a if a[k] != b.get(k)]
                return f"model.{diff[0]}={a[diff[0]]!r} here, {b.get(diff[0])!r} in the running groups"
            return f"{key}={a!r} here, {b!r} in the running groups"
    return ""


def quiet_torchft() -> None:
    """torchft logs every quorum (Rust, INFO) and every checkpoint request (HTTP access lines); meshlm says what
    matters in its own lines (`ReplicaTrainer.attempt_step`). RUST_LOG, when set, still wins."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.CRITICAL)


def transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport, reading what it receives with weights_only=True (no code runs)."""
    import urllib.request
    import warnings

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing import HTTPTransport

    class PlainHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f, warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": the tensors are copied in
                return _streaming_load(f, weights_only=True)

    server = PlainHTTPTransport(timeout=timeout, num_chunks=0)
    server._server.RequestHandlerClass.log_message = lambda *args: None  # no access line per request
    return server


class ReplicaTrainer(Trainer):
    """The trainer of replica group `parallel.replica_group` of `parallel.replica_groups` (see the module doc)."""

    def __init__(self, cfg: Config, *, resume: bool = False, overwrite: bool = False, restarts: int = 0):
        kept = _kept_metrics(cfg, restarts)
        super().__init__(cfg, resume=resume, overwrite=overwrite, restarts=restarts)
        if kept is not None and self.is_main:  # a restarted group keeps the record of the steps it took part in
            (self.run_dir / "metrics.jsonl").write_text(kept)
        self.fingerprint = fingerprint(self.cfg, self)
        self.healed_at: int | None = None
        self.joined = False  # this process has had its first quorum
        self.in_step = False  # inside optimizer.step(), where the semi-synchronous sync runs (see replica_state)
        self.manager = self.start_manager()
        self.outer = self.start_outer() if self.cfg.parallel.replica_sync_every > 1 else None

    def setup_mesh(self, dims) -> None:
        super().setup_mesh(dims)
        p = self.cfg.parallel
        self.group_dp = (self.dp_rank, self.dp_size)  # the data ranks inside this group
        self.dp_rank, self.dp_size = p.replica_group * self.dp_size + self.dp_rank, p.replica_groups * self.dp_size
        self.micro_batch_size = micro_batch_size(self.cfg, self.dp_size)

    def start_manager(self):
        """torchft's Manager for this rank: a store of this group's own (its address goes to the others in the
        quorum), a reconfigurable gloo group per group rank across the groups, the lighthouse at parallel.lighthouse."""
        p = self.cfg.parallel
        check_lighthouse(p.lighthouse)
        quiet_torchft()
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=p.collective_timeout_s)
        host, store = socket.gethostname(), None
        if self.is_main:
            store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        port = self.broadcast_setup(store.port if store is not None else None)
        pg = ProcessGroupNCCL(timeout=timeout) if self.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._store = store  # rank 0 keeps the group's store alive
        manager = Manager(pg=pg, load_state_dict=self.load_replica_state, state_dict=self.replica_state,
                          min_replica_size=p.min_replica_groups, use_async_quorum=False, timeout=timeout,
                          quorum_timeout=max(timeout, timedelta(seconds=2 * JOIN_TIMEOUT_S)),
                          connect_timeout=timedelta(seconds=30), rank=self.rank, world_size=self.world_size,
                          store_addr=host, store_port=port, lighthouse_addr=p.lighthouse,
                          replica_id=f"meshlm_{p.replica_group}", hostname=host, checkpoint_transport=transport(timeout),
                          init_sync=True, max_retries=MAX_RETRIES)
        # torchft's step counts synchronisations: a resumed group starts at its own
        manager.load_state_dict({"step": self.step // p.replica_sync_every, "batches_committed": 0})
        return manager

    def start_outer(self):
        """Semi-synchronous groups: torchft's LocalSGD or DiLoCo, hooked on the optimizer for the whole run
        (every parallel.replica_sync_every-th optimizer step runs a quorum and the synchronisation)."""
        from torchft.local_sgd import DiLoCo, LocalSGD

        p = self.cfg.parallel
        if p.replica_outer == "average":
            outer = LocalSGD(self.manager, self.base_model, self.optimizer, sync_every=p.replica_sync_every)
        else:
            sgd = torch.optim.SGD(self.base_model.parameters(), lr=p.replica_outer_lr,
                                  momentum=p.replica_outer_momentum, nesterov=True)
            outer = DiLoCo(self.manager, [self.base_model], self.optimizer, sgd, sync_every=p.replica_sync_every,
                           pin_memory=False)
        return outer.__enter__()

    def broadcast_setup(self, port: int | None) -> int:
        """Rank 0's store port on every rank of the group (inside a group: dp x tp ranks, pp = cp = 1)."""
        port = comm.broadcast_json(port, self.mesh, "dp")  # the ranks of tp coordinate 0 get rank 0's
        return int(comm.broadcast_json(port, self.mesh, "tp"))

    # -- what a rejoining group copies from a live one -------------------------------------------------
    def replica_state(self) -> dict:
        # "step": the steps taken, counting one in flight (a semi-synchronous sync runs inside optimizer.step())
        return {"model": self.base_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "loader": self.loader.state_dict(), "step": self.step + self.in_step,
                "first_val_loss": self.first_val_loss, "fingerprint": self.fingerprint}

    def load_replica_state(self, state: dict) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise ReplicaRefused(f"replica group {self.cfg.parallel.replica_group} refused: it does not match the "
                                 f"running groups ({mismatch(self.fingerprint, state['fingerprint'])})")
        self.base_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"]) - self.in_step  # (this group's step in flight is the one it completes)
        self.first_val_loss, self.saved_step, self.healed_at = state["first_val_loss"], None, self.step

    # -- one step ---------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One committed step: attempts until one commits (a failed attempt changes nothing)."""
        if self.outer is not None:
            return self.local_step()
        retried = 0
        while True:
            row = self.attempt_step()
            if row is not None:
                row["retried"] = retried
                return row
            retried += 1

    def attempt_step(self) -> dict | None:
        """Quorum, forward/backward on this group's slice, the reduction over the live groups, and the optimizer
        step if every rank of the group got through (else None, the data position put back)."""
        t, p = self.cfg.train, self.cfg.parallel
        start = time.perf_counter()
        self.quorum()
        position = self.loader.state_dict()
        data_wait, lr, num_tokens, loss = self.run_slice(start)
        members, loss = self.average_gradients(loss)
        grad_norm = clip_grad_norm(self.parallel.clip_params(self.base_model), t.grad_clip,
                                   norm_fn=self.parallel.grad_norm_fn)
        if not self.manager.should_commit() or members is None:  # should_commit first: every rank calls it
            self.loader.load_state_dict(position)
            self.optimizer.zero_grad(set_to_none=True)
            self.say(f"step {self.step + 1} not committed ({self.why_not()}); retrying with a new quorum")
            return None
        self.optimizer.step()
        self.step += 1
        comm_stats = self.mesh.stats.summary()
        row = self.metrics_row(loss, lr=lr, grad_norm=float(grad_norm), start=start, data_wait=data_wait,
                               num_tokens=num_tokens * len(members) // p.replica_groups, comm_stats=comm_stats)
        row.update(replicas=members, replica_group=p.replica_group)
        if self.healed_at is not None:
            row["healed_at"], self.healed_at = self.healed_at, None
        return row

    def run_slice(self, start: float) -> tuple[float, float, int, float]:
        """This group's slice of the next global batch, forward and backward (losses over the whole batch's
        tokens, reduced inside the group); (data wait, lr, the batch's tokens, this group's share of the loss)."""
        t = self.cfg.train
        self.mesh.stats.reset()
        micro_batches = self.loader.next_batch()
        data_wait = time.perf_counter() - start
        lr = lr_at(self.step, t)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = t.global_batch_size * t.seq_len
        return data_wait, lr, num_tokens, float(self.sum_over_dp(
            self.forward_backward(micro_batches, num_tokens=self.loader.loss_divisor)))

    def local_step(self) -> dict:
        """A semi-synchronous step: this group's slice alone (its gradients x N: the mean over its own tokens);
        every H-th step the optimizer's torchft hook synchronises the groups. Its row says which groups took part
        (`replicas`) and whether the synchronisation committed (`synced`)."""
        t, p = self.cfg.train, self.cfg.parallel
        if not self.joined:  # the groups start (or one rejoins) with a synchronisation
            self.quorum(sync=self.sync_now)
        start = time.perf_counter()
        data_wait, lr, num_tokens, loss = self.run_slice(start)
        for q in self.base_model.parameters():
            if q.grad is not None:
                q.grad.mul_(p.replica_groups)
        grad_norm = clip_grad_norm(self.parallel.clip_params(self.base_model), t.grad_clip,
                                   norm_fn=self.parallel.grad_norm_fn)
        syncs = self.manager.current_step()
        self.in_step = True
        try:
            self.optimizer.step()  # every H-th: quorum (a group behind loads a live one's state) and sync
        finally:
            self.in_step = False
        self.step += 1
        row = self.metrics_row(loss * p.replica_groups, lr=lr, grad_norm=float(grad_norm), start=start,
                               data_wait=data_wait, num_tokens=num_tokens // p.replica_groups,
                               comm_stats=self.mesh.stats.summary())
        row["replica_group"] = p.replica_group
        if self.outer._local_step == 0:  # (torchft's counter: it synchronised in this step)
            row.update(replicas=self.membership(0.0)[0], synced=self.manager.current_step() > syncs)
            if not row["synced"]:
                self.say(f"step {self.step}: synchronisation not committed ({self.why_not()})")
        if self.healed_at is not None:
            row["healed_at"], self.healed_at = self.healed_at, None
        return row

    def why_not(self) -> str:
        error = self.manager.errored()
        if error is None:
            return "another rank of this group failed, or too few groups"
        return str(getattr(error, "original_exception", error)).strip().splitlines()[0][:200] or type(error).__name__

    def say(self, line: str) -> None:
        if self.is_main:
            print(f"meshlm: replica group {self.cfg.parallel.replica_group}: {line}", file=sys.stderr, flush=True)

    def quorum(self, sync=None) -> None:
        """The quorum of this step; a group behind the others loads their state here (`load_replica_state`).
        The first quorum of a process waits (parallel.replica_start_wait_s at most) for all N groups, so that groups
        started together train together from their first step; every quorum waits for parallel.min_replica_groups.
        `sync`: what to run instead of a bare quorum (semi-synchronous groups: a whole synchronisation, so that a
        group joining the others' sync takes part in its collectives too)."""
        p, first = self.cfg.parallel, not self.joined
        need = p.replica_groups if first else p.min_replica_groups
        deadline = time.monotonic() + (p.replica_start_wait_s if first else p.collective_timeout_s)
        while True:
            (sync or self.start_quorum)()
            live = self.manager.num_participants()
            if live >= need:
                break
            if time.monotonic() > deadline:
                if live >= p.min_replica_groups:  # (a first quorum that waited long enough for the others)
                    break
                raise RuntimeError(f"replica group {p.replica_group}: {live} replica group(s) live, fewer than "
                                   f"parallel.min_replica_groups={p.min_replica_groups}; stopping")
            time.sleep(0.2)
        self.joined = True
        if sync is None:
            assert self.manager.current_step() == self.step, (self.manager.current_step(), self.step)

    def sync_now(self) -> None:
        """One synchronisation of the semi-synchronous groups, outside the optimizer's hook: torchft's LocalSGD's
        `sync`; DiLoCo has no public one, so its hook runs as on the H-th step (its step counter set to H - 1)."""
        from torchft.local_sgd import LocalSGD

        if isinstance(self.outer, LocalSGD):
            self.outer.sync()
        else:
            self.outer._local_step = self.outer._sync_every - 1
            self.outer._step_post_hook(self.optimizer, (), {})

    def start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except ReplicaRefused:
            raise
        except Exception as e:  # noqa: BLE001 -- torchft raises what its RPCs raise
            raise RuntimeError(f"replica group {self.cfg.parallel.replica_group}: no quorum from the torchft "
                               f"lighthouse at {self.cfg.parallel.lighthouse} ({str(e).splitlines()[0][:300]})") from e

    # -- the reductions over the live groups ------------------------------------------------------------
    def membership(self, loss: float) -> tuple[list[int] | None, float]:
        """(the live groups of this step, the loss summed over them); (None, loss) when the reduction failed."""
        from torch.distributed import ReduceOp

        n, g = self.cfg.parallel.replica_groups, self.cfg.parallel.replica_group
        head = torch.zeros(n + 1, dtype=torch.float64)
        head[0], head[1 + g] = loss, 1.0
        self.manager.allreduce(head, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored():
            return None, loss
        return [i for i in range(n) if head[1 + i] > 0.5], float(head[0])

    def average_gradients(self, loss: float) -> tuple[list[int] | None, float]:
        """Gradients summed over the live groups, x N/P (see the module doc); returns (members, mean loss)."""
        from torch.distributed import ReduceOp

        members, loss = self.membership(loss)
        if members is None:
            return None, loss
        params = [q for q in self.base_model.parameters() if q.requires_grad]
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        begin = time.perf_counter()
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        self.mesh.stats.record("all_reduce", "replica", flat.numel() * flat.element_size(),
                               time.perf_counter() - begin)
        if self.manager.errored():
            return None, loss
        scale = self.cfg.parallel.replica_groups / len(members)
        flat.mul_(scale)
        offset = 0
        for q in params:
            q.grad.copy_(flat[offset: offset + q.numel()].view_as(q))
            offset += q.numel()
        return members, loss * scale

    def announce(self, logger) -> None:
        super().announce(logger)
        p = self.cfg.parallel
        how = "every step" if p.replica_sync_every == 1 else f"every {p.replica_sync_every} steps ({p.replica_outer})"
        logger.print(f"meshlm: replica group {p.replica_group} of {p.replica_groups} (torchft, lighthouse "
                     f"{p.lighthouse}), synchronised {how}")

    # -- validation over the whole validation set, inside the group -----------------------------------------
    def evaluate(self) -> float:
        outer = (self.dp_rank, self.dp_size, self.micro_batch_size)
        self.dp_rank, self.dp_size = self.group_dp
        self.micro_batch_size = micro_batch_size(self.cfg, self.dp_size)
        try:
            return super().evaluate()
        finally:
            self.dp_rank, self.dp_size, self.micro_batch_size = outer

    def train(self, *, until_step: int | None = None) -> dict:
        try:
            return super().train(until_step=until_step)
        finally:
            if self.outer is not None:
                self.outer.__exit__(None, None, None)
            self.manager.shutdown(wait=False)


def _kept_metrics(cfg: Config, restarts: int) -> str | None:
    """metrics.jsonl of a restarted group (the trainer of a run restarting without a checkpoint clears it)."""
    path = Path(cfg.train.run_dir) / "metrics.jsonl"
    return path.read_text() if restarts and path.is_file() else None


class MembershipReplay(Trainer):
    """The reference of a replica-group run, in one process: step s runs the micro-batches of the groups in
    `memberships[s]` only and scales the gradients by N/P, exactly as the live groups did (`metrics.jsonl`'s
    `replicas` of each step). `cfg` is the groups' config with the layout of one process."""

    def __init__(self, cfg: Config, memberships: dict[int, list[int]], *, replica_groups: int,
                 group_micro_batch_size: int):
        self.memberships, self.replica_groups = memberships, replica_groups
        self.group_micro = group_micro_batch_size
        super().__init__(cfg, overwrite=True)

    def setup_mesh(self, dims) -> None:
        super().setup_mesh(dims)
        self.micro_batch_size = self.group_micro  # the global batch in the groups' micro-batches, in order

    def train_step(self) -> dict:
        t = self.cfg.train
        start = time.perf_counter()
        micro_batches = self.loader.next_batch()
        live = self.memberships[self.step + 1]
        per_group = len(micro_batches) // self.replica_groups
        mine = [mb for g in live for mb in micro_batches[g * per_group: (g + 1) * per_group]]
        lr = lr_at(self.step, t)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = t.global_batch_size * t.seq_len
        loss = float(self.forward_backward(mine, num_tokens=self.loader.loss_divisor))
        scale = self.replica_groups / len(live)
        for q in self.base_model.parameters():
            if q.grad is not None:
                q.grad.mul_(scale)
        grad_norm = clip_grad_norm(self.parallel.clip_params(self.base_model), t.grad_clip,
                                   norm_fn=self.parallel.grad_norm_fn)
        self.optimizer.step()
        self.step += 1
        return self.metrics_row(loss * scale, lr=lr, grad_norm=float(grad_norm), start=start, data_wait=0.0,
                                num_tokens=num_tokens * len(live) // self.replica_groups,
                                comm_stats=self.mesh.stats.summary())
