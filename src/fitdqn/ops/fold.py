"""The C51 head's fold as a PyTorch operator, ``fitdqn::folded_output``, with its backward as a second one,
``fitdqn::folded_output_backward``: the dueling head's value and per-branch advantage output layers folded into one
linear map of the stacked streams (:meth:`fitdqn.nets.c51.BranchingDuelingC51.folded_output`).

``folded_output(value_weight [v, h], value_bias [v], adv_weights [w_d, h] each, adv_biases [w_d] each, branches,
atoms, padding_rows) -> (weight [rows, (1 + br) h], bias [rows])``, with ``br = len(branches)``, ``n = max(branches)``,
``rows = br n atoms + padding_rows``, ``v >= atoms`` and ``w_d >= n_d atoms`` the layers' padded widths (their
padding rows are never read). Row ``(d, a, k)`` (row index ``(d n + a) atoms + k``), for a sub-action ``a < n_d``:

    column block 0:        value_weight[k]
    column block 1 + d:    A[a, k] + (sum_{a' < n_d} A[a', k]) / (-n_d),   A = adv_weights[d] as [n_d, atoms, h]
    every other block:     0
    bias:                  (B[a, k] + (sum_{a'} B[a', k]) / (-n_d)) + value_bias[k],   B = adv_biases[d]

Rows of padded sub-actions (``n_d <= a < n``) and the ``padding_rows`` at the end are zero. The centring is one
``addcdiv`` (``x + sum / divisor``, divisor ``-n_d``): the division of ``x - x.mean()`` on the CPU, not a
multiplication by ``1 / n_d``.

``folded_output_backward(grad_weight, grad_bias, branches, atoms, value_rows, widths) -> [value_weight grad [v, h],
value_bias grad [v], adv_weight grads [w_d, h] each.., adv_bias grads [w_d] each..]`` (one flat list): the fold is
linear in the parameters, so nothing is saved. ``G_d`` = branch d's rows of column block 1 + d, ``g_d`` its bias rows:

    adv_weight grad d, row (a, k), a < n_d:   G_d[a, k] + (sum_{a' < n_d} G_d[a', k]) / (-n_d)   (likewise the bias)
    value_weight grad, row k < atoms:         sum over d, then a < n_d, of block 0's row (d, a, k)  (likewise the bias)

and zeros in every parameter's padding rows (rows ``>= atoms`` of the value layer, ``>= n_d atoms`` of branch d's).

Why: the fold is tiny maths (a few hundred kB) but its plain formulation was 11 ops forward and 22 backward,
a few microseconds each in the update's launch-bound CUDA graph, run twice forward (online and target networks) and
once backward. The Triton kernels (:mod:`fitdqn.ops.fold_triton`) write every element once, zeros included (no
zero fill): ``br`` launches forward (one per branch, each writing all columns of its branch's rows; the last one
the padding rows too) and ``br + 1`` backward (one per branch for its layer's gradients, one for the value layer's).

Kernels: on CUDA the Triton kernels when every tensor is bf16, fp16 or fp32
(:data:`fitdqn.ops.kernels.FUSED_DTYPES`) and the layout's valid sub-actions fit the value kernel's bit mask
(:func:`triton_takes`); everywhere else (and for fp64) the same maths in torch (:func:`fold_maths`,
:func:`fold_grads`: a few ATen ops each way into views of one zeroed buffer). The Triton kernels sum sub-actions in
order (``a = 0, 1, ..``; the value gradient over ``(d, a)`` in order), which is the CPU's order at some shapes and
not at others: equal to the CPU kernels to a few ulps, not bit for bit. :func:`plain_fold` is the same maths in
plain differentiable ops, what an exported program runs (:mod:`fitdqn.ops.decompositions`). The fake kernels allocate
exactly what the launchers and the CPU kernels return: the weight and bias (two tensors), and one gradient tensor
per parameter in that parameter's shape.

Autograd: :func:`torch.library.register_autograd` on ``fitdqn::folded_output``; its backward calls the backward op
and hands the list's parts to the list arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fitdqn.ops.kernels import runs_triton, triton_module

VALID_BITS = 63  # the value-gradient kernel's bit mask of valid (branch, sub-action) pairs: br * max_n at most


def _triton():
    return triton_module("fitdqn.ops.fold_triton")


def used_rows(branches: Sequence[int], atoms: int) -> int:
    """``br * max_n * atoms``: the folded rows before the padding rows."""
    return len(branches) * max(branches) * atoms


def valid_mask(branches: Sequence[int]) -> int:
    """Bit ``d * max_n + a`` set for each valid sub-action ``a < n_d`` of branch ``d``."""
    n = max(branches)
    return sum(1 << (d * n + a) for d, size in enumerate(branches) for a in range(size))


def triton_takes(branches: Sequence[int], *tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels take these dtypes and this layout (else the torch maths runs, on any device)."""
    return runs_triton(*tensors) and len(branches) * max(branches) <= VALID_BITS


