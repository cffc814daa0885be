"""`meshlm generate` / `meshlm serve` over several nodes (--nnodes, --node-rank, --rdzv-endpoint), as a user runs
them: subprocesses.

- Refusals, one line each, before any rank starts (in-process, no ranks).
- Two agents on this machine acting as two nodes (static rendezvous on 127.0.0.1): `meshlm serve --tp 2 --replicas
  2`, each replica's tensor-parallel pair split over the nodes (one rank of each replica per node); greedy
  completions from both replicas equal one process's, and only node 0 (its `meshlm serve`, the router) listens
  on the port.
- `meshlm cluster emulate` (root and iproute2; skipped without): `meshlm generate --cp 2 --stats` with the two cp
  ranks on two emulated nodes: greedy tokens equal one process's, each rank holds the configured pool of KV blocks
  and the sequence's blocks j % 2, the cp axis moves exactly the bytes the config gives (the prefill's ring of
  keys/values and the decodes' two all-gathers per layer), and at least those bytes crossed the shaped link.
- `meshlm cluster emulate` with `meshlm serve --prefill tp=1 --decode tp=1` (root): the prefill instance on one
  emulated node, the decode instance on the other, the front on node 0; greedy tokens equal one engine's, the bytes
  on "kv" equal the config's count for the tokens sent (the front's /metrics), and at least those crossed the link.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from meshlm.cli import main

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK")
PROMPT = "0123456789" * 10  # 100 tokens (no merges of digits in the tiny tokenizer): blocks of 32, 32, 32, 4
MAX_NEW = 6


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}


def test_node_options_are_refused_in_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    gen = ["generate", "--hf", str(tmp_path), "--prompt", "x"]
    serve = ["serve", "--model", str(tmp_path), "--tp", "2", "--replicas", "2", "--nnodes", "2"]
    cases = [
        ([*gen, "--cp", "2", "--nnodes", "2"], "--nnodes=2 needs --rdzv-endpoint"),
        ([*gen, "--cp", "2", "--node-rank", "1"], "--node-rank needs --rdzv-endpoint"),
        ([*gen, "--cp", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "between 0 and"),
        ([*gen, "--tp", "3", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "3 rank(s) do not split evenly over"),
        ([*gen, "--nnodes", "2", "--rdzv-endpoint", "h:1"], "1 rank(s) do not split evenly"),
        ([*serve, "--rdzv-endpoint", "h:1"], "needs --node-rank"),
        ([*serve, "--rdzv-endpoint", "h", "--node-rank", "0"], "must be HOST:PORT"),
        (["cluster", "emulate", "--nodes", "2", "--procs-per-node", "2", "--inter-node-bw", "1gbit", "--",
          "meshlm", *gen, "--cp", "2"], "--nodes 2 x --procs-per-node 2 = 4"),
        (["cluster", "emulate", "--nodes", "2", "--procs-per-node", "1", "--inter-node-bw", "1gbit", "--",
          "meshlm", *gen, "--cp", "2", "--node-rank", "0"], "drop --node-rank"),
        # a disaggregated pair: both instances' ranks, the prefill instance's first
        (["serve", "--model", str(tmp_path), "--prefill", "tp=1", "--decode", "tp=2", "--nnodes", "2",
          "--rdzv-endpoint", "h:1"], "--prefill tp=1,cp=1 + --decode tp=2,cp=1 = 3 ranks do not split evenly"),
        (["cluster", "emulate", "--nodes", "2", "--procs-per-node", "2", "--inter-node-bw", "1gbit", "--",
          "meshlm", "serve", "--model", str(tmp_path), "--prefill", "tp=1", "--decode", "tp=1"],
         "--decode tp=1,cp=1 = 2 ranks, but --nodes 2 x --procs-per-node 2 = 4"),
    ]
    for argv, message in cases:
        if argv[0] == "serve":
            pytest.importorskip("fastapi")
            pytest.importorskip("uvicorn")
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    # one of a launch's ranks (torchrun; srun's tasks): the launch must have tp x cp ranks, and places them itself
    for launch in ({"WORLD_SIZE": "4", "RANK": "0"}, {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}):
        with monkeypatch.context() as m:
            for k in LAUNCH_ENV:
                m.delenv(k, raising=False)
            for k, v in launch.items():
                m.setenv(k, v)
            for argv, message in [([*gen, "--cp", "2"], "serves on 2 ranks but this launch has 4"),
                                  ([*gen, "--cp", "4", "--nnodes", "2"], "drop --nnodes")]:
                assert main(argv) == 2
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and message in err[0], (launch, argv, err)


def _listeners(port: int) -> list[int]:
    """The processes listening on 127.0.0.1:`port` (TCP, IPv4)."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in {f"socket:[{i}]" for i in inodes} for fd in fds):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_serve_two_tp2_replicas_over_two_agents_answer_on_node_0_only(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import make_model_dir, serve_argv, wait_until_up

    from meshlm import LLM, SamplingParams
    from meshlm.processes import descendants, free_port, free_ports, stop_tree

    model_dir = make_model_dir(tmp_path)
    rdzv = free_port()
    while not _port_free(rdzv + 1):  # two consecutive free ports: the replicas' rendezvous
        rdzv = free_port()
    port = free_ports(1, avoid=(rdzv, rdzv + 1))[0]
    argv = serve_argv(model_dir, port, "--tp", "2", "--replicas", "2", "--router", "round_robin", "--nnodes", "2",
                      "--rdzv-endpoint", f"127.0.0.1:{rdzv}")
    agents = [subprocess.Popen([sys.executable, "-m", "meshlm.cli", *argv, "--node-rank", str(k)], env=clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for k in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(url, agents[0])
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": MAX_NEW, "temperature": 0}
        got = [httpx.post(f"{url}/v1/completions", json=body, timeout=60) for _ in range(2)]
        listening = _listeners(port)
        under = [set(descendants(a.pid)) | {a.pid} for a in agents]
    finally:
        for agent in agents:
            stop_tree(agent, 10)
        outputs = [a.stdout.read() for a in agents]
        print("node 0:", outputs[0], "node 1:", outputs[1], sep="\n")  # pytest shows it where the test fails
    want = LLM(str(model_dir), device="cpu", block_size=8).generate(
        ["hello world"], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))[0].text
    for r in got:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (r.text, outputs)
    assert sorted(r.headers["x-meshlm-replica"] for r in got) == ["0", "1"], [r.headers for r in got]
    # the router listens on node 0 (the agent itself), nothing of node 1 on its port; node 0 alone says where
    assert listening == [agents[0].pid] and not under[1] & set(listening), (listening, under)
    assert "meshlm serve: http://127.0.0.1" in outputs[0] and "meshlm serve: http" not in outputs[1], outputs
    assert "router (round_robin) over 2 replicas" in outputs[0], outputs[0]


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="emulated nodes need root and iproute2 (ip, tc)")


