"""The operators, one module each: the ``torch.library`` custom op (``fitdqn::...``) whose CPU kernel is the plain
maths in PyTorch, whose CUDA kernel is, beside it in ``<op>_triton.py``, the Triton kernel (imported on first use,
falling back to the CPU maths: :mod:`fitdqn.ops.kernels`), and whose fake kernel allocates what the CUDA kernel
allocates, so a memory trace on fake tensors sees it. The operator's own dispatch chooses; its callers call it
unconditionally. The plain-autograd oracles they are tested against are in ``tests/support/reference``.

- :mod:`fitdqn.ops.iqn`: the IQN head's quantile network (``fitdqn::iqn_quantile_head`` and its backward);
- :mod:`fitdqn.ops.attention`: the last-token attention core (``fitdqn::last_token_attention`` and its backward);
- :mod:`fitdqn.ops.residual_norm`: the attention block's residual add + LayerNorm (``fitdqn::residual_layer_norm``
  and its backward);
- :mod:`fitdqn.ops.fold`: the C51 head's fold of its value and advantage output layers into one linear map
  (``fitdqn::folded_output`` and its backward);
- :mod:`fitdqn.ops.c51_means`: C51's expected values, softmax and sum over the atoms (``fitdqn::c51_means``);
- :mod:`fitdqn.ops.projection`: C51's projection, landing positions included (``fitdqn::categorical_projection``);
- :mod:`fitdqn.ops.quantile_huber`: IQN's quantile Huber loss (``fitdqn::quantile_huber``);
- :mod:`fitdqn.ops.weighted_losses`: the update's weighted sum of the three losses, with the C51 priorities
  (``fitdqn::weighted_losses`` and its backward);
- :mod:`fitdqn.ops.prioritized`: prioritized replay's draw (``fitdqn::prioritized_draw``: the stratified descent
  and the importance weights) and priority update (``fitdqn::prioritized_update``, in place);
- :mod:`fitdqn.ops.replay_gather`: the replay's batch gather, HER 'future' relabelling and the n-step return
  (``fitdqn::replay_gather``), and the goal bonus the operator takes (:class:`~fitdqn.ops.replay_gather.GoalCrossing`);
- :mod:`fitdqn.ops.sum_tree`: the sum tree's ancestor rebuild (in place; a plain function, not an operator);
- :mod:`fitdqn.ops.linear_relu`: a linear layer with its ReLU in the product's epilogue (ATen ops and their
  autograd: no custom op, no Triton);
- :mod:`fitdqn.ops.gather`: ``gather`` with an in-place backward, so that fake tensors trace it as the GPU runs it
  (ATen ops and their autograd: no custom op, no Triton);
- :mod:`fitdqn.ops.kernels`: where the Triton kernels run (``FITDQN_TRITON=0`` turns them off), and their lazy
  import.

Networks (:mod:`fitdqn.nets`), losses (:mod:`fitdqn.learn.losses`) and the replay import these, never the
reverse: this package imports only torch, :mod:`fitdqn.errors`, :mod:`fitdqn.transitions` and its own modules.
Importing it registers every operator.
"""

from fitdqn.ops.attention import last_token_attention
from fitdqn.ops.c51_means import c51_means
from fitdqn.ops.fold import folded_output
from fitdqn.ops.gather import gather_in_place_grad
from fitdqn.ops.iqn import cosine_embedding, iqn_quantile_head
from fitdqn.ops.kernels import FUSED_DTYPES, TRITON_SWITCH, runs_triton, triton_available
from fitdqn.ops.linear_relu import linear_relu
from fitdqn.ops.prioritized import prioritized_draw, prioritized_update
from fitdqn.ops.projection import atom_positions, project_dense, project_returns
from fitdqn.ops.quantile_huber import QuantileHuber, quantile_huber, quantile_huber_sorted
from fitdqn.ops.replay_gather import GoalCrossing  # the operator keeps its module's name: fitdqn.ops.replay_gather
from fitdqn.ops.residual_norm import residual_layer_norm
from fitdqn.ops.weighted_losses import FusedWeightedLosses

__all__ = [
    "FUSED_DTYPES", "FusedWeightedLosses", "GoalCrossing", "QuantileHuber", "TRITON_SWITCH", "atom_positions",
    "c51_means", "cosine_embedding", "folded_output", "gather_in_place_grad", "iqn_quantile_head",
    "last_token_attention", "linear_relu", "prioritized_draw", "prioritized_update", "project_dense",
    "project_returns", "quantile_huber", "quantile_huber_sorted", "residual_layer_norm", "runs_triton",
    "triton_available",
]
