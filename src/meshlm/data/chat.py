"""Conversations as training data (supervised fine-tuning): each rendered by the chat template the model will be
served with, tokenized as one text, and the loss taken on the assistant's turns only.

Responsible for: telling a conversation from a text (`is_conversation_row`: "messages", or "prompt" and
"completion"; a file's first line decides what it holds, `meshlm.data.sources.holds_conversations`); reading and
checking every conversation before any training step (`read_conversations`, errors naming file:line): OpenAI's form,
{"messages": [{"role": ..., "content": ...}, ...]} with an optional "tools" list, the messages taken as the server
takes a chat request's (`meshlm.messages`: content parts joined, a tool call's arguments as an object, ...), so that
they render as they will be served; or a prompt and its completion (TRL's two other forms): two lists of messages,
of which the completion's count, or two texts, each tokenized alone without special tokens (as a completion
request's prompt, then what is generated), the completion and the separator after it counting (so the model learns
to stop); `encode_conversations`, the token stream training packs with where each conversation begins and, per
token, whether predicting it counts in the loss.

Which tokens count. For an assistant's message i (or a completion's messages from i), the template's text of
messages[:i] with the generation prompt (`p`) must begin the text of the messages through it (`e`), which must begin
the whole conversation's text: the characters e adds to p -- the reply and whatever closes its turn (Llama 3's
<|eot_id|>, ChatML's <|im_end|>) -- are the assistant's, so the model learns to end its turn where the server stops
it. The whole text is tokenized once (as the server tokenizes a prompt, `Tokenizer.encode_prompt`), and a token
counts when its characters overlap one of those stretches (one that begins in the prompt and runs into the reply, as
a leading space may, is the reply's, as in transformers' assistant mask). A template that does not write a
conversation's turns as prefixes of the whole (Qwen3's drops the reasoning of earlier turns) is refused by name:
`data.assistant_only_loss=false` trains on every token instead; so is a conversation opening with the assistant's
message under a template that cannot render what comes before it. The separator between packed conversations (EOS,
or the byte tokenizer's blank line) is never a target that counts when only the assistant's turns do.

Not responsible for: packing, splitting and batching (text.py: a masked target is `IGNORE_INDEX`), the template
language (meshlm.tokenizer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.messages import checked_text, template_messages
from meshlm.tokenizer import ChatTemplateError, Tokenizer


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]  # as the template takes them (`meshlm.messages.template_messages`)
    tools: list[dict] | None
    where: str  # "file:line", for errors
    key: str  # the line as read: what the train/validation split hashes
    texts: tuple[str, str] | None = None  # a prompt and its completion given as texts (then no messages)
    completion_from: int | None = None  # a prompt and completion given as messages: where the completion begins


def is_conversation_row(row) -> bool:
    """A JSON line that is a conversation: an object with "messages", or with "prompt" and "completion"."""
    return isinstance(row, dict) and ("messages" in row or {"prompt", "completion"} <= set(row))


def read_conversations(path: str | Path, *, max_bytes: int) -> list[Conversation]:
    """Every conversation of a `.jsonl` (whole lines until `max_bytes` of it are read), each checked."""
    path, out, total = Path(path), [], 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if total >= max_bytes:
                break
            total += len(raw)
            out.append(conversation_of_line(raw, f"{path}:{lineno}"))
    return out


def conversation_of_line(raw: bytes, where: str) -> Conversation:
    """One line of a conversation file, checked (errors name `where`, its file:line)."""
    try:
        line = raw.decode("utf-8")
        row = json.loads(line)
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError
        raise ValueError(f"{where} is not valid JSON in UTF-8 ({e}); each line must be an object") from None
    return _conversation(row, where, line.strip())


def conversation_of_row(row: dict, where: str) -> Conversation:
    """A parquet row's conversation columns (`meshlm.data.sources.conversation_columns`), checked; "tools" may be
    a JSON text, as Hugging Face datasets often store them, and a message's null fields are absent ones (a column of
    structs gives every message each field any has). Its key (what the validation split hashes) is the row as JSON,
    keys sorted."""
    row = {k: v for k, v in row.items() if v is not None}
    if isinstance(row.get("tools"), str):
        try:
            row["tools"] = json.loads(row["tools"])
        except ValueError as e:
            raise ValueError(f"{where}: 'tools' is a text that is not JSON ({e})") from None
    return _conversation(row, where, json.dumps(row, ensure_ascii=False, sort_keys=True, default=str))


def sample_prompt(path: str | Path, tokenizer: Tokenizer) -> tuple[str, bool] | None:
    """What the end-of-training sample continues: (the text, whether it is a chat template's) -- the file's first
    conversation up to its first assistant message that answers another's (or its completion), rendered with the
    generation prompt, or its first prompt text; None where there is no such prompt."""
    conv = read_conversations(path, max_bytes=1)[0]
    if conv.texts is not None:
        return (conv.texts[0], False) if conv.texts[0] else None
    first = conv.completion_from if conv.completion_from is not None else \
        next((i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i > 0), None)
    if not first:
        return None
    return tokenizer.apply_chat_template(conv.messages[:first], conv.tools), True


def _conversation(row, where: str, key: str) -> Conversation:
    shape = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
    completion_from = None
    if is_conversation_row(row) and "messages" not in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str) and completion:
            try:
                texts = (checked_text(prompt, "prompt"), checked_text(completion, "completion"))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            return Conversation(messages=[], tools=None, where=where, key=key, texts=texts)
        if not (isinstance(prompt, list) and isinstance(completion, list) and completion):
            raise ValueError(f"{where}: 'prompt' and 'completion' must be two texts or two lists of messages, the "
                             "completion not empty")
        row, completion_from = {**row, "messages": prompt + completion}, len(prompt)
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise ValueError(f"{where} has no non-empty list 'messages'; each line (or parquet row) of a conversation file "
                         f"must be {shape}, or {{\"prompt\": ..., \"completion\": ...}} (a file of texts has "
                         "{\"text\": ...} on every line instead)")
    try:  # as the server takes a chat's messages, so that they render the same
        messages = template_messages(row["messages"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of function definitions (objects), as the chat API's")
    return Conversation(messages=messages, tools=tools, where=where, key=key, completion_from=completion_from)


def encode_conversations(conversations: list[Conversation], tokenizer: Tokenizer, *, assistant_only: bool,
                         whole_in: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32, starts int64: where each conversation -- and each run of padding -- begins, trainable bool
    per token: whether predicting it counts in the loss) of the conversations packed in order, each followed by the
    tokenizer's document separator (`conversation_tokens`), placed by `place` (`whole_in` = seq_len: none crosses
    a sample's edge), the gaps padding: the separator's first token, or 0, a document of its own that no loss
    counts."""
    encoded = [conversation_tokens(c, tokenizer, assistant_only=assistant_only) for c in conversations]
    if not encoded:
        return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, bool)
    lengths = np.asarray([len(ids) for ids, _ in encoded], dtype=np.int64)
    at = place(lengths, whole_in)
    total = int(at[-1] + lengths[-1])
    tokens, trainable = np.full(total, pad_token(tokenizer), dtype=np.int32), np.zeros(total, dtype=bool)
    for start, (ids, counts) in zip(at.tolist(), encoded):
        tokens[start:start + len(ids)], trainable[start:start + len(ids)] = ids, counts
    return tokens, with_padding_starts(at, lengths), trainable


