"""The OpenAI API's response bodies: what a completion or chat completion request gets back.

Responsible for: the layout of both endpoints' answers, whole (`Replies.response`) or streamed as server-sent
events (`Replies.event`, `Replies.usage_event`, `sse`): the choices in OpenAI's order (prompt x n + sample),
their text or message, their logprobs (`completion_logprobs`, `chat_logprobs`), the passages of a
retrieval-augmented request (`retrieved`), and the token usage.
Not responsible for: checking requests (requests.py), HTTP or waiting for the engine (server.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlm.infer.engine import RequestOutput


def completion_logprobs(logprobs: list[dict], dec) -> dict:
    return {"tokens": [dec(lp["token"]) for lp in logprobs],
            "token_logprobs": [lp["logprob"] for lp in logprobs],
            "top_logprobs": [{dec(t): v for t, v in lp["top"].items()} for lp in logprobs]}


def echoed_logprobs(prompt_ids: list[int], prompt_logprobs: list[dict | None] | None, dec) -> dict:
    """`completion_logprobs` of an echoed prompt: every prompt token, the first without a log-probability (null,
    as OpenAI's legacy API and vLLM answer), the others given the tokens before them."""
    lps = prompt_logprobs or [None] * len(prompt_ids)
    return {"tokens": [dec(t) for t in prompt_ids],
            "token_logprobs": [None if lp is None else lp["logprob"] for lp in lps],
            "top_logprobs": [None if lp is None else {dec(t): v for t, v in lp["top"].items()} for lp in lps]}


def chat_logprobs(logprobs: list[dict], dec) -> dict:
    """Chat's logprobs: each token's text, its UTF-8 `bytes` (OpenAI's field; a token that is part of a character
    decodes to U+FFFD, whose bytes these are, as vLLM gives), its log-probability and its top alternatives."""
    def entry(token: int, logprob: float) -> dict:
        text = dec(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(lp["token"], lp["logprob"])
                        | {"top_logprobs": [entry(t, v) for t, v in lp["top"].items()]} for lp in logprobs]}


def usage(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def sse(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


@dataclass
class Replies:
    """How the choices of one request are written back: `chat` or completion, under the response id `rid`."""

    chat: bool
    rid: str
    model: str  # the served model's name
    dec: Callable[[int], str]  # a token id -> its text (logprobs name tokens by their text)
    logprobs: bool  # the request asked for logprobs
    retrieved: list[list[dict]] | None  # the passages of each prompt (retrieval-augmented requests)
    n: int  # choices per prompt: choice i answers prompt i // n
    echo: list[str] | None = None  # each prompt's text, which a completion's text begins with (`echo`)

    def response(self, outputs: list[RequestOutput], num_prompt: int) -> dict:
        """The whole answer: every choice's finished output, in choice order."""
        choices = []
        for i, out in enumerate(outputs):
            choice = {"index": i, "finish_reason": out.finish_reason}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
                choice["logprobs"] = chat_logprobs(out.logprobs, self.dec) if self.logprobs else None
            else:
                choice["text"] = out.text if self.echo is None else self.echo[i // self.n] + out.text
                choice["logprobs"] = completion_logprobs(out.logprobs, self.dec) if self.logprobs else None
                if self.echo is not None and self.logprobs:
                    head = echoed_logprobs(out.prompt_token_ids, out.prompt_logprobs, self.dec)
                    choice["logprobs"] = {k: head[k] + choice["logprobs"][k] for k in head}
            if self.retrieved is not None:
                choice["retrieved"] = self.retrieved[i // self.n]
            choices.append(choice)
        completion = sum(len(o.token_ids) for o in outputs)
        response = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                    "created": int(time.time()), "model": self.model, "choices": choices,
                    "usage": usage(num_prompt, completion)}
        if self.retrieved is not None:
            if len(self.retrieved) == 1:
                response["retrieved"] = self.retrieved[0]
        return response

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def event(self, i: int, delta: str | None, finish_reason, *, first=False, logprobs=None) -> str:
        """A streamed chunk of choice `i`: new text (`delta`), its tokens' `logprobs`, or how it finished;
        `first`: the chunk that opens a chat choice (its role) or a retrieval-augmented one (its passages)."""
        choice = {"index": i, "finish_reason": finish_reason}
        if first and self.retrieved is not None:
            choice["retrieved"] = self.retrieved[i // self.n]
        if self.chat:
            d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
            choice["delta"] = d
            if logprobs:
                choice["logprobs"] = chat_logprobs(logprobs, self.dec)
        else:
            choice["text"] = delta or ""
            if logprobs:
                choice["logprobs"] = completion_logprobs(logprobs, self.dec)
        return sse({"id": self.rid, "object": self.chunk_kind, "created": int(time.time()), "model": self.model,
                    "choices": [choice]})

    def usage_event(self, num_prompt: int, num_completion: int) -> str:
        """The last chunk of a stream that asked for `stream_options.include_usage`."""
        return sse({"id": self.rid, "object": self.chunk_kind, "created": int(time.time()), "model": self.model,
                    "choices": [], "usage": usage(num_prompt, num_completion)})
