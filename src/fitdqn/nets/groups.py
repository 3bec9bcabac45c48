"""Memory groups: which modules the planner counts under 'dqn', 'attention', 'iqn' and 'iql'.

Every submodule of the networks carries a ``memory_group`` attribute (set by :func:`tag`), so a forward
hook can attribute what a module allocates to one of the four groups (see
``fitdqn.memory.attribution``). :func:`parameter_groups` lists each group's top-level modules so the
planner can count parameters, target copies, gradients and Adam states per group.

- ``dqn``: the per-token trunk MLP (state -> trunk_hidden -> d_model) and the branching dueling C51 head;
- ``attention``: the self-attention block (Q, K/V and output projections, LayerNorm);
- ``iqn``: the IQN quantile head (cosine embedding projection, output layer);
- ``iql``: the IQL value net V(s).

The learner keeps a target copy of the Q network (``dqn``, ``attention``, ``iqn``), not of V(s).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import nn

MEMORY_GROUPS: tuple[str, ...] = ("dqn", "attention", "iqn", "iql")
GROUP_ATTR = "memory_group"
TARGET_COPIED: frozenset[str] = frozenset({"dqn", "attention", "iqn"})


def tag(module: nn.Module, group: str) -> nn.Module:
    """Mark ``module`` and all its submodules as belonging to ``group``; returns ``module``."""
    if group not in MEMORY_GROUPS:
        raise ValueError(f"unknown memory group {group!r}; groups: {', '.join(MEMORY_GROUPS)}")
    for sub in module.modules():
        setattr(sub, GROUP_ATTR, group)
    return module


def group_of(module: nn.Module) -> str | None:
    """The memory group a module was tagged with, or None (containers such as the whole Q network)."""
    return getattr(module, GROUP_ATTR, None)


@dataclass(frozen=True)
class ParameterGroup:
    """One memory group: its top-level modules and whether the learner keeps a target copy of them."""

    name: str
    modules: tuple[nn.Module, ...]
    target_copy: bool

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()

    def numel(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def parameter_groups(obj: object) -> dict[str, ParameterGroup]:
    """The four memory groups of a ``Learner`` (online Q network + V(s)), a module, or modules.

    Only online modules are listed (a Learner's target copy mirrors the groups with ``target_copy``);
    each parameter appears in exactly one group. Groups without modules (e.g. 'iql' when given only a
    Q network) are present with no modules, so callers can index all four names.
    """
    if hasattr(obj, "online") and hasattr(obj, "value"):
        roots: list[nn.Module] = [obj.online, obj.value]  # type: ignore[attr-defined]
    elif isinstance(obj, nn.Module):
        roots = [obj]
    elif isinstance(obj, Iterable):
        roots = list(obj)
    else:
        raise TypeError(f"parameter_groups: expected a Learner, a module or modules, got {type(obj).__name__}")
    found: dict[str, list[nn.Module]] = {name: [] for name in MEMORY_GROUPS}
    for root in roots:
        for module in _top_tagged(root, parent_group=None):
            found[group_of(module)].append(module)  # type: ignore[index]
    return {
        name: ParameterGroup(name, tuple(modules), name in TARGET_COPIED) for name, modules in found.items()
    }


def _top_tagged(module: nn.Module, parent_group: str | None) -> Iterator[nn.Module]:
    """Top-most tagged modules; untagged parameters and a group nested in another are errors."""
    group = group_of(module)
    if group is not None and parent_group is not None and group != parent_group:
        raise ValueError(f"module {type(module).__name__} tagged {group!r} inside a {parent_group!r} module")
    if group is not None and parent_group is None:
        yield module
        parent_group = group
    if group is None and any(True for _ in module.parameters(recurse=False)):
        raise ValueError(f"module {type(module).__name__} owns parameters but has no memory group tag")
    for child in module.children():
        yield from _top_tagged(child, parent_group)
