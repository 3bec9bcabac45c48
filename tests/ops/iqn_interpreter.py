"""The fused IQN head's Triton kernels on the CPU, under Triton's interpreter: run as a script by
``test_iqn_fused.py`` (``python iqn_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON line.

In this process the Triton launchers are registered as the *CPU* kernels of ``fitdqn::iqn_quantile_head`` and
its backward op, so ``IQNHead`` runs operator, autograd and kernels end to end on CPU tensors; the CPU kernels'
chunked maths are called directly (:class:`Chunked`).
The interpreter's bf16 is patched to round as the GPU does (``triton_interpreter.patch_interpreter_bf16``).
"""

from __future__ import annotations

import torch
from support.reference.nets import iqn_head
from triton_interpreter import interpreted_main  # next to this script

# (name, batch, quantiles, d_model, embedding, outputs, compute dtype, backward programs (None: default))
CASES = [
    ("fp32-B3-N64", 3, 64, 256, 64, 15, "float32", None),
    ("fp32-B5-N32", 5, 32, 256, 64, 15, "float32", None),  # acting K: 2 samples a tile, B odd
    ("fp32-B2-N100", 2, 100, 256, 64, 15, "float32", None),  # 2 quantile blocks a sample, masked
    ("fp32-B9-N64-loop", 9, 64, 256, 64, 15, "float32", 4),  # each backward program loops over 2-3 tiles
    ("fp32-B19-N8-small", 19, 8, 16, 8, 15, "float32", None),  # d, E below a block; 8 samples a tile
    ("bf16-B3-N64", 3, 64, 256, 64, 15, "bfloat16", None),
    ("bf16-B7-N32", 7, 32, 256, 64, 15, "bfloat16", None),
    ("bf16-B9-N64-loop", 9, 64, 256, 64, 15, "bfloat16", 4),
    ("fp16-B3-N64", 3, 64, 256, 64, 15, "float16", None),
]
RESULTS = ("out", "grad_features", "grad_embed_w", "grad_embed_b", "grad_out_w", "grad_out_b")
# (name, batch, quantiles, d_model, embedding, outputs): bf16 *features* (the fused attention's under bf16 autocast),
# the default kernels under bf16 autocast
FEATURE_CASES = [
    ("bf16-features-B7-N32", 7, 32, 256, 64, 15),
    ("bf16-features-B19-N8-small", 19, 8, 16, 8, 15),
]


def use_triton_on_cpu() -> None:
    from fitdqn.ops import iqn as ops_iqn
    from fitdqn.ops import iqn_triton

    def forward(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype):
        return iqn_triton.fused_quantiles(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype)

    def backward(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype):
        return iqn_triton.fused_quantile_grads(grad_out, features, taus, frequencies, embed_w, embed_b, out_w, dtype)

    ops_iqn.iqn_quantile_head.register_kernel("cpu", forward)
    ops_iqn.iqn_quantile_head_backward.register_kernel("cpu", backward)


class Chunked(torch.autograd.Function):
    """The CPU kernels' chunked maths as an autograd function (in this process the operator's CPU kernel is Triton)."""

    @staticmethod
    def forward(ctx, features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype):
        from fitdqn.ops import iqn as ops_iqn

        ctx.save_for_backward(features, taus, frequencies, embed_w, embed_b, out_w)
        ctx.dtype = dtype
        return ops_iqn.chunked_quantiles(features, taus, frequencies, embed_w, embed_b, out_w, out_b, dtype)

    @staticmethod
    def backward(ctx, grad_out):
        from fitdqn.ops import iqn as ops_iqn

        features, taus, frequencies, embed_w, embed_b, out_w = ctx.saved_tensors
        grad_x, grad_w1, grad_w2, grad_b2 = ops_iqn.chunked_quantile_grads(
            grad_out, features, taus, frequencies, embed_w, embed_b, out_w, ctx.dtype)
        return (grad_x.to(features.dtype), None, None, grad_w1.to(embed_w.dtype), grad_w1[:, 0].to(embed_b.dtype),
                grad_w2.to(out_w.dtype), grad_b2.to(out_w.dtype), None)


