"""Reasoning in a reply's text: the thinking a reasoning model writes before its answer, told apart from it.

Responsible for: `PARSERS`, chosen with `meshlm serve --reasoning-parser` (vLLM's and SGLang's flag of that
name): `deepseek_r1` (DeepSeek-R1 and its distillations, QwQ: the reply thinks from its first token -- R1's
template opens `<think>` in the prompt -- until `</think>`) and `qwen3` (Qwen3: the reply thinks if it begins with
`<think>` or its template's generation prompt left one open, as the thinking-only models' templates do; with
thinking off, the template closes the block there and the whole reply is the answer; a `<think>` in the messages'
own text opens nothing); `Thinking.split`, a reply's text as
(reasoning, content), of a whole reply or, streamed, of the text so far (what may still be `</think>` held back).
A grammar (structured outputs, a forced tool choice) holds a reply that starts thinking (`Thinking.opens`) only after
its `</think>` (`SamplingParams.structured_after`), as vLLM's do; one that may or may not think (Qwen3's generation
prompt leaves it to the model) is held from its first token, so it answers without thinking -- vLLM waits for a
`</think>` there too, which leaves a model that never writes one unheld.
Not responsible for: the answer's layout (responses.py: the reasoning goes out as `reasoning`, vLLM's field, and
`reasoning_content`, SGLang's and DeepSeek's), the template's `enable_thinking` (a request's
`chat_template_kwargs`). Torch-free.
"""

from __future__ import annotations

from meshlm.infer.tool_parsers import partial_marker_at

START, END = "<think>", "</think>"


class Thinking:
    """`<think>` ... `</think>` before the answer. `always_open`: every reply thinks from its first token."""

    def __init__(self, name: str, always_open: bool):
        self.name, self.always_open = name, always_open

    def opens(self, opening: str) -> bool:
        """Whether a reply starts thinking: always, or where what the template writes of it (`opening`:
        `Tokenizer.reply_opening`, the generation prompt or a continued message) leaves a `<think>` open -- never
        where it closed one (a prefilled `<think>...</think>`, or Qwen3's template with thinking off)."""
        if opening.rfind(END) > opening.rfind(START):
            return False
        return self.always_open or opening.rfind(START) > opening.rfind(END)

    def split(self, text: str, opened: bool, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a reply's `text` (None: none); `opened`: the reply starts thinking
        (`opens`); `final`: the whole reply, else the text so far, whose undecided end is left out of both (a
        possible `</think>`, or the start of a reply that may yet open `<think>`)."""
        if text.startswith(START):
            opened, text = True, text[len(START):]
        elif not final and START.startswith(text):  # it may yet begin with <think>
            return None, None
        elif not opened:
            return None, text
        reasoning, closed, content = text.partition(END)
        if closed:
            return reasoning or None, content or None
        return (text or None, None) if final else (text[:partial_marker_at(text, END)], None)


PARSERS = {p.name: p for p in (Thinking("deepseek_r1", always_open=True), Thinking("qwen3", always_open=False))}
