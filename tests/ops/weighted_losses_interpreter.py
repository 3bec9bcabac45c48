"""The weighted loss's Triton kernels on the CPU, under Triton's interpreter: run as a script by
``test_weighted_losses.py`` (``python weighted_losses_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one
JSON line.

Why a separate process: as for ``iqn_interpreter.py``, Triton reads ``TRITON_INTERPRET`` when a kernel is
*defined*, and the setting holds for the whole process.

In this process the Triton launchers are registered as the *CPU* kernels of ``fitdqn::weighted_losses`` and its
backward op, so ``weighted_losses(...)`` runs operator, autograd function and kernels end to end on CPU
tensors; the plain autograd function of ``tests/support/reference`` is the oracle. The interpreter's fp32 -> bf16
cast is patched to round to nearest even as the GPU does (``triton_interpreter.patch_interpreter_bf16``).
"""

from __future__ import annotations

import torch
from triton_interpreter import interpreted_main  # next to this script
from triton_interpreter import relative_error as error

# (name, batch, branches, atoms, dtype of iqn and v, strided inputs)
CASES = [
    ("fp32-B5-A51", 5, 3, 51, "float32", False),  # below one block (16 samples at br 3, A 51)
    ("fp32-B37-A51", 37, 3, 51, "float32", False),  # three programs, the last one part full
    ("bf16-B37-A51", 37, 3, 51, "bfloat16", False),  # the learner's bf16 iqn and v under autocast
    ("fp32-B70-A7", 70, 3, 7, "float32", False),  # a small odd A: below one block (128 samples)
    ("bf16-B300-A7-strided", 300, 3, 7, "bfloat16", True),  # three programs; every input a strided view
    ("fp16-B19-A51-strided", 19, 3, 51, "float16", True),
]
RESULTS = ("loss", "means", "priorities", "grad_log_probs", "grad_iqn", "grad_v")
ELEMENTWISE = ("grad_log_probs", "grad_iqn", "grad_v")  # the same operations in the same order as the oracle
EXPECTILE = 0.7


def use_triton_on_cpu() -> None:
    from fitdqn.ops import weighted_losses, weighted_losses_triton

    weighted_losses.weighted_losses_op.register_kernel("cpu", weighted_losses_triton.fused_weighted_losses)
    weighted_losses.weighted_losses_backward.register_kernel("cpu", weighted_losses_triton.fused_weighted_losses_grads)


def inputs(batch, branches, atoms, dtype, strided):
    """c51_target, log_probs ``[B, br, A]`` fp32, iqn, v ``[B]`` in ``dtype``, v_target, weight ``[B]`` fp32 (strided
    views of larger tensors if asked), loss_weights ``[3]``; v_target - v of both signs, a weight exactly 0."""
    def vector(values, kind=torch.float32):
        return torch.stack([values, values + 1], dim=1).to(kind)[:, 0] if strided else values.to(kind)

    def distribution(values):
        return torch.cat([values, values[..., :5]], dim=-1)[..., :atoms] if strided else values

    c51_target = distribution(torch.softmax(torch.randn(batch, branches, atoms), -1))
    log_probs = distribution(torch.log_softmax(torch.randn(batch, branches, atoms), -1))
    weight = torch.rand(batch) + 0.1
    weight[0] = 0.0
    return (c51_target, log_probs, vector(torch.rand(batch), dtype), vector(torch.randn(batch), dtype),
            vector(torch.randn(batch)), vector(weight), torch.tensor([1.0, 0.5, 2.0]))


def described(tensors) -> dict:
    return {"shapes": [list(t.shape) for t in tensors], "dtypes": [str(t.dtype) for t in tensors]}


def run(fused, c51_target, log_probs, iqn, v, v_target, weight, loss_weights):
    from support.reference import losses as reference

    from fitdqn.learn.losses import weighted_losses

    leaves = [t.detach().requires_grad_() for t in (log_probs, iqn, v)]
    function = weighted_losses if fused else reference.weighted_losses  # the operators, or the plain oracle
    loss, means, priorities = function(c51_target, leaves[0], leaves[1], leaves[2], v_target, weight, loss_weights,
                                       EXPECTILE)
    loss.backward()
    return [loss.detach(), means, priorities, *[leaf.grad for leaf in leaves]]


def run_case(name, batch, branches, atoms, dtype_name, strided):
    from fitdqn.ops.weighted_losses import loss_parts, weighted_losses_backward, weighted_losses_op

    torch.manual_seed(0)
    tensors = inputs(batch, branches, atoms, getattr(torch, dtype_name), strided)
    c51_target, log_probs, iqn, v, v_target, weight, loss_weights = tensors
    assert c51_target.is_contiguous() != strided and v.is_contiguous() != strided
    fused, torch_path = run(True, *tensors), run(False, *tensors)
    forward = weighted_losses_op(c51_target, log_probs, iqn, v, v_target, weight, EXPECTILE)  # the kernel
    backward = weighted_losses_backward(torch.tensor(1.0), c51_target, v, v_target, weight, loss_weights, EXPECTILE,
                                        iqn.dtype)
    partial_sums = loss_parts(c51_target, log_probs, iqn, v, v_target, weight, EXPECTILE)[1]  # the torch maths
    return {"error": {key: error(got, expected) for key, got, expected in zip(RESULTS, fused, torch_path, strict=True)},
            "equal": {key: bool(torch.equal(got, expected)) for key, got, expected
                      in zip(RESULTS, fused, torch_path, strict=True) if key in ELEMENTWISE},
            "dtypes": {key: [str(got.dtype), str(expected.dtype)] for key, got, expected
                       in zip(RESULTS, fused, torch_path, strict=True)},
            "partial_sums_error": error(forward[1], partial_sums),
            "forward": described(forward), "backward": described(backward)}


def run_cases() -> dict:
    return {case[0]: run_case(*case) for case in CASES}


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.weighted_losses_triton", run_cases, use_triton_on_cpu)
