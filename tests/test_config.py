import dataclasses

import pytest

from fitdqn.config import (
    Config,
    ConfigError,
    config_from_dict,
    dump_config,
    load_config,
    with_overrides,
)


def test_defaults_hold_the_budget_knobs():
    budget = Config().budget
    assert budget.batch_size == -1
    assert budget.replay_buffer_vram_fraction == 0.70
    assert (budget.min_batch, budget.max_batch) == (64, 16384)


def test_every_field_has_help():
    for section in dataclasses.fields(Config):
        for knob in dataclasses.fields(section.type if isinstance(section.type, type) else
                                       type(getattr(Config(), section.name))):
            assert knob.metadata.get("help"), f"{section.name}.{knob.name} has no help"


def test_toml_round_trip(tmp_path):
    config = with_overrides(Config(), {"learn.lr": 3e-4, "net.branches": (3, 4, 5), "budget.batch_size": 0})
    path = tmp_path / "run.toml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="'learn.learning_rate'"):
        config_from_dict({"learn": {"learning_rate": 1e-3}})


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match="'optim'"):
        config_from_dict({"optim": {"lr": 1e-3}})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="'budget.batch_size'.*expected int"):
        config_from_dict({"budget": {"batch_size": "big"}})
    with pytest.raises(ConfigError, match="'replay.her'"):
        config_from_dict({"replay": {"her": 3}})


def test_int_accepted_where_float_expected():
    assert config_from_dict({"learn": {"lr": 1}}).learn.lr == 1.0


def test_cross_field_check_says_what_to_change():
    with pytest.raises(ConfigError, match="replay_buffer_vram_fraction"):
        config_from_dict({"budget": {"replay_buffer_vram_fraction": 1.5}})
    with pytest.raises(ConfigError, match="min_batch"):
        config_from_dict({"budget": {"min_batch": 512, "max_batch": 256}})


def test_malformed_toml_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[learn\nlr = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
