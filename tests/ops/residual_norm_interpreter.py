"""The fused residual add + LayerNorm's Triton kernels on the CPU, under Triton's interpreter: run as a script by
``test_residual_norm.py`` (``python residual_norm_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON line.

Why a separate process: as for ``iqn_interpreter.py``, Triton reads ``TRITON_INTERPRET`` when a kernel is
*defined*, and the setting holds for the whole process.

In this process the Triton launchers are registered as the *CPU* kernels of ``fitdqn::residual_layer_norm`` and its
backward op (and, for the module cases, those of ``fitdqn::last_token_attention`` too), so the operator, its
autograd and ``LastTokenAttention`` run end to end on CPU tensors through the kernels. The
interpreter's bf16 gaps are patched as in ``iqn_interpreter.py``.

Errors are ``max |result - reference| / max |reference|``, the reference in fp64 from the same (rounded) inputs:
LayerNorm of the sum rounded to the inputs' dtype, with the upstream gradient rounded to it too (the gradient of a
bf16 output is bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from attention_interpreter import run_module_case  # next to this script
from attention_interpreter import use_triton_on_cpu as use_attention_triton_on_cpu
from triton_interpreter import interpreted_main  # next to this script
from triton_interpreter import relative_error as error

# (name, batch, d_model, dtype, strided residual)
CASES = [
    ("fp32-B5-d64", 5, 64, "float32", False),  # B below one block (64 rows at d = 64)
    ("fp32-B70-d64", 70, 64, "float32", False),  # two programs, the last one part full
    ("fp32-B7-d48-strided", 7, 48, "float32", True),  # padded columns; the residual a row view
    ("fp32-B37-d256", 37, 256, "float32", False),  # 16 rows a block: three programs
    ("bf16-B37-d256-strided", 37, 256, "bfloat16", True),
    ("bf16-B70-d64", 70, 64, "bfloat16", False),
    ("bf16-B9-d48", 9, 48, "bfloat16", False),
    ("fp16-B20-d64", 20, 64, "float16", False),
]
RESULTS = ("out", "mean", "rstd", "grad_x", "grad_residual", "grad_weight", "grad_bias")
# (name, batch, window, d_model, heads, dtype): LastTokenAttention through both operators' kernels, under
# CPU autocast at bf16 (``attention_interpreter.run_module_case``)
MODULE_CASES = [
    ("module-fp32", 6, 8, 64, 4, "float32"),
    ("module-bf16", 6, 8, 64, 4, "bfloat16"),
]


def use_triton_on_cpu() -> None:
    """This operator's kernels and the attention core's (the module cases run both) as their CPU kernels."""
    from fitdqn.ops import residual_norm, residual_norm_triton

    residual_norm.residual_layer_norm_op.register_kernel("cpu", residual_norm_triton.fused_residual_norm)
    residual_norm.residual_layer_norm_backward.register_kernel("cpu", residual_norm_triton.fused_residual_norm_grads)
    use_attention_triton_on_cpu()


def inputs(batch, d_model, dtype, strided):
    """x ``[B, d]``, residual ``[B, d]`` (a row view of ``[B, 3, d]`` if asked), weight, bias ``[d]`` fp32 and the
    upstream gradient ``[B, d]`` in ``dtype``."""
    x = torch.randn(batch, d_model).to(dtype)
    if strided:
        residual = (torch.randn(batch, 3, d_model) * 2 + 1).to(dtype)[:, -1]  # row stride 3 d
    else:
        residual = (torch.randn(batch, d_model) * 2 + 1).to(dtype)
    weight, bias = 1 + 0.5 * torch.randn(d_model), 0.5 * torch.randn(d_model)
    return x, residual, weight, bias, torch.randn(batch, d_model).to(dtype)


def described(tensors) -> dict:
    return {"shapes": [list(t.shape) for t in tensors], "dtypes": [str(t.dtype) for t in tensors]}


def run_case(name, batch, d_model, dtype_name, strided):
    from fitdqn.ops.residual_norm import residual_layer_norm_op

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    x, residual, weight, bias, upstream = inputs(batch, d_model, dtype, strided)
    assert residual.is_contiguous() != strided
    leaves = [t.detach().requires_grad_() for t in (x, residual, weight, bias)]
    out, total, mean, rstd = residual_layer_norm_op(*leaves, 1e-5)  # the Triton kernels, operator and autograd
    grads = torch.autograd.grad(out, leaves, upstream)
    grad_total, partial_sums = torch.ops.fitdqn.residual_layer_norm_backward(upstream, total, mean, rstd, weight)
    total64 = (x + residual).double().requires_grad_()  # the sum, rounded as the add of two `dtype` tensors rounds
    weight64, bias64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    out64 = F.layer_norm(total64, (d_model,), weight64, bias64, 1e-5)
    grad64 = torch.autograd.grad(out64, [total64, weight64, bias64], upstream.double())
    variance, mean64 = torch.var_mean(total64.detach(), dim=-1, correction=0)
    reference = [out64.detach(), mean64, torch.rsqrt(variance + 1e-5), grad64[0], grad64[0], grad64[1], grad64[2]]
    fused = [out, mean, rstd, *grads]
    return {"fused": {key: error(value, ref) for key, value, ref in zip(RESULTS, fused, reference, strict=True)},
            "total_equals_add": bool(torch.equal(total, x + residual)),
            "forward": described((out, total, mean, rstd)), "backward": described((grad_total, partial_sums)),
            "grad_dtypes": [str(grad.dtype) for grad in grads]}


def run_cases() -> dict:
    results = {case[0]: run_case(*case) for case in CASES}
    results.update({case[0]: run_module_case(*case) for case in MODULE_CASES})
    return results


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.residual_norm_triton", run_cases, use_triton_on_cpu)