def chunked(head, features, taus):
    """The head through :class:`Chunked`, in the dtype autocast gives its matmuls."""
    from fitdqn.ops.iqn import compute_dtype

    dtype = compute_dtype("cpu", head.out.weight.dtype)
    return Chunked.apply(features, taus, head.frequencies, head.embed.weight, head.embed.bias, head.out.weight,
                         head.out.bias, dtype)


def head_results(head, features, taus, upstream, dtype, path=None):
    """Output and gradients (features, embed w/b, out w/b) of ``(head(...) * upstream).sum()``: the head (or
    ``path(head, features, taus)``) at ``dtype`` (bf16, fp16: CPU autocast), or the plain reference in fp32
    (``dtype`` None)."""
    features = features.detach().requires_grad_()
    if dtype is None:  # the oracle
        out = iqn_head(head, features, taus)
    else:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = head(features, taus) if path is None else path(head, features, taus)
    grads = torch.autograd.grad((out * upstream).sum(), [features, *head.parameters()])
    return [out.detach(), *grads]


def run_case(name, batch, quantiles, d_model, embedding, outputs, dtype_name, programs):
    from fitdqn.nets.iqn import IQNHead
    from fitdqn.ops import iqn as ops_iqn

    ops_iqn.WEIGHT_GRAD_PROGRAMS = programs or 128
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    head = IQNHead(d_model, embedding, outputs)
    features, taus = torch.randn(batch, d_model), torch.rand(batch, quantiles)
    upstream = torch.randn(batch, quantiles, outputs)
    fused = head_results(head, features, taus, upstream, dtype)
    plain = head_results(head, features, taus, upstream, dtype, chunked)
    # the oracle in fp32, from the same fp32 cosines: fp64 would move the phase of cos(pi * i * tau) at
    # i = 63 by ~1e-5 and flip a ReLU here and there (a gradient jump that both fp32 paths share)
    reference = head_results(head, features, taus, upstream, None)

    return {"fused": relative(fused, reference), "chunked": relative(plain, reference),
            "shapes": [list(value.shape) for value in fused], "dtypes": [str(value.dtype) for value in fused],
            "programs": ops_iqn.tile_geometry(batch, quantiles).programs}


def relative(values, reference) -> dict:
    return {key: ((value.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
            for key, value, ref in zip(RESULTS, values, reference, strict=True)}


def run_features_case(name, batch, quantiles, d_model, embedding, outputs):
    """The head on bf16 features: errors of the kernels and of the chunked maths against the fp32 reference on the
    same (rounded) features, and the dtype of the grad features the backward op itself returns (no cast after)."""
    from fitdqn.nets.iqn import IQNHead
    from fitdqn.ops import iqn as ops_iqn

    ops_iqn.WEIGHT_GRAD_PROGRAMS = 128  # the default (run_case sets it)
    torch.manual_seed(0)
    head = IQNHead(d_model, embedding, outputs)
    features, taus = torch.randn(batch, d_model).bfloat16(), torch.rand(batch, quantiles)
    upstream = torch.randn(batch, quantiles, outputs)
    fused = head_results(head, features, taus, upstream, torch.bfloat16)
    plain = head_results(head, features, taus, upstream, torch.bfloat16, chunked)
    reference = head_results(head, features.float(), taus, upstream, None)
    op_grads = torch.ops.fitdqn.iqn_quantile_head_backward(
        upstream, features, taus, head.frequencies, head.embed.weight, head.embed.bias, head.out.weight,
        torch.bfloat16)
    return {"fused": relative(fused, reference), "chunked": relative(plain, reference),
            "op_grad_features_dtype": str(op_grads[0].dtype), "grad_features_dtype": str(fused[1].dtype)}


def run_cases() -> dict:
    results = {case[0]: run_case(*case) for case in CASES}
    results.update({case[0]: run_features_case(*case) for case in FEATURE_CASES})
    return results


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.iqn_triton", run_cases, use_triton_on_cpu)
