"""KV cache tiers below the device pool (`infer/kv_tiers.py`, `infer/kv_tier_store.py`): prefix-cache blocks the pool
evicts are kept in host memory, then on disk, and brought back for a later request with the same prefix.

A multi-turn workload (conversations sharing a system prompt, each turn extending its conversation) on a device pool
too small to keep them all gives the same greedy tokens with tiers as without, with prefix hits from the host tier
and from the disk tier (counted in the engine's stats and /metrics); the disk tier survives a restart of the same
model and layout and is ignored by another model or block size; truncated and corrupted files are ignored with a
warning, and a full disk turns the tier off without breaking anything; each tier stays within its size; under tp=2
and cp=2 serving the tokens are one process's.
"""

import logging
import random
import subprocess
import sys

import pytest
import torch

from dist import run_distributed
from meshlm import LLM, SamplingParams
from meshlm.infer.block_manager import BlockManager
from meshlm.infer.kv_tiers import KVTierConfig, KVTiers

transformers = pytest.importorskip("transformers")
from test_engine import tiny_hf  # noqa: E402 -- after the importorskip

BS = 4
SMALL_POOL = dict(block_size=BS, num_blocks=16, max_num_seqs=2, dtype=torch.float64)  # 64 tokens of cache
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 8  # K and V, 2 layers, 4 tokens, 2 kv heads of 16, float64


def conversations(num: int = 4, turns: int = 3, seed: int = 0) -> list[list[int]]:
    """The prompts of `num` conversations, turn after turn: a shared system prompt (8 tokens), then each
    conversation's own opening (16 tokens), then 5 more tokens each turn (the conversation so far is the prefix)."""
    rng = random.Random(seed)
    system = [rng.randrange(2, 90) for _ in range(8)]
    convs = [system + [rng.randrange(2, 90) for _ in range(16)] for _ in range(num)]
    prompts = []
    for _ in range(turns):
        for conv in convs:
            conv += [rng.randrange(2, 90) for _ in range(5)]
            prompts.append(list(conv))
    return prompts


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """One request at a time (each turn after the one before), as a chat client sends them."""
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def chain_keys(tokens: list[int], n: int) -> list[int]:
    keys, parent = [], None
    for i in range(n):
        parent = BlockManager._chain_hash(parent, tuple(tokens[i * BS:(i + 1) * BS]))
        keys.append(parent)
    return keys


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    tiny_hf("llama").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def baseline(model_dir):
    """Tokens and stats of the workload without tiers."""
    llm = LLM(model_dir, device="cpu", **SMALL_POOL)
    return run(llm, conversations()), llm.engine.stats()


def check_pools(llm: LLM, *, host_mb: float = 0.0, disk_mb: float = 0.0) -> None:
    engine = llm.engine
    store, tiers = engine.runner.tier_store, engine.tiers
    tiers.check_invariants()
    engine.block_manager.check_invariants([])
    assert store.host_bytes <= host_mb * (1 << 20) and tiers.num_blocks("host") <= store.host_slots
    assert store.disk_bytes() <= disk_mb * (1 << 20) and tiers.num_blocks("disk") <= store.disk_blocks
    if store.dir is not None:
        assert len(list(store.dir.glob("*.kv"))) == tiers.num_blocks("disk")


def test_host_tier_gives_hits_and_the_same_tokens(model_dir, baseline):
    want, base = baseline
    llm = LLM(model_dir, device="cpu", kv_host_mb=0.05, **SMALL_POOL)  # 12 blocks of host memory
    assert run(llm, conversations()) == want
    s = llm.engine.stats()
    assert s["kv_host_hit_tokens"] > 0 and s["kv_disk_hit_tokens"] == 0 and s["kv_host_loaded_blocks"] > 0
    assert s["kv_recomputed_tokens"] < base["kv_recomputed_tokens"]
    assert s["prefix_cache_hit_tokens"] == s["kv_host_hit_tokens"] + s["kv_device_hit_tokens"]
    assert s["kv_host_blocks"] <= s["kv_host_blocks_total"] == 12
    check_pools(llm, host_mb=0.05)


