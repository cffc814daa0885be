"""Serving workloads on one deployment: static batches, continuous batching, the offline optimum, Poisson
arrivals and prefill/decode disaggregation -- throughput, first-token and per-token latency, power.

Responsible for: `estimate_serving` (the JSON fields of `meshlm plan infer`) and `search_serving` (every layout of
--gpus ranked, as the training search does).
Not responsible for: what is asked of the deployment (`serving_workload.Workload`: prompt and output lengths, one
batching mode, the prefix cache's share); one iteration's time or memory (`serving.py`); the queueing formulas the
modes put those times into (`queues.py`: `slot_wait`, `budget_wait`, `wait_quantile`, `tail_concurrency`).

Modes (I prompt tokens, O output tokens per request):
  * static batch B (`--batch`; TensorRT-LLM's gptSessionBenchmark, FasterTransformer): the whole batch's
    prompts prefilled in one pass (TTFT), then O - 1 decode steps with the KV growing from I to I + O
    (priced at the mean, I + O / 2);
  * continuous batching with C requests in flight (`--concurrency`; Orca, Yu et al. OSDI'22; vLLM, Kwon et al.
    SOSP'23): in the steady state a request finishes every O / C iterations and its replacement's prompt is
    prefilled in chunks that ride with the decodes (Sarathi-Serve, Agrawal et al. OSDI'24): each iteration carries
    C decodes over I + O / 2 cached tokens and C x I / O prompt tokens on average, in whole pieces (a chunk, or a
    prompt shorter than one) -- Poisson many per iteration, and an iteration carrying a piece lasts longer than one
    carrying its average share (`_prompt_mixture`: decode iterations are bound by the weights, prompt ones by the
    FLOPs); throughput = C / the mean iteration, TPOT = the mean iteration a decoding request sees, TTFT =
    ceil(I / chunk) iterations holding a chunk. C is a count of clients, each sending its next request when its
    last one ends (vLLM's `bench serve --max-concurrency`, NIM's genai-perf `--concurrency`): a request arrives as
    an iteration ends and waits for the whole next one, and its prompt queues for the engine's token budget
    (`prefill_queue`, at the rate of Little's law); beyond what the engine can run
    (`max_concurrency`: its KV, or its running-request cap) the rest wait in its queue (`clients`), C - N of them
    always; Little's law on the queue, W = (C - N) / X at X requests/s, adds the wait to the TTFT and leaves the
    throughput N's;
  * offline (`--offline`): the concurrency that maximises throughput among those whose KV fits, each request
    reserving I + O tokens (TensorRT-LLM's GUARANTEED_NO_EVICT scheduler; vLLM's reported max concurrency);
    with latency targets (`--max-ttft-ms`, `--max-tpot-ms`: a serving SLO, goodput in DistServe's sense) the one
    that maximises it among those whose steady-state TTFT and TPOT meet them (`meets_slo` false, and the
    fewest requests, where none does); the steady state's TTFT holds no queueing, so a target on a tail (p99)
    under bursty arrivals is met more easily here than in the measurement;
  * Poisson arrivals of R requests/s (`--request-rate`): the in-flight count C solves Little's law
    C = R x (TTFT + O x TPOT(C)) by fixed-point iteration. The engine admits a request at its next iteration (it
    waits out the one in flight when anything runs: E[T^2] / (2 E[T]) on average over the iterations' lengths T, as
    a random instant falls in the long, prompt-carrying ones more often -- `queues.residual_life`); then it rides
    the next iteration with every prompt that arrived during that one, which lengthen it, until the token budget
    binds and prompts queue for it: an M/D/1 queue of jobs of I tokens on a server of a chunk per iteration
    (`prefill_queue`, `queues.budget_wait`: the longer of the two waits; Pollaczek-Khinchine with deterministic
    service). The engine absorbs load by batching
    more -- the TPOT grows with C, the TTFT does not until the budget or the KV runs out (TensorRT-LLM's online table:
    at 16 requests/s, the rate its offline run peaks at, the mean TTFT 175 ms against 62 ms at 2/s). A request also
    waits for a running-request slot (the KV or the engine's cap) when the Poisson in-flight count fills them, as in
    an M/D/k queue (`slot_wait`, Erlang's C). It keeps up while R x O stays below the offline throughput, the offered
    load below the slots and the prompts' tokens below the token budget (`utilization`, the busiest of the three).
    Tails at `--percentile` P (default 99, MLPerf's server scenarios' p99): the waits' from the slot queue's and the
    M/D/1 queue's distributions (`slot_wait`, `wait_quantile`) plus the iteration in flight's; the TPOT's at the
    in-flight count a request sees over its life, plus the spread of its mean gap (its O - 1 gaps, each an iteration
    carrying Poisson many prompts: normal by the central limit); the count: every request in flight is served at
    once, so the count is that of an infinite-server queue, Poisson with mean C (the M/G/infinity result), and its
    mean over a life of fixed length has variance 2C/3 (`tail_concurrency`);
  * the highest Poisson rate whose tails meet `--max-ttft-ms` / `--max-tpot-ms` (`--request-rate max`: MLPerf's
    server scenario, p99 TTFT and TPOT within its limits): a bisection over the in-flight count C, the rate being
    Little's C / (TTFT + O x TPOT(C)) (`max_rate`);
  * disaggregated P:D (`--disaggregate`; DistServe, Zhong et al. OSDI'24; Splitwise, Patel et al. ISCA'24):
    P GPUs only prefill (full chunks, compute-bound), D GPUs only decode (iterations of decodes alone: the
    offline optimum and a TPOT target are taken on those), and each request's prompt KV crosses from one to the
    other over the link they share (scale-up when both fit one domain, else each prefill GPU's NIC); throughput is
    the least of the three rates, the TTFT the prefill pool's.
Prefix caching (`--prefix-hit H`; vLLM's automatic prefix caching, SGLang's RadixAttention, TensorRT-LLM's KV cache
reuse): a share H of each prompt's tokens is found in the cache, so in every mode a request prefills only the rest
(`Workload.prefill_len`, at least its last token), each of them attending over the cached prefix and the rest before
it (`Workload.prefill_ctx`). The KV is counted whole for every request -- its own earlier turns, say -- unless the
prefix is one that every request shares (`--prefix-shared`: a system prompt, a RAG template), whose blocks the running
requests then hold once (`ServedModel.sequences_sharing_a_prefix`: in the full-attention layers); a disaggregated
deployment is priced shipping the whole prompt's KV to the decode pool (meshlm's own decode instance skips the blocks
its cache holds). benchmarks/prefix_cache.py measures meshlm's engine against it.
Power: every GPU at its board power plus its share of server and network, times PUE (cluster.py's datasheet
figures, `operations.power`) -- an upper bound while decode leaves the tensor cores idle.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from meshlm.planner.cluster import GiB
from meshlm.planner.explain import serving_caution
from meshlm.planner.queues import budget_wait, slot_wait, tail_concurrency
from meshlm.planner.search import divisors
from meshlm.planner.serving import Serving, iteration_time, kv_transfer_bytes, weight_only
from meshlm.planner.serving_layout import ServingLayout
from meshlm.planner.serving_engine import busiest_rank_prefill, default_max_batch
from meshlm.planner.serving_model import KV_BYTES
from meshlm.planner.serving_workload import Workload

def max_concurrency(sv: Serving, wl: Workload) -> int:
    """Requests of I + O tokens whose KV fits the deployment (each dp rank its own; a prefix they share held once
    on each), within --max-batch."""
    per_rank = _kv_fits(sv, wl)
    if wl.max_batch:
        per_rank = min(per_rank, wl.max_batch)
    return int(per_rank) * sv.layout.dp


def _kv_fits(sv: Serving, wl: Workload) -> int:
    """Requests of I + O tokens whose KV one dp rank holds (`Serving.max_sequences`)."""
    return sv.max_sequences(wl.input_len + wl.output_len, shared_prefix=wl.shared_prefix_len)


def static_batch(sv: Serving, wl: Workload, batch: int) -> dict:
    I, O, b = wl.input_len, wl.output_len, batch / sv.layout.dp
    pre = iteration_time(sv, decodes=0, kv_len=0, prefill_tokens=b * wl.prefill_len, prefill_ctx=wl.prefill_ctx)
    dec = iteration_time(sv, **wl.decoding(b))
    total = pre["total"] + (O - 1) * dec["total"]
    main = dec if (O - 1) * dec["total"] >= pre["total"] else pre
    return {"concurrency": batch, "ttft_s": pre["total"], "tpot_s": dec["total"], "output_tokens_per_s": batch * O / total,
            "total_tokens_per_s": batch * (I + O) / total, "bound": main["bound"], "iteration": dec}


def continuous(sv: Serving, wl: Workload, concurrency: float) -> dict:
    I, O, c = wl.input_len, wl.output_len, concurrency / sv.layout.dp
    it = steady_iteration(sv, wl, c)
    P = wl.prefill_len
    chunk = min(P, wl.prefill_chunk)
    with_chunk = iteration_time(sv, **wl.decoding(c), prefill_tokens=max(chunk, c * P / O),
                                prefill_ctx=wl.prefill_ctx)
    ttft = 0.0 if wl.prefilled_elsewhere else math.ceil(P / chunk) * with_chunk["total"]
    return {"concurrency": concurrency, "ttft_s": ttft,
            "tpot_s": it.get("itl", it["total"]),
            "output_tokens_per_s": concurrency / it["total"],
            "total_tokens_per_s": concurrency * (I + O) / O / it["total"], "bound": it["bound"], "iteration": it}


def clients(sv: Serving, wl: Workload, concurrency: int) -> dict:
    """`concurrency` closed-loop clients (module docstring): `continuous` for the N = min(C, `max_concurrency`) the
    engine runs, their prompts queueing for its token budget (`prefill_queue`, at the rate Little's law gives:
    N / (TTFT + O x TPOT), the TTFT solved as a fixed point; a lone client finds the engine idle); the other C - N
    wait, each for W = (C - N) x O / (output tokens/s) before that (Little's law on a queue that is never empty:
    C - N waiting, X = tokens/s / O requests/s leaving it). "running" and "queued" say which; the bound is then the
    KV capacity unless the engine's cap (--max-batch) stopped it first."""
    cap = max_concurrency(sv, wl)
    n = min(concurrency, cap)
    r = continuous(sv, wl, n)
    if n > sv.layout.dp:  # others' requests are in flight: the engine is always busy
        prefill, ttft = r["ttft_s"], r["ttft_s"]
        for _ in range(100):
            rate = n / (ttft + wl.output_len * r["tpot_s"])
            ttft, last = prefill + prefill_queue(sv, wl, r, rate, busy=1.0, at_boundary=True), ttft
            if not ttft < math.inf or abs(ttft - last) <= 1e-12 * ttft:
                break
        r = dict(r, ttft_s=ttft)
    if concurrency <= cap:
        return dict(r, running=concurrency, queued=0)
    wait = (concurrency - cap) * wl.output_len / r["output_tokens_per_s"]
    kv_bound = not wl.max_batch or _kv_fits(sv, wl) < wl.max_batch
    return dict(r, concurrency=concurrency, running=cap, queued=concurrency - cap, ttft_s=r["ttft_s"] + wait,
                bound="KV capacity" if kv_bound else r["bound"])


