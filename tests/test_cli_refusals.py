"""Inputs a fuzz pass over `meshlm data`, `verify`, `plot`, `config`, `info`, `convert`, `rag` and `cluster` found
ending in a traceback, a hang or a silent nonsense, each now one line on stderr naming the value and the fix (exit 2,
or 1 for a path that cannot be read or written). In process through `meshlm.cli.main`: no rank is started."""

import json

import pytest
import torch

from meshlm.cli import main


def _one_line(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_path_that_cannot_be_read_or_written_is_one_line_naming_it(tmp_path, capsys):
    folder = tmp_path / "cfg"
    folder.mkdir()
    line = _one_line(capsys, ["config", "--config", str(folder)], code=1)
    assert line.startswith("meshlm config: error: ") and str(folder) in line and "Is a directory" in line
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    line = _one_line(capsys, ["verify", "--nproc", "2", "--steps", "1", "--run-dir", str(a_file / "sub")], code=1)
    assert "afile" in line and "Not a directory" in line


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_data_prepare_refuses_a_shard_size_that_is_not_positive(tmp_path, capsys, value):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    line = _one_line(capsys, ["data", "prepare", str(src), "--tokenizer", str(tmp_path / "t.json"),
                              "--out", str(tmp_path / "o"), f"--shard-mb={value}"])
    assert f"--shard-mb={float(value)} must be a positive number of MiB" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("config, says", [
    ([1, 2], r"holds a JSON list, not an object"),
    ({"model_type": "llama", "num_attention_heads": 4}, r"lacks 'vocab_size', which a llama config.json holds"),
    ({"model_type": "llama", "vocab_size": 64, "hidden_size": None, "num_hidden_layers": 1,
      "num_attention_heads": 4, "intermediate_size": 64}, r"has a field of the wrong type"),
    ({"model_type": "llama", "vocab_size": 64, "hidden_size": 256.5, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 64},
     r"model\.hidden_size=256\.5 must be a whole number"),
    ({"model_type": "llama", "vocab_size": 64, "hidden_size": True, "num_hidden_layers": 1,
      "num_attention_heads": 1, "intermediate_size": 64}, r"model\.hidden_size=True must be a whole number"),
    ({"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "intermediate_size": 64, "rope_scaling": [1]}, r"has a field of the wrong type"),
    ("{not json", r"is not a JSON file"),
])
def test_info_names_what_is_wrong_in_a_hugging_face_config(tmp_path, capsys, config, says):
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    line = _one_line(capsys, ["info", "--hf", str(tmp_path)])
    assert line.startswith("meshlm info: error: ")
    assert __import__("re").search(says, line), line


def test_info_refuses_a_sequence_beyond_the_model(capsys):
    assert "--seq-len=-1 must be in 1..256" in _one_line(capsys, ["info", "--seq-len", "-1"])
    assert "--seq-len=257 must be in 1..256" in _one_line(capsys, ["info", "--seq-len", "257"])


@pytest.mark.parametrize("row, says", [
    ({"loss": 3.0}, "KeyError: 'step'"),
    ({"step": None, "loss": 3.0}, "TypeError"),
    ({"step": 1, "loss": 3.0, "comm_s": 5}, "AttributeError"),
    ({"step": "x", "loss": 3.0}, "ValueError"),
])
def test_plot_names_the_line_of_a_row_it_cannot_read(tmp_path, capsys, row, says):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 4.0}) + "\n" + json.dumps(row) + "\n")
    line = _one_line(capsys, ["plot", str(run), "--out", str(tmp_path / "p.png")])
    assert f"metrics.jsonl:2: a row meshlm train does not write ({says}" in line
    assert not (tmp_path / "p.png").exists()


def test_plot_refuses_an_out_without_a_suffix(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 4.0}) + "\n")
    line = _one_line(capsys, ["plot", str(run), "--out", str(run)])
    assert "is a folder or has no suffix" in line and "loss.png" in line
    assert "e.g. " + str(tmp_path / "pic.png") in _one_line(capsys, ["plot", str(run), "--out", str(tmp_path / "pic")])
    assert list(tmp_path.glob("*.png")) == []


