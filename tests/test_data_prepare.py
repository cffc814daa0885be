"""`meshlm data prepare`: shards hold exactly the directly tokenized documents (every input format, 1 and 2
workers), the validation split follows the per-document hash rule, reruns resume, and every bad input fails
before any work with one line naming the file and the fix."""

import hashlib
import json
import os

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")
pytest.importorskip("zstandard")

from prepared_data import encode, make_docs, make_tokenizer, read_split, write_all_formats, write_jsonl, write_parquet

from meshlm.cli import main
from meshlm.data.prepare import prepare


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.mark.parametrize("workers", [1, 2])
def test_shards_equal_direct_tokenization_of_every_format(tmp_path, tokenizer, workers):
    docs = write_all_formats(tmp_path / "src", make_docs(120))
    summary = prepare([tmp_path / "src"], tokenizer_path=tokenizer, out=tmp_path / "out", workers=workers,
                      shard_bytes=700, progress=False)
    expected = encode(tokenizer, docs)
    tokens, starts = read_split(tmp_path / "out")
    assert tokens.tolist() == sum(expected, [])
    assert starts.tolist() == np.cumsum([0] + [len(e) for e in expected])[:-1].tolist()
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    shards = m["splits"]["train"]["shards"]
    assert m["dtype"] == "uint16" and m["tokenizer"]["eos_token_id"] is not None and "val" not in m["splits"]
    assert summary["num_shards"] == len(shards) == summary["shards_written"] > 3
    assert summary["num_documents"]["train"] == len(docs) == m["splits"]["train"]["num_documents"]
    assert m["splits"]["train"]["num_tokens"] == len(tokens) == sum(s["num_tokens"] for s in shards)
    for s in shards:
        assert hashlib.sha256((tmp_path / "out" / s["bin"]).read_bytes()).hexdigest() == s["sha256"]
    assert not list((tmp_path / "out").glob("*.tmp")) and not (tmp_path / "out" / "progress").exists()


def test_validation_split_by_document_hash(tmp_path, tokenizer):
    from meshlm.data.text import split_documents

    docs = make_docs(80)
    write_jsonl(tmp_path / "a.jsonl", docs)
    prepare([tmp_path / "a.jsonl"], tokenizer_path=tokenizer, out=tmp_path / "out", val_fraction=0.25,
            shard_bytes=1500, progress=False)
    train_docs, val_docs = split_documents(docs, 0.25)
    assert 0 < len(val_docs) < len(docs) / 2
    assert read_split(tmp_path / "out", "train")[0].tolist() == sum(encode(tokenizer, train_docs), [])
    assert read_split(tmp_path / "out", "val")[0].tolist() == sum(encode(tokenizer, val_docs), [])


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "<|endoftext|>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("w1 w65535 w65536 w69999 nope")
    prepare([tmp_path / "a.txt"], tokenizer_path=tmp_path / "tok.json", out=tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["dtype"] == "uint32"
    assert read_split(tmp_path / "out")[0].tolist() == [1, 65535, 65536, 69999, 70_000, 70_001]


def test_rerun_resumes_and_ignores_a_killed_runs_temp_files(tmp_path, tokenizer):
    """The first run dies at a bad line in the last shards; with the line fixed (same size), the rerun writes
    only the shards that were not finished, over a garbage temp file, and the result is a fresh run's."""
    docs = make_docs(150)
    src = write_jsonl(tmp_path / "a.jsonl", docs)
    lines = src.read_bytes().splitlines(keepends=True)
    bad = lines[-3]
    src.write_bytes(b"".join(lines[:-3] + [b"{" + b"x" * (len(bad) - 2) + b"\n"] + lines[-2:]))
    kwargs = dict(tokenizer_path=tokenizer, out=tmp_path / "out", shard_bytes=600, progress=False)
    with pytest.raises(ValueError, match=rf"a\.jsonl:{len(lines) - 2} is not valid JSON"):
        prepare([src], **kwargs)
    out = tmp_path / "out"
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("train-*.bin")}
    assert len(finished) > 3 and not (out / "manifest.json").exists()
    next_shard = f"train-{len(list((out / 'progress').glob('0*.json'))):06d}.bin"
    (out / f"{next_shard}.tmp").write_bytes(b"garbage of a killed run")
    with pytest.raises(ValueError, match="unfinished preparation"):
        prepare([src], **{**kwargs, "shard_bytes": 601})

    src.write_bytes(b"".join(lines))  # fixed, same size
    summary = prepare([src], **kwargs)
    assert summary["shards_skipped"] == len(finished) and summary["shards_written"] >= 1
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("train-*.bin") if p.name in finished} == finished
    assert read_split(out)[0].tolist() == sum(encode(tokenizer, docs), [])
    assert not list(out.glob("*.tmp"))
    fresh = prepare([src], **{**kwargs, "out": tmp_path / "fresh"})
    assert (out / "manifest.json").read_text().replace(str(out), "") == \
        (tmp_path / "fresh" / "manifest.json").read_text().replace(str(tmp_path / "fresh"), "")
    again = prepare([src], **kwargs)  # complete: nothing to do
    assert again["shards_written"] == 0 and again["shards_skipped"] == fresh["num_shards"]


