"""Text <-> token ids, one type for training and serving: bytes, or a Hugging Face `tokenizer.json`.

Responsible for: the `Tokenizer` base every tokenizer here shares (encode, decode, the end-of-sequence ids,
chat rendering); `ByteTokenizer` (UTF-8 bytes, vocabulary 256, nothing to download); `HFTokenizer` (a
`tokenizer.json` through the `tokenizers` library, no transformers needed), read either alone (what a
training run names in `data.tokenizer`) or from a Hugging Face model directory (its end-of-sequence ids from
config.json / generation_config.json / tokenizer_config.json, its chat template); `load_tokenizer`, the way a
training run gets its tokenizer (`conversation_tokenizer` for conversations: a model folder's, with its template);
and `encode_documents`, the token stream training packs
(`encode_with_starts`: with where each document begins, for document masking).

Chat messages are rendered with the model's chat template (jinja, sandboxed, with the extensions, filters and
globals transformers gives it: `_template_environment`) or, for a tokenizer without one, with this fallback template:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

(each message as `<|role|>`, a newline, its content and a newline; then `<|assistant|>` and a newline to
prompt the reply).

A tokenizer a meshlm run trained with is `plain`: training packed documents without special tokens (an EOS
between documents), so its text is encoded without them and decoded with them kept, as it was seen.
Not responsible for: training tokenizers, detokenizing incrementally (infer/engine.py), the corpus
(meshlm.data.text).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np

FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# What a checkpoint carries of a chat template its model was trained with (its chat_template and special tokens,
# as a Hugging Face tokenizer_config.json holds them), beside its tokenizer.json
CHAT_CONFIG_FILE = "tokenizer_config.json"

# Names an end-of-sequence token goes by in tokenizer.json files that come without a model directory.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


class Tokenizer:
    """What training, generation and the server need of a tokenizer."""

    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    special_tokens: dict[str, str] = {}
    _template = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], *, skip_special_tokens: bool | None = None) -> str:
        raise NotImplementedError

    def encode_documents(self, texts: list[str]) -> np.ndarray:
        """One int32 token stream for many documents, each followed by EOS when there is one."""
        return self.encode_with_starts(texts)[0]

    def encode_with_starts(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """`encode_documents`' stream and where each document begins in it (int64 offsets, one per document, in
        order; a document's separator -- EOS, or the byte tokenizer's blank line -- is its own last token)."""
        raise NotImplementedError

    @property
    def separator(self) -> list[int]:
        """The tokens `encode_with_starts` puts after each document: EOS when there is one."""
        return [self.eos_token_id] if self.eos_token_id is not None else []

    def encode_with_offsets(self, text: str, *,
                            add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids int32, where each token's characters begin in `text` and where they end, int64) of
        `encode(text)`: what a conversation's loss mask reads (`meshlm.data.chat`). A token the tokenizer adds
        itself (BOS) is empty at 0."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            variables: dict | None = None) -> str:
        """The prompt text for chat `messages` ([{"role": ..., "content": ...}]), ending where the reply starts;
        `tools` (the OpenAI API's function definitions) are the template's `tools`, for templates that list them.
        `add_generation_prompt`: the template opens the assistant's turn; `continue_final_message`: the text ends
        with the last message's content instead (what the template writes after it is cut), so that the reply
        continues it; `variables`: more of the template's variables (e.g. Qwen3's `enable_thinking`)."""
        cut = f"<meshlm-continue-{uuid.uuid4().hex}>" if continue_final_message else ""  # marks where to end
        if cut:
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + cut}]
        try:
            if self._template is None:  # a template that does not compile is refused as any other
                self._template = _template_environment().from_string(self.chat_template or FALLBACK_CHAT_TEMPLATE)
            text = self._template.render(**(variables or {}), messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.special_tokens.get("bos_token", ""),
                                         eos_token=self.special_tokens.get("eos_token", ""))
        except Exception as e:  # noqa: BLE001 -- the template's own failure, whatever it is
            # its raise_exception("roles must alternate"), a filter given what it cannot take, or none such, a
            # division by zero, a range the sandbox refuses, a macro that recurses without end
            raise ChatTemplateError(e) from e
        if cut:
            if text.count(cut) != 1:
                raise ChatTemplateError(ValueError("continue_final_message: the chat template does not write the "
                                                   "last message's content once as sent, so the prompt cannot end "
                                                   "inside it"), field="continue_final_message")
            text = text[:text.index(cut)]
        return text

    def reply_opening(self, messages: list[dict], tools: list[dict] | None = None, *, whole: str | None = None,
                      **options) -> str:
        """What the prompt of `apply_chat_template(messages, tools, **options)` (`whole`, if rendered already)
        writes of the reply itself, after
        the last message: the generation prompt (e.g. Qwen3's "<|im_start|>assistant\n", with "<think>\n" where
        its template opens the thinking), or the last message's content that the reply continues; "" where the
        template writes none. A template that writes the turns otherwise without its generation prompt (or refuses
        to) is read after the last message's content."""
        if options.get("continue_final_message"):
            return messages[-1]["content"]
        if not options.get("add_generation_prompt", True):
            return ""
        whole = self.apply_chat_template(messages, tools, **options) if whole is None else whole
        try:
            before = self.apply_chat_template(messages, tools, **{**options, "add_generation_prompt": False})
        except Exception:  # noqa: BLE001 -- a template that insists on a generation prompt: read after the content
            before = None
        if before is not None and whole.startswith(before):
            return whole[len(before):]
        last = messages[-1]["content"]  # a template that writes the turns otherwise without it
        return whole[whole.rfind(last) + len(last):] if last and last in whole else ""

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **options) -> list[int]:
        """`apply_chat_template(messages, tools, **options)`'s token ids."""
        return self.encode_prompt(self.apply_chat_template(messages, tools, **options))

    def encode_prompt(self, text: str) -> list[int]:
        """A chat prompt's text (`apply_chat_template`'s) as token ids: a template writes the special tokens (e.g.
        BOS) itself; the fallback one does not."""
        return self.encode(text, add_special_tokens=self.prompt_special_tokens)

    @property
    def prompt_special_tokens(self) -> bool:
        """Whether a chat prompt's text is encoded with the tokenizer's special tokens: a template writes them
        itself (e.g. BOS); the fallback one does not."""
        return self.chat_template is None


