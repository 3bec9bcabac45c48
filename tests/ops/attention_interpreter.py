"""The fused attention's Triton kernels on the CPU, under Triton's interpreter: run as a script by
``test_attention_fused.py`` (``python attention_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON line.

Why a separate process: as for ``iqn_interpreter.py``, Triton reads ``TRITON_INTERPRET`` when a kernel is
*defined*, and the setting holds for the whole process.

In this process the Triton launchers are registered as the *CPU* kernels of ``fitdqn::last_token_attention`` and
its backward op, so the operator, its autograd and ``LastTokenAttention`` run end to end on CPU
tensors through the kernels. The interpreter's bf16 gaps are patched as in ``iqn_interpreter.py``.

Errors are ``max |result - reference| / max |reference|`` (the absolute error where the reference is all zeros:
grad q at W = 1), the reference in fp64 from the same (rounded) inputs.
"""

from __future__ import annotations

import copy

import torch
from support.reference.nets import attention as reference_attention
from triton_interpreter import interpreted_main  # next to this script
from triton_interpreter import relative_error as error

# (name, batch, window, d_model, heads, dtype, strided inputs)
CASES = [
    ("fp32-B5-W8-d256-H4", 5, 8, 256, 4, "float32", False),  # the default shape, B below one block
    ("fp32-B19-W3-d32-H4", 19, 3, 32, 4, "float32", False),  # three programs, the last one part full
    ("fp32-B1-W1-d64-H2", 1, 1, 64, 2, "float32", False),  # one token: weights 1, grad q 0
    ("fp32-B4-W5-d48-H4", 4, 5, 48, 4, "float32", False),  # dh = 12: padded head columns
    ("fp32-B3-W6-d24-H3", 3, 6, 24, 3, "float32", False),  # 3 heads: a padded head
    ("fp32-B6-W9-d16-H1-strided", 6, 9, 16, 1, "float32", True),  # W above a power of two; strided q, kv
    ("bf16-B7-W8-d256-H4", 7, 8, 256, 4, "bfloat16", False),
    ("bf16-B9-W4-d64-H4-strided", 9, 4, 64, 4, "bfloat16", True),
    ("fp16-B5-W8-d64-H4", 5, 8, 64, 4, "float16", False),
]
RESULTS = ("out", "grad_q", "grad_kv")
# (name, batch, window, d_model, heads, dtype): LastTokenAttention, under CPU autocast at bf16
MODULE_CASES = [
    ("module-fp32", 6, 8, 64, 4, "float32"),
    ("module-bf16", 6, 8, 64, 4, "bfloat16"),
]
MODULE_RESULTS = ("out", "grad_tokens", "grad_query_w", "grad_query_b", "grad_key_value_w", "grad_key_value_b",
                  "grad_out_w", "grad_out_b", "grad_norm_w", "grad_norm_b")


def use_triton_on_cpu() -> None:
    from fitdqn.ops import attention, attention_triton

    attention.last_token_attention.register_kernel("cpu", attention_triton.fused_attention)
    attention.last_token_attention_backward.register_kernel("cpu", attention_triton.fused_attention_grads)


def inputs(batch, window, d_model, dtype, strided):
    """q ``[B, d]``, kv ``[B, W, 2 d]``, upstream ``[B, d]`` (q, kv strided views of larger tensors if asked)."""
    if strided:
        q = torch.randn(batch, 2 * d_model).to(dtype)[:, ::2]  # column stride 2
        kv = (torch.randn(batch, window + 2, 2 * d_model + 8) * 2).to(dtype)[:, 1:-1, 3:3 + 2 * d_model]  # odd rows
    else:
        q, kv = torch.randn(batch, d_model).to(dtype), (torch.randn(batch, window, 2 * d_model) * 2).to(dtype)
    return q, kv, torch.randn(batch, d_model)


def run_case(name, batch, window, d_model, heads, dtype_name, strided):
    from fitdqn.ops.attention import attention_core, last_token_attention

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    q, kv, upstream = inputs(batch, window, d_model, dtype, strided)
    assert q.is_contiguous() != strided and kv.is_contiguous() != strided
    q_in, kv_in = q.detach().requires_grad_(), kv.detach().requires_grad_()
    out = last_token_attention(q_in, kv_in, heads)  # the Triton kernels, through the operator and its autograd
    fused = [out.detach(), *torch.autograd.grad(out, [q_in, kv_in], upstream.to(out.dtype))]
    q64, kv64 = q.double().requires_grad_(), kv.double().requires_grad_()
    out64 = attention_core(q64, kv64, heads)
    reference = [out64.detach(), *torch.autograd.grad(out64, [q64, kv64], upstream.double())]
    return {"fused": {key: error(value, ref) for key, value, ref in zip(RESULTS, fused, reference, strict=True)},
            "shapes": [list(value.shape) for value in fused], "dtypes": [str(value.dtype) for value in fused]}


def module_results(module, tokens, upstream, dtype, reference: bool = False):
    """Output and gradients (tokens, then every parameter) of ``(module(tokens) * upstream).sum()``."""
    tokens = tokens.detach().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = reference_attention(module, tokens) if reference else module(tokens)
    grads = torch.autograd.grad((out * upstream).sum(), [tokens, *module.parameters()])
    return [out.detach(), *grads]


def run_module_case(name, batch, window, d_model, heads, dtype_name):
    from fitdqn.nets.attention import LastTokenAttention

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    module = LastTokenAttention(d_model, heads)
    # as the network hands them over: the trunk's tokens in the autocast dtype, and an upstream gradient that the
    # features' dtype holds exactly (the fused path's features are bf16 under autocast, so is their gradient)
    tokens, upstream = torch.randn(batch, window, d_model).to(dtype), torch.randn(batch, d_model).to(dtype).float()
    fused = module_results(module, tokens, upstream, dtype)
    today = module_results(copy.deepcopy(module), tokens, upstream, dtype, reference=True)  # the elementwise path
    oracle = module_results(module.double(), tokens.double(), upstream.double(), torch.float32, reference=True)
    return {"fused": {key: error(value, ref) for key, value, ref in zip(MODULE_RESULTS, fused, oracle, strict=True)},
            "today": {key: error(value, ref) for key, value, ref in zip(MODULE_RESULTS, today, oracle, strict=True)}}


def run_cases() -> dict:
    results = {case[0]: run_case(*case) for case in CASES}
    results.update({case[0]: run_module_case(*case) for case in MODULE_CASES})
    return results


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.attention_triton", run_cases, use_triton_on_cpu)
