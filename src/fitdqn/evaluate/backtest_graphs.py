"""Backtests on CUDA as graph replays: each backtest pass's step captured once, at its first run.

A backtest steps a few envs (one per segment) for a few hundred bars, and each eager step is a few hundred
small kernel launches (a network's forward at batch K or a rule's table look-up, the env's step, the records):
about 1.5 s a backtest on an H200, bound by the launches, not by the GPU. :class:`BacktestGraphs` is a
:data:`~fitdqn.evaluate.backtest.PassRunner` that keeps each pass it builds under its key (the policy's name, the
market, the split, the sizes): the pass's step (:meth:`~fitdqn.evaluate.backtest.SegmentPass.step`: act -> env
step -> records at a device counter) is captured at its first run and replayed ``per`` times at every later one,
the env reset in place (and the policy's generator reseeded) before each. A network's graph reads its parameters
where they live, so a later backtest backtests the network as it is then (the optimizer updates it in place).
A replay launches the eager step's kernels with the eager step's random offsets, so the results are the eager
pass's (``tests/evaluate/test_backtest_graphs.py``, bit for bit on an H200).

Memory: each graph is captured into ``pool()``, the collector graph's private pool. The collector's step at
``collect.num_envs`` envs runs the same observe -> act -> env step at a batch at least a backtest's K, and its
graph's intermediates are free between its replays, so a backtest's step takes its blocks from pages the plan
already holds for the collector (:func:`fitdqn.plan.build.collector_component`). ``grown_bytes`` says how much the
captures grew that pool anyway (0 for a default run on the H200, and for the validation graph on every card of
``benchmarks/budget_sweep.py``). The graphs never run at once (one stream), which is what sharing a pool asks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from fitdqn.device.graphs import capture_graph, pool_bytes
from fitdqn.evaluate.backtest import Progress_, SegmentPass, run_eagerly, run_steps

WARMUP = 2  # eager steps before the capture (each a real step of the first run)


class BacktestGraphs:
    """A pass runner that keeps its passes, each step a graph replay (module docstring); ``pool()``: the pool to
    capture into (None: a private pool of each graph's own), ``stream``: the capture stream."""

    def __init__(self, stream: torch.cuda.Stream | None, pool: Callable[[], tuple | None] = lambda: None) -> None:
        self.stream, self.pool = stream, pool
        self.passes: dict[Hashable, tuple[object, SegmentPass, torch.cuda.CUDAGraph | None]] = {}
        self.grown_bytes = 0  # what the captures added to the pool they were captured into

    def __call__(self, key: Hashable, build: Callable[[], SegmentPass], *, label: str, progress: Progress_,
                 keep: object = None) -> SegmentPass:
        """The pass of ``key`` run to its end: built (by ``build()``) and captured at the key's first run (a pass
        of fewer than WARMUP + 2 steps stays eager), replayed after; ``keep``: an object the key names by its id
        (the market), kept alive with the pass. ``key = None``: an eager pass, not kept."""
        if key is None:
            return run_eagerly(key, build, label=label, progress=progress)
        if key in self.passes:
            _, run, graph = self.passes[key]
            run.start()
            done = 0
        else:
            run = build()
            run.start()
            graph = self._capture(run) if run.per >= WARMUP + 2 else None
            self.passes[key] = (keep, run, graph)
            done = WARMUP if graph is not None else 0
        run_steps(run.per - done, graph.replay if graph is not None else run.step, label=label, progress=progress)
        return run

    def _capture(self, run: SegmentPass) -> torch.cuda.CUDAGraph:
        """The pass's step captured after WARMUP real steps, into ``pool()``."""
        pool = self.pool()
        before = pool_bytes(pool) if pool is not None else 0
        graph, _ = capture_graph(run.step, run.env.device, self.stream, warmup=WARMUP, generators=run.generators,
                                 pool=pool)
        if pool is not None:
            self.grown_bytes += pool_bytes(pool) - before
        return graph
