"""The C51 projection's Triton kernel on the CPU, under Triton's interpreter: run as a script by
``test_projection_fused.py`` (``python projection_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON
line.

Why a separate process: as for ``iqn_interpreter.py``, Triton reads ``TRITON_INTERPRET`` when a kernel
is *defined*, and the setting holds for the whole process.

In this process the Triton launcher is registered as the *CPU* kernel of ``fitdqn::categorical_projection``, so
``categorical_projection(...)`` runs the operator and its kernel (landing positions included) end to
end on CPU tensors. Errors are ``max |result - reference|`` (probabilities): against the per-atom loop of
``tests/support/projection_reference.py`` and against the CPU kernel's torch maths (the positions of
``atom_positions``, the dense hat); ``mass`` is ``max |sum_i out_i - 1|``.

``HAT_CASES`` check the positions themselves: with one-hot distributions (branch k all on atom k) each output row
is one atom's hat, ``max(0, 1 - |x_k - i|)``, exact in both forms. ``torch``: against the torch path's hats;
``unfused``: against the same torch maths with ``start + discount j`` rounded twice, as the interpreter's
``tl.fma`` (numpy) rounds it (a GPU fuses it, as ATen's CPU ``addcmul``), which must agree bit for bit.
``STRIDED``: the operator called directly with strided rewards and discounts (an expanded ``[B, 1]``, a column of a
wider tensor, a bf16 one), against the torch path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton_interpreter import interpreted_main  # next to this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package

# (name, batch, branches (0: probs [B, A]), atoms, v_max (support [-v_max, v_max]), rewards per branch ([B, br]),
#  discounts per branch)
CASES = [
    ("A51-B5-br3-far", 5, 3, 51, 10.0, False, False),  # rewards far beyond the support, a terminal
    ("A51-B7-2d", 7, 0, 51, 10.0, False, False),  # odd R, discount 1 and 0
    ("A11-B4-exact", 4, 0, 11, 10.0, False, False),  # landings exactly on atoms and on v_max
    ("A21-B3-br3-branch-rewards", 3, 3, 21, 5.0, True, False),  # as the update with learn.iql_in_target
    ("A51-B6-br3-branch-both", 6, 3, 51, 10.0, True, True),  # far beyond both ends, terminal, per branch
    ("A13-B5-br2-branch-rewards", 5, 2, 13, 3.0, True, False),
    ("A51-B0-empty", 0, 3, 51, 10.0, False, False),  # R = 0
]
# (name, atoms, v_max, batch, rewards per branch)
HAT_CASES = [("hats-A51", 51, 10.0, 12, False), ("hats-A51-branch-rewards", 51, 10.0, 6, True),
             ("hats-A13", 13, 3.0, 12, False)]


def inputs(batch, branches, atoms, v_max, branch_rewards, branch_discounts):
    """``probs [B, (br,) A]``, rewards and discounts ``[B]`` (``[B, br]`` where per branch), support ``[A]``."""
    generator = torch.Generator().manual_seed(atoms + batch)
    shape = (batch, branches, atoms) if branches else (batch, atoms)
    probs = torch.softmax(torch.randn(shape, generator=generator), dim=-1)
    support = torch.linspace(-v_max, v_max, atoms)
    rewards = torch.randn(shape[:-1] if branch_rewards else (batch,), generator=generator) * 0.8 * v_max
    discounts = torch.rand(shape[:-1] if branch_discounts else (batch,), generator=generator)
    if atoms == 11:  # dz = 2: r = 2 with discount 1 moves every atom one up; -4 and 10 are atoms (10 = v_max)
        rewards, discounts = torch.tensor([2.0, -4.0, 0.0, 10.0]), torch.tensor([1.0, 0.0, 0.5, 1.0])
    elif batch >= 2:
        rewards[0], rewards[1] = 3 * v_max, -2.5 * v_max  # far beyond the support
        discounts[0], discounts[1] = 1.0, 0.0
        if branch_rewards and branches > 1:
            rewards[2, 0], rewards[2, 1] = 4 * v_max, -4 * v_max  # both ends within one sample
    return probs, rewards, discounts, support


def hat_inputs(atoms, v_max, batch, branch_rewards):
    """One-hot distributions ``[B, A (branch k), A]`` (branch k all on atom k), rewards ``[B]`` or ``[B, A]``
    (beyond both ends too), discounts ``[B]`` (0 and 1 among them), support ``[A]``."""
    generator = torch.Generator().manual_seed(atoms + batch + 1)
    probs = torch.eye(atoms).expand(batch, atoms, atoms)
    rewards = torch.randn((batch, atoms) if branch_rewards else (batch,), generator=generator) * v_max
    rewards[0], rewards[1] = 3 * v_max, -3 * v_max
    discounts = torch.rand(batch, generator=generator)
    discounts[1], discounts[2] = 0.0, 1.0
    return probs, rewards, discounts, torch.linspace(-v_max, v_max, atoms)


def positions_unfused(rewards, discounts, support):
    """``atom_positions(3, ...)`` with ``start + discount j`` a multiply and an add, each rounded."""
    atoms = support.shape[0]
    rewards = rewards.reshape(rewards.shape + (1,) * (3 - rewards.dim()))
    discounts = discounts.reshape(discounts.shape + (1,) * (3 - discounts.dim()))
    dz = (support[-1] - support[0]) / (atoms - 1)
    start = (rewards - (1.0 - discounts) * support[0]) / dz
    return (start + discounts * torch.arange(atoms, dtype=torch.float32)).clamp_(0.0, atoms - 1.0)


def reference(probs, rewards, discounts, support):
    """The per-atom loop of ``support.projection_reference``, branch by branch where the rewards or discounts are
    per branch."""
    from support.projection_reference import project_loop

    if not probs.numel():
        return probs.double()
    if rewards.dim() == 1 and discounts.dim() == 1:
        return project_loop(probs, rewards, discounts, support)
    return torch.stack([project_loop(probs[:, k], rewards[:, k] if rewards.dim() == 2 else rewards,
                                     discounts[:, k] if discounts.dim() == 2 else discounts, support)
                        for k in range(probs.shape[1])], dim=1)


def error(value: torch.Tensor, expected: torch.Tensor) -> float:
    return (value.double() - expected.double()).abs().max().item() if expected.numel() else 0.0


def run_case(name, *case):
    from support.projection_reference import project_plain

    from fitdqn.learn.losses import categorical_projection

    probs, rewards, discounts, support = inputs(*case)
    fused = categorical_projection(probs, rewards, discounts, support)  # the Triton kernel
    dense = project_plain(probs, rewards, discounts, support)
    return {"loop": error(fused, reference(probs, rewards, discounts, support)), "dense": error(fused, dense),
            "mass": error(fused.sum(-1), torch.ones(fused.shape[:-1])),
            "shape": list(fused.shape), "dtype": str(fused.dtype)}


def run_hat_case(name, *case):
    from support.projection_reference import project_plain

    from fitdqn.learn.losses import categorical_projection
    from fitdqn.ops.projection import project_dense

    probs, rewards, discounts, support = hat_inputs(*case)
    fused = categorical_projection(probs, rewards, discounts, support)  # [B, A (k), A (i)]
    return {"torch": error(fused, project_plain(probs, rewards, discounts, support)),
            "unfused": error(fused, project_dense(probs, positions_unfused(rewards, discounts, support)))}


def run_strided():
    """The operator on strided rewards and discounts: ``[B, 1]`` expanded to ``[B, br]`` (stride 0), a column of
    ``[B, 2]``, ``[B, br]`` transposed from ``[br, B]``, bf16 discounts and probabilities."""
    from support.projection_reference import project_plain

    from fitdqn.ops.projection import project_returns

    probs, rewards, discounts, support = inputs(6, 3, 51, 10.0, True, False)
    wide = torch.stack([discounts, 1.0 - discounts], dim=1)  # [B, 2]: discounts are its column 0
    errors = {}
    for name, (by_row_rewards, by_row_discounts) in {
        "expanded": (rewards[:, :1].expand(6, 3), wide[:, 0]),
        "transposed": (rewards.t().contiguous().t(), wide[:, :1].expand(6, 3)),
        "bf16": (rewards, discounts.bfloat16()),
    }.items():
        flat = probs.bfloat16() if name == "bf16" else probs
        got = project_returns(flat.reshape(18, 51), by_row_rewards, by_row_discounts, support).view(6, 3, 51)
        expected = project_plain(flat, by_row_rewards, by_row_discounts, support)
        errors[name] = error(got, expected)
    return errors


def use_triton_on_cpu() -> None:
    from fitdqn.ops import projection, projection_triton

    projection.project_returns.register_kernel("cpu", projection_triton.fused_projection)


def run_cases() -> dict:
    results = {case[0]: run_case(*case) for case in CASES}
    results.update({case[0]: run_hat_case(*case) for case in HAT_CASES})
    results["strided"] = run_strided()
    return results


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.projection_triton", run_cases, use_triton_on_cpu, bf16=False)
