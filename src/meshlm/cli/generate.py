"""`meshlm generate`: text from a meshlm checkpoint or a Hugging Face model, on one rank or tp x cp ranks (on one
node or several)."""

from __future__ import annotations

import json

from meshlm.cli.common import add_serving_node_arguments, finite_float, in_process_group, launch_serving_ranks


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a meshlm checkpoint or a Hugging Face model",
                       description="Generate a continuation of --prompt on the inference engine "
                                   "(paged KV cache): one process, or --tp N x --cp M ranks.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a meshlm run dir or one of its checkpoints")
    src.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user's message through the model's chat template and print the reply "
                        "alone (as a chat completion would answer it)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before it")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--min-p", type=finite_float, default=0.0,
                   help="drop tokens less likely than MIN_P x the most likely one (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--repetition-penalty", type=finite_float, default=1.0, metavar="R",
                   help="divide the positive logits of tokens in the prompt or generated so far by R, multiply the "
                        "negative ones (default 1.0 = off)")
    p.add_argument("--frequency-penalty", type=finite_float, default=0.0, metavar="F",
                   help="subtract F x how often a token was generated so far from its logit, in [-2, 2] (default 0)")
    p.add_argument("--presence-penalty", type=finite_float, default=0.0, metavar="P",
                   help="subtract P from the logit of every token generated so far, in [-2, 2] (default 0)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (started through torch's launcher, on this node or over --nnodes; each "
                        "holds 1/N of the weights and of every KV block; default 1)")
    p.add_argument("--cp", type=int, default=1, metavar="M",
                   help="context-parallel ranks: every sequence's KV blocks spread over M ranks, so a context "
                        "M times one rank's cache is served (x --tp ranks in all; default 1)")
    p.add_argument("--stats", action="store_true",
                   help="after the text, print one JSON line of the engine's counters: the KV blocks of each cp rank "
                        "(in all, and holding cached tokens at the end) and the bytes each mesh axis moved, by "
                        "operation (rank 0's view)")
    add_speculative_arguments(p)
    add_kv_tier_arguments(p)
    add_serving_node_arguments(p)


def add_speculative_arguments(p) -> None:
    """The speculative decoding flags of `meshlm generate` and `meshlm serve`."""
    p.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                   help="speculative decoding: 'ngram' proposes the tokens that followed the last n tokens' latest "
                        "earlier occurrence (prompt lookup), 'draft' a smaller model (--speculative-model); one "
                        "target forward verifies them, and the output is what the model alone gives")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="tokens proposed per sequence and step (default 4)")
    p.add_argument("--ngram", type=int, nargs=2, default=(1, 4), metavar=("MIN", "MAX"),
                   help="n-gram sizes looked up, the largest first (default 1 4)")
    p.add_argument("--speculative-model", default=None, metavar="DIR",
                   help="the draft model of --speculative draft: a meshlm checkpoint or Hugging Face directory with "
                        "the same tokenizer as the model")


def add_kv_tier_arguments(p) -> None:
    """The KV cache tier flags of `meshlm generate` and `meshlm serve`."""
    p.add_argument("--kv-host-mb", type=float, default=0.0, metavar="MB",
                   help="host memory per rank for prefix-cache blocks evicted from the KV cache: a later request "
                        "with the same prefix copies them back instead of recomputing them (default 0: off)")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="a directory for blocks evicted from host memory (or from the KV cache, without "
                        "--kv-host-mb); checksummed, kept across restarts of the same model and layout")
    p.add_argument("--kv-disk-mb", type=float, default=0.0, metavar="MB",
                   help="disk per rank under --kv-disk-dir (required with it)")


def kv_tier_kwargs(args) -> dict:
    """The `LLM` arguments of the KV tier flags (ValueError on a bad value, before any model loads)."""
    from meshlm.infer.kv_tiers import KVTierConfig

    KVTierConfig.of(args.kv_host_mb, args.kv_disk_dir, args.kv_disk_mb)
    return dict(kv_host_mb=args.kv_host_mb, kv_disk_dir=args.kv_disk_dir, kv_disk_mb=args.kv_disk_mb)


def speculative_config(args):
    """The `SpeculativeConfig` of parsed arguments, or None (ValueError on a bad value, before any model loads)."""
    from meshlm.infer.speculative import SpeculativeConfig

    if args.speculative is None:
        if args.speculative_model is not None:
            raise ValueError("--speculative-model needs --speculative draft")
        return None
    if args.speculative == "draft" and args.speculative_model is None:
        raise ValueError("--speculative draft needs --speculative-model DIR (a smaller model, same tokenizer)")
    if args.num_speculative_tokens < 1:
        raise ValueError(f"--num-speculative-tokens={args.num_speculative_tokens} must be >= 1")
    return SpeculativeConfig(method=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
                             ngram=tuple(args.ngram), model=args.speculative_model)


