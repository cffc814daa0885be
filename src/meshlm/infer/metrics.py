"""The server's /metrics in Prometheus' text format: the engine's counters and gauges, and the server's histograms.

Responsible for: `Histogram` (cumulative buckets, sum, count) and `metrics_text` (every counter of an
`async_engine.AsyncEngine`: the engine's stats, requests by finish reason, retrieval, KV blocks per cp rank,
communication by mesh axis, disaggregated KV transfers, TTFT and TPOT histograms).
Not responsible for: serving the route (`server.create_app`) or the router's own metrics (`replicas.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlm.infer.async_engine import AsyncEngine


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return lines


def metrics_text(engine: "AsyncEngine") -> str:
    """GET /metrics: the engine's counters and the server's histograms in Prometheus' text format."""
    s = engine.stats()
    lines = []
    rows = [
        ("meshlm_requests_running", "num_running", "requests being processed", "gauge"),
        ("meshlm_requests_waiting", "num_waiting", "requests waiting for admission", "gauge"),
        ("meshlm_kv_blocks_used", "kv_blocks_used", "KV cache blocks in use", "gauge"),
        ("meshlm_kv_blocks_free", "kv_blocks_free", "KV cache blocks free", "gauge"),
        ("meshlm_prefix_cache_hit_rate", "prefix_cache_hit_rate", "prompt tokens found in the prefix cache / queried", "gauge"),
        ("meshlm_prefix_cache_queried_tokens_total", "prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache", "counter"),
        ("meshlm_prefix_cache_hit_tokens_total", "prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", "counter"),
        ("meshlm_kv_host_hit_tokens_total", "kv_host_hit_tokens", "prompt tokens whose KV blocks came back from the "
         "host memory tier", "counter"),
        ("meshlm_kv_disk_hit_tokens_total", "kv_disk_hit_tokens", "prompt tokens whose KV blocks came back from the "
         "disk tier", "counter"),
        ("meshlm_kv_recomputed_tokens_total", "kv_recomputed_tokens", "prompt tokens found in no KV tier (computed)",
         "counter"),
        ("meshlm_kv_host_blocks", "kv_host_blocks", "KV blocks held in the host memory tier", "gauge"),
        ("meshlm_kv_disk_blocks", "kv_disk_blocks", "KV blocks held in the disk tier", "gauge"),
        ("meshlm_kv_disk_failed_loads_total", "kv_disk_failed_loads", "disk tier files that did not check out "
         "(truncated, corrupted, missing; their tokens recomputed)", "counter"),
        ("meshlm_generated_tokens_total", "generated_tokens", "tokens generated", "counter"),
        ("meshlm_preemptions_total", "num_preemptions", "requests preempted (recomputed later)", "counter"),
        ("meshlm_spec_proposed_tokens_total", "spec_proposed_tokens", "tokens proposed by speculative decoding and "
         "verified by the model", "counter"),
        ("meshlm_spec_accepted_tokens_total", "spec_accepted_tokens", "proposed tokens the model accepted", "counter"),
        ("meshlm_spec_acceptance_rate", "spec_acceptance_rate", "accepted / proposed tokens", "gauge"),
        ("meshlm_spec_tokens_per_target_forward", "tokens_per_target_forward", "tokens a sequence emits per forward "
         "of the model that samples it (1 without speculative decoding)", "gauge"),
        ("meshlm_spec_draft_forwards_total", "spec_draft_forwards", "batched forwards of the draft model", "counter"),
    ]
    if "kv_transfers" in s:  # disaggregated prefill and decode (infer/disaggregated.py)
        rows += [
            ("meshlm_kv_transfers_total", "kv_transfers", "KV transfers from the prefill to the decode instance",
             "counter"),
            ("meshlm_kv_transferred_tokens_total", "kv_transferred_tokens", "tokens whose KV the prefill instance "
             "sent to the decode instance", "counter"),
            ("meshlm_kv_transferred_bytes_total", "kv_transferred_bytes", "bytes of keys and values the prefill "
             "instance's ranks sent to the decode instance's", "counter"),
            ("meshlm_kv_transfer_skipped_tokens_total", "kv_transfer_skipped_tokens", "tokens handed to the decode "
             "instance whose KV its prefix cache held (not sent)", "counter"),
            ("meshlm_kv_transfer_seconds_total", "kv_transfer_seconds", "seconds spent in KV transfers", "counter"),
        ]
    for name, key, help_text, kind in rows:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {s[key]}"]
    lines += ["# HELP meshlm_requests_total requests accepted", "# TYPE meshlm_requests_total counter",
              f"meshlm_requests_total {engine.num_requests}"]
    lines += ["# HELP meshlm_requests_finished_total sequences finished, by reason (abort: the client left "
              "or the request was cancelled; error: this sequence failed alone)",
              "# TYPE meshlm_requests_finished_total counter"]
    reasons = {"stop": 0, "length": 0, "abort": 0, "error": 0, **s["finish_reasons"]}
    lines += [f'meshlm_requests_finished_total{{reason="{r}"}} {c}' for r, c in sorted(reasons.items())]
    lines += engine.rag_latency.render("meshlm_rag_retrieval_seconds", "time to retrieve passages for a prompt")
    lines += engine.rag_tokens.render("meshlm_rag_retrieved_tokens", "tokens of retrieved passages put before a prompt")
    rag_rate = engine.rag_cached_tokens / engine.rag_prompt_tokens if engine.rag_prompt_tokens else 0.0
    lines += ["# HELP meshlm_rag_prefix_cache_hit_rate prompt tokens of retrieval-augmented requests found in "
              "the prefix cache / their prompt tokens", "# TYPE meshlm_rag_prefix_cache_hit_rate gauge",
              f"meshlm_rag_prefix_cache_hit_rate {rag_rate}",
              "# HELP meshlm_rag_prefix_cache_hit_tokens_total prompt tokens of retrieval-augmented requests "
              "found in the prefix cache", "# TYPE meshlm_rag_prefix_cache_hit_tokens_total counter",
              f"meshlm_rag_prefix_cache_hit_tokens_total {engine.rag_cached_tokens}"]
    for kind in ("used", "free"):
        lines += [f"# HELP meshlm_kv_blocks_{kind}_per_rank KV cache blocks {kind.replace('used', 'in use')} on "
                  "each context-parallel rank", f"# TYPE meshlm_kv_blocks_{kind}_per_rank gauge"]
        lines += [f'meshlm_kv_blocks_{kind}_per_rank{{cp_rank="{r}"}} {n}'
                  for r, n in enumerate(s[f"kv_blocks_{kind}_per_rank"])]
    for unit, key, help_text in (("bytes", "bytes", "bytes moved by collectives"),
                                 ("seconds", "seconds", "seconds spent waiting in collectives")):
        lines += [f"# HELP meshlm_comm_{unit}_total {help_text} (rank 0), by mesh axis",
                  f"# TYPE meshlm_comm_{unit}_total counter"]
        lines += [f'meshlm_comm_{unit}_total{{axis="{a}"}} {c[key]}' for a, c in sorted(s["comm"].items())]
    lines += ["# HELP meshlm_comm_calls_per_token collective calls per generated token (rank 0), by mesh axis",
              "# TYPE meshlm_comm_calls_per_token gauge"]
    lines += [f'meshlm_comm_calls_per_token{{axis="{a}"}} {c}' for a, c in sorted(s["comm_calls_per_token"].items())]
    lines += engine.ttft.render("meshlm_time_to_first_token_seconds", "time from request to first token")
    lines += engine.tpot.render("meshlm_time_per_output_token_seconds", "mean time between output tokens of a request")
    return "\n".join(lines) + "\n"
