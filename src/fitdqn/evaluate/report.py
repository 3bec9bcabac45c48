"""Reports a trader reads: a verdict in words first, then what was traded and how, then the tables.

The verdict rests on the bootstrap intervals (:mod:`fitdqn.evaluate.bootstrap`): the agent's edge is
"distinguishable from zero" when the interval of its Sharpe excludes 0, and "distinguishable from buy-and-hold"
when the interval of its Sharpe minus buy-and-hold's (the same bars resampled together) excludes 0; likewise
against the best baseline sized as the agent is (:func:`fitdqn.evaluate.compare.own_sizing_baselines`: the one of
highest Sharpe on the same bars, the hardest of them to beat). The reality check weighs the agent against all
baselines at once, and a configuration found by trying many is judged by its deflated Sharpe ratio
(:mod:`fitdqn.evaluate.significance`). A baseline that cannot run on the bars is marked n/a with the reason.
Across seeds and folds, the test P&L of the seeds is averaged bar by bar (an equal-weight book of the seeds' agents)
and the folds' test blocks are joined in time; the intervals are those of that pooled series, with each seed's
own pooled Sharpe beside it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from fitdqn.config import Config
from fitdqn.evaluate.baselines import SIZED_HOLD
from fitdqn.evaluate.bootstrap import bootstrap_sharpe
from fitdqn.evaluate.compare import (
    BUY_AND_HOLD,
    POLICIES,
    RANDOM,
    bootstrap_options,
    joint_test,
    own_sizing_baselines,
    sharpe_differences,
    tries_counted,
)
from fitdqn.evaluate.ensemble import BRACKET_RULE
from fitdqn.evaluate.metrics import bar_returns, sharpe_ratio
from fitdqn.market.contract import ContractSpec

TABLE_WIDTH = 160  # console width for printing reports: tables never wrap, in a terminal or a pipe


def policy_label(name: str, config: Config, results: dict[str, Any] | None = None) -> str:
    e = config.evaluate
    labels = {
        "agent": "agent",
        BUY_AND_HOLD: f"buy & hold ({config.market.max_contracts} ct)",
        SIZED_HOLD: f"buy & hold sized by volatility (up to {config.market.max_contracts} ct)",
        "ma_crossover": f"MA {e.ma_fast}/{e.ma_slow}",
        "time_series_momentum": f"momentum {e.momentum_years * 12:g} mo",
        "last_bar_momentum": "last-bar momentum",
        RANDOM: f"random ({config.train.eval_seeds} seed{'s' if config.train.eval_seeds != 1 else ''})",
    }
    return labels.get(name, name)


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def percent(fraction: float | None, digits: int = 1) -> str:
    """A fraction as a percentage (0.034 -> '3.4'), '-' for None."""
    return "-" if fraction is None else f"{100 * fraction:.{digits}f}"


def fmt_ci(ci: dict[str, Any] | None) -> str:
    if not ci or ci.get("low") is None or ci.get("high") is None:
        return "-"
    return f"{ci['low']:.2f} .. {ci['high']:.2f}"


def contract_line(contract: ContractSpec) -> str:
    c = contract
    text = (f"{c.name}{f' ({c.description})' if c.description else ''}: {c.multiplier:g} {c.unit} per point "
            f"per contract, tick {c.tick_size:g}, commission {c.commission:g} {c.unit} per contract per fill, "
            f"slippage {c.slippage_ticks:g} tick(s) on market and stop fills")
    return text


def judge(ci: dict[str, Any] | None, what: str) -> str:
    """Words for an interval: above / below / not distinguishable from ``what``."""
    if not ci or ci.get("low") is None or ci.get("high") is None:
        return f"no interval (too few bars), so not distinguishable from {what}"
    if ci["low"] > 0:
        return f"distinguishable from {what} (above it)"
    if ci["high"] < 0:
        return f"distinguishable from {what} (below it)"
    return f"not distinguishable from {what}"


def best_baseline(results: dict[str, Any], config: Config) -> tuple[str, float] | None:
    """The baseline of highest Sharpe among those sized as the agent is (and present: not n/a, not ruined)."""
    own = [(n, results[n]["sharpe"]) for n in own_sizing_baselines(config)
           if n in results.get("policies", ()) and results[n].get("sharpe") is not None]
    return max(own, key=lambda r: r[1]) if own else None


def sizing_words(config: Config) -> str:
    return ("sized by volatility as the agent is" if config.market.position_sizing == "volatility"
            else "in whole contracts as the agent is")


def split_verdict(results: dict[str, Any], config: Config) -> str:
    """The verdict of one run from its test results."""
    agent, level = results["agent"], f"{100 * config.evaluate.confidence:g} %"
    if agent.get("ruined_at") is not None:
        return (f"The agent lost the whole account on the {results['split']} split: equity reached zero at step "
                f"{agent['ruined_at']} of {results['bars']}, so the backtest ended there and it has no Sharpe. "
                "Raise train.capital or lower market.max_contracts to trade it at all.")
    ci, diff = agent.get("sharpe_ci"), agent.get("sharpe_minus_buy_and_hold")
    hold = results.get(BUY_AND_HOLD, {}).get("sharpe")
    text = (f"On the {results['split']} split ({results['bars']} bars) the agent's Sharpe is "
            f"{fmt(agent['sharpe'], 2)} ({level} interval {fmt_ci(ci)}): {judge(ci, 'zero')}. ")
    if diff:
        text += (f"Buy-and-hold's ({policy_label(BUY_AND_HOLD, config)}) is {fmt(hold, 2)}; the difference, "
                 f"{diff['estimate']:+.2f} (interval {fmt_ci(diff)}), is {judge(diff, 'buy-and-hold')}. ")
    text += baseline_sentence(best_baseline(results, config), agent, config)
    text += reality_sentence(agent.get("reality_check"))
    text += deflated_sentence(agent.get("deflated_sharpe"))
    return text.strip()


def baseline_sentence(best: tuple[str, float] | None, agent: dict[str, Any], config: Config) -> str:
    """The best baseline sized as the agent is, by Sharpe, and whether the agent is distinguishable from it."""
    if best is None:
        return ""
    name, sharpe = best
    label = policy_label(name, config)
    diff = agent.get("sharpe_minus_buy_and_hold") if name == BUY_AND_HOLD else agent.get(
        "sharpe_minus_rules", {}).get(name)
    text = f"The best baseline {sizing_words(config)}, {label}, has Sharpe {sharpe:.2f}"
    if not diff:
        return text + ". "
    return f"{text}; the agent minus it, {diff['estimate']:+.2f} (interval {fmt_ci(diff)}), is {judge(diff, label)}. "


def fmt_p(p: float | None) -> str:
    if p is None:
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def reality_sentence(check: dict[str, Any] | None) -> str:
    """The agent against every baseline at once (:func:`fitdqn.evaluate.significance.reality_check`)."""
    if not check:
        return ""
    spa = check.get("some_baseline_beats_agent") or {}
    k = len(check["baselines"])
    return (f"Against all {k} baseline{'s' if k != 1 else ''} at once (reality check, {check['samples']} "
            f"resamples): p = {fmt_p(check.get('agent_beats_every_baseline'))} that the agent beats every one, "
            f"p = {fmt_p(spa.get('consistent'))} that some baseline beats the agent (Hansen's SPA). ")


def deflated_sentence(deflated: dict[str, Any] | None) -> str:
    """A tuned configuration's Sharpe deflated for the tries that found it."""
    if not deflated:
        return ""
    where = f" in {deflated['tried_in']}" if deflated.get("tried_in") else ""
    return (f"This configuration is the best of {deflated['trials']} tried{where}: their Sharpes' spread (variance "
            f"{deflated['trials_sharpe_variance']:.3g}) gives a best of {deflated['expected_max_sharpe']:.2f} by luck "
            f"alone, and the deflated Sharpe ratio (the probability that the agent's true Sharpe is above that) is "
            f"{fmt(deflated['deflated_sharpe'], 2)}. ")


