"""The training loop: data -> micro-steps -> clip -> optimizer step -> metrics, validation, checkpoints.

Responsible for: putting a run together from a `Config` (mesh, data, loader, model, optimizer); the
optimizer step as gradient accumulation over micro-batches with the loss normalised to the exact global
token mean; the LR schedule, clipping, periodic validation, when to checkpoint (and bit-identical
resume), and a text sample at the end. Its parts live beside it: `setup.py` (device, precision, the
parallel model), `resume.py` (the run directory, what a checkpoint carries beside the weights),
`report.py` (a step's metrics row), `sample.py` (the whole model generation runs on).
Not responsible for: how a parallel strategy works. The trainer builds the `Mesh` from
`cfg.parallel` and the world (the default process group, if one was started), and
`meshlm.parallel.parallelize` hands it back the module to run, the `no_sync()` context for
accumulation and the global gradient-norm function -- one code path for one process and for many.
Each rank loads only its data-parallel slice of every global batch; rank 0 logs and publishes
checkpoints; reported losses are global (reduced over the "dp" axis).

Under tensor parallelism (parallel.tp > 1) the model returns this rank's vocab slice of the logits:
the losses go through `vocab_parallel_cross_entropy` (the same value on every tp rank, so reported
losses are still reduced over "dp" only), clipping uses the TP-aware norm, checkpoints hold the full
unsharded tensors (see `meshlm.checkpoint`), and the end-of-training sample runs on a full copy
of the model gathered over tp (generation with the KV cache does not run on the TP-sharded model).

Under pipeline parallelism (parallel.pp > 1) the model is this rank's stage: `pipeline_step` hands the
step's micro-batches to the executor of `meshlm.parallel.pipeline` (every backward under no_sync, then
one data-parallel reduction), the loss comes from the last stage (the same on every rank), clipping sums
the norm over the stages, each rank saves only its stage's tensors (DCP merges them), validation runs
forward-only through the stages and the sample on a full copy gathered from them.

Under context parallelism (parallel.cp > 1) every rank runs its two chunks of every sequence
(`meshlm.parallel.context`): `local_batch` cuts inputs and targets and passes the tokens' true positions;
losses and validation sums are reduced over "dp_cp" (data-parallel and cp ranks), and gradients too.

Under document masking (data.document_mask) every micro-batch carries its document ids (`meshlm.models.documents`),
whole sequences on every rank; the model masks attention by document and restarts RoPE's positions at each one.

Loss normalisation: every micro-batch contributes `sum of token losses / targets of the global batch that count`
(all of packed text; of conversations the assistant's: the loader's `loss_targets`, counted on every rank), so the
gradients *summed* over micro-batches and data-parallel ranks are those of the global batch's mean, however unevenly
the counted targets fall. A data-parallel gradient reduction must therefore be a sum, not a mean.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshlm import comm
from meshlm.checkpoint import load_checkpoint, resume_checkpoint, saved_layout
from meshlm.config import Config
from meshlm.host_memory import reuse_freed_host_memory
from meshlm.liveness import Heartbeat, store_client
from meshlm.mesh import Mesh, build_mesh
from meshlm.models.stats import train_flops_per_token
from meshlm.parallel.expert import update_router_biases
from meshlm.parallel.parallelize import check_layout, micro_batch_size
from meshlm.parallel.pipeline import run_pipeline_step
from meshlm.parallel.recompute import SavedTensorMeter
from meshlm.parallel.tensor import vocab_parallel_cross_entropy
from meshlm.schedules import build_schedule
from meshlm.stragglers import ArrivalRecord, StragglerWatch
from meshlm.timeline import write_timeline
from meshlm.data.text import IGNORE_INDEX, validation_batches
from meshlm.train.memory import memory_checkpoints, storage_step
from meshlm.train.metrics import MetricsLogger, peak_tflops_guess
from meshlm.train.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from meshlm.train.report import count_parameters, expert_load, pipeline_idle_share, step_row
from meshlm.train.resume import (
    CheckpointWriter,
    check_run_dir_on_every_rank,
    clear_run_dir,
    last_logged_step,
    layout_change_note,
    make_run_dir,
    rank_extra,
    restore_rank_extra,
    use_config_optimizer_settings,
)
from meshlm.train.sample import prompt_ids, whole_model
from meshlm.train.setup import (
    build_data,
    build_parallel_model,
    checkpoint_files,
    load_training_tokenizer,
    param_dtype,
    resolve_device,
    resolve_precision,
    seed_everything,
    set_steps_from_epochs,
)


TIMELINE_STEPS = 3  # pipeline runs record the per-action timeline of their first steps (<run_dir>/timeline/)


class Trainer:
    """`Trainer(cfg).train()`; `resume=True` continues from `<run_dir>/checkpoints/latest` (or, when that
    pointer is damaged, the newest complete checkpoint) and refuses when there is none; a fresh run into a
    run_dir that holds checkpoints refuses unless `overwrite=True` (which deletes them).

    Runs as one process, or as one rank of many when the default process group is started (e.g.
    `meshlm.distributed.init_distributed` under torchrun): the layout comes from `cfg.parallel`
    resolved against that world, and is checked (`check_layout`) before any data or model is built.
    """

    def __init__(self, cfg: Config, *, resume: bool = False, overwrite: bool = False, restarts: int = 0):
        self.cfg = cfg.validate()
        t = cfg.train
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        dims = check_layout(cfg, world_size)  # user mistakes surface here, before any work
        # After a restart, the newest in-memory checkpoint that survived, when one is as new as storage's.
        self.memory = memory_checkpoints(cfg, world_size)
        from_memory = self.memory.newest(at_least=storage_step(t.run_dir) if resume else 0) \
            if self.memory is not None and restarts else None
        if from_memory is None:  # storage is neither read nor changed when resuming from memory
            check_run_dir_on_every_rank(t.run_dir, resume=resume, overwrite=overwrite, world_size=world_size)
        self.setup_mesh(dims)

        self.tokenizer = load_training_tokenizer(cfg)
        self.train_data, self.val_data, self.loader = build_data(
            cfg, self.tokenizer, micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size)
        set_steps_from_epochs(t, len(self.train_data))  # train.epochs, when given, decides train.steps

        self.setup_model()
        self.optimizer = build_optimizer(self.base_model, t, zero=self.parallel.zero)

        self.run_dir = Path(t.run_dir)
        self.step = 0
        self.first_val_loss: float | None = None
        # What autograd keeps for backward during one micro-batch (this rank's activation memory,
        # parallel.recompute shows here): measured once, on the first micro-step, by a saved-tensor hook.
        self.activation_mib: float | None = None
        self.flops_per_token = train_flops_per_token(cfg.model, t.seq_len)
        self.peak_tflops, self.peak_note = ((t.peak_tflops, "train.peak_tflops") if t.peak_tflops > 0
                                            else peak_tflops_guess(self.device))
        self.saved_step: int | None = None  # the step of the checkpoint on disk that matches this state
        self.resumed_from: Path | None = None
        self.resume_note: str | None = None
        self.fallback_note: str | None = None  # --resume took another checkpoint than `latest` names: why
        self.optimizer_note: str | None = None  # the config's betas / eps replaced the checkpoint's
        self.checkpoints = CheckpointWriter(
            self.run_dir, config=self.cfg, rank=self.rank, world_size=self.world_size, mesh=self.mesh,
            barrier=self.barrier,
            files=checkpoint_files(self.tokenizer))
        if self.is_main:
            make_run_dir(t.run_dir)
        # After the launcher restarted the ranks (--max-restarts): how far the run had got, to log what it lost.
        last_logged = last_logged_step(self.run_dir) if restarts and self.is_main else 0
        if from_memory is not None:
            self.load_memory(from_memory)
        elif resume:  # never deletes anything; check_run_dir made sure there is a complete checkpoint
            self.resumed_from, self.fallback_note = resume_checkpoint(self.run_dir)
            self.load(self.resumed_from, checksums=False)  # check_run_dir verified it
        elif self.is_main:
            clear_run_dir(self.run_dir)
        if self.memory is not None and not restarts:
            self.memory.files.remove()  # an earlier job's in-memory checkpoints: never this job's to resume from
        self.barrier()  # no rank goes on while rank 0 may still be clearing the run_dir
        self.restart_row = ({"step": self.step, "restart": restarts, "lost_steps": max(0, last_logged - self.step),
                             "from": "memory" if from_memory is not None else "storage"} if restarts else None)

    def setup_mesh(self, dims) -> None:
        """Device, precision, mesh, this rank's place in it and the micro-batch size; seeds the RNGs.
        (Shared with `meshlm.evaluate.Evaluator`, which runs a trained model under a layout.)"""
        t = self.cfg.train
        self.device = resolve_device(t.device)
        if self.device.type == "cuda" and self.device.index is None:
            # under a launcher, init_distributed made cuda:LOCAL_RANK current
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.autocast_dtype = resolve_precision(t.precision, self.device)
        if t.reuse_host_memory and self.device.type == "cpu":
            reuse_freed_host_memory()
        p = self.cfg.parallel
        blocking = self.device.type == "cuda" and p.collective_wait == "blocking"
        self.mesh: Mesh = build_mesh(dims, device_type=self.device.type,
                                     wait_timeout_s=p.collective_timeout_s if blocking else None)
        self.rank, self.world_size = self.mesh.rank, self.mesh.world_size
        self.dp_rank, self.dp_size = self.mesh.local_rank("dp"), self.mesh.size("dp")
        self.micro_batch_size = micro_batch_size(self.cfg, self.dp_size)
        seed_everything(t.seed)

    def setup_model(self, *, weights=None) -> None:
        """Build the model and apply the layout (`setup.build_parallel_model`: each rank initialises only what
        it holds). `weights(model)`, when given, fills the full model before it is split over the ranks.
        (Shared with `meshlm.evaluate.Evaluator` too.)"""
        self.dtype = param_dtype(self.cfg.train.precision)
        self.base_model, self.parallel = build_parallel_model(self.cfg, self.mesh, device=self.device,
                                                              dtype=self.dtype, weights=weights)
        self.model = self.parallel.module  # what the step runs; base_model stays the plain Transformer
        self.mesh = self.parallel.mesh  # expert parallelism adds its "ep" and "ep_dp" groups
        self.moe = self.cfg.model.is_moe
        self.context = self.parallel.context  # cp > 1: each rank runs its chunks of every sequence

    # -- the loop ----------------------------------------------------------------------------
    def train(self, *, until_step: int | None = None) -> dict:
        """Train to `train.steps` (or stop early at `until_step`, e.g. to test resuming) and save.

        Returns a summary: steps, final loss, first/final validation loss, mean tokens/s.
        """
        t = self.cfg.train
        stop = t.steps if until_step is None else min(until_step, t.steps)
        logger = MetricsLogger(self.run_dir, total_steps=t.steps, enabled=self.is_main,
                               progress=t.progress, start_step=self.step, tensorboard=t.tensorboard,
                               wandb_config=self.cfg.to_dict() if t.wandb else None)
        self.announce(logger)
        has_val = t.val_batches > 0 and len(self.val_data) > 0
        last = {"loss": float("nan")}
        final_val = None
        times = []
        heartbeat = self.start_heartbeat()
        self.start_arrivals()
        try:
            if has_val and self.first_val_loss is None:
                self.first_val_loss = final_val = self.evaluate()
                logger.log({"step": self.step, "val_loss": final_val})
            while self.step < stop:
                if self.arrivals is not None:
                    self.arrivals.step = self.step + 1  # its first collective notes this rank's arrival
                last = self.train_step()
                self.note_arrivals(last, logger)
                if heartbeat is not None:
                    heartbeat.progress()
                times.append(last["step_time_s"])
                if self.step % t.log_interval == 0 or self.step == stop:
                    logger.log(last)
                if has_val and (self.step % t.val_interval == 0 or self.step == stop):
                    final_val = self.evaluate()
                    logger.log({"step": self.step, "val_loss": final_val})
                if t.checkpoint_interval and self.step % t.checkpoint_interval == 0 and self.step != stop:
                    self.save(asynchronous=t.async_checkpoint)
                if self.memory is not None and self.step % t.memory_checkpoint_interval == 0 and self.step != stop:
                    self.memory.save(self.step, model=self.base_model, optimizer=self.optimizer, mesh=self.mesh,
                                     extra=rank_extra(self.loader, self.base_model, first_val_loss=self.first_val_loss))
            if self.saved_step != self.step:
                self.save()
            self.finish_checkpoint()
            if self.memory is not None and self.step == t.steps:  # the run is done: its in-memory copies go
                self.barrier()
                self.memory.files.remove()
        except comm.CollectiveError as e:
            if heartbeat is None:
                raise
            never = self.arrivals.explain() if self.arrivals is not None else ""
            raise comm.CollectiveError(f"{e}; {never + '; ' if never else ''}{heartbeat.explain()}") from e
        finally:
            logger.close()
            if heartbeat is not None:
                heartbeat.close()
        num_tokens = t.global_batch_size * t.seq_len
        return {"steps": self.step, "loss": last["loss"], "val_loss": final_val,
                "first_val_loss": self.first_val_loss,
                "tokens_per_s": num_tokens * len(times) / sum(times) if times else 0.0}

    def announce(self, logger: MetricsLogger) -> None:
        """The run's opening lines (rank 0): ranks, parameters, data, device; where a resume or restart took
        it up, and why it differs from the checkpoint (collective under pp: the parameters are counted)."""
        t = self.cfg.train
        if self.world_size > 1:
            logger.print(f"meshlm: {self.world_size} ranks, {self.mesh}")
        num_params = count_parameters(self.base_model, self.mesh, pipeline=self.parallel.pipeline is not None,
                                      device=self.device)
        # Two lines that fit 80 columns (a terminal would wrap one long line mid-phrase).
        precision = str(self.autocast_dtype or self.dtype).removeprefix("torch.")
        epochs = f" ({t.epochs:g} epoch{'' if t.epochs == 1 else 's'}: {t.steps:,} steps)" if t.epochs else ""
        logger.print(f"meshlm: {num_params:,} parameters, {len(self.train_data):,} training samples of "
                     f"{t.seq_len} tokens{epochs}\ndevice {self.device}, precision {precision}; MFU: {self.peak_note}")
        if self.resumed_from is not None:
            logger.print(f"resumed from {self.resumed_from} at step {self.step}")
        if self.restart_row is not None:
            logger.log(self.restart_row)
            logger.print(f"restart {self.restart_row['restart']}: a rank failed; continuing from step {self.step} "
                         f"({self.restart_row['lost_steps']} step(s) lost since the last checkpoint, from "
                         f"{self.restart_row['from']})")
        for note in (self.fallback_note, self.optimizer_note):
            if note is not None:
                logger.print(note)
        if self.resume_note is not None:
            logger.print(self.resume_note)

    def start_heartbeat(self) -> Heartbeat | None:
        """With several ranks: this rank's heartbeat (a failed collective's error then names the ranks that
        stopped answering); on CUDA also the step watchdog that turns NCCL's silent wait into that error."""
        if self.world_size == 1:
            return None
        timeout = self.cfg.parallel.collective_timeout_s
        stats = self.mesh.stats

        def describe() -> str:
            return f" (last collective issued: {stats.last[0]} on mesh axis {stats.last[1]!r})" if stats.last else ""

        # a step is many collectives: the watchdog allows one full timeout past the collectives' own
        try:
            return Heartbeat(self.rank, self.world_size, describe=describe,
                             watchdog_s=2 * timeout if self.device.type == "cuda" else None)
        except (KeyError, RuntimeError, ValueError):  # no reachable store: train on, errors name fewer ranks
            return None

    def start_arrivals(self) -> None:
        """With several ranks: this rank's arrival at each step's first collective, noted in the launch's store,
        and on rank 0 the watch that reads them (`meshlm.stragglers`); None where there is no store."""
        self.arrivals, self.straggler_watch = None, None
        if self.world_size == 1:
            return
        try:
            store = store_client()
        except (KeyError, RuntimeError, ValueError):  # no reachable store: train on without
            return
        self.arrivals = ArrivalRecord(store, rank=self.rank, world_size=self.world_size,
                                      stage=self.mesh.local_rank("pp"))
        self.mesh.stats.on_first = self.arrivals.arrive
        if self.is_main:
            p = self.cfg.parallel
            self.straggler_watch = StragglerWatch(factor=p.straggler_factor, patience=p.straggler_steps)

    def note_arrivals(self, row: dict, logger: MetricsLogger) -> None:
        """After a step: rank 0 adds its arrival spread and slowest rank to the step's row, and names a rank
        that has been holding the others up (a warning line)."""
        if self.arrivals is None:
            return
        self.arrivals.step = None  # collectives between steps (validation, checkpoints) are no arrivals
        records = self.arrivals.read(self.step) if self.straggler_watch is not None else None
        if records is not None:
            fields, warning = self.straggler_watch.observe(self.step, records)
            row.update(fields)
            if warning is not None:
                logger.print(warning)

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step over the next global batch; returns its metrics row."""
        t = self.cfg.train
        start = time.perf_counter()
        self.mesh.stats.reset()
        micro_batches = self.loader.next_batch()
        data_wait = time.perf_counter() - start  # reading (or, prefetched, waiting for) this step's data
        lr = lr_at(self.step, t)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = t.global_batch_size * t.seq_len  # every token is run; the loss counts `loss_targets`
        loss = self.forward_backward(micro_batches, num_tokens=self.loader.loss_divisor)
        grad_norm = clip_grad_norm(self.parallel.clip_params(self.base_model), t.grad_clip,
                                   norm_fn=self.parallel.grad_norm_fn)
        if self.loader.loss_targets:  # a batch of which no target counts (conversations) moves no weight
            self.optimizer.step()
        if self.moe and self.loader.loss_targets:  # aux-loss-free balancing (router_bias_update_rate): its load
            update_router_biases(self.base_model, self.mesh, axis=self.moe_token_axes)
        self.step += 1
        # What the step itself moved (gradient reduction, ...), before the metric reductions below (only for logs)
        comm_stats = self.mesh.stats.summary()
        # Each rank holds the sum over its slice of (token losses / global tokens): the sum over ranks is the mean.
        return self.metrics_row(float(self.sum_over_dp(loss)), lr=lr, grad_norm=float(grad_norm),
                                num_tokens=num_tokens, start=start, data_wait=data_wait, comm_stats=comm_stats)

    def forward_backward(self, micro_batches, *, num_tokens: int) -> torch.Tensor:
        """Forward + backward of this rank's micro-batches of a step (accumulated, reduced over data parallelism
        once); returns this rank's share of the mean loss over `num_tokens`."""
        loss = torch.zeros((), dtype=self.dtype, device=self.device)
        if self.parallel.pipeline is not None:
            loss += self.pipeline_step(micro_batches, num_tokens=num_tokens)
            micro_batches = []  # the pipeline ran them all
        for i, batch in enumerate(micro_batches):  # (inputs, targets[, documents])
            final = i == len(micro_batches) - 1
            with contextlib.nullcontext() if final else self.parallel.no_sync():
                loss += self.micro_step(*batch, num_tokens=num_tokens,
                                        num_micro_batches=len(micro_batches) * self.dp_size)
        return loss

    def metrics_row(self, loss: float, *, lr: float, grad_norm: float, num_tokens: int, start: float,
                    data_wait: float, comm_stats) -> dict:
        """The metrics row of the step just taken (`loss`: the global mean, already reduced; `loss_tokens`: how many
        targets it counted, where fewer than the batch's -- conversations)."""
        row = step_row(step=self.step, loss=loss, lr=lr, grad_norm=grad_norm, num_tokens=num_tokens,
                       step_time=time.perf_counter() - start, flops_per_token=self.flops_per_token,
                       peak_tflops=self.peak_tflops, world_size=self.world_size, device=self.device,
                       activation_mib=self.activation_mib, comm_stats=comm_stats, data_wait=data_wait)
        if self.moe:
            load = expert_load(self.base_model, self.mesh, axis=self.moe_token_axes)
            if load is not None:
                row["expert_load"] = load
        if self.parallel.pipeline is not None:
            row["pp_bubble"] = pipeline_idle_share(self.pipeline_result)
        if self.loader.loss_targets != self.cfg.train.global_batch_size * self.cfg.train.seq_len:
            row["loss_tokens"] = self.loader.loss_targets
        return row

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None, *,
                   num_tokens: int, num_micro_batches: int) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns its (detached) share of the global mean loss.

        `num_tokens` is the token count of the whole global batch (all micro-batches, all ranks);
        `num_micro_batches` likewise, for the MoE auxiliary loss, which is a mean over micro-batches.
        """
        inputs, targets, positions, documents = self.local_batch(inputs, targets, documents)
        meter = SavedTensorMeter(self.base_model) if self.activation_mib is None else contextlib.nullcontext()
        with meter:
            with self.autocast():
                logits = self.model(inputs, positions=positions, documents=documents)
            loss = self.loss_sum(logits, targets) / num_tokens
            aux = self.base_model.aux_loss()
            total = loss + aux / num_micro_batches if torch.is_tensor(aux) else loss
        if self.activation_mib is None:
            self.activation_mib = meter.bytes / 2**20
        total.backward()
        return loss.detach()

    def pipeline_step(self, micro_batches, *, num_tokens: int) -> torch.Tensor:
        """Forward + backward of every micro-batch of the step through the pipeline schedule (pp > 1);
        returns this data-parallel rank's share of the global mean loss (the same on every stage).

        All backward passes run inside no_sync (a stage runs many partial backwards per micro-batch);
        the gradients are then reduced over data parallelism once."""
        p = self.cfg.parallel
        schedule = build_schedule(p.pp_schedule, pp=p.pp, num_microbatches=len(micro_batches), pp_chunks=p.pp_chunks)
        batches = [self.local_batch(*mb) for mb in micro_batches]
        positions = batches[0][2]
        batches = [(x, y, documents) for x, y, _, documents in batches]
        with self.parallel.no_sync(), self.autocast():
            # The MoE load-balancing loss, a mean over the global batch's micro-batches (as `micro_step`).
            aux_scale = self.cfg.model.router_aux_loss_coef / (len(batches) * self.dp_size) if self.moe else 0.0
            result = run_pipeline_step(self.parallel.pipeline, schedule, batches, mesh=self.mesh,
                                       num_tokens=num_tokens, activation_dtype=self.dtype, loss_fn=self.loss_sum,
                                       sequence_shards=self.sequence_shards, positions=positions,
                                       aux_scale=aux_scale)
        self.parallel.reduce_grads()
        self.pipeline_result = result  # this rank's actions of the last step (timeline), its peak activations
        if self.step < TIMELINE_STEPS:  # the first steps' timelines, for `meshlm plan schedule --from-run`
            write_timeline(self.run_dir, rank=self.rank, step=self.step + 1, schedule=schedule,
                           pp_rank=self.mesh.local_rank("pp"), result=result)
        return result.loss.to(self.dtype)

    # -- validation --------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Mean token loss over a fixed validation set (the same every time, and under every layout).

        The set is the first `train.val_batches` x `train.global_batch_size` validation samples, so
        it depends neither on the micro-batch size nor on the number of ranks that split it -- at most the
        global batches that cover the split once (more would only repeat its samples, and were built as one list).
        """
        t = self.cfg.train
        once = max(1, -(-len(self.val_data) // t.global_batch_size))
        loss_sum, count = self.loss_totals(self.val_data, num_global_batches=min(t.val_batches, once))
        return loss_sum / count if count else float("nan")

    @torch.no_grad()
    def loss_totals(self, dataset, *, num_global_batches: int) -> tuple[float, int]:
        """(sum of token losses, tokens) over the first `num_global_batches` x `train.global_batch_size`
        samples of `dataset` (wrapping around a smaller one), summed over the ranks (collective)."""
        t = self.cfg.train
        micro_per_global = t.global_batch_size // self.micro_batch_size  # a multiple of dp (check_layout)
        batches = validation_batches(dataset, num_batches=num_global_batches * micro_per_global,
                                     micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank,
                                     dp_size=self.dp_size, documents=self.cfg.data.document_mask)
        self.model.eval()
        # [sum of token losses, tokens] summed over ranks: right when ranks hold different numbers of batches (or none)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.parallel.pipeline is not None and batches:
            # Forward only through the stages; the stages of one pipeline hold the same batches.
            batches = [self.local_batch(*mb) for mb in batches]
            positions = batches[0][2]
            batches = [(x, y, documents) for x, y, _, documents in batches]
            with self.autocast():
                result = run_pipeline_step(self.parallel.pipeline, None, batches, mesh=self.mesh, num_tokens=1,
                                           activation_dtype=self.dtype, forward_only=True, loss_fn=self.loss_sum,
                                           sequence_shards=self.sequence_shards, positions=positions)
            totals[0] += result.loss
            totals[1] += sum(int((batch[1] != IGNORE_INDEX).sum()) for batch in batches)
            batches = []
        for batch in batches:
            inputs, targets, positions, documents = self.local_batch(*batch)
            with self.autocast():
                logits = self.model(inputs, positions=positions, documents=documents)
            totals[0] += self.loss_sum(logits, targets)
            totals[1] += int((targets != IGNORE_INDEX).sum())
        self.model.train()
        loss_sum, count = self.sum_over_dp(totals).tolist()
        return loss_sum, int(count)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, *, asynchronous: bool = False) -> Path:
        """Checkpoint the current step. `asynchronous`: the state is staged and written in the background
        (train.async_checkpoint); it is published by the next save or `finish_checkpoint`. A save first
        publishes the one still pending, so at most one is in flight."""
        self.finish_checkpoint()
        extra = rank_extra(self.loader, self.base_model, first_val_loss=self.first_val_loss)
        path = self.checkpoints.save(step=self.step, model=self.base_model, optimizer=self.optimizer,
                                     rank_extra=extra, asynchronous=asynchronous)
        self.saved_step = self.step
        return path

    def finish_checkpoint(self) -> None:
        """Wait for the checkpoint being written in the background (if any) and publish it (collective)."""
        self.checkpoints.finish()

    def load(self, path: str | Path, *, checksums: bool = True) -> None:
        """Restore model, optimizer, step, this rank's RNG and the data position from a checkpoint.

        Under the layout it was saved with (the same parallel degrees), every rank takes its own
        extras and the continuation is bit-identical. Under another layout (e.g. saved by 2 ranks,
        resumed by 1 or 4; or tp=2 resumed as dp=2) every rank takes rank 0's: the loader position
        is global (global batches consumed, not per-rank samples) and data-parallel ranks draw
        identical RNG streams, so the run continues on the same batches -- equal within fp32
        rounding, not bit-identical (sums over ranks reorder).
        """
        path = Path(path)
        saved = saved_layout(path, checksums=checksums)  # verifies the checkpoint (checksums: unless done)
        same_layout = saved == self.mesh.dims
        state = load_checkpoint(path, model=self.base_model, optimizer=self.optimizer, config=self.cfg,
                                rank=self.rank if same_layout else 0, mesh=self.mesh, checksums=False)
        self.step = self.saved_step = state["step"]
        self.first_val_loss = restore_rank_extra(state["rank_extra"], self.loader, self.base_model)
        note = use_config_optimizer_settings(self.optimizer, self.cfg.train)
        if note is not None:
            self.optimizer_note = note
        if not same_layout:
            self.resume_note = layout_change_note(saved, self.mesh.dims, self.world_size)

    def load_memory(self, step: int) -> None:
        """Restore model, optimizer, step, RNG and data position from the in-memory checkpoint of `step`
        (`train/memory.py`; same layout, so the continuation is bit-identical)."""
        extra = self.memory.restore(step, model=self.base_model, optimizer=self.optimizer, mesh=self.mesh)
        self.step = step
        self.first_val_loss = restore_rank_extra(extra, self.loader, self.base_model)

    # -- sampling ----------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompt: str, max_new_tokens: int, *, temperature: float = 0.8, top_p: float = 0.95,
               seed: int | None = None, chat: bool = False) -> str:
        """The text the model continues `prompt` (`chat`: a chat template's text, encoded as served) with.

        Sampled by default (seeded by train.seed, so reproducible): a small byte-level model decoded
        greedily falls into repeating its most frequent word. `temperature=0` is greedy.
        """
        from meshlm.models.generation import generate

        ids, room = prompt_ids(self.tokenizer, prompt, max_seq_len=self.cfg.model.max_seq_len, chat=chat)
        model = whole_model(self.cfg, self.base_model, self.parallel, self.mesh, device=self.device, dtype=self.dtype)
        with self.autocast():
            out = generate(model, ids, max_new_tokens=min(max_new_tokens, room), temperature=temperature,
                           top_p=top_p, seed=self.cfg.train.seed if seed is None else seed)
        return self.tokenizer.decode(out)

    # -- what the parts share: the ranks, the tokens, the precision, the loss ----------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (checkpoint publication); nothing to wait for on one process."""
        if self.world_size > 1:
            dist.barrier()

    @property
    def token_axis(self) -> str:
        """The ranks that hold different tokens of the batch: the data-parallel ones, and under context
        parallelism their cp ranks."""
        return "dp_cp" if self.context is not None else "dp"

    @property
    def moe_token_axes(self) -> tuple[str, ...]:
        """The ranks whose MoE layers route different tokens: `token_axis`, and under sequence
        parallelism the tp ranks (each routes its chunk of the sequence)."""
        sp = self.parallel.tensor_parallel and self.cfg.parallel.sequence_parallel
        return (self.token_axis, "tp") if sp else (self.token_axis,)

    def sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a reported tensor over `token_axis` (the input itself on one rank)."""
        return comm.all_reduce(value.clone(), self.mesh, self.token_axis)

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None):
        """(inputs, targets, positions, documents) of a micro-batch as this rank runs it, on the device: under
        context parallelism its two chunks of every sequence and their true positions (RoPE); else the
        whole sequences and positions None (0..seq-1). `documents` (data.document_mask): the whole sequences'
        document ids, never split (the model reads the positions' part of them); else None."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        documents = documents.to(self.device) if documents is not None else None
        if self.context is None:
            return inputs, targets, None, documents
        positions = self.context.positions(inputs.shape[1], device=self.device)
        return self.context.shard(inputs), self.context.shard(targets), positions, documents

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of the token losses of one micro-batch (under tp, from this rank's vocab slice; collective)."""
        if self.parallel.tensor_parallel:
            return vocab_parallel_cross_entropy(logits, targets, self.mesh, reduction="sum")
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32; fp64 stays
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    @property
    def sequence_shards(self) -> int:
        """How many pieces the sequence of the hidden states between blocks is cut into (SP: tp)."""
        sp = self.parallel.tensor_parallel and self.cfg.parallel.sequence_parallel
        return self.mesh.size("tp") if sp else 1
