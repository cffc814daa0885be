"""Planner tests for the recovery paths (`meshlm.planner.recovery`): the time a failure costs and the goodput of
restarting from storage, restarting from in-memory checkpoints, and torchft replica groups; semi-synchronous
groups' synchronisation; and what `meshlm plan estimate` prints of them (text and JSON)."""

from __future__ import annotations

import json

import pytest

from test_planner import _cli

# A small case worked by hand: MTBF 10,000 s, 1 s steps, a storage checkpoint written in 50 s, 10 GB of state per
# GPU copied to host memory at 100 GB/s (0.1 s) and to a peer at 25 GB/s (0.4 s), a 100 s restart, 4 groups.
CASE = dict(mtbf_s=10_000.0, step_s=1.0, storage_write_s=50.0, state_bytes=10e9, host_bw=100e9, peer_bw=25e9,
            restart_s=100.0, groups=4)
LLAMA = ["plan", "estimate", "--model", "llama3-70b", "--cluster", "h100", "--global-batch-tokens", "16M"]


def test_each_path_loses_what_the_hand_computation_says():
    from meshlm.planner.recovery import recovery_paths

    r = recovery_paths(**CASE)
    s, m, g = r["recovery"]["storage"], r["recovery"]["memory"], r["recovery"]["replica"]
    # storage: tau = sqrt(2 x 50 x 10,000) - 50 = 950 s; lost = (950 + 50) / 2 + 100 + 50 (read) = 650 s;
    # waste = 50 / 950 + 650 / 10,000
    assert s["checkpoint_interval_s"] == pytest.approx(950.0)
    assert s["lost_s_per_failure"] == pytest.approx(650.0)
    assert s["goodput"] == pytest.approx(1 - (50 / 950 + 0.065))
    # memory: write 0.1 + 0.4 = 0.5 s; tau = sqrt(2 x 0.5 x 10,000) - 0.5 = 99.5 s; lost = (99.5 + 0.5) / 2 + 100 +
    # 0.4 (the peer's copy back) = 150.4 s; waste = 0.5 / 99.5 + 150.4 / 10,000
    assert m["checkpoint_write_s"] == pytest.approx(0.5) and m["reload_s"] == pytest.approx(0.4)
    assert m["checkpoint_interval_s"] == pytest.approx(99.5)
    assert m["lost_s_per_failure"] == pytest.approx(150.4)
    assert m["goodput"] == pytest.approx(1 - (0.5 / 99.5 + 0.01504))
    # replica: the retried step (1 s) + the failed group's restart and heal (100 + 0.4 s) at 1 / 4 of the job
    assert g["heal_s"] == pytest.approx(0.4)
    assert g["lost_s_per_failure"] == pytest.approx(26.1)
    assert g["goodput"] == pytest.approx(1 - 0.00261)
    assert r["goodput_by_recovery"] == pytest.approx({"storage": 0.8823684, "memory": 0.9799349, "replica": 0.99739})
    assert r["lost_s_per_failure"] == pytest.approx({"storage": 650.0, "memory": 150.4, "replica": 26.1})
    assert r["configured_recovery"] == "storage" and r["state_gb_per_gpu"] == pytest.approx(10.0)


def test_replica_needs_two_groups_and_bad_inputs_are_refused():
    from meshlm.planner.recovery import recovery_paths

    one = recovery_paths(**{**CASE, "groups": 1})
    assert one["recovery"]["replica"] is None and one["goodput_by_recovery"]["replica"] is None
    with pytest.raises(ValueError, match="at least 2 replica groups"):
        recovery_paths(**{**CASE, "groups": 1}, configured="replica")
    with pytest.raises(ValueError, match="must be one of storage, memory, replica"):
        recovery_paths(**CASE, configured="disk")
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        recovery_paths(**{**CASE, "peer_bw": 0.0})


@pytest.mark.parametrize("mtbf_h", [0.5, 3.0, 50.0, 1000.0])
@pytest.mark.parametrize("groups", [2, 8, 64])
def test_replica_beats_memory_beats_storage(mtbf_h, groups):
    """Same failures and restart: a replica group's recovery costs the job least, then a restart from host memory
    (a shorter interval and a faster reload), then one from storage."""
    from meshlm.planner.recovery import recovery_paths

    for write in (5.0, 120.0):
        r = recovery_paths(**{**CASE, "mtbf_s": mtbf_h * 3600, "storage_write_s": write, "groups": groups,
                              "step_s": 5.0, "restart_s": 600.0})
        g, lost = r["goodput_by_recovery"], r["lost_s_per_failure"]
        assert g["replica"] >= g["memory"] >= g["storage"], (mtbf_h, groups, write, g)
        assert lost["replica"] < lost["memory"] < lost["storage"]
    # more groups: the failed one is a smaller share of the job
    few = recovery_paths(**{**CASE, "groups": 2})["lost_s_per_failure"]["replica"]
    many = recovery_paths(**{**CASE, "groups": 8})["lost_s_per_failure"]["replica"]
    assert few == pytest.approx(1 + 100.4 / 2) and many == pytest.approx(1 + 100.4 / 8)


