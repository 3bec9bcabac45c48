"""The C51 fold's Triton kernels on the CPU, under Triton's interpreter: run as a script by ``test_fold.py``
(``python fold_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON line.

Why a separate process: as for ``iqn_interpreter.py``, Triton reads ``TRITON_INTERPRET`` when a kernel is *defined*,
and the setting holds for the whole process.

In this process the Triton launchers are registered as the *CPU* kernels of ``fitdqn::folded_output`` and its
backward op, so the operator, its autograd and ``BranchingDuelingC51`` run end to end on CPU tensors
through the kernels. While the operators run, ``torch.empty`` hands out NaN-filled tensors: an element a kernel
failed to write shows up as NaN.

Per case, for the folded weight and bias and each parameter's gradient: ``torch``, ``max |result - torch maths|``
(the CPU kernels' ops) over ``max |fp64 maths|``; ``fp64``, the same against the torch maths in
fp64 from the same inputs; ``equal``, whether the result equals the torch maths bit for bit; ``zeros``, whether
every element the fp64 maths makes exactly zero (padded sub-actions, padding rows, other branches' blocks) is zero.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from support.reference.nets import c51_head
from triton_interpreter import interpreted_main  # next to this script
from triton_interpreter import relative_error as error

# (name, branches, atoms, hidden, dtype): padding rows 3, 3, 7, 7, 0, 0, 7
CASES = [
    ("fp32-555-a51-h64", (5, 5, 5), 51, 64, "float32"),
    ("fp32-352-a51-h64", (3, 5, 2), 51, 64, "float32"),
    ("fp32-555-a7-h16", (5, 5, 5), 7, 16, "float32"),
    ("fp32-352-a7-h8", (3, 5, 2), 7, 8, "float32"),
    ("fp32-44-a7-h12", (4, 4), 7, 12, "float32"),
    ("fp32-24-a7-h100", (2, 4), 7, 100, "float32"),  # two column tiles, the second part full
    ("bf16-352-a7-h16", (3, 5, 2), 7, 16, "bfloat16"),
]
RESULTS = ("weight", "bias", "grad_value_weight", "grad_value_bias", "grad_adv_weights", "grad_adv_biases")
MODULE_RESULTS = ("logits", "grad_features", "grad_parameters")


def parameters(branches, atoms, hidden, dtype, seed=0):
    """value weight ``[v, h]``, bias ``[v]``, per branch ``[w_d, h]``, ``[w_d]`` (aligned widths), every element
    random, the layers' padding rows included (the fold must not read them)."""
    from fitdqn.nets.c51 import aligned_width

    generator = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    value_rows, widths = aligned_width(atoms), [aligned_width(n * atoms) for n in branches]
    return (draw(value_rows, hidden), draw(value_rows), [draw(w, hidden) for w in widths], [draw(w) for w in widths])


def upstream(branches, atoms, hidden, padding_rows, dtype, seed=1):
    """Gradients of the folded weight and bias, every row (padded sub-actions and padding rows too)."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(branches) * max(branches) * atoms + padding_rows
    return (torch.randn(rows, (1 + len(branches)) * hidden, generator=generator, dtype=torch.float64).to(dtype),
            torch.randn(rows, generator=generator, dtype=torch.float64).to(dtype))


def padding_rows_of(branches, atoms) -> int:
    from fitdqn.nets.c51 import aligned_width

    used = len(branches) * max(branches) * atoms
    return aligned_width(used) - used


def use_triton_on_cpu() -> None:
    from fitdqn.ops import fold, fold_triton

    fold.folded_output_op.register_kernel("cpu", fold_triton.fused_fold)
    fold.folded_output_backward.register_kernel("cpu", fold_triton.fused_fold_grads)


@contextlib.contextmanager
def nan_empty():
    """``torch.empty`` fills with NaN inside (what a kernel leaves unwritten shows)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


def flat(results) -> list[torch.Tensor]:
    """weight, bias, value grads, the advantage grads of every branch concatenated (weights, then biases)."""
    weight, bias, grads, br = results
    return [weight, bias, grads[0], grads[1], torch.cat(grads[2:2 + br]), torch.cat(grads[2 + br:])]


