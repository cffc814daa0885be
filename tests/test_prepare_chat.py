"""Conversations through `meshlm data prepare`: a prepared folder gives exactly the samples, loss masks and document
starts that training packs in memory from the same file (kept whole in samples or split across them, the assistant's
turns or every token), training on it takes the global batch's mean over the counted targets under data parallelism
and context parallelism with document masking, and what cannot be trained as asked is refused by name."""

import gzip
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from chat_data import first_step_batch, conversations, make_chatml_folder, write_jsonl
from parity import FP64_TOL
from prepared_data import make_tokenizer
from runs import SMALL_MODEL, harness_launch

from meshlm import verify
from meshlm.config import DataConfig, load_config
from meshlm.data.chat import read_conversations
from meshlm.data.dataset import BlendedDataset, PreparedDataset
from meshlm.data.prepare import prepare
from meshlm.data.text import IGNORE_INDEX, build_datasets, split_conversations
from meshlm.tokenizer import conversation_tokenizer

SEQ = 48


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_chatml_folder(tmp_path_factory.mktemp("chatml"))


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """Conversations, and TRL's prompt/completion rows of both kinds among them."""
    rows = conversations(160)
    for i in range(0, 160, 20):
        rows[i] = {"prompt": f"{i} plus one is", "completion": f" {i + 1}."}
        rows[i + 1] = {"prompt": rows[i + 1]["messages"][:-1], "completion": rows[i + 1]["messages"][-1:]}
    return write_jsonl(tmp_path_factory.mktemp("chat") / "chat.jsonl", rows)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, chat_file, folder):
    out = tmp_path_factory.mktemp("prep") / "chats"
    prepare([chat_file], tokenizer_path=folder, out=out, val_fraction=0.1, progress=False)
    return out


def in_memory(chat_file, folder, **data):
    cfg = DataConfig(path=chat_file, tokenizer=str(folder), val_fraction=0.1, **data)
    return build_datasets(cfg, seq_len=SEQ, tokenizer=conversation_tokenizer(folder))


@pytest.mark.parametrize("assistant_only", [True, False])
@pytest.mark.parametrize("whole", [True, False])
def test_a_prepared_folder_gives_the_samples_training_packs_in_memory(chat_file, folder, prepared, assistant_only,
                                                                     whole):
    mine = in_memory(chat_file, folder, assistant_only_loss=assistant_only, split_across_samples=not whole)
    for split, packed in zip(("train", "val"), mine):
        ds = PreparedDataset(prepared, seq_len=SEQ, split=split, tokenizer_path=folder,
                             assistant_only=assistant_only, whole=whole)
        assert len(ds) == len(packed) > 0
        idx = torch.arange(len(ds))
        assert torch.equal(ds.samples(idx), packed.samples(idx))
        for a, b in zip(ds.batch(idx), packed.batch(idx)):
            assert torch.equal(a, b)
        assert ds.loss_targets(idx) == packed.loss_targets(idx)
        assert (ds.loss_targets(idx) < len(ds) * SEQ) == (assistant_only or whole)  # masks, or padding
        for a, b in zip(ds.document_starts(idx), packed.document_starts(idx)):
            assert a.tolist() == b.tolist()


def test_the_manifest_counts_what_the_loss_counts_and_masks_are_checked(chat_file, folder, prepared, tmp_path):
    m = json.loads((prepared / "manifest.json").read_text())
    assert m["version"] == 2 and m["conversations"]["assistant_only_loss"]
    assert m["conversations"]["chat"]["eos_token"] == "<|im_end|>"
    train, val = split_conversations(read_conversations(chat_file, max_bytes=1 << 30), 0.1)
    assert m["splits"]["train"]["num_documents"] == len(train) and m["splits"]["val"]["num_documents"] == len(val)
    packed = in_memory(chat_file, folder, split_across_samples=True)[0]
    assert m["splits"]["train"]["num_loss_tokens"] == int(packed.trainable.sum())
    # the same conversations over several shards and two workers: the same bytes, shard by shard
    again = tmp_path / "again"
    summary = prepare([chat_file], tokenizer_path=folder, out=again, val_fraction=0.1, shard_bytes=3000, workers=2,
                      progress=False)
    assert summary["num_shards"] > 2 and summary["num_loss_tokens"] == {s: v["num_loss_tokens"] for s, v in
                                                                         m["splits"].items()}
    shards = json.loads((again / "manifest.json").read_text())["splits"]["train"]["shards"]
    joined = b"".join((again / s["mask"]).read_bytes() for s in shards)
    assert joined == b"".join((prepared / s["mask"]).read_bytes() for s in m["splits"]["train"]["shards"])
    (again / shards[0]["mask"]).write_bytes(b"\x01")
    with pytest.raises(ValueError, match=r"train-000000\.mask has 1 bytes, the manifest says one per token"):
        PreparedDataset(again, seq_len=SEQ, tokenizer_path=folder)


