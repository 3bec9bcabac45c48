"""fitdqn's graphed update beside the same maths written plainly in PyTorch: eager, CUDA graph, torch.compile.

    PYTHONPATH=src python benchmarks/update_vs_compile.py --out benchmarks/results/update_vs_compile.json
    PYTHONPATH=src python benchmarks/update_vs_compile.py --device cpu --batches 32 --iters 2 --modes \
        fitdqn-eager,eager --out /tmp/cpu.json                                                     # smoke

In one process on one device, at each batch size (default 1024, 8192, 16384), on random batches of the learner's
shapes (``fitdqn.learn.random_batch``: obs ``[B, W, S]``, W = 8, S = ``--state-dim``; fitdqn's observations in
the learner's autocast dtype, bf16 on CUDA, as the trainer's replay builds them, ``--fitdqn-obs float32`` for the
plain step's float32):

- ``fitdqn``: ``fitdqn.learn.Learner.update`` (the default CUDA networks: fused Triton operators, bf16 autocast)
  captured by ``fitdqn.device.graphs.capture_graph``, the graph the trainer replays (without the replay's sampling);
  ``fitdqn-eager`` is the same update run eagerly;
- the plain implementation (:class:`PlainLearner`, written as a user would from the papers, the same widths):
  per-token MLP over the window, last-token attention through ``F.scaled_dot_product_attention``, branching
  dueling C51 (one value and one advantage stream per branch, dueling on the logits, projection by
  ``scatter_add_``), IQN (cosine embedding, ``[B, N, d]`` products) with the pairwise ``[B, N, N', branches]``
  quantile Huber loss, the IQL expectile value net, double-DQN targets, gradient clipping, fused capturable
  Adam, Polyak target update, bf16 autocast. Modes:
  ``eager``; ``graph`` (the whole step captured in one CUDA graph, PyTorch's whole-network recipe);
  ``compile`` (``torch.compile`` of the forward and loss, default mode, static shapes; backward through
  AOTAutograd) with the whole step then captured in one CUDA graph; ``max-autotune``: the same with
  ``mode="max-autotune-no-cudagraphs"`` (max-autotune's kernel search; its own cudagraph trees cannot sit
  inside the step's graph, which captures the optimizer too). A compile that takes longer than
  ``--compile-limit`` seconds is abandoned and the row says so.

The networks are those a run on the device trains (``fitdqn.config.for_device``: ``net.size = small`` by
default); ``--set net.size=full`` measures the full widths.

Per row: ``ms``: median over ``--iters`` calls after ``--warmup`` (CUDA events around each call; a graph mode
times ``graph.replay()`` with its inputs in place); ``kb_per_sample``: peak allocated bytes minus those
allocated before (networks, gradients, Adam state and the batch exist already), over the batch (graph modes:
the peak over warm-up and capture, as ``benchmarks/bench_update.py`` measures it); ``compile_s``: the first
call's time less one ordinary call; ``marginal_kb_per_sample``: the slope of the peak from the previous batch
(fixed costs cancel); ``ms_over_fitdqn_graph``, ``kb_over_fitdqn_graph``: each row over fitdqn's graphed update at
the same batch.
``--profile-batch``: a ``torch.profiler`` table of where the time of fitdqn's update goes (eager: kernel by
kernel; the graph replays the same kernels without the launch gaps), and the same for the compiled plain step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import math
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import median_ms, peak_bytes, seconds_of, sync, write_json
from torch import nn

from fitdqn.config import Config, LearnConfig, NetConfig, config_to_dict, for_device, with_overrides
from fitdqn.device.graphs import capture_graph
from fitdqn.device.probe import resolve_device
from fitdqn.learn import Learner, random_batch
from fitdqn.provenance import code_commit

PLAIN_MODES = ("eager", "graph", "compile", "max-autotune")
FITDQN_MODES = ("fitdqn", "fitdqn-eager")
COMPILE_MODES = {"compile": "default", "max-autotune": "max-autotune-no-cudagraphs"}


# ---------------------------------------------------------------------------------------------- plain PyTorch

class PlainQNet(nn.Module):
    """Trunk MLP per token -> last-token attention -> branching dueling C51 and IQN, as a user writes them."""

    def __init__(self, net: NetConfig, state_dim: int) -> None:
        super().__init__()
        if len(set(net.branches)) != 1:
            raise ValueError("the plain network takes branches of one size")
        self.branches, self.actions, self.atoms = len(net.branches), net.branches[0], net.num_atoms
        self.heads, d, h = net.attention_heads, net.d_model, net.stream_hidden
        self.fc1 = nn.Linear(state_dim, net.trunk_hidden)
        self.fc2 = nn.Linear(net.trunk_hidden, d)
        self.query = nn.Linear(d, d)
        self.key_value = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.value = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, self.atoms))
        self.advantages = nn.ModuleList(
            nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, self.actions * self.atoms))
            for _ in range(self.branches))
        self.iqn_embed = nn.Linear(net.iqn_embedding, d)
        self.iqn_out = nn.Linear(d, self.branches * self.actions)
        self.register_buffer("support", torch.linspace(net.v_min, net.v_max, net.num_atoms))  # [A]
        self.register_buffer("frequencies", math.pi * torch.arange(net.iqn_embedding, dtype=torch.float32))  # [E]

    def features(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs [B, W, S] -> [B, d]``: the last token after attending over the window."""
        batch, window, _ = obs.shape
        tokens = F.relu(self.fc2(F.relu(self.fc1(obs))))  # [B, W, d]
        last = tokens[:, -1]  # [B, d]
        heads, head_dim = self.heads, last.shape[-1] // self.heads
        q = self.query(last).view(batch, heads, 1, head_dim)  # [B, H, 1, dh]
        k, v = self.key_value(tokens).view(batch, window, 2, heads, head_dim).permute(2, 0, 3, 1, 4)  # [B, H, W, dh]
        attended = F.scaled_dot_product_attention(q, k, v).reshape(batch, -1)  # [B, d]
        return self.norm(last + self.out(attended))

    def c51_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, d] -> [B, branches, actions, atoms]``: V + A - mean_a A per branch."""
        value = self.value(features).view(-1, 1, 1, self.atoms)  # [B, 1, 1, A]
        advantage = torch.stack([adv(features).view(-1, self.actions, self.atoms) for adv in self.advantages],
                                dim=1)  # [B, br, n, A]
        return value + advantage - advantage.mean(dim=2, keepdim=True)

    def q_values(self, logits: torch.Tensor) -> torch.Tensor:
        return (torch.softmax(logits.float(), dim=-1) * self.support).sum(-1)  # [..., n]

    def quantiles(self, features: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        """``features [B, d]``, ``taus [B, N] -> [B, N, branches, actions]`` (fp32)."""
        cosines = torch.cos(taus.unsqueeze(-1) * self.frequencies)  # [B, N, E]
        phi = F.relu(self.iqn_embed(cosines))  # [B, N, d]
        values = self.iqn_out(features.unsqueeze(1) * phi)  # [B, N, br * n]
        return values.float().view(*taus.shape, self.branches, self.actions)


def plain_value_net(state_dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(state_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


def take_action(values: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """``values [B, br, n, A]``, ``action [B, br]`` -> ``[B, br, A]``."""
    index = action[:, :, None, None].expand(-1, -1, 1, values.shape[-1])  # [B, br, 1, A]
    return values.gather(2, index).squeeze(2)


def take_quantiles(values: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """``values [B, N, br, n]``, ``action [B, br]`` -> ``[B, N, br]``."""
    index = action[:, None, :, None].expand(-1, values.shape[1], -1, 1)  # [B, N, br, 1]
    return values.gather(3, index).squeeze(3)


def project(next_probs: torch.Tensor, reward: torch.Tensor, discount: torch.Tensor, support: torch.Tensor
            ) -> torch.Tensor:
    """C51's projection of ``r + discount z`` onto the support, the usual floor/ceil ``scatter_add_`` form:
    ``next_probs [B, br, A]`` -> ``[B, br, A]``."""
    v_min, v_max, atoms = support[0], support[-1], support.shape[0]
    dz = (v_max - v_min) / (atoms - 1)
    tz = (reward[:, None, None] + discount[:, None, None] * support).clamp(v_min, v_max)  # [B, 1, A]
    b = ((tz - v_min) / dz).expand_as(next_probs)  # [B, br, A]
    lower, upper = b.floor().clamp(0, atoms - 1), b.ceil().clamp(0, atoms - 1)  # rounding can pass A - 1
    to_lower = (upper + (lower == upper).float() - b) * next_probs  # an exact hit goes to the lower atom
    to_upper = (b - lower) * next_probs
    target = torch.zeros_like(next_probs)
    target.scatter_add_(-1, lower.long(), to_lower)
    target.scatter_add_(-1, upper.long(), to_upper)
    return target


def quantile_huber(pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor, kappa: float) -> torch.Tensor:
    """Pairwise quantile Huber: ``pred [B, N, br]``, ``target [B, N', br]``, ``taus [B, N]`` -> ``[B]``
    (sum over N, mean over N', mean over branches: the same reduction as fitdqn's)."""
    u = target.unsqueeze(1) - pred.unsqueeze(2)  # [B, N, N', br]
    huber = torch.where(u.abs() <= kappa, 0.5 * u.square(), kappa * (u.abs() - 0.5 * kappa))
    rho = (taus[:, :, None, None] - (u.detach() < 0).float()).abs() * huber / kappa  # [B, N, N', br]
    return rho.mean(2).sum(1).mean(-1)


class PlainLearner:
    """Online + target Q nets, V(s), fused Adam; ``step(batch)`` is one update (no host sync)."""

    def __init__(self, net: NetConfig, learn: LearnConfig, state_dim: int, device: torch.device,
                 compile_mode: str | None = None, lr: float = 1e-3, tau: float = 0.005) -> None:
        self.learn, self.device, self.tau = learn, device, tau
        self.quantile_count = net.iqn_quantiles
        self.online = PlainQNet(net, state_dim).to(device)
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.value = plain_value_net(state_dim, net.iql_hidden).to(device)
        self.params = [*self.online.parameters(), *self.value.parameters()]
        self.online_params, self.target_params = list(self.online.parameters()), list(self.target.parameters())
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.Adam(self.params, lr=lr, eps=learn.adam_eps, fused=cuda, capturable=cuda)
        self.dtype = torch.bfloat16 if cuda else None  # bf16 autocast on CUDA, fp32 on the CPU
        self.cache = True  # autocast's weight-cast cache (off for graph capture, PyTorch's advice)
        self.losses = self._losses if compile_mode is None else torch.compile(self._losses, mode=compile_mode,
                                                                             dynamic=False)

    def _losses(self, batch: dict[str, torch.Tensor], taus: torch.Tensor, next_taus: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        """The forward and the losses (what ``torch.compile`` compiles); ``taus``, ``next_taus`` ``[B, N]``."""
        cfg, online, target = self.learn, self.online, self.target
        obs, next_obs, action = batch["obs"], batch["next_obs"], batch["action"]  # [B, W, S], [B, W, S], [B, br]
        reward, discount, weight = batch["reward"], batch["discount"], batch["weight"]  # [B] each
        autocast = (torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=self.cache) if self.dtype
                    else contextlib.nullcontext())
        with autocast:
            with torch.no_grad():
                best = online.q_values(online.c51_logits(online.features(next_obs))).argmax(-1)  # [B, br]
                next_features = target.features(next_obs)  # [B, d]
                next_probs = torch.softmax(take_action(target.c51_logits(next_features), best).float(), -1)
                c51_target = project(next_probs, reward, discount, target.support)  # [B, br, A]
                next_quantiles = take_quantiles(target.quantiles(next_features, next_taus), best)  # [B, N', br]
                iqn_target = reward[:, None, None] + discount[:, None, None] * next_quantiles  # [B, N', br]
                taken = take_action(target.c51_logits(target.features(obs)), action)  # [B, br, A]
                v_target = target.q_values(taken).mean(-1)  # [B]
            features = online.features(obs)  # [B, d]
            log_probs = torch.log_softmax(take_action(online.c51_logits(features), action).float(), -1)
            cross_entropy = -(c51_target * log_probs).sum(-1)  # [B, br]
            quantiles = take_quantiles(online.quantiles(features, taus), action)  # [B, N, br]
            iqn = quantile_huber(quantiles, iqn_target, taus, cfg.kappa)  # [B]
            v = self.value(obs[:, -1]).squeeze(-1).float()  # [B]
            diff = v_target - v
            iql = torch.where(diff < 0, 1 - cfg.iql_expectile, cfg.iql_expectile) * diff.square()  # [B]
            c51_loss = (weight * cross_entropy.mean(-1)).mean()
            iqn_loss = (weight * iqn).mean()
            iql_loss = (weight * iql).mean()
            loss = c51_loss + cfg.iqn_loss_weight * iqn_loss + cfg.iql_loss_weight * iql_loss
        return {"loss": loss, "c51_loss": c51_loss.detach(), "iqn_loss": iqn_loss.detach(),
                "iql_loss": iql_loss.detach(), "priorities": cross_entropy.detach().mean(-1)}

    def step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        size = batch["obs"].shape[0]
        taus = torch.rand(size, self.quantile_count, device=self.device)  # [B, N]
        next_taus = torch.rand(size, self.quantile_count, device=self.device)  # [B, N']
        self.optimizer.zero_grad(set_to_none=False)  # gradients at fixed addresses (graph capture)
        out = self.losses(batch, taus, next_taus)
        out["loss"].backward()
        out["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.params, self.learn.grad_clip, foreach=True)
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(self.target_params, self.online_params, self.tau)
        out["loss"] = out["loss"].detach()
        return out


def capture(step: Callable[[], dict], device: torch.device, warmup: int) -> tuple[torch.cuda.CUDAGraph, dict]:
    """PyTorch's whole-network recipe: warm up on a side stream, then capture one call."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


# ---------------------------------------------------------------------------------------------- measuring

class CompileTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise :class:`CompileTimeout` in the main thread after ``seconds`` (0: no limit)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(_signum, _frame):
        raise CompileTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed_out(error: BaseException | None) -> bool:
    """Whether ``error`` is, or wraps (Inductor re-raises it as ``InductorError``), a :class:`CompileTimeout`."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, CompileTimeout) or "CompileTimeout" in repr(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def bench_fitdqn(config: Config, args, device: torch.device, batch_size: int, mode: str) -> dict:
    torch.manual_seed(0)
    learner = Learner(config, args.state_dim, device)
    learner.set_batch_size(batch_size)
    obs_dtype = learner.autocast_dtype if args.fitdqn_obs == "learner" and learner.autocast_dtype else torch.float32
    batch = random_batch(config, args.state_dim, batch_size, device, 0, obs_dtype=obs_dtype)
    row = row_name(mode, batch_size)
    row["obs_dtype"] = str(obs_dtype).removeprefix("torch.")
    if mode == "fitdqn-eager":
        first = seconds_of(lambda: learner.update(batch), device)
        row["peak_bytes"] = peak_bytes(lambda: learner.update(batch), device)
        row["ms"] = median_ms(lambda: learner.update(batch), device, args.iters, args.warmup)
        row["first_call_s"] = first
        row["outputs_finite"] = bool(all(torch.isfinite(v).all() for v in learner.update(batch).values()))
        return row
    holder = {}  # the update over a static batch, captured as the trainer captures its step
    row["peak_bytes"] = peak_bytes(
        lambda: holder.setdefault("graph", capture_graph(lambda: learner.update(batch), device, warmup=3)), device)
    graph, static_outputs = holder["graph"]
    row["ms"] = median_ms(graph.replay, device, args.iters, args.warmup)
    row["outputs_finite"] = bool(all(torch.isfinite(v).all() for v in static_outputs.values()))
    return row


def bench_plain(config: Config, args, device: torch.device, batch_size: int, mode: str) -> dict:
    torch.manual_seed(0)
    compile_mode = COMPILE_MODES.get(mode)
    row: dict = {"impl": "plain", "mode": mode, "batch": batch_size}
    if compile_mode is not None:
        row["torch_compile_mode"] = compile_mode
        torch._dynamo.reset()
    learner = PlainLearner(config.net, config.learn, args.state_dim, device, compile_mode)
    batch = random_batch(config, args.state_dim, batch_size, device, 0)
    graphed = mode != "eager" and device.type == "cuda"
    learner.cache = not graphed
    try:
        with time_limit(args.compile_limit if compile_mode else 0):
            first = seconds_of(lambda: learner.step(batch), device)  # compiles forward and backward
    except Exception as error:
        if not timed_out(error):
            raise
        torch._dynamo.reset()
        return {**row, "skipped": f"compiling took longer than --compile-limit {args.compile_limit:g} s"}
    ordinary = seconds_of(lambda: learner.step(batch), device)
    if compile_mode is not None:
        row["compile_s"] = max(first - ordinary, 0.0)
    row["first_call_s"] = first
    if not graphed:
        row["peak_bytes"] = peak_bytes(lambda: learner.step(batch), device)
        out = learner.step(batch)
        row["ms"] = median_ms(lambda: learner.step(batch), device, args.iters, args.warmup)
    else:
        holder = {}
        row["peak_bytes"] = peak_bytes(
            lambda: holder.setdefault("graph", capture(lambda: learner.step(batch), device, warmup=3)), device)
        graph, out = holder["graph"]
        row["ms"] = median_ms(graph.replay, device, args.iters, args.warmup)
    row["outputs_finite"] = bool(all(torch.isfinite(v).all() for v in out.values()))
    return row


# ---------------------------------------------------------------------------------------------- profile

def kernel_table(fn: Callable[[], object], device: torch.device, calls: int, top: int) -> dict:
    """``torch.profiler`` over ``calls`` calls of ``fn``: the ``top`` kernels by total device time, with % of
    all kernel time, and that total per call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0.0)
        if getattr(event, "device_type", None) == DeviceType.CUDA and device_us > 0:
            rows.append((event.key, device_us, event.count))
    total = sum(us for _, us, _ in rows)
    rows.sort(key=lambda r: -r[1])
    return {
        "calls": calls, "kernels_per_call": sum(c for _, _, c in rows) / calls,
        "kernel_ms_per_call": total / calls / 1e3,
        "top": [{"kernel": name[:160], "ms_per_call": us / calls / 1e3, "percent": 100 * us / max(total, 1e-9),
                 "launches_per_call": count / calls} for name, us, count in rows[:top]],
    }


