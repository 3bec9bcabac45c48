"""Run a script of Triton kernel cases under Triton's interpreter (``TRITON_INTERPRET=1``) in a subprocess.

The interpreter stands in for a GPU on CPU-only machines: a CUDA machine tests the compiled kernels instead, so
there the caller's tests are skipped. The script prints its results as JSON on its last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def run_under_interpreter(script: Path, timeout: float = 600) -> dict:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the compiled kernels are tested instead")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
