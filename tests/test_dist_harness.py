"""The multi-rank harness itself: results come back by rank; failures and hangs fail fast and say where."""

import re
import time

import pytest
import torch
import torch.distributed as dist

from dist import DistributedTestError, run_distributed


def sum_of_ranks(rank, world_size, scale, *, offset=0):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t.item() * scale + offset, "threads": torch.get_num_threads()}


def rank_one_raises(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom from rank one")
    dist.barrier()  # rank 0 would wait here forever: the harness must not
    return rank


def rank_crashes(rank, world_size):
    import os

    if rank == 0:
        os._exit(3)
    return rank


def rank_one_hangs(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_results_by_rank_with_args_and_kwargs():
    out = run_distributed(sum_of_ranks, 2, 10.0, offset=1, timeout=60)
    assert out == [{"rank": r, "sum": 11.0, "threads": 1} for r in range(2)]


def test_raising_rank_shows_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        run_distributed(rank_one_raises, 2, timeout=60)
    msg = str(err.value)
    assert "rank 1 failed" in msg and "boom from rank one" in msg and "rank_one_raises" in msg
    assert "first to fail: rank 1" in msg
    assert time.monotonic() - start < 60


def test_hanging_rank_fails_within_timeout_and_shows_its_stack():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        run_distributed(rank_one_hangs, 2, timeout=5)
    msg = str(err.value)
    # rank 0 normally has returned by then; on a very loaded machine it may still be starting
    assert re.search(r"timed out after 5 s; ranks still running: \[(0, )?1\]", msg), msg
    assert "rank_one_hangs" in msg  # the faulthandler stack of the hanging rank
    assert time.monotonic() - start < 30


def test_crashing_rank_is_reported_with_its_exit_code():
    with pytest.raises(DistributedTestError, match="rank 0 exited with code 3"):
        run_distributed(rank_crashes, 2, timeout=30)