def profile_rows(config: Config, args, device: torch.device) -> dict:
    batch_size = args.profile_batch
    result = {"batch": batch_size}
    torch.manual_seed(0)
    learner = Learner(config, args.state_dim, device)
    learner.set_batch_size(batch_size)
    batch = random_batch(config, args.state_dim, batch_size, device, 0)
    result["fitdqn_eager"] = kernel_table(partial(learner.update, batch), device, args.profile_calls,
                                          args.profile_top)
    learner = batch = None
    free(device)
    if "compile" in args.modes and args.profile_plain:
        torch._dynamo.reset()
        plain = PlainLearner(config.net, config.learn, args.state_dim, device, COMPILE_MODES["compile"])
        batch = random_batch(config, args.state_dim, batch_size, device, 0)
        try:
            with time_limit(args.compile_limit):
                plain.step(batch)
            result["plain_compile"] = kernel_table(lambda: plain.step(batch), device, args.profile_calls,
                                                   args.profile_top)
        except Exception as error:
            if not timed_out(error):
                raise
            result["plain_compile"] = {"skipped": "compile limit"}
    return result


# ---------------------------------------------------------------------------------------------- driver

def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def add_ratios(rows: list[dict]) -> None:
    """Each row against fitdqn's graphed update at its batch, and ``marginal_kb_per_sample``: the slope of the peak
    bytes from the previous batch of the same implementation and mode (fixed costs such as weight casts, cuBLAS
    workspaces and the IQN kernel's partial sums cancel)."""
    previous: dict[tuple[str, str], dict] = {}
    for row in rows:
        if row.get("peak_bytes") is None:
            continue
        last = previous.get((row["impl"], row["mode"]))
        if last is not None and row["batch"] > last["batch"]:
            row["marginal_kb_per_sample"] = (row["peak_bytes"] - last["peak_bytes"]) / (
                row["batch"] - last["batch"]) / 1024
        previous[(row["impl"], row["mode"])] = row
    reference = {r["batch"]: r for r in rows if r["impl"] == "fitdqn" and r["mode"] == "graph" and "ms" in r}
    for row in rows:
        ref = reference.get(row["batch"])
        if ref is None or "ms" not in row:
            continue
        row["ms_over_fitdqn_graph"] = row["ms"] / ref["ms"]
        if row.get("peak_bytes") and ref.get("peak_bytes"):
            row["kb_over_fitdqn_graph"] = row["peak_bytes"] / ref["peak_bytes"]


