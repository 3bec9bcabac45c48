"""The report's words: verdicts from intervals, the ruined account's note, labels and units."""

import pytest

from fitdqn.config import Config
from fitdqn.evaluate.report import judge, metrics_table, split_verdict, units_line


def interval(estimate, low, high):
    return {"estimate": estimate, "low": low, "high": high, "confidence": 0.95, "samples": 2000, "block_length": 9}


def results(agent, diff, hold_sharpe=0.5, rule_diff=None):
    base = {"total_return": 0.1, "sortino": 1.0, "max_drawdown": 0.1, "turnover": 0.1, "trades": 3,
            "win_rate": 0.5, "ruined_at": None}
    return {
        "split": "test", "bars": 750, "capital": 1e5, "currency": "USD", "periods_per_year": 252.0,
        "policies": ["agent", "buy_and_hold", "ma_crossover"],
        "agent": {**base, **agent, "sharpe_minus_buy_and_hold": diff,
                  "sharpe_minus_rules": {"ma_crossover": rule_diff}},
        "buy_and_hold": {**base, "sharpe": hold_sharpe, "sharpe_ci": interval(hold_sharpe, -0.5, 1.5)},
        "ma_crossover": {**base, "sharpe": 0.7, "sharpe_ci": interval(0.7, -0.2, 1.6)},
    }


def test_judge_reads_the_interval():
    assert judge(interval(1.2, 0.3, 2.0), "zero") == "distinguishable from zero (above it)"
    assert judge(interval(-1.2, -2.0, -0.1), "zero") == "distinguishable from zero (below it)"
    assert judge(interval(0.2, -0.5, 0.9), "buy-and-hold") == "not distinguishable from buy-and-hold"
    assert judge(None, "zero").startswith("no interval")


def test_verdict_names_both_comparisons_and_the_best_rule():
    r = results({"sharpe": 1.8, "sharpe_ci": interval(1.8, 0.6, 3.0)}, interval(1.3, 0.1, 2.4))
    text = split_verdict(r, Config())
    assert text.startswith("On the test split (750 bars) the agent's Sharpe is 1.80 (95 % interval 0.60 .. 3.00): "
                           "distinguishable from zero (above it).")
    assert "the difference, +1.30 (interval 0.10 .. 2.40), is distinguishable from buy-and-hold (above it)" in text
    assert text.endswith("The best baseline sized by volatility as the agent is, MA 50/200, has Sharpe 0.70.")
    weak = split_verdict(results({"sharpe": 0.3, "sharpe_ci": interval(0.3, -0.9, 1.4)}, interval(-0.2, -1.0, 0.6)),
                         Config())
    assert "not distinguishable from zero" in weak and "not distinguishable from buy-and-hold" in weak


def test_a_ruined_account_gets_a_note_not_a_sharpe():
    r = results({"sharpe": None, "sortino": None, "sharpe_ci": None, "ruined_at": 412}, None)
    text = split_verdict(r, Config())
    assert "lost the whole account" in text and "step 412 of 750" in text and "Sharpe is" not in text
    table = "\n".join(metrics_table(r, Config()))
    assert "| agent | 10.0 | - | - |" in table and "note: agent lost the whole account at step 412" in table


def test_verdict_and_table_compare_the_agent_with_the_best_rule():
    r = results({"sharpe": 1.8, "sharpe_ci": interval(1.8, 0.6, 3.0)}, interval(1.3, 0.1, 2.4),
                rule_diff=interval(1.1, -0.2, 2.3))
    text = split_verdict(r, Config())
    assert text.endswith("The best baseline sized by volatility as the agent is, MA 50/200, has Sharpe 0.70; the agent "
                         "minus it, +1.10 (interval -0.20 .. 2.30), is not distinguishable from MA 50/200.")
    r["agent"]["sharpe_minus_rules"]["ma_crossover"] = interval(1.1, 0.3, 2.3)
    assert split_verdict(r, Config()).endswith("is distinguishable from MA 50/200 (above it).")
    table = "\n".join(metrics_table(r, Config()))
    assert "agent Sharpe minus buy & hold (2 ct): +1.30, interval 0.10 .. 2.40" in table
    assert "agent Sharpe minus MA 50/200: +1.10, interval 0.30 .. 2.30" in table


