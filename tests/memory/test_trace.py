"""Traced step memory: a toy MLP step counted by hand, linearity, attribution, views, and a real GPU check."""

from __future__ import annotations

import gc

import pytest
import torch
from support.linearity import check_linearity
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fitdqn.memory.attribution import OTHER
from fitdqn.memory.live_bytes import LiveBytes, round_block
from fitdqn.memory.trace import (
    AutocastUnavailable,
    NoCudaDevice,
    StepSetup,
    describe,
    measure_step_memory,
    per_sample_bytes,
    trace_step_memory,
)

IN, HIDDEN, OUT = 80, (512, 256), 15
FP32 = 4


def make_toy_step(batch_size: int, device: torch.device) -> StepSetup:
    """Linear 80 -> 512 -> 256 -> 15 with ReLUs, MSE loss, Adam; the step makes its own batch."""
    widths = (IN, *HIDDEN, OUT)
    layers: list[nn.Module] = []
    for k in range(len(widths) - 1):
        layers.append(nn.Linear(widths[k], widths[k + 1], device=device))
        if k < len(widths) - 2:
            layers.append(nn.ReLU())
    net = nn.Sequential(*layers)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        x = torch.randn(batch_size, IN, device=device)  # [B, 80]
        target = torch.randn(batch_size, OUT, device=device)  # [B, 15]
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(net(x), target)
        loss.backward()
        optimizer.step()

    return StepSetup(step, {"trunk": list(net[:-1]), "head": [net[-1]]})


def hand_count_per_sample(reduction_staging: bool) -> int:
    """Per-sample bytes of the toy step's peak, from the layer widths alone (fp32 everywhere).

    Alive for the whole step: the batch, x [B, 80] and target [B, 15] (locals of the step). ReLU saves its
    output for backward, and the next Linear saves that same tensor as its input, so each hidden layer k
    keeps r_k [B, h_k] from its forward until its ReLU's backward; the pre-activation [B, h_k] dies as soon
    as the ReLU has run. Backward runs from the last layer down; r_j of the layers above are released. The
    candidate peaks:
      forward, at ReLU k:      batch + r_1..r_{k-1} + pre-activation_k + r_k
      backward, at ReLU k:     batch + r_1..r_k + grad of r_k (from the Linear above) + grad of pre-act_k
      backward, Linear k+1's bias gradient (CUDA only): grad of pre-act_{k+1} [B, h_{k+1}] is summed over
        the batch after grad of r_k is made; the CUDA reduction stages 2 x that gradient's bytes
        (``kernel_scratch``): batch + r_1..r_k + grad of r_k + 3 x [B, h_{k+1}].
    The output [B, 15] and its gradient are smaller than any hidden candidate.
    """
    batch = IN + OUT
    candidates = []
    for k, width in enumerate(HIDDEN):
        below = sum(HIDDEN[:k])
        candidates.append(batch + below + 2 * width)  # forward at ReLU k
        candidates.append(batch + below + 3 * width)  # backward at ReLU k
        if reduction_staging and k + 1 < len(HIDDEN):
            candidates.append(batch + below + 2 * width + 3 * HIDDEN[k + 1])
    return max(candidates) * FP32


def test_toy_step_per_sample_matches_hand_count():
    expected = hand_count_per_sample(reduction_staging=False)
    assert expected == (95 + 3 * 512) * 4  # = 6524: backward of the first ReLU
    fit = per_sample_bytes(make_toy_step, batches=(1024, 2048), device="cpu")
    # the 512-byte rounding moves the slope by at most 512 / 1024 bytes per sample
    assert abs(fit.per_sample_bytes - expected) <= 0.02 * expected
    # attribution: the batch is made outside every group; the trunk's three [B, 512] tensors are its own
    assert fit.per_group_per_sample[OTHER] == pytest.approx((IN + OUT) * FP32, abs=1)
    assert fit.per_group_per_sample["trunk"] == pytest.approx(3 * HIDDEN[0] * FP32, abs=1)
    assert fit.per_group_per_sample["head"] == 0


def test_toy_step_for_cuda_adds_the_bias_reduction_staging():
    expected = hand_count_per_sample(reduction_staging=True)
    assert expected == (95 + 512 + 512 + 3 * 256) * 4  # = 7548: layer 2's bias gradient
    fit = per_sample_bytes(make_toy_step, batches=(1024, 2048), device="cuda")
    assert abs(fit.per_sample_bytes - expected) <= 0.02 * expected
    assert "scratch of aten.sum" in fit.traces[1].peak_op
    assert fit.traces[1].scratch_at_peak == 2 * 2048 * 256 * FP32


def test_traced_bytes_grow_linearly_with_batch():
    batch = 1024
    steps = [trace_step_memory(make_toy_step, b).step_bytes for b in (batch, 2 * batch, 4 * batch)]
    assert steps[0] < steps[1] < steps[2]
    assert steps[2] - steps[1] == 2 * (steps[1] - steps[0])
    linearity = check_linearity(make_toy_step, (batch, 2 * batch, 8 * batch))
    assert linearity.holds(0.001), linearity.relative_error