def run(args) -> dict:
    device = resolve_device(args.device)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    overrides = dict(item.split("=", 1) for item in args.set)
    config = with_overrides(Config(), overrides) if overrides else Config()
    config = for_device(config, device.type)  # the widths a run on this device trains (`--set net.size=full`)
    batches = [int(b) for b in args.batches.split(",") if b]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(PLAIN_MODES) - set(FITDQN_MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {', '.join(FITDQN_MODES + PLAIN_MODES)}")
    if device.type != "cuda":
        modes = [m for m in modes if m not in ("fitdqn", "graph")]
    rows = []
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "commit": code_commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "state_dim": args.state_dim, "config": {k: config_to_dict(config)[k] for k in ("net", "learn")},
        "results": rows,
    }
    started = time.perf_counter()

    def out_of_time() -> bool:
        return args.total_limit > 0 and time.perf_counter() - started > args.total_limit

    autotune_batches = [int(b) for b in args.max_autotune_batches.split(",") if b] or batches
    jobs = [(b, m) for b in batches for m in modes if m != "max-autotune"]  # the longest compiles last
    jobs += [(b, "max-autotune") for b in batches if "max-autotune" in modes and b in autotune_batches]
    profiled = not (args.profile_batch and device.type == "cuda")
    for batch_size, mode in jobs:
        if mode == "max-autotune" and not profiled:  # the profile before the longest compiles
            profile_into(result, config, args, device)
            profiled = True
        bench = bench_fitdqn if mode in FITDQN_MODES else bench_plain
        if mode in COMPILE_MODES and out_of_time():
            rows.append({"impl": "plain", "mode": mode, "batch": batch_size,
                         "skipped": f"past --total-limit {args.total_limit:g} s"})
            continue
        try:
            row = bench(config, args, device, batch_size, mode)
        except torch.OutOfMemoryError as error:
            row = {**row_name(mode, batch_size), "error": f"out of memory: {str(error)[:200]}"}
        except Exception as error:  # report and go on: one broken mode must not lose the others
            row = {**row_name(mode, batch_size), "error": repr(error)[:400]}
        if row.get("peak_bytes") is not None:
            row["kb_per_sample"] = row["peak_bytes"] / batch_size / 1024
        rows.append(row)
        print(format_row(row), flush=True)
        add_ratios(rows)
        write_json(args.out, result, announce=False)  # after every row: a run cut short keeps what it measured
        free(device)
    if not profiled:
        profile_into(result, config, args, device)
    return result