def test_sharpe_intervals_pair_the_agent_with_each_baseline_and_none_when_ruined():
    import dataclasses

    import numpy as np

    from fitdqn.evaluate.bootstrap import bootstrap_sharpe
    from fitdqn.evaluate.compare import sharpe_intervals
    from fitdqn.evaluate.metrics import bar_returns

    config = Config()
    config = dataclasses.replace(config, evaluate=dataclasses.replace(config.evaluate, bootstrap_samples=100))
    rng = np.random.default_rng(0)
    agent, hold, rule = (rng.normal(50, 500, 300) for _ in range(3))
    got = sharpe_intervals(config, agent, 1e5, 252.0, {"buy_and_hold": hold, "ma_crossover": rule})
    e = config.evaluate
    options = dict(samples=e.bootstrap_samples, block_length=e.block_length, confidence=e.confidence,
                   seed=e.bootstrap_seed)
    def paired(other):
        return bootstrap_sharpe(bar_returns(agent, 1e5), 252.0, baseline=bar_returns(other, 1e5), **options).to_json()

    assert got["sharpe_minus_rules"] == {"ma_crossover": paired(rule)}
    assert got["sharpe_minus_buy_and_hold"] == paired(hold)
    # the reality check takes the pairwise intervals' resamples: a pairwise p below the tail is an interval above 0
    check = got["reality_check"]
    assert check["baselines"] == ["buy_and_hold", "ma_crossover"] and check["samples"] == 100
    for name, diff in (("buy_and_hold", got["sharpe_minus_buy_and_hold"]),
                       ("ma_crossover", got["sharpe_minus_rules"]["ma_crossover"])):
        assert (check["pairwise"][name] < 0.025) == (diff["low"] > 0)
    ruined = agent.copy()
    ruined[100] = -2e5  # equity below zero at bar 100: no Sharpe, no difference
    got = sharpe_intervals(config, ruined, 1e5, 252.0, {"buy_and_hold": hold, "ma_crossover": rule})
    assert got == {"sharpe_ci": None, "sharpe_minus_buy_and_hold": None, "sharpe_minus_rules": {"ma_crossover": None},
                   "reality_check": None}
    assert "sharpe_minus_rules" not in sharpe_intervals(config, hold, 1e5, 252.0)


def test_the_table_and_the_units_line_name_their_units():
    r = results({"sharpe": 1.8, "sharpe_ci": interval(1.8, 0.6, 3.0)}, None)
    head = metrics_table(r, Config())[0]
    assert "return %" in head and "max DD %" in head and "turnover ct/bar" in head and "win %" in head
    assert "| agent | 10.0 | 1.80 | 0.60 .. 3.00 | 1.00 | 10.0 | 0.100 | 3 | 50 |" in metrics_table(r, Config())
    line = units_line({**r, "currency": "price units"}, Config())
    assert line.startswith("Account: capital 100,000 price units (auto:") and "P&L in price units net of" in line
    assert "% of capital" in line and "contracts traded per bar" in line


def test_the_verdict_judges_the_agent_by_the_best_baseline_of_its_sizing():
    import dataclasses

    r = results({"sharpe": 1.8, "sharpe_ci": interval(1.8, 0.6, 3.0)}, interval(1.3, 0.1, 2.4),
                rule_diff=interval(1.1, 0.3, 2.3))
    r["policies"].insert(2, "sized_buy_and_hold")
    r["sized_buy_and_hold"] = {**r["ma_crossover"], "sharpe": 1.5}
    r["agent"]["sharpe_minus_rules"]["sized_buy_and_hold"] = interval(0.3, -0.6, 1.2)
    text = split_verdict(r, Config())  # volatility sizing (the default): the sized buy-and-hold is the one to beat
    assert ("The best baseline sized by volatility as the agent is, buy & hold sized by volatility (up to 2 ct), has "
            "Sharpe 1.50; the agent minus it, +0.30 (interval -0.60 .. 1.20), is not distinguishable") in text
    contracts = Config()
    contracts = dataclasses.replace(contracts, market=dataclasses.replace(contracts.market,
                                                                          position_sizing="contracts"))
    r["buy_and_hold"]["sharpe"] = 0.9
    text = split_verdict(r, contracts)  # whole contracts: the plain buy-and-hold and the rules
    assert "The best baseline in whole contracts as the agent is, buy & hold (2 ct), has Sharpe 0.90; the agent " \
           "minus it, +1.30 (interval 0.10 .. 2.40), is distinguishable from buy & hold (2 ct) (above it)." in text