def difference_lines(agent: dict[str, Any], config: Config, what: str = "agent Sharpe minus") -> list[str]:
    """A markdown paragraph (after a blank line) with one line per baseline the agent was compared with on the same
    bars: the difference and its interval; nothing when there are none."""
    differences = {BUY_AND_HOLD: agent.get("sharpe_minus_buy_and_hold"), **agent.get("sharpe_minus_rules", {})}
    lines = [f"{what} {policy_label(name, config)}: {diff['estimate']:+.2f}, interval {fmt_ci(diff)}"
             for name, diff in differences.items() if diff]
    return ["", *(f"{line}  " for line in lines[:-1]), lines[-1]] if lines else []  # "  ": a markdown line break


def reality_lines(check: dict[str, Any] | None) -> list[str]:
    """A markdown paragraph: the reality check's p-values (:func:`fitdqn.evaluate.significance.reality_check`)."""
    if not check:
        return []
    spa = check.get("some_baseline_beats_agent") or {}
    return ["", f"all {len(check['baselines'])} baselines at once ({check['samples']} resamples): the agent beats "
                f"every one, p = {fmt_p(check.get('agent_beats_every_baseline'))} (largest one-sided pairwise p); "
                f"some baseline beats the agent, p = {fmt_p(spa.get('consistent'))} (Hansen's SPA; White's reality "
                f"check {fmt_p(spa.get('upper'))})"]


