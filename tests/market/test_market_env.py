"""The vectorised env: fills, costs, stops and take-profits against hand-worked bars; buy-and-hold; episodes,
auto-reset, goals, determinism, the transition contract, no host sync."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.env import env_options, market_env
from support.replay_reference import check_rows

from fitdqn.config import Config, with_overrides
from fitdqn.errors import UserError
from fitdqn.market.contract import ContractSpec
from fitdqn.market.env import (
    EPISODE_END,
    EXIT_EPISODE_END,
    EXIT_NONE,
    EXIT_STOP,
    EXIT_TAKE_PROFIT,
    TERMINAL,
    FuturesEnv,
    position_levels,
)
from fitdqn.market.layout import (
    ACHIEVED_COLUMN,
    AGENT_FIELDS,
    GOAL_COLUMN,
    NUM_FEATURES,
    WARMUP,
    env_state_bytes,
    market_bytes,
    transition_spec,
)
from fitdqn.market.loader import load_market
from fitdqn.market.observation import build_observation
from fitdqn.ops.replay_gather import GoalCrossing
from fitdqn.resolve import resolve_for_market

# multiplier 50, tick 0.25, commission 2.5 per contract per fill, slippage 1 tick = 0.25 points = 12.5 cash
TEST_CONTRACT = ContractSpec("test", multiplier=50.0, tick_size=0.25, commission=2.5, slippage_ticks=1.0)
SCALE = 1e-3
# action indices: branch 0 target {0: -2, 1: -1, 2: 0, 3: +1, 4: +2}; branch 1 stop {0: none, 1: 1, 2: 1.5,
# 3: 2, 4: 3} x ATR; branch 2 take-profit {0: none, 1: 1, 2: 2, 3: 3, 4: 5} x ATR
FLAT, LONG1, LONG2, SHORT1, SHORT2 = 2, 3, 4, 1, 0


def hand_env(bars, episode_length, atr=2.0, num_envs=1) -> FuturesEnv:
    """An env over hand-written bars (open, high, low, close), ATR fixed, one window, episodes from bar 0."""
    prices = torch.tensor(bars, dtype=torch.float32)
    T = prices.shape[0]
    return FuturesEnv(
        prices,
        torch.full((T,), atr),
        torch.zeros(T, NUM_FEATURES),
        TEST_CONTRACT,
        first_bar=0,
        stop_bar=episode_length + 1,
        **env_options(num_envs=num_envs, window=1, episode_length=episode_length, reward_scale=SCALE),
    )


def act(*branches):
    return torch.tensor([branches])


FLAT_BAR = (100.0, 101.0, 99.0, 100.0)


@pytest.fixture(scope="module")
def sp500_market():
    return load_market(Config().market, window=8)


def test_position_levels():
    assert position_levels(5, 2) == [-2.0, -1.0, 0.0, 1.0, 2.0]
    assert position_levels(3, 1) == [-1.0, 0.0, 1.0]
    assert position_levels(5, 4) == [-4.0, -2.0, 0.0, 2.0, 4.0]
    with pytest.raises(UserError):
        position_levels(4, 2)


def test_fill_at_next_open_hold_and_liquidate():
    bars = [
        FLAT_BAR,
        (100.5, 102.0, 100.0, 101.5),
        (101.0, 103.0, 100.5, 102.5),
        (102.0, 102.5, 101.0, 101.75),
    ]
    env = hand_env(bars, episode_length=3)
    # decide long 1 at bar 0 -> buy at bar 1 open 100.5 + 0.25 slippage; mark at the close 101.5
    out = env.step(act(LONG1, 0, 0))
    assert out["pnl"].item() == pytest.approx((101.5 - 100.5 - 0.25) * 50 - 2.5)  # 35.0
    assert out["reward"].item() == pytest.approx(0.035)
    assert out["cost"].item() == pytest.approx(12.5 + 2.5)
    assert out["position"].item() == 1.0 and out["traded"].item() == 1.0 and out["exit"].item() == EXIT_NONE
    agent = out["next_agent"][0]
    assert agent[AGENT_FIELDS.index("position")] == pytest.approx(0.5)  # 1 of max 2 contracts
    assert agent[AGENT_FIELDS.index("unrealised_pnl")] == pytest.approx((101.5 - 100.75) * 50 * SCALE)
    assert agent[AGENT_FIELDS.index("time_in_trade")] == pytest.approx(1 / 3)
    assert agent[AGENT_FIELDS.index("episode_left")] == pytest.approx(2 / 3)
    assert agent[ACHIEVED_COLUMN] == pytest.approx(0.035)
    # hold: gap 101.5 -> 101.0 and bar 101.0 -> 102.5, no costs
    out = env.step(act(LONG1, 0, 0))
    assert out["pnl"].item() == pytest.approx((102.5 - 101.5) * 50)
    assert out["cost"].item() == 0.0 and out["traded"].item() == 0.0
    # last step: hold through bar 3 then liquidate at its close with slippage and commission
    out = env.step(act(LONG1, 0, 0))
    assert out["pnl"].item() == pytest.approx((101.75 - 102.5 - 0.25) * 50 - 2.5)  # -52.5
    assert out["exit"].item() == EXIT_EPISODE_END and out["flags"].item() == TERMINAL | EPISODE_END
    assert out["next_agent"][0, AGENT_FIELDS.index("position")] == 0.0
    assert out["achieved"].item() == pytest.approx((35.0 + 50.0 - 52.5) * SCALE)
    # = buy-and-hold from bar 1's open to bar 3's close minus two sides of costs
    assert out["achieved"].item() == pytest.approx(((101.75 - 100.5 - 0.5) * 50 - 5.0) * SCALE)


def test_long_stop_loss_with_slippage():
    env = hand_env([FLAT_BAR, (100.0, 100.5, 97.0, 99.0)], episode_length=1)
    out = env.step(act(LONG1, 1, 0))  # stop 1 x ATR = 2 below the open: 98.0; low 97 touches it
    assert out["exit"].item() == EXIT_STOP and out["position"].item() == 0.0
    # in at 100.25, out at 98 - 0.25; two commissions
    assert out["pnl"].item() == pytest.approx((97.75 - 100.0 - 0.25) * 50 - 2 * 2.5)  # -130.0
    assert out["cost"].item() == pytest.approx(2 * 12.5 + 2 * 2.5)
    assert out["traded"].item() == 2.0


def test_long_take_profit_fills_at_its_limit():
    env = hand_env([FLAT_BAR, (100.0, 104.5, 99.5, 101.0)], episode_length=1)
    out = env.step(act(LONG1, 0, 2))  # take-profit 2 x ATR = 4 above the open: 104.0; high 104.5
    assert out["exit"].item() == EXIT_TAKE_PROFIT
    assert out["pnl"].item() == pytest.approx((104.0 - 100.0 - 0.25) * 50 - 2 * 2.5)  # 182.5


def test_stop_first_when_both_are_touched():
    env = hand_env([FLAT_BAR, (100.0, 104.5, 97.0, 101.0)], episode_length=1)
    out = env.step(act(LONG1, 1, 2))  # stop 98 and target 104 both inside [97, 104.5]
    assert out["exit"].item() == EXIT_STOP
    assert out["pnl"].item() == pytest.approx(-130.0)
    short = hand_env([FLAT_BAR, (100.0, 103.5, 97.5, 99.0)], episode_length=1)
    out = short.step(act(SHORT1, 2, 1))  # short: stop 103 (1.5 ATR above), target 98 (1 ATR below): both hit
    assert out["exit"].item() == EXIT_STOP


def test_short_stop_and_short_take_profit():
    env = hand_env([FLAT_BAR, (100.0, 103.5, 99.0, 101.0)], episode_length=1)
    out = env.step(act(SHORT1, 2, 0))  # stop 1.5 x 2 = 3 above the open: 103; high 103.5
    assert out["exit"].item() == EXIT_STOP
    assert out["pnl"].item() == pytest.approx(-1 * (103.25 - 100.0) * 50 - 0.25 * 50 - 2 * 2.5)  # -180.0
    env = hand_env([FLAT_BAR, (100.0, 100.5, 97.5, 99.0)], episode_length=1)
    out = env.step(act(SHORT2, 0, 1))  # 2 contracts short, target 1 x ATR below: 98; low 97.5
    assert out["exit"].item() == EXIT_TAKE_PROFIT
    assert out["pnl"].item() == pytest.approx(-2 * (98.0 - 100.0) * 50 - 2 * 0.25 * 50 - 4 * 2.5)  # 165.0


def test_untouched_bracket_marks_to_the_close():
    env = hand_env([FLAT_BAR, (100.0, 101.5, 98.5, 101.0), FLAT_BAR], episode_length=2)
    out = env.step(act(LONG2, 1, 2))  # stop 98, target 104: neither touched
    assert out["exit"].item() == EXIT_NONE and out["position"].item() == 2.0
    assert out["pnl"].item() == pytest.approx(2 * (101.0 - 100.0 - 0.25) * 50 - 2 * 2.5)  # 70.0
    assert out["next_agent"][0, AGENT_FIELDS.index("stop_distance")] == pytest.approx(1.0 / 3.0)
    assert out["next_agent"][0, AGENT_FIELDS.index("take_profit_distance")] == pytest.approx(2.0 / 5.0)


def test_reversal_and_gap():
    bars = [FLAT_BAR, (100.0, 101.0, 99.5, 100.5), (101.0, 101.5, 99.0, 99.5)]
    env = hand_env(bars, episode_length=2)
    first = env.step(act(LONG1, 0, 0))
    assert first["pnl"].item() == pytest.approx((100.5 - 100.0 - 0.25) * 50 - 2.5)  # 10.0
    out = env.step(act(SHORT2, 0, 0))  # sell 3 at 101 - 0.25; gap +0.5 on the long; liquidate 2 at the close
    points = 1 * (101.0 - 100.5) - 2 * (99.5 - 101.0) - 3 * 0.25 - 2 * 0.25
    assert out["pnl"].item() == pytest.approx(points * 50 - (3 + 2) * 2.5)  # 100.0
    assert out["traded"].item() == 5.0 and out["exit"].item() == EXIT_EPISODE_END


def test_stop_and_target_prices_round_to_the_tick():
    env = hand_env([FLAT_BAR, (100.0, 100.5, 98.2, 100.0)], episode_length=1, atr=1.7)
    out = env.step(act(LONG1, 1, 0))  # stop 100 - 1.7 = 98.3 -> 98.25 on the tick grid; low 98.2 hits it
    assert out["exit"].item() == EXIT_STOP
    assert out["pnl"].item() == pytest.approx((98.0 - 100.0 - 0.25) * 50 - 5.0)


def test_episode_reward_of_holding_one_contract_is_buy_and_hold_minus_costs(sp500_market):
    market = sp500_market
    L = 64
    env = market_env(market, "train", num_envs=16, episode_length=L, seed=5)
    start = env.bar.clone()
    total = torch.zeros(16, dtype=torch.float64)
    for _ in range(L):
        out = env.step(torch.tensor([[LONG1, 0, 0]] * 16))
        total += out["reward"].double()
    assert (out["flags"] == TERMINAL | EPISODE_END).all()
    p = market.prices.double()
    es = market.contract
    expected = ((p[start + L, 3] - p[start + 1, 0]) * es.multiplier - 2 * es.cost_per_side) * 1e-3
    torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- episodes
def test_episodes_start_after_warmup_and_reset_inside_step(sp500_market):
    L = 20
    env = market_env(sp500_market, "train", num_envs=64, episode_length=L, seed=3)
    train = sp500_market.splits["train"]
    assert env.first_bar == WARMUP and env.num_starts == train.stop - 1 - L - WARMUP + 1
    starts = [env.bar.clone()]
    g = torch.Generator().manual_seed(0)
    for k in range(3 * L):
        before = env.bar.clone()
        out = env.step(torch.randint(0, 5, (64, 3), generator=g))
        assert (out["episode_step"] == k % L).all()
        assert torch.equal(out["bar"].long(), before)
        ended = (out["flags"] & EPISODE_END) != 0
        assert bool(ended.all()) == (k % L == L - 1)
        if not ended.any():  # the next obs of a transition is (bar + 1, next_agent)
            assert torch.equal(out["current_bar"], before + 1)
            assert torch.equal(out["current_agent"], out["next_agent"])
        else:
            starts.append(out["current_bar"].clone())
            assert (out["current_agent"][:, ACHIEVED_COLUMN] == 0).all()
            assert (out["current_agent"][:, AGENT_FIELDS.index("episode_left")] == 1).all()
    starts = torch.cat(starts)
    assert starts.min() >= max(WARMUP, env.window - 1) and starts.max() + L <= train.stop - 1
    assert starts.unique().numel() > 150  # random offsets


def test_goal_is_sampled_per_episode_and_rewarded_on_upward_crossing(sp500_market):
    env = market_env(sp500_market, "train", num_envs=256, episode_length=4, seed=0)
    goals = env.agent[:, GOAL_COLUMN]
    low, high = env.goal_range
    assert low == 0.0 and high == pytest.approx(env.goal_unit * 2.0)
    assert (goals >= low).all() and (goals <= high).all() and goals.std() > 0
    assert env.goal_unit == pytest.approx(float(sp500_market.atr[WARMUP:3522].median()) * 50 * 1e-3, rel=1e-6)
    before = torch.tensor([0.0, 0.5, 1.5, 0.9, 2.0])
    after = torch.tensor([1.2, 1.0, 0.5, 1.0, 3.0])
    bonus = env.goal_reward(before, after, torch.ones(5))
    assert bonus.tolist() == pytest.approx([env.goal_bonus, env.goal_bonus, 0.0, env.goal_bonus, 0.0])
    assert env.goal_reward == GoalCrossing(env.goal_bonus)  # the bonus the replay's gather operator takes


def test_seeded_determinism(sp500_market):
    def rollout(seed):
        env = market_env(sp500_market, "train", num_envs=32, episode_length=16, seed=seed)
        g = torch.Generator().manual_seed(1)
        outs = [env.step(torch.randint(0, 5, (32, 3), generator=g)) for _ in range(40)]
        return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}

    a, b, c = rollout(7), rollout(7), rollout(8)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["bar"], c["bar"])
    env = market_env(sp500_market, "train", num_envs=8, seed=1)
    first = env.bar.clone()
    env.reset(seed=1)
    assert torch.equal(env.bar, first)


def test_branches_without_brackets_trade_as_the_full_env_choosing_none(sp500_market):
    """``net.branches = (n, 1, 1)``: the bracket branches offer only 'none'; the env then steps exactly as the full
    one does when the agent chooses no stop and no take-profit."""
    def rollout(branches):
        env = market_env(sp500_market, "train", num_envs=16, episode_length=16, branches=branches, seed=3)
        g = torch.Generator().manual_seed(2)
        actions = [torch.cat([torch.randint(0, 5, (16, 1), generator=g), torch.zeros(16, 2, dtype=torch.long)], 1)
                   for _ in range(30)]
        outs = [env.step(a) for a in actions]
        return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}

    full, bare = rollout((5, 5, 5)), rollout((5, 1, 1))
    for key in full:
        assert torch.equal(full[key], bare[key]), key
    with pytest.raises(UserError, match=r"\(n, 1, 1\) for target positions only"):
        market_env(sp500_market, "train", branches=(5, 2, 5))


def test_transition_contract(sp500_market):
    env = market_env(sp500_market, "train", num_envs=5, episode_length=8)
    spec = transition_spec()
    assert list(spec) == [
        "bar",
        "agent",
        "action",
        "reward",
        "achieved",
        "next_agent",
        "episode_step",
        "flags",
    ]
    assert env.transition_spec() == spec
    out = env.step(torch.randint(0, 5, (5, 3), dtype=torch.uint8))
    check_rows(spec, {k: out[k] for k in spec}, 5)
    assert len(AGENT_FIELDS) == 8 and AGENT_FIELDS[GOAL_COLUMN] == "goal"
    obs = env.observation()
    assert obs.shape == (5, 8, 80) and obs.dtype == torch.float32
    assert torch.equal(obs, build_observation(env.features, out["current_bar"], out["current_agent"], 8))
    assert env_state_bytes(5) == 5 * (2 * 8 + 7 * 4 + 8 * 4)
    assert market_bytes(100) == 100 * (72 + 4 + 1) * 4


def test_step_has_no_host_sync():
    """Run step and observation on the meta device: .item(), bool() or a Python branch on a value raises."""
    env = hand_env([FLAT_BAR] * 12, episode_length=5, num_envs=4)
    for name, value in list(vars(env).items()):
        if isinstance(value, torch.Tensor):
            setattr(env, name, torch.empty_like(value, device="meta"))
    env.device, env.generator = torch.device("meta"), None
    out = env.step(torch.zeros(4, 3, dtype=torch.long, device="meta"))
    assert out["reward"].shape == (4,) and env.observation().shape == (4, 1, 80)


def test_bad_env_arguments(sp500_market):
    with pytest.raises(UserError, match="cannot hold an episode"):
        market_env(sp500_market, "test", episode_length=5000)
    with pytest.raises(UserError, match=r"net.branches"):
        market_env(sp500_market, "train", branches=(5, 4, 5))
    with pytest.raises(UserError, match="window"):
        hand_env([FLAT_BAR] * 5, 2).__class__(
            torch.zeros(5, 4), torch.zeros(5), torch.zeros(5, 72), TEST_CONTRACT, first_bar=0,
            **env_options(window=4)
        )


def test_from_config_reads_the_config():
    config = with_overrides(
        Config(),
        {
            "market.data": "synthetic",
            "market.synthetic_bars": 1500,
            "net.window": 4,
            "collect.num_envs": 6,
            "market.episode_length": 32,
            "market.max_contracts": 4,
            "market.reward_scale": 1.0,  # resolved: nothing left to the data
            "market.position_sizing": "contracts",
        },
    )
    env = FuturesEnv.from_config(config, "validation")
    assert env.num_envs == 6 and env.window == 4 and env.episode_length == 32
    assert env.position_levels.tolist() == [-4.0, -2.0, 0.0, 2.0, 4.0]
    assert env.contract.name == "generic" and env.first_bar == 1050
    assert env.observation().shape == (6, 4, 80)


def test_vol_reward_is_pnl_over_the_decision_bars_atr():
    """'vol': the same step's net P&L divided by ATR(decision bar) x multiplier, then scaled; state in the same
    units."""
    bars = [FLAT_BAR, (100.5, 102.0, 100.0, 101.5), (101.0, 103.0, 100.5, 102.5)]
    prices = torch.tensor(bars, dtype=torch.float32)
    atr = torch.tensor([2.0, 4.0, 4.0])
    env = FuturesEnv(prices, atr, torch.zeros(3, NUM_FEATURES), TEST_CONTRACT, first_bar=0, stop_bar=3,
                     **env_options(window=1, episode_length=2, reward_scale=0.5, reward="vol"))
    out = env.step(act(LONG1, 0, 0))
    pnl = (101.5 - 100.5 - 0.25) * 50 - 2.5
    assert out["pnl"].item() == pytest.approx(pnl)  # the backtest's currency is unchanged
    assert out["reward"].item() == pytest.approx(pnl / (2.0 * 50) * 0.5)
    unrealised = out["next_agent"][0, AGENT_FIELDS.index("unrealised_pnl")]
    assert unrealised.item() == pytest.approx((101.5 - 100.75) * 50 / (2.0 * 50) * 0.5)
    assert env.goal_unit == pytest.approx(0.5)  # one ATR of one contract
    out = env.step(act(LONG1, 0, 0))  # decided at bar 1: its ATR is 4
    assert out["reward"].item() == pytest.approx(out["pnl"].item() / (4.0 * 50) * 0.5)


def test_risk_penalty_takes_the_squared_reward_off_each_step_and_leaves_the_pnl():
    """market.risk_penalty = k: the step's reward r becomes r - k r^2 (mean-variance utility); P&L and the next
    state are those of the plain env, but for the reward so far (``achieved``: the penalised rewards' sum)."""
    bars = [FLAT_BAR, (100.5, 102.0, 100.0, 101.5), (101.0, 103.0, 100.5, 102.5)]
    prices = torch.tensor(bars, dtype=torch.float32)
    atr = torch.tensor([2.0, 4.0, 4.0])

    def env_with(penalty: float) -> FuturesEnv:
        return FuturesEnv(prices, atr, torch.zeros(3, NUM_FEATURES), TEST_CONTRACT, first_bar=0, stop_bar=3,
                          **env_options(window=1, episode_length=2, reward_scale=0.5, reward="vol",
                                        risk_penalty=penalty))

    plain, averse = env_with(0.0), env_with(0.3)
    achieved = AGENT_FIELDS.index("achieved")
    total = 0.0
    first = True
    for action in (act(LONG2, 0, 0), act(SHORT1, 0, 0)):
        a, b = plain.step(action), averse.step(action)
        r = a["reward"].item()
        if first:  # long 2 from flat: 2 contracts x (close - open - slippage) x 50 - 2 commissions, over ATR 2 x 50
            assert r == pytest.approx((2 * (101.5 - 100.5 - 0.25) * 50 - 2 * 2.5) / (2.0 * 50) * 0.5)
            first = False
        assert b["reward"].item() == pytest.approx(r - 0.3 * r * r)
        assert b["pnl"].item() == a["pnl"].item()
        total += b["reward"].item()
        assert b["next_agent"][0, achieved].item() == pytest.approx(total)
        others = [i for i in range(len(AGENT_FIELDS)) if i != achieved]
        torch.testing.assert_close(b["next_agent"][:, others], a["next_agent"][:, others])
    config = with_overrides(Config(), {"market.data": "synthetic", "market.risk_penalty": 0.25,
                                       "market.reward_scale": 1.0, "market.position_sizing": "contracts"})
    assert FuturesEnv.from_config(config, "train", num_envs=2).risk_penalty == 0.25
    with pytest.raises(UserError, match="risk_penalty"):
        env_with(-0.1)


def test_derived_reward_scale_puts_returns_inside_the_support():
    """market.reward_scale = 0: the full-position discounted return on the training split has std
    v_max / reward_support_sigmas (recomputed here from the close prices); with the old typed-in 1e-3, 17 % of
    one-step synthetic rewards fell outside the C51 support."""
    from fitdqn.market.env import derive_reward_scale

    config = with_overrides(Config(), {"market.data": "synthetic", "learn.gamma": 0.9, "learn.n_step": 3})
    market = load_market(config.market, window=config.net.window)
    for reward in ("vol", "pnl"):
        cfg = with_overrides(config, {"market.reward": reward})
        info = derive_reward_scale(market, cfg)
        train = market.split("train")
        first = market.first_bar(train, cfg.net.window)
        close = market.prices[first:train.stop, 3].double().numpy()
        per_contract = np.diff(close) / (market.atr[first:train.stop - 1].double().numpy() if reward == "vol"
                                         else 1 / market.contract.multiplier)
        r = cfg.market.max_contracts * per_contract * info.scale
        horizon = 30  # 3 / (1 - gamma)
        g = sum(0.9**k * r[k:len(r) - horizon + 1 + k] for k in range(horizon))
        assert g.std() == pytest.approx(cfg.net.v_max / cfg.market.reward_support_sigmas, rel=1e-6)
        assert info.source == "derived" and info.outside_one_step < 0.01 and info.outside_n_step < 0.01
    given = derive_reward_scale(market, with_overrides(config, {"market.reward": "pnl", "market.reward_scale": 1e-3}))
    assert given.source == "given" and given.outside_one_step > 0.1
    resolved, info = resolve_for_market(config, market)
    assert resolved.market.reward_scale == info.scale > 0
    assert FuturesEnv.from_config(resolved, "train", market=market, num_envs=4).reward_scale == info.scale
    with pytest.raises(UserError, match="resolve_for_market"):  # the env factory resolves nothing itself
        FuturesEnv.from_config(config, "train", market=market, num_envs=4)


def test_an_unresolved_reward_scale_is_refused():
    with pytest.raises(UserError, match="resolve_for_market"):
        hand_env([FLAT_BAR, FLAT_BAR], episode_length=1).__class__(
            torch.tensor([FLAT_BAR, FLAT_BAR]), torch.full((2,), 2.0), torch.zeros(2, NUM_FEATURES), TEST_CONTRACT,
            first_bar=0, **env_options(window=1, episode_length=1, reward_scale=0.0))


def test_a_given_goal_unit_is_used_as_given(sp500_market):
    derived = market_env(sp500_market, "train", num_envs=4)
    given = market_env(sp500_market, "train", num_envs=4, goal_unit=0.7)
    assert derived.goal_unit != 0.7 and given.goal_unit == 0.7 and given.goal_range == (0.0, 0.7 * 16.0)


def test_volatility_sizing_holds_the_level_times_the_target_over_the_bars_volatility():
    """market.position_sizing = 'volatility': a level's contracts x min(1, target / (ATR / close)) of the decision
    bar; fills, costs and P&L are those of the fractional position; below the target the full level."""
    bars = [FLAT_BAR, (100.5, 102.0, 100.0, 101.5), (101.0, 103.0, 100.5, 102.5)]
    prices = torch.tensor(bars, dtype=torch.float32)
    atr = torch.tensor([4.0, 1.0, 1.0])  # ATR / close: 4 % at bar 0, about 1 % at bar 1

    def env_with(target: float) -> FuturesEnv:
        return FuturesEnv(prices, atr, torch.zeros(3, NUM_FEATURES), TEST_CONTRACT, first_bar=0, stop_bar=3,
                          **env_options(window=1, episode_length=2, target_volatility=target))

    sized = env_with(0.01)  # 1 %: a quarter of the level at bar 0, all of it at bar 1 (1 / 101.5 < 1 %)
    first = sized.step(act(LONG2, 0, 0))
    assert first["position"].item() == pytest.approx(0.5)  # 2 contracts x 0.01 / (4 / 100)
    assert first["target"].item() == pytest.approx(0.5)  # what the backtests and `fitdqn act` report
    assert first["traded"].item() == pytest.approx(0.5)
    assert first["pnl"].item() == pytest.approx(0.5 * (101.5 - 100.5 - 0.25) * 50 - 0.5 * 2.5, rel=1e-5)
    second = sized.step(act(LONG2, 0, 0))  # the full level: buy 1.5 more at the open, hold, liquidate 2 at the close
    assert second["position"].item() == pytest.approx(2.0)
    assert second["traded"].item() == pytest.approx(1.5 + 2.0)
    plain = env_with(0.0)  # 0: positions in contracts, as without sizing
    assert plain.step(act(LONG2, 0, 0))["position"].item() == 2.0
    with pytest.raises(UserError, match="target"):
        env_with(-0.01)


def test_volatility_sizing_target_is_derived_from_the_training_split():
    """market.target_volatility = 0 resolves to the median ATR / close of the training split's decision bars, the
    reward scale then derived for the sized positions; 'contracts' leaves it 0; a given target is kept."""
    config = with_overrides(Config(), {"market.data": "synthetic", "market.position_sizing": "volatility"})
    market = load_market(config.market, window=config.net.window)
    train = market.split("train")
    first = market.first_bar(train, config.net.window)
    relative = (market.atr[first:train.stop - 1].double() / market.prices[first:train.stop - 1, 3].double()).numpy()
    resolved, info = resolve_for_market(config, market)
    assert resolved.market.target_volatility == pytest.approx(float(np.median(relative)), rel=1e-9)
    assert info.target_volatility == resolved.market.target_volatility and "sized by volatility" in info.describe()
    plain, _ = resolve_for_market(with_overrides(config, {"market.position_sizing": "contracts"}), market)
    assert plain.market.target_volatility == 0.0 and resolved.market.reward_scale > plain.market.reward_scale
    given, _ = resolve_for_market(with_overrides(config, {"market.target_volatility": 0.02}), market)
    assert given.market.target_volatility == 0.02
    env = FuturesEnv.from_config(resolved, "train", market=market, num_envs=2)
    assert env.target_volatility == pytest.approx(resolved.market.target_volatility)
    whole = with_overrides(config, {"market.position_sizing": "contracts", "market.target_volatility": 0.02,
                                    "market.reward_scale": 1.0})  # nothing left to resolve: a target unused
    assert FuturesEnv.from_config(whole, "train", market=market, num_envs=2).target_volatility == 0.0
