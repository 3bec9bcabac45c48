"""The C51 means' Triton kernel on the CPU, under Triton's interpreter: run as a script by ``test_c51_means.py``
(``python c51_means_interpreter.py`` with ``TRITON_INTERPRET=1``), prints one JSON line: per case the largest
``|kernel - reference|`` against the float64 reference and against the torch form, and the largest mean's size.
"""

from __future__ import annotations

import torch
from triton_interpreter import interpreted_main  # next to this script

from fitdqn.ops.c51_means import expected_values

# (name, shape of the logits (atoms last), dtype, logit scale)
CASES = [
    ("B37-br3-n5-A51-bf16", (37, 3, 5, 51), torch.bfloat16, 3.0),  # rows not a multiple of ROWS
    ("B16-A51-fp32", (16, 51), torch.float32, 1.0),
    ("B5-br3-A11-fp32-peaked", (5, 3, 11), torch.float32, 40.0),  # near one-hot: large exponents
    ("B3-A64-fp16", (3, 64), torch.float16, 2.0),  # atoms a power of two: no padding
    ("B0-empty", (0, 3, 51), torch.float32, 1.0),
]


def logits_for(shape, dtype, scale):
    generator = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def reference(logits, support):
    """The float64 mean of each distribution."""
    probs = torch.softmax(logits.double(), dim=-1)
    return (probs * support.double()).sum(-1)


def run_cases() -> dict:
    from fitdqn.ops.c51_means_triton import fused_means  # imports triton: only in this script's own process

    results = {}
    for name, shape, dtype, scale in CASES:
        logits = logits_for(shape, dtype, scale)
        support = torch.linspace(-10.0, 10.0, shape[-1])
        out = fused_means(logits, support)
        assert out.shape == shape[:-1] and out.dtype == torch.float32
        exact = reference(logits, support)
        results[name] = {
            "reference": float((out.double() - exact).abs().max()) if out.numel() else 0.0,
            "torch": float((out - expected_values(logits, support)).abs().max()) if out.numel() else 0.0,
            "size": float(exact.abs().max()) if out.numel() else 0.0,
        }
    return results


if __name__ == "__main__":
    interpreted_main("fitdqn.ops.c51_means_triton", run_cases, bf16=False)