def run_fold(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows, grad_weight,
             grad_bias):
    """Through the operator and its autograd: weight, bias and every parameter's gradient."""
    from fitdqn.ops.fold import folded_output

    leaves = [t.detach().requires_grad_() for t in (value_weight, value_bias, *adv_weights, *adv_biases)]
    br = len(branches)
    weight, bias = folded_output(leaves[0], leaves[1], leaves[2:2 + br], leaves[2 + br:], branches, atoms,
                                 padding_rows)
    grads = torch.autograd.grad([weight, bias], leaves, [grad_weight, grad_bias])
    return weight.detach(), bias.detach(), list(grads), br


def maths(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows, grad_weight, grad_bias):
    """The CPU kernels' torch maths, called directly."""
    from fitdqn.ops.fold import fold_grads, fold_maths

    weight, bias = fold_maths(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows)
    widths = [w.shape[0] for w in adv_weights]
    grads = fold_grads(grad_weight, grad_bias, branches, atoms, value_weight.shape[0], widths)
    return weight, bias, grads, len(branches)


def run_case(name, branches, atoms, hidden, dtype_name):
    dtype = getattr(torch, dtype_name)
    padding_rows = padding_rows_of(branches, atoms)
    params = parameters(branches, atoms, hidden, dtype)
    grad_weight, grad_bias = upstream(branches, atoms, hidden, padding_rows, dtype)
    with nan_empty():
        fused = run_fold(*params, branches, atoms, padding_rows, grad_weight, grad_bias)
        launched = [fused[0], fused[1], *fused[2]]
        direct = [*torch.ops.fitdqn.folded_output(params[0], params[1], params[2], params[3], list(branches), atoms,
                                                  padding_rows),
                  *torch.ops.fitdqn.folded_output_backward(grad_weight, grad_bias, list(branches), atoms,
                                                           params[0].shape[0], [w.shape[0] for w in params[2]])]
    torch_results = maths(*params, branches, atoms, padding_rows, grad_weight, grad_bias)
    as64 = [params[0].double(), params[1].double(), [w.double() for w in params[2]], [b.double() for b in params[3]]]
    exact = maths(*as64, branches, atoms, padding_rows, grad_weight.double(), grad_bias.double())
    got, torch_flat, exact_flat = flat(fused), flat(torch_results), flat(exact)
    return {
        "torch": {key: error(g, t) for key, g, t in zip(RESULTS, got, torch_flat, strict=True)},
        "fp64": {key: error(g, e) for key, g, e in zip(RESULTS, got, exact_flat, strict=True)},
        "equal": {key: bool(torch.equal(g, t)) for key, g, t in zip(RESULTS, got, torch_flat, strict=True)},
        "zeros": {key: bool((g[e == 0] == 0).all()) for key, g, e in zip(RESULTS, got, exact_flat, strict=True)},
        "autograd_equals_ops": all(torch.equal(a, b) for a, b in zip(launched, direct, strict=True)),
        "shapes": [list(t.shape) for t in launched], "dtypes": [str(t.dtype) for t in launched],
    }


def run_module_case() -> dict:
    """``BranchingDuelingC51`` through the kernels against its per-branch reference (fp32)."""
    from fitdqn.nets.c51 import BranchingDuelingC51

    torch.manual_seed(0)
    head = BranchingDuelingC51(16, 8, (3, 5, 2), 11)
    features = torch.randn(7, 16, requires_grad=True)
    grad_logits = torch.randn(7, 3, 5, 11)
    results = []
    for forward in (head, functools.partial(c51_head, head)):
        logits = forward(features)
        grads = torch.autograd.grad((logits * grad_logits).sum(), [features, *head.parameters()])
        results.append([logits.detach(), grads[0], torch.cat([g.flatten() for g in grads[1:]])])
    return {key: error(got, ref) for key, got, ref in zip(MODULE_RESULTS, *results, strict=True)}


def run_cases() -> dict:
    results = {case[0]: run_case(*case) for case in CASES}
    results["module"] = run_module_case()
    return results


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.fold_triton", run_cases, use_triton_on_cpu)
