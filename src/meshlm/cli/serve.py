"""`meshlm serve`: the OpenAI-compatible server, on one rank or tp x cp ranks started through torchrun, or
`--replicas R` such servers behind a router (`infer/replicas.py`, `infer/router.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from meshlm.cli.common import add_serving_node_arguments, in_process_group, launch_serving_ranks, replica_endpoints, \
    require_extra, serving_ranks, serving_ranks_per_node
from meshlm.cli.generate import add_kv_tier_arguments, add_speculative_arguments, kv_tier_kwargs, speculative_config
from meshlm.infer.auth import api_key_of, exposure_warning
from meshlm.infer.block_manager import DEFAULT_KV_CACHE_MB
from meshlm.infer.router import POLICIES
from meshlm.infer.reasoning import PARSERS as REASONING
from meshlm.infer.tool_parsers import PARSERS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Hugging Face model directory or a meshlm checkpoint: POST /v1/completions, "
                    "/v1/chat/completions (stream or not), GET /v1/models, /health, /metrics.")
    p.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model directory or meshlm checkpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint except /health (`ps` shows it: "
                        "prefer --api-key-file)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="as --api-key, the key being the first line of PATH")
    p.add_argument("--max-body-mb", type=float, default=16.0,
                   help="largest request body accepted, in MiB (default 16); larger ones get 413")
    p.add_argument("--quiet", action="store_true",
                   help="do not log a line per request (method, path, status, tokens, latency)")
    p.add_argument("--rag", default=None, metavar="INDEX",
                   help="a `meshlm rag index` folder: requests with \"rag\": {\"top_k\": K} get passages put "
                        "before their prompt and a \"retrieved\" list in the response")
    p.add_argument("--rag-top-k", type=int, default=4, help="passages per request when it does not say (default 4)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="the model's own tool-call format, read from its replies when a chat with tools leaves the "
                        "choice to it (tool_choice \"auto\", the default with tools; refused without this flag): "
                        "hermes (<tool_call> JSON </tool_call>: Qwen2.5, Qwen3, Hermes) or llama3_json (Llama "
                        "3.1/3.2's JSON calls); \"required\" and a named function work without it")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING),
                   help="a reasoning model's format: its thinking (<think> ... </think>) is answered apart from the "
                        "reply, as \"reasoning\" and \"reasoning_content\", whole and streamed: deepseek_r1 (the "
                        "reply thinks from its first token: DeepSeek-R1, its distillations, QwQ) or qwen3 (it thinks "
                        "if it opens <think> or its prompt left one open; chat_template_kwargs "
                        "{\"enable_thinking\": false} turns it off)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="where the sampling defaults of requests that leave them out come from (temperature, top_p, "
                        "top_k, min_p, repetition_penalty): auto (default, as vLLM's: the model directory's "
                        "generation_config.json, e.g. Qwen3's temperature 0.6), vllm (none: the API's defaults, "
                        "temperature 1) or a directory holding a generation_config.json")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV block (default 32)")
    p.add_argument("--kv-cache-mb", type=float, default=float(DEFAULT_KV_CACHE_MB),
                   help=f"KV cache memory in MiB (default {DEFAULT_KV_CACHE_MB})")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default 2048)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (each holds 1/N of the weights and of every KV block; default 1)")
    p.add_argument("--cp", type=int, default=1, metavar="M",
                   help="context-parallel ranks (every sequence's KV blocks spread over M ranks; x --tp ranks in "
                        "all, started through torch's launcher; --kv-cache-mb is per rank; default 1)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default: cuda when present, in bf16; else cpu in fp32), cpu or cuda")
    p.add_argument("--replicas", type=int, default=1, metavar="R",
                   help="R servers (each its own --tp x --cp ranks, on a free port of 127.0.0.1) behind one router "
                        "at --host/--port that sends each request to the replica most likely to hold its prefix in "
                        "cache (default 1: no router); with --nnodes, every replica spreads over the nodes, the "
                        "router and the replicas' fronts on node 0 (--node-rank 0), replica i's rendezvous at "
                        "--rdzv-endpoint's port + i")
    p.add_argument("--router", default="cache_aware", choices=POLICIES,
                   help="with --replicas: cache_aware (default: the replica sent the longest prefix of the prompt "
                        "while loads are balanced, else the least loaded) or round_robin")
    p.add_argument("--replica-start-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="with --replicas: how long the replicas may take to load before the router gives up "
                        "(default 900)")
    add_speculative_arguments(p)
    add_kv_tier_arguments(p)
    add_disaggregation_arguments(p)
    p.add_argument("--collective-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="with --tp/--cp: how long a rank waits in a step's collective for the others before the "
                        "server reports the engine broken (default 600); an idle server keeps its ranks alive "
                        "with a small message a second, so idling longer than this is fine")
    add_serving_node_arguments(p)


def run(args) -> int:
    require_extra("serve", "fastapi", "uvicorn")
    from meshlm.distributed import launched_ranks

    ranks = serving_ranks(args)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port={args.port} must be in 0..65535")
    if args.replicas < 1:
        raise ValueError(f"--replicas={args.replicas} must be >= 1")
    speculative_config(args)  # refused here, before any rank starts
    api_key_of(args.api_key, args.api_key_file)  # likewise
    kv_tier_kwargs(args)  # likewise
    sampling_defaults_of(args)  # likewise
    if args.prefill is not None or args.decode is not None:
        return serve_disaggregated(args)
    if args.replicas > 1:
        if launched_ranks():
            raise ValueError("--replicas starts its own launchers; drop it under torchrun/srun")
        return serve_replicas(args)
    code = launch_serving_ranks(args)  # the ranks (on --nnodes nodes) through torch's launcher
    if code is not None:
        return code
    if ranks == 1 and not launched_ranks():
        return serve_here(args)
    return serve_on_ranks(args, lambda: serve_here(args))


def serve_on_ranks(args, work) -> int:
    """`work()` on this rank of a launch, inside the process group (GPUs unless --device cpu) whose collectives
    give up after --collective-timeout."""
    import torch

    if args.collective_timeout <= 0:
        raise ValueError(f"--collective-timeout={args.collective_timeout} must be > 0 seconds")
    return in_process_group(work, "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu",
                            timeout_s=args.collective_timeout)


def build_llm(args):
    """The `LLM` of parsed `meshlm serve` arguments (on several ranks: every rank builds it; on the others
    this returns only when rank 0 closes it)."""
    from meshlm.infer.llm import LLM

    return LLM(args.model, tp=args.tp, cp=args.cp, device=args.device, **build_llm_kwargs(args))


def build_llm_kwargs(args) -> dict:
    """The engine and KV cache arguments of parsed `meshlm serve` arguments."""
    return dict(block_size=args.block_size, kv_cache_memory_bytes=int(args.kv_cache_mb * (1 << 20)),
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                speculative=speculative_config(args), **kv_tier_kwargs(args))


def build_server(args, llm=None):
    """(uvicorn.Server, AsyncEngine) for parsed `meshlm serve` arguments; the caller runs the server. `llm`: an
    `LLM` (default: `build_llm`'s), or an engine with `Engine`'s interface (`DisaggregatedEngine`)."""
    import uvicorn

    from meshlm.infer.async_engine import AsyncEngine
    from meshlm.infer.server import create_app

    api_key = api_key_of(args.api_key, args.api_key_file)
    llm = llm or build_llm(args)
    engine = AsyncEngine(getattr(llm, "engine", llm))
    name = model_name_of(args)
    if not 1 <= args.rag_top_k <= 64:
        raise ValueError(f"--rag-top-k={args.rag_top_k} must be between 1 and 64")
    if args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb={args.max_body_mb} must be > 0")
    rag_index = None
    if args.rag is not None:
        from meshlm.infer.rag import RagIndex

        rag_index = RagIndex.load(args.rag)
    defaults = sampling_defaults_of(args)
    log = None if args.quiet else (lambda line: print(f"meshlm serve: {line}", flush=True))
    app = create_app(engine, model_name=name, api_key=api_key,
                     max_body_bytes=int(args.max_body_mb * (1 << 20)), log=log, rag_index=rag_index,
                     rag_top_k=args.rag_top_k, tool_call_parser=args.tool_call_parser,
                     reasoning_parser=args.reasoning_parser, sampling_defaults=defaults)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    server.meshlm_model_name = name  # the id clients must send, for the banner
    server.meshlm_warning = exposure_warning(args.host, api_key)  # for the banner: reachable without a key
    if defaults:  # for the banner, as vLLM says it
        server.meshlm_warning = "\n".join(filter(None, [server.meshlm_warning, (
            f"meshlm serve: requests that leave them out sample with the model's generation_config.json: "
            f"{', '.join(f'{k}={v}' for k, v in defaults.items())} (--generation-config vllm: the API's defaults)")]))
    return server, engine


def sampling_defaults_of(args) -> dict:
    """--generation-config's sampling defaults: the model directory's (auto), none (vllm) or DIR's."""
    from meshlm.infer.sequence import SamplingError, SamplingParams
    from meshlm.tokenizer import read_generation_defaults

    if args.generation_config == "vllm":
        return {}
    where = Path(args.model if args.generation_config == "auto" else args.generation_config)
    if args.generation_config != "auto" and not (where / "generation_config.json").is_file():
        raise ValueError(f"--generation-config={args.generation_config!r} holds no generation_config.json; give "
                         "auto, vllm or a directory holding one")
    defaults = read_generation_defaults(where)
    try:
        SamplingParams(**defaults)
    except SamplingError as e:
        raise ValueError(f"{where / 'generation_config.json'}: {e}; fix it or give --generation-config vllm") from None
    return defaults


def model_name_of(args) -> str:
    """The model id clients send: --served-model-name, else the model directory's name."""
    return args.served_model_name or Path(args.model).resolve().name


def serve_replicas(args, *, extra_argv: tuple[str, ...] = (), label: str | None = None) -> int:
    """`--replicas R`: this command line R times again as ordinary servers (each on a free port of 127.0.0.1,
    quiet: the router logs each request), and the router at --host/--port in this process, which stops them.
    `extra_argv`: added to each replica's command line; `label`: how errors name a replica (default "replica I")."""
    import uvicorn

    from meshlm.infer.replicas import ReplicaSet, create_router_app
    from meshlm.infer.router import make_policy

    if args.max_body_mb <= 0:
        raise ValueError(f"--max-body-mb={args.max_body_mb} must be > 0")
    if args.replica_start_timeout <= 0:
        raise ValueError(f"--replica-start-timeout={args.replica_start_timeout} must be > 0 seconds")
    api_key = api_key_of(args.api_key, args.api_key_file)
    policy = make_policy(args.router, args.replicas)
    endpoints = replica_endpoints(args)  # over --nnodes: each replica its own rendezvous

    def command(index: int, port: int) -> list[str]:  # the last of a repeated option wins
        return [sys.executable, "-m", "meshlm.cli", *args.argv, "--replicas", "1", "--host", "127.0.0.1",
                "--port", str(port), "--quiet", *extra_argv,
                *(["--rdzv-endpoint", endpoints[index]] if endpoints else [])]

    rendezvous = tuple(int(e.rpartition(":")[2]) for e in endpoints)  # bound on node 0 by the replicas' launchers
    if endpoints and args.node_rank != 0:  # this node hosts ranks of every replica; fronts and router: node 0
        with ReplicaSet(command, args.replicas, label=label, avoid_ports=rendezvous) as replicas:
            return replicas.wait_for_exit()
    with ReplicaSet(command, args.replicas, label=label, avoid_ports=rendezvous) as replicas:
        replicas.wait_until_healthy(args.replica_start_timeout)
        log = None if args.quiet else (lambda line: print(f"meshlm serve: {line}", flush=True))
        app = create_router_app(replicas.replicas, policy, api_key=api_key,
                                max_body_bytes=int(args.max_body_mb * (1 << 20)), log=log)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5)
        print(serve_banner(args.host, args.port, args.model, model_name_of(args)), flush=True)
        ports = ", ".join(f"{r.index}: 127.0.0.1:{r.port}" for r in replicas.replicas)
        print(f"meshlm serve: front before {replicas.replicas[0].name()}" if label is not None else
              f"meshlm serve: router ({args.router}) over {args.replicas} replicas ({ports})", flush=True)
        if (warning := exposure_warning(args.host, api_key)) is not None:
            print(warning, flush=True)
        uvicorn.Server(config).run()
    return 0