def check_layout(value_weight: torch.Tensor, value_bias: torch.Tensor, adv_weights: Sequence[torch.Tensor],
                 adv_biases: Sequence[torch.Tensor], branches: Sequence[int], atoms: int, padding_rows: int) -> None:
    """The parameters' shapes against the layout (module docstring): else ValueError."""
    hidden = value_weight.shape[-1]
    problems = []
    if value_weight.dim() != 2 or value_bias.shape != value_weight.shape[:1] or value_weight.shape[0] < atoms:
        problems.append(f"value layer {tuple(value_weight.shape)}, {tuple(value_bias.shape)}")
    if hidden < 1 or not branches or min(branches) < 1 or atoms < 1 or padding_rows < 0:
        problems.append(f"hidden {hidden}, branches {list(branches)}, atoms {atoms}, padding rows {padding_rows}")
    elif len(adv_weights) != len(branches) or len(adv_biases) != len(branches):
        problems.append(f"{len(adv_weights)} advantage weights and {len(adv_biases)} biases")
    else:
        for d, (size, weight, bias) in enumerate(zip(branches, adv_weights, adv_biases, strict=True)):
            if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] < size * atoms \
                    or bias.shape != weight.shape[:1]:
                problems.append(f"branch {d} ({size} sub-actions): {tuple(weight.shape)}, {tuple(bias.shape)}")
    if problems:
        raise ValueError(f"folded_output wants value [v >= atoms, h], [v] and per branch [w_d >= n_d atoms, h], "
                         f"[w_d]; got {'; '.join(problems)}")