def test_rag_refuses_an_empty_query_an_index_that_is_a_file_and_a_damaged_tokenizer(tmp_path, capsys):
    pytest.importorskip("bm25s")
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    assert "the query is empty" in _one_line(capsys, ["rag", "search", str(tmp_path), "  "])
    assert "is not a meshlm RAG index" in _one_line(capsys, ["rag", "search", str(a_file), "words"])
    pytest.importorskip("tokenizers")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("some words to index")
    (tmp_path / "tok.json").write_text("{not a tokenizer")
    line = _one_line(capsys, ["rag", "index", str(docs), "--out", str(tmp_path / "ix"), "--tokenizer",
                              str(tmp_path / "tok.json")])
    assert "tok.json' is not a readable tokenizer.json" in line


@pytest.mark.parametrize("argv, says", [
    (["verify", "--nproc", "2", "--steps", "1000000000"], "--steps=1000000000 must be in 1..1000"),
    (["verify", "--all-layouts", "--max-ranks", "1000"], "--max-ranks=1000 must be in 2..64"),
    (["verify", "--nproc", "2", "--seed", "3"], "--seed go with --all-layouts"),
    (["verify", "--nproc", "2", "--max-ranks", "4"], "--max-ranks go with --all-layouts"),
    (["train", "--nproc", "1", "--replica-groups", "2", "--emulate-nodes", "2", "--inter-node-bw", "1gbit"],
     "--replica-groups is not supported on emulated nodes"),
    (["train", "--set", 'model.rope_scaling={"factor":2}'], "(a TOML inline table: {factor = 8.0"),
    (["train", "--nproc", "1", "--emulate-nodes", "100000", "--inter-node-bw", "1gbit"],
     "100000 emulated nodes: need 2..200"),
])
def test_settings_that_ran_without_end_or_were_ignored_are_refused(capsys, argv, says):
    assert says in _one_line(capsys, argv)


def test_a_config_with_a_key_outside_any_section_says_so(tmp_path, capsys):
    (tmp_path / "c.toml").write_text("steps = 1\n")
    assert "config key 'steps' must be a [section] table, e.g. [train]" in _one_line(
        capsys, ["config", "--config", str(tmp_path / "c.toml")])
    (tmp_path / "b.toml").write_bytes(b"\xff\xfe\x00binary")
    assert "b.toml' is not valid TOML" in _one_line(capsys, ["config", "--config", str(tmp_path / "b.toml")])


@pytest.mark.parametrize("rate", ["1bit", "8bit", "999kbit", "2tbit", "99999999999999999999tbit"])
def test_an_emulated_link_outside_what_tc_shapes_is_refused(rate):
    from meshlm.emulate import parse_duration, parse_rate

    with pytest.raises(ValueError, match=r"outside 1mbit\.\.1tbit"):
        parse_rate(rate)
    assert parse_rate("1mbit") == 1e6 and parse_rate("1tbit") == 1e12
    with pytest.raises(ValueError, match=r"above 10 s"):
        parse_duration("100000s")


def test_a_damaged_or_missing_safetensors_file_is_named(tmp_path):
    from meshlm.models.hf import _read_safetensors

    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file"):
        list(_read_safetensors(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-2.safetensors"}}))
    with pytest.raises(ValueError, match=r"model-2\.safetensors', which model\.safetensors\.index\.json lists, is missing"):
        list(_read_safetensors(tmp_path))


def test_a_checkpoint_meta_json_lacking_a_field_is_called_corrupt_not_old(tmp_path):
    from meshlm.checkpoint.find import _meta_problem

    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"format": 3, "step": 1, "world_size": 1}))
    assert _meta_problem(tmp_path).endswith("meta.json is corrupt (lacks config)")
    meta.write_text(json.dumps({"format": 3, "step": "two", "world_size": 1, "config": {}}))
    assert "step that is not a whole number" in _meta_problem(tmp_path)
    meta.write_text(json.dumps({"format": 1, "step": 1, "world_size": 1, "config": {}}))
    assert "has format 1; this meshlm reads formats" in _meta_problem(tmp_path)


