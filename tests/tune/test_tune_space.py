import pytest

optuna = pytest.importorskip("optuna")

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution  # noqa: E402

from fitdqn.cli import build_parser  # noqa: E402
from fitdqn.cli.tune import config_and_search  # noqa: E402
from fitdqn.config import Config, ConfigError, with_overrides  # noqa: E402
from fitdqn.tune.space import SearchSpaceError, parse_search_space  # noqa: E402


def test_ranges_and_choices_follow_the_field_types():
    space = parse_search_space({
        "learn.lr": {"low": 1e-5, "high": 1e-3, "log": True},
        "learn.n_step": {"choices": [1, 3, 5]},
        "collect.steps_per_epoch": {"low": 16, "high": 64, "step": 16},
        "replay.her": {"choices": [True, False]},
        "learn.gamma": {"low": 0.9, "high": 0.999},
    }, Config())
    d = space.distributions
    assert d["learn.lr"] == FloatDistribution(1e-5, 1e-3, log=True)
    assert d["learn.n_step"] == CategoricalDistribution([1, 3, 5])
    assert d["collect.steps_per_epoch"] == IntDistribution(16, 64, step=16)
    assert d["replay.her"] == CategoricalDistribution([True, False])
    assert d["learn.gamma"] == FloatDistribution(0.9, 0.999)
    assert list(d) == ["learn.lr", "learn.n_step", "collect.steps_per_epoch", "replay.her", "learn.gamma"]


def test_nested_tables_are_the_same_keys():
    dotted = parse_search_space({"learn.lr": {"low": 1e-5, "high": 1e-3}}, Config())
    nested = parse_search_space({"learn": {"lr": {"low": 1e-5, "high": 1e-3}}}, Config())
    assert dotted == nested


def test_tuple_choices_are_sampled_as_text_and_apply():
    space = parse_search_space({"net.branches": {"choices": [[5, 5, 5], [3, 3, 3]]}}, Config())
    assert space.distributions["net.branches"].choices == ("5,5,5", "3,3,3")
    assert with_overrides(Config(), {"net.branches": "3,3,3"}).net.branches == (3, 3, 3)


@pytest.mark.parametrize("table, message", [
    ({"learn.learning_rate": {"low": 1e-5, "high": 1e-3}}, r"'learn.learning_rate' is not a config key.*lr"),
    ({"optim.lr": {"low": 1e-5, "high": 1e-3}}, r"'optim.lr' is not a config key.*section of"),
    ({"lr": {"low": 1e-5, "high": 1e-3}}, r"'lr' is not a config key"),
    ({"train.out": {"choices": ["a", "b"]}}, r"'train.out' cannot be searched"),
    ({"market.validation_fraction": {"low": 0.1, "high": 0.2}}, r"same validation bars"),
    ({"tune.trials": {"low": 1, "high": 5}}, r"tuner's own settings"),
    ({"learn.lr": {"low": 1e-3, "high": 1e-5}}, r"low .* must be below high"),
    ({"learn.lr": {"low": 0.0, "high": 1e-3, "log": True}}, r"log range needs low > 0"),
    ({"learn.lr": {"low": 1e-5}}, r"needs both low and high"),
    ({"learn.lr": {"low": 1e-5, "high": 1e-3, "scale": "log"}}, r"unknown field\(s\) scale"),
    ({"learn.lr": 3e-4}, r"expected \{low"),
    ({"learn.risk": {"low": 0, "high": 1}}, r"'learn.risk' is not a number"),
    ({"learn.n_step": {"low": 1.5, "high": 4}}, r"expected int"),
    ({"learn.n_step": {"choices": []}}, r"non-empty list"),
    ({"learn.risk": {"choices": ["neutral", "greedy"]}}, r"'learn.risk' = 'greedy' makes an invalid config.*"
                                                          r"'neutral', 'cvar' or 'mean_variance'"),
    ({"replay.alpha": {"low": 0.5, "high": 2.0}}, r"replay.alpha must be in \[0, 1\]"),
    ({}, r"\[search\] is empty"),
])
def test_bad_entries_are_refused_by_name(table, message):
    with pytest.raises(SearchSpaceError, match=message):
        parse_search_space(table, Config())


def test_search_errors_are_user_errors():
    from fitdqn.errors import UserError

    assert issubclass(SearchSpaceError, ConfigError) and issubclass(SearchSpaceError, UserError)


def test_search_table_from_the_config_file_or_space_file(tmp_path):
    config_file = tmp_path / "tune.toml"
    config_file.write_text('[learn]\nn_step = 5\n[search]\n"learn.lr" = {low = 1e-5, high = 1e-3, log = true}\n')
    space_file = tmp_path / "space.toml"
    space_file.write_text('[search]\n"learn.gamma" = {low = 0.9, high = 0.99}\n')
    parser = build_parser()

    config, search = config_and_search(parser.parse_args(
        ["tune", "--config", str(config_file), "--trials", "7", "--parallel", "2", "--learn.target_tau", "0.01"]))
    assert search == {"learn.lr": {"low": 1e-5, "high": 1e-3, "log": True}}
    assert (config.learn.n_step, config.learn.target_tau) == (5, 0.01)
    assert (config.tune.trials, config.tune.parallel) == (7, 2)

    _, search = config_and_search(parser.parse_args(["tune", "--config", str(config_file), "--space",
                                                     str(space_file)]))
    assert search == {"learn.gamma": {"low": 0.9, "high": 0.99}}

    no_search = tmp_path / "plain.toml"
    no_search.write_text("[learn]\nlr = 1e-4\n")
    with pytest.raises(ConfigError, match="has no \\[search\\] table"):
        config_and_search(parser.parse_args(["tune", "--space", str(no_search)]))
    with pytest.raises(ConfigError, match="not found"):
        config_and_search(parser.parse_args(["tune", "--space", str(tmp_path / "missing.toml")]))


def test_tune_without_a_search_space_says_how_to_give_one(tmp_path, capsys):
    from fitdqn.cli import main

    assert main(["tune", "--dir", str(tmp_path / "tune"), "--trials", "1"]) == 2
    err = capsys.readouterr().err
    assert "no search space" in err and "--space FILE.toml" in err
    assert main(["tune", "--space", str(tmp_path / "nope.toml")]) == 2
    assert "not found" in capsys.readouterr().err
