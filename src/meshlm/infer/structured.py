"""Structured outputs: a request's tokens held to a JSON schema, a regular expression, a list of choices or a grammar.

Responsible for: `StructuredOutputs`, what a request asks for (vLLM's `structured_outputs` fields: json, regex,
choice, grammar in Lark, json_object; OpenAI's `response_format` maps onto it), and `Grammars`, which compiles
it for one engine's tokenizer into a matcher (llguidance's `LLMatcher`: the grammar's state as tokens are
consumed) and turns a matcher's state into the tokens allowed next (`allowed`).
Not responsible for: sampling (sampling.py masks the logits with `allowed` and advances the matcher with the
token it picks), stopping (a sequence whose matcher has stopped is finished: sequence.py).

llguidance (the guidance project's Rust parser; vLLM's and SGLang's `guidance` backend, llama.cpp's) rather than
a parser of our own: it computes the allowed-token mask of a grammar over a byte-level vocabulary incrementally
in tens of microseconds, which a Python parser could not, and has no dependency of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from meshlm.infer.sequence import SamplingError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# each kind's value: what it must be (a check) and how the refusal says so
VALUES = {"json": (lambda v: isinstance(v, (dict, str)), "a JSON schema (an object or its text)"),
          "regex": (lambda v: isinstance(v, str), "a string"),
          "choice": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(c, str) and c for c in v),
                     "a non-empty list of non-empty strings"),
          "grammar": (lambda v: isinstance(v, str), "a Lark grammar (a string)"),
          "json_object": (lambda v: v is True, "true")}


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (the output is one of
    these strings), `grammar` (Lark, as llguidance reads it), `json_object` (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    @classmethod
    def of(cls, value) -> "StructuredOutputs":
        """From a StructuredOutputs or a dict of its fields, checked."""
        if isinstance(value, cls):
            given = value
        elif isinstance(value, dict) and set(value) <= set(KINDS):
            given = cls(**value)
        else:
            raise SamplingError("structured_outputs", f"structured_outputs={value!r} must be a StructuredOutputs or "
                                                      f"a dict of one of {', '.join(KINDS)}")
        if len(given.asked) != 1:
            raise SamplingError("structured_outputs", f"structured_outputs asks for {given.asked or 'nothing'}: give "
                                                      f"exactly one of {', '.join(KINDS)}")
        well_typed, what = VALUES[given.kind]
        if not well_typed(getattr(given, given.kind)):
            raise SamplingError("structured_outputs", f"structured_outputs {given.kind} must be {what}")
        return given

    @property
    def asked(self) -> list[str]:
        """The kinds set (one, once checked)."""
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.asked[0]

    def llguidance_grammar(self) -> str:
        """The request as llguidance's grammar (its JSON form)."""
        from llguidance import LLMatcher

        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.json is not None:
            schema = self.json if isinstance(self.json, dict) else json.loads(self.json)
            return LLMatcher.grammar_from_json_schema(schema)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # Lark's string literals are JSON's
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


class Grammars:
    """One engine's compiler of structured outputs: its tokenizer, as llguidance reads it, built on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._ll = None
        self._last = None  # (the StructuredOutputs last compiled, its fresh matcher): n choices compile once

    def _ll_tokenizer(self):
        if self._ll is None:
            try:
                import llguidance
            except ImportError:
                error = SamplingError("structured_outputs", "structured outputs need llguidance, which this server "
                                                            "lacks: pip install llguidance (the serve extra)")
                error.status = 501  # the server's own lack, not the request's mistake
                raise error from None
            inner = getattr(self.tokenizer, "tokenizer", None)  # HFTokenizer's `tokenizers.Tokenizer`
            eos = list(self.eos_token_ids) or None
            if inner is not None and hasattr(inner, "to_str"):
                self._ll = llguidance.LLTokenizer(inner.to_str(), n_vocab=self.vocab_size, eos_token=eos)
            elif type(self.tokenizer).__name__ == "ByteTokenizer":
                self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes(self.vocab_size, eos)))
            else:
                raise SamplingError("structured_outputs", "structured outputs need the model's tokenizer "
                                                          "(a tokenizer.json or the byte tokenizer)")
        return self._ll

    def matcher(self, structured: StructuredOutputs):
        """A fresh matcher of `structured` (its grammar's state before any token); a grammar that does not compile,
        or allows no text at all, is refused by name."""
        last = self._last
        if last is not None and last[0] is structured:  # the same request's next choice (n > 1)
            return last[1].deep_copy()
        tokenizer = self._ll_tokenizer()  # first: it says what a server without llguidance lacks
        from llguidance import LLMatcher

        try:
            grammar = structured.llguidance_grammar()
        except (ValueError, TypeError, RecursionError) as e:  # a schema that is not JSON (or nested past Python's
            # recursion limit), a regex or Lark that does not parse
            raise SamplingError("structured_outputs", f"structured_outputs {structured.kind} does not compile: "
                                                      f"{_first_line(e)}") from None
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SamplingError("structured_outputs", f"structured_outputs {structured.kind} does not compile: "
                                                      f"{error_of(matcher)}")
        matcher.compute_bitmask()  # the first step's tokens: a grammar that matches nothing fails here
        if matcher.is_error():
            raise SamplingError("structured_outputs", f"structured_outputs {structured.kind} matches no text: "
                                                      f"{error_of(matcher)}")
        self._last = (structured, matcher.deep_copy())
        return matcher


def allowed(matcher, vocab_size: int):
    """The tokens `matcher` allows next, as a bool tensor [vocab_size] (llguidance's bitmask unpacked: bit i of
    32-bit word w is token 32 w + i)."""
    import torch

    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    mask = bits.flatten().bool()[:vocab_size]
    if mask.numel() < vocab_size:  # logits wider than the tokenizer's vocabulary: the padding is never allowed
        mask = torch.cat([mask, mask.new_zeros(vocab_size - mask.numel())])
    return mask


class _Bytes:
    """The byte tokenizer as llguidance's TokenizerWrapper reads a tokenizer: token i is byte i."""

    def __init__(self, vocab_size: int, eos: list[int] | None):
        self.tokens = [bytes([i]) for i in range(min(vocab_size, 256))]
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None
        self.special_token_ids = []

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def error_of(matcher) -> str:
    """A matcher's error, its first line (llguidance appends its whole state and grammar)."""
    return _first_line(matcher.get_error())


def _first_line(error) -> str:
    text = str(error).strip()
    return (text.splitlines() or ["?"])[0][:300]


def grammar_starts(seq, text: str, searched: int, encode) -> SamplingError | None:
    """A grammar that waits for `seq.params.structured_after` (`seq.waiting_matcher`) holds the next tokens once the
    generated `text` (its first `searched` characters looked at already) has reached it; what the text holds past it
    already (the rest of the token that ended it, or a character held back with it) is the grammar's first text,
    `encode`d, or the request's failure where the grammar refuses it."""
    marker = seq.params.structured_after
    at = text.find(marker, max(0, searched - len(marker) + 1))  # the new text only
    if at < 0:
        return None
    seq.matcher, seq.waiting_matcher = seq.waiting_matcher, None
    rest = text[at + len(marker):]
    if rest and not (seq.matcher.consume_tokens(encode(rest, add_special_tokens=False)) and not seq.matcher.is_error()):
        return SamplingError("structured_outputs", f"the text after {marker!r} in the token that ends it, "
                                                   f"{rest[:40]!r}, does not follow structured_outputs")
    return None