def table_order(names: list[str]) -> list[str]:
    """``names`` in the order of every table (:data:`fitdqn.evaluate.compare.POLICIES`), unknown names last."""
    return sorted(names, key=lambda n: POLICIES.index(n) if n in POLICIES else len(POLICIES))


def metrics_table(results: dict[str, Any], config: Config) -> list[str]:
    head = "| policy | return % | Sharpe | interval | Sortino | max DD % | turnover ct/bar | trades | win % |"
    lines = [head, "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    unusable = results.get("not_applicable", {})
    for name in table_order([*results.get("policies", ("agent",)), *unusable]):
        if name in unusable:  # a baseline that cannot run on these bars: n/a, the reason below the table
            lines.append(f"| {policy_label(name, config)} | n/a |" + " |" * 7)
            continue
        row = results[name]
        cells = [percent(row.get("total_return")), fmt(row.get("sharpe"), 2), fmt_ci(row.get("sharpe_ci")),
                 fmt(row.get("sortino"), 2), percent(row.get("max_drawdown")), fmt(row.get("turnover")),
                 fmt(row.get("trades"), 0), percent(row.get("win_rate"), 0)]
        lines.append(f"| {policy_label(name, config)} | " + " | ".join(cells) + " |")
    lines += difference_lines(results["agent"], config)
    lines += reality_lines(results["agent"].get("reality_check"))
    for name, why in results.get("not_applicable", {}).items():
        lines += ["", f"note: {policy_label(name, config)} {why}"]
    ruined = [n for n in results.get("policies", ()) if results[n].get("ruined_at") is not None]
    for name in ruined:
        lines += ["", f"note: {policy_label(name, config)} lost the whole account at step "
                  f"{results[name]['ruined_at']}; its backtest ends there (Sharpe, Sortino, Calmar not defined)"]
    return lines


def units_line(results: dict[str, Any], config: Config) -> str:
    auto = config.train.capital <= 0
    e = config.evaluate
    return (f"Account: capital {results['capital']:,.0f} {results['currency']}"
            f"{f' (auto: the notional of {config.market.max_contracts} contracts at the split start)' if auto else ''}"
            f"; P&L in {results['currency']} net of costs; return: total over the split, % of capital; max DD: "
            "largest fall of equity from a peak, % of that peak; turnover: contracts traded per bar; win: % of "
            f"closed trades with a profit; Sharpe of the per-bar returns on equity, annualised at "
            f"{results['periods_per_year']:g} bars a year; intervals: {100 * e.confidence:g} %, stationary block "
            f"bootstrap, {e.bootstrap_samples} resamples.")


def selection_line(selection: dict[str, Any]) -> str:
    candidates = ", ".join(f"{e} ({fmt(s, 2)})" for e, s in selection["candidates"])
    stopped = f" {selection['stopped_early'][0].upper()}{selection['stopped_early'][1:]}." \
        if selection.get("stopped_early") else ""
    return (f"Network: epoch {selection['epoch']} of {selection['epochs']}, {selection['reason']}; validation "
            f"Sharpe by epoch: {candidates or 'none'}.{stopped} The test split played no part in the choice.")


def run_markdown(report: dict[str, Any], config: Config) -> str:
    """report.md of one run (the dict :func:`fitdqn.train.run.final_report` writes as report.json)."""
    test = report["test"]
    lines = [f"# fitdqn run: {config.market.data}", "", "**Verdict.** " + report["verdict"], "",
             f"Run directory: {report['run_dir']}", "",
             f"Data: {config.market.data}, {report['bars']} bars ({report['first_time']} .. {report['last_time']})"
             + (f", walk-forward fold {report['fold']['index']}" if report.get("fold") else "")
             + f"; trained on {report['train_bars'][0]} .. {report['train_bars'][1]}.", "",
             "Contract: " + contract_line_from(report), "", units_line(test, config), "",
             f"Training: {report['epochs']} epochs, {report['updates']} updates at batch {report['batch_size']} "
             f"({report['batch_source']}) on {report['device']}"
             + (f" with {report['threads']} CPU thread(s)" if report.get("threads") else "")
             + f"; planned memory {report['planned_memory']}.", "",
             selection_line(report["selection"]), ""]
    code = report.get("code")
    if code:
        lines += [f"Code: fitdqn {code['fitdqn']} (commit {code['commit']}), PyTorch {code['torch']}.", ""]
    for split in ("test", "validation"):
        r = report[split]
        lines += [f"## {split}: {r['bars']} bars, {r['first_time']} .. {r['last_time']}", ""]
        lines += metrics_table(r, config) + [""]
    lines += ["Plots: equity_test.png (agent and baselines), learning_curves.png, vram.png", "",
              f"Run directory: {report['run_dir']}", ""]
    return "\n".join(lines)


def contract_line_from(report: dict[str, Any]) -> str:
    return contract_line(ContractSpec(**{**report["contract"], "data": tuple(report["contract"]["data"])}))


# ---------------------------------------------------------------------------------------------- studies
def pooled_returns(members: list[dict[str, Any]], policy: str) -> np.ndarray:
    """Per-bar returns of ``policy`` joined over the folds (in fold order) of one seed's members."""
    parts = [bar_returns(m["pnl"][policy].to_numpy(), m["capital"]) for m in sorted(members, key=lambda m: m["fold"])]
    return np.concatenate(parts) if parts else np.zeros(0)


def study_summary(members: list[dict[str, Any]], config: Config, per_year: float,
                  ensemble: dict[int, np.ndarray] | None = None) -> dict[str, Any]:
    """Aggregate a study: ``members`` = one dict per (seed, fold) run with ``seed``, ``fold``, ``capital``,
    ``pnl`` (the run's test P&L frame: a column per policy), ``selected_epoch`` and ``test`` (its results);
    ``ensemble``: fold -> the P&L of the fold's ensemble (:mod:`fitdqn.evaluate.ensemble`) on the same bars, the
    agent of the pooled figures (``agent_book = 'ensemble'``); without it, the seeds' average book is."""
    options = bootstrap_options(config)
    seeds = sorted({m["seed"] for m in members})
    folds = sorted({m["fold"] for m in members})
    by_seed = {s: [m for m in members if m["seed"] == s] for s in seeds}
    first = by_seed[seeds[0]]
    per_seed = []
    for s in seeds:
        r = pooled_returns(by_seed[s], "agent")
        ci = bootstrap_sharpe(r, per_year, **options).to_json() if len(r) > 1 else None
        per_seed.append({"seed": s, "sharpe": _finite(sharpe_ratio(r, per_year)), "sharpe_ci": ci,
                         "selected_epochs": [m["selected_epoch"] for m in sorted(by_seed[s], key=lambda m: m["fold"])]})
    average, book = [], []  # the seeds' average agent P&L per fold, and the agent's book (the ensemble's, if any)
    for f in folds:
        fold_members = [m for m in members if m["fold"] == f]
        mean_pnl = np.mean([m["pnl"]["agent"].to_numpy() for m in fold_members], axis=0)
        average.append({"fold": f, "capital": fold_members[0]["capital"], "pnl": pd.DataFrame({"agent": mean_pnl})})
        traded = mean_pnl if ensemble is None else np.asarray(ensemble[f])
        book.append({"fold": f, "capital": fold_members[0]["capital"], "pnl": pd.DataFrame({"agent": traded})})
    average_returns = pooled_returns(average, "agent")
    book_returns = pooled_returns(book, "agent")
    hold_returns = pooled_returns(first, BUY_AND_HOLD)
    present = [p for p in POLICIES if all(p in m["pnl"].columns for m in first)]  # a baseline n/a on a fold is n/a
    pooled: dict[str, Any] = {}
    for name in present:
        r = book_returns if name == "agent" else pooled_returns(first, name)
        entry = {"sharpe": _finite(sharpe_ratio(r, per_year)),
                 "sharpe_ci": bootstrap_sharpe(r, per_year, **options).to_json() if len(r) > 1 else None}
        if name == "agent" and len(r) == len(hold_returns) > 1:  # against buy-and-hold and the rules
            others = {n: pooled_returns(first, n) for n in present if n not in ("agent", RANDOM)}
            entry |= sharpe_differences(r, others, per_year, options)
            entry["reality_check"] = joint_test(r, others, per_year, options)
        deflated = tries_counted(config, r, entry["sharpe"], per_year) if name == "agent" else None
        if deflated is not None:  # a study trained from a tune study's best.toml
            entry["deflated_sharpe"] = deflated
        pooled[name] = entry
    unusable = {name: f"{why} (fold {m['fold']})" for m in sorted(first, key=lambda m: -m["fold"])
                for name, why in m["test"].get("not_applicable", {}).items()}  # the earliest fold's reason wins
    sharpes = [p["sharpe"] for p in per_seed if p["sharpe"] is not None]
    per_fold = []
    for f in folds:
        fold_members = [m for m in members if m["fold"] == f]
        test = fold_members[0]["test"]
        agent = [m["test"]["agent"]["sharpe"] for m in fold_members if m["test"]["agent"]["sharpe"] is not None]
        fold_book = pooled_returns([b for b in book if b["fold"] == f], "agent")
        per_fold.append({"fold": f, "first_time": test["first_time"], "last_time": test["last_time"],
                         "bars": test["bars"], "agent_median_sharpe": float(np.median(agent)) if agent else None,
                         "agent_book_sharpe": _finite(sharpe_ratio(fold_book, per_year)),
                         **{n: test[n]["sharpe"] for n in test["policies"] if n != "agent"}})
    return {
        "seeds": seeds, "folds": len(folds), "bars": int(len(book_returns)), "periods_per_year": per_year,
        "per_seed": per_seed, "per_fold": per_fold, "pooled": pooled, "not_applicable": unusable,
        "agent_book": "average" if ensemble is None else "ensemble",
        "average_book": {"sharpe": _finite(sharpe_ratio(average_returns, per_year)),
                         "sharpe_ci": bootstrap_sharpe(average_returns, per_year, **options).to_json()
                         if len(average_returns) > 1 else None},
        "median_sharpe": float(np.median(sharpes)) if sharpes else None,
        "sharpe_range": [min(sharpes), max(sharpes)] if sharpes else None,
        "seeds_above_zero": sum(1 for p in per_seed if p["sharpe_ci"] and (p["sharpe_ci"]["low"] or 0) > 0),
    }


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def study_verdict(summary: dict[str, Any], config: Config) -> str:
    level = f"{100 * config.evaluate.confidence:g} %"
    n, k = len(summary["seeds"]), summary["folds"]
    agent = summary["pooled"]["agent"]
    span = f"{n} seed{'s' if n > 1 else ''}" + (f" x {k} walk-forward folds" if k > 1 else "")
    low, high = summary["sharpe_range"] or (None, None)
    members = (f"the median member's Sharpe is {fmt(summary['median_sharpe'], 2)} (seeds {fmt(low, 2)} to "
               f"{fmt(high, 2)}); {summary['seeds_above_zero']} of {n} seeds have a {level} interval above zero")
    pooled = " pooled over the folds" if k > 1 else ""
    if summary.get("agent_book") == "ensemble":
        each = ", each fold's from the seeds trained on it" if k > 1 else ""
        average = summary["average_book"]["sharpe"]
        text = (f"Across {span} ({summary['bars']} test bars{pooled}), the study's ensemble (the seeds' mean "
                f"target position on one account{each}) has Sharpe {fmt(agent['sharpe'], 2)} (interval "
                f"{fmt_ci(agent['sharpe_ci'])}): {judge(agent['sharpe_ci'], 'zero')}. Beside it, {members}, and "
                f"the seeds' average book (each on its own account) has {fmt(average, 2)}. ")
    else:
        text = (f"Across {span} ({summary['bars']} test bars{pooled}), {members}. The seeds' average book has Sharpe "
                f"{fmt(agent['sharpe'], 2)} (interval {fmt_ci(agent['sharpe_ci'])}): "
                f"{judge(agent['sharpe_ci'], 'zero')}. ")
    diff = agent.get("sharpe_minus_buy_and_hold")
    hold = summary["pooled"].get(BUY_AND_HOLD, {}).get("sharpe")
    if diff:
        text += (f"Buy-and-hold's is {fmt(hold, 2)}; the difference, {diff['estimate']:+.2f} (interval "
                 f"{fmt_ci(diff)}), is {judge(diff, 'buy-and-hold')}. ")
    text += baseline_sentence(best_baseline({"policies": list(summary["pooled"]), **summary["pooled"]}, config),
                              agent, config)
    text += reality_sentence(agent.get("reality_check"))
    text += deflated_sentence(agent.get("deflated_sharpe"))
    return text.strip()


def study_markdown(summary: dict[str, Any], config: Config, run_dir: str, contract: ContractSpec) -> str:
    e = config.evaluate
    capital = ("train.capital" if config.train.capital > 0
               else "the notional of market.max_contracts at the test block start")
    lines = [f"# fitdqn study: {config.market.data}", "", "**Verdict.** " + summary["verdict"], "",
             f"Run directory: {run_dir}", "", "Contract: " + contract_line(contract), "",
             f"Each seed and fold is its own run directory (seed_S/fold_K) with its own report.md. Capital per "
             f"fold: {capital}; Sharpe annualised at {summary['periods_per_year']:g} bars a year; intervals "
             f"{100 * e.confidence:g} %, stationary block bootstrap, {e.bootstrap_samples} resamples. Networks "
             "were chosen on each fold's validation bars only."
             + (f" The ensemble holds the mean of its members' target positions, with {BRACKET_RULE}; `fitdqn act` "
                "and `fitdqn export` on this directory give the latest fold's ensemble."
                if summary.get("agent_book") == "ensemble" else ""), "",
             "## Pooled test", "", "| policy | Sharpe | interval |", "|---|---:|---|"]
    unusable = summary.get("not_applicable", {})
    ensemble = summary.get("agent_book") == "ensemble"
    for name in table_order([*summary["pooled"], *(n for n in unusable if n not in summary["pooled"])]):
        if name not in summary["pooled"]:  # n/a on some fold: the reason below the table
            lines.append(f"| {policy_label(name, config)} | n/a | |")
            continue
        entry = summary["pooled"][name]
        label = policy_label(name, config) if name != "agent" else (
            "agent (the seeds' ensemble)" if ensemble else "agent (seeds' average book)")
        lines.append(f"| {label} | {fmt(entry['sharpe'], 2)} | {fmt_ci(entry['sharpe_ci'])} |")
        if name == "agent" and ensemble:
            average = summary["average_book"]
            lines.append(f"| seeds' average book | {fmt(average['sharpe'], 2)} | {fmt_ci(average['sharpe_ci'])} |")
    lines += difference_lines(summary["pooled"]["agent"], config, "agent minus")
    lines += reality_lines(summary["pooled"]["agent"].get("reality_check"))
    lines += [line for name, why in unusable.items() for line in ("", f"note: {policy_label(name, config)} {why}")]
    lines += ["", "## Seeds", "", "| seed | pooled Sharpe | interval | epochs chosen |", "|---:|---:|---|---|"]
    for p in summary["per_seed"]:
        lines.append(f"| {p['seed']} | {fmt(p['sharpe'], 2)} | {fmt_ci(p['sharpe_ci'])} | "
                     f"{', '.join(map(str, p['selected_epochs']))} |")
    if summary["folds"] > 1:
        names = [n for n in POLICIES if n != "agent" and any(n in f for f in summary["per_fold"])]
        book = "ensemble" if summary.get("agent_book") == "ensemble" else "average book"
        lines += ["", "## Folds (test Sharpe)", "",
                  f"| fold | test bars | agent ({book}) | agent (median) | "
                  + " | ".join(policy_label(n, config) for n in names) + " |",
                  "|---:|---|---:|---:|" + "---:|" * len(names)]
        for f in summary["per_fold"]:
            cells = [fmt(f[n], 2) if n in f else "n/a" for n in names]
            lines.append(f"| {f['fold']} | {f['first_time'][:10]} .. {f['last_time'][:10]} ({f['bars']}) | "
                         f"{fmt(f.get('agent_book_sharpe'), 2)} | {fmt(f['agent_median_sharpe'], 2)} | "
                         + " | ".join(cells) + " |")
    lines += ["", f"Run directory: {run_dir}", ""]
    return "\n".join(lines)
