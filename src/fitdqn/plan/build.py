"""From config + device to a Plan: every consumer as a component, derived from the real objects.

- ``replay`` / ``her``: from the env's transition spec and a ReplayBuffer built on the 'meta' device, sized
  from the probed free memory (``fitdqn.plan.replay_share``).
- ``collector``: the market tensors on the device, the env's state, and the peak of one collector step
  (``Learner.act`` on ``collect.num_envs`` observations + ``env.step``), traced on fake tensors.
- ``cuda_overhead``: cuBLAS/cuBLASLt workspaces per stream (``fitdqn.memory.overhead``).
- ``dqn``, ``attention``, ``iqn``, ``iql``: parameters (+ target copy) + gradients + Adam moments counted from
  the traced stand-in system's own learner (shapes and dtypes), plus each group's share of the traced training step.
- ``batch``: what the traced step allocates outside the four network groups (the sampled batch, the
  observations built from it, loss and optimizer temporaries) minus the replay's own sampling scratch.
- ``cuda_graphs``: on CUDA with ``train.cuda_graphs``, the captured update's private pool reserves more than
  the step's live peak (segments, page rounding, fragmentation): the traced step's allocations replayed
  through a model of the caching allocator (``fitdqn.memory.allocator_model``), minus the live peak the
  components above already budget, at ``GRAPH_POOL_BATCHES``.

The training step traced is the one the trainer captures: ``replay.sample -> Learner.update ->
replay.update_priorities``, on fake tensors (``fitdqn.memory.trace``), at two batch sizes; the update at any
other batch is derived from those two (``fit_update``, ``memory.trace.TraceFit``), exact where every size is affine
in the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fitdqn.config import (
    SYNTHETIC_DATA,
    AutoBatch,
    Config,
    FixedBatch,
    ProfileBatch,
    batch_choice,
    config_to_dict,
)
from fitdqn.device.cards import find_card
from fitdqn.device.probe import DeviceInfo
from fitdqn.device.profiles import DEFAULT_PROFILE, load_profiles, match_profile, profile_with_note
from fitdqn.device.sizes import format_bytes
from fitdqn.learn.schedule import Schedule
from fitdqn.market.env import derives_target
from fitdqn.market.layout import env_state_bytes, market_bytes, transition_spec
from fitdqn.memory.allocator_model import (
    expandable_segments_enabled,
    pool_line,
)
from fitdqn.memory.attribution import OTHER
from fitdqn.memory.component import Component, ComponentName, tensor_bytes
from fitdqn.memory.distributed import distributed_components
from fitdqn.memory.kernel_scratch import CudaShape
from fitdqn.memory.overhead import cuda_driver_component, cuda_overhead_component, profile_driver_source
from fitdqn.memory.trace import (
    StepSetup,
    StepTrace,
    TraceFit,
    TraceSession,
    fake_device_for,
    fit_traces,
    line_above,
)
from fitdqn.nets.groups import MEMORY_GROUPS, parameter_groups
from fitdqn.plan.planner import BatchSearch, InfeasiblePlan, Plan, make_plan
from fitdqn.plan.replay_share import ReplayTooSmall, replay_component
from fitdqn.plan.trace_cache import (
    TraceCache,
    TraceSummary,
    cache_folder,
    data_provenance,
    key_digest,
    trace_key,
    traced_config_fields,
)
from fitdqn.resolve import resolve_for_device

if TYPE_CHECKING:
    from fitdqn.learn.learner import Learner
    from fitdqn.system import System

# The system, the learner and the data pipeline are imported where a trace, a network count or a bar count is
# made, not above: a plan whose traces are all in the cache needs none of them (lazy by design: seconds of imports).

TRACE_BATCHES = (512, 1024)
# The graph pool's fragmentation is not linear below a few thousand samples (at 512-1024 many per-sample
# tensors are still small-pool requests): fitted at 512 and 1024 the learner's pool beyond its live peak is
# flat (~19 MB) and the line would miss ~100 MB at batch 8192; from 4096 on it grows ~14.5 KB/sample and the
# line through 4096 and 8192 is within a few MB from 1024 to 16384 (see allocator_model's tests).
GRAPH_POOL_BATCHES = (4096, 8192)


@dataclass(frozen=True)
class PlanInputs:
    """What the plan needs to know beyond the config: the bars on the device, and how many ranks of a
    data-parallel job (torchrun) the plan is one of."""

    num_bars: int
    market_bytes: int
    world_size: int = 1  # one process, no all-reduce

    @classmethod
    def from_market(cls, market, world_size: int = 1) -> PlanInputs:
        return cls(market.num_bars, market_bytes(market.num_bars), world_size)

    @classmethod
    def from_config(cls, config: Config) -> PlanInputs:
        """Without loading the data: a synthetic market's size is its configured bar count; a file or a
        built-in dataset is read (on the CPU) to count its bars."""
        if config.market.data == SYNTHETIC_DATA:  # synthetic_bars makes exactly that many (tests/plan/test_build.py)
            return cls(config.market.synthetic_bars, market_bytes(config.market.synthetic_bars))
        cache = TraceCache(cache_folder(config.budget.trace_cache_dir))  # counting a dataset's bars costs seconds
        key = trace_key(what="bars", market=config_to_dict(config)["market"],
                        data=data_provenance(config.market.data))
        stored = cache.get_value(key)
        if stored is not None and isinstance(stored.get("num_bars"), int):
            num_bars = stored["num_bars"]
        else:
            from fitdqn.market.data import bars_from_config

            num_bars = len(bars_from_config(config.market))
            cache.put_value(key, {"num_bars": num_bars})
        return cls(num_bars, market_bytes(num_bars))



def trace_config(config: Config, device: DeviceInfo) -> tuple[Config, str]:
    """The config the trace runs (``config`` resolved for ``device``) and how it is traced: on a CPU-only PyTorch
    the fake tensors are CPU ones, and a CUDA target's bf16 runs there under CPU autocast, which is said."""
    config = resolve_for_device(config, device)
    target = torch.device("cuda" if device.kind == "cuda" else "cpu")
    traced, note = fake_device_for(target)
    if device.kind == "cuda" and traced.type == "cpu" and config.learn.precision == "bf16":
        note += "; bf16 by CPU autocast"
    return config, note


