"""DeepSpeed's pipeline engine's sends as the planner prices them (`timing.pp_p2p_time`): each send and receive a
blocking transfer of its own (`Job.pp_p2p_serial`), and under tensor parallelism each tp rank's 1/tp slice sent and
all-gathered by the receiving stage (`Job.pp_partitioned_sends`). Arithmetic only: no ranks are started."""

from __future__ import annotations

import pytest

from meshlm.planner.cluster import get_cluster, with_overrides
from meshlm.planner.collectives import collective_time
from meshlm.planner.cost import Job, Layout, estimate

from test_planner_stacks import _row  # a published-run row with every column
from test_planner_training_kinds import _gpt


def test_serial_pipeline_transfers_cost_an_interior_stage_two_more_per_micro_batch():
    """DeepSpeed's engine (`Job.pp_p2p_serial`): each send and receive blocks on its own, so an interior stage
    waits for four transfers per micro-batch where Megatron's paired ones cost two; with 1 s per message across
    nodes (one pipeline stage per node) and a tiny model, the pipeline's p2p time grows by between m x (pair - 1 s)
    and m x pair, pair being the two-message cost the paired schedule charges per micro-batch. With two stages
    there is no interior stage: nothing changes."""
    cfg = _gpt(layers=8, hidden=512)
    base = get_cluster("a100")
    slow = with_overrides(base, scaleout_latency=base.scaleout_latency + 1.0)
    lo = Layout(tp=8, pp=4, dp_shard=1, micro_batch_size=1, pp_split="uniform", recompute="none")
    est = {x: estimate(cfg, slow, Job(seq_len=512, global_batch_size=16, pp_p2p_serial=x), lo, gpus=32)
           for x in (False, True)}
    m = est[False].num_microbatches
    assert m == 16
    pair = 2 * collective_time("p2p", 512 * 512 * 2, (1, 2), slow)  # one activation message each way
    diff = est[True].time_s["pp_p2p"] - est[False].time_s["pp_p2p"]
    assert m * (pair - 1.0) <= diff <= m * pair + 1e-9
    two = Layout(tp=8, pp=2, dp_shard=1, micro_batch_size=1, pp_split="uniform", recompute="none")
    t2 = [estimate(cfg, slow, Job(seq_len=512, global_batch_size=16, pp_p2p_serial=x), two, gpus=16).time_s["pp_p2p"]
          for x in (False, True)]
    assert t2[0] == t2[1]


def test_partitioned_sends_move_a_tp_slice_and_gather_it_on_the_receiving_stage():
    """DeepSpeed's engine under tp (runtime/pipe/engine.py: `is_pipe_partitioned` / `is_grad_partitioned` with model
    parallelism, a PartitionedTensor sent and `.full()` on receipt): per micro-batch and stage pair, two sends of the
    activation's 1/tp slice across nodes and two all-gathers of the whole activation over the tp ranks in the node,
    over the (m + pp - 1) slots of the paired schedule -- exactly; nothing changes without tp, or where sequence
    parallelism (the Layout's default) already sends the slice. A published row of DeepSpeed's pipeline engine (GPT-NeoX, BLOOM, vTrain's
    Megatron-DeepSpeed) is read so; a Megatron-LM row is not."""
    from meshlm.planner.published import job_of
    from meshlm.planner.published_rows import model_of

    cfg, a100 = _gpt(layers=8, hidden=512), get_cluster("a100")
    lo = Layout(tp=8, pp=4, dp_shard=1, micro_batch_size=2, pp_split="uniform", recompute="none",
                sequence_parallel=False)
    est = {x: estimate(cfg, a100, Job(seq_len=512, global_batch_size=16, pp_partitioned_sends=x), lo, gpus=32)
           for x in (False, True)}
    m, act = est[True].num_microbatches, 2 * 512 * 512 * 2  # micro-batch x seq x hidden x bf16
    full = 2 * collective_time("p2p", act, (1, 2), a100)  # one stage per 8-GPU node: both sends cross
    part = 2 * collective_time("p2p", act / 8, (1, 2), a100) + 2 * collective_time("all_gather", act, (8, 1), a100)
    assert est[False].time_s["pp_p2p"] == pytest.approx((m + 3) * full, rel=1e-12)
    assert est[True].time_s["pp_p2p"] == pytest.approx((m + 3) * part, rel=1e-12)
    assert part < full
    for other in (Layout(tp=1, pp=4, dp_shard=8, micro_batch_size=2, pp_split="uniform", recompute="none"),
                  Layout(tp=8, pp=4, dp_shard=1, micro_batch_size=2, pp_split="uniform", recompute="none")):
        same = [estimate(cfg, a100, Job(seq_len=512, global_batch_size=16, pp_partitioned_sends=x), other,
                         gpus=32).time_s["pp_p2p"] for x in (False, True)]
        assert same[0] == same[1]
    assert Job(seq_len=512, global_batch_size=16).pp_partitioned_sends is False  # meshlm's, Megatron's: whole tensors
    neox = _row(model="GPT-NeoX-20B", layers="44", hidden="6144", heads="64", ffn="24576", vocab="50432",
                n_gpus="96", tp="2", pp="4", dp="12", gbs_seqs="1536", mbs="4", recompute="full", precision="fp16",
                source="Black et al. 2022, GPT-NeoX-20B (gpt-neox, DeepSpeed's pipeline engine)")
    assert job_of(neox, model_of(neox)).pp_partitioned_sends
    megatron = {**neox, "source": "NVIDIA Megatron-LM (2023)", "model": "GPT 20B"}
    assert not job_of(megatron, model_of(megatron)).pp_partitioned_sends