@needs_root
def test_generate_cp2_on_two_emulated_nodes(tmp_path, capfd):
    pytest.importorskip("tokenizers")
    from tiny_hf import make_model_dir

    from meshlm import LLM, SamplingParams
    from meshlm.infer.block_manager import DEFAULT_KV_CACHE_MB

    model_dir = make_model_dir(tmp_path)
    one = LLM(str(model_dir), device="cpu")  # the engine's defaults, as `meshlm generate`'s
    prompt_ids = one.tokenizer.encode(PROMPT)
    assert len(prompt_ids) == 100
    want = one.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))[0]
    capfd.readouterr()
    code = main(["cluster", "emulate", "--nodes", "2", "--procs-per-node", "1", "--inter-node-bw", "1gbit", "--",
                 "meshlm", "generate", "--hf", str(model_dir), "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW),
                 "--cp", "2", "--stats"])
    out, err = capfd.readouterr()
    assert code == 0, out + err
    text, stats = out.strip().splitlines()[-2:]
    assert text == PROMPT + want.text, (out, err)
    stats = json.loads(stats)

    cfg = one.model.config
    head_dim, elem, block = cfg.hidden_size // cfg.num_heads, 4, 32  # fp32, the engine's default block size
    # each rank: the configured pool (the default MiB per rank) of blocks of K and V of every layer's kv heads
    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * head_dim * block * elem
    assert stats["kv_blocks_per_rank"] == [(DEFAULT_KV_CACHE_MB << 20) // per_block] * 2, stats
    # the sequence's j-th block on rank j % 2: at the end its full blocks stay cached, 0 and 2 on node 0, 1 on node 1
    computed = len(prompt_ids) + len(want.token_ids) - 1  # the last token sampled is never fed back
    full = computed // block
    assert stats["kv_cached_blocks_per_rank"] == [(full + 1) // 2, full // 2], stats
    # the prefill's ring: node 0 sends the keys/values of its blocks (0, 2: 64 tokens) and receives node 1's
    # (1, 3: 36); per token K and V of every kv head in every layer
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * head_dim * elem
    tokens = [sum(min(block, len(prompt_ids) - j * block) for j in range(r, 4, 2)) for r in (0, 1)]
    assert tokens == [64, 36]
    cp = stats["comm_bytes"]["cp"]
    assert (cp["send"], cp["recv"]) == (per_token * tokens[0], per_token * tokens[1]), cp
    # each decode step, per layer: the queries (one row, every head) all-gathered, then (output, lse)
    decodes = len(want.token_ids) - 1
    gathered = 2 * cfg.num_heads * (head_dim + head_dim + 1) * elem
    assert cp["all_gather"] == decodes * cfg.num_layers * gathered, cp
    # what crossed node 0's shaped link: at least its share of those collectives (and the rest: the step
    # messages, the sampled rows, the rendezvous), at most a little more than all of it
    line = next(x for x in err.splitlines() if "node links carried" in x)
    sent, received = map(int, re.search(r"node 0 sent (\d+) B, received (\d+) B", line).groups())
    assert sent >= cp["send"] + cp["all_gather"] // 2 and received >= cp["recv"] + cp["all_gather"] // 2, (line, cp)
    assert "node 1 sent" in line


# A client run inside emulated node 0 (`ip netns exec`): waits for the server's /health, sends each request of
# argv[2] (a JSON list of bodies) in turn, then reads /metrics; prints {"answers": [...], "metrics": text}.
NODE_CLIENT = """
import json, sys, time, urllib.request
url, bodies = sys.argv[1], json.loads(sys.argv[2])
deadline = time.monotonic() + 120
while True:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
answers = []
for body in bodies:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        answers.append(json.loads(r.read()))
with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
    print(json.dumps({"answers": answers, "metrics": r.read().decode()}))
"""


@needs_root
def test_serve_disaggregated_prefill_and_decode_on_two_emulated_nodes(tmp_path):
    """`meshlm serve --prefill tp=1 --decode tp=1` under `meshlm cluster emulate` (2 nodes x 1 rank): the prefill
    instance is rank 0 on node 0, the decode instance rank 1 on node 1, the front on node 0. Two requests in turn,
    the second sharing the first's first 4 blocks: greedy tokens equal one engine's; the front's /metrics (the
    server's, labelled replica="0") counts the tokens sent and skipped (the decode side's prefix cache held the
    4 blocks), and rank 0's bytes on "kv" (all the prefill instance's) equal 2 x layers x kv heads x head_dim x
    sent tokens x 4 (fp32), from the config; at least those bytes crossed node 0's link out and node 1's in."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("uvicorn")
    from test_server import serve_argv
    from tiny_hf import make_model_dir

    from meshlm import LLM, SamplingParams
    from meshlm.processes import alive, descendants
    from meshlm.emulate import delete_namespace

    model_dir = make_model_dir(tmp_path)
    block = 8  # serve_argv's --block-size
    a = [(7 * i) % 250 + 3 for i in range(37)]  # 37 tokens: 4 full blocks and 5 tokens
    b = a[:4 * block] + [11, 13, 17]  # its first 4 blocks are a's
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": MAX_NEW, "temperature": 0} for p in (a, b)]
    proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", "cluster", "emulate", "--nodes", "2",
                             "--procs-per-node", "1", "--inter-node-bw", "1gbit", "--", "meshlm",
                             *serve_argv(model_dir, 8000, "--prefill", "tp=1", "--decode", "tp=1")],
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    tag = f"meshlm{proc.pid}"  # run_emulated's namespaces: TAG-n0, TAG-n1, TAG-sw
    try:
        while not os.path.exists(f"/run/netns/{tag}-n0"):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        client = subprocess.run(["ip", "netns", "exec", f"{tag}-n0", sys.executable, "-c", NODE_CLIENT,
                                 "http://127.0.0.1:8000", json.dumps(bodies)], capture_output=True, text=True,
                                timeout=180)
        tree = descendants(proc.pid)
    finally:
        proc.terminate()  # SIGTERM: the nodes' commands are stopped, the namespaces removed
        out, err = proc.communicate(timeout=60)
        for ns in (f"{tag}-n0", f"{tag}-n1", f"{tag}-sw"):
            delete_namespace(ns)  # (only if the run above failed to)
    assert client.returncode == 0, client.stderr + err[-3000:]
    got = json.loads(client.stdout)
    one = LLM(str(model_dir), device="cpu", block_size=block)
    want = one.generate([a, b], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    assert [r["choices"][0]["text"] for r in got["answers"]] == [w.text for w in want], (got["answers"], err[-3000:])

    def metric(name: str) -> int:
        line = next(x for x in got["metrics"].splitlines() if x.startswith(name + "{"))
        return int(float(line.rsplit(" ", 1)[1]))

    sent = len(a) + len(b) - 4 * block  # b's first 4 blocks were on the decode side already
    assert metric("meshlm_kv_transferred_tokens_total") == sent, got["metrics"]
    assert metric("meshlm_kv_transfer_skipped_tokens_total") == 4 * block
    assert metric("meshlm_kv_transfers_total") == 2
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * sent * 4
    assert 'meshlm_comm_bytes_total{replica="0",axis="kv"} ' + str(kv_bytes) in got["metrics"], got["metrics"]
    assert metric("meshlm_kv_transferred_bytes_total") == kv_bytes
    line = next(x for x in err.splitlines() if "node links carried" in x)
    (out0, _), (_, in1) = [tuple(map(int, m)) for m in re.findall(r"sent (\d+) B, received (\d+) B", line)]
    assert out0 >= kv_bytes and in1 >= kv_bytes, (line, kv_bytes)
    # everything created is gone: the namespaces, and every process the run started
    assert not [ns for ns in os.listdir("/run/netns") if ns.startswith(tag)]
    deadline = time.monotonic() + 10  # (a rank ends on its launcher's signal, a moment later)
    while [pid for pid in tree if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in tree if alive(pid)], tree