STAND_IN_GOAL_UNIT = 1.0  # HER's goal scale on the stand-in market: a host number that moves no byte
STAND_IN_TARGET_VOLATILITY = 0.01  # volatility sizing's target there: a host number, the same traced ops


def stand_in_system(config: Config, num_bars: int, capacity: int, batch_size: int,
                    device: torch.device) -> System:
    """The trainer's system (``fitdqn.system.build_system``) on a stand-in market of ``num_bars`` zero bars,
    its replay filled by the collector's own steps until a batch can be sampled (inside the tracer's fake mode:
    shapes only)."""
    from fitdqn.system import build_system, stand_in_market

    market = config.market
    if market.reward_scale <= 0:  # derived from real bars at run time; a host number that moves no byte
        market = dataclasses.replace(market, reward_scale=1.0)
    if derives_target(market):  # the same: a host number
        market = dataclasses.replace(market, target_volatility=STAND_IN_TARGET_VOLATILITY)
    config = dataclasses.replace(config, market=market)
    system = build_system(config, stand_in_market(config, num_bars), device, capacity=capacity,
                          batch_size=batch_size,
                          epsilon_decay_steps=Schedule.from_config(config, batch_size).epsilon_decay_steps,
                          goal_unit=STAND_IN_GOAL_UNIT)
    for _ in range(config.learn.n_step + 1):  # n-step windows complete: the replay can serve a batch
        system.collect_step()
    return system


def make_train_step(config: Config, num_bars: int, capacity: int):
    """The trainer's update step (``System.update_step``: sample -> update -> priorities -> stats), buildable
    on any (fake) device at any batch."""

    def make_step(batch_size: int, device: torch.device) -> StepSetup:
        system = stand_in_system(config, num_bars, capacity, batch_size, device)
        return StepSetup(system.update_step, system.memory_groups(), system.memory_calls())

    return make_step


UPDATE, COLLECT = "update", "collect"  # the steps a system session traces


@dataclass(frozen=True)
class SystemSteps:
    """The steps of one stand-in system (a ``TraceSession``'s ``steps``): ``'update'`` at any batch
    (``System.set_batch_size``) and ``'collect'`` at ``collect.num_envs`` envs; ``system`` is the system itself,
    whose tensors the plan also counts (``network_bytes``)."""

    config: Config
    system: System

    def __call__(self, name: str, batch: int) -> StepSetup:
        system = self.system
        if name == COLLECT:
            check_num_envs(self.config, batch)
            return StepSetup(system.collect_step, system.memory_groups())
        system.set_batch_size(batch)
        return StepSetup(system.update_step, system.memory_groups(), system.memory_calls())


def make_system_session(config: Config, num_bars: int, capacity: int):
    """Both steps of one stand-in system (``TraceSession``, :class:`SystemSteps`), built once on the session's
    fake device."""

    def make_session(device: torch.device) -> SystemSteps:
        return SystemSteps(config, stand_in_system(config, num_bars, capacity, config.budget.min_batch, device))

    return make_session


def check_num_envs(config: Config, num_envs: int) -> None:
    if num_envs != config.collect.num_envs:
        raise ValueError(f"the collector step runs collect.num_envs = {config.collect.num_envs} envs, "
                         f"not {num_envs}")


GRADIENTS = "gradients"  # network_bytes' entry beside the groups: every trainable parameter's gradient