def test_parts_sum_exactly_to_the_peak_and_baseline():
    trace = trace_step_memory(make_toy_step, 768)
    assert sum(trace.peak_by_group.values()) == trace.peak_bytes
    assert sum(trace.baseline_by_group.values()) == trace.baseline_bytes
    assert sum(trace.step_by_group.values()) == trace.step_bytes
    assert sum(record.nbytes for record in trace.peak_storages) == trace.peak_bytes
    assert describe(trace).startswith("batch 768")
    # backward allocations are charged to the group whose autograd nodes made them
    assert {(r.group, r.phase) for r in trace.peak_storages if r.shape == (768, 512)} == {
        ("trunk", "forward"), ("trunk", "backward")}


def test_nested_groups_inner_wins_and_no_grad_work_is_attributed():
    def make(batch_size, device):
        inner = nn.Linear(128, 128, device=device)
        outer = nn.Sequential(nn.Linear(32, 128, device=device), nn.ReLU(), inner)
        target = nn.Linear(32, 128, device=device)

        def step():
            x = torch.randn(batch_size, 32)
            with torch.no_grad():
                goal = target(x)  # [B, 128], made under no_grad
            nn.functional.mse_loss(outer(x), goal).backward()

        return StepSetup(step, {"outer": [outer], "inner": [inner], "target": [target]})

    trace = trace_step_memory(make, 1024, "cpu")
    made_by = {(r.group, r.op, r.phase) for r in trace.peak_storages if r.shape == (1024, 128)}
    assert made_by == {
        ("target", "aten.addmm.default", "forward"),  # no_grad output, kept as the loss target
        ("outer", "aten.relu.default", "forward"),  # saved by ReLU and by the inner Linear
        ("other", "aten.mse_loss_backward.default", "backward"),  # the loss is in no group
        ("inner", "aten.mm.default", "backward"),  # inner Linear's input gradient (nested: inner wins)
    }


def test_baseline_holds_parameters_gradients_and_adam_state():
    trace = trace_step_memory(make_toy_step, 256)
    widths = (IN, *HIDDEN, OUT)
    tensors = [(widths[k + 1], widths[k]) for k in range(3)] + [(widths[k + 1],) for k in range(3)]
    params = [round_block(FP32 * (shape[0] * (shape[1] if len(shape) > 1 else 1))) for shape in tensors]
    head = round_block(OUT * HIDDEN[1] * FP32) + round_block(OUT * FP32)
    # parameters + gradients (the warm-up step left them) per group; Adam's two moments in 'other'
    assert trace.baseline_by_group["head"] == 2 * head
    assert trace.baseline_by_group["trunk"] == 2 * (sum(params) - head)
    adam_moments = 2 * sum(params)
    step_counters = trace.baseline_by_group[OTHER] - adam_moments  # 'step' tensors: CPU (not counted) or fake
    assert 0 <= step_counters <= 6 * 512