def test_training_on_a_prepared_folder_takes_the_batch_s_mean_and_carries_the_template(tmp_path, prepared, folder):
    from meshlm.train.trainer import Trainer

    cfg = load_config(overrides=[*SMALL_MODEL, f"train.seq_len={SEQ}", "train.global_batch_size=8",
                                 "train.micro_batch_size=2", "train.device=cpu", "train.precision=fp64",
                                 "train.steps=1", f"train.run_dir={tmp_path}", "train.progress=false",
                                 "train.val_batches=1", f"data.path={prepared}", f"data.tokenizer={folder}",
                                 "model.vocab_size=320", "train.checkpoint_interval=1"])
    trainer = Trainer(cfg)
    targets, logits, want = first_step_batch(trainer)
    row = trainer.train_step()
    assert abs(row["loss"] - want) <= 1e-12 * abs(want), (row["loss"], want)
    assert row["loss_tokens"] == int((targets != IGNORE_INDEX).sum()) < targets.numel()
    trainer.train()
    saved = json.loads(next(tmp_path.glob("checkpoints/step_*/tokenizer_config.json")).read_text())
    assert saved["eos_token"] == "<|im_end|>" and "im_start" in saved["chat_template"]
    # meshlm eval reads the run's prepared folder as training did: its 'val' split, or with --data every split
    from meshlm.evaluate import evaluate

    def counted(split):
        ds = PreparedDataset(prepared, seq_len=SEQ, split=split)
        return ds.loss_targets(np.arange(len(ds) // 4 * 4))

    held_out = evaluate(checkpoint=str(tmp_path), overrides=["train.global_batch_size=4"])
    assert held_out.tokens == counted("val") > 0 and np.isfinite(held_out.loss) and "'val' split" in held_out.data
    every = evaluate(checkpoint=str(tmp_path), data=str(prepared), overrides=["train.global_batch_size=4"])
    assert every.tokens == counted("train") + counted("val") and "every split" in every.data
    other = tmp_path / "other"  # a folder of another tokenizer's tokens is not this model's to read
    (other / "tok").mkdir(parents=True)
    make_tokenizer(other / "tok" / "tokenizer.json")
    (other / "t.jsonl").write_text("".join(json.dumps({"text": f"{i} plus {i}"}) + "\n" for i in range(200)))
    prepare([other / "t.jsonl"], tokenizer_path=other / "tok", out=other / "prep", progress=False)
    with pytest.raises(ValueError, match="holds the tokens of .*tokenizer.json, and this model reads"):
        evaluate(checkpoint=str(tmp_path), data=str(other / "prep"), overrides=["train.global_batch_size=4"])


LAYOUTS = {"dp2": ["train.global_batch_size=8"],
           "cp2_ring_document_mask": ["parallel.cp=2", "parallel.cp_method=ring", "data.document_mask=true"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_on_a_prepared_folder_match_one_process_in_fp64(tmp_path, prepared, folder, layout):
    cfg = load_config(overrides=[*SMALL_MODEL, "train.seq_len=32", "train.global_batch_size=8",
                                 "train.micro_batch_size=2", "train.lr=3e-3", "train.warmup_steps=2",
                                 "train.device=cpu", "train.val_interval=3", "train.val_batches=1",
                                 "parallel.bucket_size_mb=0.02", f"data.path={prepared}", f"data.tokenizer={folder}",
                                 "model.vocab_size=320", *LAYOUTS[layout]])
    report = verify.run(cfg, nproc=2, steps=3, run_dir=tmp_path, launch=harness_launch, log=io.StringIO())
    assert report.ok, verify.format_report(report)
    worst = max(max(r.loss[2], r.grad_norm[2]) for r in report.rows)
    assert worst <= FP64_TOL and report.max_weight_diff <= FP64_TOL, verify.format_report(report)


def test_a_blend_of_texts_and_conversations_counts_each_as_its_own(tmp_path, prepared, folder):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"What is {i} plus {i}? {2 * i}."}) + "\n" for i in range(400)))
    prepare([texts], tokenizer_path=folder / "tokenizer.json", out=tmp_path / "texts", progress=False)
    text_ds = PreparedDataset(tmp_path / "texts", seq_len=SEQ, tokenizer_path=folder)
    chat_ds = PreparedDataset(prepared, seq_len=SEQ, tokenizer_path=folder)
    blend = BlendedDataset([(text_ds, 1.0), (chat_ds, 1.0)])
    ids = blend.order(0, 0, np.arange(32))
    source = ids >= len(text_ds)
    assert 0 < source.sum() < 32
    inputs, targets = blend.batch(ids)
    chat_rows = torch.from_numpy(source)
    assert (targets[~chat_rows] != IGNORE_INDEX).all()  # every target of a text counts
    assert (targets[chat_rows] == IGNORE_INDEX).any()
    assert blend.loss_targets(ids) == int((targets != IGNORE_INDEX).sum())


