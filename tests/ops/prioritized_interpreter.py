"""The prioritized replay's Triton kernels on the CPU, under Triton's interpreter: run as a script by
``test_prioritized_fused.py`` (``python prioritized_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON
line.

Here the Triton launchers are called directly on CPU
tensors, beside the torch maths of :mod:`fitdqn.ops.prioritized` on copies of the same tree.
"""

from __future__ import annotations

import torch
from triton_interpreter import interpreted_main  # next to this script

# (name, leaves, fanout, batch, zero share): the tree's depth is 1, 3, 5, 6 and 4 levels
CASES = [
    ("one-level", 40, 64, 33, 0.0),
    ("fanout64-3-levels", 100_003, 64, 300, 0.2),
    ("fanout8-5-levels", 5_000, 8, 257, 0.3),
    ("fanout4-6-levels", 3_000, 4, 129, 0.0),
    ("fanout24-not-a-power-of-two", 20_000, 24, 200, 0.1),
]


def tree(leaves: int, fanout: int, zero_share: float, seed: int):
    from support.replay_reference import update_max

    from fitdqn.replay.sum_tree import SumTree

    generator = torch.Generator().manual_seed(seed)
    made = SumTree(leaves, fanout, "cpu")  # on the CPU: the torch maths
    values = torch.rand(leaves, generator=generator, dtype=torch.float64) ** 2
    values[torch.rand(leaves, generator=generator) < zero_share] = 0.0
    update_max(made, torch.arange(leaves), values)
    return made, generator


def run_case(name, leaves, fanout, batch, zero_share):
    from fitdqn.ops import prioritized, prioritized_triton

    made, generator = tree(leaves, fanout, zero_share, leaves + fanout)
    copy = [level.clone() for level in made.levels]
    uniform = torch.rand(batch, 3, generator=generator, dtype=torch.float64)[:, 0]  # a strided column, as sampled
    written = torch.tensor(leaves // 4 + 7)
    beta = torch.tensor(0.55, dtype=torch.float64)
    lowest = torch.zeros((), dtype=torch.int64)
    index, weight = prioritized_triton.fused_draw(made.levels, uniform, written, beta, lowest, fanout, leaves,
                                                  leaves // 4, 3, 4)
    ref_index, ref_weight = prioritized.draw_reference(copy, uniform, written, beta, fanout, leaves, leaves // 4,
                                                       3, 4)
    lowest_drawn = float(lowest.view(torch.float64)) == float(copy[-1][index].min())
    priorities = torch.randn(batch, generator=generator, dtype=torch.float32)
    update_index = torch.cat([index[: batch // 2], index[: batch // 4]])  # duplicates, with other priorities
    update_priorities = torch.cat([priorities[: batch // 2], priorities[batch // 2: batch // 2 + batch // 4]])
    max_priority = torch.tensor(0.25, dtype=torch.float64)
    ref_max = max_priority.clone()
    prioritized_triton.fused_update(made.levels, max_priority, update_index, update_priorities, 0.6, 1e-3, fanout)
    prioritized.update_reference(copy, ref_max, update_index, update_priorities, 0.6, 1e-3, fanout)
    leaf_error = (made.levels[-1] - copy[-1]).abs().max().item()
    node_error = max(((a - b).abs() / b.abs().clamp(min=1e-300)).max().item()
                     for a, b in zip(made.levels, copy, strict=True))
    # errors: weights absolute (f32), leaves absolute (values in [1e-3 ** 0.6, ~2]), nodes relative, max absolute
    return {"depth": len(copy), "same_index": bool(torch.equal(index, ref_index)),
            "weight_error": (weight - ref_weight).abs().max().item(), "weight_dtype": str(weight.dtype),
            "zero_leaf_drawn": bool((copy[-1][index] == 0).any()), "lowest_is_min": lowest_drawn,
            "leaf_error": leaf_error, "node_error": node_error, "max_error": abs(max_priority.item() - ref_max.item())}


def run_cases() -> dict:
    return {case[0]: run_case(*case) for case in CASES}


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.prioritized_triton", run_cases, bf16=False)
