"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`, or `.chat(messages, ...)`.

Responsible for: loading a model and its tokenizer from a Hugging Face directory (config.json,
safetensors, tokenizer.json) or a meshlm training checkpoint, building the `Engine`, and running a
batch of prompts to completion through continuous batching; with `tp=N` and/or `cp=M`, on N x M ranks
(every rank constructs the `LLM`; rank 0 drives the engine, the others run their part until it closes,
see `infer/parallel.py`).
Not responsible for: serving (server.py) or starting ranks (torchrun, or `meshlm generate --tp N --cp M`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshlm.infer.engine import Engine, RequestOutput
from meshlm.infer.parallel import RUNNER_ARGS, ParallelRunner, build_runner, run_worker
from meshlm.host_memory import reuse_freed_host_memory
from meshlm.infer.sequence import SamplingParams
from meshlm.infer.speculative import SpeculativeConfig
from meshlm.values import is_integer
from meshlm.tokenizer import HFTokenizer, Tokenizer, read_eos_token_ids
from meshlm.models.transformer import Transformer


def load_model_and_tokenizer(model: str | Path, *, dtype: torch.dtype = torch.float32,
                             device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer | None]:
    """A Hugging Face directory (config.json + safetensors) or a meshlm checkpoint / run directory."""
    path = Path(model)
    if not path.exists():
        raise ValueError(f"model {str(model)!r} does not exist; give a Hugging Face model directory or a "
                         "meshlm checkpoint (downloads are not done here)")
    if (path / "config.json").is_file():
        from meshlm.models.hf import load_pretrained

        return load_pretrained(path, dtype=dtype, device=device).eval(), HFTokenizer.from_dir(path)
    from meshlm.checkpoint import CheckpointError, load_checkpoint_for_inference

    try:
        net, _, tok = load_checkpoint_for_inference(path, device=device, dtype=dtype)
    except CheckpointError as e:
        if str(e).startswith("no checkpoint at"):  # neither kind: say that both were looked for
            raise CheckpointError(f"{str(path)!r} is neither a Hugging Face model directory (no config.json in "
                                  f"it) nor a meshlm checkpoint ({e})") from None
        raise
    return net, tok


def serving_device(device: str | torch.device, dtype: torch.dtype | None) -> tuple[str | torch.device, torch.dtype]:
    """(device, dtype) of a served model: "auto" is the GPU when there is one, as training does; the dtype
    defaults to bf16 on a GPU, fp32 on a CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} (--device) but no CUDA device is available here; use cpu or auto")
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return device, dtype


def model_for_serving(model: str | Path | Transformer, tokenizer: Tokenizer | None, *, dtype: torch.dtype,
                      device: str | torch.device, engine_kwargs: dict) -> tuple[Transformer, Tokenizer | None]:
    """(model, tokenizer) of `LLM`'s `model` argument: a `Transformer` as it is, or loaded from a path; a Hugging
    Face directory without a tokenizer gives `engine_kwargs` its config's end-of-sequence ids (unless set)."""
    if isinstance(model, Transformer):
        return model.eval(), tokenizer
    net, tok = load_model_and_tokenizer(model, dtype=dtype, device=device)
    tok = tokenizer or tok
    if tok is None and "eos_token_ids" not in engine_kwargs and Path(model, "config.json").is_file():
        engine_kwargs["eos_token_ids"] = read_eos_token_ids(model)
    return net, tok


def serving_mesh(tp: int, device: str | torch.device, *, cp: int = 1, stats=None):
    """The mesh of a parallel `LLM`: the ranks of the launch as cp x tp (the process group must exist);
    `stats`: the `comm_stats.CommStats` it counts into (default: a new one)."""
    import torch.distributed as dist

    from meshlm.mesh import ParallelDims, build_mesh

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world != tp * cp:
        raise ValueError(f"tp={tp} x cp={cp} serves on {tp * cp} ranks but this process is one of {world}; start "
                         f"{tp * cp} ranks (`meshlm generate --tp {tp} --cp {cp}`, or torchrun --nproc-per-node "
                         f"{tp * cp} with every rank building the LLM)")
    return build_mesh(ParallelDims(tp=tp, cp=cp, dp_shard=1), device_type=torch.device(device).type, stats=stats)


def load_draft_model(path: str | Path, target: Transformer, tokenizer: Tokenizer | None, *, dtype: torch.dtype,
                     device: str | torch.device) -> Transformer:
    """The draft model of speculative decoding: a meshlm checkpoint or Hugging Face directory whose vocabulary and
    tokenizer are the target's (ValueError otherwise: its proposals would be other tokens)."""
    draft, draft_tok = load_model_and_tokenizer(path, dtype=dtype, device=device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model {str(path)!r} has a vocabulary of {draft.config.vocab_size} tokens, the "
                         f"model {target.config.vocab_size}; give a draft model with the model's tokenizer")
    same = tokenizer is None or draft_tok is None or tokenizer_identity(draft_tok) == tokenizer_identity(tokenizer)
    if not same:
        raise ValueError(f"the draft model {str(path)!r} has another tokenizer than the model (the same ids are "
                         "other text); give a draft model trained with the model's tokenizer")
    return draft


def tokenizer_identity(tok: Tokenizer):
    """What must be equal for two tokenizers to give the same ids for the same text: the whole vocabulary."""
    inner = getattr(tok, "tokenizer", None)
    if inner is not None and hasattr(inner, "get_vocab"):
        return sorted(inner.get_vocab(with_added_tokens=True).items())
    return type(tok).__name__, getattr(tok, "vocab_size", None)


# The Engine arguments that count something (None: the default, where one is allowed).
WHOLE_ARGS = ("block_size", "num_blocks", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens",
              "max_model_len", "seed")


class LLM:
    def __init__(self, model: str | Path | Transformer, *, tp: int = 1, cp: int = 1, tokenizer: Tokenizer | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device = "auto", reuse_host_memory: bool = True,
                 comm_stats=None, **engine_kwargs):
        """`engine_kwargs` go to `Engine`: block_size, num_blocks, kv_cache_memory_bytes, max_num_seqs,
        max_num_batched_tokens, max_model_len, enable_prefix_caching, enable_chunked_prefill, eos_token_ids, seed,
        native_attention (decode attention by the compiled CPU kernel of `infer/native.py`; default True),
        speculative (a `infer.speculative.SpeculativeConfig` or a dict of its fields: speculative decoding; with
        method "draft" its `model` is loaded here, in `dtype` on `device`, and must share the tokenizer),
        kv_host_mb, kv_disk_dir, kv_disk_mb (KV cache tiers, per rank: prefix-cache blocks evicted from the cache
        kept in host memory, then in checksummed files that a later `LLM` of the same model and layout reads back;
        `infer/kv_tiers.py`).

        `reuse_host_memory` (on a CPU device): raise glibc malloc's mmap and trim thresholds for this process,
        so that each step reuses the memory the previous one freed instead of faulting fresh pages in
        (`host_memory.py`; ~10% of a CPU run's time otherwise). Process-wide; False leaves malloc alone.

        `tp`, `cp` > 1: on the tp x cp ranks of this launch (each rank calls this with the same arguments),
        the weights split over tp, every sequence's KV blocks spread over cp (`infer/parallel.py`); the KV
        cache arguments are per rank. On rank 0 it returns a usable LLM (`is_driver`); on the others it
        runs their part of every step and returns once rank 0 calls `close()`. `comm_stats`: a `comm_stats.CommStats`
        the ranks' communication is counted (or traced) into."""
        for name, value in (("tp", tp), ("cp", cp), *((k, engine_kwargs[k]) for k in WHOLE_ARGS if k in engine_kwargs)):
            if value is not None and not is_integer(value):
                raise ValueError(f"{name}={value!r} must be a whole number")
        if engine_kwargs.get("num_blocks") is not None and engine_kwargs["num_blocks"] < 1:
            raise ValueError(f"num_blocks={engine_kwargs['num_blocks']} must be >= 1 (or None: as many as "
                             "kv_cache_memory_bytes holds)")
        device, dtype = serving_device(device, dtype)
        if tp < 1 or cp < 1:
            raise ValueError(f"tp={tp} and cp={cp} must be >= 1")
        if reuse_host_memory and torch.device(device).type == "cpu":
            reuse_freed_host_memory()
        mesh = serving_mesh(tp, device, cp=cp, stats=comm_stats) if tp * cp > 1 else None
        net, tok = model_for_serving(model, tokenizer, dtype=dtype, device=device, engine_kwargs=engine_kwargs)
        self.model = net
        self.tokenizer = tok
        # Checked on every rank before any of them waits for steps: a refusal on rank 0 alone would leave them waiting.
        spec = engine_kwargs["speculative"] = SpeculativeConfig.of(engine_kwargs.get("speculative"))
        if spec is not None:
            spec.check_context(engine_kwargs.get("max_model_len") or net.config.max_seq_len)
            if spec.method == "draft":
                engine_kwargs["draft_model"] = load_draft_model(spec.model, net, tok, dtype=dtype, device=device)
        self.is_driver = True
        runner = build_runner(net, mesh, **{k: engine_kwargs.pop(k) for k in RUNNER_ARGS if k in engine_kwargs})
        if mesh is not None and not mesh.is_first:
            self.is_driver, self.engine = False, None
            run_worker(runner, mesh)
            return
        self.engine = Engine(runner.model, tok, runner=runner if mesh is None else ParallelRunner(runner, mesh),
                             **engine_kwargs)

    def close(self) -> None:
        """On several ranks: release the others (rank 0; afterwards this LLM generates no more)."""
        close = getattr(self.engine.runner, "close", None) if self.engine is not None else None
        if close is not None:
            close()

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Conversations through the model's chat template, as vLLM's `LLM.chat` and as the server builds a chat's
        prompt (`requests.chat_messages`, `chat_template_options`): one conversation ([{"role": ..., "content":
        ...}, ...]) or a list of them, one result per conversation. `tools` (the OpenAI API's function definitions)
        reach the template; `add_generation_prompt` opens the assistant's turn, `continue_final_message` (without
        it) continues the last, an assistant's, message; `chat_template_kwargs` are more of the template's
        variables (e.g. Qwen3's enable_thinking). A conversation the server would refuse raises ValueError."""
        from meshlm.infer.requests import APIError, ToolChoice, chat_messages, chat_template_options

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template: give generate() token ids")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("give a conversation ([{\"role\": ..., \"content\": ...}, ...]) or a list of them")
        body = {"tools": tools, "tool_choice": "none", "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message, "chat_template_kwargs": chat_template_kwargs}
        try:
            listed = ToolChoice.of(body)
            prompts = []
            for conversation in conversations:
                entries = chat_messages({"messages": conversation})
                prompts.append(self.tokenizer.encode_chat(entries, listed.tools if listed else None,
                                                          **chat_template_options(body, entries)))
        except APIError as e:
            raise ValueError(f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message) from None
        return self.generate(prompts, params)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *, rag=None, rag_top_k: int = 4,
                 rag_mode: str = "bm25") -> list[RequestOutput]:
        """One result per prompt, in order, each with `token_ids` (the generated ids) and `text`.

        `rag` (a `meshlm.infer.rag.RagIndex` or an index folder): each prompt (text) gets the `rag_top_k`
        passages found for it put before it (the template in `meshlm.infer.rag`), and its result's
        `retrieved` lists them (id, doc_id, title, score).
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)  # any iterable of prompts
        if prompts and is_integer(prompts[0]):
            prompts = [prompts]  # one prompt of token ids (a list, tuple or numpy array)
        retrieved = None
        if rag is not None:
            from meshlm.infer.rag import as_index, format_passages

            index = as_index(rag)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("rag= needs text prompts (each prompt is the search query), not token ids")
            retrieved = []
            for i, prompt in enumerate(prompts):
                passages = index.search(prompt, top_k=rag_top_k, mode=rag_mode)
                prompts[i] = format_passages(passages) + prompt
                retrieved.append([p.public() for p in passages])
        outputs = self.engine.generate(prompts, SamplingParams() if params is None else params)
        for out, found in zip(outputs, retrieved or []):
            out.retrieved = found
        return outputs