def steady_iteration(sv: Serving, wl: Workload, c: float) -> dict:
    """The mean iteration of continuous batching with c requests per dp rank: c decodes over I + O / 2 cached
    tokens and c I / O prompt tokens. With attention data parallelism under expert parallelism (ep > 1, dp > 1)
    the ranks meet at every MoE layer, so an iteration lasts as long as its busiest rank: a rank that starts a
    prompt (in pieces of the chunk) holds the others up (serving_engine.busiest_rank_prefill), unless the engine
    balances prefills across ranks."""
    O, lo = wl.output_len, sv.layout
    if wl.prefilled_elsewhere:  # a decode pool: decodes only, every iteration alike
        it = iteration_time(sv, **wl.decoding(c))
        return dict(it, itl=it["total"], itl_var=0.0, lengths=[(1.0, it["total"])])
    P = wl.prefill_len
    kw = dict(**wl.decoding(c), prefill_tokens=c * P / O, prefill_ctx=wl.prefill_ctx)
    if not lo.attention_dp or sv.engine.adp_balanced:
        return _prompt_mixture(sv, c, wl, min(P, wl.prefill_chunk))
    prob, piece = busiest_rank_prefill(c * P / O, min(P, wl.prefill_chunk), lo.dp)
    busy, idle = iteration_time(sv, **kw, rank_prefill=piece), iteration_time(sv, **kw, rank_prefill=0.0)
    out = {k: prob * v + (1 - prob) * idle[k] for k, v in busy.items() if k != "bound"}
    return dict(out, bound=busy["bound"] if prob >= 0.5 else idle["bound"],
                lengths=[(prob, busy["total"]), (1 - prob, idle["total"])])


