"""Environment throughput: the vectorised FuturesEnv with a policy forward in the loop vs gymnasium, one
episode at a time on the CPU.

Rows:

* ``vector``: ``obs = env.observation(); action = policy(obs); env.step(action)`` with E parallel episodes on
  --device, eager, for each --sizes E (1,024 ... 65,536 by default);
* ``vector+graph`` (CUDA only): the same loop captured once in a CUDA graph and replayed;
* ``env-only`` (and ``env-only+graph`` on CUDA): the same without the policy (fixed random actions), to show
  what the env itself costs;
* ``gym``: ``gymnasium.make("fitdqn/Futures-v0")`` on the CPU, one episode at a time, the same policy on a
  batch of one (numpy in and out; the way popular trading-RL libraries are run), resets included;
* ``gym env-only``: the same with ``action_space.sample()`` instead of the policy.

The policy is ``fitdqn.learn.learner.Learner.act`` (the real Q network, greedy) when it can be built, else a
small MLP over the flattened observation (said in the output). Env steps/s counts one step of one episode.
Prints a table and writes JSON to --out.

    python benchmarks/bench_env.py --out bench_env.json                                   # GPU defaults
    python benchmarks/bench_env.py --device cpu --sizes 64 256 --steps 20 --gym-steps 200  # CPU smoke
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch
from _common import seconds_of, write_json
from torch import nn

from fitdqn.config import Config, with_overrides
from fitdqn.device.graphs import capture_graph
from fitdqn.device.probe import resolve_device
from fitdqn.market.env import FuturesEnv
from fitdqn.market.layout import STATE_DIM
from fitdqn.market.loader import Market, load_market
from fitdqn.resolve import resolve_for_market


class MLPPolicy(nn.Module):
    """Fallback policy: flatten [E, W, S] -> 256 -> 256 -> per-branch argmax."""

    def __init__(self, window: int, branches: tuple[int, ...]) -> None:
        super().__init__()
        self.branches = tuple(branches)
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(window * STATE_DIM, 256),
            nn.ReLU(),
            nn.Linear(256, 256),
            nn.ReLU(),
            nn.Linear(256, sum(self.branches)),
        )

    @torch.no_grad()
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        logits = self.net(obs)  # [E, sum(branches)]
        return torch.stack([chunk.argmax(-1) for chunk in logits.split(self.branches, dim=-1)], dim=-1)


def make_policy(config: Config, device: torch.device, kind: str):
    """(policy callable obs -> actions, name)."""
    if kind in ("auto", "learner"):
        try:
            from fitdqn.learn.learner import Learner

            learner = Learner(config, STATE_DIM, device)
            epsilon = torch.zeros((), device=device)

            @torch.no_grad()
            def act(obs: torch.Tensor) -> torch.Tensor:
                return learner.act(obs, epsilon)

            act(torch.zeros(2, config.net.window, STATE_DIM, device=device))  # it runs
            return act, "learner"
        except Exception as error:  # noqa: BLE001 - any failure falls back to the MLP, and says so
            if kind == "learner":
                raise
            print(f"(Learner not usable here: {type(error).__name__}: {error}; using the MLP policy)")
    mlp = MLPPolicy(config.net.window, config.net.branches).to(device).eval()
    return mlp, "mlp"


def on_device(market: Market, device: torch.device) -> Market:
    import dataclasses

    return dataclasses.replace(
        market,
        features=market.features.to(device),
        prices=market.prices.to(device),
        atr=market.atr.to(device),
    )


def bench_vector(
    market: Market,
    config: Config,
    policy,
    num_envs: int,
    steps: int,
    device: torch.device,
    graph: bool,
    with_policy: bool = True,
) -> dict:
    env = FuturesEnv.from_config(config, "train", market=market, num_envs=num_envs, seed=0)
    actions = torch.randint(0, 5, (num_envs, 3), device=device)

    def one_step() -> None:
        action = policy(env.observation()) if with_policy else actions
        env.step(action)

    for _ in range(3):  # warm-up (allocator, cuBLAS handles, lazy init)
        one_step()
    run = one_step
    if graph:
        cuda_graph, _ = capture_graph(one_step, device, warmup=3, generators=(env.generator,))
        run = cuda_graph.replay
        run()
    def steps_in_a_row() -> None:
        for _ in range(steps):
            run()

    seconds = seconds_of(steps_in_a_row, device)
    mode = ("vector" if with_policy else "env-only") + ("+graph" if graph else "")
    return {
        "mode": mode,
        "device": str(device),
        "num_envs": num_envs,
        "steps": steps,
        "seconds": seconds,
        "env_steps_per_s": num_envs * steps / seconds,
        "ms_per_step": 1e3 * seconds / steps,
    }


def bench_gym(market: Market, config: Config, policy, steps: int) -> dict:
    """One episode at a time through gymnasium on the CPU; ``policy=None``: random actions (env cost only)."""
    import gymnasium

    import fitdqn.market  # noqa: F401  (registers fitdqn/Futures-v0)

    env = gymnasium.make("fitdqn/Futures-v0", config=config, market=market, device="cpu")
    env.action_space.seed(0)
    obs, _ = env.reset(seed=0)
    episodes = 0
    start = time.perf_counter()
    for _ in range(steps):
        if policy is None:
            action = env.action_space.sample()
        else:
            action = policy(torch.as_tensor(obs)[None])[0].numpy()  # batch of one
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            obs, _ = env.reset()
            episodes += 1
    seconds = time.perf_counter() - start
    return {
        "mode": "gym" if policy is not None else "gym env-only",
        "device": "cpu",
        "num_envs": 1,
        "steps": steps,
        "seconds": seconds,
        "env_steps_per_s": steps / seconds,
        "ms_per_step": 1e3 * seconds / steps,
        "episodes": episodes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1024, 4096, 16384, 65536],
        help="parallel episodes E for the vectorised rows",
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per vectorised row")
    parser.add_argument("--gym-steps", type=int, default=3000, help="timed steps of the gymnasium baseline")
    parser.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu', 'cuda', 'cuda:N'")
    parser.add_argument("--data", default="sp500", help="market.data for the bars")
    parser.add_argument("--policy", default="auto", choices=["auto", "learner", "mlp"])
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph rows")
    parser.add_argument("--out", default="bench_env.json", help="JSON results path")
    args = parser.parse_args()

    device = resolve_device(args.device)
    config = with_overrides(Config(), {"market.data": args.data})
    market_cpu = load_market(config.market, window=config.net.window, device="cpu")
    config, _ = resolve_for_market(config, market_cpu)  # the reward scale and sizing target, as a run derives them
    market = on_device(market_cpu, device)
    policy, policy_name = make_policy(config, device, args.policy)
    rows = []
    for num_envs in args.sizes:
        graphs = (False, True) if device.type == "cuda" and not args.no_graph else (False,)
        for graph, with_policy in [(g, p) for p in (True, False) for g in graphs]:
            try:
                row = bench_vector(market, config, policy, num_envs, args.steps, device, graph, with_policy)
            except Exception as error:  # noqa: BLE001 - a failing row is reported, the others still run
                mode = ("vector" if with_policy else "env-only") + ("+graph" if graph else "")
                row = {
                    "mode": mode,
                    "device": str(device),
                    "num_envs": num_envs,
                    "steps": 0,
                    "seconds": 0.0,
                    "env_steps_per_s": float("nan"),
                    "ms_per_step": float("nan"),
                    "error": f"{type(error).__name__}: {str(error)[:300]}",
                }
                print(f"({mode} E={num_envs} failed: {row['error']})")
            rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cpu_policy, _ = make_policy(config, torch.device("cpu"), policy_name)
    gym_row = bench_gym(market_cpu, config, cpu_policy, args.gym_steps)
    rows.append(gym_row)
    rows.append(bench_gym(market_cpu, config, None, args.gym_steps))
    for row in rows:
        row["speedup_vs_gym"] = row["env_steps_per_s"] / gym_row["env_steps_per_s"]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"fitdqn env benchmark: {args.data}, window {config.net.window}, policy {policy_name}, {name}, "
        f"torch {torch.__version__}"
    )
    print(f"{'mode':<14}{'device':<9}{'envs':>8}{'steps':>7}{'ms/step':>10}{'env steps/s':>15}{'x gym':>10}")
    for r in rows:
        print(
            f"{r['mode']:<14}{r['device']:<9}{r['num_envs']:>8}{r['steps']:>7}{r['ms_per_step']:>10.3f}"
            f"{r['env_steps_per_s']:>15,.0f}{r['speedup_vs_gym']:>10.1f}"
        )
    result = {
        "benchmark": "env",
        "data": args.data,
        "window": config.net.window,
        "policy": policy_name,
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rows": rows,
        "numpy": np.__version__,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
