"""Branching dueling C51 head (Tavakoli et al. 2018 action branching + Bellemare et al. 2017 C51).

A value stream V(s) ``[B, atoms]`` and one advantage stream per branch ``A_d(s, .) [B, n_d, atoms]``,
combined per branch on the logits: ``logits_d = V + A_d - mean_a A_d`` (the mean over that branch's
sub-actions), then a softmax over atoms gives each sub-action's return distribution on the support.

All streams' first layers are one fused ``Linear(d_model, (1 + branches) * stream_hidden)`` (one matmul,
one autocast cast of the features, or none with the fused kernel set, whose attention hands them over in bf16
under autocast; with that set its ReLU runs in the product's epilogue, ``fitdqn.ops.linear_relu``); each stream
has its own output layer. Branches of unequal size are padded to the largest one: padded sub-actions get zero
logits and ``valid_actions`` marks them invalid.

The output layers are a few columns wider than they need be (:func:`aligned_width`: 51 -> 56 atoms, 5 x 51 =
255 -> 256): with bf16 rows a multiple of 16 bytes cuBLAS can use its Hopper (sm_90) GEMMs; with 51 or 255
columns it fell back to sm_75 kernels that took about 47 us each at batch 8192 on an H200, about 0.8 ms
per update in all. The extra columns are sliced off before use: their weights get zero gradients and never
move, and the maths is unchanged.

The dueling combination is linear, so it is applied to the *weights*, not the activations
(:meth:`BranchingDuelingC51.folded_output`): with ``A_a = W_a h_d + b_a``, ``A_a - mean_a' A_a' =
(W_a - mean W) h_d + (b_a - mean b)``, and ``V + that`` is one linear map of the stacked streams
``[h_V, h_1, .., h_br]``. The whole head is then one GEMM ``[B, (1 + br) h] x [(1 + br) h, br n atoms]`` on a
weight built per forward from the same parameters, independent of the batch. Per-branch layers and dueling on
the activations (:meth:`reference`, the test oracle) took 14 kernels on ``[B, ...]`` tensors a forward and about
0.5 ms of the update at batch 8192 on an H200, most of it elementwise ``[B, n, atoms]`` passes and their
backward. The zero blocks of the folded weight cost FLOPs (a third of them are used), not time: the GEMM is small.

The fold itself is one autograd function, :class:`FoldedOutput`, because its kernels are tiny (a few
microseconds each in a CUDA graph) and their number is what costs: at equal branches it takes 9 ops (one kernel
each) forward and 7 backward. Autograd through the same maths in plain ops
(:meth:`BranchingDuelingC51._fold_reference`, its test oracle) took 11 ops forward and 22 backward at the default
(5, 5, 5) branches and 51 atoms, about 13 and 32 kernels: most of the backward undid the slices and pads of the
parameters, a zero fill and a copy each. An update runs the online network's fold forward and backward once and
the target's forward once: 25 ops where there were 44.

With the fused kernel set the fold is the operator ``fitdqn::folded_output`` (:mod:`fitdqn.ops.fold`) instead: on
CUDA one Triton launch per branch forward, each writing every column of its branch's rows (zeros included: no fill),
and one per branch plus one for the value layer backward; at three branches 3 + 3 + 4 = 10 launches an update where
FoldedOutput takes 25. On the CPU its kernels are FoldedOutput's ops (the same bits); FoldedOutput stays the torch
kernel set's fold and the operator's test oracle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from fitdqn.nets.groups import tag
from fitdqn.ops.casts import derived_once
from fitdqn.ops.fold import folded_output
from fitdqn.ops.linear import linear
from fitdqn.ops.linear_relu import linear_relu

GEMM_ALIGNMENT = 8  # bf16 elements in 16 bytes


def aligned_width(width: int) -> int:
    """``width`` rounded up to a multiple of ``GEMM_ALIGNMENT`` (an output layer's padded width)."""
    return -(-width // GEMM_ALIGNMENT) * GEMM_ALIGNMENT


class PaddedLinear(nn.Linear):
    """``nn.Linear(in, aligned_width(out))`` whose first ``out`` rows start exactly as ``nn.Linear(in, out)``'s
    would (the same random draws, so seeded runs are unchanged by the padding); the padding rows start at zero."""

    def __init__(self, in_features: int, out_features: int) -> None:
        object.__setattr__(self, "used_features", out_features)  # read by reset_parameters in nn.Linear.__init__
        super().__init__(in_features, aligned_width(out_features))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()
            nn.init.kaiming_uniform_(self.weight[:self.used_features], a=math.sqrt(5))  # nn.Linear's own init
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias[:self.used_features], -bound, bound)


def dueling(value: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
    """``value [B, A]``, ``advantage [B, n, A]`` -> ``[B, n, A]``: V + A - mean over sub-actions of A."""
    return value.unsqueeze(1) + advantage - advantage.mean(dim=1, keepdim=True)


class BranchingDuelingC51(nn.Module):
    """``features [B, d_model] -> logits [B, branches, max_n, atoms]`` (padded sub-actions: zeros)."""

    def __init__(self, d_model: int, hidden: int, branches: tuple[int, ...], atoms: int, fused: bool = False
                 ) -> None:
        super().__init__()
        self.fused = fused  # the hidden layer as fitdqn.ops.linear_relu, the output as fitdqn.ops.linear
        self.branches = tuple(branches)
        self.atoms = atoms
        self.max_n = max(branches)
        self.hidden = nn.Linear(d_model, (1 + len(branches)) * hidden)
        self.value = PaddedLinear(hidden, atoms)
        self.advantages = nn.ModuleList(PaddedLinear(hidden, n * atoms) for n in branches)
        width = len(branches) * self.max_n * atoms
        valid = torch.zeros(len(branches), self.max_n)
        divisor = torch.full((len(branches), self.max_n), -math.inf)  # FoldedOutput's centring (its docstring)
        for branch, n in enumerate(branches):
            valid[branch, :n] = 1.0
            divisor[branch, :n] = -n
        self.register_buffer("valid", valid.view(len(branches), self.max_n, 1), persistent=False)  # [br, n, 1]
        self.register_buffer("divisor", divisor.view(len(branches), self.max_n, 1), persistent=False)  # [br, n, 1]
        self.padded_actions = self.max_n * len(branches) != sum(branches)  # some branch is padded
        self.padding_rows = aligned_width(width) - width
        tag(self, "dqn")

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch = features.shape[0]
        if self.fused:  # the ReLU in the product's epilogue, the bias gradient a matrix-vector product
            layer = linear
            streams = linear_relu(features, self.hidden.weight, self.hidden.bias)  # [B, (1 + br) h]
        else:
            layer = F.linear
            streams = F.relu(layer(features, self.hidden.weight, self.hidden.bias), inplace=True)  # [B, (1 + br) h]
        weight, bias = self.folded_output()  # [rows, (1 + branches) * h], [rows]
        logits = layer(streams, weight, bias)  # [B, rows]
        width = len(self.branches) * self.max_n * self.atoms
        return logits[:, :width].view(batch, len(self.branches), self.max_n, self.atoms)

    def folded_output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The value and advantage output layers and the dueling combination as one linear map of the streams:
        weight ``[rows, (1 + branches) h]`` and bias ``[rows]``, rows = branches * max_n * atoms padded to
        ``aligned_width``. Row (d, a, k) holds V's row k in column block 0 and ``W_{d,a,k} - mean_a W_{d,.,k}``
        in block 1 + d; padded sub-actions and padding rows are zero. Inside the learner's update built once
        while the parameters are unchanged (``fitdqn.ops.casts.derived_once``: the online network's two passes
        share it, and its cast)."""
        return derived_once(self, self._fold)

    def _fold(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fold of this head's output layers: with the fused kernel set the operator ``fitdqn::folded_output``
        (:mod:`fitdqn.ops.fold`; on CUDA ``br`` Triton launches forward, ``br + 1`` backward), else
        :class:`FoldedOutput` (plain ATen ops, what ``fitdqn export`` traces)."""
        if self.fused:
            return folded_output(self.value.weight, self.value.bias, [layer.weight for layer in self.advantages],
                                 [layer.bias for layer in self.advantages], self.branches, self.atoms,
                                 self.padding_rows)
        return FoldedOutput.apply(self, self.value.weight, self.value.bias,
                                  *[layer.weight for layer in self.advantages],
                                  *[layer.bias for layer in self.advantages])

    def _fold_reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fold in plain differentiable ops: :class:`FoldedOutput`'s test oracle, forward and backward."""
        branches, n, atoms = len(self.branches), self.max_n, self.atoms
        hidden = self.value.in_features
        adv_weight = self._stacked([layer.weight for layer in self.advantages])  # [br, n, atoms, h]
        adv_bias = self._stacked([layer.bias for layer in self.advantages])  # [br, n, atoms]
        adv_weight = adv_weight - self._mean_over_actions(adv_weight)
        adv_bias = adv_bias - self._mean_over_actions(adv_bias)
        value_weight = self.value.weight[:atoms].expand(branches, n, atoms, hidden)  # [br, n, atoms, h]
        value_bias = self.value.bias[:atoms]  # [atoms]
        if self.padded_actions:  # padded sub-actions get zero logits
            value_weight = value_weight * self.valid.unsqueeze(-1)
            adv_weight, adv_bias = adv_weight * self.valid.unsqueeze(-1), adv_bias * self.valid
            value_bias = value_bias * self.valid  # [br, n, atoms]
        placement = torch.eye(branches, device=adv_weight.device).view(branches, 1, 1, branches, 1)  # d -> block d
        blocks = adv_weight.unsqueeze(3) * placement  # [br, n, atoms, br, h]: block-diagonal
        weight = torch.cat([value_weight.unsqueeze(3), blocks], dim=3).view(branches * n * atoms, -1)
        bias = (adv_bias + value_bias).reshape(-1)  # [br * n * atoms]
        if self.padding_rows:
            weight = F.pad(weight, (0, 0, 0, self.padding_rows))  # [rows, (1 + br) h]
            bias = F.pad(bias, (0, self.padding_rows))  # [rows]
        return weight, bias

    def _stacked(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Each branch's advantage weights or biases ``[n_d * atoms (padded), ...]`` -> ``[br, max_n, atoms, ...]``
        (the used rows; padded sub-actions zero)."""
        rows = self.max_n * self.atoms
        parts = []
        for n, tensor in zip(self.branches, tensors, strict=True):
            used = tensor[:n * self.atoms]
            if n < self.max_n:
                used = F.pad(used, (0, 0) * (tensor.dim() - 1) + (0, rows - n * self.atoms))
            parts.append(used)
        stacked = torch.stack(parts)  # [br, max_n * atoms, ...]
        return stacked.view(len(self.branches), self.max_n, self.atoms, *stacked.shape[2:])

    def _mean_over_actions(self, stacked: torch.Tensor) -> torch.Tensor:
        """Each branch's mean over its own sub-actions ``[br, 1, atoms, ...]`` (padded ones are zero, not counted)."""
        if all(n == self.max_n for n in self.branches):
            return stacked.mean(dim=1, keepdim=True)
        counts = self.valid.sum(dim=1, keepdim=True)  # [br, 1, 1]
        return stacked.sum(dim=1, keepdim=True) / counts.view(-1, *[1] * (stacked.dim() - 1))

    def reference(self, features: torch.Tensor) -> torch.Tensor:
        """Per-branch output layers and :func:`dueling` on the activations: the folded forward's test oracle."""
        batch = features.shape[0]
        streams = F.relu(self.hidden(features))  # [B, (1 + branches) * h]
        streams = streams.view(batch, 1 + len(self.branches), -1)  # [B, 1 + branches, h]
        value = self.value(streams[:, 0])[:, :self.atoms]  # [B, atoms] (padding columns dropped)
        logits = []
        for index, (n, layer) in enumerate(zip(self.branches, self.advantages, strict=True)):
            advantage = layer(streams[:, 1 + index])[:, :n * self.atoms].view(batch, n, self.atoms)  # [B, n, atoms]
            branch = dueling(value, advantage)  # [B, n, atoms]
            if n < self.max_n:
                branch = F.pad(branch, (0, 0, 0, self.max_n - n))  # [B, max_n, atoms]
            logits.append(branch)
        return torch.stack(logits, dim=1)  # [B, branches, max_n, atoms]


class FoldedOutput(torch.autograd.Function):
    """``(head, value weight, value bias, advantage weights.., advantage biases..) -> (weight [rows, (1 + br) h],
    bias [rows])``: :meth:`BranchingDuelingC51._fold_reference` as one autograd function.

    Autograd through the plain formulation spent about thirty small kernels backward, most of them undoing the
    slices and pads of the parameters (a zero fill and a copy each). The fold is linear in the parameters, so
    backward needs none of them (nothing is saved): it reads the incoming gradients in the folded layout and
    writes each parameter's gradient in that parameter's own padded shape, zeros in the padding rows. Both
    directions write into views of one zeroed buffer (one fill for the weight and bias, one for all the
    gradients), then run a few reductions and elementwise passes over ``[br, n, atoms, ...]``.

    Centring over a branch's sub-actions is one pass, ``x + sum_a x / divisor`` (``addcdiv``), with ``divisor``
    ``-n_d`` on branch d's sub-actions: ``x - sum / n_d``, the rounding of ``x - x.mean()`` on CPU and of
    autograd's mean backward (CUDA's mean multiplies by ``1 / n_d``: the forward may differ from the plain fold
    in the last bit there), and ``-inf`` on padded sub-actions, whose ``x`` is zero: zero there too.
    """

    @staticmethod
    def forward(ctx, head: BranchingDuelingC51, value_weight: torch.Tensor, value_bias: torch.Tensor,
                *advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # detached: the ops below write into views with ``out=``, which a program exported from this forward
        # (``fitdqn export``, torch.export inlines it) would run on parameters that require grad
        value_weight, value_bias = value_weight.detach(), value_bias.detach()
        advantages = tuple(tensor.detach() for tensor in advantages)
        branches, n, atoms = len(head.branches), head.max_n, head.atoms
        hidden, used = value_weight.shape[1], branches * n * atoms
        ctx.head, ctx.shapes = head, [t.shape for t in (value_weight, value_bias, *advantages)]
        rows = used + head.padding_rows
        weight, bias = _zeros(value_weight, (rows, (1 + branches) * hidden), (rows,))
        blocks = weight[:used].view(branches, n, atoms, 1 + branches, hidden)  # [br, n, atoms, 1 + br, h]
        torch.mul(value_weight[:atoms], head.valid.unsqueeze(-1), out=blocks[:, :, :, 0])  # V's rows in block 0
        adv_weight = head._stacked(advantages[:branches])  # [br, n, atoms, h]
        torch.addcdiv(adv_weight, adv_weight.sum(1, keepdim=True), head.divisor.unsqueeze(-1),
                      out=_own_blocks(blocks))
        adv_bias = head._stacked(advantages[branches:])  # [br, n, atoms]
        used_bias = bias[:used].view(branches, n, atoms)  # [br, n, atoms]
        torch.addcdiv(adv_bias, adv_bias.sum(1, keepdim=True), head.divisor, out=used_bias)
        used_bias.addcmul_(value_bias[:atoms], head.valid)  # + V's bias on the valid sub-actions
        return weight, bias

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_weight: torch.Tensor, grad_bias: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        head = ctx.head
        branches, n, atoms = len(head.branches), head.max_n, head.atoms
        hidden, used = ctx.shapes[0][1], branches * n * atoms
        grad_blocks = grad_weight[:used].view(branches, n, atoms, 1 + branches, hidden)  # [br, n, atoms, 1 + br, h]
        grad_rows = grad_bias[:used].view(branches, n, atoms)  # [br, n, atoms]
        grad_value, grad_own = grad_blocks[:, :, :, 0], _own_blocks(grad_blocks)  # [br, n, atoms, h] each
        if head.padded_actions:  # the rows of padded sub-actions come from no parameter
            grad_value, grad_own = grad_value * head.valid.unsqueeze(-1), grad_own * head.valid.unsqueeze(-1)
            grad_rows = grad_rows * head.valid
        widths = [shape[0] for shape in ctx.shapes[2:2 + branches]]  # each advantage layer's padded width
        value_weight, value_bias, adv_weight, adv_bias = _zeros(
            grad_weight, ctx.shapes[0], ctx.shapes[1], (branches, max(widths), hidden), (branches, max(widths)))
        torch.sum(grad_value, dim=(0, 1), out=value_weight[:atoms])
        torch.sum(grad_rows, dim=(0, 1), out=value_bias[:atoms])
        torch.addcdiv(grad_own, grad_own.sum(1, keepdim=True), head.divisor.unsqueeze(-1),
                      out=adv_weight[:, :n * atoms].view(branches, n, atoms, hidden))
        torch.addcdiv(grad_rows, grad_rows.sum(1, keepdim=True), head.divisor,
                      out=adv_bias[:, :n * atoms].view(branches, n, atoms))
        # branch d's gradient: its first width_d rows (sub-actions past n_d, its padding rows, got zeros)
        return (None, value_weight, value_bias, *[g[:w] for g, w in zip(adv_weight, widths, strict=True)],
                *[g[:w] for g, w in zip(adv_bias, widths, strict=True)])


def _own_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[br, n, atoms, 1 + br, h] -> [br, n, atoms, h]``: each branch's rows in its own column block (1 + d), a
    view (the diagonal of the advantage blocks)."""
    return blocks[:, :, :, 1:].diagonal(dim1=0, dim2=3).movedim(-1, 0)


def _zeros(like: torch.Tensor, *shapes: Sequence[int]) -> list[torch.Tensor]:
    """Zero tensors of ``shapes`` (``like``'s dtype and device), views of one buffer: one fill for all of them."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = like.new_zeros(sum(sizes))
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]
