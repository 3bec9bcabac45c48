import dataclasses
import math

import pytest

from fitdqn.config import (
    Bounds,
    Config,
    ConfigError,
    config_from_dict,
    dump_config,
    knob,
    load_config,
    validate,
    with_overrides,
)


def test_defaults_hold_the_budget_knobs():
    budget = Config().budget
    assert budget.batch_size == -1
    assert budget.replay_buffer_vram_fraction == 0.70
    assert (budget.min_batch, budget.max_batch) == (64, 16384)


def test_every_field_has_help():
    for section in dataclasses.fields(Config):
        for spec in dataclasses.fields(section.type if isinstance(section.type, type) else
                                       type(getattr(Config(), section.name))):
            assert spec.metadata.get("help"), f"{section.name}.{spec.name} has no help"


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


def all_knobs():
    """(dotted key, field, default) for every knob of every section."""
    config = Config()
    for section in dataclasses.fields(Config):
        values = getattr(config, section.name)
        for spec in dataclasses.fields(values):
            yield f"{section.name}.{spec.name}", spec, getattr(values, spec.name)


def beyond(bounds: Bounds, default, side: str):
    """A value just outside ``bounds`` on ``side`` (None if that side is unbounded)."""
    edge, is_open = (bounds.low, bounds.low_open) if side == "low" else (bounds.high, bounds.high_open)
    if math.isinf(edge):
        return None
    direction = -1 if side == "low" else 1
    if isinstance(default, int) or (isinstance(default, tuple) and isinstance(default[0], int)):
        value = int(edge) if is_open else int(edge) + direction
    else:
        # a step well above the denormals: a CPU trainer sets flush-to-zero, which reads -5e-324 as 0
        value = edge if is_open else edge + direction * max(abs(edge), 1.0) * 1e-9
    return (*default[:-1], value) if isinstance(default, tuple) else value


def test_every_numeric_knob_declares_its_bounds_and_every_default_is_inside():
    for key, spec, default in all_knobs():
        numeric = isinstance(default, (int, float, tuple)) and not isinstance(default, bool)
        assert not numeric or "bounds" in spec.metadata, f"{key}: declare its bounds in knob(...)"
    validate(Config())


def test_a_value_beyond_each_bound_is_refused_naming_the_key():
    checked = 0
    for key, spec, default in all_knobs():
        section, name = key.split(".")
        bounds = spec.metadata.get("bounds")
        bad_values = []
        if bounds is not None:
            bad_values += [v for v in (beyond(bounds, default, "low"), beyond(bounds, default, "high"))
                           if v is not None]
            if isinstance(default, float):
                bad_values += [math.nan, math.inf]
        if "choices" in spec.metadata:
            bad_values.append("no-such-choice")
        for value in bad_values:
            with pytest.raises(ConfigError, match=rf"\b{key}\b"):  # the message names the key
                config_from_dict({section: {name: value}})
            checked += 1
        if bounds is not None and not isinstance(default, tuple):
            for inside in (bounds.low, bounds.high):  # a closed bound itself is accepted
                if math.isfinite(inside) and (inside == bounds.low and not bounds.low_open
                                              or inside == bounds.high and not bounds.high_open):
                    value = int(inside) if isinstance(default, int) else float(inside)
                    try:
                        config_from_dict({section: {name: value}})
                    except ConfigError as error:
                        assert f"{key} must be {bounds.describe()}" not in str(error)  # only a cross-field check
    assert checked > 60


@pytest.mark.parametrize(("key", "value"), [("learn.lr", "nan"), ("learn.lr", "-1e-3"),
                                            ("train.checkpoint_every", "0"), ("train.epochs", "-1"),
                                            ("learn.risk", "optimistic"), ("net.branches", "5,0,5")])
def test_bad_command_line_values_are_refused(key, value):
    with pytest.raises(ConfigError, match=rf"^(every value of )?{key} must be"):
        with_overrides(Config(), {key: value})


def test_knob_without_bounds_is_still_valid():
    @dataclasses.dataclass(frozen=True)
    class Section:
        plain: int = knob(3, "a knob another branch added")
        text: str = knob("a", "free text")

    assert Section().plain == 3 and "bounds" not in dataclasses.fields(Section)[0].metadata
    with pytest.raises(TypeError):
        knob(1, "two lower bounds", ge=0, gt=0)
    with pytest.raises(TypeError):
        knob("x", "default outside its choices", choices=("a", "b"))


def test_a_run_config_that_predates_a_key_is_read_as_the_run_was_trained(tmp_path):
    """A run's config.toml written before market.position_sizing existed held whole contracts: reading it back
    (resume, evaluate, act, export) gives 'contracts', not the later default; a file that has the key keeps it."""
    from fitdqn.config import PREDATED_KEYS, dump_config, load_run_config

    assert Config().market.position_sizing == "volatility" and PREDATED_KEYS["market.position_sizing"] == "contracts"
    written = tmp_path / "config.toml"
    written.write_text(dump_config(Config()))
    assert load_run_config(written).market.position_sizing == "volatility"
    old = tmp_path / "old.toml"
    old.write_text("\n".join(line for line in dump_config(Config()).splitlines()
                             if not line.startswith("position_sizing")))
    assert "position_sizing" not in old.read_text()
    assert load_run_config(old).market.position_sizing == "contracts"
    assert load_run_config(old).market.target_volatility == 0.0


@pytest.mark.parametrize("key", ["replay.compile", "replay.fused_gather"])
def test_a_removed_replay_key_gives_one_error_saying_it_is_gone(key, tmp_path):
    """In a config file or on the command line: one error naming the key, saying it was removed; a run directory's
    config.toml written while the key existed still reads (the key chose kernels, not what a run computes)."""
    from fitdqn.config import load_run_config

    section, name = key.split(".")
    with pytest.raises(ConfigError, match=rf"^config key '{key}' was removed: .*delete it from the config$"):
        config_from_dict({section: {name: True}})
    with pytest.raises(ConfigError, match=rf"'{key}' was removed"):
        with_overrides(Config(), {key: "false"})
    written = tmp_path / "config.toml"
    written.write_text(dump_config(Config()).replace(f"[{section}]\n", f"[{section}]\n{name} = false\n"))
    assert f"{name} = false" in written.read_text()
    assert load_run_config(written) == Config()


@pytest.mark.parametrize("key", ["net.kernels", "net.iqn_chunk"])
def test_a_removed_key_says_it_is_gone_in_a_file_and_on_the_command_line(key, tmp_path, capsys):
    from fitdqn.cli import main

    section, name = key.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f"[{section}]\n{name} = 8\n")
    with pytest.raises(ConfigError, match=f"config key '{key}' was removed: .*delete it from the config"):
        load_config(path)
    with pytest.raises(SystemExit) as exit_:  # argparse's exit: one line that says why
        main(["plan", f"--{key}", "8"])
    assert exit_.value.code == 2 and f"--{key} was removed: " in capsys.readouterr().err
