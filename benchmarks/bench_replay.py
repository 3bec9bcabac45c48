"""Replay throughput: sample a batch (n-step + HER + weights) and update its priorities.

For each capacity: fill the buffer through ``write`` (lockstep steps of --num-envs rows), then time
``sample(B) + update_priorities`` eagerly and replayed from a CUDA graph (CUDA only); the same work through a
plain-torch binary sum tree (:class:`PlainPrioritizedReplay`, over the same rows); and TorchRL's
``PrioritizedReplayBuffer`` on ``LazyTensorStorage(device=...)`` with rows of the same fields when torchrl is
installed (its tree on the storage's device, or, where its build has no CUDA tree, its C++ tree on the host).
Median over --iters of per-iteration times (CUDA events on CUDA, perf_counter on CPU).
Prints a table and writes JSON to --out.

    python benchmarks/bench_replay.py --capacities 1000000 10000000 --batch 8192 --out bench_replay.json
    python benchmarks/bench_replay.py --device cpu --capacities 10000 --batch 256 --iters 3   # smoke
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Callable

import torch
from _common import median_ms, write_json

from fitdqn.device.graphs import capture_graph
from fitdqn.device.probe import resolve_device
from fitdqn.ops import sum_tree as sum_tree_ops
from fitdqn.ops.replay_gather import GoalCrossing
from fitdqn.provenance import code_commit
from fitdqn.replay import ReplayBuffer
from fitdqn.transitions import FieldSpec

GOAL_COLUMN = 5


def transition_spec(agent_dim: int) -> dict[str, FieldSpec]:
    """The DESIGN.md transition fields (agent_dim = Fa)."""
    return {
        "bar": FieldSpec((), torch.int32),
        "agent": FieldSpec((agent_dim,), torch.float32),
        "action": FieldSpec((3,), torch.uint8),
        "reward": FieldSpec((), torch.float32),
        "achieved": FieldSpec((), torch.float32),
        "next_agent": FieldSpec((agent_dim,), torch.float32),
        "episode_step": FieldSpec((), torch.int32),
        "flags": FieldSpec((), torch.uint8),
    }


goal_reward = GoalCrossing(0.5)  # the env's kind of bonus (the replay's gather operator takes it by its bonus)


def fill(buffer: ReplayBuffer, episode_length: int, agent_dim: int, generator: torch.Generator) -> None:
    """Write capacity / E lockstep steps of random rows (episodes of episode_length, rare terminals)."""
    E, device = buffer.num_envs, buffer.device
    achieved = torch.zeros(E, device=device)
    for t in range(buffer.capacity // E):
        step = t % episode_length
        reward = torch.randn(E, device=device, generator=generator) * 0.1
        achieved = achieved * (step != 0) + reward
        terminal = torch.rand(E, device=device, generator=generator) < 0.001
        flags = terminal.to(torch.uint8) | (2 * (step == episode_length - 1))
        buffer.write({
            "bar": torch.randint(8, 100_000, (E,), device=device, generator=generator, dtype=torch.int32),
            "agent": torch.randn(E, agent_dim, device=device, generator=generator),
            "action": torch.randint(0, 5, (E, 3), device=device, generator=generator, dtype=torch.uint8),
            "reward": reward,
            "achieved": achieved,
            "next_agent": torch.randn(E, agent_dim, device=device, generator=generator),
            "episode_step": torch.full((E,), step, device=device, dtype=torch.int32),
            "flags": flags.to(torch.uint8),
        })


def replay_step(buffer: ReplayBuffer, batch: int, beta: torch.Tensor) -> Callable[[], dict]:
    def step() -> dict:
        sample = buffer.sample(batch, beta)
        buffer.update_priorities(sample["index"], sample["reward"].abs())  # stands in for |TD error|
        return sample  # the step's output: the batch

    return step


def graphed(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """Capture ``step`` in a CUDA graph the way the trainer does and return its replay."""
    return capture_graph(step, device, warmup=3)[0].replay


def profile(functions: dict[str, Callable[[], None]], device: torch.device) -> None:
    """Kernel table of 5 calls of each function (graph replays show as one launch each)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, fn in functions.items():
        fn()
        torch.cuda.synchronize(device)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize(device)
        print(f"--- profile: {name} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70))


def bench_fitdqn(args, capacity: int, device: torch.device, prioritized: bool) -> list[dict]:
    """fitdqn's buffer, eager and graphed: the draw and the priority update are the operators of
    ``fitdqn.ops.prioritized``, the gather ``fitdqn::replay_gather`` (Triton kernels on CUDA, the torch maths on the
    CPU)."""
    rows = []
    spec = transition_spec(args.agent_dim)
    buffer = ReplayBuffer(
        spec, capacity, args.num_envs, n_step=3, gamma=0.99, episode_length=args.episode_length,
        goal_column=GOAL_COLUMN, goal_reward=goal_reward, prioritized=prioritized, alpha=0.6, priority_eps=1e-6,
        her=True, her_k=4, tree_fanout=args.fanout, device=device,
    )
    generator = torch.Generator(device).manual_seed(0)
    fill(buffer, args.episode_length, args.agent_dim, generator)
    beta = torch.tensor(0.4, device=device, dtype=torch.float64)
    step = replay_step(buffer, args.batch, beta)
    name = f"fitdqn {'prioritized' if prioritized else 'uniform'}"
    modes = [("eager", step)]
    if device.type == "cuda" and not args.no_graph:
        try:
            modes.append(("cuda graph", graphed(step, device)))
        except Exception as error:  # report, keep benchmarking
            rows.append({"impl": name, "mode": "cuda graph", "capacity": capacity,
                         "error": repr(error)[:300]})
    if args.profile and prioritized and device.type == "cuda":
        profile(dict(modes), device)
    for mode, fn in modes:
        seconds = median_ms(fn, device, args.iters, args.warmup) / 1e3
        rows.append({"impl": name, "mode": mode, "capacity": capacity, "batch": args.batch,
                     "fanout": args.fanout if prioritized else None,
                     "ms_per_iter": seconds * 1e3, "samples_per_s": args.batch / seconds})
    if args.parts and prioritized:
        index = buffer.sample(args.batch, beta)["index"]
        parts = {
            "draw (descent + weights)": lambda: buffer.sampler.draw(
                torch.rand(args.batch, device=device, dtype=torch.float64), beta),
            "sample (all)": lambda: buffer.sample(args.batch, beta),
            "gather (n-step+HER)": lambda: buffer.gather(index),
            "update priorities": lambda: buffer.update_priorities(index, torch.ones_like(index,
                                                                                         dtype=torch.float32)),
        }
        for part, fn in parts.items():
            fn_graph = fn
            if device.type == "cuda" and not args.no_graph:
                try:
                    fn_graph = graphed(fn, device)
                except Exception:
                    fn_graph = fn
            seconds = median_ms(fn_graph, device, args.iters, args.warmup) / 1e3
            label = f"  part: {part}"
            rows.append({"impl": label, "mode": "cuda graph" if fn_graph is not fn else "eager",
                         "capacity": capacity, "batch": args.batch, "ms_per_iter": seconds * 1e3,
                         "samples_per_s": args.batch / seconds})
    return rows


class PlainPrioritizedReplay:
    """Prioritized replay as a user writes it in plain torch over the same storage (``fields``, lockstep rows):
    a binary sum tree in one float64 tensor (node 1 the root, leaf i at ``size + i``), stratified sampling by a
    descent of ``log2(size)`` levels, importance weights, the n-step return and HER 'future' relabelling from
    the rows by indexing, and a priority update that writes the leaves and recomputes their ancestors level by
    level. The same maths as ``fitdqn.replay`` (n-step stops at the episode's end or a terminal step; a goal
    from a future step of the same episode with probability k / (k + 1)); no fused or custom kernels.
    """

    def __init__(self, fields: dict[str, torch.Tensor], written: torch.Tensor, num_envs: int, leaves: torch.Tensor,
                 n_step: int, gamma: float, episode_length: int, goal_column: int, goal_reward,
                 alpha: float = 0.6, eps: float = 1e-6, her_k: int = 4) -> None:
        self.fields, self.written, self.num_envs = fields, written, num_envs
        self.capacity = leaves.shape[0]
        self.steps = self.capacity // num_envs
        self.depth = max(1, math.ceil(math.log2(self.capacity)))
        self.size = 1 << self.depth
        device = leaves.device
        self.tree = torch.zeros(2 * self.size, dtype=torch.float64, device=device)  # [2 * size]
        self.tree[self.size:self.size + self.capacity] = leaves
        for level in range(self.depth - 1, -1, -1):  # build: node i = 2i + 2i+1
            lo, hi = 1 << level, 2 << level
            self.tree[lo:hi] = self.tree[2 * lo:2 * hi:2] + self.tree[2 * lo + 1:2 * hi:2]
        self.n_step, self.episode_length, self.goal_column = n_step, episode_length, goal_column
        self.goal_reward, self.alpha, self.eps = goal_reward, alpha, eps
        self.relabel_probability = her_k / (her_k + 1.0)
        self.offsets = torch.arange(n_step, device=device) * num_envs  # [n]
        self.powers = gamma ** torch.arange(n_step + 1, device=device, dtype=torch.float32)  # [n + 1]

    def sample(self, batch: int, beta: torch.Tensor) -> dict[str, torch.Tensor]:
        uniform = torch.rand(batch, 3, device=self.tree.device, dtype=torch.float64)  # [B, 3]
        return self.from_uniforms(uniform, beta)

    def locate(self, mass: torch.Tensor) -> torch.Tensor:
        """The leaf whose prefix-sum range holds each ``mass [B]`` (f64), by descent from the root."""
        node = torch.ones(mass.shape, dtype=torch.int64, device=mass.device)  # [B]
        for _ in range(self.depth):
            left = self.tree[2 * node]
            right = mass > left
            mass = torch.where(right, mass - left, mass)
            node = 2 * node + right.long()
        return (node - self.size).clamp(max=self.capacity - 1)  # [B]

    def from_uniforms(self, uniform: torch.Tensor, beta: torch.Tensor) -> dict[str, torch.Tensor]:
        """``uniform [B, 3]`` f64: stratum position, HER future step, HER coin."""
        device, batch = self.tree.device, uniform.shape[0]
        total = self.tree[1]
        mass = (torch.arange(batch, device=device, dtype=torch.float64) + uniform[:, 0]) / batch * total  # [B]
        index = self.locate(mass)
        probability = self.tree[self.size + index] / total
        count = torch.clamp(torch.clamp(self.written, max=self.steps) - (self.n_step - 1), min=0) * self.num_envs
        weight = (count * probability).pow(-beta)
        out = self.gather(index, uniform[:, 1:])
        out["weight"] = (weight / weight.max()).float()
        return out

    def gather(self, index: torch.Tensor, uniform: torch.Tensor) -> dict[str, torch.Tensor]:
        f, E = self.fields, self.num_envs
        agent = f["agent"][index]  # [B, Fa]
        goal = agent[:, self.goal_column]
        # HER 'future': a step of the same episode at or after this one, already written
        newest = torch.remainder(self.written - 1, self.steps)
        ahead = torch.remainder(newest - index // E, self.steps)  # [B]
        episode_step = f["episode_step"][index].long()
        span = torch.minimum(self.episode_length - 1 - episode_step, ahead).clamp(min=0)
        offset = torch.minimum((uniform[:, 0] * (span + 1)).long(), span)
        future = torch.remainder(index + offset * E, self.capacity)
        same = f["episode_step"][future].long() == episode_step + offset
        future_goal = torch.where(same, f["achieved"][future], f["achieved"][index])
        goal = torch.where(uniform[:, 1] < self.relabel_probability, future_goal, goal)  # [B]
        # n-step return up to the episode's end or a terminal step
        slots = torch.remainder(index[:, None] + self.offsets, self.capacity)  # [B, n]
        flags = f["flags"][slots]
        ended = (flags & 3) != 0
        alive = (ended.cumsum(1) - ended.long()) == 0  # [B, n]
        reward, achieved = f["reward"][slots], f["achieved"][slots]
        reward = reward + self.goal_reward(achieved - reward, achieved, goal[:, None].expand_as(achieved))
        length = alive.sum(1)
        last = slots.gather(1, (length - 1)[:, None]).squeeze(1)
        discount = self.powers[length] * (1.0 - (f["flags"][last] & 1).float())
        next_agent = f["next_agent"][last]
        agent[:, self.goal_column] = goal
        next_agent[:, self.goal_column] = goal
        return {"bar": f["bar"][index].long(), "agent": agent, "action": f["action"][index].long(),
                "reward": (reward * self.powers[:self.n_step] * alive).sum(1), "discount": discount,
                "next_bar": f["bar"][last].long() + 1, "next_agent": next_agent, "index": index}

    def update_priorities(self, index: torch.Tensor, priorities: torch.Tensor) -> None:
        node = index + self.size
        self.tree[node] = (priorities.double().abs() + self.eps) ** self.alpha
        for _ in range(self.depth):
            node = node // 2
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]


def bench_plain(args, capacity: int, device: torch.device) -> list[dict]:
    """The plain-torch sum tree over a buffer filled like fitdqn's (the same rows and leaves)."""
    spec = transition_spec(args.agent_dim)
    buffer = ReplayBuffer(
        spec, capacity, args.num_envs, n_step=3, gamma=0.99, episode_length=args.episode_length,
        goal_column=GOAL_COLUMN, goal_reward=goal_reward, prioritized=True, alpha=0.6, priority_eps=1e-6, her=True,
        her_k=4, tree_fanout=args.fanout, device=device,
    )
    fill(buffer, args.episode_length, args.agent_dim, torch.Generator(device).manual_seed(0))
    plain = PlainPrioritizedReplay(buffer.storage.fields, buffer.storage.written, buffer.num_envs,
                                   buffer.sampler.tree.leaves, n_step=3, gamma=0.99,
                                   episode_length=args.episode_length, goal_column=GOAL_COLUMN,
                                   goal_reward=goal_reward)
    del buffer.sampler  # its tree is no longer needed: only the rows are shared
    beta = torch.tensor(0.4, device=device, dtype=torch.float64)

    def step() -> dict:
        batch = plain.sample(args.batch, beta)
        plain.update_priorities(batch["index"], batch["reward"].abs())
        return batch

    modes = [("eager", step)]
    rows = []
    if device.type == "cuda" and not args.no_graph:
        try:
            modes.append(("cuda graph", graphed(step, device)))
            if not args.no_compile:
                compiled = torch.compile(step, fullgraph=True, dynamic=False)
                compiled()
                modes.append(("compile+graph", graphed(compiled, device)))
        except Exception as error:
            rows.append({"impl": "plain-torch sum tree", "mode": "cuda graph", "capacity": capacity,
                         "error": repr(error)[:300]})
    for mode, fn in modes:
        seconds = median_ms(fn, device, args.iters, args.warmup) / 1e3
        rows.append({"impl": "plain-torch sum tree", "mode": mode, "capacity": capacity, "batch": args.batch,
                     "ms_per_iter": seconds * 1e3, "samples_per_s": args.batch / seconds,
                     "note": f"binary tree, {plain.depth} levels"})
    return rows


def check_against_cpu(args, device: torch.device) -> dict:
    """Same rows into a CPU buffer (the torch maths) and a ``device`` buffer (its operators' kernels): agree?"""
    spec, num_envs, capacity = transition_spec(args.agent_dim), 64, 64 * 40
    kwargs = dict(n_step=3, gamma=0.99, episode_length=16, goal_column=GOAL_COLUMN, goal_reward=goal_reward,
                  prioritized=True, alpha=0.6, priority_eps=1e-6, her=True, her_k=4, tree_fanout=8)
    cpu = ReplayBuffer(spec, capacity, num_envs, device="cpu", **kwargs)
    dev = ReplayBuffer(spec, capacity, num_envs, device=device, **kwargs)
    fill(cpu, 16, args.agent_dim, torch.Generator().manual_seed(0))
    for t in range(cpu.storage.steps):
        rows = {name: field[t * num_envs:(t + 1) * num_envs] for name, field in cpu.storage.fields.items()}
        dev.write({name: value.to(device) for name, value in rows.items()})
    index = torch.randint(0, capacity - 3 * num_envs, (4096,))
    priorities = torch.rand(4096) * 3
    for buffer in (cpu, dev):
        buffer.update_priorities(index.to(buffer.device), priorities.to(buffer.device))  # duplicates inside
    uniform, beta = torch.rand(4096, 3, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)
    batch_cpu = cpu.batch_from_uniforms(uniform, beta)
    batch_dev = {k: v.cpu() for k, v in dev.batch_from_uniforms(uniform.to(device), beta.to(device)).items()}
    tree_cpu, tree_dev = cpu.sampler.tree, dev.sampler.tree
    return {
        "triton_rebuild": sum_tree_ops.available(device),
        "leaves_max_rel_diff": float(((tree_cpu.leaves - tree_dev.leaves.cpu()).abs()
                                      / tree_cpu.leaves.clamp(min=1e-300)).max()),
        "nodes_max_rel_diff": max(float(((a - b.cpu()).abs() / a.clamp(min=1e-300)).max())
                                  for a, b in zip(tree_cpu.levels[:-1], tree_dev.levels[:-1], strict=True)),
        "index_mismatches": int((batch_cpu["index"] != batch_dev["index"]).sum()),
        "batch_max_abs_diff": max(float((batch_cpu[k].double() - batch_dev[k].double()).abs().max())
                                  for k in batch_cpu),
    }


def bench_torchrl(args, capacity: int, device: torch.device) -> list[dict]:
    """TorchRL's prioritized buffer on ``LazyTensorStorage(device=...)`` holding rows like fitdqn's: its sum tree
    where the storage is (a CUDA tree needs a CUDA build of TorchRL), else, said so, its C++ tree on the host."""
    name = "torchrl PrioritizedReplayBuffer"
    try:
        import torchrl
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer, PrioritizedSampler, ReplayBuffer
    except ImportError as error:
        print(f"torchrl not importable: {error}")
        return [{"impl": name, "capacity": capacity, "error": f"not importable: {error}"[:300]}]
    version = f"torchrl {torchrl.__version__}"
    generator = torch.Generator(device).manual_seed(0)

    def filled(buffer) -> None:
        chunk = min(capacity, 1 << 20)
        for start in range(0, capacity, chunk):
            rows = min(chunk, capacity - start)
            buffer.extend(TensorDict({
                "bar": torch.randint(8, 100_000, (rows,), device=device, generator=generator, dtype=torch.int32),
                "agent": torch.randn(rows, args.agent_dim, device=device, generator=generator),
                "action": torch.randint(0, 5, (rows, 3), device=device, generator=generator, dtype=torch.uint8),
                "reward": torch.randn(rows, device=device, generator=generator),
                "achieved": torch.randn(rows, device=device, generator=generator),
                "next_agent": torch.randn(rows, args.agent_dim, device=device, generator=generator),
                "episode_step": torch.zeros(rows, device=device, dtype=torch.int32),
                "flags": torch.zeros(rows, device=device, dtype=torch.uint8),
            }, batch_size=[rows], device=device))

    rows_out = []
    builds = [("tree on the storage's device", lambda: PrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, storage=LazyTensorStorage(capacity, device=device), batch_size=args.batch))]
    if device.type == "cuda":
        builds.append(("C++ tree on the host, storage on the GPU", lambda: ReplayBuffer(
            storage=LazyTensorStorage(capacity, device=device), batch_size=args.batch,
            sampler=PrioritizedSampler(capacity, alpha=0.6, beta=0.4, device="cpu"))))
    for label, build in builds:
        try:
            buffer = build()
            filled(buffer)

            def step(buffer=buffer) -> None:
                data, info = buffer.sample(return_info=True)
                buffer.update_priority(info["index"], data["reward"].abs())

            seconds = median_ms(step, device, args.iters, args.warmup) / 1e3
        except Exception as error:
            rows_out.append({"impl": name, "mode": label, "capacity": capacity, "version": version,
                             "error": repr(error)[:300]})
            continue
        rows_out.append({"impl": name, "mode": "eager", "capacity": capacity, "batch": args.batch,
                         "ms_per_iter": seconds * 1e3, "samples_per_s": args.batch / seconds, "version": version,
                         "note": f"{label}; 1-step sample + priority update only (no n-step, no HER)"})
        break  # the first build that works
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--capacities", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--num-envs", type=int, default=4096)
    parser.add_argument("--episode-length", type=int, default=256)
    parser.add_argument("--agent-dim", type=int, default=8)
    parser.add_argument("--fanout", type=int, default=64)
    parser.add_argument("--no-graph", action="store_true", help="skip CUDA graph capture")
    parser.add_argument("--no-uniform", action="store_true", help="skip the uniform-sampling rows")
    parser.add_argument("--no-torchrl", action="store_true", help="skip the TorchRL rows")
    parser.add_argument("--no-fitdqn", action="store_true", help="skip fitdqn's rows")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain-torch sum tree rows")
    parser.add_argument("--parts", action="store_true", help="also time descent / gather / update alone")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the plain-torch sum tree's torch.compile + CUDA graph row")
    parser.add_argument("--profile", action="store_true", help="print kernel tables (torch.profiler)")
    parser.add_argument("--check", action="store_true", help="first compare a small buffer with the CPU")
    parser.add_argument("--out", default="bench_replay.json")
    args = parser.parse_args()
    device = resolve_device(args.device)
    args.num_envs = min(args.num_envs, max(1, min(args.capacities) // 64))  # room for episodes

    results = []
    if args.check and device.type != "cpu":
        check = check_against_cpu(args, device)
        print("check against CPU:", check)
        results.append({"impl": "check against CPU", "capacity": 64 * 40, **check})
    for capacity in args.capacities:
        capacity -= capacity % args.num_envs
        if not args.no_fitdqn:
            results += bench_fitdqn(args, capacity, device, prioritized=True)
        if not args.no_plain:
            results += bench_plain(args, capacity, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if not args.no_uniform and not args.no_fitdqn:
            results += bench_fitdqn(args, capacity, device, prioritized=False)
        if not args.no_torchrl:
            results += bench_torchrl(args, capacity, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"\nreplay sample + priority update, batch {args.batch}, {name}, torch {torch.__version__}")
    print(f"{'implementation':34} {'mode':11} {'capacity':>10} {'ms/iter':>9} {'samples/s':>14}")
    for row in results:
        if "samples_per_s" not in row and "error" not in row:
            continue
        if "error" in row:
            print(f"{row['impl']:34} {row.get('mode', ''):11} {row['capacity']:>10} {'':>9} {row['error']}")
        else:
            print(f"{row['impl']:34} {row['mode']:11} {row['capacity']:>10} {row['ms_per_iter']:>9.3f} "
                  f"{row['samples_per_s']:>14,.0f}")
    write_json(args.out, {"device": name, "torch": torch.__version__, "commit": code_commit(),
                          "date": time.strftime("%Y-%m-%d", time.gmtime()), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