def serve_banner(host: str, port: int, model_path: str, model_name: str) -> str:
    """The line `meshlm serve` starts with: where it listens and the model id requests must name."""
    return (f"meshlm serve: http://{host}:{port}/v1 serving {model_path} as model {json.dumps(model_name)} "
            f"(requests send \"model\": {json.dumps(model_name)})")


def kv_banner(stats: dict, *, block_size: int, tp: int, cp: int) -> str:
    """The second line of `meshlm serve`: how many tokens the KV cache holds, over how many ranks."""
    ranks = f" over {tp * cp} ranks (tp={tp}: each holds 1/{tp} of the kv heads; cp={cp}: each holds 1/{cp} of the " \
            "blocks)" if tp * cp > 1 else ""
    return (f"meshlm serve: KV cache of {stats['kv_blocks_total']} blocks x {block_size} tokens = "
            f"{stats['kv_blocks_total'] * block_size} tokens{ranks}")


def serve_here(args) -> int:
    """This rank's part of the server: rank 0 runs HTTP and the engine, the others their part of each step."""
    llm = build_llm(args)
    if not llm.is_driver:  # another rank of a parallel server: it ran its part until rank 0 closed
        return 0
    try:
        server, engine = build_server(args, llm)
        print(serve_banner(args.host, args.port, args.model, server.meshlm_model_name), flush=True)
        print(kv_banner(llm.engine.stats(), block_size=args.block_size, tp=args.tp, cp=args.cp), flush=True)
        if server.meshlm_warning is not None:
            print(server.meshlm_warning, flush=True)
        tiers = llm.engine.tiers
        if tiers is not None:
            print(f"meshlm serve: KV tiers: host {tiers.host_slots * tiers.num_groups} blocks, disk "
                  f"{tiers.disk_blocks * tiers.num_groups} blocks ({tiers.num_blocks('disk')} found from an earlier "
                  "run)", flush=True)
        spec = llm.engine.speculative
        if spec is not None:
            by = f"the draft model {spec.model}" if spec.method == "draft" else f"n-gram lookup (n from {spec.ngram[1]} down to {spec.ngram[0]})"
            print(f"meshlm serve: speculative decoding: {spec.num_speculative_tokens} tokens a step proposed by {by}",
                  flush=True)
        try:
            server.run()
        finally:
            engine.stop()
    finally:
        llm.close()
    return 0


