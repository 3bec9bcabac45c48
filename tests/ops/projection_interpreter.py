"""The C51 projection's Triton kernel on the CPU, under Triton's interpreter: run as a script by
``test_projection_fused.py`` (``python projection_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON
line.

Why a separate process: as for ``iqn_interpreter.py``, Triton reads ``TRITON_INTERPRET`` when a kernel
is *defined*, and the setting holds for the whole process.

In this process the Triton launcher is registered as the *CPU* kernel of ``fitdqn::categorical_projection``, so
``categorical_projection(..., fused=True)`` runs positions, operator and kernel end to end on CPU tensors.
Errors are ``max |result - reference|`` (probabilities): against the per-atom loop of
``tests/support/projection_reference.py``
and against the dense torch path (``fused=False``); ``mass`` is ``max |sum_i out_i - 1|``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package

# (name, batch, branches (0: probs [B, A]), atoms, v_max (support [-v_max, v_max]), per-branch rewards)
CASES = [
    ("A51-B5-br3-far", 5, 3, 51, 10.0, False),  # rewards far beyond the support, a terminal
    ("A51-B7-2d", 7, 0, 51, 10.0, False),  # odd R, discount 1 and 0
    ("A11-B4-exact", 4, 0, 11, 10.0, False),  # landings exactly on atoms and on v_max
    ("A21-B3-br3-branch-rewards", 3, 3, 21, 5.0, True),
    ("A51-B0-empty", 0, 3, 51, 10.0, False),  # R = 0
]


def inputs(batch, branches, atoms, v_max, branch_rewards):
    """``probs [B, (br,) A]``, rewards ``[B]`` (``[B, br]`` if per branch), discounts ``[B]``, support ``[A]``."""
    generator = torch.Generator().manual_seed(atoms + batch)
    shape = (batch, branches, atoms) if branches else (batch, atoms)
    probs = torch.softmax(torch.randn(shape, generator=generator), dim=-1)
    support = torch.linspace(-v_max, v_max, atoms)
    rewards = torch.randn(shape[:-1] if branch_rewards else (batch,), generator=generator) * 0.8 * v_max
    discounts = torch.rand(batch, generator=generator)
    if atoms == 11:  # dz = 2: r = 2 with discount 1 moves every atom one up; -4 and 10 are atoms (10 = v_max)
        rewards, discounts = torch.tensor([2.0, -4.0, 0.0, 10.0]), torch.tensor([1.0, 0.0, 0.5, 1.0])
    elif batch >= 2:
        rewards[0], rewards[1] = 3 * v_max, -2.5 * v_max  # far beyond the support
        discounts[0], discounts[1] = 1.0, 0.0
    return probs, rewards, discounts, support


def reference(probs, rewards, discounts, support):
    """The per-atom loop of ``support.projection_reference``, branch by branch where the rewards are per branch."""
    from support.projection_reference import project_loop

    if not probs.numel():
        return probs.double()
    if rewards.dim() == 1:
        return project_loop(probs, rewards, discounts, support)
    return torch.stack([project_loop(probs[:, k], rewards[:, k], discounts, support)
                        for k in range(probs.shape[1])], dim=1)


def error(value: torch.Tensor, expected: torch.Tensor) -> float:
    return (value.double() - expected.double()).abs().max().item() if expected.numel() else 0.0


def run_case(name, *case):
    from fitdqn.learn.losses import categorical_projection

    probs, rewards, discounts, support = inputs(*case)
    fused = categorical_projection(probs, rewards, discounts, support, fused=True)  # the Triton kernel
    dense = categorical_projection(probs, rewards, discounts, support)
    return {"loop": error(fused, reference(probs, rewards, discounts, support)), "dense": error(fused, dense),
            "mass": error(fused.sum(-1), torch.ones(fused.shape[:-1])),
            "shape": list(fused.shape), "dtype": str(fused.dtype)}


def use_triton_on_cpu() -> None:
    from fitdqn.ops import projection, projection_triton

    projection.project_positions.register_kernel("cpu", projection_triton.fused_projection)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or "fitdqn.ops.projection_triton" in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 in a fresh process")
    use_triton_on_cpu()
    print(json.dumps({case[0]: run_case(*case) for case in CASES}))


if __name__ == "__main__":
    main()