# Beyond this many prompt pieces per iteration on average the mixture is the mean iteration (`_prompt_mixture`).
MIXTURE_MAX_PIECES = 16.0


def _prompt_mixture(sv: Serving, c: float, wl: Workload, piece: int) -> dict:
    """Continuous batching's iterations as they run: the prompts do not spread evenly over them. A prompt's P tokens
    to prefill (`Workload.prefill_len`: I, less a cached prefix) join in pieces of `piece` (the chunk, or the whole
    of them); the pieces one iteration carries are Poisson with mean m = c P / (O piece) (c requests per rank, each
    bringing P prompt tokens per O generated), and an iteration carrying k of them lasts t(c decodes + k pieces).
    Decode iterations are bound by the weights' reads and prefill-carrying ones by the prompt's FLOPs, so the mean
    iteration E[t] exceeds the iteration of the mean work
    (t is convex in the prompt tokens): E[t] sets the throughput ("total"), the decode-weighted mean
    sum P(k) (c - k) t_k / sum P(k) (c - k) the time between a request's tokens ("itl": a prompting request does not
    decode in its prompt's iteration). Past MIXTURE_MAX_PIECES pieces an iteration holds nearly the mean work
    (relative spread 1 / sqrt(m)): the mean iteration alone. "itl_var": the variance of the gaps (decode-weighted),
    whose mean over a request's O - 1 gaps sets the spread of its TPOT (`_at_rate`'s tail); "lengths": the
    iterations' (probability, seconds), whose rest an arrival waits out (`queues.residual_life`)."""
    O, P = wl.output_len, wl.prefill_len
    m = c * P / O / piece if piece > 0 else 0.0
    kw = dict(**wl.decoding(c), prefill_ctx=wl.prefill_ctx)
    if m <= 0 or m > MIXTURE_MAX_PIECES:
        it = iteration_time(sv, **kw, prefill_tokens=c * P / O)
        return dict(it, itl=it["total"], itl_var=0.0, lengths=[(1.0, it["total"])])
    weights, its, k, p, mass = [], [], 0, math.exp(-m), 0.0
    while mass < 1 - 1e-6 and k <= 4 * MIXTURE_MAX_PIECES:
        weights.append(p)
        its.append(iteration_time(sv, **kw, prefill_tokens=k * piece))
        mass += p
        k += 1
        p *= m / k
    out = {key: sum(w * it[key] for w, it in zip(weights, its)) / mass for key in its[0] if key != "bound"}
    decoding = [w * max(0.0, c - i) for i, w in enumerate(weights)]
    gaps = sum(decoding)
    itl = sum(d * it["total"] for d, it in zip(decoding, its)) / gaps if gaps > 0 else out["total"]
    var = sum(d * (it["total"] - itl) ** 2 for d, it in zip(decoding, its)) / gaps if gaps > 0 else 0.0
    bound = max(zip(weights, its), key=lambda x: x[0] * x[1]["total"])[1]["bound"]
    lengths = [(w / mass, it["total"]) for w, it in zip(weights, its)]
    return dict(out, bound=bound, itl=itl, itl_var=var, lengths=lengths)