def test_default_groups_follow_the_layout():
    from meshlm.planner.layout import Layout
    from meshlm.planner.recovery import default_groups

    assert default_groups(Layout(dp_replicate=4, dp_shard=2, zero_stage=1)) == 4
    assert default_groups(Layout(dp_shard=8, zero_stage=0)) == 8
    assert default_groups(Layout(dp_shard=8, zero_stage=1)) == 1


def test_cli_estimate_json_reports_every_path_and_marks_the_configured_one(capsys):
    gpus = ["--gpus", "1024", "--layout", "tp=8,pp=4,dp_replicate=8,dp_shard=4,zero_stage=1"]
    rc, out = _cli([*LLAMA, *gpus, "--json"], capsys)
    assert rc == 0
    f = json.loads(out)["failures"]
    assert f["configured_recovery"] == "storage"
    assert set(f["goodput_by_recovery"]) == set(f["lost_s_per_failure"]) == {"storage", "memory", "replica"}
    assert f["goodput"] == f["goodput_by_recovery"]["storage"]
    assert f["recovery"]["replica"]["groups"] == 8  # the layout's dp_replicate
    # the storage path is the Young/Daly figure the JSON always had: restart_s there counts the read back
    assert f["recovery"]["storage"]["restart_s"] + f["checkpoint_write_s"] == pytest.approx(f["restart_s"])
    g = f["goodput_by_recovery"]
    assert 0 < g["storage"] <= g["memory"] <= g["replica"] < 1
    rc, out = _cli([*LLAMA, *gpus, "--recovery", "replica", "--replica-groups", "16", "--restart-s", "120",
                    "--json"], capsys)
    f = json.loads(out)["failures"]
    rep = f["recovery"]["replica"]
    assert f["configured_recovery"] == "replica" and f["goodput"] == f["goodput_by_recovery"]["replica"]
    assert rep["groups"] == 16 and rep["restart_s"] == 120.0
    assert rep["lost_s_per_failure"] == pytest.approx(rep["retried_step_s"] + (120.0 + rep["heal_s"]) / 16)
    # the peer copy: a GPU's weights + optimizer state at the h100 preset's scale-out p2p rate, 50 GB/s x 0.8
    assert rep["heal_s"] == pytest.approx(f["state_gb_per_gpu"] * 1e9 / 40e9)


def test_cli_estimate_text_names_each_path(capsys):
    _, out = _cli([*LLAMA, "--gpus", "64", "--layout", "tp=8,pp=4,zero_stage=0", "--recovery", "memory"], capsys)
    line = next(x for x in out.splitlines() if x.startswith("Recovery: "))
    assert "storage " in line and "memory (configured) " in line and "replica " in line and "lost per failure" in line
    rc, out = _cli([*LLAMA, "--gpus", "64", "--layout", "tp=8,pp=4,zero_stage=1"], capsys)
    assert "replica: needs >= 2 replica groups" in out and "storage (configured)" in out


def test_semi_synchronous_groups_price_one_weight_all_reduce_every_h_steps(capsys):
    rc, out = _cli([*LLAMA, "--gpus", "1024", "--layout", "tp=8,pp=4,dp_replicate=8,dp_shard=4,zero_stage=1",
                    "--replica-sync-every", "10", "--json"], capsys)
    d = json.loads(out)
    sync = d["replica_sync"]
    weights = d["memory_gib"]["weights"] * 2**30
    # 8 groups, one rank each on its own node: a ring all-reduce on the scale-out link (40 GB/s, 8 us a hop)
    assert sync["groups"] == 8 and sync["every_steps"] == 10
    assert sync["sync_s"] == pytest.approx(2 * (7 / 8 * weights / 40e9 + 7 * 8e-6))
    assert sync["per_step_s"] == pytest.approx(sync["sync_s"] / 10)
    rc, out = _cli([*LLAMA, "--gpus", "1024", "--layout", "tp=8,pp=4,dp_replicate=8,dp_shard=4,zero_stage=1",
                    "--replica-sync-every", "10"], capsys)
    assert "Semi-synchronous groups" in out
    assert "replica_sync" not in json.loads(_cli([*LLAMA, "--gpus", "64", "--layout", "tp=8,pp=4,zero_stage=1",
                                                  "--json"], capsys)[1])
