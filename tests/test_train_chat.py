"""Training on conversations (supervised fine-tuning, `meshlm.data.chat`): the loss counts the assistant's turns only,
as the chat template writes them, and is the global batch's mean under every layout.

What the mask holds is checked against the template's text: with the fallback template and bytes (multi-byte
characters included), and with a ChatML template on a BPE tokenizer read from a model folder, where what counts is
each reply and its <|im_end|>. The loss: the trainer's first step equals the whole batch's cross entropy over the
counted targets, taken directly, with micro-batches that hold different numbers of them (a mean per micro-batch
would differ, and the test says by how much); and layouts reproduce one process in fp64 through `meshlm verify`.
Bad conversation files are refused before training, naming file:line.
"""

import io
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshlm import verify
from meshlm.config import DataConfig, load_config
from meshlm.data.chat import encode_conversation, read_conversations
from meshlm.data.sources import is_chat_jsonl
from meshlm.data.text import IGNORE_INDEX, build_datasets
from meshlm.tokenizer import ByteTokenizer, HFTokenizer
from chat_data import first_step_batch, CHATML, conversations, make_chatml_folder, write_jsonl
from parity import FP64_TOL
from runs import SMALL_MODEL, harness_launch

@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", conversations(240))


def counted_text(ids, counts, decode) -> list[str]:
    """The stretches of counted tokens, decoded."""
    out, run = [], []
    for t, c in zip(list(ids) + [None], list(counts) + [False]):
        if c:
            run.append(t)
        elif run:
            out.append(decode(run))
            run = []
    return out


def test_with_bytes_and_the_fallback_template_each_reply_and_its_newline_count():
    tok = ByteTokenizer()
    conv = read_conversations_of([conversations(1)[0]])[0]
    ids, counts = encode_conversation(conv, tok, assistant_only=True)
    text = tok.apply_chat_template(conv.messages, add_generation_prompt=False)
    assert bytes(ids.tolist()).decode() == text
    replies = [m["content"] + "\n" for m in conv.messages if m["role"] == "assistant"]
    assert counted_text(ids, counts, tok.decode) == replies
    ids_all, counts_all = encode_conversation(conv, tok, assistant_only=False)
    assert (ids_all == ids).all() and counts_all.all()


def read_conversations_of(rows):
    with tempfile.TemporaryDirectory() as d:
        return read_conversations(write_jsonl(Path(d) / "c.jsonl", rows), max_bytes=1 << 30)


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory):
    return make_chatml_folder(tmp_path_factory.mktemp("chatml"))


def test_a_model_folder_s_chatml_template_counts_each_reply_and_its_end_token(chatml_folder):
    tok = HFTokenizer.from_dir(chatml_folder)
    rows = conversations(12, seed=5)
    for conv in read_conversations_of(rows):
        ids, counts = encode_conversation(conv, tok, assistant_only=True)
        assert tok.tokenizer.decode(ids.tolist(), skip_special_tokens=False) == \
            tok.apply_chat_template(conv.messages, add_generation_prompt=False)
        replies = [m["content"] + "<|im_end|>\n" for m in conv.messages if m["role"] == "assistant"]
        got = counted_text(ids, counts, lambda r: tok.tokenizer.decode(r, skip_special_tokens=False))
        assert got == replies


def test_the_packed_batches_hide_what_does_not_count_and_the_loader_counts_the_rest(chat_file):
    train, val = build_datasets(DataConfig(path=chat_file), seq_len=48, tokenizer=ByteTokenizer())
    assert len(val) > 0 and len(train) > 30
    idx = torch.arange(0, 16)
    inputs, targets = train.batch(idx)
    whole = train.samples(idx)
    counted = targets != IGNORE_INDEX
    assert (targets[counted] == whole[:, 1:][counted]).all()
    assert 0 < int(counted.sum()) == train.loss_targets(idx) < targets.numel() // 2
    # a counted target is a byte of an assistant's reply: digits, "Sure.", spaces, dots and the newline
    assert set(bytes(targets[counted].tolist()).decode()) <= set("0123456789Sure. \n")
    every = build_datasets(DataConfig(path=chat_file, assistant_only_loss=False, split_across_samples=True),
                           seq_len=48, tokenizer=ByteTokenizer())[0]  # back to back: no padding
    assert every.loss_targets(idx) == 16 * 48 and (every.batch(idx)[1] == every.samples(idx)[:, 1:]).all()


