"""The C51 fold ``fitdqn::folded_output``: its CPU kernels against the plain fold (``tests/support/reference``) and
its decomposition, its fake kernels (what the planner's trace sees), its launches, export, its Triton kernels under
Triton's interpreter and on a GPU, and ``BranchingDuelingC51``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fold_interpreter import CASES, RESULTS, padding_rows_of, parameters, upstream
from support.reference.nets import fold as reference_fold
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interpreter import run_under_interpreter

from fitdqn.nets.c51 import BranchingDuelingC51
from fitdqn.ops import kernels
from fitdqn.ops.decompositions import plain_decompositions
from fitdqn.ops.fold import folded_output, folded_output_op, plain_fold, valid_mask

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (branches, atoms, hidden): padding rows 3, 3, 7, 7, 0, 0
LAYOUTS = [((5, 5, 5), 51, 64), ((3, 5, 2), 51, 64), ((5, 5, 5), 7, 16), ((3, 5, 2), 7, 8), ((4, 4), 7, 12),
           ((2, 4), 7, 12)]


def head_with_random_layers(branches, atoms, hidden, dtype=torch.float32) -> BranchingDuelingC51:
    """A head whose output layers are random everywhere, their padding rows included (the fold must not read them)."""
    torch.manual_seed(0)
    head = BranchingDuelingC51(16, hidden, branches, atoms).to(dtype)
    with torch.no_grad():
        for p in output_layers(head):
            p.add_(torch.randn_like(p))
    return head


def output_layers(head: BranchingDuelingC51) -> list[torch.Tensor]:
    """The fold's parameters in its order: value weight, bias, advantage weights.., biases.."""
    return [head.value.weight, head.value.bias, *[layer.weight for layer in head.advantages],
            *[layer.bias for layer in head.advantages]]


