"""Config loading: TOML files, presets, dotted overrides, and the errors a user sees."""

from pathlib import Path

import pytest

from meshlm.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_validate():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.model.preset == "tiny" and cfg.model.head_dim == cfg.model.hidden_size // cfg.model.num_heads


def test_unknown_key_lists_valid_names():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["train.learning_rate=1e-3"])
    msg = str(e.value)
    assert "train.learning_rate" in msg and "lr" in msg and "warmup_steps" in msg


@pytest.mark.parametrize("text, match", [("[trainer]\nsteps = 3\n", "trainer"), ("[train\nsteps=", "not valid TOML")],
                         ids=["unknown_section", "invalid_toml"])
def test_bad_config_file_rejected(tmp_path, text, match):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(p)


def test_num_heads_must_divide_hidden():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["model.num_heads=7"])
    msg = str(e.value)
    assert "model.num_heads=7" in msg and "hidden_size" in msg


def test_negative_lr_rejected():
    with pytest.raises(ConfigError, match=r"train\.lr=-0\.1 must be > 0"):
        load_config(overrides=["train.lr=-0.1"])


@pytest.mark.parametrize("override", ["model.moe_intermediate_size=-1", "model.moe_intermediate_size=0",
                                      "model.num_shared_experts=-1", "model.shared_expert_intermediate_size=0",
                                      "model.router_aux_loss_coef=-0.5", "model.init_std=-1.0"])
def test_moe_widths_and_init_that_cannot_train_are_rejected(override):
    """Found by a fuzz pass: a negative expert width reached the model's first tensor (a traceback), the others
    trained silently on meaningless settings."""
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.") + "=.* must be"):
        load_config(overrides=["model.preset=tiny-moe", override])


def test_override_types():
    cfg = load_config(overrides=["train.lr=3e-4", "train.steps=7", "train.progress=false",
                                 "train.run_dir=runs/x", "model.num_layers=2", "train.grad_clip=0"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.train.progress is False
    assert cfg.train.run_dir == "runs/x"
    assert cfg.model.num_layers == 2
    assert cfg.train.grad_clip == 0.0 and isinstance(cfg.train.grad_clip, float)


def test_override_wrong_type_rejected():
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(overrides=["train.steps=2.5"])
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(overrides=["steps=3"])


def test_toml_file_and_override_precedence(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\npreset = "tiny-moe"\n[train]\nsteps = 11\nlr = 1e-3\n[data]\nval_fraction = 0.1\n')
    cfg = load_config(p, ["train.lr=5e-4"])
    assert cfg.model.preset == "tiny-moe" and cfg.model.num_experts == 8
    assert cfg.train.steps == 11 and cfg.train.lr == 5e-4 and cfg.data.val_fraction == 0.1


def test_preset_then_override():
    cfg = load_config(overrides=["model.preset=llama3-8b", "model.num_layers=2"])
    assert cfg.model.hidden_size == 4096 and cfg.model.num_layers == 2 and cfg.model.num_kv_heads == 8
    with pytest.raises(ConfigError, match="preset"):
        load_config(overrides=["model.preset=nope"])


def test_shipped_tiny_config_matches_defaults():
    """configs/tiny.toml spells out the default job of `meshlm train`: it must equal the built-in defaults."""
    cfg = load_config(ROOT / "configs" / "tiny.toml")
    assert cfg == load_config()
    # and it names every field of the sections it spells out (a new field cannot be forgotten there)
    import dataclasses
    import tomllib

    from meshlm.config import DataConfig, ParallelConfig, TrainConfig

    written = tomllib.loads((ROOT / "configs" / "tiny.toml").read_text())
    for section, cls in (("parallel", ParallelConfig), ("train", TrainConfig), ("data", DataConfig)):
        # a field unset by default (None: derived) is named in a comment, TOML having no null
        unset = {f.name for f in dataclasses.fields(cls) if getattr(cls(), f.name) is None}
        assert set(written[section]) | unset == {f.name for f in dataclasses.fields(cls)}, section


def test_tiny_toml_is_the_reference_generated_from_the_dataclasses():
    from meshlm.config_doc import reference_toml

    assert (ROOT / "configs" / "tiny.toml").read_text() == reference_toml(), \
        "configs/tiny.toml is out of date: regenerate it with `meshlm config > configs/tiny.toml`"


def test_the_reference_parses_to_the_dataclass_defaults_and_names_every_field(tmp_path):
    import dataclasses
    import tomllib

    from meshlm.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
    from meshlm.config_doc import reference_toml

    text = reference_toml()
    written = tomllib.loads(text)
    for section, cls in (("parallel", ParallelConfig), ("train", TrainConfig), ("data", DataConfig)):
        # fields unset by default (None) are written commented out, TOML having no null
        want = {k: v for k, v in dataclasses.asdict(cls()).items() if v is not None}
        assert written[section] == want, section
    assert written["model"] == {"preset": "tiny"}  # the preset's fields are there, commented out
    path = tmp_path / "reference.toml"
    path.write_text(text)
    assert load_config(path) == Config().validate()
    lines = text.splitlines()
    for f in dataclasses.fields(ModelConfig):
        assert any(line.startswith((f"# {f.name} = ", f"# {f.name} (unset)", f"{f.name} = ")) for line in lines), f.name
    # each field carries the comment its dataclass gives it
    assert any(line.startswith("pp_schedule = ") and "zero_bubble" in line for line in lines)


def test_a_rendered_config_reads_back_to_itself(tmp_path):
    from meshlm.config_doc import render_config

    cfg = load_config(overrides=["model.num_layers=2", "model.rope_scaling={factor = 8.0, low_freq_factor = 1.0, "
                                 "high_freq_factor = 4.0, original_max_position_embeddings = 64}",
                                 "parallel.tp=2", "parallel.pp_layers=1,1", "train.lr=3e-4", "train.tensorboard=true",
                                 "data.val_fraction=0.1"])
    path = tmp_path / "c.toml"
    path.write_text(render_config(cfg))
    assert "\nnum_layers = 2" in path.read_text() and "\n# hidden_size = 256" in path.read_text()
    assert load_config(path) == cfg


def test_meshlm_config_prints_the_reference_or_the_resolved_config(capsys):
    from meshlm.cli import main

    assert main(["config"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs" / "tiny.toml").read_text()
    assert main(["config", "--set", "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# written by `meshlm config --set train.steps=7`") and "\nsteps = 7 " in out
    assert main(["config", "--set", "train.nope=1"]) == 2
