"""Queueing formulas of the serving planner, free of any model or cluster: what a request waits for under Poisson
arrivals -- a running-request slot (`slot_wait`, Erlang's C), the engine's per-iteration token budget and the
iteration in flight (`budget_wait`, over the M/D/1 queue's mean and `wait_quantile`, and `residual_life`) -- and the
in-flight count a request sees over its life (`tail_concurrency`). Each is checked against a simulation of the
queue it describes (tests/test_planner_serving_arrivals.py). Responsible for: these formulas. Not responsible for:
which deployment's times go into them (`serving_modes`: `prefill_queue`, `_at_rate`, `clients`).
"""

from __future__ import annotations

import math
import statistics


def budget_wait(rate: float, prompt: int, budget: int, t_budget: float, in_flight: list[tuple[float, float]], *,
                busy: float, q: float | None = None, at_boundary: bool = False, t_token: float = 0.0) -> float:
    """The wait of a prompt of `prompt` tokens for an engine's iterations (and what the other prompts add to its own),
    prompts arriving at `rate` per second (Poisson), on average (q None) or at quantile q. Two parts:
      * the iteration in flight: the engine admits new work at iteration boundaries, so an arrival that finds it
        running (probability `busy`) waits out the rest of the iteration (`residual_life` of the iterations'
        lengths `in_flight`, (probability, seconds) pairs: t / 2 for iterations of one length t) -- or, arriving
        `at_boundary` (a closed-loop client's next request, sent as its last one's final iteration ends), the whole
        next iteration, the mean length by count;
      * the other prompts, in one of two regimes -- the wait the longer of the two:
        - the budget binds: every iteration carries at most `budget` prompt tokens (the engine's token budget:
          TensorRT-LLM's max_num_tokens, vLLM's max_num_batched_tokens) in `t_budget` seconds, and prompts queue for
          it as jobs in an M/D/1 queue -- service S = prompt x t_budget / budget, utilisation rho = rate x S
          (Pollaczek-Khinchine's mean rho S / (2 (1 - rho)), `wait_quantile`'s quantile);
        - it does not: the prompts that arrived during the iteration in flight all ride the next one (bulk
          service), which lasts `t_token` seconds longer for each of their tokens -- those before this prompt and
          those after, Poisson with mean 2 x rate x the rest (an instant's age and rest in a renewal process share
          one mean), their tokens capped by what the budget leaves this one (`_co_riders`; Poisson arrivals only).
    Against a simulated engine whose iterations last t_decode + t_token a prompt token: within 6% over prompts of
    1/40 to 0.6 of the budget at budget utilisations 0.1-0.85; each regime alone is 20-50% off where the other holds
    (tests/test_planner_serving_arrivals.py). Infinite where the prompts outrun the budget (rho >= 1)."""
    S = prompt * t_budget / budget
    rho = rate * S
    if rho >= 1:
        return math.inf
    if q is None:
        rest = sum(p * t for p, t in in_flight) if at_boundary else residual_life(in_flight)
        riders = 0.0 if at_boundary or not t_token else t_token * _co_riders(2 * rate * rest, prompt, budget)
        return busy * rest + max(rho * S / (2 * (1 - rho)), busy * riders)
    residual = 0.0 if q <= 1 - busy else residual_life(in_flight, (q - (1 - busy)) / busy)
    riders = t_token * _co_riders(2 * rate * residual_life(in_flight), prompt, budget) if t_token else 0.0
    return residual + max(wait_quantile(rho, S, q), busy * riders)


def _co_riders(m: float, prompt: int, budget: int) -> float:
    """E[min(N x prompt, budget - prompt)] for N ~ Poisson(m): the other prompts' tokens one iteration carries beside a
    prompt, within what the budget leaves it (none for a prompt of a whole budget or more: it is chunked)."""
    room = budget - prompt
    if room <= 0 or m <= 0:
        return 0.0
    # N at and beyond which the room is full, or past which Poisson(m) has no mass left (the room stands for the rest)
    full = min(math.ceil(room / prompt), int(m + 12 * math.sqrt(m)) + 30)
    p, below, mean = math.exp(-m), 0.0, 0.0
    for k in range(full):
        mean += p * k * prompt
        below += p
        p *= m / (k + 1)
    return mean + (1 - below) * room


def residual_life(lengths: list[tuple[float, float]], q: float | None = None) -> float:
    """What is left of the iteration in flight at a random instant (a Poisson arrival's, PASTA), iterations of the
    lengths t with the frequencies p of `lengths` ((p, t) pairs, by count): on average E[t^2] / (2 E[t]) -- a random
    instant falls in a long iteration more often than in a short one (the inspection paradox of renewal theory),
    t / 2 for one length t -- or at quantile q, from P(rest > x) = sum p (t - x)+ / sum p t (piecewise linear in x,
    inverted between the lengths)."""
    mean = sum(p * t for p, t in lengths)
    if mean <= 0:
        return 0.0
    if q is None:
        return sum(p * t * t for p, t in lengths) / (2 * mean)
    above = lambda x: sum(p * (t - x) for p, t in lengths if t > x) / mean  # noqa: E731  P(rest > x)
    ts = sorted({t for _, t in lengths} | {0.0})
    for a, b in zip(ts, ts[1:]):  # P(rest > x) falls linearly between neighbouring lengths
        if above(b) <= 1 - q:
            return a + (above(a) - (1 - q)) / (above(a) - above(b)) * (b - a)
    return ts[-1]


