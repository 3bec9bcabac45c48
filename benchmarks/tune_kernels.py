"""Launch shapes of fitdqn's Triton kernels, timed on the present GPU (the figures quoted beside the constants).

Times the fused IQN head's backward and forward kernels (``fitdqn.ops.iqn_triton``), the quantile Huber kernel
(``fitdqn.ops.quantile_huber_triton``) and C51's projection (``fitdqn.ops.projection_triton``) alone, at the
update's shapes (N = N' = 64, E = 64, d = 256, 15 outputs, 3 branches, bf16), for a list of launch shapes each:
slice width, warps, pipeline stages and, for the backward, the number of batch programs P
(``fitdqn.ops.iqn.WEIGHT_GRAD_PROGRAMS``); for the quantile Huber loss, its warps and whether its loop over the
targets is unrolled; for the projection, the distributions a program takes and its warps
(3 branches x batch distributions of 51 atoms, rewards and discounts per sample). Each backward shape is checked
against the first (the partial sums are reduced over P; only the summation order may differ), each projection
against the first, each Huber kernel against the closed form.

    PYTHONPATH=src python benchmarks/tune_kernels.py --batch 8192 --out tune_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from _common import median_ms, write_json

BACKWARD_SHAPES = [  # (P, BLOCK_D, warps, stages); the first is the reference the others are checked against
    (128, 256, 16, 2), (128, 128, 8, 2), (128, 128, 8, 1), (128, 64, 4, 2), (128, 64, 4, 1), (264, 128, 8, 2),
    (66, 128, 8, 2), (128, 128, 4, 2),
]
FORWARD_SHAPES = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 2), (32, 4, 2)]  # (BLOCK_D, warps, stages)
HUBER_SHAPES = [(8, True), (8, False), (4, True), (4, False), (2, False), (16, False)]  # (warps, unrolled loop)
# (ROWS, warps)
PROJECTION_SHAPES = [(1, 2), (1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 4), (4, 8), (8, 4), (8, 8)]
KERNELS = ("iqn_backward", "iqn_forward", "quantile_huber", "projection")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=20, help="timed launches per shape (their median)")
    parser.add_argument("--out", default="tune_kernels.json")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated: " + ", ".join(KERNELS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tune_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    from fitdqn.ops import iqn as ops_iqn
    from fitdqn.ops import iqn_triton
    from fitdqn.ops import projection_triton as projection
    from fitdqn.ops import quantile_huber_triton as huber
    from fitdqn.ops.quantile_huber import quantile_huber_sorted

    kernels = args.kernels.split(",")

    device, (batch, n, e, d, o) = torch.device("cuda"), (args.batch, 64, 64, 256, 15)
    generator = torch.Generator(device=device).manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device=device, generator=generator)  # noqa: E731
    features, taus = randn(batch, d).bfloat16(), torch.rand(batch, n, device=device, generator=generator)
    frequencies = torch.arange(e, device=device, dtype=torch.float32) * torch.pi
    w1, b1, w2, b2, grad = randn(d, e) * 0.1, randn(d) * 0.1, randn(o, d) * 0.1, randn(o) * 0.1, randn(batch, n, o)
    saved = (ops_iqn.WEIGHT_GRAD_PROGRAMS, iqn_triton.TRANSPOSED_BLOCK_D, iqn_triton.TRANSPOSED_WARPS,
             iqn_triton.TRANSPOSED_STAGES, iqn_triton.FORWARD_BLOCK_D,
             iqn_triton.FORWARD_WARPS, iqn_triton.FORWARD_STAGES, huber.ROWS_WARPS, huber.ROWS_UNROLL, projection.ROWS,
             projection.WARPS)
    rows, first = [], None
    try:
        for programs, block_d, warps, stages in BACKWARD_SHAPES if "iqn_backward" in kernels else ():
            ops_iqn.WEIGHT_GRAD_PROGRAMS = programs
            iqn_triton.TRANSPOSED_BLOCK_D, iqn_triton.TRANSPOSED_WARPS = block_d, warps
            iqn_triton.TRANSPOSED_STAGES = stages
            backward = lambda: iqn_triton.fused_quantile_grads(grad, features, taus, frequencies, w1, b1, w2,  # noqa
                                                               torch.bfloat16)
            out = backward()
            sums = [out[0], *(part.sum(0) for part in out[1:])]
            first = first or sums
            error = max(((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(sums, first, strict=True))
            rows.append({"kernel": "iqn_backward", "programs": programs, "block_d": block_d,
                         "warps": warps, "stages": stages, "ms": median_ms(backward, device, args.reps, warmup=1),
                         "error_vs_first": error})
            print(json.dumps(rows[-1]), flush=True)
        for block_d, warps, stages in FORWARD_SHAPES if "iqn_forward" in kernels else ():
            iqn_triton.FORWARD_BLOCK_D, iqn_triton.FORWARD_WARPS, iqn_triton.FORWARD_STAGES = block_d, warps, stages
            forward = lambda: iqn_triton.fused_quantiles(features, taus, frequencies, w1, b1, w2, b2,  # noqa: E731
                                                         torch.bfloat16)
            rows.append({"kernel": "iqn_forward", "block_d": block_d, "warps": warps, "stages": stages,
                         "ms": median_ms(forward, device, args.reps, warmup=1)})
            print(json.dumps(rows[-1]), flush=True)
        pred, target = randn(batch, n, 3), randn(batch, n, 3)
        ref_loss, ref_grad = quantile_huber_sorted(pred, target, taus, 1.0)  # fp64 inside: the oracle
        for warps, unroll in HUBER_SHAPES if "quantile_huber" in kernels else ():
            huber.ROWS_WARPS, huber.ROWS_UNROLL = warps, unroll
            loss = lambda: huber.fused_quantile_huber(pred, target, taus, 1.0)  # noqa: E731
            got_loss, got_grad = loss()
            error = max(((got_loss - ref_loss).abs().max() / ref_loss.abs().max()).item(),
                        ((got_grad - ref_grad).abs().max() / ref_grad.abs().max()).item())
            rows.append({"kernel": "quantile_huber", "warps": warps, "unrolled": unroll,
                         "ms": median_ms(loss, device, args.reps, warmup=1), "error_vs_closed_form": error})
            print(json.dumps(rows[-1]), flush=True)
        probs = torch.softmax(randn(batch * 3, 51), dim=-1)  # [B * 3 branches, 51 atoms]
        rewards, discounts = randn(batch) * 5, torch.full((batch,), 0.99**3, device=device)  # [B]: per sample
        support = torch.linspace(-10.0, 10.0, 51, device=device)
        first_projection = None
        for rows_per_program, warps in PROJECTION_SHAPES if "projection" in kernels else ():
            projection.ROWS, projection.WARPS = rows_per_program, warps
            project = lambda: projection.fused_projection(probs, rewards, discounts, support)  # noqa: E731
            out = project()
            first_projection = out if first_projection is None else first_projection
            rows.append({"kernel": "projection", "rows": rows_per_program, "warps": warps,
                         "ms": median_ms(project, device, args.reps, warmup=1),
                         "error_vs_first": (out - first_projection).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        (ops_iqn.WEIGHT_GRAD_PROGRAMS, iqn_triton.TRANSPOSED_BLOCK_D, iqn_triton.TRANSPOSED_WARPS,
         iqn_triton.TRANSPOSED_STAGES, iqn_triton.FORWARD_BLOCK_D,
         iqn_triton.FORWARD_WARPS, iqn_triton.FORWARD_STAGES, huber.ROWS_WARPS, huber.ROWS_UNROLL, projection.ROWS,
         projection.WARPS) = saved
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": batch, "rows": rows}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