def test_rag_refuses_an_index_inside_its_documents(tmp_path, capsys):
    pytest.importorskip("bm25s")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("some words to index")
    for out in (docs, docs / "index"):
        line = _one_line(capsys, ["rag", "index", str(docs), "--out", str(out), "--overwrite"])
        assert "lies inside the documents folder" in line
    assert sorted(p.name for p in docs.iterdir()) == ["a.txt"]


EST = ["plan", "estimate", "--model", "llama3-8b", "--gpus", "8", "--global-batch-tokens", "1M", "--layout", "tp=8"]


@pytest.mark.parametrize("argv, says", [
    ([*EST, "--failure-rate", "0"], "failure rate 0.0 per GPU-hour must be > 0"),
    ([*EST, "--train-tokens", "inf"], "--train-tokens 'inf' must be a finite number > 0"),
    ([*EST, "--storage-bw", "nan"], "--storage-bw 'nan' must be a finite number > 0"),
    (["plan", "infer", "--model", "llama3-8b", "--gpus", "8", "--top", "0"], "--top 0 must be >= 1"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch-tokens", "1M", "--top", "-1"],
     "--top -1 must be >= 1"),
    (["plan", "infer", "--model", "llama3-8b", "--tp", "1", "--disaggregate", "4:4", "--batch", "8"],
     "a static batch (--batch) are modelled on one pool only"),
    ([*EST[:-2], "--layout", "tp=8,tp=4"], "layout key 'tp' is given twice in 'tp=8,tp=4'"),
    ([*EST[:-2], "--layout", "tp=0"], "layout tp=0 must be >= 1"),
    ([*EST[:-2], "--layout", "tp=8,bucket_size_mb=nan"], "layout bucket_size_mb='nan' must be a finite number > 0"),
    ([*EST[:-2], "--layout", "dp_replicate=2,tp=4", "--recovery", "replica", "--replica-groups", "3"],
     "--replica-groups 3 must divide the layout's 2 data-parallel ranks"),
    ([*EST[:-2], "--layout", "dp_replicate=2,tp=4", "--replica-sync-every", "0"], "--replica-sync-every 0 must be >= 1"),
    (["plan", "compare", "--model", "llama3-8b", "--gpus", "8", "--global-batch-tokens", "1M", "--cluster", "h100",
      "--cluster", "h100"], "--cluster h100 given twice"),
    (["plan", "calibrate", "--out", "x.json", "--nodes", "0"], "describe an emulated cluster; add --emulated"),
    (["plan", "calibrate", "--out", "x.json", "--emulated", "--nodes", "0", "--inter-node-bw", "1gbit"],
     "--nodes 0 must be >= 2"),
    (["plan", "schedule", "--pp", "12500", "--microbatches", "8"], "--pp 12500: at most 1024 stages"),
    (["plan", "schedule", "--pp", "8", "--microbatches", "100000000"], "forward passes to simulate; at most 100,000"),
])
def test_plan_refuses_what_gave_a_nan_a_traceback_or_a_hang(capsys, argv, says):
    assert says in _one_line(capsys, argv)


@pytest.mark.parametrize("flag", [["--failure-rate", "inf"], ["--restart-s", "nan"]])
def test_plan_number_flags_refuse_nan_and_infinity_at_parsing(capsys, flag):
    with pytest.raises(SystemExit) as e:
        main([*EST, *flag])
    assert e.value.code == 2 and "is not a finite number" in capsys.readouterr().err


def test_plan_search_over_a_billion_gpus_answers_at_once(capsys):
    from meshlm.planner.search import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and len(divisors(10**9)) == 100
    line = _one_line(capsys, ["plan", "--model", "llama3-8b", "--gpus", "1000000000", "--global-batch-tokens", "1M"])
    assert "no valid layout for 1000000000 GPUs" in line


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "holds a JSON list, not a config.json object"),
    ("{not json", "is not a JSON file"),
    ("{}", "config.json lacks 'num_hidden_layers'"),
    (json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 0, "intermediate_size": 128}), "model.num_heads=0 must be > 0"),
])
def test_plan_names_what_is_wrong_in_a_model_config(tmp_path, capsys, content, says):
    (tmp_path / "m.json").write_text(content)
    assert says in _one_line(capsys, ["plan", "infer", "--model", str(tmp_path / "m.json"), "--tp", "1"])