def network_bytes(learner: Learner) -> dict[str, int]:
    """Per memory group, what ``learner`` holds for good — parameters (+ target copy), gradients and Adam state —
    and under ``GRADIENTS`` the bytes of all its gradients (what one all-reduce of a data-parallel update moves),
    counted from its tensors' shapes and dtypes (fake tensors: the stand-in system's learner)."""
    targets = parameter_groups(learner.target)
    counted = {}
    for name, group in parameter_groups(learner).items():
        params = list(group.parameters())
        held = [*params, *targets[name].parameters(), *(p.grad for p in params if p.grad is not None),
                *(t for p in params for t in learner.optimizer.state.get(p, {}).values()
                  if isinstance(t, torch.Tensor))]
        counted[name] = sum(tensor_bytes(t.shape, t.dtype) for t in held)
    counted[GRADIENTS] = sum(tensor_bytes(p.shape, p.dtype) for p in learner.params)
    return counted


def _cuda_shape(device: DeviceInfo) -> CudaShape:
    """What the reduction-scratch model reads from the target card (none known: no SM cap, an upper bound)."""
    if device.sm_count is None:
        return CudaShape()
    return CudaShape(device.sm_count, device.max_threads_per_sm or CudaShape().max_threads_per_sm)


@dataclass(frozen=True)
class Tracer:
    """Traces of one traced config's steps, each done once: from memory, else the disk cache, else traced."""

    config: Config
    num_bars: int
    target: str  # 'cuda' | 'cpu'
    cuda_shape: CudaShape
    compute_capability: tuple[int, int] | None
    cache: TraceCache
    planning: Planning  # what the plan shares among its traces

    def key(self, what: str, batch: int, **fields) -> dict:
        return trace_key(what=what, config=traced_config_fields(config_to_dict(self.config)),
                         num_bars=self.num_bars, target=self.target, batch=batch,
                         sm_count=self.cuda_shape.sm_count, max_threads_per_sm=self.cuda_shape.max_threads_per_sm,
                         compute_capability=self.compute_capability, **fields)

    def step(self, capacity: int, batch: int, pools: bool = False) -> TraceSummary:
        """The training step traced at one batch; with ``pools`` what a graph pool would reserve for it."""
        key = self.key(UPDATE, batch, capacity=capacity, pools=pools)
        return self.planning.summary(self.cache, key,
                                     lambda: TraceSummary.of(self.trace(capacity, UPDATE, batch, pools), pools))

    def collect(self, capacity: int, pools: bool = False) -> TraceSummary:
        """One collector step at ``collect.num_envs`` envs (``step_bytes``: its peak beyond what is allocated
        before it); with ``pools`` what the collector graph's own pool would reserve for it."""
        num_envs = self.config.collect.num_envs
        key = self.key(COLLECT, num_envs, capacity=capacity, pools=pools)
        return self.planning.summary(self.cache, key, lambda: TraceSummary.of(
            self.trace(capacity, COLLECT, num_envs, pools), pools))

    def networks(self, capacity: int) -> dict[str, int]:
        """``network_bytes`` of the stand-in system of this traced config (the plan's session of it at
        ``capacity``, else one of its own), from memory, else the disk cache, else counted."""
        key = self.key("networks", 0)
        digest = key_digest(key)
        networks = self.planning.networks
        if digest not in networks:
            stored = self.cache.get_value(key)
            if not (isinstance(stored, dict) and all(isinstance(v, int) for v in stored.values())
                    and set(stored) == {*MEMORY_GROUPS, GRADIENTS}):
                with self.session(capacity) as session:
                    stored = network_bytes(session.build().system.learner)
                self.cache.put_value(key, stored)
            networks[digest] = stored
        return dict(networks[digest])

    @contextlib.contextmanager
    def session(self, capacity: int) -> Iterator[TraceSession]:
        """The trace session of the stand-in system at ``capacity``: the plan's one (``Planning.traced_sessions``,
        built at its first use), else one of its own, closed on exit."""
        planning = self.planning
        if planning.sessions is None:
            alone = self._new_session(capacity)
            try:
                yield alone
            finally:
                alone.close()
            return
        digest = key_digest(self.key("session", 0, capacity=capacity))
        if digest not in planning.sessions:
            planning.sessions[digest] = self._new_session(capacity)
        yield planning.sessions[digest]

    def _new_session(self, capacity: int) -> TraceSession:
        return TraceSession(make_system_session(self.config, self.num_bars, capacity), self.target,
                            cuda_shape=self.cuda_shape)

    def trace(self, capacity: int, name: str, batch: int, record_events: bool) -> StepTrace:
        """Step ``name`` at ``batch`` on the stand-in system of this traced config and capacity: the plan's one
        session of it (``Planning.traced_sessions``, built at its first trace), else a session of its own."""
        if self.planning.sessions is None:
            with self.session(capacity) as alone:
                return alone.trace(name, batch, record_events)
        with self.session(capacity) as session:
            return self._shared_trace(session, capacity, name, batch, record_events)

    def _shared_trace(self, session: TraceSession, capacity: int, name: str, batch: int,
                      record_events: bool) -> StepTrace:
        if name != UPDATE:  # the collector: warm already (``stand_in_system`` ran its steps to fill the replay)
            return session.trace(name, batch, record_events, warm_up=False)
        fits, notes = self.planning.fits, self.planning.notes
        digest = key_digest(self.key("session", 0, capacity=capacity))
        if digest not in fits:  # the first update asked of this system: traced with twice its batch, and fitted
            fits[digest], first, failed = fit_update(session, batch)
            if failed:
                notes.append(f"the update traced at every batch (not derived from two traces: {failed})")
            return first
        fit = fits[digest]
        derived = fit.at(batch) if fit is not None else None
        if derived is not None:
            return derived
        if fit is not None:
            notes.append(f"the update at batch {batch} traced: a size fitted through batch {fit.batches[0]} and "
                         f"{fit.batches[1]} is negative there")
        return session.trace(name, batch, record_events)


