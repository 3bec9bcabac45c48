"""GPU replay: ring storage, device sum tree, prioritized/uniform sampling, n-step returns, HER.

Everything lives on the training device; write / sample / update_priorities make no host sync.
"""

from fitdqn.replay.buffer import REQUIRED_FIELDS, ReplayBuffer
from fitdqn.replay.storage import RingStorage
from fitdqn.replay.sum_tree import SumTree

__all__ = ["REQUIRED_FIELDS", "ReplayBuffer", "RingStorage", "SumTree"]