# The flag of each sampling parameter (`SamplingError.field`), for its messages.
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                  "max_tokens": "--max-new-tokens", "seed": "--seed", "repetition_penalty": "--repetition-penalty",
                  "frequency_penalty": "--frequency-penalty", "presence_penalty": "--presence-penalty"}


def run(args) -> int:
    from meshlm.distributed import launched_ranks

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat's system message: give --chat with it")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (argv keeps them as surrogates)
        raise ValueError("--prompt is not valid UTF-8 text; give it as UTF-8") from None
    for flag, path in (("--hf", args.hf), ("--checkpoint", args.checkpoint)):
        if path == "":  # Path("") is the working directory
            raise ValueError(f"{flag} is empty; give a folder")
    params = sampling_params(args)
    speculative_config(args)  # refused here, before any rank starts
    kv_tier_kwargs(args)
    code = launch_serving_ranks(args)  # the ranks (on --nnodes nodes) through torch's launcher
    if code is not None:
        return code
    if not launched_ranks():
        return generate_here(args, params)
    import torch

    return in_process_group(lambda: generate_here(args, params), "cuda" if torch.cuda.is_available() else "cpu")


def sampling_params(args):
    """The `SamplingParams` of the flags; a value out of range is refused naming its flag."""
    from meshlm.infer.sequence import SamplingError, SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              max_tokens=args.max_new_tokens, seed=args.seed,
                              repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty)
    except SamplingError as e:
        flag, message = SAMPLING_FLAGS.get(e.field, e.field), str(e)
        raise ValueError(flag + " " + message.removeprefix(e.field + "=")) from None


def generate_here(args, params) -> int:
    """This rank's part: rank 0 generates and prints, the others run their part of each step."""
    from meshlm.infer.llm import LLM

    llm = LLM(args.checkpoint or args.hf, tp=args.tp, cp=args.cp, speculative=speculative_config(args),
              **kv_tier_kwargs(args))
    if llm.is_driver:
        try:
            _generate_and_print(llm, args, params)
        finally:
            llm.close()
    return 0


def _generate_and_print(llm, args, params) -> None:
    if llm.tokenizer is None:
        raise ValueError(f"{args.checkpoint or args.hf!r} has no tokenizer (tokenizer.json); cannot encode --prompt")
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    prompt = llm.tokenizer.encode_chat([*messages, {"role": "user", "content": args.prompt}]) if args.chat \
        else args.prompt
    num_prompt = len(prompt) if args.chat else len(llm.tokenizer.encode(args.prompt))
    if num_prompt == 0:
        raise ValueError("--prompt encodes to no tokens; give some text")
    if num_prompt >= llm.engine.max_model_len:
        raise ValueError(f"the prompt has {num_prompt} tokens, and the model's context is "
                         f"{llm.engine.max_model_len}: shorten --prompt")
    if num_prompt + args.max_new_tokens > llm.engine.max_model_len:
        raise ValueError(f"the prompt ({num_prompt} tokens) + --max-new-tokens={args.max_new_tokens} exceeds the "
                         f"model's context of {llm.engine.max_model_len} tokens; use --max-new-tokens <= "
                         f"{max(llm.engine.max_model_len - num_prompt, 0)}")
    result = llm.generate([prompt], params)[0]
    print(result.text if args.chat else args.prompt + result.text)
    if args.stats:
        print(json.dumps(generation_stats(llm.engine)), flush=True)


def generation_stats(engine) -> dict:
    """`--stats`: the KV blocks of each cp rank (`kv_blocks_per_rank`; `kv_cached_blocks_per_rank`: those still
    holding a cached prefix), and what each mesh axis moved, {axis: {op: bytes}} (rank 0's counters)."""
    bm = engine.block_manager
    per_rank = bm.num_blocks // bm.num_groups
    cached = [0] * bm.num_groups
    for block in bm.cached.values():
        cached[block % bm.num_groups] += 1
    comm: dict = {}
    mesh = getattr(engine.runner, "mesh", None)
    for (op, axis), counted in (mesh.stats.snapshot().items() if mesh is not None else ()):
        comm.setdefault(axis, {})[op] = counted.bytes
    return {"kv_blocks_per_rank": [per_rank] * bm.num_groups, "kv_cached_blocks_per_rank": cached,
            "comm_bytes": comm}