def _layout(branches: Sequence[int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """valid ``[br, n, 1]`` (1 on valid sub-actions) and divisor ``[br, n, 1]`` (``-n_d``; ``-inf`` on padded ones,
    whose ``x`` and sum are zero: ``x + sum / -inf`` is zero there too), as the head's buffers. Built each call
    from the static layout: a host-to-device copy on CUDA, where only the fp64 fallback runs this maths."""
    n = max(branches)
    valid = [[1.0] * size + [0.0] * (n - size) for size in branches]
    divisor = [[-float(size)] * size + [-float("inf")] * (n - size) for size in branches]
    return (torch.tensor(valid, dtype=like.dtype, device=like.device).unsqueeze(-1),
            torch.tensor(divisor, dtype=like.dtype, device=like.device).unsqueeze(-1))


def _stacked(tensors: Sequence[torch.Tensor], branches: Sequence[int], atoms: int) -> torch.Tensor:
    """Each branch's advantage weights or biases ``[w_d, ...]`` -> ``[br, n, atoms, ...]`` (the used rows; padded
    sub-actions zero)."""
    n = max(branches)
    parts = []
    for size, tensor in zip(branches, tensors, strict=True):
        used = tensor[:size * atoms]
        if size < n:
            used = torch.nn.functional.pad(used, (0, 0) * (tensor.dim() - 1) + (0, (n - size) * atoms))
        parts.append(used)
    stacked = torch.stack(parts)  # [br, n * atoms, ...]
    return stacked.view(len(branches), n, atoms, *stacked.shape[2:])


def _own_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[br, n, atoms, 1 + br, h] -> [br, n, atoms, h]``: each branch's rows in its own column block (1 + d)."""
    return blocks[:, :, :, 1:].diagonal(dim1=0, dim2=3).movedim(-1, 0)


def fold_maths(value_weight: torch.Tensor, value_bias: torch.Tensor, adv_weights: Sequence[torch.Tensor],
               adv_biases: Sequence[torch.Tensor], branches: Sequence[int], atoms: int, padding_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward in torch, into a zeroed weight and bias (one fill for each)."""
    br, n, hidden, used = len(branches), max(branches), value_weight.shape[1], used_rows(branches, atoms)
    valid, divisor = _layout(branches, value_weight)  # [br, n, 1] each
    weight = value_weight.new_zeros(used + padding_rows, (1 + br) * hidden)  # [rows, (1 + br) h]
    bias = value_weight.new_zeros(used + padding_rows)  # [rows]
    with torch.no_grad():
        blocks = weight[:used].view(br, n, atoms, 1 + br, hidden)  # [br, n, atoms, 1 + br, h]
        torch.mul(value_weight[:atoms], valid.unsqueeze(-1), out=blocks[:, :, :, 0])  # V's rows in block 0
        adv_weight = _stacked(adv_weights, branches, atoms)  # [br, n, atoms, h]
        torch.addcdiv(adv_weight, adv_weight.sum(1, keepdim=True), divisor.unsqueeze(-1), out=_own_blocks(blocks))
        adv_bias = _stacked(adv_biases, branches, atoms)  # [br, n, atoms]
        bias_rows = bias[:used].view(br, n, atoms)  # [br, n, atoms]
        torch.addcdiv(adv_bias, adv_bias.sum(1, keepdim=True), divisor, out=bias_rows)
        bias_rows.addcmul_(value_bias[:atoms], valid)  # + V's bias on the valid sub-actions
    return weight, bias


def plain_fold(value_weight: torch.Tensor, value_bias: torch.Tensor, adv_weights: Sequence[torch.Tensor],
               adv_biases: Sequence[torch.Tensor], branches: Sequence[int], atoms: int, padding_rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold in plain differentiable ops, each making a new tensor (no ``out=``, nothing in place): the
    decomposition an exported program runs instead of the operator (:mod:`fitdqn.ops.decompositions`)."""
    br, n, hidden = len(branches), max(branches), value_weight.shape[1]
    valid = torch.stack([torch.nn.functional.pad(value_weight.new_ones(size), (0, n - size))
                         for size in branches]).unsqueeze(-1)  # [br, n, 1]: made by ops (a traced constant is not)
    counts = valid.sum(1, keepdim=True)  # [br, 1, 1]: each branch's sub-actions
    adv_weight = _stacked(adv_weights, branches, atoms)  # [br, n, atoms, h]
    adv_bias = _stacked(adv_biases, branches, atoms)  # [br, n, atoms]
    adv_weight = (adv_weight - adv_weight.sum(1, keepdim=True) / counts.unsqueeze(-1)) * valid.unsqueeze(-1)
    adv_bias = (adv_bias - adv_bias.sum(1, keepdim=True) / counts) * valid
    value_rows = value_weight[:atoms].expand(br, n, atoms, hidden) * valid.unsqueeze(-1)  # [br, n, atoms, h]
    placement = torch.eye(br, dtype=value_weight.dtype, device=value_weight.device).view(br, 1, 1, br, 1)
    blocks = adv_weight.unsqueeze(3) * placement  # [br, n, atoms, br, h]: block-diagonal
    weight = torch.cat([value_rows.unsqueeze(3), blocks], dim=3).reshape(br * n * atoms, (1 + br) * hidden)
    bias = (adv_bias + value_bias[:atoms] * valid).reshape(-1)  # [br * n * atoms]
    weight = torch.nn.functional.pad(weight, (0, 0, 0, padding_rows))  # [rows, (1 + br) h]
    return weight, torch.nn.functional.pad(bias, (0, padding_rows))  # [rows]


def fold_grads(grad_weight: torch.Tensor, grad_bias: torch.Tensor, branches: Sequence[int], atoms: int,
               value_rows: int, widths: Sequence[int]) -> list[torch.Tensor]:
    """The backward in torch; each gradient its own tensor."""
    br, n, used = len(branches), max(branches), used_rows(branches, atoms)
    hidden = grad_weight.shape[1] // (1 + br)
    valid, divisor = _layout(branches, grad_weight)  # [br, n, 1] each
    grad_blocks = grad_weight[:used].view(br, n, atoms, 1 + br, hidden)  # [br, n, atoms, 1 + br, h]
    grad_rows = grad_bias[:used].view(br, n, atoms)  # [br, n, atoms]
    grad_value, grad_own = grad_blocks[:, :, :, 0], _own_blocks(grad_blocks)  # [br, n, atoms, h] each
    if any(size < n for size in branches):  # the rows of padded sub-actions come from no parameter
        grad_value, grad_own = grad_value * valid.unsqueeze(-1), grad_own * valid.unsqueeze(-1)
        grad_rows = grad_rows * valid
    value_weight = grad_weight.new_zeros(value_rows, hidden)  # [v, h]
    value_bias = grad_weight.new_zeros(value_rows)  # [v]
    torch.sum(grad_value, dim=(0, 1), out=value_weight[:atoms])
    torch.sum(grad_rows, dim=(0, 1), out=value_bias[:atoms])
    adv_weight = grad_weight.new_zeros(br, max(max(widths), n * atoms), hidden)  # [br, w, h]
    adv_bias = grad_weight.new_zeros(br, max(max(widths), n * atoms))  # [br, w]
    torch.addcdiv(grad_own, grad_own.sum(1, keepdim=True), divisor.unsqueeze(-1),
                  out=adv_weight[:, :n * atoms].view(br, n, atoms, hidden))
    torch.addcdiv(grad_rows, grad_rows.sum(1, keepdim=True), divisor, out=adv_bias[:, :n * atoms].view(br, n, atoms))
    # branch d's gradient: its first w_d rows (sub-actions past n_d and its padding rows are zeros), a tensor each
    return [value_weight, value_bias, *[g[:w].clone() for g, w in zip(adv_weight, widths, strict=True)],
            *[g[:w].clone() for g, w in zip(adv_bias, widths, strict=True)]]


# ---------------------------------------------------------------------------------------------- forward

@torch.library.custom_op("fitdqn::folded_output", mutates_args=())
def folded_output_op(value_weight: torch.Tensor, value_bias: torch.Tensor, adv_weights: list[torch.Tensor],
                     adv_biases: list[torch.Tensor], branches: list[int], atoms: int, padding_rows: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight ``[rows, (1 + br) h]``, bias ``[rows]`` in value_weight's dtype (module docstring); the default (CPU)
    kernel is the torch maths."""
    check_layout(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows)
    return fold_maths(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows)


@folded_output_op.register_kernel("cuda")
def _fold_cuda(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows):
    check_layout(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows)
    if not triton_takes(branches, value_weight, value_bias, *adv_weights, *adv_biases):
        return fold_maths(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows)
    return _triton().fused_fold(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows)


@folded_output_op.register_fake
def _fold_fake(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows):
    check_layout(value_weight, value_bias, adv_weights, adv_biases, branches, atoms, padding_rows)
    rows = used_rows(branches, atoms) + padding_rows
    # [rows, (1 + br) h], [rows]: two tensors in value_weight's dtype
    return value_weight.new_empty(rows, (1 + len(branches)) * value_weight.shape[1]), value_weight.new_empty(rows)


# ---------------------------------------------------------------------------------------------- backward

@torch.library.custom_op("fitdqn::folded_output_backward", mutates_args=())
def folded_output_backward(grad_weight: torch.Tensor, grad_bias: torch.Tensor, branches: list[int], atoms: int,
                           value_rows: int, widths: list[int]) -> list[torch.Tensor]:
    """``grad_weight [rows, (1 + br) h]``, ``grad_bias [rows]`` -> [value weight ``[v, h]``, value bias ``[v]``,
    advantage weights ``[w_d, h]``.., advantage biases ``[w_d]``..] gradients in grad_weight's dtype. Default
    (CPU) kernel: the torch maths."""
    return fold_grads(grad_weight, grad_bias, branches, atoms, value_rows, widths)


@folded_output_backward.register_kernel("cuda")
def _grads_cuda(grad_weight, grad_bias, branches, atoms, value_rows, widths):
    if not triton_takes(branches, grad_weight, grad_bias):
        return fold_grads(grad_weight, grad_bias, branches, atoms, value_rows, widths)
    return _triton().fused_fold_grads(grad_weight, grad_bias, branches, atoms, value_rows, widths)


@folded_output_backward.register_fake
def _grads_fake(grad_weight, grad_bias, branches, atoms, value_rows, widths):
    hidden = grad_weight.shape[1] // (1 + len(branches))
    # [v, h], [v], [w_d, h] per branch, [w_d] per branch: grad_weight's dtype
    return [grad_weight.new_empty(value_rows, hidden), grad_weight.new_empty(value_rows),
            *[grad_weight.new_empty(w, hidden) for w in widths], *[grad_weight.new_empty(w) for w in widths]]


# ---------------------------------------------------------------------------------------------- autograd

def _setup_context(ctx, inputs, output) -> None:
    value_weight, _, adv_weights, _, branches, atoms, _ = inputs
    ctx.layout = (list(branches), atoms, value_weight.shape[0], [w.shape[0] for w in adv_weights])  # no tensors


def _backward(ctx, grad_weight, grad_bias):
    branches, atoms, value_rows, widths = ctx.layout
    grads = torch.ops.fitdqn.folded_output_backward(grad_weight, grad_bias, branches, atoms, value_rows, widths)
    br = len(branches)
    return grads[0], grads[1], list(grads[2:2 + br]), list(grads[2 + br:]), None, None, None


folded_output_op.register_autograd(_backward, setup_context=_setup_context)


def folded_output(value_weight: torch.Tensor, value_bias: torch.Tensor, adv_weights: Sequence[torch.Tensor],
                  adv_biases: Sequence[torch.Tensor], branches: Sequence[int], atoms: int, padding_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The folded weight ``[rows, (1 + br) h]`` and bias ``[rows]`` (module docstring), differentiable in every
    parameter."""
    return folded_output_op(value_weight, value_bias, list(adv_weights), list(adv_biases), list(branches), atoms,
                            padding_rows)