def offline(sv: Serving, wl: Workload) -> dict:
    """The throughput-maximising concurrency that fits (powers of two up to the KV limit, and the limit); with latency
    targets, among those meeting them (a finer grid: quarter powers of two), else the fewest requests (module
    docstring)."""
    cap = max_concurrency(sv, wl)
    dp = sv.layout.dp
    slo = wl.max_ttft_s is not None or wl.max_tpot_s is not None
    steps = [2 ** (i / 4) for i in range(80)] if slo else [2**i for i in range(20)]
    candidates = {cap} | {dp * max(1, round(x)) for x in steps if dp * x < cap}
    results = [continuous(sv, wl, c) for c in sorted(candidates)]
    if slo:
        meets = [r for r in results if r["ttft_s"] <= (wl.max_ttft_s or math.inf)
                 and r["tpot_s"] <= (wl.max_tpot_s or math.inf)]
        best = max(meets, key=lambda r: r["output_tokens_per_s"]) if meets else results[0]
        return dict(best, meets_slo=bool(meets))
    best = max(results, key=lambda r: r["output_tokens_per_s"])
    if best["concurrency"] == cap and best["bound"] == "memory bandwidth" and not wl.max_batch:
        best["bound"] = "KV capacity"  # more sequences would share the weight reads, but no more KV fits
    return best


def poisson(sv: Serving, wl: Workload) -> dict:
    """Latencies under Poisson arrivals (module docstring): Little's law fixed point + the prefill queue."""
    R, O = wl.request_rate, wl.output_len
    best = offline(sv, wl)
    if R * O >= best["output_tokens_per_s"]:  # more than it can serve: the queue grows without bound
        return _at_rate(sv, wl, R, best, best)
    c = R * O * best["tpot_s"]
    for _ in range(200):
        r = continuous(sv, wl, max(c, 1e-9))
        c, last = 0.5 * c + 0.5 * R * (r["ttft_s"] + O * r["tpot_s"]), c
        if c == math.inf:  # the prompts outrun the token budget at every count: the queue grows without bound
            return _at_rate(sv, wl, R, best, best)
        if abs(c - last) <= 1e-9 * max(c, 1e-9):
            break
    return _at_rate(sv, wl, R, continuous(sv, wl, max(c, 1e-9)), best)


def max_rate(sv: Serving, wl: Workload) -> dict:
    """The highest Poisson rate whose TTFT and TPOT tails meet the workload's targets (module docstring): the
    in-flight count C bisected between none and what fits, the rate at each being Little's C / (TTFT + O x TPOT(C));
    where not even a trickle of requests meets them, a trickle's latencies with meets_slo false."""
    O, cap = wl.output_len, max_concurrency(sv, wl)
    best = offline(sv, replace(wl, max_rate=False, max_ttft_s=None, max_tpot_s=None))

    def at(c: float) -> dict:
        r = continuous(sv, wl, c)
        return _at_rate(sv, wl, c / (r["ttft_s"] + O * r["tpot_s"]), r, best)

    def meets(x: dict) -> bool:
        return (x["keeps_up"] and x["ttft_tail_s"] <= (wl.max_ttft_s or math.inf)
                and x["tpot_tail_s"] <= (wl.max_tpot_s or math.inf))

    lo, hi = 1e-3 * min(1.0, cap), float(cap)
    if not meets(at(lo)):
        return dict(at(lo), meets_slo=False)
    if meets(at(hi)):
        return dict(at(hi), meets_slo=True)
    for _ in range(40):
        mid = math.sqrt(lo * hi)  # the count spans orders of magnitude: bisect its logarithm
        lo, hi = (mid, hi) if meets(at(mid)) else (lo, mid)
    return dict(at(lo), meets_slo=True)


