"""The cuBLAS/cuBLASLt workspaces' component: PyTorch's size rule, and with expandable segments the capture
stream's pair rounded up to whole 20 MiB pages."""

from fitdqn.memory.allocator_model import LARGE_BUFFER
from fitdqn.memory.overhead import cuda_overhead_component

MIB = 2**20


def test_hopper_workspaces_and_the_capture_streams_page_rounding():
    plain = cuda_overhead_component((9, 0))
    assert plain.fixed_bytes == 2 * (32 + 32) * MIB  # :4096:8 for cuBLAS and cuBLASLt, default + capture stream
    paged = cuda_overhead_component((9, 0), expandable=True)
    assert paged.fixed_bytes == 64 * MIB + 80 * MIB  # 64 MiB on the capture stream keep four 20 MiB pages
    assert "20 MiB pages" in paged.derived_from


def test_other_cards_round_their_smaller_pair_to_one_page():
    per_stream = 2 * (4096 * 2 + 16 * 8) * 1024  # :4096:2:16:8 for each library: 16.25 MiB a stream
    assert cuda_overhead_component((8, 6)).fixed_bytes == 2 * per_stream
    assert cuda_overhead_component((8, 6), expandable=True).fixed_bytes == per_stream + LARGE_BUFFER
    assert cuda_overhead_component((8, 6), streams=1, expandable=True).fixed_bytes == per_stream  # no capture stream
