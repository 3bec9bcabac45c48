"""A sum tree resident on the device: batched updates, and levels the prioritized draw descends (stratified
sampling, :mod:`fitdqn.ops.prioritized`), no host sync.

Layout: a ``fanout``-ary tree stored level by level, leaves last. Level sizes are padded to a multiple of
the fanout so every node's children are one contiguous row of ``level.view(-1, fanout)``; padding leaves
hold 0 and are never sampled. The root is not stored: it is the sum of the top level (at most ``fanout``
nodes). A wide fanout (``replay.tree_fanout``, 64 by default) keeps the depth at 4 for 16M leaves, so a descent
is a handful of batched kernels per level instead of ~24 levels of a binary tree.

Precision: float64. Updates never add deltas: each touched ancestor is recomputed as the sum of its
children (level by level, a scatter of recomputed sums), so a node always equals the sum of its current
children, whatever the number of updates. Float64 still matters for sampling: the descent compares a
prefix mass against ``u * total``; in float32 with 10M leaves one rounding step of the total is about half
an average leaf's mass, which would bias small priorities. Float64 makes that error ~1e-9 leaf masses.

Duplicate indices in one update: the largest value wins (``scatter_reduce(amax)``, deterministic;
:mod:`fitdqn.ops.prioritized`).

The ancestor rebuild is :func:`fitdqn.ops.sum_tree.propagate`: on CUDA with Triton one kernel per level,
else the torch reference it is checked against.
"""

from __future__ import annotations

import torch

from fitdqn.ops import prioritized as prioritized_ops
from fitdqn.ops import sum_tree as sum_tree_ops
from fitdqn.replay.storage import filled_rows

DTYPE = prioritized_ops.DTYPE


def level_sizes(num_leaves: int, fanout: int) -> list[int]:
    """Stored sizes of every level, top first, leaves last; each a multiple of ``fanout``."""
    if num_leaves < 1 or fanout < 2:
        raise ValueError("a sum tree needs at least one leaf and a fanout of at least 2")
    sizes = [-(-num_leaves // fanout) * fanout]
    while sizes[-1] > fanout:
        parents = sizes[-1] // fanout
        sizes.append(-(-parents // fanout) * fanout)
    return sizes[::-1]


class SumTree:
    """Priorities of ``num_leaves`` slots; sample slots with probability proportional to priority."""

    def __init__(self, num_leaves: int, fanout: int, device: torch.device | str):
        self.num_leaves = int(num_leaves)
        self.fanout = int(fanout)
        self.device = torch.device(device)
        self.levels = [torch.zeros(size, dtype=DTYPE, device=self.device) for size in
                       level_sizes(self.num_leaves, self.fanout)]

    @property
    def leaves(self) -> torch.Tensor:
        return self.levels[-1]  # [padded N] f64

    def tensors(self) -> list[torch.Tensor]:
        return list(self.levels)

    def total(self) -> torch.Tensor:
        """Sum of all priorities, a 0-dim f64 device tensor."""
        return self.levels[0].sum()

    # ---- updates -------------------------------------------------------------------------------------
    def assign(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Set leaves ``index [M]`` to ``values [M]``; indices must be unique (e.g. one lockstep step)."""
        self.leaves.index_copy_(0, index, values.to(DTYPE))
        self.propagate(index)

    def propagate(self, index: torch.Tensor) -> None:
        """Recompute every ancestor of leaves ``index [M]`` as the sum of its children, level by level.

        Duplicated parents get the same recomputed sum, so the scatter is deterministic.
        """
        sum_tree_ops.propagate(self.levels, index, self.fanout)

    def state_dict(self, leaves: int | None = None) -> dict[str, torch.Tensor]:
        """Every level; with ``leaves``, of the leaf level only the first ``leaves`` (the rest must be 0: slots
        never written), as a tensor of its own (:func:`fitdqn.replay.storage.filled_rows`). The upper levels are
        kept whole, as they are (about 1 / fanout of the leaves): loading rebuilds nothing, so a resumed tree is
        the saved one bit for bit, whichever kernel summed it."""
        state = {f"level{depth}": level for depth, level in enumerate(self.levels)}
        if leaves is not None and leaves < self.num_leaves:
            state[f"level{len(self.levels) - 1}"] = filled_rows(self.leaves, leaves)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """The levels of :meth:`state_dict`; a leaf level of fewer entries is padded with zeros."""
        for depth, level in enumerate(self.levels):
            source = state[f"level{depth}"]
            leaf_prefix = depth == len(self.levels) - 1 and source.dim() == 1 and source.shape[0] <= level.shape[0]
            if source.shape != level.shape and not leaf_prefix:
                raise ValueError(
                    f"sum tree level {depth}: shape {tuple(source.shape)} != {tuple(level.shape)}")
            level.zero_()
            level[: source.shape[0]].copy_(source)
