"""The load a published serving row was measured under, as its cells state it: the Poisson request rate of a server
row (`request_rate`), the latency limits its throughput was measured within (`latency_targets` -- stated, or, for an
MLPerf round's server or interactive row stating none, its benchmark's rules: `mlperf_targets`) and the percentile they
hold at (`target_percentile`).

Responsible for: reading those from a row's cells. Not responsible for: pricing the row (`published_serving.py`, which
reads them), the queues themselves (`serving_modes.py`, `queues.py`).
"""

from __future__ import annotations

import re

_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:requests|req)\s*/\s*s\b")


def request_rate(row: dict) -> float | None:
    """The Poisson arrival rate, requests/s, a row was measured at ("QPS 2 (2 requests/s)"), from its batching cell;
    None where it states none."""
    m = _RATE.search(row.get("batch_or_concurrency", "").lower())
    return float(m.group(1)) if m else None


_TARGET = re.compile(r"(ttft|tpot|time to first token|time per output token)\s*(?:\(?p\d+(?:\.\d+)?\)?\s*)?"
                     r"(?:<=|≤|=<|<|at most|under|within|target|constraint|slo|limit)\s*(?:of\s*)?:?\s*"
                     r"(\d+(?:\.\d+)?)\s*(ms|s)\b")


def _target_cells(row: dict) -> str:
    """The cells a row states its latency targets in (its batching and notes), lower case."""
    return f"{row.get('batch_or_concurrency', '')} {row.get('notes', '')}".lower()


# MLPerf Inference's server-scenario latency limits by benchmark, ms, (TTFT, TPOT) for the server scenario and for its
# interactive variant (None: the benchmark has none), every one held at the 99th percentile
# (`*.Server.target_latency_percentile = 99`): MLCommons' loadgen/mlperf.conf (mlcommons/inference at b66003e,
# 2026-08), each pair unchanged since the round that added it -- llama2-70b 2024-01, mixtral-8x7b 2024-06,
# llama3.1-405b 2024-12, llama2-70b-interactive 2025-01, deepseek-r1 and llama3.1-8b 2025-06, the 405B and 8B
# interactive ones 2025-07, deepseek-r1-interactive 2025-12, gpt-oss-120b 2026-01. (GPT-J's is a 20 s end-to-end
# latency, not a TTFT / TPOT pair: not read.) Matched on the row's model cell, first pattern first.
MLPERF_SERVER_TARGETS_MS = (  # patterns on the model cell's letters and digits alone ("llama3_1-405b": llama31405b)
    (r"llama270b", (2000, 200), (450, 40)),
    (r"mixtral8x7b", (2000, 200), None),
    (r"llama31?405b", (6000, 175), (4500, 80)),
    (r"llama318b", (2000, 100), (500, 30)),
    (r"deepseekr1", (2000, 80), (1500, 15)),
    (r"gptoss120b", (3000, 80), (2000, 15)),
)
MLPERF_TARGET_PERCENTILE = 99.0


def mlperf_targets(row: dict) -> tuple[float, float] | None:
    """(TTFT, TPOT) in seconds that MLPerf's rules hold a server or interactive row of one of its rounds to (its
    source or notes name MLPerf or MLCommons, who run it), by the benchmark its model cell names
    (`MLPERF_SERVER_TARGETS_MS`; interactive where the scenario or the row's own cells say so -- model, source
    location, notes, batching); None for any other row."""
    scenario = row.get("scenario", "").strip().lower()
    named = " ".join(row.get(k, "") for k in ("source", "source_loc", "notes")).lower()
    if not re.search(r"mlperf|mlcommons", named) or scenario not in ("server", "interactive"):
        return None
    model = re.sub(r"[^a-z0-9]", "", row.get("model", "").lower())
    # the row's own cells, not the source's title (a round's "offline, server and interactive" would name it for all)
    own = " ".join(row.get(k, "") for k in ("model", "source_loc", "notes", "batch_or_concurrency")).lower()
    interactive = scenario == "interactive" or "interactive" in own
    for pattern, server, fast in MLPERF_SERVER_TARGETS_MS:
        if re.search(pattern, model):
            limits = fast if interactive else server
            return None if limits is None else (limits[0] / 1e3, limits[1] / 1e3)
    return None


def _stated_targets(row: dict) -> dict:
    """{"ttft" / "tpot": seconds} for the limits the row's batching and notes cells state (the first of each)."""
    out = {}
    for m in _TARGET.finditer(_target_cells(row)):
        kind = "ttft" if m.group(1) in ("ttft", "time to first token") else "tpot"
        out.setdefault(kind, float(m.group(2)) * (1e-3 if m.group(3) == "ms" else 1.0))
    return out


def latency_targets(row: dict) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) limits in seconds a row says its throughput was measured within ("TTFT p99 <= 2 s", "TPOT < 40
    ms", "TPOT target 200 ms": a serving SLO, as MLPerf's server scenarios set one), from its batching and notes
    cells; a figure without a comparison ("TTFT 120 ms") is a result, not a target. A row stating none from an MLPerf
    round's server or interactive scenario is held to that benchmark's rules (`mlperf_targets`). (None, None) when
    neither names any."""
    stated = _stated_targets(row)
    if not stated and (rules := mlperf_targets(row)) is not None:
        return rules
    return stated.get("ttft"), stated.get("tpot")


_PERCENTILE = re.compile(r"\bp(\d+(?:\.\d+)?)\b|\b(\d+(?:\.\d+)?)(?:st|nd|rd|th)?[ -]percentile")


def target_percentile(row: dict) -> float | None:
    """The percentile a row's latency targets hold at ("TTFT p99 <= 2 s", "99th percentile TPOT < 40 ms": 99), from
    the same cells as `latency_targets`; MLPerf's 99th where its rules set the targets (`mlperf_targets`); None where
    it names none (the targets are then read as on the means)."""
    text = _target_cells(row)
    found = [float(m.group(1) or m.group(2)) for m in _PERCENTILE.finditer(text)]
    stated = next((p for p in found if 0 < p < 100), None)
    if stated is None and not _stated_targets(row) and mlperf_targets(row) is not None:
        return MLPERF_TARGET_PERCENTILE
    return stated