def _bad_inputs(tmp_path, tokenizer):
    """name -> (sources, prepare keywords, the message's pattern)."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "hidden_only").mkdir()
    (tmp_path / "hidden_only" / ".x").write_text("x")
    (tmp_path / "empty_only").mkdir()
    (tmp_path / "empty_only" / "a.txt").write_text("")
    write_parquet(tmp_path / "no_field.parquet", ["a", "b"], field="content")
    write_jsonl(tmp_path / "no_field.jsonl", ["a", "b"], field="body")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"text": 3}\n')
    (tmp_path / "blank.jsonl.zst").write_bytes(__import__("zstandard").ZstdCompressor().compress(b"\n\n"))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstd at all")
    whole = __import__("zstandard").ZstdCompressor().compress(b'{"text": "a line of text"}\n' * 2000)
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[:len(whole) // 2])  # a download cut short
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "manifest.json").write_text("{}")
    (tmp_path / "prepared" / "train-000000.bin").write_bytes(b"\0\0")
    (tmp_path / "x.txt.gz").write_bytes(b"\x1f\x8b")
    (tmp_path / "broken_tok.json").write_text("{not a tokenizer")
    good = tmp_path / "ok.txt"
    good.write_text("hello")
    os.mkfifo(tmp_path / "pipe")
    return {
        "a pipe": ([tmp_path / "pipe"], {}, r"source .*pipe is not a regular file \(a pipe or a device\)"),
        "missing source": ([tmp_path / "nope.jsonl"], {}, r"source '.*nope\.jsonl' does not exist"),
        "empty file": ([tmp_path / "empty.txt"], {}, r"source file .*empty\.txt is empty"),
        "empty folder": ([tmp_path / "empty_dir"], {}, r"source folder .*empty_dir holds no files"),
        "only hidden files": ([tmp_path / "hidden_only"], {}, r"hidden_only holds no data files \(only 1 hidden"),
        "only empty files": ([tmp_path / "empty_only"], {}, r"empty_only holds only empty files \(1\)"),
        "parquet without the field": ([tmp_path / "no_field.parquet"], {},
                                      r"no_field\.parquet has no column 'text' \(columns: content, n\); pass --field"),
        "jsonl without the field": ([tmp_path / "no_field.jsonl"], {}, r"no_field\.jsonl:1 has no field 'text'"),
        "jsonl field not a string": ([tmp_path / "bad.jsonl"], {}, r"bad\.jsonl:3: field 'text' is int"),
        "jsonl with no lines": ([tmp_path / "blank.jsonl.zst"], {}, r"blank\.jsonl\.zst holds no JSON lines"),
        "damaged gzip": ([tmp_path / "bad.jsonl.gz"], {}, r"bad\.jsonl\.gz: cannot decompress"),
        "damaged zstandard": ([tmp_path / "bad.jsonl.zst"], {}, r"bad\.jsonl\.zst: cannot decompress"),
        "truncated zstandard": ([tmp_path / "cut.jsonl.zst"], {},
                                r"cut\.jsonl\.zst: cannot decompress \(the file ends inside a zstd frame: it is truncated"),
        "a binary file": ([tmp_path / "image.png"], {}, r"image\.png is binary \(a NUL byte in its first 8 KiB\)"),
        "one file twice": ([good, tmp_path / "." / "ok.txt"], {}, r"ok\.txt is given twice .*drop one of the sources"),
        "a prepared dataset": ([tmp_path / "prepared"], {}, r"prepared is a prepared dataset .*data\.path="),
        "compressed text": ([tmp_path / "x.txt.gz"], {}, r"x\.txt\.gz: compressed inputs must be"),
        "tokenizer missing": ([good], {"tokenizer_path": tmp_path / "none.json"}, r"--tokenizer .*none\.json does not"),
        "tokenizer unreadable": ([good], {"tokenizer_path": tmp_path / "broken_tok.json"},
                                 r"--tokenizer .*broken_tok\.json is not a readable tokenizer\.json"),
        "out inside a source": ([tmp_path], {"out": tmp_path / "sub" / "out"}, r"lies inside source folder"),
        "out not ours": ([good], {"out": tmp_path}, r"--out .* exists and is not a prepared dataset"),
        "bad val fraction": ([good], {"val_fraction": 1.0}, r"--val-fraction=1\.0 must be in \[0, 1\)"),
        "no workers": ([good], {"workers": 0}, r"--workers=0 must be >= 1"),
    }


def test_a_folder_leaves_out_hidden_files_job_markers_and_empty_files_and_says_so(tmp_path):
    """A code corpus has `_private.py` files (read) and empty files (an empty __init__.py: left out, not fatal);
    a Spark / Hadoop / parquet output folder has markers beside its part files (left out); all counted in one line."""
    from meshlm.data.sources import list_files

    src = tmp_path / "src"
    files = {"b.txt": "bee", "a/empty.txt": "", "a/x.txt": "ex", ".git/c.txt": "hidden", "a/.DS_Store": "x",
             "_utils.py": "u", "pkg/__init__.py": "", "pkg/_private/mod.py": "m", "__main__.py": "x",
             "_SUCCESS": "", "_committed_123": "{}", "_started_123": "", "part-0.parquet.crc": "c",
             ".part-0.parquet.crc": "c", "_metadata": "m", "_common_metadata": "m", "_temporary/0/part-0.txt": "t",
             "t/_delta_log/000.json": "{}", "metadata.txt": "kept", "_SUCCESS.txt": "kept"}
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    (src / "img").mkdir()
    (src / "img" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")  # a NUL byte: not text
    listing = list_files([src])
    assert [f.relative_to(src).as_posix() for f in listing.files] == [
        "_SUCCESS.txt", "__main__.py", "_utils.py", "a/x.txt", "b.txt", "metadata.txt", "pkg/_private/mod.py"]
    rel = {reason: [p.relative_to(src).as_posix() for p in paths] for reason, paths in listing.left_out.items()}
    assert rel == {"hidden": [".git/c.txt", ".part-0.parquet.crc", "a/.DS_Store"],
                   "job markers": ["_SUCCESS", "_committed_123", "_common_metadata", "_metadata", "_started_123",
                                   "_temporary/0/part-0.txt", "part-0.parquet.crc", "t/_delta_log/000.json"],
                   "empty": ["a/empty.txt", "pkg/__init__.py"], "binary": ["img/logo.png"]}
    note = listing.note().replace(src.as_posix() + "/", "")
    assert note == ("left out 14 of the 21 files in the source folders: 3 hidden (.git/c.txt, .part-0.parquet.crc, "
                    "a/.DS_Store); 8 job markers (_SUCCESS, _committed_123, _common_metadata, ...); "
                    "2 empty (a/empty.txt, pkg/__init__.py); 1 binary (img/logo.png)")
    assert list_files([src / "b.txt"]).note() == ""


def test_each_bad_input_fails_with_one_line_naming_it(tmp_path, tokenizer):
    cases = _bad_inputs(tmp_path, tokenizer)
    for name, (srcs, kwargs, pattern) in cases.items():
        kwargs = {"tokenizer_path": tokenizer, "out": tmp_path / f"out_{len(name)}_{name[:5]}", "progress": False,
                  **kwargs}
        with pytest.raises(ValueError, match=pattern) as e:
            prepare(srcs, **kwargs)
        assert "\n" not in str(e.value), name


def test_cli(tmp_path, tokenizer, capsys):
    (tmp_path / "src").mkdir()
    write_parquet(tmp_path / "src" / "a.parquet", make_docs(30), field="content")
    (tmp_path / "src" / "_SUCCESS").write_text("")
    argv = ["data", "prepare", str(tmp_path / "src"), "--tokenizer", str(tokenizer), "--out",
            str(tmp_path / "out"), "--no-progress", "--val-fraction", "0.1"]
    assert main(argv + ["--field", "content", "--workers", "2"]) == 0
    out, err = capsys.readouterr()
    assert "train" in out
    note = f"meshlm data prepare: left out 1 of the 2 files in the source folders: 1 job marker " \
           f"({(tmp_path / 'src' / '_SUCCESS').as_posix()})\n"
    assert err == note
    assert os.path.exists(tmp_path / "out" / "manifest.json")
    assert main(argv + ["--field", "content", "--val-fraction", "0.2"]) == 2  # other settings, same folder
    err = capsys.readouterr().err
    assert err.startswith(note)  # said before any check of the output folder
    err = err[len(note):].strip()
    assert err.startswith("meshlm data: error: --out") and "val_fraction" in err and "\n" not in err
    assert main(argv) == 2  # the parquet file has no column 'text'
    assert "pass --field NAME" in capsys.readouterr().err
