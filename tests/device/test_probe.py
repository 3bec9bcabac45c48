import pytest
import torch

from fitdqn.device.probe import probe, resolve_device, what_if
from fitdqn.errors import UserError


def test_cpu_probe_reports_system_memory():
    info = probe("cpu")
    assert info.kind == "cpu"
    assert 0 < info.free_bytes <= info.total_bytes


def test_what_if_free_defaults_to_total_and_back():
    assert what_if("x", 4 * 2**30, None).free_bytes == 4 * 2**30
    assert what_if("x", None, 2**30).total_bytes == 2**30
    with pytest.raises(UserError, match="exceeds"):
        what_if("x", 2**30, 2**31)


def test_bad_device_names():
    with pytest.raises(UserError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_probe_matches_driver():
    info = probe("cuda")
    free, total = torch.cuda.mem_get_info()
    assert info.total_bytes == total
    assert abs(info.free_bytes - free) < 64 * 2**20
    assert info.name == torch.cuda.get_device_name()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_probe_sees_the_per_process_memory_fraction():
    if not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        pytest.skip("this PyTorch cannot report the fraction")
    _, total = torch.cuda.mem_get_info()
    assert probe("cuda").allocator_limit_bytes is None
    torch.cuda.set_per_process_memory_fraction(0.25)
    try:
        info = probe("cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert info.allocator_limit_bytes == pytest.approx(0.25 * total, abs=1)
    assert info.free_bytes <= info.allocator_limit_bytes - torch.cuda.memory_reserved()
