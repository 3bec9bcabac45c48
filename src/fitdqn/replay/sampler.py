"""Which slots a batch uses: prioritized (sum tree) or uniform, over the sampleable window of the ring.

The ring holds steps ``max(0, T - S) .. T - 1`` (T = steps written, S = steps the ring holds). A step s is
sampleable once its n-step window is written: ``max(0, T - S) <= s <= T - n``. Both samplers read T from
the storage's device counter, so nothing here syncs with the host.

Prioritized: when step t is written, its slots (which held step t - S) drop to priority 0 and the slots of
step t - n + 1 enter at the running max priority; :meth:`PrioritizedSampler.update` never revives a slot
whose priority is 0 (it left the window between sample and update).
"""

from __future__ import annotations

import torch

from fitdqn.ops import prioritized as prioritized_ops
from fitdqn.replay.storage import RingStorage
from fitdqn.replay.sum_tree import SumTree


def sampleable_steps(storage: RingStorage, n_step: int) -> torch.Tensor:
    """Lockstep steps whose n-step window is written and not overwritten (0-dim int64)."""
    return prioritized_ops.sampleable_count(storage.written, storage.steps, n_step, 1)


class UniformSampler:
    """Every sampleable transition equally likely; weights are ones."""

    def __init__(self, storage: RingStorage, n_step: int):
        self.storage = storage
        self.n_step = n_step

    def tensors(self) -> list[torch.Tensor]:
        return []

    def on_write(self, step: torch.Tensor) -> None:
        """Nothing to track: the window follows the storage's counter."""

    def draw(self, uniform: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B] int64 slots, weight [B] f32 ones)``; ``uniform [B]`` f64 in [0, 1) picks them."""
        s = self.storage
        count = sampleable_steps(s, self.n_step) * s.num_envs  # 0-dim: sampleable transitions
        oldest = torch.clamp(s.written - s.steps, min=0)  # 0-dim: oldest step still held
        q = torch.minimum((uniform * count).long(), torch.clamp(count - 1, min=0))  # [B] rank in the window
        step = oldest + torch.div(q, s.num_envs, rounding_mode="floor")  # [B]
        index = torch.remainder(step, s.steps) * s.num_envs + torch.remainder(q, s.num_envs)
        return index, torch.ones(uniform.shape, device=uniform.device, dtype=torch.float32)

    def update(self, index: torch.Tensor, priorities: torch.Tensor) -> None:
        """Uniform sampling ignores priorities."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class PrioritizedSampler:
    """Proportional prioritized replay (Schaul et al. 2016) on a device :class:`SumTree`.

    Leaves hold ``(|priority| + eps) ** alpha``; new transitions enter at the running max leaf value.
    Importance weights ``w = (N * P(i)) ** -beta`` normalised by the batch maximum. The draw and the update are the
    operators of :mod:`fitdqn.ops.prioritized` (Triton kernels on CUDA, the torch maths elsewhere).
    """

    def __init__(self, storage: RingStorage, n_step: int, alpha: float, priority_eps: float, tree_fanout: int):
        if storage.steps < n_step:
            raise ValueError(f"the ring holds {storage.steps} steps, fewer than n_step {n_step}")
        self.storage = storage
        self.n_step = n_step
        self.alpha = float(alpha)
        self.eps = float(priority_eps)
        self.tree = SumTree(storage.capacity, tree_fanout, storage.device)
        self.max_priority = torch.ones((), dtype=torch.float64, device=storage.device)  # leaf space
        self.slot_pair = torch.zeros(2 * storage.num_envs, dtype=torch.int64, device=storage.device)
        # the Triton draw's scratch: the batch's smallest leaf, as the bits of a non-negative float64 (they order as
        # int64 do); the torch maths leaves it alone
        self.lowest_leaf = torch.zeros((), dtype=torch.int64, device=storage.device)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.tree.tensors(), self.max_priority, self.slot_pair, self.lowest_leaf]

    def on_write(self, step: torch.Tensor) -> None:
        """Step ``step`` (0-dim) was just written: its slots leave, step - n + 1 enters at max priority."""
        s, num_envs = self.storage, self.storage.num_envs
        written_slots = s.step_slots(step)  # [E]
        entering = step - (self.n_step - 1)  # 0-dim; negative in the first n - 1 steps
        entering_slots = s.step_slots(entering)  # [E]
        # Negative `entering` wraps to slots not yet written: they stay at 0.
        value = self.max_priority * (entering >= 0)  # 0-dim f64
        if self.n_step == 1:
            self.tree.assign(written_slots, value.expand(num_envs))
            return
        self.tree.leaves.index_fill_(0, written_slots, 0.0)
        self.tree.leaves.index_copy_(0, entering_slots, value.expand(num_envs))
        self.slot_pair[:num_envs] = written_slots
        self.slot_pair[num_envs:] = entering_slots
        self.tree.propagate(self.slot_pair)

    def draw(self, uniform: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [B] int64 slots, weight [B] f32)``, stratified by priority; ``uniform [B]`` places."""
        s, tree = self.storage, self.tree
        return prioritized_ops.prioritized_draw(tree.levels, uniform, s.written, beta, self.lowest_leaf, tree.fanout,
                                                tree.num_leaves, s.steps, self.n_step, s.num_envs)

    def update(self, index: torch.Tensor, priorities: torch.Tensor) -> None:
        """New priorities (e.g. |TD error|, before ``** alpha``) for slots ``index [B]``.

        A duplicated slot keeps its largest new priority. Slots at priority 0 (left the window since they
        were sampled) stay at 0. The running max follows the largest leaf written.
        """
        prioritized_ops.prioritized_update(self.tree.levels, self.max_priority, index, priorities, self.alpha,
                                           self.eps, self.tree.fanout)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The running max and the tree, its leaves up to the ring's filled slots (the others are 0)."""
        tree = {f"tree.{k}": v for k, v in self.tree.state_dict(leaves=self.storage.filled()).items()}
        return {"max_priority": self.max_priority, **tree}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        tree = {k.removeprefix("tree."): v for k, v in state.items() if k.startswith("tree.")}
        self.tree.load_state_dict(tree)
        self.max_priority.copy_(state["max_priority"])