def op_fold(head: BranchingDuelingC51, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    br = len(head.branches)
    return folded_output(params[0], params[1], params[2:2 + br], params[2 + br:], head.branches, head.atoms,
                         head.padding_rows)


def fold_and_grads(fold, head, params, grad_weight, grad_bias):
    weight, bias = fold(head, params)
    return [weight.detach(), bias.detach(), *torch.autograd.grad([weight, bias], params, [grad_weight, grad_bias])]


# ------------------------------------------------------------------------------- the operator on the CPU

@pytest.mark.parametrize(("branches", "atoms", "hidden"), LAYOUTS)
def test_operator_on_the_cpu_is_the_plain_fold(branches, atoms, hidden):
    head = head_with_random_layers(branches, atoms, hidden)
    assert head.padding_rows == padding_rows_of(branches, atoms)
    params = output_layers(head)
    weight, bias = op_fold(head, params)
    grad_weight, grad_bias = torch.randn_like(weight), torch.randn_like(bias)  # padding rows and sub-actions too
    got = fold_and_grads(op_fold, head, params, grad_weight, grad_bias)
    for oracle in (lambda h, p: reference_fold(h), decomposed):  # the oracle, and what an export runs
        plain = fold_and_grads(oracle, head, params, grad_weight, grad_bias)
        for index, (value, reference) in enumerate(zip(got, plain, strict=True)):
            assert value.shape == reference.shape and value.dtype == reference.dtype, index
            torch.testing.assert_close(value, reference, rtol=1e-6, atol=1e-6, msg=str(index))
    # the layers' padding rows get exact zeros, the fold's padding rows are zero
    assert not got[2][atoms:].any() and not got[3][atoms:].any()
    for index, n in enumerate(branches):
        assert not got[4 + index][n * atoms:].any() and not got[4 + len(branches) + index][n * atoms:].any()
    used = len(branches) * max(branches) * atoms
    assert not got[0][used:].any() and not got[1][used:].any()


def decomposed(head: BranchingDuelingC51, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fitdqn.ops.fold.plain_fold`, the operator's decomposition."""
    br = len(head.branches)
    return plain_fold(params[0], params[1], params[2:2 + br], params[2 + br:], head.branches, head.atoms,
                      head.padding_rows)


def test_head_folds_with_the_operator():
    weight, _ = head_with_random_layers((3, 5, 2), 11, 8)._fold()
    assert "fitdqn_folded_output" in weight.grad_fn.name()


def test_operator_passes_gradcheck_in_fp64():
    head = head_with_random_layers((3, 2), 3, 4, dtype=torch.float64)
    params = [p.detach().requires_grad_() for p in output_layers(head)]

    def fold(*tensors):
        return op_fold(head, list(tensors))

    assert torch.autograd.gradcheck(fold, params)


def test_operators_pass_opcheck():
    head = head_with_random_layers((3, 5, 2), 7, 8)
    params = [p.detach().requires_grad_() for p in output_layers(head)]
    br = len(head.branches)
    args = (params[0], params[1], params[2:2 + br], params[2 + br:], list(head.branches), head.atoms,
            head.padding_rows)
    torch.library.opcheck(torch.ops.fitdqn.folded_output.default, args)
    weight, bias = folded_output_op(*args)
    torch.library.opcheck(torch.ops.fitdqn.folded_output_backward.default,
                          (torch.randn_like(weight), torch.randn_like(bias), list(head.branches), head.atoms,
                           params[0].shape[0], [p.shape[0] for p in params[2:2 + br]]))


def test_operator_rejects_a_layout_its_parameters_do_not_fit():
    head = head_with_random_layers((3, 5, 2), 7, 8)
    params = output_layers(head)
    with pytest.raises(ValueError, match="folded_output"):
        folded_output(params[0], params[1], params[2:5], params[5:], (3, 6, 2), 7, 3)  # branch 1 too narrow
    with pytest.raises(ValueError, match="folded_output"):
        folded_output(params[0], params[1], params[2:5], params[5:7], (3, 5), 7, 3)  # branches and layers
    with pytest.raises(ValueError, match="folded_output"):
        folded_output(params[0][:, :4], params[1], params[2:5], params[5:], (3, 5, 2), 7, 3)  # hidden


def test_valid_mask_marks_each_branchs_sub_actions():
    assert valid_mask((3, 5, 2)) == 0b00011_11111_00111
    assert valid_mask((2,)) == 0b11


# ------------------------------------------------------------------------------------------- launches

class _Ops(TorchDispatchMode):
    """The ops that launch kernels (views and metadata ops dropped)."""

    VIEWS = ("view", "slice", "select", "diagonal", "movedim", "unsqueeze", "split", "unbind", "detach", "alias",
             "expand", "permute", "squeeze", "t.default")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not any(name.split(".")[1].startswith(view) for view in self.VIEWS):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_launches_forward_and_backward():
    """One operator call each way (on CUDA br Triton launches forward, br + 1 backward: the launchers' loops in
    fitdqn.ops.fold_triton)."""
    head = head_with_random_layers((5, 5, 5), 51, 16)
    with _Ops() as forward_ops:
        weight, bias = head._fold()
    grads = [torch.ones_like(weight), torch.ones_like(bias)]
    with _Ops() as backward_ops:
        torch.autograd.backward([weight, bias], grads)
    assert forward_ops.ops == ["fitdqn.folded_output.default"]
    assert backward_ops.ops == ["fitdqn.folded_output_backward.default"]


# ---------------------------------------------------------------- the fake kernels: what the planner sees

def real_and_fake_outputs(branches, atoms, hidden, dtype):
    padding_rows = padding_rows_of(branches, atoms)
    params = parameters(branches, atoms, hidden, dtype)
    grads = upstream(branches, atoms, hidden, padding_rows, dtype)
    layout = (list(branches), atoms)
    widths = [w.shape[0] for w in params[2]]
    outputs = []
    for mode in (None, FakeTensorMode()):
        with mode or torch.no_grad():
            if mode is not None:
                params = [mode.from_tensor(params[0]), mode.from_tensor(params[1]),
                          [mode.from_tensor(t) for t in params[2]], [mode.from_tensor(t) for t in params[3]]]
                grads = [mode.from_tensor(t) for t in grads]
            forward = torch.ops.fitdqn.folded_output(*params, *layout, padding_rows)
            backward = torch.ops.fitdqn.folded_output_backward(*grads, *layout, params[0].shape[0], widths)
            outputs.append([(tuple(t.shape), t.stride(), t.dtype) for t in (*forward, *backward)])
    return outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("branches", "atoms", "hidden"), LAYOUTS)
def test_fake_kernels_allocate_what_the_cpu_kernels_return(branches, atoms, hidden, dtype):
    real, fake = real_and_fake_outputs(branches, atoms, hidden, dtype)
    assert real == fake
    rows = len(branches) * max(branches) * atoms + padding_rows_of(branches, atoms)
    assert real[0][0] == (rows, (1 + len(branches)) * hidden) and real[1][0] == (rows,)


def test_head_traces_on_fake_tensors():
    with FakeTensorMode():
        head = BranchingDuelingC51(64, 128, (5, 5, 5), 51)
        features = torch.randn(1024, 64, requires_grad=True)
        logits = head(features)
        logits.sum().backward()
    assert logits.shape == (1024, 3, 5, 51)
    assert head.value.weight.grad.shape == head.value.weight.shape
    assert all(layer.weight.grad.shape == layer.weight.shape for layer in head.advantages)


def test_head_exports_as_its_plain_maths():
    head = head_with_random_layers((3, 5, 2), 11, 8).eval()
    features = torch.randn(4, 16)
    with torch.no_grad():
        program = torch.export.export(head, (features,))
        assert "fitdqn.folded_output" in str(program.graph)
        program = program.run_decompositions(plain_decompositions())
    assert "fitdqn" not in str(program.graph)  # loads and runs without fitdqn
    torch.testing.assert_close(program.module()(features), head(features), rtol=1e-6, atol=1e-6)


# -------------------------------------------------------------------- Triton kernels under the interpreter

TOLERANCES = {"float32": 5e-7, "bfloat16": 1e-2}  # max error / max |reference|


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_under_interpreter(Path(__file__).with_name("fold_interpreter.py"))


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_triton_kernels_under_the_interpreter_match_the_cpu_kernels(interpreted, case):
    name, branches, atoms, hidden, dtype_name = case
    result = interpreted[name]
    for key in RESULTS:
        # against the CPU kernels and the fp64 maths: the sums' order differs at some shapes
        assert result["torch"][key] <= TOLERANCES[dtype_name], key
        assert result["fp64"][key] <= TOLERANCES[dtype_name], key
        assert result["zeros"][key], key  # every zero written (NaN-filled allocations), padding and blocks
    assert result["autograd_equals_ops"]
    # the launchers allocate what the fake kernels (and the CPU kernels) do
    launched = [(tuple(shape), getattr(torch, kind.removeprefix("torch.")))
                for shape, kind in zip(result["shapes"], result["dtypes"], strict=True)]
    _, fake = real_and_fake_outputs(branches, atoms, hidden, getattr(torch, dtype_name))
    assert launched == [(shape, dtype) for shape, _, dtype in fake]


def test_head_under_the_interpreter_matches_the_reference(interpreted):
    for key, value in interpreted["module"].items():
        assert value <= 2e-6, key


def test_launch_geometry():
    triton_kernels = pytest.importorskip("fitdqn.ops.fold_triton")
    assert (triton_kernels._block_h(128), triton_kernels._block_h(12), triton_kernels._block_h(100)) == (64, 16, 64)
    assert (triton_kernels._pad_block(0), triton_kernels._pad_block(3), triton_kernels._pad_block(7)) == (1, 4, 8)


# ----------------------------------------------------------------------------------------------- on a GPU

@cuda
@pytest.mark.parametrize(("branches", "atoms", "hidden"), [((5, 5, 5), 51, 128), ((3, 5, 2), 51, 64),
                                                           ((3, 5, 2), 7, 8), ((4, 4), 7, 100)])
def test_triton_operator_on_cuda_matches_the_cpu_maths(branches, atoms, hidden, monkeypatch):
    head = head_with_random_layers(branches, atoms, hidden).cuda()
    params = output_layers(head)
    weight, bias = op_fold(head, params)
    grad_weight, grad_bias = torch.randn_like(weight), torch.randn_like(bias)
    got = fold_and_grads(op_fold, head, params, grad_weight, grad_bias)
    monkeypatch.setenv(kernels.TRITON_SWITCH, "0")  # the CPU kernels' maths on the GPU
    expected = fold_and_grads(op_fold, head, params, grad_weight, grad_bias)
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        assert value.shape == reference.shape and value.dtype == reference.dtype, index
        torch.testing.assert_close(value, reference, rtol=1e-6, atol=1e-6, msg=str(index))
        assert not value[reference == 0].any(), index  # padding rows, padded sub-actions, other blocks


@cuda
def test_triton_operators_pass_opcheck_on_cuda():
    head = head_with_random_layers((3, 5, 2), 51, 64).cuda()
    params = output_layers(head)
    br = len(head.branches)
    args = (params[0], params[1], params[2:2 + br], params[2 + br:], list(head.branches), head.atoms,
            head.padding_rows)
    torch.library.opcheck(torch.ops.fitdqn.folded_output.default, args, test_utils=("test_schema", "test_faketensor"))
    weight, bias = folded_output_op(*args)
    torch.library.opcheck(torch.ops.fitdqn.folded_output_backward.default,
                          (torch.randn_like(weight), torch.randn_like(bias), list(head.branches), head.atoms,
                           params[0].shape[0], [p.shape[0] for p in params[2:2 + br]]),
                          test_utils=("test_schema", "test_faketensor"))
