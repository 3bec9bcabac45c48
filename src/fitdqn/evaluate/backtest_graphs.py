"""The agent's backtests on CUDA as graph replays: one CUDA graph per split, captured at its first backtest.

A backtest steps a few envs (one per segment) for a few hundred bars, and each eager step is a few hundred
small kernel launches (the network's forward at batch K, the env's step, the records): about 1 s a backtest on
an H200 whatever the GPU, the launches' cost. Here the step of a split's :class:`SegmentPass` (act -> env step ->
records at a device counter) is captured once and replayed ``per`` times at every later backtest of that split,
the env reset in place before each. The graph reads the policy's parameters where they live, so a later backtest
backtests the network as it is then (the optimizer updates it in place).

Memory: each graph is captured into ``pool()``, the collector graph's private pool. The collector's step at
``collect.num_envs`` envs runs the same observe -> act -> env step at a batch at least the backtest's K, and its
graph's intermediates are free between its replays, so the backtest's step takes its blocks from pages the plan
already holds for the collector (:func:`fitdqn.plan.build.collector_component`). ``grown_bytes`` says how much a
capture grew that pool anyway (0 on the H200 for the default config: ``tests/evaluate/test_cuda_backtest.py``).
The two graphs never run at once (one stream), which is what sharing a pool asks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fitdqn.device.graphs import capture_graph, pool_bytes
from fitdqn.evaluate.backtest import (
    Backtest,
    Policy,
    Progress_,
    SegmentPass,
    SplitSizes,
    assemble,
    policy_actions,
    split_env,
)
from fitdqn.market.loader import Market

WARMUP = 2  # eager steps before the capture (each a real step of the first backtest)


class BacktestGraphs:
    """Backtests of one ``policy`` on CUDA, each split's step a graph replay (module docstring); ``pool()``: the
    pool to capture into (None: a private pool of its own), ``stream``: the capture stream."""

    def __init__(self, policy: Policy, stream: torch.cuda.Stream | None,
                 pool: Callable[[], tuple | None] = lambda: None) -> None:
        self.policy, self.stream, self.pool = policy, stream, pool
        self.passes: dict[tuple, tuple[Market, SegmentPass, torch.cuda.CUDAGraph | None]] = {}
        self.grown_bytes = 0  # what the captures added to the pool they were captured into

    def backtest(self, market: Market, split: str, sizes: SplitSizes, *, goal: float | None = None,
                 progress: Progress_ = None) -> Backtest:
        """:func:`fitdqn.evaluate.backtest.evaluate_policy` of the policy, its steps graph replays after the
        split's first backtest (which captures the graph; a split of fewer than WARMUP + 2 steps stays eager)."""
        key = (id(market), split, sizes, goal)  # the entry keeps the market alive: its id stays its own
        if key not in self.passes:
            env = split_env(market, split, sizes.layout(market, split), sizes, goal)
            run = SegmentPass(env, 1, policy_actions(env, self.policy))
            run.start()
            graph = self._capture(run) if run.per >= WARMUP + 2 else None
            self.passes[key] = (market, run, graph)
            done = WARMUP if graph is not None else 0
        else:
            _, run, graph = self.passes[key]
            run.start()
            done = 0
        name = market.split(split).name
        run.steps(run.per - done, graph.replay if graph is not None else run.step, label=f"backtest {name}",
                  progress=progress)
        env = run.env
        return assemble(env, {k: v[0] for k, v in run.host().items()}, env.prices.double().cpu().numpy(),
                        split=name, timestamps=market.bars["timestamp"].to_numpy(), segments=run.segments)

    def _capture(self, run: SegmentPass) -> torch.cuda.CUDAGraph:
        """The pass's step captured after WARMUP real steps, into ``pool()``."""
        pool = self.pool()
        before = pool_bytes(pool) if pool is not None else 0
        graph, _ = capture_graph(run.step, run.env.device, self.stream, warmup=WARMUP,
                                 generators=(run.env.generator,), pool=pool)
        if pool is not None:
            self.grown_bytes += pool_bytes(pool) - before
        return graph
