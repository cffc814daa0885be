"""What the serving planner needs measured on this host beyond `calibrate`'s rates: the fixed host work of meshlm's
serving engine per step, per decoder layer and per sequence (`measure_serving_host`: engine steps of tiny
models), which the planner's `meshlm` engine prices, and what a GEMM costs on a CPU apart from its FLOPs
(`measure_gemm_weight_pass`: packed GEMMs and one-row GEMVs), which `Cluster.gemm_weight_bw` / `gemm_call_s` /
`gemv_weight_bw` / `gemv_call_s` carry.

Responsible for: those two measurements and their fits, in thread CPU seconds on one thread.
Not responsible for: writing the calibration file (`calibrate.calibrate`) or pricing anything (`serving.py`).
"""

from __future__ import annotations

import time


def measure_gemm_weight_pass(*, nbytes: int = 32 * 2**20, sizes: tuple = (256, 2048), rows: tuple = (2, 64),
                             repeats: int = 7) -> dict:
    """What a GEMM costs on one thread apart from its FLOPs: `x @ W.T` through `nbytes` of fp32 size x size weights
    (beyond the caches, as a model's layers are) for each of `sizes`, at one row and at `rows` rows of x, timed in
    thread CPU seconds (the fastest of `repeats`). A CPU BLAS takes two paths:
    - from two rows on it packs the weights before it multiplies, so that pass adds to the FLOPs' time rather than
      overlapping it: t = rows x FLOPs / r + calls x gemm_call_s + weight bytes / gemm_weight_bandwidth, its pass
      the line through the two `rows` counts at zero rows (the serving benchmark's model, hidden 256: its 29 GEMMs
      of a decode step take 1.9 ms + rows x 0.066 ms from 2 to 64 rows);
    - one row is a matrix-vector product that streams the weights once, unpacked: t = calls x gemv_call_s + weight
      bytes / gemv_weight_bandwidth (that model's 29 take 1.1 ms at one row, less than the packed pass alone).
    Each path's two terms come from the two sizes, as many bytes in 128 calls as in 2 (`_fit_weight_pass`); a
    call's fixed part grows with its weights (20 us at 256 x 256, beyond the dispatch a tiny model's step holds:
    `measure_serving_host`). {"gemm_weight_bandwidth", "gemm_call_s", "gemv_weight_bandwidth", "gemv_call_s"}."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    packed, gemv = [], []
    for size in sizes:
        ws = [torch.randn(size, size) for _ in range(max(1, nbytes // (4 * size * size)))]
        times = {}
        for m in (1, *rows):
            x = torch.randn(m, size)
            best = float("inf")
            for i in range(repeats + 1):
                t = time.thread_time()
                for w in ws:
                    F.linear(x, w)
                if i:  # the first pass pays one-time setup
                    best = min(best, time.thread_time() - t)
            times[m] = best
        (m1, m2), weights = rows, len(ws) * size * size * 4
        packed.append((len(ws), weights, times[m1] - m1 * (times[m2] - times[m1]) / (m2 - m1)))
        gemv.append((len(ws), weights, times[1]))
    bw, call = _fit_weight_pass(packed)
    gemv_bw, gemv_call = _fit_weight_pass(gemv)
    return {"gemm_weight_bandwidth": bw, "gemm_call_s": call, "gemv_weight_bandwidth": gemv_bw,
            "gemv_call_s": gemv_call}


def _fit_weight_pass(passes: list) -> tuple[float, float]:
    """(bytes/s, seconds per call) of t = calls x c + bytes / R from two passes (calls, bytes, seconds) over as many
    bytes (the calls make the difference); a bandwidth of 0 where the calls leave no time for the bytes."""
    (n1, b1, t1), (n2, b2, t2) = passes
    call = max(0.0, (t1 - t2) / (n1 - n2)) if n1 != n2 else 0.0
    weights_s = t2 - n2 * call
    return (b2 / weights_s if weights_s > 0 else 0.0), call


SERVING_LAYERS = (1, 2, 3)  # decoder layers of the tiny models whose engine steps `measure_serving_host` times
SERVING_SEQS = (1, 4, 16)  # decoding sequences per step


def measure_serving_host(*, steps: int = 20) -> dict:
    """The fixed host work of meshlm's serving engine per step, which the FLOP and byte counts of the serving
    model do not see: `Engine.step` (schedule, the step's plain input, the model, sampling, the scheduler's
    update, detokenization with the byte tokenizer) timed on tiny models (hidden 64, vocab 256: their FLOPs are
    a few microseconds of one core) with `SERVING_LAYERS` decoder layers and `SERVING_SEQS` decoding sequences,
    the fastest of `steps` decode steps each in thread CPU seconds (after a prefill and four untimed steps; on a
    shared host a step's wall time also holds the time other work ran instead, its CPU time does not), one
    thread. The fit step seconds = step_s + layers x layer_s + sequences x (seq_s + layers x layer_seq_s),
    least squares over the nine points (four would pin it to each point's noise: fits minutes apart differed 2x
    per layer), per sequence: its input, sampling and output in the engine; its attention and KV writes in every
    layer: {"step_s", "layer_s", "seq_s", "layer_seq_s", "points": [[layers, sequences, seconds]]}."""
    import torch

    from meshlm.config import ModelConfig
    from meshlm.infer.engine import Engine
    from meshlm.infer.sequence import SamplingParams
    from meshlm.models.transformer import build_model
    from meshlm.tokenizer import ByteTokenizer

    torch.set_num_threads(1)
    points = []
    for layers in SERVING_LAYERS:
        cfg = ModelConfig(vocab_size=256, hidden_size=64, num_layers=layers, num_heads=2, num_kv_heads=1,
                          intermediate_size=192, max_seq_len=256)
        model = build_model(cfg, seed=0).eval()
        for seqs in SERVING_SEQS:
            engine = Engine(model, ByteTokenizer(), block_size=16, num_blocks=seqs * 4 + 4, eos_token_ids=())
            params = SamplingParams(temperature=0, max_tokens=steps + 5, ignore_eos=True)
            for i in range(seqs):
                engine.add_request([2 + (i + j) % 200 for j in range(8)], params)
            times = []
            with torch.no_grad():
                for i in range(steps + 5):  # the prefill, four untimed decode steps, then `steps` timed
                    t = time.thread_time()
                    engine.step()
                    if i >= 5:
                        times.append(time.thread_time() - t)
            points.append([layers, seqs, min(times)])
    fit = _least_squares([[1.0, lay, n, lay * n] for lay, n, _ in points], [t for *_, t in points])
    return {**{k: max(0.0, v) for k, v in zip(("step_s", "layer_s", "seq_s", "layer_seq_s"), fit)}, "points": points}


def _least_squares(rows: list, ys: list) -> list:
    """x minimising |rows x - ys| (normal equations, Gauss-Jordan; a few unknowns)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(a[r][c]))
        a[c], a[pivot] = a[pivot], a[c]
        for r in range(n):
            if r != c and a[c][c]:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c])]
    return [a[i][n] / a[i][i] if a[i][i] else 0.0 for i in range(n)]
