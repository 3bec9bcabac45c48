"""Which named group of modules is running now: the owner of an allocation, forward and backward.

Forward: a forward pre-hook on each module of a group pushes the group's name, a forward hook pops it, so an
allocation belongs to the innermost group module running (nested groups: the inner one wins).

Backward: the autograd engine runs graph nodes, not modules. While the forward runs, a ``TorchFunctionMode``
labels every autograd node that each torch call creates with the group running at that moment (the node's
``metadata``; a walk from the call's outputs through nodes not labelled yet, so nodes made inside a composite
op are labelled too). Calls that bypass torch functions (a custom ``autograd.Function.apply``) are labelled
by the group module's forward hook, which walks back from the module's outputs the same way. In backward,
``torch._C._current_autograd_node()`` names the node the engine is running and its label is the owner (the
engine sums gradients that meet at a node while the producing node is still current; any allocation
between two nodes falls to the node that ran last on that thread). Nodes made outside every group
(the loss, the inputs) and the optimizer step belong to ``OTHER``.

Calls: parts of a step that are not modules (a replay's sampling) are named by ``(object, attribute)`` pairs
(``attach_calls``): for the trace the attribute is replaced by a wrapper that pushes the group's name around
the call, as a module's hooks do (the innermost group running wins); the attribute is put back on exit.

Storages keep the owner they had when they were made ("creator pays"): an input batch made outside the
groups stays in ``OTHER`` even when a group saves it for backward.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

OTHER = "other"
_LABEL = "fitdqn_budget_group"  # key in an autograd node's metadata dict


class GroupOwner:
    """Answers ``owner()`` (the group to charge now) and ``in_backward()`` for ``LiveBytes``."""

    def __init__(self) -> None:
        self.groups: dict[str, list[nn.Module]] = {}
        self._stack: list[str] = []
        self._last_backward: dict[int, str] = {}  # thread id -> label of the node that ran last
        self._handles: list = []
        self._wrapped: list[tuple[object, str, bool, object]] = []  # (object, attribute, own attribute?, original)

    # -- who owns an allocation now --------------------------------------------------------------------
    def owner(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            label = node.metadata.get(_LABEL, OTHER)
            self._last_backward[threading.get_ident()] = label
            return label
        if self._stack:
            return self._stack[-1]
        if torch._C._current_graph_task_id() != -1:
            # inside a backward pass but between two nodes: the node that ran last on this thread
            return self._last_backward.get(threading.get_ident(), OTHER)
        return OTHER

    def in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def forward_group(self) -> str:
        return self._stack[-1] if self._stack else OTHER

    # -- hooks -----------------------------------------------------------------------------------------
    @contextmanager
    def active(self) -> Iterator[None]:
        """Node labelling on (and the module hooks ``attach`` adds); everything removed on exit."""
        try:
            with _NodeLabeller(self):
                yield
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            for obj, attribute, own, original in reversed(self._wrapped):
                if own:
                    setattr(obj, attribute, original)
                else:
                    delattr(obj, attribute)  # the class's method shows through again
            self._wrapped.clear()
            self._stack.clear()
            self.groups = {}

    def attach(self, groups: dict[str, Iterable[nn.Module]]) -> None:
        """Hook the modules of each group (call inside ``active``). A module belongs to one group."""
        groups = {name: list(modules) for name, modules in groups.items()}
        if OTHER in groups:
            raise ValueError(f"group name {OTHER!r} is reserved for what belongs to no group")
        seen: dict[int, str] = {}
        for name, modules in groups.items():
            for module in modules:
                if seen.get(id(module), name) != name:
                    raise ValueError(f"module {type(module).__name__} is in groups {seen[id(module)]!r} "
                                     f"and {name!r}: a module belongs to one group")
                seen[id(module)] = name
        for name, modules in groups.items():
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(self._push(name)))
                self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        self.groups = groups

    def attach_calls(self, calls: dict[str, Iterable[tuple[object, str]]] | None) -> None:
        """Charge what each ``(object, attribute)`` call allocates to its group (call inside ``active``)."""
        for name, pairs in (calls or {}).items():
            if name == OTHER:
                raise ValueError(f"group name {OTHER!r} is reserved for what belongs to no group")
            for obj, attribute in pairs:
                original = getattr(obj, attribute)
                self._wrapped.append((obj, attribute, attribute in vars(obj), original))
                setattr(obj, attribute, self._charged(name, original))

    def _charged(self, name: str, call):
        def charged(*args, **kwargs):
            self._stack.append(name)
            try:
                return call(*args, **kwargs)
            finally:
                self._stack.pop()

        return charged

    def _push(self, name: str):
        def hook(module, args):
            self._stack.append(name)

        return hook

    def _pop(self, module, args, output):
        # label what the torch-function labeller could not see (autograd.Function.apply, C++ internals)
        if torch.is_grad_enabled() and self._stack:
            roots = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.grad_fn]
            label_new_nodes(roots, self._stack[-1])
        self._stack.pop()


class _NodeLabeller(TorchFunctionMode):
    """After each torch call, labels the autograd nodes it created with the forward group running now."""

    def __init__(self, owner: GroupOwner):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
            roots = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn]
            if roots:
                label_new_nodes(roots, self.owner.forward_group())
        return out


def label_new_nodes(roots: list, label: str) -> None:
    """Label ``roots`` and every node behind them that has no label yet (labelled nodes stop the walk)."""
    pending = [node for node in roots if node is not None]
    while pending:
        node = pending.pop()
        metadata = node.metadata
        if _LABEL in metadata:
            continue
        metadata[_LABEL] = label
        pending.extend(child for child, _ in node.next_functions if child is not None)