def prefill_queue(sv: Serving, wl: Workload, r: dict, R: float, *, busy: float, q: float | None = None,
                  at_boundary: bool = False) -> float:
    """Seconds a request of continuous batching `r` (requests arriving at R per second, Poisson) waits before its
    prompt's iterations, on average (q None) or at quantile q (`budget_wait` on this deployment: the lengths of `r`'s
    iterations, the iteration of its decodes and a full chunk, and what a prompt token adds to one, per dp rank)."""
    full = _budget_iteration(sv, wl, r)
    # closed-loop arrivals have no co-riders (`budget_wait`): no per-token cost to price for them
    t_token = 0.0 if at_boundary else (full - _budget_iteration(sv, wl, r, prompt_tokens=0)) / wl.prefill_chunk
    return budget_wait(R / sv.layout.dp, wl.prefill_len, wl.prefill_chunk, full, r["iteration"]["lengths"], busy=busy,
                       q=q, at_boundary=at_boundary, t_token=t_token)


def _budget_iteration(sv: Serving, wl: Workload, r: dict, prompt_tokens: int | None = None) -> float:
    """Seconds of an iteration carrying `r`'s decodes and a full chunk of prompt tokens (the token budget; or
    `prompt_tokens`), per dp rank."""
    return iteration_time(sv, **wl.decoding(r["concurrency"] / sv.layout.dp),
                          prefill_tokens=wl.prefill_chunk if prompt_tokens is None else prompt_tokens,
                          prefill_ctx=wl.prefill_ctx)["total"]


def _at_rate(sv: Serving, wl: Workload, R: float, r: dict, best: dict) -> dict:
    """Poisson arrivals of R requests/s with `r` the continuous batching of the in-flight count they make and `best`
    the offline optimum: the waits for a running-request slot (`slot_wait`) and for the token budget
    (`prefill_queue`) added to the TTFT; the utilisation, the busiest of three limits -- the offered output tokens/s
    against the offline optimum's, the offered load (rate x a request's slot time) against the slots, the prompts'
    tokens against the token budget (rate x I x the budget iteration / the chunk) --, and whether it keeps up (each
    below 1; where one is not, the queue grows and the output tokens/s are the offered ones, at most the offline
    optimum's -- whose iterations carry whatever prompt tokens they hold: TensorRT-LLM's 467 + 16 rows at 32
    requests/s serve what it says, 24% more than the budget with the model's iteration times allows); the tails at
    `wl.percentile` ("ttft_tail_s", "tpot_tail_s"; the means where it is None). The in-flight count seen by an
    arrival is Poisson with mean c (the M/G/infinity result): the engine is busy with probability 1 - e^-c/dp."""
    I, O, c, s = wl.input_len, wl.output_len, r["concurrency"], r["ttft_s"]
    cap, dp = max_concurrency(sv, wl), sv.layout.dp
    hold = s + O * r["tpot_s"]  # a running request's slot, from its prompt's iterations to its last token
    slots, load = cap // dp, R / dp * hold
    utilization = max(R * O / best["output_tokens_per_s"], load / slots,
                      R / dp * wl.prefill_len * _budget_iteration(sv, wl, r) / wl.prefill_chunk)
    keeps_up = utilization < 1
    busy = -math.expm1(-c / dp)
    wait = prefill_queue(sv, wl, r, R, busy=busy) + slot_wait(load, slots, hold) if keeps_up else math.inf
    served = min(R, best["output_tokens_per_s"] / O)
    out = dict(r, request_rate=R, ttft_s=s + wait, keeps_up=keeps_up, utilization=utilization,
               output_tokens_per_s=served * O, total_tokens_per_s=served * (I + O))
    if wl.percentile is None:
        out.update(ttft_tail_s=out["ttft_s"], tpot_tail_s=out["tpot_s"])
    else:
        q = wl.percentile / 100
        many = min(float(cap), tail_concurrency(c, dp, q))
        crowded = continuous(sv, wl, many) if many > c else r
        # a request's TPOT is the mean of its O - 1 gaps, each an iteration that may carry prompts (Poisson many):
        # normal at the quantile (central limit), on top of the in-flight count's tail
        spread = math.sqrt(crowded["iteration"].get("itl_var", 0.0) / max(1, O - 1))
        queue = prefill_queue(sv, wl, r, R, busy=busy, q=q) + slot_wait(load, slots, hold, q) if keeps_up else math.inf
        out.update(ttft_tail_s=s + queue,
                   tpot_tail_s=crowded["tpot_s"] + statistics.NormalDist().inv_cdf(q) * spread)
    if not keeps_up:
        out["bound"] = best["bound"]
    return out


