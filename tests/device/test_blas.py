"""The cuBLAS/cuBLASLt workspaces are made at set-up, on the streams asked for, before anything else."""

import pytest
import torch

from fitdqn.device.blas import reserve_blas_workspaces
from fitdqn.memory.overhead import cublas_workspace_bytes


def test_nothing_happens_off_cuda():
    reserve_blas_workspaces(torch.device("cpu"), (None,))  # no CUDA call: would raise on a CPU-only build


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_new_stream_gets_its_workspaces_at_once():
    device = torch.device("cuda", 0)
    stream = torch.cuda.Stream(device)
    before = torch.cuda.memory_allocated(device)
    reserve_blas_workspaces(device, (stream,))
    made = torch.cuda.memory_allocated(device) - before
    workspace, _ = cublas_workspace_bytes(torch.cuda.get_device_capability(device))
    assert made >= workspace  # at least the cuBLAS workspace of the new stream (cuBLASLt's beside it)
    reserve_blas_workspaces(device, (stream,))
    assert torch.cuda.memory_allocated(device) - before == made  # made once per stream
