"""Text <-> token ids for the engine, read from a Hugging Face model directory.

Responsible for: loading `tokenizer.json` (the `tokenizers` library, no transformers needed), the end
of sequence ids (config.json / generation_config.json / tokenizer_config.json), and rendering chat
messages with the model's chat template (jinja, as Hugging Face does) or, for a tokenizer without
one, with this fallback template:

    <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n

(each message as `<|role|>`, a newline, its content and a newline; then `<|assistant|>` and a
newline to prompt the reply).
Not responsible for: training tokenizers or detokenizing incrementally (engine.py).
"""

from __future__ import annotations

import json
from pathlib import Path

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def read_eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids named by a Hugging Face directory's generation_config.json / config.json."""
    eos: list[int] = []
    for cfg in (_read_json(Path(path) / "generation_config.json"), _read_json(Path(path) / "config.json")):
        value = cfg.get("eos_token_id")
        for t in (value if isinstance(value, list) else [value]):
            if isinstance(t, int) and t not in eos:
                eos.append(t)
    return tuple(eos)


class Tokenizer:
    def __init__(self, tokenizer, *, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer | None":
        """The tokenizer of a Hugging Face directory, or None if it has no tokenizer.json."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        special = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = tok_cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        eos = list(read_eos_token_ids(path))
        if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
            t = tok.token_to_id(special["eos_token"])
            if t not in eos:
                eos.append(t)
        template = tok_cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tok, eos_token_ids=tuple(eos), chat_template=template, special_tokens=special)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for chat `messages` ([{"role": ..., "content": ...}]), ending where the reply starts."""
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template or FALLBACK_CHAT_TEMPLATE)
        return self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self.special_tokens.get("bos_token", ""),
                                     eos_token=self.special_tokens.get("eos_token", ""))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # A template writes the special tokens (e.g. BOS) itself; the fallback one does not.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=self.chat_template is None)


def _raise(message: str):
    raise ValueError(message)