def test_disk_tier_gives_hits_survives_a_restart_and_keeps_its_size(model_dir, baseline, tmp_path):
    want, base = baseline
    disk = dict(kv_disk_dir=str(tmp_path), kv_disk_mb=0.06)  # 14 files
    # host tier of 2 blocks: most evictions go on to disk, the disk evicts its oldest files
    llm = LLM(model_dir, device="cpu", kv_host_mb=BLOCK_BYTES * 2 / (1 << 20), **disk, **SMALL_POOL)
    assert run(llm, conversations()) == want
    s = llm.engine.stats()
    assert s["kv_disk_hit_tokens"] > 0 and s["kv_disk_saved_blocks"] > 0 and s["kv_disk_evicted_blocks"] > 0
    assert s["kv_recomputed_tokens"] < base["kv_recomputed_tokens"]
    check_pools(llm, host_mb=BLOCK_BYTES * 2 / (1 << 20), disk_mb=0.06)
    first = s["kv_disk_hit_tokens"]

    # no host tier at all: the pool evicts straight to disk
    llm = LLM(model_dir, device="cpu", **disk, **SMALL_POOL)
    found = llm.engine.tiers.num_blocks("disk")
    assert found == s["kv_disk_blocks"] > 0  # what the first server left
    assert run(llm, conversations()) == want
    again = llm.engine.stats()
    assert again["kv_disk_hit_tokens"] > first and again["kv_host_hit_tokens"] == 0
    check_pools(llm, disk_mb=0.06)

    # another block size, another model: the files are not theirs
    other = LLM(model_dir, device="cpu", **disk, **{**SMALL_POOL, "block_size": 8, "num_blocks": 8})
    assert other.engine.tiers.num_blocks("disk") == 0
    torch.manual_seed(1)
    other_dir = tmp_path / "other-model"
    tiny_hf("llama").save_pretrained(other_dir)
    other = LLM(str(other_dir), device="cpu", **disk, **SMALL_POOL)
    assert other.engine.tiers.num_blocks("disk") == 0
    run(other, conversations()[:2])
    assert other.engine.stats()["kv_disk_hit_tokens"] == 0


def test_truncated_and_corrupted_files_are_ignored_and_recomputed(model_dir, tmp_path, caplog):
    a, c, filler = [list(range(2, 26))], [list(range(30, 54))], [[(7 * i) % 80 + 3 for i in range(60)]]
    disk = dict(kv_disk_dir=str(tmp_path), kv_disk_mb=1)
    llm = LLM(model_dir, device="cpu", **disk, **SMALL_POOL)
    want = run(llm, a + c + filler)  # the filler evicts a's and c's blocks to disk
    store = llm.engine.runner.tier_store
    files = {key: store.dir / f"{key & 0xFFFFFFFFFFFFFFFF:016x}.kv" for key in chain_keys(a[0], 5) + chain_keys(c[0], 5)}
    assert all(f.exists() for f in files.values())
    corrupted = files[chain_keys(a[0], 3)[2]]  # a's third block: a byte of its keys flipped
    data = bytearray(corrupted.read_bytes())
    data[200] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    truncated = files[chain_keys(c[0], 1)[0]]  # c's first block: cut short
    truncated.write_bytes(truncated.read_bytes()[:100])

    with caplog.at_level(logging.WARNING, logger="meshlm.infer.kv_tier_store"):
        llm = LLM(model_dir, device="cpu", **disk, **SMALL_POOL)
        assert run(llm, a + c) == want[:2]
    s = llm.engine.stats()
    assert s["kv_disk_failed_loads"] == 1 and s["kv_disk_hit_tokens"] == 2 * BS  # a's first two blocks
    assert s["kv_recomputed_tokens"] == 2 * 24 - 2 * BS
    text = caplog.text
    assert "corrupted" in text and str(corrupted) in text and "not a whole block file" in text and str(truncated) in text
    assert not truncated.exists() and not corrupted.exists()  # deleted: written again when evicted again


def test_a_full_disk_turns_the_tier_off_and_serving_goes_on(model_dir, baseline, tmp_path, caplog, monkeypatch):
    want, _ = baseline

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("meshlm.infer.kv_tier_store.pack_block", no_space)
    llm = LLM(model_dir, device="cpu", kv_host_mb=BLOCK_BYTES * 2 / (1 << 20), kv_disk_dir=str(tmp_path),
              kv_disk_mb=1, **SMALL_POOL)
    with caplog.at_level(logging.WARNING, logger="meshlm.infer.kv_tier_store"):
        assert run(llm, conversations()) == want
    assert "No space left on device" in caplog.text and "disk tier is off" in caplog.text
    assert not llm.engine.tiers.has_disk and llm.engine.stats()["kv_disk_hit_tokens"] == 0
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))