def profile_into(result: dict, config: Config, args, device: torch.device) -> None:
    try:
        result["profile"] = profile_rows(config, args, device)
    except Exception as error:
        result["profile"] = {"error": repr(error)[:400]}
    write_json(args.out, result, announce=False)
    free(device)


def row_name(mode: str, batch_size: int) -> dict:
    if mode in FITDQN_MODES:
        return {"impl": "fitdqn", "mode": "graph" if mode == "fitdqn" else "eager", "batch": batch_size}
    return {"impl": "plain", "mode": mode, "batch": batch_size}


def format_row(row: dict) -> str:
    name = f"{row['impl']} {row['mode']}"
    if "error" in row or "skipped" in row:
        return f"{name:22} {row['batch']:>6}  {row.get('error') or row.get('skipped')}"
    kb = row.get("kb_per_sample")
    compile_s = row.get("compile_s")
    ratio = row.get("ms_over_fitdqn_graph")
    return (f"{name:22} {row['batch']:>6} {row['ms']:9.3f} " + (f"{kb:9.1f}" if kb is not None else f"{'-':>9}")
            + (f" {compile_s:9.1f}" if compile_s is not None else f" {'-':>9}")
            + (f" {ratio:8.2f}x" if ratio is not None else f" {'-':>9}")
            + (f" {marginal:9.1f}" if (marginal := row.get("marginal_kb_per_sample")) is not None else f" {'-':>9}"))


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  torch {result['torch']}  commit {result['commit']}")
    print(f"{'implementation':22} {'batch':>6} {'ms':>9} {'KB/samp':>9} {'compile s':>9} {'vs fitdqn':>9} "
          f"{'marg. KB':>9}")
    for row in result["results"]:
        print(format_row(row))
    profile = result.get("profile") or {}
    for key in ("fitdqn_eager", "plain_compile"):
        table = profile.get(key)
        if not table or "top" not in table:
            continue
        print(f"\nwhere the time goes: {key} at batch {profile['batch']}: {table['kernel_ms_per_call']:.3f} ms of "
              f"kernels, {table['kernels_per_call']:.0f} launches per update")
        for entry in table["top"]:
            print(f"  {entry['percent']:5.1f} %  {entry['ms_per_call']:7.3f} ms  x{entry['launches_per_call']:<4.0f} "
                  f"{entry['kernel'][:90]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--device", default="auto", help="'auto', 'cuda', 'cuda:N' or 'cpu'")
    parser.add_argument("--batches", default="1024,8192,16384", help="comma-separated batch sizes")
    parser.add_argument("--modes", default=",".join(FITDQN_MODES + PLAIN_MODES),
                        help=f"comma-separated, of {', '.join(FITDQN_MODES + PLAIN_MODES)}")
    parser.add_argument("--iters", type=int, default=100, help="timed calls per row (median)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before timing")
    parser.add_argument("--state-dim", type=int, default=80, help="features per bar token")
    parser.add_argument("--fitdqn-obs", choices=("learner", "float32"), default="learner",
                        help="dtype of the observations fitdqn's update gets: 'learner' as the trainer's replay "
                             "builds them (the autocast dtype: bf16 on CUDA), or float32 as the plain step's")
    parser.add_argument("--compile-limit", type=float, default=240.0,
                        help="seconds a torch.compile may take before its row is skipped (0: no limit)")
    parser.add_argument("--max-autotune-batches", default="",
                        help="comma-separated batches for max-autotune (default: every batch)")
    parser.add_argument("--profile-batch", type=int, default=8192, help="batch of the profile table (0: none)")
    parser.add_argument("--profile-calls", type=int, default=10, help="updates profiled")
    parser.add_argument("--profile-top", type=int, default=15, help="kernels listed")
    parser.add_argument("--profile-plain", action="store_true", help="also profile the compiled plain step")
    parser.add_argument("--total-limit", type=float, default=0.0,
                        help="seconds after which no further compile row starts (0: no limit)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="fitdqn config override")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