def place(lengths: np.ndarray, whole_in: int | None) -> np.ndarray:
    """Where each document of `lengths` (tokens, separator included) begins when packed in order: back to back,
    or with `whole_in` = seq_len none crossing the edge of a sample (samples start every seq_len tokens and hold
    seq_len + 1, `text.PackedDataset`): one that does not fit in the rest of its sample starts the next one (the
    rest is padding); one longer than a sample starts at a sample's start and runs on into the next ones. The one
    rule of conversations packed in memory (`encode_conversations`) and read from prepared shards."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not whole_in:
        return np.cumsum(lengths) - lengths
    out, at = np.empty(len(lengths), dtype=np.int64), 0
    for i, length in enumerate(lengths.tolist()):
        used = at % whole_in
        if used and used + length > whole_in + 1:  # would cross the sample's end
            at += whole_in - used
        out[i] = at
        at += length
    return out


def with_padding_starts(at: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The document starts of documents placed at `at` (`place`): theirs, and each gap's before them."""
    ends = at[:-1] + lengths[:-1]
    gaps = ends[ends < at[1:]]
    return np.sort(np.concatenate([at, gaps])).astype(np.int64)


def pad_token(tokenizer: Tokenizer) -> int:
    """What fills the rest of a sample no conversation fits: the separator's first token, or 0."""
    return int(tokenizer.separator[0]) if tokenizer.separator else 0


