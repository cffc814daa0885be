"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`.

Responsible for: loading a model and its tokenizer from a Hugging Face directory (config.json,
safetensors, tokenizer.json) or a meshlm training checkpoint, building the `Engine`, and running a
batch of prompts to completion through continuous batching.
Not responsible for: serving (server.py) or tensor-parallel inference (`tp` > 1 is not there yet).
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshlm.infer.engine import Engine, RequestOutput
from meshlm.infer.sequence import SamplingParams
from meshlm.infer.tokenizer import Tokenizer, read_eos_token_ids
from meshlm.models.transformer import Transformer


class _WrappedTokenizer(Tokenizer):
    """A meshlm training tokenizer (ByteTokenizer / HFTokenizer of meshlm.train.data) seen as ours."""

    def __init__(self, tok):
        eos = getattr(tok, "eos_token_id", None)
        super().__init__(tok, eos_token_ids=(eos,) if eos is not None else ())

    @property
    def vocab_size(self) -> int:
        return int(getattr(self.tokenizer, "vocab_size", 0))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids)


def load_model_and_tokenizer(model: str | Path, *, dtype: torch.dtype = torch.float32,
                             device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer | None]:
    """A Hugging Face directory (config.json + safetensors) or a meshlm checkpoint / run directory."""
    path = Path(model)
    if not path.exists():
        raise ValueError(f"model {str(model)!r} does not exist; give a Hugging Face model directory or a "
                         "meshlm checkpoint (downloads are not done here)")
    if (path / "config.json").is_file():
        from meshlm.models.hf import load_pretrained

        return load_pretrained(path, dtype=dtype, device=device).eval(), Tokenizer.from_dir(path)
    from meshlm.train.checkpoint import load_checkpoint_for_inference

    net, _, tok = load_checkpoint_for_inference(path, device=device, dtype=dtype)
    return net, _WrappedTokenizer(tok)


class LLM:
    def __init__(self, model: str | Path | Transformer, *, tp: int = 1, tokenizer: Tokenizer | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device = "auto", **engine_kwargs):
        """`engine_kwargs` go to `Engine`: block_size, num_blocks, kv_cache_memory_bytes, max_num_seqs,
        max_num_batched_tokens, max_model_len, enable_prefix_caching, enable_chunked_prefill, eos_token_ids, seed."""
        if device == "auto":  # the GPU when there is one, as training does
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype is None:
            dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        if tp != 1:
            raise ValueError(f"tp={tp}: tensor-parallel inference is not available yet; use tp=1")
        if isinstance(model, Transformer):
            net, tok = model.eval(), tokenizer
        else:
            net, tok = load_model_and_tokenizer(model, dtype=dtype, device=device)
            tok = tokenizer or tok
            if tok is None and "eos_token_ids" not in engine_kwargs and Path(model, "config.json").is_file():
                engine_kwargs["eos_token_ids"] = read_eos_token_ids(model)
        self.model = net
        self.tokenizer = tok
        self.engine = Engine(net, tok, **engine_kwargs)

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, *, rag=None, rag_top_k: int = 4,
                 rag_mode: str = "bm25") -> list[RequestOutput]:
        """One result per prompt, in order, each with `token_ids` (the generated ids) and `text`.

        `rag` (a `meshlm.infer.rag.RagIndex` or an index folder): each prompt (text) gets the `rag_top_k`
        passages found for it put before it (the template in `meshlm.infer.rag`), and its result's
        `retrieved` lists them (id, doc_id, title, score).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
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
        outputs = self.engine.generate(prompts, params or SamplingParams())
        for out, found in zip(outputs, retrieved or []):
            out.retrieved = found
        return outputs