# ---------------------------------------------------------------------------------------------
# --prefill / --decode: disaggregated prefill and decode (infer/disaggregated.py)
# ---------------------------------------------------------------------------------------------


def add_disaggregation_arguments(p) -> None:
    g = p.add_argument_group("disaggregated prefill and decode")
    g.add_argument("--prefill", default=None, metavar="LAYOUT",
                   help="with --decode: a prefill instance of this layout (tp=N and/or cp=M, e.g. tp=2) computes each "
                        "prompt's KV and first token and sends the KV to the decode instance, which continues the "
                        "sequence; both through torch's launcher in one command, P+D ranks in all (the planner's "
                        "`plan infer --disaggregate P:D`; over --nnodes, the prefill instance's ranks on the first "
                        "nodes, the front on node 0); instead of --tp/--cp")
    g.add_argument("--decode", default=None, metavar="LAYOUT",
                   help="with --prefill: the decode instance's layout, e.g. tp=1,cp=2")
    g.add_argument("--no-front", action="store_true",
                   help="with --prefill/--decode: serve from the first rank itself, without the front process that "
                        "keeps answering (503, /health unhealthy) if an instance dies")


def disaggregated_layouts(args):
    """(prefill, decode) `InstanceLayout`s of --prefill/--decode, checked against the model's config where it can
    be read without loading weights (a Hugging Face directory); ValueError before any rank starts."""
    from meshlm.infer.instances import check_instances, parse_instance

    if args.prefill is None or args.decode is None:
        raise ValueError("--prefill and --decode go together: give both, e.g. --prefill tp=2 --decode tp=1,cp=2")
    if args.tp != 1 or args.cp != 1 or args.replicas != 1:
        raise ValueError("--prefill/--decode give each instance its layout: drop --tp/--cp/--replicas")
    if speculative_config(args) is not None or any(kv_tier_kwargs(args).values()):
        raise ValueError("speculative decoding and KV tiers are not combined with --prefill/--decode yet; leave "
                         "them out")
    prefill, decode = parse_instance(args.prefill, role="prefill"), parse_instance(args.decode, role="decode")
    config = Path(args.model, "config.json")
    if config.is_file():
        from meshlm.hf_config import read_hf_config

        check_instances(read_hf_config(args.model), prefill, decode)
    return prefill, decode