@pytest.mark.parametrize("change, says", [
    ({"matmul_flops": 0}, "holds matmul_flops=0, which no machine measures"),
    ({"memory_bandwidth": -5}, "holds memory_bandwidth=-5"),
    ({"link": None}, "cannot be read"),
    ({"matmul_flops": "abc"}, "cannot be read (could not convert string to float"),
])
def test_a_calibration_file_no_machine_measures_is_refused(tmp_path, capsys, change, says):
    cal = {"matmul_flops": 5e10, "memory_bandwidth": 2e10, "cpu_cores": 2, "link": {"bandwidth": 1e9, "latency": 1e-4},
           **change}
    (tmp_path / "cal.json").write_text(json.dumps(cal))
    line = _one_line(capsys, ["plan", "--model", "tiny", "--cluster", "local", "--calibration", str(tmp_path / "cal.json"),
                              "--gpus", "2", "--global-batch-size", "8", "--seq-len", "256"])
    assert says in line


INFER = ["plan", "infer", "--model", "llama3-8b", "--cluster", "h100"]


@pytest.mark.parametrize("argv, says", [
    ([*INFER, "--tp", "1", "--percentile", "50"], "--percentile 50 is the tail of Poisson arrivals' latencies"),
    ([*INFER, "--tp", "1", "--mtp-acceptance", "0.5"], "--mtp-acceptance 0.5 is the chance a draft token is accepted"),
    ([*INFER, "--tp", "1", "--calibration", "mine.json"], "--calibration mine.json describes --cluster local"),
    ([*EST, "--calibration", "mine.json"], "no --cluster here is local (h100)"),
    ([*INFER, "--layout", "tp=4", "--disaggregate", "4:4", "--gpus", "16"],
     "--gpus 16 and --disaggregate 4:4 (8 GPUs) disagree"),
    (["plan", "infer", "--model", "mixtral-8x7b", "--cluster", "h100", "--tp", "2", "--dense-precision", "fp4"],
     "--dense-precision fp4: h100 has no fp4 tensor cores"),
    (["plan", "context", "--model", "llama3-8b", "--context", "1K", "--max-gpus", "1000000000"],
     "--max-gpus 1,000,000,000 is beyond the 1,048,576 GPUs"),
    ([*EST[:-2], "--layout", "tp=8,pp_schedule=interleaved"], "layout pp_schedule=interleaved acts only with pp > 1"),
    ([*EST[:-2], "--layout", "tp=8,cp_method=ulysses"], "layout cp_method=ulysses acts only with cp > 1"),
    ([*EST[:-2], "--layout", "tp=4,expert_tp=2"], "layout expert_tp=2 splits routed experts; llama3-8b is dense"),
    ([*EST, "--cluster", "a100", "--precision", "fp8"], "A100-SXM-80G has no fp8 tensor cores to train in"),
])
def test_plan_refuses_a_setting_it_would_have_ignored_or_priced_wrongly(capsys, argv, says):
    assert says in _one_line(capsys, argv)