def test_metrics_show_the_tiers(model_dir):
    pytest.importorskip("fastapi")
    from meshlm.infer.metrics import metrics_text
    from meshlm.infer.server import AsyncEngine

    llm = LLM(model_dir, device="cpu", kv_host_mb=0.05, **SMALL_POOL)
    run(llm, conversations(turns=2))
    engine = AsyncEngine(llm.engine)
    try:
        text = metrics_text(engine)
    finally:
        engine.stop()
    hits = llm.engine.stats()["kv_host_hit_tokens"]
    assert hits > 0 and f"meshlm_kv_host_hit_tokens_total {hits}\n" in text
    assert "meshlm_kv_disk_hit_tokens_total 0\n" in text and "meshlm_kv_recomputed_tokens_total" in text


def test_bad_settings_name_the_flag(tmp_path, model_dir, capsys):
    from meshlm.cli import main

    a_file = tmp_path / "f"
    a_file.write_text("x")
    for kwargs, match in [(dict(host_mb=-1), r"--kv-host-mb.*>= 0"), (dict(disk_dir=str(tmp_path), disk_mb=-2), "--kv-disk-mb"),
                          (dict(disk_dir=str(a_file), disk_mb=1), "is a file"),
                          (dict(disk_dir=str(tmp_path)), r"needs the tier's size.*--kv-disk-mb"),
                          (dict(disk_mb=1), r"needs a directory.*--kv-disk-dir")]:
        with pytest.raises(ValueError, match=match):
            KVTierConfig.of(**kwargs)
    with pytest.raises(ValueError, match=r"kv_host_mb=1e-05 \(--kv-host-mb\) holds no KV block of 4096 bytes"):
        LLM(model_dir, device="cpu", kv_host_mb=1e-5, **SMALL_POOL)
    # found by fuzzing: a host tier beyond the host's memory was allocated, and failed in a traceback
    with pytest.raises(ValueError, match=r"kv_host_mb=1e\+12 \(--kv-host-mb\) is more than this host's memory"):
        LLM(model_dir, device="cpu", kv_host_mb=1e12, **SMALL_POOL)
    assert KVTierConfig.of() is None and KVTierConfig.of(0, None, 0) is None
    assert main(["generate", "--hf", model_dir, "--prompt", "x", "--kv-host-mb", "-1"]) == 2
    assert "--kv-host-mb" in capsys.readouterr().err


def test_the_tier_directory_is_torch_free_and_keeps_its_sizes():
    code = "import sys, meshlm.infer.kv_tiers, meshlm.infer.block_manager; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    rng = random.Random(0)
    tiers = KVTiers(host_slots=3, disk_blocks=5, num_groups=2)
    for i in range(200):  # random evictions and loads: each tier within its size, slots never shared
        g = rng.randrange(2)
        key = rng.randrange(40)
        if rng.random() < 0.3 and tiers.claim(g, key, None, (key,)) is not None:
            tiers.load(2 * rng.randrange(8) + g)
        else:
            tiers.evicted(g, key, None, (key,), 2 * rng.randrange(8) + g)
        tiers.check_invariants()
    moves = tiers.take_moves()
    assert {m[0] for m in moves} == {"d2h", "h2f", "rm", "h2d", "f2d"}


def _tiers_on_ranks(rank, world_size, model_dir, disk_dir, layouts):
    out = {}
    for name, (tp, cp) in layouts.items():
        llm = LLM(model_dir, tp=tp, cp=cp, device="cpu", kv_host_mb=0.03, kv_disk_dir=disk_dir, kv_disk_mb=0.2,
                  **{**SMALL_POOL, "num_blocks": 16 // cp})
        store = llm.engine.runner.runner.tier_store if llm.is_driver else None
        if llm.is_driver:
            out[name] = run(llm, conversations()), llm.engine.stats()
            out[name, "pools"] = store.host_bytes, store.disk_bytes()
            llm.engine.tiers.check_invariants()
            llm.close()
    return out


def test_tiers_under_tp2_and_cp2_give_one_process_tokens(model_dir, baseline, tmp_path):
    want, _ = baseline
    layouts = {"tp2": (2, 1), "cp2": (1, 2)}
    results = run_distributed(_tiers_on_ranks, 2, model_dir, str(tmp_path), layouts, timeout=240)
    for name in layouts:
        tokens, s = results[0][name]
        assert tokens == want, name
        assert s["kv_host_hit_tokens"] > 0 and s["kv_disk_hit_tokens"] > 0, (name, s)
        host, disk = results[0][name, "pools"]
        assert host <= 0.03 * (1 << 20) and disk <= 0.2 * (1 << 20)
    # every rank wrote its own share of each block: tp rank 1's files (half the kv heads) beside rank 0's
    assert len(list(tmp_path.glob("*/t1c0/*.kv"))) > 0 and len(list(tmp_path.glob("*/t0c1/*.kv"))) > 0
