"""meshlm pipeline parallelism against torch.distributed.pipelining, same model and micro-batches, one run.

    python benchmarks/pp.py                                  # pp=2 and pp=4 gloo ranks on CPU
    python benchmarks/pp.py --world-sizes 2 --microbatches 8 --hidden 256 --layers 8
    python benchmarks/pp.py --smoke                          # pp=2, every schedule, one step (CI)

--smoke: pp=2 with a 4-layer model of hidden 32 (2 chunks per rank for the interleaved schedules), 4
micro-batches, one timed step, no warmup; with --device cuda on a host without the GPUs, a JSON saying so.

For every pp in --world-sizes and every schedule, each rank builds the same model twice, split the same
way (meshlm's `split_model`; torch's `PipelineStage` gets a module per chunk holding the same blocks),
and times training steps (forward + backward of all micro-batches, gradients zeroed after), alternating
between the two so that load from other processes hits both alike. Schedules, ours vs torch's:
  gpipe        ScheduleGPipe
  1f1b         Schedule1F1B
  interleaved  ScheduleInterleaved1F1B (2 chunks per rank for both)
  zero_bubble  ScheduleInterleavedZeroBubble -- torch's zero-bubble needs >= 2 chunks per rank, ours
               (ZB-H1) runs 1: the row is the nearest pair there is, not the same schedule.
Prints one JSON object: per (pp, schedule) the median and minimum step time of each, their ratio,
both losses of the first step (they must agree), and our measured bubble fraction (idle time of the
busiest rank over its busy time, from the executor's per-action timeline of the last step) next to the
simulator's prediction for that step (`timeline.simulate_measured`: every action its measured time, the
measured comm latency and host gap between actions, both also printed) and for equal action times.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from torch import nn

from meshlm.mesh import ParallelDims, build_mesh
from meshlm.models.transformer import build_model
from meshlm.parallel.pipeline import run_pipeline_step, split_model, token_loss_sum
from meshlm.schedules import build_schedule, simulate
from meshlm.timeline import measured_overheads, measured_timeline, simulate_measured

from _common import (SMOKE_MODEL, parse_args_smoke, print_smoke_skip, smoke_cuda_missing, add_common_args, batch, device_of, model_config, parse_world_sizes, run_ranks,  # noqa: E402
                     time_alternating)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


class _Chunk(nn.Module):
    """One chunk of a meshlm stage as a module of its own, for torch's PipelineStage."""

    def __init__(self, stage, chunk: int):
        super().__init__()
        m = stage.model
        self.first, self.last = stage.is_first(chunk), stage.is_last(chunk)
        self.embed = m.embed if self.first else None
        self.blocks = nn.ModuleList([m.layers[n] for n in stage.chunk_layers[chunk]])
        self.norm = m.norm if self.last else None
        self.lm_head = m.lm_head if self.last else None
        self.inv_freq = m.inv_freq

    def forward(self, x):
        from meshlm.models.transformer import rope_cos_sin

        h = self.embed(x) if self.first else x
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(h.shape[1], device=h.device), h.dtype)
        for block in self.blocks:
            h = block(h, cos, sin)
        return self.lm_head(self.norm(h)) if self.last else h


