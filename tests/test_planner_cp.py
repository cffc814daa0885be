"""The planner under context parallelism: every method (parallel.cp_method = ring | allgather | ulysses).

Measured against a real run: two gloo ranks run meshlm's model under cp=2 (`apply_context_parallel`,
each rank its two chunks of every sequence and their true positions) and count, with
`SavedTensorMeter`, the bytes autograd keeps per layer (3 layers minus 1, halved: the embedding,
head, loss and RoPE tables cancel), and with `CommStats` the bytes sent on the "cp" axis in one
forward and backward. The planner's eager activation count (`Job(fused_elementwise=False)`, fp32) and
its `cp_comm_bytes` must equal them exactly, for recompute none, selective and full, for models whose
kv heads are half, a quarter of and as many as the query heads (the methods keep K/V at different
head counts, so only a spread of shapes tells the counts apart); "usp2" is the hybrid with
cp_ulysses=2 (at cp=2 a ring of one: the all-to-alls and what the hybrid keeps, not its ring steps).

And the arithmetic: layout parsing and validation, the time model's collectives, and that the search
tries every method, the all-gather beating the ring at short sequences and the ring it at long ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist import run_distributed
from meshlm.config import ModelConfig
from meshlm.planner import cost, estimate, plan
from meshlm.planner.cluster import get_cluster
from meshlm.planner.cost import Job, Layout, parse_layout

BASE = dict(vocab_size=256, hidden_size=32, num_heads=4, intermediate_size=64, max_seq_len=64)
KV_HEADS = (2, 1, 4)  # GQA 2:1, 4:1, and plain multi-head attention
METHODS = ("ring", "allgather", "ulysses")
RECOMPUTE = ("none", "selective", "full")
BATCH, SEQ, CP = 2, 16, 2  # seq / cp = 8 tokens per rank, 2 chunks of 4


def _model_cfg(kv_heads: int, layers: int) -> ModelConfig:
    return ModelConfig(**BASE, num_kv_heads=kv_heads, num_layers=layers)


def cp_count_worker(rank, world_size):
    from meshlm.comm_stats import CommStats
    from meshlm.mesh import ParallelDims, build_mesh
    from meshlm.models.transformer import build_model
    from meshlm.parallel.context import apply_context_parallel
    from meshlm.parallel.recompute import SavedTensorMeter, apply_recompute

    stats = CommStats()
    mesh = build_mesh(ParallelDims(cp=CP), device_type="cpu", stats=stats)
    tokens = torch.randint(0, BASE["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for kv in KV_HEADS:
        for method in (*METHODS, "usp2"):
            for rc in RECOMPUTE:
                saved, sent = {}, {}
                for layers in (1, 3):
                    model = build_model(_model_cfg(kv, layers), seed=0)
                    handle = apply_context_parallel(model, mesh, method=method if method != "usp2" else "ring",
                                                    ulysses=2 if method == "usp2" else 1)
                    apply_recompute(model, rc)
                    inputs, targets = handle.shard(tokens[:, :-1]), handle.shard(tokens[:, 1:])
                    stats.reset()
                    with SavedTensorMeter(model) as meter:
                        logits = model(inputs, positions=handle.positions(SEQ))
                        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                    loss.backward()
                    saved[layers] = meter.bytes
                    # what one rank sends: every collective's bytes, less the ring's receives (they mirror
                    # the sends), as Estimate.cp_comm_bytes counts
                    sent[layers] = sum(stats.total(axis=a).bytes - stats.total(op="recv", axis=a).bytes
                                       for a in ("cp", "cp_ulysses", "cp_ring"))
                out[(kv, method, rc)] = {"per_layer": (saved[3] - saved[1]) / 2, "cp_bytes_3_layers": sent[3],
                                         "cp_bytes_per_layer": (sent[3] - sent[1]) / 2}
    return out


def _planner(kv: int, method: str, rc: str, layers: int) -> cost.Estimate:
    job = Job(seq_len=SEQ, global_batch_size=BATCH, precision="fp32", fused_elementwise=False, runtime="meshlm")
    hybrid = dict(cp_method="ring", cp_ulysses=2) if method == "usp2" else dict(cp_method=method)
    layout = Layout(cp=CP, **hybrid, recompute=rc, micro_batch_size=BATCH)
    return cost.estimate(_model_cfg(kv, layers), get_cluster("a100"), job, layout, gpus=CP)


def _predicted_per_layer_bytes(kv: int, method: str, rc: str) -> float:
    """Per layer from the planner's own total: activations grow by 2 layers' worth from 1 to 3 layers."""
    act = {n: _planner(kv, method, rc, n).memory_gib["activations"] * 2**30 for n in (1, 3)}
    return (act[3] - act[1]) / 2


@pytest.fixture(scope="module")
def measured():
    results = run_distributed(cp_count_worker, CP, timeout=180)
    assert results[0] == results[1]  # the load-balanced split: both ranks keep and send the same
    return results[0]


def test_activation_bytes_under_cp_equal_the_planners_exactly(measured):
    rows = []
    for (kv, method, rc), got in sorted(measured.items()):
        want = _predicted_per_layer_bytes(kv, method, rc)
        rows.append((kv, method, rc, got["per_layer"], want))
        # exact: the planner's float total (GiB) differs from an integer byte count by rounding alone
        assert got["per_layer"] == round(want), (kv, method, rc, got["per_layer"], want)
    print("\nkv_heads method    recompute measured planner (bytes per layer, cp=2, 2x16 tokens, fp32)")
    for row in rows:
        print(f"  {row[0]:>6} {row[1]:<9} {row[2]:<9} {row[3]:>8.0f} {row[4]:>8.0f}")
    # the methods really differ as the planner says: per local token the all-gather keeps the whole
    # sequence's K/V at the kv heads (2 kv_dim cp) where the ring keeps this rank's (2 kv_dim); no mask
    q_dim, tokens = BASE["hidden_size"], BATCH * SEQ // CP
    for kv in KV_HEADS:
        kv_dim = q_dim // BASE["num_heads"] * kv
        ring, ag = measured[(kv, "ring", "none")]["per_layer"], measured[(kv, "allgather", "none")]["per_layer"]
        assert ag - ring == 4 * (2 * kv_dim * CP - 2 * kv_dim) * tokens, kv
    # recomputing the core (selective) keeps the same whatever the method, as without cp
    for kv in KV_HEADS:
        assert measured[(kv, "ring", "selective")]["per_layer"] == measured[(kv, "allgather", "selective")]["per_layer"]


def test_cp_comm_bytes_equal_what_commstats_counts(measured):
    for (kv, method, rc), got in measured.items():
        est = _planner(kv, method, rc, 3)
        assert est.cp_comm_bytes == got["cp_bytes_3_layers"], (kv, method, rc, est.cp_comm_bytes, got)
        assert got["cp_bytes_3_layers"] == 3 * got["cp_bytes_per_layer"]  # nothing outside the layers


def test_layout_cp_method_parse_validate_and_short():
    lo = parse_layout("cp=2,cp_method=allgather", gpus=8)
    assert (lo.cp, lo.cp_method, lo.dp_shard) == (2, "allgather", 4)
    assert "cp2ag" in lo.short().split()
    assert "cp2" in parse_layout("cp=2", gpus=8).short().split()  # ring: the default, unmarked
    assert parse_layout("cp=2", gpus=8).cp_method == "ring"
    lo = parse_layout("cp=4,cp_method=ulysses", gpus=8)
    assert "cp4u" in lo.short().split()
    assert "cp4u2" in parse_layout("cp=4,cp_ulysses=2", gpus=8).short().split()
    with pytest.raises(ValueError, match=r"cp_ulysses=2 with parallel.cp_method='allgather': the hybrid.*cp_method=ring"):
        estimate("llama3-8b", "h100", gpus=8, layout="cp=4,cp_ulysses=2,cp_method=allgather", seq_len=8192,
                 global_batch_size=2)
    with pytest.raises(ValueError, match=r"cp_method=ulysses, parallel.cp=3 with model.num_heads=32 / parallel.tp=2 = 16 per tp rank"):
        estimate("llama3-8b", "h100", gpus=6, layout="cp=3,tp=2,cp_method=ulysses", seq_len=8196, global_batch_size=1)
    with pytest.raises(ValueError, match=r"cp_method='alltoall'.*ring.*allgather.*ulysses"):
        estimate("llama3-8b", "h100", gpus=8, layout="cp=2,cp_method=alltoall", seq_len=8192, global_batch_size=8)


def _cp_est(method: str, *, seq: int, gpus: int = 8, cp: int = 4, rc: str = "none", cluster: str = "h100"):
    return estimate("llama3-8b", cluster, gpus=gpus, layout=f"cp={cp},cp_method={method},zero_stage=3,recompute={rc}",
                    seq_len=seq, global_batch_size=gpus // cp)


def test_allgather_time_is_one_exposed_all_gather_and_reduce_scatter_per_layer():
    cfg = ModelConfig.from_preset("llama3-8b")
    clu = get_cluster("h100")
    seq, cp = 8192, 4
    kv_pair = seq / cp * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K + V of one rank, bf16
    span = cost.group_span(1, cp, clu.scaleup_size)
    per_layer = {rc: (n_ag * cost.collective_time("all_gather", cp * kv_pair, span, clu)
                      + cost.collective_time("reduce_scatter", cp * kv_pair, span, clu))
                 for rc, n_ag in (("none", 1), ("selective", 2), ("full", 2))}
    for rc, t in per_layer.items():
        est = _cp_est("allgather", seq=seq, cp=cp, rc=rc)
        assert est.time_s["cp_comm"] == pytest.approx(est.num_microbatches * cfg.num_layers * t, rel=1e-12), rc
        # the volumes: forward cp blocks of K+V gathered (again when recomputed), backward cp blocks reduced
        n_ag = 2 if rc != "none" else 1
        assert est.cp_comm_bytes == est.num_microbatches * cfg.num_layers * (n_ag + 1) * cp * kv_pair
        ring = _cp_est("ring", seq=seq, cp=cp, rc=rc)
        # ring: (cp - 1) blocks of K+V forward (again when recomputed), backward K+V and dK+dV in fp32
        assert ring.cp_comm_bytes == ring.num_microbatches * cfg.num_layers * (cp - 1) * (n_ag * kv_pair + 3 * kv_pair)


def test_ulysses_time_is_its_exposed_all_to_alls_and_bytes_the_docstrings():
    cfg = ModelConfig.from_preset("llama3-8b")  # 32 heads, 8 kv heads
    clu = get_cluster("h100")
    seq, cp = 8192, 16  # kv heads replicated to lcm(8, 16) = 16
    head = seq / cp * cfg.head_dim * 2  # one head of one rank's tokens, bf16
    qkv, out = head * (32 + 2 * 16), head * 32
    span = cost.group_span(1, cp, clu.scaleup_size)
    t_qkv, t_out = (cost.collective_time("all_to_all", n, span, clu) for n in (qkv, out))
    for rc, n_qkv, n_out in (("none", 2, 2), ("selective", 3, 2), ("full", 3, 3)):
        est = _cp_est("ulysses", seq=seq, gpus=16, cp=cp, rc=rc)
        per_step = est.num_microbatches * cfg.num_layers
        assert est.time_s["cp_comm"] == pytest.approx(per_step * (n_qkv * t_qkv + n_out * t_out), rel=1e-12), rc
        assert est.cp_comm_bytes == per_step * (n_qkv * qkv + n_out * out), rc


def test_hybrid_bytes_are_ulysses_in_its_groups_and_the_ring_across_them():
    cfg = ModelConfig.from_preset("llama3-8b")  # 32 heads, 8 kv heads
    seq, cp, u = 8192, 8, 4  # kv heads as they are (lcm(8, 4) = 8), a ring of 2 groups
    head = seq / cp * cfg.head_dim * 2  # one head of one rank's tokens, bf16
    a2a = head * (32 + 2 * 8) + head * 32
    kv_pair = 2 * head * 8  # the group's 4 x seq / cp tokens at 8 / 4 kv heads, K + V
    est = estimate("llama3-8b", "h100", gpus=8, layout=f"cp={cp},cp_ulysses={u},zero_stage=3", seq_len=seq,
                   global_batch_size=1)
    per_step = est.num_microbatches * cfg.num_layers
    # all-to-alls forward and backward; one ring step: K+V forward, K+V and dK+dV (fp32) backward
    assert est.cp_comm_bytes == per_step * (2 * a2a + (cp // u - 1) * (kv_pair + kv_pair + 2 * kv_pair))


def test_short_sequences_favour_the_all_gather_and_long_ones_the_ring():
    short = {m: _cp_est(m, seq=8192) for m in METHODS}
    assert short["allgather"].time_s["cp_comm"] < short["ring"].time_s["cp_comm"]
    assert short["allgather"].time_s["step"] < short["ring"].time_s["step"]
    long = {m: _cp_est(m, seq=131072, gpus=16, cp=8, cluster="h200") for m in METHODS}
    # the all-gather keeps the whole sequence's K/V (kv heads) per layer where the ring keeps 1/cp of it
    assert long["allgather"].memory_gib["activations"] > long["ring"].memory_gib["activations"]
    print("\n128K over cp=8, activations GiB: ring", round(long["ring"].memory_gib["activations"], 1),
          "allgather", round(long["allgather"].memory_gib["activations"], 1))
    # across nodes (tp=8 fills a node, cp=2 spans two) time alone tells them apart: the all-gather's
    # exposed transfer grows with the sequence, the ring's hides behind attention that grows faster
    across = {(seq, m): estimate("llama3-8b", "h100", gpus=16, layout=f"tp=8,cp=2,cp_method={m},zero_stage=1",
                                 seq_len=seq, global_batch_size=8).time_s["cp_comm"]
              for seq in (8192, 32768) for m in METHODS}
    assert across[(8192, "allgather")] < across[(8192, "ring")]
    assert across[(32768, "ring")] < across[(32768, "allgather")]


def test_search_tries_every_method_and_picks_by_sequence_length():
    short = plan("llama3-8b", "h100", gpus=16, seq_len=8192, global_batch_tokens="1M", top=0)
    cp_layouts = [e.layout for e in short.ranked if e.layout.cp > 1]
    assert {lo.cp_method for lo in cp_layouts} == set(METHODS)
    # the fastest layout with cp > 1 is not the ring: one collective beats cp - 1 short steps at 8K (Ulysses
    # also attends in one kernel over the whole sequence, beyond the all-gather's short chunk pairs)
    assert cp_layouts[0].cp_method == "ulysses"
    best = {m: next(lo for lo in cp_layouts if lo.cp_method == m) for m in METHODS}
    assert [lo.cp for lo in best.values()] == [2, 2, 2]
    long = plan("llama3-8b", "h100", gpus=64, seq_len=131072, global_batch_tokens="4M", top=1)
    # at 128K context parallelism wins; with the all-gather's K/V linear in the sequence (no mask) either
    # method can (Llama 3 trained its long-context stage with the all-gather)
    assert long.ranked[0].layout.cp > 1