def _pool(sv: Serving, gpus: int) -> Serving:
    """The layout's tp x pp x cp replica shape on a pool of `gpus` (experts over the pool's stage when ep > 1)."""
    lo = sv.layout
    rest = lo.tp * lo.pp * lo.cp
    if gpus % rest:
        raise ValueError(f"--disaggregate pool of {gpus} GPUs is not a multiple of tp x pp x cp = {rest}")
    dp = gpus // rest
    ep = 1 if lo.ep == 1 else math.gcd(dp * lo.tp * lo.cp, sv.sm.cfg.num_experts)
    return replace(sv, layout=ServingLayout(tp=lo.tp, pp=lo.pp, cp=lo.cp, ep=ep, dp=dp))


def disaggregated(sv: Serving, wl: Workload) -> dict:
    """P:D disaggregation (module docstring): the prefill pool at full chunks, the decode pool at --concurrency or at
    its offline optimum -- chosen on its own iterations, which carry decodes only, and with a TPOT target on them --
    and the prompts' KV between them. The TTFT is the prefill pool's (a prompt alone, then its KV shipped), so a TTFT
    target is met or not there, whatever the decode pool runs."""
    P, D = wl.disaggregate
    pre, dec = _pool(sv, P), _pool(sv, D)
    I, O, cl, todo = wl.input_len, wl.output_len, sv.cluster, wl.prefill_len
    chunk = max(wl.prefill_chunk, todo)
    full = iteration_time(pre, decodes=0, kv_len=0, prefill_tokens=chunk, prefill_ctx=wl.prefill_ctx)
    prefill_rps = pre.layout.dp * chunk / todo / full["total"]
    dwl = replace(wl, disaggregate=None, prefilled_elsewhere=True, max_ttft_s=None)
    d = continuous(dec, dwl, wl.concurrency) if wl.concurrency else offline(dec, dwl)
    it = d["iteration"]
    decode_rps = d["output_tokens_per_s"] / O if O > 1 else math.inf  # one token: the prefill pool's alone
    nbytes = kv_transfer_bytes(sv.sm, prompt_tokens=I, kv_precision=sv.kv_precision)
    same_domain = P + D <= cl.scaleup_size
    link_bw = (cl.scaleup_bw if same_domain else cl.scaleout_bw) * cl.link_efficiency
    replica = pre.layout.tp * pre.layout.pp * pre.layout.cp  # each GPU ships its own shard on its own link
    transfer_s = nbytes / (replica * link_bw)
    transfer_rps = P * link_bw / nbytes
    rps = min(prefill_rps, decode_rps, transfer_rps)
    bound = {prefill_rps: full["bound"], decode_rps: it["bound"],
             transfer_rps: "scale-up link" if same_domain else "scale-out link"}[rps]
    alone = iteration_time(pre, decodes=0, kv_len=0, prefill_tokens=todo, prefill_ctx=wl.prefill_ctx)["total"]
    ttft = alone + transfer_s
    slo = {}
    if wl.max_ttft_s is not None or wl.max_tpot_s is not None:  # the TPOT's met by the decode pool's choice
        slo["meets_slo"] = d.get("meets_slo", True) and ttft <= (wl.max_ttft_s or math.inf)
    return {**slo, "concurrency": d["concurrency"], "ttft_s": ttft, "tpot_s": it["total"],
            "output_tokens_per_s": rps * O, "total_tokens_per_s": rps * (I + O), "bound": bound, "iteration": it,
            "kv_transfer_bytes_per_request": nbytes, "kv_transfer_s": transfer_s,
            "prefill_requests_per_s": prefill_rps, "decode_requests_per_s": decode_rps,
            "transfer_requests_per_s": transfer_rps}


def power_w(sv: Serving) -> float:
    """Watts per GPU of the deployment (module docstring: board, server and network shares, PUE)."""
    from meshlm.planner.operations import power

    return power(sv.cluster, gpus=sv.layout.world, step_s=1.0, tokens_per_s=1.0)["watts_per_gpu"]