class _Square(torch.autograd.Function):
    """A custom op: its backward makes a [B, N] gradient that must be charged to the calling module."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _SquareModule(nn.Module):
    def forward(self, x):
        return _Square.apply(x)  # the module's last op: no later torch call inside the module


def test_custom_autograd_function_backward_is_charged_to_its_module():
    def make(batch_size, device):
        layer = nn.Linear(16, 256, device=device)
        square = _SquareModule()

        def step():
            square(layer(torch.randn(batch_size, 16))).sum().backward()

        return StepSetup(step, {"square": [square], "layer": [layer]})

    trace = trace_step_memory(make, 512, "cpu")
    backward = {r.group for r in trace.peak_storages if r.phase == "backward" and r.shape == (512, 256)}
    assert "square" in backward and OTHER not in backward


def test_views_do_not_double_count():
    with FakeTensorMode():
        tracker = LiveBytes("cpu", lambda: OTHER, lambda: False)
        with tracker:
            base = torch.empty(1000, 300)  # [1000, 300] fp32: 1_200_000 bytes
            views = [base.view(300_000), base[:, :10], base.t(), base[5], base.unsqueeze(0), base.detach()]
            base.add_(1.0)  # in place: same storage
            assert tracker.live_bytes == round_block(1000 * 300 * FP32)
            copy = base.clone()  # a new storage
            assert tracker.live_bytes == 2 * round_block(1000 * 300 * FP32)
            del base
            gc.collect()
            assert tracker.live_bytes == 2 * round_block(1000 * 300 * FP32)  # views keep the storage
            del views
            gc.collect()
            assert tracker.live_bytes == round_block(1000 * 300 * FP32)
            del copy
            gc.collect()
            assert tracker.live_bytes == 0
        tracker.detach_finalizers()


def test_storages_saved_for_backward_live_until_backward():
    with FakeTensorMode():
        tracker = LiveBytes("cpu", lambda: OTHER, lambda: False)
        with tracker:
            weight = torch.empty(64, 64, requires_grad=True)
            hidden = torch.relu(torch.empty(128, 64) @ weight)  # relu saves its output
            loss = hidden.sum()
            saved = round_block(128 * 64 * FP32)
            del hidden
            gc.collect()
            live_with_graph = tracker.live_bytes
            loss.backward()
            del loss
            gc.collect()
            # the relu output was alive only through the graph; backward released it
            assert live_with_graph - tracker.live_bytes >= saved
        tracker.detach_finalizers()


def test_allocator_rounding():
    assert [round_block(n) for n in (0, 1, 511, 512, 513, 1 << 20)] == [0, 512, 512, 512, 1024, 1 << 20]


def test_group_modules_must_be_disjoint():
    def make(batch_size, device):
        layer = nn.Linear(4, 4, device=device)
        return StepSetup(lambda: layer(torch.randn(batch_size, 4)), {"a": [layer], "b": [layer]})

    with pytest.raises(ValueError, match="one group"):
        trace_step_memory(make, 8)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="checks the CPU-only build's autocast guard")
def test_cuda_autocast_on_cpu_build_is_an_error_not_a_silent_fp32_trace():
    def make(batch_size, device):
        layer = nn.Linear(8, 8, device=device)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                layer(torch.randn(batch_size, 8)).sum().backward()

        return step

    with pytest.raises(AutocastUnavailable, match="device.type"):
        trace_step_memory(make, 8)


def test_autocast_with_the_given_device_type_halves_the_activations():
    def make(batch_size, device, autocast):
        net = nn.Sequential(nn.Linear(64, 1024, device=device), nn.ReLU(), nn.Linear(1024, 1, device=device))

        def step():
            x = torch.randn(batch_size, 64)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = net(x).float().mean()
            loss.backward()

        return step

    fp32 = per_sample_bytes(lambda b, d: make(b, d, False), (512, 1024), "cpu").per_sample_bytes
    bf16 = per_sample_bytes(lambda b, d: make(b, d, True), (512, 1024), "cpu").per_sample_bytes
    assert 0.4 < bf16 / fp32 < 0.75, (bf16, fp32)


def make_norm_step(batch_size: int, device: torch.device) -> StepSetup:
    """Linear 64 -> 256, LayerNorm, Linear 256 -> 1 under bf16 autocast: CUDA keeps LayerNorm in fp32."""
    norm = nn.LayerNorm(256, device=device)
    net = nn.Sequential(nn.Linear(64, 256, device=device), norm, nn.Linear(256, 1, device=device))

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = net(torch.randn(batch_size, 64)).float().mean()
        loss.backward()

    return StepSetup(step, {"norm": [norm]})


def norm_output_dtypes(trace) -> set[torch.dtype]:
    return {r.dtype for r in trace.peak_storages if r.group == "norm" and r.shape == (trace.batch_size, 256)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback runs where CUDA is not usable")
def test_cpu_fallback_applies_cuda_autocast_rules():
    for_cuda = trace_step_memory(make_norm_step, 512, "cuda")
    for_cpu = trace_step_memory(make_norm_step, 512, "cpu")
    assert for_cuda.traced_device == "cpu" and "autocast" in for_cuda.note
    assert torch.float32 in norm_output_dtypes(for_cuda)  # as on a GPU
    assert norm_output_dtypes(for_cpu) == {torch.bfloat16}  # CPU autocast keeps LayerNorm in bf16
    assert for_cuda.step_bytes > for_cpu.step_bytes


def test_measure_needs_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(NoCudaDevice, match="trace_step_memory"):
        measure_step_memory(make_toy_step, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fake_device", ["cuda", "cpu"])
@pytest.mark.parametrize("batch_size", [1024, 4096])
@pytest.mark.parametrize("make_step", [make_toy_step, make_norm_step])
def test_trace_matches_the_real_gpu(make_step, batch_size, fake_device):
    traced = trace_step_memory(make_step, batch_size, "cuda", fake_device=fake_device)
    measured = measure_step_memory(make_step, batch_size, "cuda")
    torch.cuda.empty_cache()
    assert abs(traced.step_bytes - measured) <= 0.05 * measured, (traced.step_bytes, measured)


class ToySampler:
    """A stand-in replay: ``draw`` makes a batch (charged to its call group), ``observe`` makes no group's bytes."""

    def draw(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 10)  # [B, 10] f32: 40 B a row

    def observe(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows.shape[0], 20)  # [B, 20] f32: 80 B a row


def test_calls_that_are_not_modules_are_charged_to_their_group_and_put_back():
    sampler = ToySampler()

    def make_step(batch_size: int, device: torch.device) -> StepSetup:
        def step() -> None:
            rows = sampler.draw(batch_size)
            obs = sampler.observe(rows)
            del rows, obs  # both alive together at the step's peak

        return StepSetup(step, {}, {"replay": [(sampler, "draw")]})

    batch = 1024
    trace = trace_step_memory(make_step, batch, "cpu")
    assert trace.step_by_group["replay"] == round_block(40 * batch)
    assert trace.step_by_group[OTHER] == round_block(80 * batch)
    assert "draw" not in vars(sampler)  # the method shows through again after the trace