def slot_wait(load: float, slots: int, hold: float, q: float | None = None) -> float:
    """The wait for one of `slots` running-request slots (the engine's cap -- its KV or its max batch -- on one dp
    rank), requests arriving as Poisson at an offered load `load` = rate x `hold`, each holding its slot `hold`
    seconds; on average (q None) or at quantile q. Erlang's C formula gives the chance to wait (M/M/k, `erlang_c`);
    holding times that vary little halve M/M/k's waits (Allen-Cunneen's (1 + cs^2) / 2, cs = 0), exponential given a
    wait: mean C hold / (2 (k - a)), P(W > t) = C exp(-2 (k - a) t / hold) -- within 10% of a simulated M/D/k queue
    where the wait matters (tests/test_planner_serving_arrivals.py). Infinite at load >= slots."""
    if load >= slots:
        return math.inf
    C = erlang_c(slots, load)
    scale = hold / (2 * (slots - load))
    if q is None:
        return C * scale
    return scale * math.log(C / (1 - q)) if C > 1 - q else 0.0


def erlang_c(k: int, a: float) -> float:
    """Erlang's C: the chance an arrival waits in an M/M/k queue at offered load a (< k), from Erlang B's recursion
    B(n) = a B(n-1) / (n + a B(n-1)); 0 below a = k - 10 sqrt(k), where it is below 1e-20 (Halfin-Whitt)."""
    if a <= 0 or a < k - 10 * math.sqrt(k):
        return 0.0
    b = 1.0
    for n in range(1, k + 1):
        b = a * b / (n + a * b)
    return k * b / (k - a * (1 - b))


_LOG_MAX_TERM = math.log(1e11)  # beyond, the alternating sum of `wait_quantile` loses its digits


def wait_quantile(rho: float, s: float, q: float) -> float:
    """The q-quantile of the wait in an M/D/1 queue of service s at utilisation rho. Erlang's distribution of it,
    P(W <= u s) = (1 - rho) sum_{k=0}^{floor(u)} (rho (k - u))^k / k! exp(rho (u - k)) (the M/D/1 waiting time; e.g.
    Franx, "A simple solution for the M/D/c waiting time distribution", Oper. Res. Letters 29, 2001), where its
    alternating sum holds its digits; beyond, the Cramer-Lundberg tail of the M/G/1 wait, P(W > t) ~ C exp(-x t / s),
    x > 0 solving rho (e^x - 1) = x, C = (1 - rho) / (rho e^x - 1) (Asmussen, "Applied Probability and Queues",
    XIII.5), within 2% there (rho >= 0.85 at q = 0.99)."""
    if math.isnan(rho) or math.isnan(s):  # a caller's bug: said, not searched for forever
        raise ValueError(f"wait_quantile of an undefined queue: utilisation {rho}, service {s}")
    if rho <= 0 or s <= 0 or q <= 1 - rho:
        return 0.0  # P(W = 0) = 1 - rho
    if rho >= 1:
        return math.inf

    def below(u: float) -> bool | None:  # P(W <= u s) >= q; None where the sum's terms outgrow double precision
        terms = []
        for k in range(int(u) + 1):  # each term in logarithms: k! and x^k alone overflow a double past k ~ 170
            x = rho * (k - u)
            if x == 0:
                terms.append(1.0 if k == 0 else 0.0)
                continue
            log = k * math.log(abs(x)) - math.lgamma(k + 1) + rho * (u - k)
            if log > _LOG_MAX_TERM:
                return None
            terms.append((-1.0 if x < 0 and k % 2 else 1.0) * math.exp(log))
        return (1 - rho) * math.fsum(terms) >= q

    a, b = 0.0, 1.0
    while (ok := below(b)) is False:
        a, b = b, 2 * b
    if ok is None:
        return s * _wait_tail(rho, q)
    for _ in range(60):
        m = 0.5 * (a + b)
        ok = below(m)
        if ok is None:
            return s * _wait_tail(rho, q)
        a, b = (a, m) if ok else (m, b)
    return s * b


def _wait_tail(rho: float, q: float) -> float:
    """`wait_quantile`'s Cramer-Lundberg asymptote, in units of the service time."""
    f = lambda x: rho * math.expm1(x) - x  # noqa: E731  f(0) = 0, f'(0) < 0, convex: one positive root
    a, b = 1e-12, 1.0
    while f(b) < 0:
        a, b = b, 2 * b
    for _ in range(200):
        m = 0.5 * (a + b)
        a, b = (m, b) if f(m) < 0 else (a, m)
    x = 0.5 * (a + b)
    C = min(rho, (1 - rho) / (rho * math.exp(x) - 1))
    return max(0.0, math.log(C / (1 - q)) / x)


def tail_concurrency(c: float, dp: int, q: float) -> float:
    """The q-quantile of the mean in-flight count a request sees over its life under Poisson arrivals with c in flight
    on average over `dp` ranks (module docstring): each rank's count Poisson with mean c / dp, its mean over a life of
    fixed length T of variance (2/3) c / dp (the count's autocovariance (c / dp)(1 - u / T) averaged over the
    life), normal at the quantile; as a total over the ranks."""
    z = statistics.NormalDist().inv_cdf(q)
    return max(0.0, c + dp * z * math.sqrt(2 * c / dp / 3))
