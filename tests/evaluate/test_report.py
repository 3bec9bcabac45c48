"""The report's words: verdicts from intervals, the ruined account's note, labels and units."""

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
    assert text.endswith("The best rule baseline, MA 50/200, has Sharpe 0.70.")
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
    assert text.endswith("The best rule baseline, MA 50/200, has Sharpe 0.70; the agent minus it, +1.10 (interval "
                         "-0.20 .. 2.30), is not distinguishable from MA 50/200.")
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
    ruined = agent.copy()
    ruined[100] = -2e5  # equity below zero at bar 100: no Sharpe, no difference
    got = sharpe_intervals(config, ruined, 1e5, 252.0, {"buy_and_hold": hold, "ma_crossover": rule})
    assert got == {"sharpe_ci": None, "sharpe_minus_buy_and_hold": None, "sharpe_minus_rules": {"ma_crossover": None}}
    assert "sharpe_minus_rules" not in sharpe_intervals(config, hold, 1e5, 252.0)


def test_the_table_and_the_units_line_name_their_units():
    r = results({"sharpe": 1.8, "sharpe_ci": interval(1.8, 0.6, 3.0)}, None)
    head = metrics_table(r, Config())[0]
    assert "return %" in head and "max DD %" in head and "turnover ct/bar" in head and "win %" in head
    assert "| agent | 10.0 | 1.80 | 0.60 .. 3.00 | 1.00 | 10.0 | 0.100 | 3 | 50 |" in metrics_table(r, Config())
    line = units_line({**r, "currency": "price units"}, Config())
    assert line.startswith("Account: capital 100,000 price units (auto:") and "P&L in price units net of" in line
    assert "% of capital" in line and "contracts traded per bar" in line
