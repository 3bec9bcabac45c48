"""Triton kernel cases under Triton's interpreter (``TRITON_INTERPRET=1``), each script in its own process.

The interpreter stands in for a GPU on CPU-only machines: a CUDA machine tests the compiled kernels instead, so
there the caller's tests are skipped. A test runs a script with :func:`run_under_interpreter`; the script's
``__main__`` is :func:`interpreted_main`, which prints its results as JSON on its last line.

Why a separate process: Triton reads ``TRITON_INTERPRET`` when a kernel is *defined* (``@triton.jit`` returns an
interpreted function only if it is set then), and the setting holds for the whole process; the test process must
keep the compiled kernels for its CUDA tests and never redefines them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def run_under_interpreter(script: Path, timeout: float = 600) -> dict:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the compiled kernels are tested instead")
    tests = str(Path(__file__).resolve().parents[1])  # tests/: the support package (the plain oracles)
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), tests]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest ``|value - reference|`` over the largest ``|reference|`` (absolute where the reference is all
    zero; 0 for empty tensors), in float64."""
    if not reference.numel():
        return 0.0
    scale = reference.double().abs().max().item()
    difference = (value.double() - reference.double()).abs().max().item()
    return difference / scale if scale > 0 else difference


def patch_interpreter_bf16() -> None:
    """Two gaps of the interpreter (Triton 3.x) patched to behave as the GPU does: it multiplies the raw bits of
    bf16 ``tl.dot`` operands (triton-lang/triton#11584: bf16 arithmetic is unsupported there), and it casts fp32
    to bf16 by truncation where the GPU rounds to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def as_fp32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        values = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(values, tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # round to nearest even
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.create_dot, builder.cast_impl = dot, cast


def interpreted_main(triton_module: str, run_cases: Callable[[], dict],
                     use_triton_on_cpu: Callable[[], None] | None = None, bf16: bool = True) -> None:
    """A kernel-case script's ``__main__``: refuse to run outside the interpreter or after ``triton_module`` (the
    kernels') was imported, patch the interpreter's bf16 (``bf16``), register the Triton launchers as the operators'
    CPU kernels (``use_triton_on_cpu``: the operators then run end to end on CPU tensors), run the cases, print
    their results as one JSON line."""
    if os.environ.get("TRITON_INTERPRET") != "1" or triton_module in sys.modules:
        raise SystemExit("run with TRITON_INTERPRET=1 in a fresh process")
    if bf16:
        patch_interpreter_bf16()
    if use_triton_on_cpu is not None:
        use_triton_on_cpu()
    print(json.dumps(run_cases()))