def test_a_baseline_that_cannot_run_is_n_a_with_its_reason_never_a_row_of_zeros():
    r = results({"sharpe": 1.8, "sharpe_ci": interval(1.8, 0.6, 3.0)}, interval(1.3, 0.1, 2.4))
    r["not_applicable"] = {"time_series_momentum": "n/a: a 12-month lookback (252 bars at 252 bars a year) needs "
                                                   "252 bars of history before its first decision; the data have 180"}
    table = "\n".join(metrics_table(r, Config()))
    assert "| momentum 12 mo | n/a | | | | | | | |" in table
    assert "note: momentum 12 mo n/a: a 12-month lookback" in table and "0.00" not in table.split("momentum 12 mo")[1]


def test_the_reality_check_and_the_deflated_sharpe_are_in_the_verdict():
    r = results({"sharpe": 1.8, "sharpe_ci": interval(1.8, 0.6, 3.0)}, interval(1.3, 0.1, 2.4))
    r["agent"]["reality_check"] = {"some_baseline_beats_agent": {"consistent": 0.71, "upper": 0.8},
                                   "agent_beats_every_baseline": 0.0004, "pairwise": {}, "samples": 2000,
                                   "baselines": ["buy_and_hold", "ma_crossover"], "block_length": 9, "confidence": 0.95}
    r["agent"]["deflated_sharpe"] = {"deflated_sharpe": 0.62, "sharpe": 1.8, "expected_max_sharpe": 1.41, "trials": 20,
                                     "trials_sharpe_variance": 0.25, "bars": 750, "skew": 0.0, "kurtosis": 3.0,
                                     "tried_in": "tune study 'fitdqn'"}
    text = split_verdict(r, Config())
    assert ("Against all 2 baselines at once (reality check, 2000 resamples): p = < 0.001 that the agent beats every "
            "one, p = 0.710 that some baseline beats the agent (Hansen's SPA).") in text
    assert text.endswith("This configuration is the best of 20 tried in tune study 'fitdqn': their Sharpes' spread "
                         "(variance 0.25) gives a best of 1.41 by luck alone, and the deflated Sharpe ratio (the "
                         "probability that the agent's true Sharpe is above that) is 0.62.")
    assert "some baseline beats the agent, p = 0.710 (Hansen's SPA; White's reality check 0.800)" in "\n".join(
        metrics_table(r, Config()))


def test_a_study_from_a_tuned_config_deflates_its_book():
    import dataclasses

    import numpy as np
    import pandas as pd

    from fitdqn.evaluate.report import study_summary, study_verdict
    from fitdqn.evaluate.significance import deflated_sharpe, return_moments

    config = Config()
    config = dataclasses.replace(config, evaluate=dataclasses.replace(
        config.evaluate, bootstrap_samples=100, tried_configs=12, tried_sharpe_variance=0.4, tried_in="tune study 's'"))
    rng = np.random.default_rng(0)
    members = []
    for seed in (0, 1):
        for fold in (0, 1):
            pnl = pd.DataFrame({"agent": rng.normal(40, 500, 200), "buy_and_hold": rng.normal(20, 500, 200)})
            test = {"first_time": "2020-01-01", "last_time": "2020-12-31", "bars": 200,
                    "policies": ["agent", "buy_and_hold"], "buy_and_hold": {"sharpe": 0.3},
                    "agent": {"sharpe": 0.5}}
            members.append({"seed": seed, "fold": fold, "capital": 1e5, "pnl": pnl, "selected_epoch": 1, "test": test})
    ensemble = {f: rng.normal(50, 400, 200) for f in (0, 1)}
    summary = study_summary(members, config, 252.0, ensemble)
    summary["verdict"] = study_verdict(summary, config)
    returns = np.concatenate([ensemble[f] / (1e5 + np.concatenate([[0.0], np.cumsum(ensemble[f])[:-1]]))
                              for f in (0, 1)])  # the ensemble's book, fold by fold on its capital
    agent = summary["pooled"]["agent"]
    got = dict(agent["deflated_sharpe"])
    assert got.pop("tried_in") == "tune study 's'"
    assert got == pytest.approx(deflated_sharpe(agent["sharpe"], 252.0, return_moments(returns), 12, 0.4), rel=1e-9)
    assert "the best of 12 tried in tune study 's'" in summary["verdict"]