def serve_disaggregated(args) -> int:
    """`--prefill/--decode`: the front (the router of `--replicas`, over one server) here, the ranks in a child
    launch (`--no-front`); on the ranks, `serve_disaggregated_here`."""
    from meshlm.distributed import launched_ranks
    from meshlm.infer.instances import disaggregate_label
    from meshlm.launch import node_launcher_args, run_torchrun, without_node_flags

    prefill, decode = disaggregated_layouts(args)
    per_node = serving_ranks_per_node(args)  # prefill's ranks first, then decode's: over --nnodes, prefill first
    if launched_ranks():
        return serve_on_ranks(args, lambda: serve_disaggregated_here(args, prefill, decode))
    if args.no_front:
        # --monitor-interval 1: when a rank dies, the launcher stops the others up to a second later, time enough
        # for rank 0 to end the requests in flight with an error naming the instance that failed
        return run_torchrun([*node_launcher_args(args, per_node), "--monitor-interval", "1"],
                            without_node_flags(args.argv))
    label = (f"the disaggregated server (prefill {prefill.label()}, decode {decode.label()}: "
             f"--disaggregate {disaggregate_label(prefill, decode)})")
    return serve_replicas(args, extra_argv=("--no-front",), label=label)


def serve_disaggregated_here(args, prefill, decode) -> int:
    """This rank's part: rank 0 runs HTTP and both engines' scheduling, every rank its instance's part."""
    from meshlm.infer.disaggregated import disaggregated_engine
    from meshlm.infer.instances import disaggregate_label

    engine = disaggregated_engine(args.model, prefill, decode, device=args.device, **build_llm_kwargs(args))
    if engine is None:
        return 0
    try:
        server, async_engine = build_server(args, engine)
        print(serve_banner(args.host, args.port, args.model, server.meshlm_model_name), flush=True)
        print(f"meshlm serve: disaggregated --disaggregate {disaggregate_label(prefill, decode)}: prefill instance "
              f"{prefill.label()} (ranks 0-{prefill.ranks - 1}, {engine.prefill.stats()['kv_blocks_total']} KV "
              f"blocks), decode instance {decode.label()} (ranks {prefill.ranks}-{prefill.ranks + decode.ranks - 1}, "
              f"{engine.decode.stats()['kv_blocks_total']} KV blocks of {args.block_size} tokens)", flush=True)
        if server.meshlm_warning is not None:
            print(server.meshlm_warning, flush=True)
        try:
            server.run()
        finally:
            async_engine.stop()
    finally:
        engine.close()
    return 0
