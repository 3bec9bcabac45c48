"""`fitdqn act` and `fitdqn export` on a tiny trained run: the backtest's own actions, the learner's own picks."""

import dataclasses
import io
import shutil
import tomllib

import numpy as np
import pandas as pd
import pytest
import tomli_w
import torch
from rich.console import Console

from fitdqn.cli import main
from fitdqn.config import Config, with_overrides
from fitdqn.deploy import act_on_bars, export_policy, load_exported, load_run_policy
from fitdqn.deploy.act import ACTION_COLUMNS
from fitdqn.deploy.export import acting_network
from fitdqn.errors import UserError
from fitdqn.evaluate.backtest import evaluate_config
from fitdqn.evaluate.baselines import greedy_policy
from fitdqn.market.env import FuturesEnv, position_levels
from fitdqn.market.loader import load_market
from fitdqn.train.checkpoint import best_network_weights
from fitdqn.train.run import train

TINY = {
    "market.data": "synthetic", "market.synthetic_bars": 1200, "market.episode_length": 32,
    "net.window": 4, "net.trunk_hidden": 64, "net.d_model": 32, "net.stream_hidden": 32, "net.num_atoms": 11,
    "net.iqn_embedding": 16, "net.iqn_quantiles": 8, "net.iqn_act_quantiles": 8, "net.iql_hidden": 32,
    "collect.num_envs": 16, "collect.steps_per_epoch": 16, "replay.capacity": 4096, "replay.min_fill": 128,
    "budget.batch_size": 64, "train.device": "cpu", "train.epochs": 2, "train.eval_every": 2,
    "train.checkpoint_every": 2, "train.eval_seeds": 1,
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("act") / "run"
    train(with_overrides(Config(), TINY), path, console=Console(file=io.StringIO()))
    return path


@pytest.fixture(scope="module")
def policy(run_dir):
    return load_run_policy(run_dir, "cpu")


@pytest.fixture(scope="module")
def market(policy):
    return load_market(policy.config.market, window=policy.config.net.window)


def split_backtest(policy, market):
    """The reference: the test backtest as the run's report computes it, with the actions it took."""
    taken = []
    act = greedy_policy(policy.learner)

    def recording(obs):
        action = act(obs)
        taken.append(action)
        return action

    one_env = dataclasses.replace(policy.config, evaluate=dataclasses.replace(policy.config.evaluate, segments=1))
    backtest = evaluate_config(recording, one_env, "test", market=market)  # bar by bar, as act_on_bars
    return backtest, torch.cat(taken).numpy()


def test_act_reproduces_the_test_backtest(policy, market):
    backtest, taken = split_backtest(policy, market)
    first = market.first_bar("test", policy.config.net.window)
    frame = act_on_bars(policy, market.bars, start=market.bars["timestamp"].iloc[first])
    n = len(backtest)
    # one more row than the backtest: the decision at the last bar, to trade at the next open
    assert len(frame) == n + 1
    assert np.array_equal(frame[list(ACTION_COLUMNS)].to_numpy()[:n], taken)
    assert len(np.unique(taken[:, 0])) > 1  # a policy that moves, so the comparison means something
    assert np.array_equal(frame["target"].to_numpy()[:n], backtest.target)
    # the contracts aimed for: the level sized by volatility (the default), as the env's fills were
    bar = backtest.decision_bar
    relative = market.atr.numpy()[bar] / market.prices[:, 3].numpy()[bar]
    level = np.asarray(position_levels(policy.config.net.branches[0], policy.config.market.max_contracts))[taken[:n, 0]]
    sized = level * np.minimum(1.0, policy.config.market.target_volatility / relative)
    np.testing.assert_allclose(frame["target"].to_numpy()[:n], sized, rtol=1e-5, atol=1e-6)
    # what an account can trade: the nearest whole number of contracts
    whole = frame["target_whole"].to_numpy()
    assert np.array_equal(whole, np.round(whole)) and (np.abs(whole - frame["target"].to_numpy()) <= 0.5).all()
    assert np.array_equal(frame["timestamp"].to_numpy()[:n], market.bars["timestamp"].to_numpy()[backtest.decision_bar])
    # the held position comes from the env's own mechanics: it is what the backtest held after the step before
    assert np.array_equal(frame["held"].to_numpy()[1:n], backtest.position[:n - 1] * (backtest.exit[:n - 1] != 3))
    # the P&L matches up to the last backtest step, which the backtest liquidates at the end of the data
    assert np.array_equal(frame["pnl"].to_numpy()[:n - 1], backtest.pnl[:n - 1])
    assert frame["bracket_from"].iloc[-1] == "close" and np.isnan(frame["pnl"].iloc[-1])
    assert (frame["bracket_from"].iloc[:-1] == "next_open").all()


def test_bracket_prices_lie_on_the_right_side(policy, market):
    frame = act_on_bars(policy, market.bars.iloc[:600])
    assert frame["timestamp"].iloc[0] == market.bars["timestamp"].iloc[market.warmup]  # default: after warm-up
    next_open = market.bars["open"].to_numpy()[frame.index[:-1] + market.warmup + 1]
    base = np.append(next_open, frame["close"].iloc[-1])  # what the bracket is measured from
    side = np.sign(frame["target"].to_numpy())
    level = np.asarray(position_levels(policy.config.net.branches[0], policy.config.market.max_contracts))[
        frame["action_position"].to_numpy()]
    held_level = np.abs(frame["target"].to_numpy()) == np.abs(level)
    assert held_level.any() and not held_level.all()  # volatility sizing: some training bars are above the target
    stop, take = frame["stop_price"].to_numpy(), frame["take_profit_price"].to_numpy()
    has_stop, has_take = ~np.isnan(stop), ~np.isnan(take)
    assert has_stop.any() or has_take.any()
    assert np.all(side[has_stop] * (base[has_stop] - stop[has_stop]) >= 0)
    assert np.all(side[has_take] * (take[has_take] - base[has_take]) >= 0)
    assert np.array_equal(has_stop, (frame["stop_atr"].to_numpy() > 0) & (side != 0))
    assert np.array_equal(has_take, (frame["take_profit_atr"].to_numpy() > 0) & (side != 0))


def test_act_command_writes_csv_and_parquet(run_dir, policy, market, tmp_path, capsys):
    bars = tmp_path / "bars.csv"
    market.bars.to_csv(bars, index=False)
    start = str(market.bars["timestamp"].iloc[1050].date())
    expected = act_on_bars(policy, market.bars, start=start)
    for name in ("out.csv", "out.parquet"):
        out = tmp_path / name
        assert main(["act", str(run_dir), "--data", str(bars), "--start", start, "--out", str(out)]) == 0
        written = pd.read_csv(out, parse_dates=["timestamp"]) if name.endswith(".csv") else pd.read_parquet(out)
        assert np.array_equal(written[list(ACTION_COLUMNS)].to_numpy(), expected[list(ACTION_COLUMNS)].to_numpy())
        assert np.allclose(written["stop_price"], expected["stop_price"], equal_nan=True)
        assert written["timestamp"].iloc[0] == market.bars["timestamp"].iloc[1050]
        out_text = capsys.readouterr().out
        assert "latest, to trade at the next open" in out_text and str(out) in out_text


def test_act_on_a_built_in_data_set_reads_it_as_training_does(run_dir, policy, market, tmp_path, capsys):
    """--data synthetic is the run's own synthetic market (its seed and size): the same rows as its bars."""
    start = str(market.bars["timestamp"].iloc[1100].date())
    out = tmp_path / "synthetic.csv"
    assert main(["act", str(run_dir), "--data", "synthetic", "--start", start, "--out", str(out)]) == 0
    written = pd.read_csv(out)
    expected = act_on_bars(policy, market.bars, start=start)
    assert np.array_equal(written[list(ACTION_COLUMNS)].to_numpy(), expected[list(ACTION_COLUMNS)].to_numpy())
    assert "latest, to trade at the next open" in capsys.readouterr().out
    assert main(["act", str(run_dir), "--data", "sp501", "--out", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert "neither a built-in data set (sp500, nasdaq, synthetic) nor a CSV/Parquet file path" in err


def test_act_mistakes_are_clear_errors(run_dir, policy, market, tmp_path, capsys):
    bars = tmp_path / "bars.parquet"
    market.bars.to_parquet(bars)
    assert main(["act", str(run_dir), "--data", str(bars), "--out", str(tmp_path / "x.xlsx")]) == 2
    assert ".csv or .parquet" in capsys.readouterr().err and not (tmp_path / "x.xlsx").exists()
    with pytest.raises(UserError, match="give an earlier start"):
        act_on_bars(policy, market.bars, start="2100-01-01")
    with pytest.raises(UserError, match="not a date"):
        act_on_bars(policy, market.bars, start="yesterday-ish")
    with pytest.raises(UserError, match="at least 141 bars"):
        act_on_bars(policy, market.bars.iloc[:100])
    assert main(["act", str(tmp_path), "--data", str(bars)]) == 2
    assert "not a fitdqn run directory" in capsys.readouterr().err


def test_act_without_the_training_bars_needs_the_goal_unit(run_dir, policy, market, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    config = tomllib.loads((moved / "config.toml").read_text())
    config["market"]["data"] = str(tmp_path / "gone.csv")
    (moved / "config.toml").write_text(tomli_w.dumps(config))
    with pytest.raises(UserError, match="set market.contract"):  # 'auto' on a file: the contract comes from its bars
        load_run_policy(moved, "cpu")
    config["market"]["contract"] = "generic"  # the spec the run traded (synthetic bars)
    (moved / "config.toml").write_text(tomli_w.dumps(config))
    other = load_run_policy(moved, "cpu")
    recent = market.bars.iloc[-300:]
    with pytest.raises(UserError, match="--goal-unit"):
        act_on_bars(other, recent)
    assert act_on_bars(other, recent, goal_unit=policy.goal_unit()).equals(act_on_bars(policy, recent))


def observations(policy, market) -> torch.Tensor:
    """Real observations [B, W, S]: training-split episodes in random states."""
    env = FuturesEnv.from_config(policy.config, "train", market=market, num_envs=24, seed=3)
    for _ in range(5):
        env.step(torch.randint(0, 5, (24, 3)))
    return env.observation()


def test_exported_program_picks_the_learners_actions(policy, market, tmp_path):
    path = export_policy(policy, tmp_path / "policy.pt2")
    program, meta = load_exported(path)
    module = program.module()
    real = observations(policy, market)
    noise = torch.randn(37, *real.shape[1:])
    for obs in (real, noise, real[:1]):  # the batch dimension is dynamic
        actions, q = module(obs)
        assert actions.dtype == torch.int64 and q.shape == (obs.shape[0], 3, 5)
        assert torch.equal(actions, policy.learner.act(obs, torch.zeros(()), network=policy.learner.evaluated))
    assert meta["branches"]["target_contracts"] == [-2.0, -1.0, 0.0, 1.0, 2.0]
    sizing = meta["position_sizing"]  # the run's resolved sizing: the default sizes by volatility
    assert sizing["mode"] == policy.config.market.position_sizing == "volatility"
    assert sizing["target_volatility"] == policy.config.market.target_volatility > 0
    assert meta["inputs"]["obs"] == ["batch", 4, 80] and len(meta["feature_names"]) + len(meta["agent_fields"]) == 80


def test_exported_cvar_policy_matches_the_quantile_head(policy, market, tmp_path):
    config = dataclasses.replace(policy.config, learn=dataclasses.replace(policy.config.learn, risk="cvar"))
    cvar = dataclasses.replace(policy, config=config)
    program, meta = load_exported(export_policy(cvar, tmp_path / "cvar.pt2"))
    obs = observations(policy, market)
    actions, q = program.module()(obs)
    net, k, alpha = policy.learner.evaluated, config.net.iqn_act_quantiles, config.learn.cvar_alpha
    taus = (alpha * (torch.arange(k) + 0.5) / k).expand(obs.shape[0], -1)  # the export's fixed levels
    with torch.no_grad():
        expected = net.quantiles(net.features(obs), taus).mean(1)  # [B, 3, 5] through the learner's own head
    assert torch.allclose(q, expected, atol=1e-5)
    assert torch.equal(actions, net.greedy(expected)) and meta["risk"] == "cvar"
    assert acting_network(cvar).risk == "cvar"


def test_exported_mean_variance_policy_picks_the_learners_actions(policy, market, tmp_path):
    learn = dataclasses.replace(policy.config.learn, risk="mean_variance", risk_aversion=0.3)
    config = dataclasses.replace(policy.config, learn=learn)
    averse = dataclasses.replace(policy, config=config)
    program, meta = load_exported(export_policy(averse, tmp_path / "mean_variance.pt2"))
    obs = observations(policy, market)
    actions, _ = program.module()(obs)
    learner = policy.learner
    learner.config, learner.learn_config = config, learn  # the same networks, acting by mean - 0.3 variance
    try:
        assert torch.equal(actions, learner.act(obs, torch.zeros(()), network=learner.evaluated))
    finally:
        learner.config, learner.learn_config = policy.config, policy.config.learn
    assert meta["risk"] == "mean_variance" and meta["risk_aversion"] == 0.3


def test_export_command(run_dir, tmp_path, capsys):
    out = tmp_path / "deploy" / "policy.pt2"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert out.is_file() and "torch.export.load" in capsys.readouterr().out
    assert main(["export", str(run_dir), "--out", str(tmp_path / "policy.onnx")]) == 2
    assert ".pt2" in capsys.readouterr().err


def test_act_uses_the_network_the_report_is_about_unless_told_otherwise(run_dir, policy):
    best = torch.load(run_dir / "best.pt", weights_only=True)
    for name, tensor in policy.learner.evaluated.state_dict().items():
        assert torch.equal(tensor, best["network"][name]), name
    assert policy.epoch == best["epoch"]
    last = load_run_policy(run_dir, "cpu", "last")
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    for part in ("online", "target"):
        for name, tensor in getattr(last.learner, part).state_dict().items():
            assert torch.equal(tensor, state["learner"][part][name]), name


def test_act_without_best_pt_names_the_option(run_dir, tmp_path):
    moved = tmp_path / "no_best"
    shutil.copytree(run_dir, moved)
    (moved / "best.pt").unlink()
    with pytest.raises(UserError, match="--network last"):
        load_run_policy(moved, "cpu")
    assert load_run_policy(moved, "cpu", "last").epoch >= 1


def best_and_last(run_dir):
    """A run's best.pt and its final checkpoint's learner state."""
    return (torch.load(run_dir / "best.pt", weights_only=True),
            torch.load(run_dir / "checkpoint.pt", weights_only=True)["learner"])


def test_online_network_when_asked_is_the_one_reported(tmp_path):
    path = tmp_path / "online"
    train(with_overrides(Config(), {**TINY, "evaluate.reported_network": "online"}), path,
          console=Console(file=io.StringIO()))
    best, last = best_and_last(path)
    for name, tensor in best["network"].items():
        assert torch.equal(tensor, last["online"][name]), name
    policy = load_run_policy(path, "cpu")
    assert policy.learner.evaluated is policy.learner.online


def test_the_target_network_by_default_is_the_one_reported_acted_with_and_exported(run_dir, policy, tmp_path):
    assert Config().evaluate.reported_network == "target"  # the module's run is a target run
    best, last = best_and_last(run_dir)
    assert best["epoch"] == 2  # the one validation: the final network's, whose target is the checkpoint's
    for name, tensor in best["network"].items():
        assert torch.equal(tensor, last["target"][name]), name
    assert not all(torch.equal(tensor, last["online"][name]) for name, tensor in best["network"].items())
    learner = policy.learner
    assert learner.evaluated is learner.target
    obs = torch.randn(64, 4, 80)
    by_target = learner.act(obs, torch.zeros(()), network=learner.target)
    assert torch.equal(greedy_policy(learner)(obs), by_target)
    assert not torch.equal(by_target, learner.act(obs, torch.zeros(())))  # the online network picks otherwise
    actions, _ = load_exported(export_policy(policy, tmp_path / "policy.pt2"))[0].module()(obs)
    assert torch.equal(actions, by_target)


def test_best_pt_of_older_versions_keeps_its_network_under_online():
    weights = {"w": torch.ones(2)}
    assert best_network_weights({"online": weights}) is weights
    assert best_network_weights({"network": weights, "online": {}}) is weights


def test_whole_contracts_round_halves_away_from_zero():
    from fitdqn.deploy.act import whole_contracts

    got = whole_contracts(np.array([0.37, 0.5, -0.5, 1.49, -1.5, 2.0, 0.0]))
    assert got.tolist() == [0.0, 1.0, -1.0, 1.0, -2.0, 2.0, 0.0]