def test_a_conversation_that_fits_a_sample_is_never_cut_by_its_edge(chat_file):
    seq_len = 64
    convs = read_conversations(chat_file, max_bytes=1 << 30)
    tok = ByteTokenizer()
    lengths = [len(encode_conversation(c, tok, assistant_only=True)[0]) + len(tok.separator) for c in convs]
    whole = build_datasets(DataConfig(path=chat_file, val_fraction=0), seq_len=seq_len, tokenizer=tok)[0]
    split = build_datasets(DataConfig(path=chat_file, val_fraction=0, split_across_samples=True), seq_len=seq_len,
                           tokenizer=tok)[0]
    assert split.tokens.numel() == sum(lengths) and (np.diff(split.starts) == lengths[:-1]).all()
    starts = [int(a) for a in whole.starts if int(whole.tokens[a]) == ord("<")]
    assert len(starts) == len(convs)  # the others begin a padding run
    cut = 0
    for a, n in zip(starts, lengths):
        cut += n <= seq_len + 1 and a % seq_len + n > seq_len + 1  # fits in a sample, yet crosses an edge
    assert cut == 0
    assert sum(a % seq_len + n > seq_len + 1 for a, n in zip(split.starts.tolist(), lengths) if n <= seq_len + 1)
    padding = torch.ones_like(whole.trainable)
    for a, n in zip(starts, lengths):
        padding[a:a + n] = False
    assert padding.any() and not whole.trainable[padding].any()  # no loss on the padding
    assert int(whole.trainable.sum()) == int(split.trainable.sum())  # the same replies count, the padding adds none
    assert len(whole) > len(split)


def test_prompts_and_completions_count_the_completion_and_the_stop_after_it(tmp_path):
    pairs = [{"prompt": f"Q: {i} + {i}?\nA:", "completion": f" {2 * i}é"} for i in range(6)]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    assert is_chat_jsonl(path)
    tok = ByteTokenizer()
    data = build_datasets(DataConfig(path=path, val_fraction=0, split_across_samples=True), seq_len=8,
                          tokenizer=tok)[0]
    assert bytes(data.tokens.tolist()).decode() == "".join(p["prompt"] + p["completion"] + "\n\n" for p in pairs)
    counted = counted_text(data.tokens.tolist(), data.trainable.tolist(), tok.decode)
    assert counted == [p["completion"] + "\n\n" for p in pairs]  # the separator too: where the model stops
    as_messages = [{"prompt": [{"role": "user", "content": "hi"}],
                    "completion": [{"role": "assistant", "content": "hello"}]}]
    conv = read_conversations(write_jsonl(tmp_path / "m.jsonl", as_messages), max_bytes=1 << 20)[0]
    ids, counts = encode_conversation(conv, tok, assistant_only=True)
    assert counted_text(ids, counts, tok.decode) == ["hello\n"]
    for bad in ({"prompt": "q", "completion": ""}, {"prompt": "q", "completion": [{"role": "assistant"}]}):
        with pytest.raises(ValueError, match="bad.jsonl:1: 'prompt' and 'completion' must be two texts"):
            read_conversations(write_jsonl(tmp_path / "bad.jsonl", [bad]), max_bytes=1 << 20)


def make_cfg(path, *extra):
    return load_config(overrides=[*SMALL_MODEL, "train.seq_len=32", "train.global_batch_size=8",
                                  "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=2",
                                  "train.device=cpu", "data.val_fraction=0.1", "train.val_interval=3",
                                  "train.val_batches=1", "parallel.bucket_size_mb=0.02", f"data.path={path}",
                                  *extra])


def test_the_first_step_s_loss_is_the_whole_batch_s_mean_over_the_counted_targets(tmp_path, chat_file):
    from meshlm.train.trainer import Trainer

    cfg = make_cfg(chat_file, "train.precision=fp64", "train.steps=1", f"train.run_dir={tmp_path}",
                   "train.progress=false", "train.val_batches=0")
    trainer = Trainer(cfg)
    targets, logits, want = first_step_batch(trainer)
    per_micro = np.mean([float(F.cross_entropy(logits[i:i + 2].flatten(0, 1), targets[i:i + 2].flatten()))
                         for i in range(0, 8, 2)])
    counts = [int((targets[i:i + 2] != IGNORE_INDEX).sum()) for i in range(0, 8, 2)]
    assert len(set(counts)) > 1, counts  # the micro-batches hold different numbers of counted targets
    assert abs(per_micro - want) > 1e-4, (per_micro, want)  # so a mean per micro-batch would be another loss
    row = trainer.train_step()
    assert abs(row["loss"] - want) <= 1e-12 * abs(want), (row["loss"], want)
    assert row["loss_tokens"] == sum(counts)  # logged beside the loss