def fit_update(session: TraceSession, batch: int) -> tuple[TraceFit | None, StepTrace, str]:
    """The update of ``session``'s system traced at ``batch`` and ``2 x batch`` and fitted (``fit_traces``): the
    fit (None if the two differ, and why), and the update at ``batch``. The first trace runs no warm-up step: where
    the fit holds, its step made the same changes from the same baseline as the warm one after it, so nothing it
    made persists; where it does not, ``batch`` is traced again, warm, and fitted again."""
    first = session.trace(UPDATE, batch, True, ledger=True, warm_up=False)
    second = session.trace(UPDATE, 2 * batch, True, ledger=True)
    fit, failed = fit_traces(first, second)
    if fit is None:  # its first step may have made what persists between steps (optimizer state): again, warm
        first = session.trace(UPDATE, batch, True, ledger=True)
        fit, failed = fit_traces(first, second)
    return fit, first, failed


@dataclass
class Planning:
    """What one plan shares among the traces it asks for (:func:`plan_for_device` makes one, or takes its
    caller's): each traced step's summary and the networks' bytes by key digest (a plan asks for one several
    times), the trace sessions open while :meth:`traced_sessions` is (one stand-in system per traced config and
    capacity; None: each trace builds its own), the update's fit per open session (None: none holds;
    ``fit_update``), and what the plan says of its traces."""

    summaries: dict[str, TraceSummary] = field(default_factory=dict)
    networks: dict[str, dict[str, int]] = field(default_factory=dict)  # network_bytes by traced config
    sessions: dict[str, TraceSession] | None = None
    fits: dict[str, TraceFit | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def traced_sessions(self) -> Iterator[None]:
        """Trace sessions shared by everything planned inside (one stand-in system per traced config and capacity,
        built once), closed on exit."""
        if self.sessions is not None:  # nested: the outer plan owns them
            yield
            return
        self.sessions = {}
        try:
            yield
        finally:
            sessions, self.sessions = self.sessions, None
            self.fits.clear()
            for session in sessions.values():
                session.close()

    def summary(self, cache: TraceCache, key: dict, trace) -> TraceSummary:
        """The summary of one traced step: from memory, else the disk cache, else ``trace()``; the notes its trace
        made go into the plan's notes whichever way it came."""
        digest = key_digest(key)
        summary = self.summaries.get(digest) or cache.get(key)
        if summary is None:
            start = len(self.notes)
            summary = trace()
            summary = dataclasses.replace(summary, notes=tuple(self.notes[start:]))
            cache.put(key, summary)
        else:
            self.notes.extend(summary.notes)
        self.summaries[digest] = summary
        return summary


def tracer_for(config: Config, device: DeviceInfo, traced_config: Config, num_bars: int,
               planning: Planning | None = None) -> Tracer:
    target = "cuda" if device.kind == "cuda" else "cpu"
    shape = _cuda_shape(device) if target == "cuda" else CudaShape()
    return Tracer(traced_config, num_bars, target, shape, device.compute_capability,
                  TraceCache(cache_folder(config.budget.trace_cache_dir)),
                  planning if planning is not None else Planning())


def cuda_graphs_component(config: Config, device: DeviceInfo, tracer: Tracer, capacity: int, note: str = "",
                          anchor: int | None = None) -> Component:
    """The update graph's private pool beyond the step's live peak (module docstring), or 0 bytes and why:
    a line through ``GRAPH_POOL_BATCHES``, or with ``anchor`` in proportion to the batch from that one."""
    if device.kind != "cuda":
        return Component(ComponentName.CUDA_GRAPHS, 0, 0, f"{device.kind} device: no CUDA graphs")
    if not config.train.cuda_graphs:
        return Component(ComponentName.CUDA_GRAPHS, 0, 0,
                         "train.cuda_graphs is off: the update runs eagerly, no graph pool")
    expandable = expandable_segments_enabled()
    mode = "expandable segments" if expandable else "default allocator, no expandable segments"
    if anchor is None:
        small, large = (tracer.step(capacity, b, pools=True) for b in GRAPH_POOL_BATCHES)
        fit = pool_line(((small.batch_size, small.step_bytes, small.pool(expandable)),
                         (large.batch_size, large.step_bytes, large.pool(expandable))), expandable)
        fixed, per_sample, allocations = fit.fixed_bytes, fit.per_sample_bytes, fit.usages[1].allocations
        at = f"at batch {fit.batches[0]} and {fit.batches[1]}"
        if expandable:
            at += ", + one 20 MiB and one 2 MiB page of mapping granularity"
    else:
        # the pool the model reserves at the anchor, its mapped end rounded to whole pages: exact there (the batch
        # the plan settles on is always an anchor), so no page allowance on top
        summary = tracer.step(capacity, anchor, pools=True)
        usage = summary.pool(expandable)
        beyond = usage.reserved_bytes - summary.step_bytes
        fixed, per_sample, allocations = 0, -(-max(beyond, 0) // anchor), usage.allocations
        at = f"at batch {anchor}, in proportion (the pool's mapped end in whole pages)"
    text = (f"allocator model over the traced step's {allocations} allocations ({mode}): "
            f"pool reserved - step live peak {at}")
    return Component(ComponentName.CUDA_GRAPHS, fixed, per_sample, text + (f" ({note})" if note else ""))


def build_components(config: Config, device: DeviceInfo, inputs: PlanInputs, anchor: int | None = None,
                     lines_at: tuple[int, int] = TRACE_BATCHES, planning: Planning | None = None
                     ) -> tuple[list[Component], int]:
    """Every consumer, in any order (the planner orders them), and the planned replay capacity.

    The step's components are lines through traces at ``lines_at`` (the graph pool's at
    ``GRAPH_POOL_BATCHES``), or, with ``anchor``, in proportion to one trace at ``anchor``: exact there, for
    checking or choosing a batch there (``plan_for_device``). Lines through two traces would not be exact at
    either when the step's peak moves to another phase between them (per group, the shares change)."""
    spec = transition_spec()
    num_envs = config.collect.num_envs
    overhead = device_overhead_components(config, device)  # CUDA's own bytes: not free for the replay's share
    if device.free_bytes is None:
        capacity = max(config.replay.capacity // num_envs, config.learn.n_step) * num_envs
        replay = Component(ComponentName.REPLAY, 0, 0, "memory unknown: not sized")
    else:
        cuda_own = sum(c.fixed_bytes for c in overhead)
        replay, capacity = replay_component(config, spec, max(device.free_bytes - cuda_own, 0), num_envs)

    traced_config, note = trace_config(config, device)
    tracer = tracer_for(config, device, traced_config, inputs.num_bars, planning)
    graphs = device.kind == "cuda" and config.train.cuda_graphs
    collect = tracer.collect(capacity, pools=graphs)
    groups = (*MEMORY_GROUPS, ComponentName.REPLAY, ComponentName.HER, OTHER)
    if anchor is None:  # lines through two traces, above both
        first, second = (tracer.step(capacity, b, pools=graphs and b in GRAPH_POOL_BATCHES) for b in lines_at)
        lines = {name: line_above((first.batch_size, first.step_by_group.get(name, 0)),
                                  (second.batch_size, second.step_by_group.get(name, 0)))
                 for name in groups}
        how = f"traced update at batch {lines_at[0]} and {lines_at[1]}"
    else:  # in proportion to one trace at the anchor: exact there, whichever phase holds the step's peak
        trace = tracer.step(capacity, anchor, pools=graphs)
        lines = {name: (0, -(-max(trace.step_by_group.get(name, 0), 0) // anchor)) for name in groups}
        how = f"traced update at batch {anchor}, in proportion"
    how += f" ({note})" if note else ""
    networks = tracer.networks(capacity)
    components = [with_traced_step(replay, lines[ComponentName.REPLAY], f"sampling and priorities: {how}")]
    her_text = f"future-goal relabelling: {how}" if config.replay.her else "replay.her = false"
    components.append(with_traced_step(Component(ComponentName.HER, 0, 0, ""), lines[ComponentName.HER], her_text))
    components.append(collector_component(inputs, num_envs, collect))
    components.extend(overhead)
    for name in MEMORY_GROUPS:
        components.append(Component(
            name,
            networks[name] + lines[name][0],
            lines[name][1],
            f"params{' + target' if name != 'iql' else ''} + grads + Adam m,v of the real modules; {how}",
        ))
    if inputs.world_size > 1:  # a rank of a data-parallel job: the all-reduce's buffer and NCCL's own memory
        components.extend(distributed_components(inputs.world_size, networks[GRADIENTS], device.kind))
    other_fixed, other_per_sample = lines[OTHER]
    components.append(Component(
        ComponentName.BATCH,
        other_fixed,
        other_per_sample,
        f"observations, losses, optimizer temporaries: {how}",
    ))
    components.append(cuda_graphs_component(config, device, tracer, capacity, note, anchor))
    return components, capacity


def collector_component(inputs: PlanInputs, num_envs: int, collect: TraceSummary) -> Component:
    """The market's tensors, the env's state and one collector step; captured in a CUDA graph (``collect`` traced
    with pools), the step's live peak is what the graph's own private pool reserves for it (the allocator model
    over the traced step: segments and, with expandable segments, whole 20 MiB and 2 MiB pages)."""
    text = f"market tensors ({inputs.num_bars} bars) + env state ({num_envs} envs) + traced collector step peak"
    step = collect.step_bytes
    if collect.pools:
        expandable = expandable_segments_enabled()
        pool = collect.pool(expandable).reserved_bytes
        text += (f", held in the collector graph's pool: {format_bytes(pool)} reserved for its "
                 f"{format_bytes(step)} live peak (allocator model, "
                 f"{'expandable segments' if expandable else 'default allocator'})")
        step = max(step, pool)
    return Component(ComponentName.COLLECTOR, inputs.market_bytes + env_state_bytes(num_envs) + step, 0, text)


def with_traced_step(component: Component, line: tuple[int, int], how: str) -> Component:
    """``component`` plus its group's share of the traced step (``line``: fixed, per-sample bytes)."""
    text = "; ".join(part for part in (component.derived_from, how) if part)
    return Component(component.name, component.fixed_bytes + line[0], line[1], text)


def profile_driver_bytes(config: Config, device: DeviceInfo) -> tuple[int, str]:
    """Driver-side bytes for ``device`` and who measured them: its profile's, else the ``default`` profile's (a
    measurement on another card, better than none; ``fitdqn profile`` measures this one). 0 off CUDA."""
    if device.kind != "cuda":
        return 0, ""
    profiles = load_profiles(config.budget.profiles_dir or None)
    profile = match_profile(profile_name_of(device, profiles), profiles)
    if profile.driver_bytes is None:
        profile = profiles[DEFAULT_PROFILE]
    return profile.driver_bytes or 0, profile_driver_source(profile)


def device_overhead_components(config: Config, device: DeviceInfo) -> list[Component]:
    """CUDA's own bytes: ``cuda_overhead`` (workspaces) and ``cuda_driver`` (``profile_driver_bytes``)."""
    if device.kind != "cuda":
        return [Component(ComponentName.CUDA_OVERHEAD, 0, 0, "CPU device: none")]
    driver_bytes, source = profile_driver_bytes(config, device)
    components = [cuda_overhead_component(device.compute_capability, expandable=expandable_segments_enabled())]
    if driver_bytes:
        components.append(cuda_driver_component(driver_bytes, source))
    return components


def plan_for_device(config: Config, device: DeviceInfo, inputs: PlanInputs | None = None,
                    planning: Planning | None = None) -> Plan:
    """The plan: components from the real objects, the batch chosen last (``fitdqn.plan.planner.make_plan``).

    The step's lines are fitted at a few hundred to a few thousand samples and are loose elsewhere: the
    step's live peak grows more slowly than its slope far beyond (the staging buffers of reductions over the
    batch stop growing once they fill the GPU's SMs), its peak moves between phases (lines through 512 and 1024
    missed the step at 8192 by 7 %), and the graph pool's slack is not linear in the batch. So every batch the
    plan settles on is planned with the step's components in proportion to the step at that batch: a profile or
    user batch is checked there; an auto batch is searched (``refine_auto_batch``). The update is traced at two
    batches and derived at every other (``fit_update``)."""
    planning = planning if planning is not None else Planning()
    with planning.traced_sessions():  # one stand-in system per traced capacity, built once for every trace below
        start = len(planning.notes)
        plan = _plan_for_device(config, device, inputs, planning)
        notes = tuple(dict.fromkeys(planning.notes[start:]))
        del planning.notes[start:]
        return dataclasses.replace(plan, notes=(*plan.notes, *notes)) if notes else plan


def _plan_for_device(config: Config, device: DeviceInfo, inputs: PlanInputs | None, planning: Planning) -> Plan:
    config = resolve_for_device(config, device)
    profiles = load_profiles(config.budget.profiles_dir or None)
    profile, profile_note = profile_with_note(profile_name_of(device, profiles), profiles) \
        if device.kind == "cuda" else (match_profile(device.name, profiles), "")
    inputs = inputs or PlanInputs.from_config(config)
    budget = config.budget
    choice = batch_choice(budget)
    wanted = (choice.size if isinstance(choice, FixedBatch) else profile.batch_size if isinstance(choice, ProfileBatch)
              else 0)
    # a known batch: the step's components in proportion to the step traced (or derived) there, exact there
    # whichever phase holds the step's peak (lines through other batches can miss it by several per cent)
    anchor = wanted if wanted > 0 and device.free_bytes is not None else None
    plan = None
    graphed = device.kind == "cuda" and config.train.cuda_graphs
    if isinstance(choice, AutoBatch) and device.free_bytes is not None and graphed:
        # an auto batch on a graphed GPU: the graph pool's traces (GRAPH_POOL_BATCHES) come first, so lines
        # through them guess the batch; beyond them it is searched by anchored traces (refine_auto_batch) and
        # the traces at TRACE_BATCHES are never needed
        try:
            components, capacity = build_components(config, device, inputs, lines_at=GRAPH_POOL_BATCHES,
                                                    planning=planning)
            guess = make_plan(device, profile, budget, components, capacity, sampleable_capacity(config, capacity))
        except (InfeasiblePlan, ReplayTooSmall):
            guess = None  # a small card: the lines at TRACE_BATCHES below decide (and say why, if nothing fits)
        if guess is not None and guess.batch_size > max(GRAPH_POOL_BATCHES):
            plan = refine_auto_batch(config, device, inputs, profile, guess, GRAPH_POOL_BATCHES, planning)
    if plan is None:
        components = None
        try:
            components, capacity = build_components(config, device, inputs, anchor, planning=planning)
            make_plan(device, profile, budget, components, capacity)  # the memory's verdict first
        except (InfeasiblePlan, ReplayTooSmall) as error:  # say what would be enough, not only what is short
            if components is None and device.free_bytes is not None:  # the replay failed before the step was traced
                components, _ = build_components(config, dataclasses.replace(device, free_bytes=None), inputs,
                                                 anchor, planning=planning)
            needed = least_free_bytes(config, device, profile, components) if components is not None else None
            if needed is None:
                raise
            raise InfeasiblePlan(
                f"{format_bytes(device.free_bytes)} free on {device.name} is too little for this config: it needs "
                f"about {format_bytes(needed)} free (at that, `fitdqn plan --free-memory "
                f"{math.ceil(needed / 2**20)}MiB` shows its plan). {error}"
            ) from None
        plan = make_plan(device, profile, budget, components, capacity, sampleable_capacity(config, capacity))
        if plan.batch_source == "auto" and device.free_bytes is not None:
            plan = refine_auto_batch(config, device, inputs, profile, plan, TRACE_BATCHES, planning)
    if plan.batch_source != "auto" and device.free_bytes is not None and device.kind == "cuda":
        largest = largest_fitting_batch(config, device, inputs, plan, planning)
        plan = dataclasses.replace(plan, max_fitting_batch=largest)
    notes = tuple(note for note in (device.described_from, profile_note) if note)
    return dataclasses.replace(plan, notes=(*notes, *plan.notes)) if notes else plan


def largest_fitting_batch(config: Config, device: DeviceInfo, inputs: PlanInputs, plan: Plan,
                          planning: Planning) -> int | None:
    """The largest batch that fits, as an auto batch finds it (``refine_auto_batch``), whatever batch ``plan`` was
    asked for: one answer on a card, where lines anchored at the asked batch extrapolate from there (at a profile
    batch of a few thousand they gave a third of the batch that fits). Never below the batch ``plan`` checked."""
    auto = dataclasses.replace(config, budget=dataclasses.replace(config.budget, batch_size=0))
    try:
        searched = _plan_for_device(auto, device, inputs, planning).max_fitting_batch
    except (InfeasiblePlan, ReplayTooSmall):  # the asked batch was checked; the search found none: keep the lines'
        return plan.max_fitting_batch
    return max(searched, plan.batch_size) if searched is not None else plan.max_fitting_batch


def profile_name_of(device: DeviceInfo, profiles) -> str:
    """The name a profile is matched on: a what-if alias (``rtx3050ti``) by its card's real name, unless a profile
    bears the alias itself."""
    card = find_card(device.name) if device.what_if else None
    return card.name if card is not None and device.name.strip().lower() not in profiles else device.name


def sampleable_capacity(config: Config, capacity: int) -> int:
    """The most transitions a replay of ``capacity`` serves at once (``replay.sampler.sampleable_steps`` when
    full: the last ``n_step - 1`` lockstep steps wait for their window); refuses a replay that can never reach
    ``replay.min_fill`` (the trainer would wait for it forever)."""
    num_envs = config.collect.num_envs
    sampleable = max(capacity // num_envs - (config.learn.n_step - 1), 0) * num_envs
    if sampleable < config.replay.min_fill:
        raise InfeasiblePlan(
            f"the replay holds {capacity} transitions, of which at most {sampleable} can be sampled at once "
            f"(the last {config.learn.n_step - 1} steps of {num_envs} envs wait for their n-step window), "
            f"below replay.min_fill = {config.replay.min_fill}: no update would ever run; raise replay.capacity "
            "or lower replay.min_fill"
        )
    return sampleable


LEAST_FREE_RESOLUTION = 2**20  # bytes: how close least_free_bytes gets
LEAST_FREE_LIMIT = 2**40  # bytes: least_free_bytes gives up beyond this


def least_free_bytes(config: Config, device: DeviceInfo, profile, components: list[Component]) -> int | None:
    """The least free memory (to ``LEAST_FREE_RESOLUTION``) at which this config's plan succeeds on ``device``;
    None if the device's memory is unknown or not even ``LEAST_FREE_LIMIT`` would do. ``components``: the plan's
    (``build_components``); the step's do not depend on the free memory, so each trial of the bisection only sizes
    the replay for its free memory (it grows with it, up to replay.capacity) and re-plans."""
    if device.free_bytes is None:
        return None
    cuda_own = sum(c.fixed_bytes for c in device_overhead_components(config, device))
    spec, num_envs = transition_spec(), config.collect.num_envs

    def fits(free: int) -> bool:
        trial = dataclasses.replace(device, free_bytes=free, total_bytes=max(device.total_bytes or 0, free))
        try:
            replay, capacity = replay_component(config, spec, max(free - cuda_own, 0), num_envs)
            # the replay sized for this free memory, with the step's per-sample share it was traced with
            sized = [dataclasses.replace(c, fixed_bytes=replay.fixed_bytes) if c.name == ComponentName.REPLAY else c
                     for c in components]
            make_plan(trial, profile, config.budget, sized, capacity)
        except (InfeasiblePlan, ReplayTooSmall):
            return False
        return True

    low, high = device.free_bytes, max(2 * device.free_bytes, 2**30)
    while not fits(high):
        low, high = high, 2 * high
        if high > LEAST_FREE_LIMIT:
            return None
    while high - low > LEAST_FREE_RESOLUTION:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


AUTO_REFINE_ROUNDS = 5
AUTO_REFINE_CONVERGED = 0.01  # stop when the next anchor would move the batch by less than this fraction


def refine_auto_batch(config: Config, device: DeviceInfo, inputs: PlanInputs, profile, plan: Plan,
                      lines_at: tuple[int, int], planning: Planning) -> Plan:
    """The largest auto batch whose traced need fits, by re-anchoring the step's lines at the candidate.

    Round k plans with components in proportion to a trace at ``B_k``, exact at ``B_k``: the plan's batch
    ``P_k`` is at least ``B_k`` exactly when the traced step at ``B_k`` (with its modelled graph pool) fits.
    The next anchor is ``P_k``, kept under any anchor that missed
    (:class:`fitdqn.plan.planner.BatchSearch`); the answer is the largest anchor that fitted, stopping when
    the next one would move it by less than ``AUTO_REFINE_CONVERGED``. Never larger than an anchor that was
    checked: what lies beyond it is only extrapolated. If no anchor fitted within ``AUTO_REFINE_ROUNDS`` (each
    round that misses lowers the next anchor), the smaller of the lines' batch and the last candidate is kept, and a
    note says so."""
    anchor, fitted, search = plan.batch_size, None, BatchSearch(AUTO_REFINE_CONVERGED)
    for _ in range(AUTO_REFINE_ROUNDS):
        components, capacity = build_components(config, device, inputs, anchor, planning=planning)
        candidate = make_plan(device, profile, config.budget, components, capacity,
                              sampleable_capacity(config, capacity))
        fits = candidate.max_fitting_batch is not None and candidate.max_fitting_batch >= anchor
        if fits and (fitted is None or anchor > fitted[0]):
            fitted = (anchor, candidate)
        proposal = search.next(anchor, fits, candidate.batch_size)
        if proposal is None:
            break
        anchor = proposal
    if fitted is None:
        batch = min(plan.batch_size, anchor)
        return dataclasses.replace(plan, batch_size=batch, notes=(
            *plan.notes, f"auto batch {batch}: not checked by a trace (no traced batch fitted in "
                         f"{AUTO_REFINE_ROUNDS} rounds)"))
    batch, candidate = fitted
    note = (f"auto batch {batch}: the step at {batch} samples (traced, or derived from two traces) fits "
            f"(the lines fitted at {max(lines_at)} samples gave {plan.batch_size})")
    return dataclasses.replace(candidate, batch_size=batch, notes=(*candidate.notes, note))