def test_a_baseline_n_a_on_one_fold_is_n_a_in_the_pooled_study():
    import numpy as np
    import pandas as pd

    from fitdqn.evaluate.report import study_markdown, study_summary, study_verdict
    from fitdqn.market.contract import ContractSpec

    config = Config()
    rng = np.random.default_rng(1)
    why = "n/a: a 12-month lookback (252 bars at 252 bars a year) needs 252 bars of history before its first " \
          "decision; the data have 200"
    members = []
    for fold in (0, 1):
        columns = {"agent": rng.normal(40, 500, 150), "buy_and_hold": rng.normal(20, 500, 150)}
        policies = ["agent", "buy_and_hold"]
        if fold == 1:  # the momentum rule has its history from the second fold on
            columns["time_series_momentum"] = rng.normal(10, 500, 150)
            policies.append("time_series_momentum")
        test = {"first_time": "2020-01-01", "last_time": "2020-06-30", "bars": 150, "policies": policies,
                "not_applicable": {} if fold else {"time_series_momentum": why},
                **{n: {"sharpe": 0.1} for n in policies}}
        members.append({"seed": 0, "fold": fold, "capital": 1e5, "pnl": pd.DataFrame(columns), "selected_epoch": 1,
                        "test": test})
    summary = study_summary(members, config, 252.0)
    summary["verdict"] = study_verdict(summary, config)
    assert "time_series_momentum" not in summary["pooled"]
    assert summary["not_applicable"] == {"time_series_momentum": f"{why} (fold 0)"}
    folds = summary["per_fold"]
    assert folds[1]["time_series_momentum"] == 0.1 and "time_series_momentum" not in folds[0]
    text = study_markdown(summary, config, "runs/x", ContractSpec("generic", 50.0, 0.25, 2.5, 1.0))
    assert "| momentum 12 mo | n/a | |" in text and f"note: momentum 12 mo {why} (fold 0)" in text
    assert "| 0 | 2020-01-01 .. 2020-06-30 (150) |" in text and "| n/a |" in text.split("## Folds")[1]


def test_policy_intervals_from_shared_resamples_equal_each_interval_drawn_alone():
    import dataclasses

    import numpy as np

    from fitdqn.evaluate.compare import policy_intervals, sharpe_intervals

    config = Config()
    config = dataclasses.replace(config, evaluate=dataclasses.replace(config.evaluate, bootstrap_samples=300))
    rng = np.random.default_rng(1)
    agent, hold, rule, other = (rng.normal(50, 500, 400) for _ in range(4))
    ruined = agent.copy()
    ruined[150] = -2e5  # equity below zero: no Sharpe
    flat = np.full(400, 10.0)  # a constant series: an infinite Sharpe in every resample
    for pnl in ({"agent": agent, "buy_and_hold": hold, "ma_crossover": rule, "breakout": other},
                {"agent": agent, "buy_and_hold": ruined, "ma_crossover": flat},
                {"agent": ruined, "buy_and_hold": hold, "ma_crossover": rule},
                {"agent": agent[:2], "buy_and_hold": hold[:2]}):
        others = {name: p for name, p in pnl.items() if name != "agent"}
        alone = {name: sharpe_intervals(config, p, 1e5, 252.0, others if name == "agent" else None)
                 for name, p in pnl.items()}
        assert policy_intervals(config, pnl, 1e5, 252.0) == alone