def test_what_cannot_be_trained_as_asked_is_refused_by_name(tmp_path, chat_file, prepared, folder):
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "plain"}) + "\n")
    with pytest.raises(ValueError, match="holds conversations and .*texts.jsonl texts; prepare each kind"):
        prepare([chat_file, texts], tokenizer_path=folder, out=tmp_path / "mixed", progress=False)
    with pytest.raises(ValueError, match=r"chat\.jsonl:1 is a conversation with no field 'content', in a file read"):
        prepare([chat_file], tokenizer_path=folder, out=tmp_path / "f", field="content", progress=False)
    both = tmp_path / "both.jsonl"  # rows with a text and messages: conversations, unless --field names the text
    both.write_text("".join(json.dumps({"body": f"{i} plus {i}", **c}) + "\n" for i, c in enumerate(conversations(9))))
    assert "num_loss_tokens" in prepare([both], tokenizer_path=folder, out=tmp_path / "b1", progress=False)
    assert "num_loss_tokens" not in prepare([both], tokenizer_path=folder, out=tmp_path / "b2", field="body",
                                            progress=False)
    late = tmp_path / "late.jsonl"  # a file of texts, then a conversation: named by its line
    late.write_text(json.dumps({"text": "plain"}) + "\n" + json.dumps(conversations(1)[0]) + "\n")
    with pytest.raises(ValueError, match=r"late\.jsonl:2 is a conversation with no field 'text'"):
        prepare([late], tokenizer_path=folder, out=tmp_path / "late", progress=False)
    with pytest.raises(ValueError, match="--all-tokens is for conversations"):
        prepare([texts], tokenizer_path=folder, out=tmp_path / "t", progress=False, assistant_only=False)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n{oops\n")
    with pytest.raises(ValueError, match=r"broken\.jsonl:2 is not valid JSON"):
        prepare([chat_file, broken], tokenizer_path=folder, out=tmp_path / "b", progress=False)
    bad = tmp_path / "bad.jsonl.gz"  # a compressed file of conversations is read as one; its bad line named
    rows = [json.dumps(c) for c in conversations(3)] + ['{"messages": [{"role": "wizard", "content": "x"}]}']
    bad.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    with pytest.raises(ValueError, match=r"bad\.jsonl\.gz:4: .*wizard"):
        prepare([bad], tokenizer_path=folder, out=tmp_path / "bad", progress=False)
    every = tmp_path / "every"
    prepare([chat_file], tokenizer_path=folder, out=every, progress=False, assistant_only=False)
    assert not list(every.glob("*.mask"))
    with pytest.raises(ValueError, match="prepared with --all-tokens .*data.assistant_only_loss=false"):
        PreparedDataset(every, seq_len=SEQ, tokenizer_path=folder)
    assert PreparedDataset(every, seq_len=SEQ, assistant_only=False).loss_targets(np.arange(4)) > 0
    from meshlm.train.setup import load_training_tokenizer

    (tmp_path / "plain").mkdir()  # the same tokenizer.json, without the folder's template
    (tmp_path / "plain" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    cfg = load_config(overrides=[*SMALL_MODEL, f"data.path={prepared}", "model.vocab_size=320", "train.seq_len=32",
                                 f"data.tokenizer={tmp_path / 'plain' / 'tokenizer.json'}"])
    with pytest.raises(ValueError, match="rendered with another chat template than data.tokenizer="):
        load_training_tokenizer(cfg)


def test_a_parquet_file_of_conversations_prepares_as_its_json_lines_do(tmp_path, folder):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = conversations(40, seed=7)
    write_jsonl(tmp_path / "c.jsonl", rows)
    # as Hugging Face chat datasets store them: messages a list of structs (a field one message lacks is null in
    # the others), tools a JSON text
    rows[0]["messages"][1]["name"] = "calculator"
    table = pa.Table.from_pylist([{**r, "tools": "[]"} for r in rows])
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
    a = prepare([tmp_path / "c.jsonl"], tokenizer_path=folder, out=tmp_path / "a", progress=False)
    b = prepare([tmp_path / "c.parquet"], tokenizer_path=folder, out=tmp_path / "b", progress=False, shard_bytes=1)
    assert a["num_tokens"] == b["num_tokens"] and a["num_loss_tokens"] == b["num_loss_tokens"]
    assert b["num_shards"] == 6  # one per row group
    for name in ("bin", "mask"):
        assert (tmp_path / "a" / f"train-000000.{name}").read_bytes() == b"".join(
            (tmp_path / "b" / f"train-{k:06d}.{name}").read_bytes() for k in range(6))
    bad = pa.Table.from_pylist([{**rows[1], "tools": "[]"},
                                {"messages": [{"role": "user", "content": "x"}], "tools": "[oops"}])
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet:row 2: 'tools' is a text that is not JSON"):
        prepare([tmp_path / "bad.parquet"], tokenizer_path=folder, out=tmp_path / "bad", progress=False)


def test_data_show_marks_what_the_loss_counts_in_a_prepared_folder_and_a_file_alike(prepared, chat_file, folder,
                                                                                    capsys):
    from meshlm.cli import main

    def shown(*args):
        assert main(["data", "show", *args, "--seq-len", str(SEQ), "--samples", "3", "--first", "2",
                     "--no-color"]) == 0
        return capsys.readouterr().out

    from_folder = shown(str(prepared), "--tokenizer", str(folder))
    from_file = shown(chat_file, "--tokenizer", str(folder))
    assert from_folder.count("--- sample ") == 3 and "--- sample 2 of " in from_folder
    marked = [piece.split("]]")[0] for piece in from_folder.split("[[")[1:]]
    assert marked and all(piece.endswith("<|im_end|>\n") for piece in marked if "<|im_end|>" in piece)
    assert "<|im_start|>assistant\n[[" in from_folder and "[[<|im_start|>" not in from_folder
    packed = in_memory(chat_file, folder)[0]
    counted = int((packed.batch(np.arange(2, 5))[1] != IGNORE_INDEX).sum())
    headers = [line for line in from_file.splitlines() if line.startswith("--- sample")]
    assert sum(int(line.split(": ")[1].split(" of ")[0]) for line in headers) == counted > 0
    every = shown(str(prepared), "--all-tokens", "--split-across-samples")
    assert f"{SEQ} of {SEQ} targets count" in every


def test_data_show_decodes_as_training_reads_texts_and_splits_no_character(tmp_path, folder):
    from meshlm.data.show import open_samples, sample_runs
    from meshlm.tokenizer import load_tokenizer

    texts = tmp_path / "t.jsonl"  # texts, read through a model folder: its plain tokenizer, as training reads them
    texts.write_text("".join(json.dumps({"text": f"naïve {i} ☃ plus"}) + "\n" for i in range(300)))
    samples, tokenizer = open_samples(texts, tokenizer=str(folder), seq_len=SEQ)
    data = DataConfig(path=str(texts), tokenizer=str(folder), val_fraction=0.0)
    packed = build_datasets(data, seq_len=SEQ, tokenizer=load_tokenizer(folder))[0]  # plain: no template's EOS
    assert len(samples) == len(packed) and torch.equal(samples.samples(np.arange(5)), packed.samples(np.arange(5)))
    chats = tmp_path / "c.jsonl"  # bytes: a reply's first character is two bytes, split between runs
    write_jsonl(chats, [{"messages": [{"role": "user", "content": "ça?"}, {"role": "assistant", "content": "é ✓"}]}
                        for _ in range(40)])
    samples, tokenizer = open_samples(chats, tokenizer=None, seq_len=SEQ)
    for i in range(4):
        runs, counted = sample_runs(samples, i, tokenizer)
        assert "".join(text for text, _ in runs) == tokenizer.decode(samples.samples(np.asarray([i]))[0].tolist())
        assert counted and all("\ufffd" not in text for text, counts in runs if counts)
    with pytest.raises(ValueError, match="not a prepared folder.*leave --split out"):
        open_samples(chats, tokenizer=None, seq_len=SEQ, split="val")


def test_bad_inputs_are_named_leave_nothing_behind_and_blends_name_the_folder_at_fault(tmp_path, chat_file,
                                                                                      prepared, folder):
    texts = tmp_path / "t.jsonl"  # a lone surrogate in a text: named by file:line, prepared or read in memory
    texts.write_text('{"text": "ok"}\n{"text": "bad \\ud800 x"}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: field 'text' holds text that is not valid Unicode"):
        prepare([texts], tokenizer_path=folder, out=tmp_path / "t", progress=False)
    assert not (tmp_path / "t").exists()  # no shard finished: nothing left, the same command runs once it is fixed
    with pytest.raises(ValueError, match=r"t\.jsonl:2: its 'text' holds text that is not valid Unicode"):
        build_datasets(DataConfig(path=str(texts)), seq_len=SEQ, tokenizer=conversation_tokenizer(None))
    texts.write_text('{"text": "ok"}\n{"text": "fixed"}\n')
    assert prepare([texts], tokenizer_path=folder, out=tmp_path / "t", progress=False)["num_shards"] == 1
    same = tmp_path / "same.jsonl"  # every conversation hashes into 'val': training is told so
    from meshlm.data.prepare import _split_of

    into_val = next(c for c in conversations(20) if _split_of(json.dumps(c).encode(), 0.5) == "val")
    write_jsonl(same, [into_val] * 20)
    prepare([same], tokenizer_path=folder, out=tmp_path / "same", val_fraction=0.5, progress=False)
    from meshlm.train.setup import build_data, load_training_tokenizer

    def cfg_of(*data):
        return load_config(overrides=[*SMALL_MODEL, "model.vocab_size=320", f"train.seq_len={SEQ}",
                                      f"data.tokenizer={folder}", *data])

    cfg = cfg_of(f"data.path={tmp_path / 'same'}")
    with pytest.raises(ValueError, match="'train' split is empty: all its 20 documents hashed into 'val'"):
        build_data(cfg, load_training_tokenizer(cfg), micro_batch_size=1, dp_rank=0, dp_size=1)
    other = tmp_path / "other_model"  # another template: a blend names the folder rendered with it, not the others
    other.mkdir()
    (other / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!",
                                                             "eos_token": "<|im_end|>"}))
    blend = cfg_of(f"data.sources=[{{path = \"{prepared}\", weight = 1}}]", f"data.tokenizer={other}")
    with pytest.raises(ValueError, match=f"^{prepared} holds conversations rendered with another chat template"):
        load_training_tokenizer(blend)
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x", "eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>', which is not a token of its tokenizer.json"):
        prepare([chat_file], tokenizer_path=other, out=tmp_path / "nope", progress=False)