def estimate_serving(sv: Serving, wl: Workload) -> dict:
    """The JSON of `meshlm plan infer` for one deployment (README lists the keys)."""
    lo, gpus = sv.layout, sv.layout.world
    mem, cap = sv.memory(), max_concurrency(sv, wl)
    out = {"layout": lo.label(), "gpus": gpus, "mode": wl.mode, "input_len": wl.input_len,
           "prefix_hit": wl.prefix_hit, "prefill_tokens_per_request": wl.prefill_len,
           "shared_prefix_tokens": wl.shared_prefix_len, "output_len": wl.output_len,
           "draft_tokens_per_step": sv.mtp_tokens, "tokens_per_step": sv.mtp_tokens_per_step(),
           "draft_model": None if sv.draft_model is None else sv.draft_model.cfg.preset or "config.json",
           "precision": sv.precision, "kv_precision": sv.kv_precision,
           "weights_gib": mem["weights"] / GiB, "workspace_gib": mem["workspace"] / GiB,
           "profile_gib": mem["profile"] / GiB,
           "kv_capacity_gib": mem["kv_capacity"] / GiB, "kv_bytes_per_token": sv.kv_bytes_per_token_per_gpu(),
           "kv_bytes_per_token_model": sv.sm.kv_bytes_per_token(KV_BYTES[sv.kv_precision]),
           "kv_bytes_per_request": sv.kv_bytes_per_gpu(wl.input_len + wl.output_len),
           "max_context_tokens": sv.max_tokens(), "model_context_tokens": sv.sm.cfg.max_seq_len,
           "context_note": sv.sm.context_note(wl.input_len + wl.output_len), "max_concurrency": cap, "max_batch": cap}
    need = 1 if wl.disaggregate else wl.batch or 1  # clients beyond what fits wait in the queue (`clients`)
    reason = _misfit(sv, wl, cap, need, mem)
    for name, n in zip(("prefill", "decode"), wl.disaggregate or ()):  # each pool holds the weights on its own
        pool = _pool(sv, n)
        reason = reason or _misfit(pool, wl, max_concurrency(pool, wl), 1, pool.memory(), pool=f"the {name} pool's ")
    out.update(fits=not reason, reason=reason)
    if reason:
        return out
    if wl.disaggregate:
        r = disaggregated(sv, wl)
        gpus = sum(wl.disaggregate)
        out["disaggregate"] = list(wl.disaggregate)
    else:
        r = {"static": lambda: static_batch(sv, wl, wl.batch), "concurrency": lambda: clients(sv, wl, wl.concurrency),
             "offline": lambda: offline(sv, wl), "request-rate": lambda: poisson(sv, wl),
             "max-rate": lambda: max_rate(sv, wl)}[wl.mode]()
    watts = power_w(sv) * gpus
    it = r.pop("iteration")
    tails = {k: r.pop(k) for k in ("ttft_tail_s", "tpot_tail_s") if k in r}
    if tails and wl.percentile is not None:  # Poisson arrivals: the latencies' tails beside their means
        p = percentile_label(wl.percentile)
        out.update({"percentile": wl.percentile, f"ttft_{p}_ms": _ms(tails["ttft_tail_s"]),
                    f"tpot_{p}_ms": _ms(tails["tpot_tail_s"])})
    out.update({k: v for k, v in r.items() if k not in ("ttft_s", "tpot_s")})
    out["caution"] = caution(sv, bound=r["bound"], concurrency=r["concurrency"])
    out.update(gpus=gpus, ttft_ms=_ms(r["ttft_s"]), tpot_ms=_ms(r["tpot_s"]),
               output_tokens_per_s_per_gpu=r["output_tokens_per_s"] / gpus, decode_tokens_per_s=r["output_tokens_per_s"],
               power_w=watts, joules_per_output_token=watts / r["output_tokens_per_s"],
               iteration_ms={k: v * 1e3 for k, v in it.items() if k not in ("bound", "itl_var", "lengths")})
    return out


def caution(sv: Serving, *, bound: str, concurrency: float) -> str | None:
    """`explain.serving_caution` for the deployment at `concurrency` requests in flight and its `bound`: each engine
    decodes concurrency / dp of them, and each iteration all-reduces their query tokens' (MTP drafts too) bf16 hidden
    states; FP4 experts with BF16 GEMMs are weight-only (W4A16); latent attention (MLA) with dp and ep ranks is
    DeepSeek's attention-DP layout."""
    lo, running = sv.layout, concurrency / sv.layout.dp
    return serving_caution(bound=bound, tp=lo.tp, running=running, engine=sv.engine.name, gpu=sv.cluster.gpu,
                           all_reduce_bytes=running * (1 + sv.mtp_tokens) * sv.sm.cfg.hidden_size * 2,
                           weight_only=sv.sm.cfg.is_moe and weight_only(sv.precision, sv.gemm_precision),
                           latent_adp=sv.sm.mla is not None and lo.attention_dp)


def _ms(seconds: float) -> float | None:
    """Milliseconds, or None (JSON null) for a latency without bound: arrivals the deployment does not keep up with."""
    return seconds * 1e3 if math.isfinite(seconds) else None


def percentile_label(p: float) -> str:
    """The JSON keys' name of a percentile: 99 -> "p99", 99.9 -> "p99_9"."""
    return f"p{p:g}".replace(".", "_")


