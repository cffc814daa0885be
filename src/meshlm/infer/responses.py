"""The OpenAI API's response bodies: what a completion or chat completion request gets back.

Responsible for: the layout of both endpoints' answers, whole (`Replies.response`) or streamed as server-sent
events (`Replies.event`, `Replies.echo_event`, `Replies.usage_event`, `sse`): the choices in OpenAI's order
(prompt x n + sample), their text or message (an echoed prompt first), their logprobs (`completion_logprobs` with
its `text_offset`, `chat_logprobs` with `bytes`), a chat's tool calls (`tool_calls`, read from its text by
`tool_parsers`; streamed, the text that may be a call held back until they end), the passages of a
retrieval-augmented request (`retrieved`), and the token usage.
Not responsible for: checking requests (requests.py), HTTP or waiting for the engine (server.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlm.infer.engine import RequestOutput
    from meshlm.infer.tool_parsers import Call


def completion_logprobs(token_ids: list[int], logprobs: list[dict | None], dec, offset: int = 0,
                        widths: list[int] | None = None) -> dict:
    """A completion's logprobs (OpenAI's legacy layout): each token's text, its log-probability and top
    alternatives (None where there is none: an echoed prompt's first token), and `text_offset`: the lengths of
    the tokens before it summed from `offset` (`widths`; default their texts', as vLLM counts) -- where it begins
    in the choice's text, unless a text prompt's BOS or a token that splits a character shifts them."""
    tokens = [dec(t) for t in token_ids]
    widths = [len(t) for t in tokens] if widths is None else widths
    return {"tokens": tokens, "text_offset": list(accumulate(widths, initial=offset))[:-1],
            "token_logprobs": [None if lp is None else lp["logprob"] for lp in logprobs],
            "top_logprobs": [None if lp is None else {dec(t): v for t, v in lp["top"].items()} for lp in logprobs]}


def chat_logprobs(logprobs: list[dict], dec) -> dict:
    """Chat's logprobs: each token's text, its UTF-8 `bytes` (OpenAI's field; a token that is part of a character
    decodes to U+FFFD, whose bytes these are, as vLLM gives), its log-probability and its top alternatives."""
    def entry(token: int, logprob: float) -> dict:
        text = dec(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(lp["token"], lp["logprob"])
                        | {"top_logprobs": [entry(t, v) for t, v in lp["top"].items()]} for lp in logprobs]}


def tool_calls(calls: list[Call]) -> list[dict]:
    """The OpenAI API's tool calls of (name, arguments) pairs: each with an id, its arguments as JSON text."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for name, arguments in calls]


def usage(num_prompt: int, num_completion: int, cached: int = 0) -> dict:
    """OpenAI's usage; `cached`: the prompt tokens the prefix cache held (`prompt_tokens_details.cached_tokens`)."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion, "prompt_tokens_details": {"cached_tokens": cached}}


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
    prompt_only: bool = False  # echo without tokens (max_tokens 0): the one token the engine sampled is left out
    streamed: dict[int, int] = field(default_factory=dict)  # choice -> characters of token text streamed so far
    # a chat's tool-call format (tool_parsers: a forced choice's or --tool-call-parser's): its replies' calls are
    # read from their text; streamed, the text that may be a call is held back until the reply ends
    calls: object = None
    # a chat's reasoning format (reasoning.Thinking, --reasoning-parser's) and whether its replies (one prompt) start
    # thinking: the reasoning goes out apart from the content
    reasoning: object = None
    thinking: bool = False
    said: dict[int, str] = field(default_factory=dict)  # a chat choice's text so far (with `calls` or `reasoning`)
    released: dict[int, tuple[int, int]] = field(default_factory=dict)  # ... its reasoning and content sent
    # a generated token id -> the text it adds to the choice's (a special token: none); None: its `dec` text
    shown: Callable[[int], str] | None = None

    def response(self, outputs: list[RequestOutput], num_prompt: int) -> dict:
        """The whole answer: every choice's finished output, in choice order."""
        choices = []
        for i, out in enumerate(outputs):
            choice = {"index": i, "finish_reason": self.finish_reason(out)}
            if self.chat:
                reasoning, content, calls = self.parts(i, out.text)
                choice["message"] = {"role": "assistant", "content": content, **self.reasoning_fields(reasoning)}
                if calls:
                    choice["message"]["tool_calls"] = tool_calls(calls)
                    choice["finish_reason"] = "tool_calls"
                choice["logprobs"] = chat_logprobs(out.logprobs, self.dec) if self.logprobs else None
            else:
                head = "" if self.echo is None else self.echo[i // self.n]
                choice["text"] = head if self.prompt_only else head + out.text
                choice["logprobs"] = self.whole_logprobs(out) if self.logprobs else None
            if self.retrieved is not None:
                choice["retrieved"] = self.retrieved[i // self.n]
            choices.append(choice)
        response = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                    "created": int(time.time()), "model": self.model, "choices": choices,
                    "usage": usage(num_prompt, self.completion_tokens(outputs),
                                   self.cached_tokens(enumerate(outputs)))}
        if self.retrieved is not None:
            if len(self.retrieved) == 1:
                response["retrieved"] = self.retrieved[0]
        return response

    def finish_reason(self, out: RequestOutput) -> str | None:
        """A choice's finish reason: "length" for an echo without tokens (the one the engine sampled is left out)."""
        return "length" if self.prompt_only else out.finish_reason

    def completion_tokens(self, outputs) -> int:
        """The tokens the choices answered (none for an echo without tokens)."""
        return 0 if self.prompt_only else sum(len(o.token_ids) for o in outputs)

    def cached_tokens(self, choices) -> int:
        """The prompt tokens the prefix cache held, once per prompt (its first choice's), of (index, output)
        pairs."""
        return sum(out.num_cached_tokens for i, out in choices if i % self.n == 0)

    @staticmethod
    def prompt_part(out: RequestOutput) -> tuple[list[int], list[dict | None]]:
        """An echoed prompt's token ids and their logprob entries (the first None)."""
        ids = list(out.prompt_token_ids)
        return ids, list(out.prompt_logprobs or [None] * len(ids))

    def whole_logprobs(self, out: RequestOutput) -> dict:
        """A completion's logprobs: the prompt's first where it is echoed (its first token without one), then the
        generated tokens'."""
        ids, entries = self.prompt_part(out) if self.echo is not None else ([], [])
        widths = [len(self.dec(t)) for t in ids]  # an echoed prompt's text shows its special tokens
        if not self.prompt_only:
            generated = [lp["token"] for lp in out.logprobs]
            ids += generated
            entries += out.logprobs
            widths += self.widths(generated)
        return completion_logprobs(ids, entries, self.dec, widths=widths)

    def widths(self, generated: list[int]) -> list[int]:
        """The lengths generated tokens add to a choice's text."""
        return [len((self.shown or self.dec)(t)) for t in generated]

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def event(self, i: int, delta: str | None, finish_reason, *, first=False, logprobs=None) -> str:
        """A streamed chunk of choice `i`: new text (`delta`), its tokens' `logprobs`, or how it finished;
        `first`: the chunk that opens a chat choice (its role) or a retrieval-augmented one (its passages). Empty
        where a chat's text is all held back and it carries nothing else."""
        choice = {"index": i, "finish_reason": finish_reason}
        if first and self.retrieved is not None:
            choice["retrieved"] = self.retrieved[i // self.n]
        if self.chat:
            if first:
                d = {"role": "assistant", "content": ""}
            elif self.calls is not None or self.reasoning is not None:
                d = self.release(i, delta)
            else:
                d = {"content": delta} if delta else {}
            if not (first or d or logprobs or finish_reason):
                return ""  # all of its text held back: nothing to send
            choice["delta"] = d
            if logprobs:
                choice["logprobs"] = chat_logprobs(logprobs, self.dec)
        else:
            choice["text"] = delta or ""
            if logprobs:
                ids = [e["token"] for e in logprobs]
                widths = self.widths(ids)
                choice["logprobs"] = completion_logprobs(ids, logprobs, self.dec, self.streamed.get(i, 0), widths)
                self.streamed[i] = self.streamed.get(i, 0) + sum(widths)
        return self.chunk(choice)

    def parts(self, i: int, text: str, final: bool = True) -> tuple[str | None, str | None, list]:
        """Chat choice `i`'s reasoning, content and tool calls in its `text`: the whole reply's (`final`), or the
        text so far's, of which what may still be `</think>` or a call is held back (no calls yet)."""
        reasoning, content = (None, text) if self.reasoning is None else \
            self.reasoning.split(text, self.thinking, final)
        if self.calls is None or content is None:
            return reasoning, content, []
        if not final:
            sent = self.released.get(i, (0, 0))[1]
            return reasoning, content[:max(sent, self.calls.hold(content))], []
        parsed = self.calls.parse(content)
        return (reasoning, *parsed) if parsed is not None else (reasoning, content, [])

    def reasoning_fields(self, reasoning: str | None) -> dict:
        """A message's or delta's reasoning: as `reasoning` (vLLM's field) and `reasoning_content` (SGLang's and
        DeepSeek's API's); none without a reasoning parser."""
        return {} if self.reasoning is None else {"reasoning": reasoning, "reasoning_content": reasoning}

    def release(self, i: int, delta: str | None) -> dict:
        """A streamed chat choice's delta for its new text: the reasoning and content that may go out now."""
        text = self.said[i] = self.said.get(i, "") + (delta or "")
        return self.delta_since(i, *self.parts(i, text, final=False)[:2])

    def delta_since(self, i: int, reasoning: str | None, content: str | None) -> dict:
        """The delta of choice `i`'s reasoning and content beyond what went out (and note it went out)."""
        r_sent, c_sent = self.released.get(i, (0, 0))
        d = self.reasoning_fields(reasoning[r_sent:]) if reasoning and reasoning[r_sent:] else {}
        if content and content[c_sent:]:
            d["content"] = content[c_sent:]
        self.released[i] = (max(r_sent, len(reasoning or "")), max(c_sent, len(content or "")))
        return d

    def finish_events(self, i: int, out: RequestOutput) -> list[str]:
        """The chunks that end streamed choice `i`: with a tool-call or reasoning format, the text held back and
        the calls the reply makes (whole, in one chunk), then the finish reason ("tool_calls" if it made any)."""
        reason = self.finish_reason(out)
        if not self.chat or (self.calls is None and self.reasoning is None):
            return [self.event(i, None, reason)]
        reasoning, content, calls = self.parts(i, out.text)
        d = self.delta_since(i, reasoning, content)
        self.said.pop(i, None), self.released.pop(i, None)
        events = [self.chunk({"index": i, "finish_reason": None, "delta": d})] if d else []
        if calls:
            entries = [{"index": k, **call} for k, call in enumerate(tool_calls(calls))]
            events.append(self.chunk({"index": i, "finish_reason": None, "delta": {"tool_calls": entries}}))
            reason = "tool_calls"
        return [*events, self.chunk({"index": i, "finish_reason": reason, "delta": {}})]

    def chunk(self, choice: dict) -> str:
        """One streamed chunk of one choice."""
        return sse({"id": self.rid, "object": self.chunk_kind, "created": int(time.time()), "model": self.model,
                    "choices": [choice]})

    def echo_event(self, i: int, out: RequestOutput) -> str:
        """The chunk that opens an echoed completion's choice `i`: its prompt's text, and its prompt's logprobs
        where asked (`out` is the choice's first output, after its prefill)."""
        choice = {"index": i, "finish_reason": None, "text": self.echo[i // self.n]}
        if self.logprobs:
            choice["logprobs"] = completion_logprobs(*self.prompt_part(out), self.dec)
            self.streamed[i] = sum(map(len, choice["logprobs"]["tokens"]))
        return self.chunk(choice)

    def usage_event(self, num_prompt: int, num_completion: int, cached: int = 0) -> str:
        """The last chunk of a stream that asked for `stream_options.include_usage`."""
        return sse({"id": self.rid, "object": self.chunk_kind, "created": int(time.time()), "model": self.model,
                    "choices": [], "usage": usage(num_prompt, num_completion, cached)})
