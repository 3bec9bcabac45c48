"""A linear layer's bias gradient (the column sum of ``grad [M, N]``): ATen's reduction against matrix products.

The update's largest transient at batch 8192 is the global-memory staging of ATen's column-sum reduction
(``fitdqn.memory.kernel_scratch``): up to 4x the gradient's bytes, fp32 partial sums, for the bias gradients of the
C51 head's hidden layer (``[B, 768]``), the trunk (``[B W, 128]``) and, with the full widths, the attention's
key/value projection (``[B W, 512]``: 132 MiB of a 388 MiB step). A matrix-vector product against a ones vector
reads the gradient once through cuBLAS and takes no allocator scratch (cuBLAS's workspace is made once, outside).
Whether it is as fast decides whether the update takes it; this script measures both on the shapes above.

For each shape and each way (``sum``: ``grad.sum(0)``, what autograd and ``linear_relu`` do; ``mv``:
``torch.mv(grad.t(), ones)``; ``mm``: ``ones[1, M] @ grad``): the median time over ``--iters`` calls (CUDA events on
CUDA, perf_counter on a CPU), the allocator's peak above what was allocated before the call (CUDA only), and the
largest error against a float64 column sum, relative to that sum's largest magnitude.

    python benchmarks/bias_grad.py --out bias_grad.json                 # on a GPU, bf16
    python benchmarks/bias_grad.py --device cpu --iters 3 --out x.json  # a smoke run
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch
from _common import median_ms, peak_bytes, write_json

from fitdqn.device.probe import resolve_device
from fitdqn.provenance import code_commit

# (rows, columns) of the bias gradients at batch 8192 (W = 8 tokens): C51 hidden, trunk, attention, full widths
SHAPES = ((8192, 768), (65536, 64), (65536, 128), (65536, 256), (65536, 512), (8192, 512))


def ways(ones: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each way of the column sum of ``grad [M, N]`` -> ``[N]``; ``ones [M]`` in the gradient's dtype."""
    return {
        "sum": lambda grad: grad.sum(0),
        "mv": lambda grad: torch.mv(grad.t(), ones),
        "mm": lambda grad: (ones.unsqueeze(0) @ grad).squeeze(0),
    }


def measure(shape: tuple[int, int], dtype: torch.dtype, iters: int, device: torch.device) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(shape, generator=generator, device=device).to(dtype)  # [M, N]
    ones = torch.ones(shape[0], device=device, dtype=dtype)  # [M]
    exact = grad.double().sum(0)  # [N]
    scale = exact.abs().max().item()
    rows = []
    for name, way in ways(ones).items():
        out = way(grad)
        rows.append({
            "rows": shape[0], "columns": shape[1], "way": name, "dtype": str(dtype).removeprefix("torch."),
            "ms": median_ms(lambda way=way: way(grad), device, iters, warmup=3),
            "scratch_bytes": (None if (peak := peak_bytes(lambda way=way: way(grad), device)) is None
                              else peak - out.numel() * out.element_size()),
            "relative_error": (out.double() - exact).abs().max().item() / scale,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--device", default="auto", help="'auto', 'cuda', 'cuda:N' or 'cpu'")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--iters", type=int, default=100, help="timed calls per row (median)")
    parser.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES),
                        help="comma-separated ROWSxCOLUMNS of the gradients (default: the update's at batch 8192)")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",") if shape]
    rows = [row for shape in shapes for row in measure(shape, dtype, args.iters, device)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    print(f"{name}  torch {torch.__version__}  {args.dtype}")
    print(f"{'shape':>14} {'way':>4} {'ms':>9} {'scratch MiB':>12} {'rel. error':>11}")
    for row in rows:
        scratch = "-" if row["scratch_bytes"] is None else f"{row['scratch_bytes'] / 2**20:.1f}"
        print(f"{row['rows']:>7} x {row['columns']:<4} {row['way']:>4} {row['ms']:9.4f} {scratch:>12} "
              f"{row['relative_error']:11.2e}")
    write_json(args.out, {"device": name, "torch": torch.__version__, "commit": code_commit(), "dtype": args.dtype,
                          "iters": args.iters, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
