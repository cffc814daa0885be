"""ParallelDims validation, the pure rank layout, and the torch groups of a real 4-rank mesh."""

import pytest
import torch

from dist import run_distributed
from meshlm import comm
from meshlm.config import ParallelConfig
from meshlm.mesh import ALL_AXES, AXES, ParallelDims, build_mesh, group_ranks, rank_coords


def test_dp_shard_takes_the_rest():
    assert ParallelDims(tp=2, pp=2).resolve(16).dp_shard == 4
    assert ParallelDims(tp=2, dp_replicate=2, cp=2).resolve(8).dp_shard == 1
    assert ParallelDims(dp_shard=4).resolve(4) == ParallelDims(dp_shard=4)
    assert ParallelDims.from_config(ParallelConfig(tp=2, ep=2)).resolve(4) == ParallelDims(tp=2, ep=2, dp_shard=2)


def test_errors_name_the_numbers_and_a_fix():
    with pytest.raises(ValueError, match=r"tp=3 = 3 does not divide world size 4; choose tp in \{1,2,4\}"):
        ParallelDims(tp=3).resolve(4)
    with pytest.raises(ValueError, match=r"pp=2 x .* x tp=4 = 8 does not divide world size 12; "
                                         r"choose tp in \{1,2,3,6\} or choose pp in \{1,3\}"):
        ParallelDims(pp=2, tp=4).resolve(12)
    with pytest.raises(ValueError, match=r"dp_shard=2 .* = 2 != world size 4; choose dp_shard in \{4\}.*dp_shard=-1"):
        ParallelDims(dp_shard=2).resolve(4)
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp_shard x cp = 2 x 2 = 4.*choose ep in \{1,2,4\}"):
        ParallelDims(cp=2, ep=3).resolve(4)
    with pytest.raises(ValueError, match="tp=0 must be an integer >= 1"):
        ParallelDims(tp=0).resolve(4)
    with pytest.raises(ValueError, match="dp_shard=0"):
        ParallelDims(dp_shard=0).resolve(4)
    with pytest.raises(ValueError, match="resolve"):
        rank_coords(ParallelDims(), 0)
    with pytest.raises(ValueError, match="axis='ep'"):
        ParallelDims(dp_shard=2).degree("ep")


def test_rank_order_tp_innermost_pp_outermost():
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2).resolve(32)
    assert rank_coords(dims, 0) == dict.fromkeys(ALL_AXES, 0)
    assert rank_coords(dims, 1)["tp"] == 1 and rank_coords(dims, 2)["cp"] == 1
    assert rank_coords(dims, 4)["dp_shard"] == 1 and rank_coords(dims, 8)["dp_replicate"] == 1
    assert rank_coords(dims, 16)["pp"] == 1
    c = rank_coords(dims, 31)
    assert c == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "dp": 3, "dp_cp": 7,
                 "dp_shard_cp": 3}
    assert group_ranks(dims, 5, "tp") == [4, 5]
    assert group_ranks(dims, 5, "pp") == [5, 21]
    assert group_ranks(dims, 5, "dp") == [1, 5, 9, 13]
    assert group_ranks(dims, 5, "dp_cp") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert group_ranks(dims, 5, "dp_shard_cp") == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="outside"):
        rank_coords(dims, 32)


@pytest.mark.parametrize("degrees", [(1, 1, 4, 1, 2), (2, 3, 1, 2, 1), (3, 1, 2, 2, 2)])
def test_groups_partition_the_world(degrees):
    dims = ParallelDims(**dict(zip(AXES, degrees))).resolve(int(torch.tensor(degrees).prod()))
    for axis in ALL_AXES:
        groups = {tuple(group_ranks(dims, r, axis)) for r in range(dims.world_size)}
        members = sorted(r for g in groups for r in g)
        assert members == list(range(dims.world_size)), axis
        for g in groups:
            assert [rank_coords(dims, r)[axis] for r in g] == list(range(dims.degree(axis)))
            others = {a: {rank_coords(dims, r)[a] for r in g} for a in AXES}
            varying = {a for a, v in others.items() if len(v) > 1}
            assert varying <= {"dp": {"dp_replicate", "dp_shard"},
                               "dp_cp": {"dp_replicate", "dp_shard", "cp"},
                               "dp_shard_cp": {"dp_shard", "cp"}}.get(axis, {axis})


def mesh_worker(rank, world_size):
    out = []
    for kwargs in ({"tp": 2}, {"pp": 2, "cp": 2}, {"dp_replicate": 2}):
        mesh = build_mesh(ParallelDims(**kwargs), device_type="cpu")  # asserts torch groups == group_ranks
        sums = {}
        for axis in ALL_AXES:
            t = torch.tensor([float(rank)])
            comm.all_reduce(t, mesh, axis)
            assert t.item() == sum(mesh.ranks(axis)), axis
            sums[axis] = (mesh.size(axis), mesh.local_rank(axis), mesh.ranks(axis))
        out.append(sums)
    return out


def test_real_mesh_groups_on_four_ranks():
    results = run_distributed(mesh_worker, 4, timeout=90)
    dims = ParallelDims(tp=2).resolve(4)
    for rank, layouts in enumerate(results):
        tp = layouts[0]
        assert tp["tp"] == (2, rank % 2, group_ranks(dims, rank, "tp"))
        assert tp["dp"] == (2, rank // 2, group_ranks(dims, rank, "dp"))
        pp_cp = layouts[1]
        assert pp_cp["pp"][2] == [rank % 2, rank % 2 + 2] and pp_cp["dp"][0] == 1
        rep = layouts[2]
        assert rep["dp"] == (4, rank, [0, 1, 2, 3]) and rep["dp_replicate"][2] == [rank % 2, rank % 2 + 2]


def test_launch_env_is_read_from_torchrun_variables():
    from meshlm.distributed import init_distributed, read_launch_env

    assert read_launch_env({}) == (0, 1, 0)
    assert read_launch_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == (5, 8, 1)
    with pytest.raises(ValueError, match="RANK=8 WORLD_SIZE=8"):
        read_launch_env({"RANK": "8", "WORLD_SIZE": "8"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        init_distributed("cpu", environ={"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="device_type='tpu'"):
        init_distributed("tpu", environ={})
    env = init_distributed("cpu", environ={})  # one process: no process group at all
    assert env.world_size == 1 and env.backend is None and env.is_main


def init_worker(rank, world_size, port):
    import torch.distributed as dist

    from meshlm.distributed import init_distributed, teardown_distributed

    dist.destroy_process_group()  # the harness made one; start again from torchrun-style variables
    env = init_distributed("cpu", environ={"RANK": str(rank), "WORLD_SIZE": str(world_size),
                                           "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(port)})
    mesh = build_mesh(ParallelDims(), device_type="cpu")
    t = torch.ones(1)
    comm.all_reduce(t, mesh, "dp")
    teardown_distributed()
    teardown_distributed()  # safe twice
    return env.rank, env.backend, torch.get_num_threads(), t.item()


def test_init_distributed_on_two_ranks():
    from meshlm.processes import free_port

    assert run_distributed(init_worker, 2, free_port(), timeout=60) == [(0, "gloo", 1, 2.0), (1, "gloo", 1, 2.0)]


def test_a_layout_wider_than_one_process_says_how_many_ranks_to_start():
    with pytest.raises(ValueError, match=r"pp=2 .* choose pp in \{1\}; or start 2 ranks .* --nproc 2"):
        ParallelDims(pp=2).resolve(1)
