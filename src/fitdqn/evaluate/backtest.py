"""Backtests: a policy run over a whole split of bars on the futures env, with the env's fills and costs.

A backtest is the split cut into consecutive ``market.episode_length`` episodes, as in training: each
episode starts flat and liquidates at its end. That makes it parallel for free: the episodes are grouped into
K contiguous **segments** of whole episodes, and the K segments are stepped together as the K envs of one
sequential :class:`~fitdqn.market.env.FuturesEnv` (one network forward per step for all of them instead of
one per bar). Every segment starts flat at an episode start, exactly where the one-env pass starts that
episode, so the stitched result is the one-env pass's: equal bit for bit for any policy whose action for an
observation does not depend on the rest of the batch (rules; a network up to float rounding of a batched
matmul, which can flip a near-tie). A random policy draws different numbers at a different batch size.
``evaluate.segments`` caps K (memory: K observations and one forward at batch K per step); K = 1 is the plain
sequential pass. The per-step records stay on the device until one host sync at the end.

A pass (:class:`SegmentPass`) is the env, its records and a step with no host sync (act -> env step -> the
records at a device counter); a :data:`PassRunner` runs it to its end: :func:`run_eagerly`, or
:class:`fitdqn.evaluate.backtest_graphs.BacktestGraphs`, which keeps each pass under a key and replays its step
as a CUDA graph.

Rules (:class:`BarRule`, their actions per bar decided in advance) are batched further:
:func:`rules_pass` steps P rules' K segments each as the P x K envs of one env, every env's action
looked up in the stacked ``[P, T, 3]`` action table at (its rule, its bar), and splits the records back into
one Backtest per rule, equal bit for bit to the rule's own :func:`run_backtest` (the step is elementwise per
env). :func:`evaluate_rules` keeps a pass within ``evaluate.segments`` envs (``segments // K`` rules a pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor

from fitdqn.config import Config
from fitdqn.market.contract import ContractSpec
from fitdqn.market.env import FuturesEnv, needs_resolving
from fitdqn.market.layout import NUM_BRANCHES
from fitdqn.market.loader import Market, load_market
from fitdqn.resolve import resolve_for_market


@dataclass
class Backtest:
    """One sequential run over a split. Step k decides at ``decision_bar[k]`` and fills on the next bar
    (``timestamp[k]`` is that fill bar's time); currency arrays are float64.

    ``equity[k]`` is the cumulative net P&L after k steps (``equity[0] = 0``); ``buy_and_hold`` holds
    ``hold_contracts`` (the env's ``max_contracts``, the agent's largest exposure) bought at the first fill
    bar's open and held to the last close, entry and exit costs included. The run is a sequence of
    ``episode_length`` episodes, as in training: a position is liquidated (and may be re-entered at the next
    open) at each episode end (``exit == EXIT_EPISODE_END``).
    """

    split: str
    contract: ContractSpec
    decision_bar: np.ndarray  # [N] int64
    timestamp: np.ndarray  # [N] datetime64[ns] of the fill bar (NaT without bars)
    pnl: np.ndarray  # [N] currency, net of costs
    cost: np.ndarray  # [N] currency: commission + slippage
    reward: np.ndarray  # [N] pnl x reward_scale
    target: np.ndarray  # [N] contracts chosen
    position: np.ndarray  # [N] contracts held at the fill bar's close
    traded: np.ndarray  # [N] contracts filled
    exit: np.ndarray  # [N] uint8 EXIT_* codes
    equity: np.ndarray  # [N + 1] currency
    buy_and_hold: np.ndarray  # [N + 1] currency
    hold_contracts: int
    segments: int  # envs stepped in parallel (1 = the plain sequential pass)

    def __len__(self) -> int:
        return int(self.pnl.shape[0])


class BarRule:
    """A rule policy: the action of every bar decided in advance, ``actions [T, 3]`` int64 over all bars of
    the market (the rule reads prices up to the decision bar only). The backtest looks up the env's bars
    instead of building observations."""

    def __init__(self, name: str, actions: Tensor) -> None:
        self.name = name
        self.actions = actions  # [T, 3] int64

    def __call__(self, bar: Tensor) -> Tensor:
        return self.actions[bar]  # [E, 3]


Policy = Callable[[Tensor], Tensor]  # obs [E, W, S] -> actions [E, 3]
Progress_ = Progress | Console | None
# (key, build, *, label, progress, keep) -> the pass, run to its end: run_eagerly, or backtest_graphs.BacktestGraphs
PassRunner = Callable[..., "SegmentPass"]


def segment_layout(steps: int, episode_length: int, segments: int) -> tuple[int, int]:
    """(K, steps per segment): at most ``segments`` segments of whole episodes covering ``steps`` steps."""
    episodes = max(1, math.ceil(steps / episode_length))
    per_segment = math.ceil(episodes / max(1, min(segments, episodes)))  # episodes per segment
    count = math.ceil(episodes / per_segment)
    return count, min(per_segment * episode_length, steps)


def _progress(progress: Progress_, total: int, label: str):
    """(progress, task, own): a task on the caller's Progress, a transient bar on a terminal Console, or
    nothing."""
    if isinstance(progress, Progress):
        return progress, progress.add_task(label, total=total, status=label), False
    if isinstance(progress, Console) and progress.is_terminal:  # a pipe or a log gets no bar
        bar = Progress(TextColumn("[bold]{task.description}"), MofNCompleteColumn(), BarColumn(),
                       TimeElapsedColumn(), console=progress, transient=True)
        bar.start()
        return bar, bar.add_task(label, total=total), True
    return None, None, False


def run_backtest(
    env: FuturesEnv,
    policy: Policy | BarRule,
    *,
    split: str,
    timestamps: np.ndarray | None,
    progress: Progress_ = None,
) -> Backtest:
    """Run ``policy`` over a sequential env from its first bar to the end of its range, its ``num_envs``
    envs stepping contiguous segments of whole episodes (module docstring). One host sync, at the end (plus
    whatever the policy does). ``progress``: a rich Progress to add a task to, or a Console for a bar."""
    run = run_eagerly(None, lambda: policy_pass(env, policy), label=f"backtest {split}", progress=progress)
    return pass_results(run, split=split, timestamps=timestamps)[0]


def run_eagerly(key: Hashable, build: Callable[[], SegmentPass], *, label: str, progress: Progress_,
                keep: object = None) -> SegmentPass:
    """A :data:`PassRunner`: a new pass (``build()``) stepped eagerly to its end (``key`` and ``keep`` are for
    runners that keep their passes: ``fitdqn.evaluate.backtest_graphs``)."""
    run = build()
    run.start()
    run_steps(run.per, run.step, label=label, progress=progress)
    return run


def policy_pass(env: FuturesEnv, policy: Policy | BarRule) -> SegmentPass:
    """A one-group pass of ``policy`` over ``env``. A policy that draws random numbers says so with a ``seeded``
    attribute, ``(generator, seed)`` (``fitdqn.evaluate.baselines.random_policy``): the pass reseeds it at each
    start and a graph capture registers the generator."""
    return SegmentPass(env, 1, policy_actions(env, policy), seeded=getattr(policy, "seeded", None))


def policy_actions(env: FuturesEnv, policy: Policy | BarRule) -> Callable[[], Tensor]:
    """``act()``: the actions ``[E, 3]`` of ``policy`` at the env's current bars."""
    if isinstance(policy, BarRule):
        return lambda: policy(env.bar)
    return lambda: torch.as_tensor(policy(env.observation()), device=env.device).reshape(env.num_envs, NUM_BRANCHES)


RECORDS = ("pnl", "cost", "reward", "position", "traded")  # the env's per-step outputs a backtest keeps


class SegmentPass:
    """One pass of a sequential env of ``groups`` x K envs from its first bar to the end of its range: env
    ``g * K + k`` is group g's segment k (each group's segments start where a lone K-env pass starts them),
    ``act()`` the actions ``[E, 3]`` of the envs' current bars. The per-step records stay on the device
    (``[per, E]`` each) until :meth:`host`, the one host sync. :meth:`step` has no host sync and no Python state
    (the step it writes is a device counter), so it can be captured in a CUDA graph and replayed."""

    def __init__(self, env: FuturesEnv, groups: int, act: Callable[[], Tensor],
                 seeded: tuple[torch.Generator, int] | None = None) -> None:
        if not env.sequential:
            raise ValueError("a backtest needs a sequential env (FuturesEnv(..., sequential=True))")
        self.steps_total = env.last_bar - env.first_bar
        K, per = segment_layout(self.steps_total, env.episode_length, env.num_envs // groups)
        if groups < 1 or K * groups != env.num_envs:
            raise ValueError(f"an env of {env.num_envs} envs for {groups} group(s) of {K} segments: build it with "
                             "groups x segment_layout() envs")
        self.env, self.groups, self.act, self.segments, self.per = env, groups, act, K, per
        self.seeded = seeded  # (the policy's generator, its seed): reseeded at each start
        self.generators = (env.generator,) + ((seeded[0],) if seeded is not None else ())  # what the step draws from
        E, device = env.num_envs, env.device
        dtype = env.prices.dtype  # the env's P&L is float32: recorded as such, widened to float64 on the host
        self.record = {k: torch.empty((per, E), dtype=dtype, device=device) for k in (*RECORDS, "target")}
        self.record["exit"] = torch.empty((per, E), dtype=torch.uint8, device=device)
        self.record["bar"] = torch.empty((per, E), dtype=torch.int64, device=device)
        self.index = torch.zeros((), dtype=torch.int64, device=device)  # the step being written
        self.first_bars = env.first_bar + (torch.arange(K, device=device) * per).repeat(groups)  # [E]

    def start(self) -> None:
        """Every env flat at its segment's first episode start; the records written from step 0 again; the
        policy's generator at its seed."""
        if self.seeded is not None:
            self.seeded[0].manual_seed(self.seeded[1])
        self.env.reset()
        self.env.bar.copy_(self.first_bars)
        self.index.zero_()

    def step(self) -> None:
        """act -> env step -> the step's records (at ``index``), then the next index."""
        env = self.env
        action = self.act()  # [E, 3]
        out = env.step(action)
        values = {name: out[name] for name in (*RECORDS, "target", "exit", "bar")}  # [E] each
        at = self.index.view(1)  # a device index (indexing with a 0-dim tensor would read it on the host)
        for name, value in values.items():
            record = self.record[name]
            record.index_copy_(0, at, value.to(record.dtype).unsqueeze(0))
        self.index.add_(1)

    def host(self) -> dict[str, np.ndarray]:
        """Each group's stitched per-step records on the host (``[groups, steps]`` each: pnl, cost, reward,
        position, traded, target, exit, bar). One host sync."""
        steps, per, E, device = self.steps_total, self.per, self.env.num_envs, self.env.device
        # stitch: group g's segment k is column g * K + k; its first min(per, steps - k * per) steps, in order
        step_of = torch.arange(steps, device=device)
        flat = ((step_of % per) * E + step_of // per)[None, :] + (torch.arange(self.groups, device=device)
                                                                  * self.segments)[:, None]
        # host sync: the backtest's results ([groups, steps] flat indices into [S, E])
        return {k: v.reshape(-1)[flat].cpu().numpy() if v.dtype in (torch.uint8, torch.int64)
                else v.reshape(-1)[flat].double().cpu().numpy() for k, v in self.record.items()}


def run_steps(count: int, step: Callable[[], None], *, label: str, progress: Progress_) -> None:
    """``step()`` ``count`` times under a progress task (``progress``: a rich Progress, a Console for a bar, or
    None)."""
    bar_progress, task, own = _progress(progress, count, label)
    try:
        for _ in range(count):
            step()
            if bar_progress is not None:
                bar_progress.advance(task)
    finally:
        if own:
            bar_progress.stop()
        elif bar_progress is not None:
            bar_progress.remove_task(task)


def _assemble(env: FuturesEnv, host: dict[str, np.ndarray], prices: np.ndarray, *, split: str,
              timestamps: np.ndarray | None, segments: int) -> Backtest:
    """A Backtest from one policy's stitched per-step records on the host (``[steps]`` each: pnl, cost, reward,
    position, traded, target, exit, bar) and the env's ``prices [T, 4]`` as float64."""
    bars_np = host["bar"]
    steps = bars_np.shape[0]
    fill_bars = bars_np + 1
    c = env.contract
    hold = env.max_contracts
    buy_and_hold = np.zeros(steps + 1)
    buy_and_hold[1:] = hold * ((prices[fill_bars, 3] - prices[fill_bars[0], 0] - c.slippage) * c.multiplier
                               - c.commission)
    buy_and_hold[-1] -= hold * c.cost_per_side
    stamps = (
        np.asarray(timestamps)[fill_bars]
        if timestamps is not None
        else np.full(steps, np.datetime64("NaT", "ns"))
    )
    pnl = host["pnl"]
    return Backtest(
        split=split, contract=c, decision_bar=bars_np, timestamp=stamps, pnl=pnl, cost=host["cost"],
        reward=host["reward"], target=host["target"], position=host["position"], traded=host["traded"],
        exit=host["exit"], equity=np.concatenate([[0.0], np.cumsum(pnl)]), buy_and_hold=buy_and_hold,
        hold_contracts=hold, segments=segments,
    )


def rules_pass(env: FuturesEnv, rules: Sequence[BarRule]) -> SegmentPass:
    """The pass of P rules in one env of P x K envs: group p is rule p."""
    P = len(rules)
    if P < 1 or env.num_envs % P:
        raise ValueError(f"an env of {env.num_envs} envs for {P} rules: build it with P x K envs")
    table = torch.stack([r.actions.to(env.device) for r in rules])  # [P, T, 3] int64
    rule_of = torch.arange(P, device=env.device).repeat_interleave(env.num_envs // P)  # [E] the rule of each env
    return SegmentPass(env, P, lambda: table[rule_of, env.bar])


def pass_results(run: SegmentPass, *, split: str, timestamps: np.ndarray | None) -> list[Backtest]:
    """One Backtest per group of a finished pass (per rule of a rules pass), in order."""
    env = run.env
    host = run.host()
    prices = env.prices.double().cpu().numpy()
    return [_assemble(env, {k: v[p] for k, v in host.items()}, prices, split=split, timestamps=timestamps,
                     segments=run.segments) for p in range(run.groups)]


@dataclass(frozen=True)
class SplitSizes:
    """What a backtest's env is built with: the run's resolved ``config`` (as the agent was trained),
    ``segments``, the most segments it steps in parallel, and ``levels``, branch 0's contracts where not the
    config's (an ensemble's means)."""

    config: Config
    segments: int
    levels: tuple[float, ...] | None = None

    @classmethod
    def of_config(cls, config: Config, market: Market) -> SplitSizes:
        """The sizes of a :class:`fitdqn.config.Config` (the values it leaves to the data resolved on ``market``'s
        training split, as the agent was trained)."""
        if needs_resolving(config.market):
            config, _ = resolve_for_market(config, market)
        return cls(config=config, segments=config.evaluate.segments)

    def layout(self, market: Market, split: str) -> int:
        """K: the segments of whole episodes a lone backtest of ``split`` steps (:func:`segment_layout`)."""
        s = market.split(split)
        steps = s.stop - 1 - market.first_bar(s, self.config.net.window)
        return segment_layout(steps, self.config.market.episode_length, self.segments)[0]


def split_env(market: Market, split: str, num_envs: int, sizes: SplitSizes, goal: float | None) -> FuturesEnv:
    """A sequential env of ``num_envs`` envs over ``split``, its goal fixed (None: the middle of the training
    goal range)."""
    env = FuturesEnv.from_config(sizes.config, split, market=market, num_envs=num_envs, levels=sizes.levels,
                                 sequential=True, seed=0)  # a sequential env draws no start bars; the goal is set below
    g = 0.5 * (env.goal_range[0] + env.goal_range[1]) if goal is None else float(goal)
    env.goal_range = (g, g)
    return env


def evaluate_policy(policy: Policy | BarRule, market: Market, split: str, sizes: SplitSizes, *,
                    goal: float | None = None, progress: Progress_ = None, runner: PassRunner = run_eagerly,
                    key: Hashable = None) -> Backtest:
    """Backtest ``policy`` over a whole split of ``market`` from its first valid bar to its end, in at most
    ``sizes.segments`` parallel segments. ``goal`` is the target shown in the state (None: the middle of the
    training goal range). ``runner``: how the pass runs (eagerly; or graph replays, where ``key`` names the
    policy: a runner that keeps passes replays the pass it first built under the same key, split and sizes)."""
    name = market.split(split).name
    run = runner(None if key is None else ("policy", key, id(market), split, sizes, goal),
                 lambda: policy_pass(split_env(market, split, sizes.layout(market, split), sizes, goal), policy),
                 label=f"backtest {name}", progress=progress, keep=market)
    return pass_results(run, split=name, timestamps=market.bars["timestamp"].to_numpy())[0]


def evaluate_rules(rules: Sequence[BarRule], market: Market, split: str, sizes: SplitSizes, *,
                   goal: float | None = None, progress: Progress_ = None, runner: PassRunner = run_eagerly
                   ) -> list[Backtest]:
    """:func:`evaluate_policy` for every rule of ``rules`` (in order), the rules batched into passes of
    :func:`rules_pass`: each rule keeps the K segments of its lone backtest, and a pass steps at
    most ``segments`` envs (``segments // K`` rules; the env state is a few floats per env). A pass is keyed by
    its rules' names for a ``runner`` that keeps passes."""
    if not rules:
        return []
    count = sizes.layout(market, split)
    per_pass = max(1, sizes.segments // count)  # rules per pass
    stamps = market.bars["timestamp"].to_numpy()
    name = market.split(split).name
    out: list[Backtest] = []
    for first in range(0, len(rules), per_pass):
        chunk = list(rules[first:first + per_pass])
        run = runner(("rules", tuple(r.name for r in chunk), id(market), split, sizes, goal),
                     lambda chunk=chunk: rules_pass(split_env(market, split, len(chunk) * count, sizes, goal), chunk),
                     label=f"rules {name}", progress=progress, keep=market)
        out += pass_results(run, split=name, timestamps=stamps)
    return out


def evaluate_config(
    policy: Policy | BarRule,
    config,
    split: str,
    *,
    market: Market | None = None,
    device=None,
    goal: float | None = None,
    progress: Progress_ = None,
    runner: PassRunner = run_eagerly,
    key: Hashable = None,
) -> Backtest:
    """:func:`evaluate_policy` with the sizes of a :class:`fitdqn.config.Config`."""
    if market is None:
        market = load_market(config.market, window=config.net.window, device=device)
    return evaluate_policy(policy, market, split, SplitSizes.of_config(config, market), goal=goal,
                           progress=progress, runner=runner, key=key)


def evaluate_rules_config(
    rules: Sequence[BarRule],
    config,
    split: str,
    *,
    market: Market,
    goal: float | None = None,
    progress: Progress_ = None,
    runner: PassRunner = run_eagerly,
) -> list[Backtest]:
    """:func:`evaluate_rules` with the sizes of a :class:`fitdqn.config.Config`, on a loaded ``market``."""
    return evaluate_rules(rules, market, split, SplitSizes.of_config(config, market), goal=goal, progress=progress,
                          runner=runner)