LAYOUTS = {  # id: (ranks, settings)
    "dp2": (2, []),
    "tp2_sp": (2, ["parallel.tp=2"]),
    "pp2_1f1b": (2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"]),
    "cp2_ring_document_mask": (2, ["parallel.cp=2", "parallel.cp_method=ring", "data.document_mask=true"]),
    "zero3_dp2": (2, ["parallel.zero_stage=3"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_the_single_process_run_in_fp64(tmp_path, chat_file, layout):
    nproc, settings = LAYOUTS[layout]
    report = verify.run(make_cfg(chat_file, *settings), nproc=nproc, steps=3, run_dir=tmp_path,
                        launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    worst = max(max(r.loss[2], r.grad_norm[2]) for r in report.rows)
    assert worst <= FP64_TOL, verify.format_report(report)
    assert report.max_weight_diff <= FP64_TOL, verify.format_report(report)


def test_validation_counts_only_the_assistant_s_targets(tmp_path, chat_file):
    from meshlm.train.trainer import Trainer

    cfg = make_cfg(chat_file, "train.precision=fp64", "train.steps=1", f"train.run_dir={tmp_path}",
                   "train.progress=false")
    trainer = Trainer(cfg)
    loss_sum, count = trainer.loss_totals(trainer.val_data, num_global_batches=1)
    n = min(8, len(trainer.val_data))
    idx = torch.arange(8) % len(trainer.val_data)
    _, targets = trainer.val_data.batch(idx)
    assert n > 0 and count == int((targets != IGNORE_INDEX).sum()) < targets.numel()


def test_conversation_files_are_told_apart_and_bad_ones_refused_by_line(tmp_path):
    assert is_chat_jsonl(write_jsonl(tmp_path / "c.jsonl", conversations(2)))
    assert not is_chat_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}]))
    good = json.dumps(conversations(1)[0])
    bad = {
        '{"messages": []}': "has no non-empty list 'messages'",
        # the server's own words (`meshlm.messages`): a conversation is taken as a chat request's messages are
        '{"messages": [{"content": "hi"}]}': "each message needs a 'role' and a 'content'",
        '{"messages": [{"role": "user", "content": 3}]}': "message content must be a string or a list of text parts",
        '{"messages": [{"role": "robot", "content": "x"}]}': "message role 'robot' is not one of",
        '{"messages": [{"role": "user", "content": "\\ud800"}]}': "not valid Unicode",
        '{"messages": [{"role": "user", "content": "x"}], "tools": {}}': "'tools' must be a list",
        '{"prompt": "\\udfff", "completion": "x"}': "prompt holds text that is not valid Unicode",
        "{not json": "is not valid JSON",
        "\udcff": "is not valid JSON in UTF-8",  # a byte that is no UTF-8 (written back as 0xff below)
    }
    for line, words in bad.items():
        path = tmp_path / "bad.jsonl"
        path.write_bytes((good + "\n\n" + line + "\n").encode("utf-8", errors="surrogateescape"))
        with pytest.raises(ValueError, match="bad.jsonl:3") as e:
            read_conversations(path, max_bytes=1 << 20)
        assert words in str(e.value)
    only_users = write_jsonl(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": "hi " * 40}]}] * 9)
    with pytest.raises(ValueError, match="no token of the training conversations is an assistant's"):
        build_datasets(DataConfig(path=only_users), seq_len=16, tokenizer=ByteTokenizer())


def test_a_template_that_rewrites_earlier_turns_is_refused_unless_every_token_counts(tmp_path):
    # as Qwen3's drops the reasoning of earlier turns: the last reply is written differently from the others
    rewrites = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[old]{% else %}"
                "<{{ m['role'] }}>{{ m['content'] }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = ByteTokenizer()
    tok.chat_template = rewrites
    conv = read_conversations_of([conversations(1)[0]])[0]
    with pytest.raises(ValueError, match="data.assistant_only_loss=false"):
        encode_conversation(conv, tok, assistant_only=True)
    ids, counts = encode_conversation(conv, tok, assistant_only=False)
    assert counts.all() and len(ids) > 0


def test_the_checkpoint_carries_the_template_to_generation_eval_and_conversion(tmp_path, chat_file, chatml_folder):
    from meshlm.checkpoint import load_checkpoint_for_inference
    from meshlm.convert import to_hf
    from meshlm.evaluate import evaluate
    from meshlm.train.trainer import Trainer

    cfg = make_cfg(chat_file, "train.steps=2", f"train.run_dir={tmp_path / 'run'}", "train.progress=false",
                   "train.val_batches=0", "model.vocab_size=320", f"data.tokenizer={chatml_folder}")
    Trainer(cfg).train()
    _, _, tok = load_checkpoint_for_inference(tmp_path / "run")
    end = tok.tokenizer.token_to_id("<|im_end|>")
    assert tok.chat_template == CHATML and end in tok.eos_token_ids  # a reply stops where its turn ends
    prompt = tok.encode_chat([{"role": "user", "content": "What is 1 plus 2?"}])
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    to_hf(tmp_path / "run", tmp_path / "hf")
    assert HFTokenizer.from_dir(tmp_path / "hf").chat_template == CHATML
    result = evaluate(checkpoint=str(tmp_path / "run"), data=chat_file)
    assert 0 < result.tokens < result.samples * cfg.train.seq_len / 2  # the assistant's targets only


def test_fine_tuning_a_converted_model_renders_its_conversations_with_its_template(tmp_path, chat_file,
                                                                                   chatml_folder):
    import shutil

    import transformers

    from meshlm.checkpoint import load_checkpoint_for_inference
    from meshlm.convert import to_meshlm
    from meshlm.train.trainer import Trainer

    hf = tmp_path / "hf"
    shutil.copytree(chatml_folder, hf)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(hf)
    to_meshlm(hf, tmp_path / "run", overrides=[f"data.path={chat_file}", "train.seq_len=32", "train.device=cpu",
                                               "train.global_batch_size=8", "train.micro_batch_size=2",
                                               "train.progress=false", "train.val_batches=0"])
    cfg = load_config(tmp_path / "run" / "config.toml", ["train.steps=1"])
    trainer = Trainer(cfg, resume=True)
    assert trainer.tokenizer.chat_template == CHATML  # the model's own, not the fallback
    _, targets = trainer.loader.dataset.batch(torch.arange(8))
    counted = targets[targets != IGNORE_INDEX].tolist()
    assert trainer.tokenizer.tokenizer.token_to_id("<|im_end|>") in counted
    trainer.train()
    _, _, tok = load_checkpoint_for_inference(tmp_path / "run")
    assert tok.chat_template == CHATML and tok.tokenizer.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_a_conversation_renders_as_the_server_renders_the_same_messages():
    """Tool calls (content null, arguments as JSON text) and an earlier reply's reasoning go through the server's
    own normalisation (`meshlm.messages`): the training text is the server's prompt text for those messages."""
    from meshlm.infer.requests import chat_messages

    tools_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                      "{% for c in m.get('tool_calls') or [] %}<call>{{ c['function']['arguments'] | tojson }}"
                      "</call>{% endfor %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    messages = [{"role": "user", "content": "add 1 and 2"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
                {"role": "assistant", "content": "3."}]
    tok = ByteTokenizer()
    tok.chat_template = tools_template
    conv = read_conversations_of([{"messages": messages}])[0]
    ids, counts = encode_conversation(conv, tok, assistant_only=True)
    served = tok.apply_chat_template(chat_messages({"messages": messages}), add_generation_prompt=False)
    assert bytes(ids.tolist()).decode() == served
    assert "None" not in served and '<call>{"a": 1, "b": 2}</call>' in served  # arguments as an object
    assert counted_text(ids, counts, tok.decode) == ['<call>{"a": 1, "b": 2}</call>', "3."]


def test_a_reply_token_that_begins_in_the_prompt_counts_and_texts_are_tokenized_apart():
    """A token that runs from the prompt into the reply (a generation prompt ending in a space, " 42" one BPE token)
    is the reply's; a prompt and completion given as texts are tokenized each alone, the completion whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["USER: what?\nASSISTANT: 42\nQ: what? A: 42"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = HFTokenizer(raw)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}ASSISTANT: {% endif %}")
    conv = read_conversations_of([{"messages": [{"role": "user", "content": "what?"},
                                                {"role": "assistant", "content": "42"}]}])[0]
    ids, counts = encode_conversation(conv, tok, assistant_only=True)
    pieces = [tok.tokenizer.id_to_token(int(i)) for i in ids]
    assert any(p.startswith("Ġ") and p.endswith("42") for p, c in zip(pieces, counts) if c), (pieces, counts)
    pair = read_conversations_of([{"prompt": "Q: what? A: ", "completion": "42"}])[0]
    ids, counts = encode_conversation(pair, tok, assistant_only=True)
    assert tok.decode([int(i) for i, c in zip(ids, counts) if c]) == "42"


def test_only_the_completion_counts_and_a_conversation_must_not_open_with_the_assistant(tmp_path):
    few_shot = {"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                           {"role": "user", "content": "2+2?"}],
                "completion": [{"role": "assistant", "content": "4"}]}
    tok = ByteTokenizer()
    conv = read_conversations_of([few_shot])[0]
    ids, counts = encode_conversation(conv, tok, assistant_only=True)
    assert counted_text(ids, counts, tok.decode) == ["4\n"]  # not the prompt's example reply
    tok = ByteTokenizer()  # (a tokenizer compiles its template once)
    tok.chat_template = "{{ messages[0]['role'] }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    first = read_conversations_of([{"messages": [{"role": "assistant", "content": "hi"},
                                                 {"role": "user", "content": "yo"}]}])[0]
    with pytest.raises(ValueError, match="start the conversation with a user or system message"):
        encode_conversation(first, tok, assistant_only=True)


def test_nothing_to_count_moves_no_weight_and_is_refused_where_a_loss_is_asked_for(tmp_path, chat_file):
    from meshlm.evaluate import evaluate
    from meshlm.train.trainer import Trainer

    cfg = make_cfg(chat_file, "train.precision=fp64", "train.steps=1", f"train.run_dir={tmp_path / 'run'}",
                   "train.progress=false", "train.val_batches=0")
    trainer = Trainer(cfg)
    trainer.loader.dataset.trainable[:] = False  # a global batch of which no target counts
    before = {k: v.clone() for k, v in trainer.base_model.state_dict().items()}
    row = trainer.train_step()
    assert row["loss"] == 0 and row["loss_tokens"] == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.base_model.state_dict().items())  # AdamW did not step
    trainer.loader.dataset.trainable[:] = True
    trainer.train()
    users = write_jsonl(tmp_path / "users.jsonl", [{"messages": [{"role": "user", "content": "hi " * 30}]}] * 40)
    with pytest.raises(ValueError, match="no target of its first .* counts in the loss"):
        evaluate(checkpoint=str(tmp_path / "run"), data=users)
    # a tiny val_fraction takes none by hash: the last conversation is the validation split, here a user's alone
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [*conversations(60), {"messages": [
        {"role": "user", "content": "a question without its answer " * 4}]}])
    with pytest.raises(ValueError, match="no token of the .* validation samples .* is an assistant's"):
        Trainer(make_cfg(mixed, "data.val_fraction=1e-12", f"train.run_dir={tmp_path / 'mixed'}"))


def test_what_the_fallback_template_cannot_write_and_files_training_cannot_read_are_refused(tmp_path):
    calls = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
    with pytest.raises(ValueError, match="tools or tool calls, which the fallback chat template does not write"):
        encode_conversation(read_conversations_of([calls])[0], ByteTokenizer(), assistant_only=True)
    # a template's own failure, whatever it raises, is the conversation's refusal naming its line
    tok = ByteTokenizer()
    tok.chat_template = "{{ 1 // (messages | length - 2) }}"
    with pytest.raises(ValueError, match=r"c.jsonl:1: the model's chat template rejects .* ZeroDivisionError"):
        encode_conversation(read_conversations_of([conversations(2)[1]])[0], tok, assistant_only=True)
    # transformers' {% generation %} marking is written through
    tok = ByteTokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}"
                         "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    ids, counts = encode_conversation(read_conversations_of([conversations(2)[1]])[0], tok, assistant_only=True)
    assert counted_text(ids, counts, tok.decode) == [conversations(2)[1]["messages"][1]["content"]]
    (tmp_path / "c.jsonl.gz").write_bytes(b"\x1f\x8b compressed")
    with pytest.raises(ValueError, match="is a .gz file, which training does not read as text"):
        build_datasets(DataConfig(path=str(tmp_path / "c.jsonl.gz")), seq_len=8, tokenizer=ByteTokenizer())
    folder = tmp_path / "chats"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", conversations(3))
    with pytest.raises(ValueError, match="a.jsonl:1 is a conversation: conversations are trained on from one"):
        build_datasets(DataConfig(path=str(folder)), seq_len=8, tokenizer=ByteTokenizer())