def conversation_tokens(conv: Conversation, tokenizer: Tokenizer, *, assistant_only: bool) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """`encode_conversation` followed by the tokenizer's document separator (`Tokenizer.separator`), which counts
    only after a completion given as text (it is how the model learns to stop), or when every token does."""
    ids, counts = encode_conversation(conv, tokenizer, assistant_only=assistant_only)
    sep = np.asarray(tokenizer.separator, dtype=np.int32)
    return (np.concatenate([ids, sep]).astype(np.int32),
            np.concatenate([counts, np.full(len(sep), not assistant_only or conv.texts is not None)]))


def encode_conversation(conv: Conversation, tokenizer: Tokenizer, *, assistant_only: bool) -> tuple[np.ndarray,
                                                                                                     np.ndarray]:
    """(token ids, whether each counts in the loss) of one conversation rendered whole. A token counts when its
    characters overlap an assistant's stretch (a token that begins in the prompt and runs into the reply, as a
    leading space may, is the reply's: transformers' assistant mask takes it so). A prompt and completion given as
    texts: each tokenized alone, without special tokens (as a completion request's prompt is, then generated)."""
    if conv.texts is not None:
        prompt, completion = (np.asarray(tokenizer.encode(t, add_special_tokens=False), dtype=np.int32)
                              for t in conv.texts)
        counts = np.concatenate([np.full(len(prompt), not assistant_only), np.ones(len(completion), dtype=bool)])
        return np.concatenate([prompt, completion]), counts

    if tokenizer.chat_template is None and (conv.tools or any("tool_calls" in m for m in conv.messages)):
        raise ValueError(f"{conv.where}: this conversation has tools or tool calls, which the fallback chat template "
                         "does not write (its turns would be trained without them); set data.tokenizer to a model "
                         "folder whose chat template does")

    def render(messages, generation_prompt, what):
        try:
            return tokenizer.apply_chat_template(messages, conv.tools, add_generation_prompt=generation_prompt)
        except ChatTemplateError as e:
            raise ValueError(f"{conv.where}: {e}{what}") from None

    whole = render(conv.messages, False, "")
    ids, starts, ends = tokenizer.encode_with_offsets(whole, add_special_tokens=tokenizer.prompt_special_tokens)
    if not assistant_only:
        return ids, np.ones(len(ids), dtype=bool)
    if conv.completion_from is not None:  # the completion's messages, whoever speaks in them
        turns = [(conv.completion_from, len(conv.messages))]
    else:
        turns = [(i, i + 1) for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    counts = np.zeros(len(ids), dtype=bool)
    for first, last in turns:
        what = (" (rendering the messages before the assistant's first one: start the conversation with a user or "
                "system message)") if first == 0 else ""
        before, through = render(conv.messages[:first], True, what), render(conv.messages[:last], False, "")
        if not (through.startswith(before) and whole.startswith(through)):
            raise ValueError(f"{conv.where}: the chat template does not write this conversation's turns as a "
                             f"prefix of the whole (messages[{first}] changes what comes before it: e.g. Qwen3's "
                             "template drops earlier turns' reasoning), so the assistant's tokens cannot be told "
                             "apart; set data.assistant_only_loss=false to train on every token")
        counts |= (starts < len(through)) & (ends > len(before))
    return ids, counts