def _template_environment():
    """Jinja as transformers (and so vLLM) renders chat templates: sandboxed, trim_blocks and lstrip_blocks,
    `{% break %}` / `{% continue %}`, `{% generation %}`, `raise_exception`, `strftime_now` (today's date, which
    Llama 3.1's template writes), and a `tojson` that keeps keys in order and text unescaped (jinja's own sorts keys
    and escapes `<`, `>`, `&`, `'` and every non-ASCII character: tools would be written otherwise than the model
    was trained with)."""
    from datetime import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols,
                                                                                         _generation_tag()])
    env.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _generation_tag():
    """Jinja's extension for transformers' `{% generation %} ... {% endgeneration %}` (a template's marking of the
    assistant's text, for its assistant mask): written through as its body (meshlm finds the assistant's text from
    the turns themselves, `meshlm.data.chat`)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


class ChatTemplateError(ValueError):
    """A chat template's refusal of the messages (its raise_exception, a filter given what it cannot take, or a
    continued message it does not write as sent); `field`: the request's field it names."""

    def __init__(self, error: Exception, field: str = "messages"):
        super().__init__(f"the model's chat template rejects these messages: {type(error).__name__}: {error}")
        self.field = field


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: vocabulary 256, no special tokens, nothing to download."""

    vocab_size = 256

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], *, skip_special_tokens: bool | None = None) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def encode_with_starts(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Documents joined by a blank line (vectorised: no Python loop per byte)."""
        parts, sep = [t.encode("utf-8") for t in texts], bytes(self.separator)
        blob = sep.join(parts)
        lengths = np.asarray([len(p) + len(sep) for p in parts], dtype=np.int64)  # each with the blank line after it
        return np.frombuffer(blob, dtype=np.uint8).astype(np.int32), np.cumsum(lengths) - lengths

    separator = [10, 10]  # a blank line

    def encode_with_offsets(self, text: str, *,
                            add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        width = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)  # UTF-8 bytes of each character
        starts = np.repeat(np.arange(len(points), dtype=np.int64), width)  # a byte: of its character
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32), starts, starts + 1


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` with its end-of-sequence ids and chat template."""

    def __init__(self, tokenizer, *, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, plain: bool = False, path: str | None = None):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}
        self.plain = plain
        self.path = path

    @classmethod
    def from_file(cls, path: str | Path) -> "HFTokenizer":
        """A lone tokenizer.json, as a training run names it: plain, EOS found by its usual names."""
        tok = read_tokenizer_json(Path(path))
        eos = eos_by_name(tok)
        return cls(tok, eos_token_ids=(eos,) if eos is not None else (), plain=True, path=str(path))

    @classmethod
    def from_dir(cls, path: str | Path) -> "HFTokenizer | None":
        """The tokenizer of a Hugging Face directory, or None if it has no tokenizer.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        tok = read_tokenizer_json(path / "tokenizer.json")
        tok_cfg = _read_json(path / "tokenizer_config.json")
        special, eos = _special_tokens(tok, tok_cfg, read_eos_token_ids(path))
        template = tok_cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(tok, eos_token_ids=eos, chat_template=template, special_tokens=special,
                   path=str(path / "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        add = not self.plain if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(text, add_special_tokens=add).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool | None = None) -> str:
        skip = not self.plain if skip_special_tokens is None else skip_special_tokens
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip)

    def encode_with_starts(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Documents encoded in one batch call (parallel in Rust), each followed by EOS when there is one."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        sep = np.asarray(self.separator, dtype=np.int32)
        parts = [p for enc in encodings for p in [np.asarray(enc.ids, dtype=np.int32), sep]]
        lengths = np.asarray([len(enc.ids) + len(sep) for enc in encodings], dtype=np.int64)
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)), np.cumsum(lengths) - lengths

    def encode_with_offsets(self, text: str, *,
                            add_special_tokens: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, dtype=np.int32), offsets[:, 0], offsets[:, 1]


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer a training run names in `data.tokenizer`: bytes for no path, else a tokenizer.json (or a
    folder holding one), plain. A Hugging Face model directory, with its own EOS ids and chat template, is
    `HFTokenizer.from_dir`."""
    if not path:
        return ByteTokenizer()
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"tokenizer {str(path)!r} is not a tokenizer.json nor a folder holding one; pass one, "
                         "or leave data.tokenizer empty for bytes")
    return HFTokenizer.from_file(p)


def conversation_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer conversations are rendered and tokenized with for training (in memory, or by `meshlm data
    prepare`): `load_tokenizer(path)`, but that of the Hugging Face model folder `path` names (the folder, or the
    tokenizer.json inside it: `meshlm convert --to-meshlm` copies the model's files there) when it has a chat
    template, with that template and the folder's end-of-sequence ids."""
    tokenizer = load_tokenizer(path)
    if path:
        given = Path(path)
        folder = given if given.is_dir() else given.parent if given.name == "tokenizer.json" else None
        templated = HFTokenizer.from_dir(folder) if folder is not None else None
        if templated is not None and templated.chat_template:
            eos = templated.special_tokens.get("eos_token")
            if eos is not None and templated.tokenizer.token_to_id(eos) is None:
                raise ValueError(f"{folder}'s tokenizer_config.json names eos_token {eos!r}, which is not a token of "
                                 "its tokenizer.json: conversations would be trained without their end of turn; fix "
                                 "the folder's eos_token")
            return templated
    return tokenizer


def chat_config(tokenizer: Tokenizer) -> dict | None:
    """What a checkpoint saves of `tokenizer`'s chat template (`CHAT_CONFIG_FILE`), None when it has none."""
    if not tokenizer.chat_template:
        return None
    return {"chat_template": tokenizer.chat_template, **tokenizer.special_tokens}


def load_saved_tokenizer(folder: Path, names, fallback: str | Path | None) -> Tokenizer:
    """The tokenizer a checkpoint `folder` carries (`names`: the files its manifest lists and verified): its
    tokenizer.json, else `fallback`'s (data.tokenizer, or bytes); with the chat template it trained with when it
    saved one (`CHAT_CONFIG_FILE`: the template, its special tokens, and its eos_token -- e.g. ChatML's
    <|im_end|>, which ends a turn -- among the end-of-sequence ids)."""
    tokenizer = load_tokenizer(folder / "tokenizer.json" if "tokenizer.json" in names else fallback)
    if CHAT_CONFIG_FILE in names and isinstance(tokenizer, HFTokenizer):
        saved = _read_json(folder / CHAT_CONFIG_FILE)
        tokenizer.chat_template = saved.get("chat_template")
        tokenizer.special_tokens, tokenizer.eos_token_ids = _special_tokens(tokenizer.tokenizer, saved,
                                                                            tokenizer.eos_token_ids)
    return tokenizer


def _special_tokens(tok, tok_cfg: dict, eos_ids) -> tuple[dict[str, str], tuple[int, ...]]:
    """What a tokenizer_config.json (a model folder's, or the one a checkpoint saved) gives a `tokenizers`
    tokenizer `tok`: its bos / eos / pad tokens (a text, or {"content": ...}), and `eos_ids` with its eos_token's id
    added (ChatML's <|im_end|>, which ends a turn)."""
    special = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = tok_cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
    eos = list(eos_ids)
    end = tok.token_to_id(special["eos_token"]) if "eos_token" in special else None
    if end is not None and end not in eos:
        eos.append(end)
    return special, tuple(eos)


def eos_by_name(tok) -> int | None:
    """The id of the first of `EOS_NAMES` a `tokenizers.Tokenizer` has (training packs documents with it)."""
    return next((tok.token_to_id(t) for t in EOS_NAMES if tok.token_to_id(t) is not None), None)


def read_eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids named by a Hugging Face directory's generation_config.json / config.json."""
    eos: list[int] = []
    for cfg in (_read_json(Path(path) / "generation_config.json"), _read_json(Path(path) / "config.json")):
        value = cfg.get("eos_token_id")
        for t in (value if isinstance(value, list) else [value]):
            if isinstance(t, int) and t not in eos:
                eos.append(t)
    return tuple(eos)


GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_defaults(path: str | Path) -> dict:
    """The sampling defaults a Hugging Face directory's generation_config.json recommends for the requests that do
    not set them (vLLM's `--generation-config auto`: temperature, top_p, top_k, min_p, repetition_penalty); {}
    without one. `do_sample` is not read, as vLLM does not; nor `max_new_tokens` (a request's default stays the
    room its context leaves)."""
    config = _read_json(Path(path) / "generation_config.json")
    return {key: config[key] for key in GENERATION_DEFAULTS
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}


def read_tokenizer_json(path: Path):
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:
        raise ValueError(f"tokenizer {str(path)!r} needs the `tokenizers` package; pip install tokenizers (the "
                         "`hf` extra: pip install -e \".[hf]\") or train on bytes (an empty data.tokenizer)") from None
    try:
        return RustTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises a bare Exception on a damaged file
        raise ValueError(f"{str(path)!r} is not a readable tokenizer.json ({e}); pass the model's own "
                         "tokenizer.json") from None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _raise(message: str):
    raise ValueError(message)