def _misfit(sv: Serving, wl: Workload, cap: int, need: int, mem: dict, *, pool: str = "") -> str:
    """Why `need` requests do not fit the deployment (`pool`: which of a disaggregated one's it is), or ""."""
    seq = wl.input_len + wl.output_len
    if cap < sv.layout.dp or cap < 1:
        profile = (f" and the engine's profile run {mem['profile'] / GiB:.1f} GiB (its sampler over "
                   f"{default_max_batch(sv.engine, sv.cluster)} rows)" if mem["profile"] else "")
        fewer = ", a smaller --max-batch" if mem["profile"] else ""
        more = " (or that pool's share of --disaggregate)" if pool else ""
        return (f"{pool}{mem['weights'] / GiB:.1f} GiB of weights per GPU{profile} leave room for {sv.max_tokens():,} "
                f"tokens of KV cache, fewer than one sequence of {seq} tokens; add GPUs (tp, pp or cp){more}, shorten "
                f"the sequence{fewer} or use --precision fp8 / --kv-precision fp8")
    held = _kv_fits(sv, wl)  # requests the KV cache of a dp rank holds
    if need > cap and wl.max_batch and held > wl.max_batch:  # the engine's cap binds, not the memory
        return (f"{need} requests do not fit: the engine runs at most {wl.max_batch} at once per dp rank "
                f"(--max-batch, or the --engine's default), {cap} over {sv.layout.dp} dp rank(s), where the KV cache "
                f"would hold {held * sv.layout.dp}: raise --max-batch, or add dp ranks")
    if need > cap:
        shared = f" (their shared {wl.shared_prefix_len}-token prefix held once)" if wl.shared_prefix_len else ""
        return (f"{need} requests of {seq} tokens{shared} do not fit: {sv.kv_bytes_per_gpu(seq) / 2**20:,.1f} MiB of "
                f"KV cache each per GPU alone, {mem['kv_capacity'] / GiB:,.1f} GiB per GPU hold {cap} (max "
                f"concurrency)")
    return ""


def frontier(sv: Serving, wl: Workload) -> list[dict]:
    """The throughput-interactivity curve of one deployment (`plan infer --plot`): continuous batching (`clients`) at
    dp x 1, 2, 4, ... requests in flight up to what fits (`max_concurrency`, and that count itself): output tokens/s
    per GPU against each request's tokens/s (1 / TPOT), with the TTFT -- more requests share each iteration's weight
    reads until the compute, the KV or the engine's cap stops them. Empty where no request fits."""
    cap, dp = max_concurrency(sv, wl), sv.layout.dp
    if _misfit(sv, wl, cap, 1, sv.memory()):  # not one request per dp rank
        return []
    counts = sorted({dp * 2**i for i in range(40) if dp * 2**i < cap} | {cap})
    points = []
    for c in counts:
        r = clients(sv, wl, c)
        points.append({"concurrency": c, "output_tokens_per_s_per_gpu": r["output_tokens_per_s"] / sv.layout.world,
                       "tokens_per_s_per_user": 1.0 / r["tpot_s"], "ttft_ms": r["ttft_s"] * 1e3,
                       "tpot_ms": r["tpot_s"] * 1e3, "bound": r["bound"]})
    return points


def serving_layouts(sv: Serving, gpus: int) -> list[ServingLayout]:
    """Every layout of `gpus` the search considers: tp within a scale-up domain, pp, cp = 1, the rest replicas (dp),
    ep = 1 or, for MoE, every rank of a stage's replicas (ep = dp x tp); tp and pp split a draft model too."""
    cfg, layouts = sv.sm.cfg, []
    models = [cfg] + ([sv.draft_model.cfg] if sv.draft_model is not None else [])
    splits = lambda t: t <= sv.cluster.scaleup_size and all(m.num_heads % t == 0 for m in models)  # noqa: E731
    for tp in filter(splits, divisors(gpus)):
        for pp in (p for p in divisors(gpus // tp) if p <= min(16, *(m.num_layers for m in models))):
            dp = gpus // (tp * pp)
            eps = [1] + ([dp * tp] if cfg.is_moe and dp * tp > 1 and cfg.num_experts % (dp * tp) == 0 else [])
            layouts += [ServingLayout(tp=tp, pp=pp, ep=ep, dp=dp) for ep in eps]
    return layouts


def search_serving(sv: Serving, wl: Workload, *, gpus: int, top: int = 10) -> list[dict]:
    """Every layout of `gpus` (`serving_layouts`) ranked by output tokens/s (then TPOT); those that miss the latency
    targets after those that meet them, those that fall behind Poisson arrivals after those that keep up, those that
    do not fit last, the nearest to fitting (the fewest weights per
    GPU) first."""
    results = [estimate_serving(replace(sv, layout=lo), wl) for lo in serving_layouts(sv, gpus)]
    key = lambda r: (not r["fits"], not r.get("meets_slo", True), not r.get("keeps_up", True),  # noqa: E731
                     -r.get("output_tokens_per_s", 0.0), r.get("tpot_ms", math.inf), r["weights_gib"])
    return sorted(results, key=key)[:top]