def _torch_schedule(name: str, stage, pp: int, m: int, device, loss_fn):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)

    stages = [PipelineStage(_Chunk(stage, c), stage.stage(c), stage.num_stages, device)
              for c in range(stage.pp_chunks)]
    if name == "gpipe":
        return ScheduleGPipe(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    if name == "1f1b":
        return Schedule1F1B(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleInterleaved1F1B if name == "interleaved" else ScheduleInterleavedZeroBubble
    return cls(stages, m, loss_fn=loss_fn, scale_grads=False)


def _bench(rank: int, world_size: int, args) -> dict:
    device = device_of(args, rank)
    mesh = build_mesh(ParallelDims(pp=world_size), device_type=device.type)
    pp, m, micro = world_size, args.microbatches, args.batch
    cfg = model_config(args)
    num_tokens = m * micro * args.seq_len
    out = {}
    for name in SCHEDULES:
        ours_v = 2 if name == "interleaved" else 1
        torch_v = 2 if name in ("interleaved", "zero_bubble") else 1
        if cfg.num_layers < pp * max(ours_v, torch_v):
            continue
        ours = split_model(build_model(cfg, seed=0, device=device), pp_rank=rank, pp=pp, pp_chunks=ours_v)
        sched = build_schedule(name, pp=pp, num_microbatches=m, pp_chunks=ours_v)
        peer_stage = split_model(build_model(cfg, seed=0, device=device), pp_rank=rank, pp=pp, pp_chunks=torch_v)
        loss_fn = lambda logits, targets: token_loss_sum(logits, targets) / num_tokens  # noqa: E731
        peer = _torch_schedule(name, peer_stage, pp, m, device, loss_fn)
        timelines = []

        def ours_step(i):
            inputs, targets = batch(args, i, m * micro, device)
            mbs = list(zip(inputs.split(micro), targets.split(micro)))
            res = run_pipeline_step(ours, sched, mbs, mesh=mesh, num_tokens=num_tokens)
            timelines.append((res.timeline, res.t0_wall))
            ours.model.zero_grad(set_to_none=True)
            return res.loss.detach()

        def peer_step(i):
            inputs, targets = batch(args, i, m * micro, device)
            losses = []
            first, last = peer_stage.is_first(0), any(peer_stage.is_last(c) for c in range(torch_v))
            kwargs = {"target": targets, "losses": losses} if last else {}
            peer.step(inputs, **kwargs) if first else peer.step(**kwargs)
            peer_stage.model.zero_grad(set_to_none=True)
            loss = torch.stack(losses).sum().detach().double() if losses else torch.zeros((), dtype=torch.float64)
            dist.all_reduce(loss, group=mesh.group("pp"))
            return loss

        seconds, losses = time_alternating({"meshlm": ours_step, "torch": peer_step}, warmup=args.warmup,
                                           timed=args.steps, device=device)
        # the busiest rank's idle time, from every rank's timeline of the last step (clocks aligned by
        # the ranks' wall-clock step starts), next to the simulator fed with that step's own action
        # times, its measured comm latency and its host gap between actions
        every = [None] * world_size
        dist.all_gather_object(every, timelines[-1])
        measured = measured_timeline(sched, [tl for tl, _ in every], [t0 for _, t0 in every])
        t_comm, t_gap = measured_overheads(measured)
        predicted = simulate_measured(measured, t_comm=t_comm, t_gap=t_gap)
        a, b = statistics.median(seconds["meshlm"]), statistics.median(seconds["torch"])
        out[f"pp{pp}_{name}"] = {
            "meshlm_step_ms_median": round(a * 1e3, 2), "torch_step_ms_median": round(b * 1e3, 2),
            "meshlm_step_ms_min": round(min(seconds["meshlm"]) * 1e3, 2),
            "torch_step_ms_min": round(min(seconds["torch"]) * 1e3, 2),
            "step_time_ratio": round(a / b, 3),
            "loss_step1": [losses["meshlm"][0].item(), losses["torch"][0].item()],
            "meshlm_measured_bubble_fraction": round(measured.bubble_fraction, 3),
            "simulated_bubble_fraction": round(predicted.bubble_fraction, 3),
            "simulated_bubble_fraction_equal_times": round(simulate(sched).bubble_fraction, 3),
            "measured_idle_ms_per_rank": [round(x * 1e3, 1) for x in measured.idle],
            "simulated_idle_ms_per_rank": [round(x * 1e3, 1) for x in predicted.idle],
            "comm_latency_ms": round(t_comm * 1e3, 3), "gap_between_actions_ms": round(t_gap * 1e3, 3),
            "chunks_per_rank": {"meshlm": ours_v, "torch": torch_v}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, world_sizes="2,4")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default %(default)s)")
    ap.set_defaults(layers=8, hidden=128, vocab=1024, seq_len=64, batch=2, steps=6)
    args = parse_args_smoke(ap, SMOKE_MODEL | {"layers": 4, "microbatches": 4})
    if args.smoke and (why := smoke_cuda_missing(args)):
        print_smoke_skip("pp", {"run": why})
        return
    results = {}
    for world_size in parse_world_sizes(args):
        results |= run_ranks(_bench, world_size, args)
    print(json.dumps({"benchmark": "pp", "smoke": args.smoke, "device": args.device, "backend": "nccl" if args.device == "cuda" else "gloo",
                      "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                                "seq_len": args.seq_len},
                      "microbatches": args.microbatches, "micro_batch_size": args.batch,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