def test_plan_infer_blames_the_engine_cap_not_the_memory_when_the_cap_binds(capsys):
    assert main([*INFER, "--tp", "1", "--batch", "64", "--max-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "the engine runs at most 8 at once per dp rank (--max-batch" in out and "MiB of KV cache" not in out
    assert main([*INFER, "--tp", "1", "--batch", "640"]) == 0  # beyond the KV cache: the memory is named
    assert "MiB of KV cache each per GPU alone" in capsys.readouterr().out


def test_plan_context_never_splits_a_sequence_over_more_cp_ranks_than_tokens(capsys):
    assert main(["plan", "context", "--model", "llama3-8b", "--context", "1K", "--max-gpus", "1048576",
                 "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    cps = [int(p["layout"].split("cp=")[1].split(",")[0]) for p in answer["curve"]]
    assert max(cps) <= 1024 + 1 and len(cps) > 1


@pytest.mark.parametrize("plot, says", [
    ("missing/x.png", "the folder"), ("x", "is a folder or has no suffix"), ("x.xyz", "matplotlib draws no .xyz")])
def test_plan_refuses_a_plot_it_cannot_write_before_the_search(tmp_path, capsys, monkeypatch, plot, says):
    pytest.importorskip("matplotlib")
    import meshlm.planner.search as search

    monkeypatch.setattr(search, "search", lambda *a, **k: pytest.fail("searched before refusing --plot"))
    line = _one_line(capsys, ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch-tokens", "1M",
                              "--plot", str(tmp_path / plot)])
    assert line.startswith("meshlm plan: error: --plot") and says in line


@pytest.mark.parametrize("spoil, says", [
    (lambda t: t.to(torch.int8), "is int8: a quantized checkpoint"),
    (lambda t: t.to(torch.float8_e4m3fn), "is float8_e4m3fn: a quantized checkpoint"),
    (lambda t: t.index_fill(0, torch.tensor([0]), float("nan")), "holds NaN or infinite values"),
])
def test_a_hugging_face_checkpoint_a_cast_would_corrupt_is_refused(tmp_path, spoil, says):
    from safetensors.torch import load_file, save_file

    from meshlm.config import ModelConfig
    from meshlm.models import build_model
    from meshlm.models.hf import load_pretrained, save_pretrained

    save_pretrained(build_model(ModelConfig.from_preset("tiny"), seed=0), tmp_path)
    load_pretrained(tmp_path)  # as saved: loads
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = spoil(tensors[name]).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' in .* {says}"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("flags, says", [
    (["--prompt", "\udcff\udcfe"], "--prompt is not valid UTF-8 text"),
    (["--top-p", "2"], "--top-p 2.0 must be in (0, 1]"),
    (["--top-k", "-5"], "--top-k -5 must be an integer >= 1 (0 or -1 disables it)"),
    (["--seed", str(2**64)], "--seed 18446744073709551616 must be an integer in [-2**63, 2**64)"),
    (["--min-p", "2"], "--min-p 2.0 must be in [0, 1] (0 is off)"),
    (["--repetition-penalty", "0"], "--repetition-penalty 0.0 must be > 0 (1 is off)"),
    (["--frequency-penalty", "3"], "--frequency-penalty 3.0 must be in [-2, 2] (0 is off)"),
    (["--kv-host-mb", "inf"], "kv_host_mb=inf (--kv-host-mb) must be a finite number >= 0"),
    (["--kv-disk-mb", "inf", "--kv-disk-dir", "d"], "kv_disk_mb=inf (--kv-disk-mb) must be a finite number >= 0"),
])
def test_generate_names_the_flag_of_a_setting_it_refuses(tmp_path, capsys, flags, says):
    (tmp_path / "config.json").write_text("{}")  # refused before any model is read
    argv = ["generate", "--hf", str(tmp_path), "--prompt", "hi", *flags]
    assert says in _one_line(capsys, argv)


def test_generate_refuses_an_empty_folder_name_and_names_both_kinds_of_model_it_looked_for(tmp_path, capsys):
    assert "--hf is empty; give a folder" in _one_line(capsys, ["generate", "--hf", "", "--prompt", "hi"])
    line = _one_line(capsys, ["generate", "--hf", str(tmp_path), "--prompt", "hi"])
    assert "is neither a Hugging Face model directory (no config.json in it) nor a meshlm checkpoint" in line


def test_generate_refuses_an_infinite_temperature_at_parsing(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--hf", ".", "--prompt", "hi", "--temperature", "inf"])
    assert e.value.code == 2 and "'inf' is not a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("num_layers", 0), ("hidden_size", -256)])
def test_planner_estimate_validates_the_model_config_it_is_given(field, value):
    """A ZeroDivisionError, or a negative step time that fit, before (found by a fuzz pass of the Python API)."""
    from meshlm import planner
    from meshlm.config import ModelConfig

    with pytest.raises(ValueError, match=f"model.{field}={value} must be > 0"):
        planner.estimate(ModelConfig.from_preset("tiny", **{field: value}), "h100", gpus=1, layout="tp=1",
                         global_batch_size=8, seq_len=256)


@pytest.mark.parametrize("change, error, says", [
    (dict(layout=5), ValueError, "layout must be 'tp=8,pp=4,...', a dict of those keys or a Layout, not int"),
    (dict(model=None), ValueError, "model must be a preset name, a config.json path or a ModelConfig"),
    (dict(gpus=1.5), ValueError, "gpus=1.5 must be a whole number"),
    (dict(seq_len=float("inf")), ValueError, "seq_len=inf must be a whole number"),
])
def test_the_planner_python_api_names_an_argument_of_the_wrong_kind(change, error, says):
    """AttributeError / OverflowError / a message naming --gpus before (found by a fuzz pass of the Python API)."""
    from meshlm import planner

    args = {**dict(model="llama3-8b", cluster="h100", gpus=8, layout="tp=8", global_batch_size=8, seq_len=256),
            **change}
    with pytest.raises(error, match=__import__("re").escape(says)):
        planner.estimate(args.pop("model"), args.pop("cluster"), **args)
    if "layout" not in change:
        with pytest.raises(ValueError, match="top=-1 must be a whole number >= 0"):
            planner.plan("llama3-8b", "h100", gpus=8, global_batch_size=8, seq_len=256, top=-1)


@pytest.mark.parametrize("preset, field, value, says", [
    ("tiny", "init_std", float("inf"), "must be a finite number"),
    ("tiny-moe", "capacity_factor", float("inf"), "must be a finite number"),
    ("tiny-moe", "num_experts_per_token", 1.5, "must be a whole number"),
    ("tiny", "norm_eps", None, "must be a finite number"),
    ("tiny", "rope_scaling", 5, "must be a table of RoPE scaling keys \\(llama3, yarn or linear\\)"),
    ("tiny", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0},
     "has rope_type 'dynamic', which must be one of llama3"),
    ("tiny", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "is missing keys \\['original_max_position_embed"),
    ("tiny", "rope_scaling", {"rope_type": "linear", "factor": 0}, "has a factor that is not a number > 0"),
    ("tiny", "hidden_size", None, "must be a whole number"),  # a TypeError as the head width was derived
    ("tiny", "num_heads", "4", "must be a whole number"),
])
def test_a_model_config_of_numbers_the_model_cannot_use_is_refused(preset, field, value, says):
    """Validated before, then non-finite weights, an OverflowError or a TypeError inside the forward (found by a fuzz
    pass of the Python API)."""
    from meshlm.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=f"model.{field}=.* {says}"):
        ModelConfig.from_preset(preset, **{field: value}).validate()


def test_load_config_refuses_an_empty_path_and_overrides_that_are_not_a_list_of_strings():
    """'' read the working directory; a string of overrides was split into characters; an int one was an
    AttributeError (found by a fuzz pass of the Python API)."""
    from meshlm.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="config file '' is empty"):
        load_config("")
    for overrides in ("model.num_layers=2", ["model.num_layers=2", 5]):
        with pytest.raises(ConfigError, match="must be a list of 'section.field=value' strings"):
            load_config(None, overrides)


@pytest.mark.parametrize("kw, error, says", [
    (dict(dtype="float32"), ValueError, "dtype='float32' must be a floating torch.dtype"),
    (dict(device="nope"), ValueError, "device='nope' is not a torch device"),
    (dict(device="meta"), ValueError, "device='meta' holds no weights to load into"),
])
def test_load_pretrained_names_a_dtype_or_device_it_cannot_load_into(tmp_path, kw, error, says):
    """'Invalid device string: float32' (naming the wrong argument) or a torch RuntimeError before."""
    from meshlm.models.hf import load_pretrained

    with pytest.raises(error, match=says):
        load_pretrained(tmp_path, **kw)


def test_a_layout_key_at_its_default_asks_for_nothing_and_is_taken():
    """The refusal of keys without their degree takes a full `Layout.to_dict()` (every key, at its default)."""
    from meshlm.planner import estimate
    from meshlm.planner.layout import Layout

    for layout in (Layout(tp=8).to_dict(), "tp=8,pp=1,pp_schedule=1f1b", {"tp": 8, "cp_method": "ring"}):
        assert estimate("llama3-8b", "h100", gpus=8, layout=layout, global_batch_tokens="1M").layout.tp == 8
