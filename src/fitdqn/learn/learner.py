"""The learner: online + target Q networks, the IQL value net, one Adam, and the single update function.

``Learner.update(batch)`` is one pure, capturable step (no ``.item()``, no host sync, no Python branch on a
tensor value; every Python branch is on the config). It runs eagerly (the reference) and inside a CUDA
graph (``fitdqn.device.graphs.capture_graph``, the fast path).

The batch's observations arrive as the replay built them: with ``learn.obs_noise`` already noised there
(:func:`fitdqn.system.build_system`), so the update itself draws no noise.

What one update does, in order:

1. Targets, under ``no_grad`` (nothing kept for backward):
   - double DQN: the online net's C51 means on ``next_obs`` pick ``a*`` per branch; the target net gives
     the C51 distribution of ``a*`` on ``next_obs``, projected onto the support after ``r + discount * z``
     (``discount = gamma^m (1 - terminal)``, the n-step return comes in the batch);
   - IQN: the target net's quantiles of the same ``a*`` at N' fresh levels, ``r + discount * theta_j``;
   - IQL: the target net's C51 mean Q(s, a) of the taken actions, *averaged over branches* (every branch's
     Q estimates the same return in the branching architecture, so the average is the natural V target);
   - ``learn.iql_in_target``: V(s') replaces the bootstrap value in the TD target. Distributional targets
     keep their shape and are shifted so their mean is V(s'): C51 by adding ``discount * (V(s') - mean)``
     to the reward before projection, IQN by shifting the target quantiles by ``V(s') - mean_j theta_j``.
2. Losses on ``obs`` (one forward of the online trunk; C51 and IQN share its features):
   - C51: cross-entropy of the projected target against the taken sub-action's distribution, per branch,
     averaged over branches -> ``[B]``;
   - IQN: quantile Huber (kappa) of the taken sub-actions at N levels vs the N' targets, per branch,
     averaged over branches -> ``[B]``;
   - IQL: expectile regression (``learn.iql_expectile``) of V(s) (last token = current bar) -> ``[B]``.
   ``loss = mean_B(weight * (c51 + iqn_loss_weight * iqn + iql_loss_weight * iql))``; the importance weights
   apply to all three (prioritised sampling biases all of them). ``c51_loss``, ``iqn_loss``, ``iql_loss`` are
   the weighted means of each part.
3. New priorities ``[B]`` = the per-sample C51 cross-entropy averaged over branches (Rainbow's choice: the
   distributional analogue of |TD|), before ``^alpha``.
4. Data-parallel runs: the gradients averaged across ranks (``gradient_sync``, one all-reduce).
5. Gradient-norm clip (``learn.grad_clip``; ``grad_norm`` is the norm before clipping), one Adam step over
   all trainable parameters (online Q net + V net), the step counter, then the target update
   (:mod:`fitdqn.learn.target`). Learning rate and target rate follow the batch
   (:meth:`Learner.set_batch_size`, rules in :mod:`fitdqn.learn.schedule`).

Gradients are allocated once at construction (so they sit at fixed addresses for graph capture and count as
fixed memory, not activations); each update lets backward write fresh ones and copies them in with one
multi-tensor copy (``_keep_gradients``), instead of zeroing them and adding each into its buffer (a kernel per
parameter). Adam's state is initialised at construction too, for the same reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fitdqn.config import Config
from fitdqn.learn.act import select_actions
from fitdqn.learn.losses import categorical_projection, quantile_huber_loss, weighted_losses
from fitdqn.learn.precision import autocast, autocast_dtype
from fitdqn.learn.schedule import lr_factor, scaled_lr, target_period_at, target_tau_at
from fitdqn.learn.target import target_weight, update_target
from fitdqn.nets.iql import ValueNet
from fitdqn.nets.qnet import QNetwork
from fitdqn.ops.casts import casts_once
from fitdqn.ops.gather import gather_in_place_grad

UPDATE_BATCH_KEYS = ("obs", "action", "reward", "discount", "next_obs", "weight")
OUTPUT_KEYS = ("loss", "c51_loss", "iqn_loss", "iql_loss", "priorities", "q_mean", "v_mean", "grad_norm")


class Learner:
    """Online and target Q networks, V(s), one Adam; ``update`` and ``act``."""

    def __init__(self, config: Config, state_dim: int, device: torch.device | str) -> None:
        self.config = config
        self.net_config, self.learn_config = config.net, config.learn
        self.device = torch.device(device)
        self.state_dim = state_dim
        with self.device:  # built in place on the device (no .to(): also works under FakeTensorMode)
            self.online = QNetwork(config.net, state_dim)
            self.target = QNetwork(config.net, state_dim).requires_grad_(False)
            self.target.load_state_dict(self.online.state_dict())  # a copy (deepcopy breaks fake tensors)
            self.value = ValueNet(state_dim, config.net.iql_hidden)
        self.params = [*self.online.parameters(), *self.value.parameters()]
        self.online_params = list(self.online.parameters())
        self.target_params = list(self.target.parameters())
        self.autocast_dtype = autocast_dtype(self.learn_config.precision, self.device)
        # the parameters cast to the autocast dtype at an update's start, in one launch (fitdqn.ops.casts): the
        # layers read those copies
        self.cast_up_front = [*self.params, *self.target_params] if self.autocast_dtype is not None else []
        cuda = self.device.type == "cuda"
        # a tensor, so a captured update reads the rate the schedule sets between replays (set_lr_progress);
        # float64 on the CPU, where the one-kernel Adam then steps bit for bit as with a Python float rate
        lr_dtype = torch.float32 if cuda else torch.float64
        self.lr = torch.tensor(self.learn_config.lr, dtype=lr_dtype, device=self.device)  # []
        # (1, w_iqn, w_iql): the loss's weights as a tensor made once (a captured update copies nothing from the host)
        self.loss_weights = torch.tensor([1.0, self.learn_config.iqn_loss_weight, self.learn_config.iql_loss_weight],
                                         device=self.device)  # [3]
        self.lr_progress = 0.0
        decay = self.learn_config.weight_decay
        adam = torch.optim.AdamW if decay > 0 else torch.optim.Adam  # the same state: step, exp_avg, exp_avg_sq
        self.optimizer = adam(self.params, lr=self.lr, eps=self.learn_config.adam_eps, weight_decay=decay,
                              capturable=cuda, fused=True)
        self.step = torch.zeros((), dtype=torch.int64, device=self.device)  # updates done
        # data-parallel runs: averages the gradients across ranks, between backward and the clip/step (set by
        # the trainer from fitdqn.train.distributed; captured with the update on CUDA); None: one process
        self.gradient_sync: Callable[[], None] | None = None
        self._init_grads_and_optimizer()
        self.set_batch_size(self.learn_config.base_batch)

    def set_batch_size(self, batch_size: int) -> None:
        """Learning rate and target-network rate for updates of ``batch_size`` samples (the rules of
        :mod:`fitdqn.learn.schedule`). Call before capturing the update in a graph: the graph keeps them."""
        cfg = self.learn_config
        self.batch_size = int(batch_size)
        self.set_lr_progress(self.lr_progress)
        self.target_tau = target_tau_at(cfg, self.batch_size)
        self.target_period = target_period_at(cfg, self.batch_size)

    def set_lr_progress(self, progress: float) -> None:
        """The learning rate at ``progress`` through the run (0..1): the batch's rate (``scaled_lr``) times the
        decay's share (``lr_factor``); written into the rate tensor that the optimizer (and its graph) reads."""
        self.lr_progress = float(progress)
        self.lr.fill_(scaled_lr(self.learn_config, self.batch_size) * lr_factor(self.learn_config, progress))

    # ------------------------------------------------------------------ update

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One gradient step. ``batch`` keys: ``UPDATE_BATCH_KEYS`` (docs/DESIGN.md); returns ``OUTPUT_KEYS``. Each
        parameter is cast to the autocast dtype once (``fitdqn.ops.casts``), though the online net runs twice."""
        with casts_once(self.cast_up_front, self.autocast_dtype):
            return self._update(batch)

    def _update(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cfg = self.learn_config
        obs, action, weight = batch["obs"], batch["action"], batch["weight"]  # [B, W, S], [B, br], [B]
        for p in self.params:  # backward writes each gradient afresh: no zeroing pass, no accumulating add
            p.grad = None
        with autocast(self.device, self.autocast_dtype):
            c51_target, iqn_target, v_target = self._targets(batch)  # [B, br, A], [B, N', br], [B]
            features = self.online.features(obs)  # [B, d]
            logits = self.online.c51_logits(features)  # [B, br, n, A]
            logits = _take_atoms(logits, action)  # [B, br, A]
            log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [B, br, A]: one kernel from bf16
            taus = torch.rand(obs.shape[0], self.net_config.iqn_quantiles, device=self.device)  # [B, N]
            quantiles = _take_quantiles(self.online.quantiles(features, taus), action)  # [B, N, br]
            iqn = quantile_huber_loss(quantiles, iqn_target, taus, cfg.kappa)  # [B]
            v = self.value(obs[:, -1])  # [B]
        # c51 + w iqn + w iql, importance-weighted (fp32, an operator each way: fitdqn.learn.losses.weighted_losses)
        loss, means, priorities = weighted_losses(c51_target, log_probs, iqn, v, v_target, weight, self.loss_weights,
                                                  cfg.iql_expectile)
        loss.backward()
        self._keep_gradients()
        if self.gradient_sync is not None:
            self.gradient_sync()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True)
        self.optimizer.step()
        self.step.add_(1)
        update_target(self.target_params, self.online_params,
                      target_weight(self.step, cfg.target_update, self.target_tau, self.target_period))
        with torch.no_grad():
            q_mean = (log_probs.exp() * self.online.support).sum(-1).mean()  # taken actions, all branches
        return {
            "loss": loss.detach(),
            "c51_loss": means[0],
            "iqn_loss": means[1],
            "iql_loss": means[2],
            "priorities": priorities,  # [B]
            "q_mean": q_mean,
            "v_mean": v.detach().mean(),
            "grad_norm": grad_norm.detach(),
        }

    @torch.no_grad()
    def _targets(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        obs, next_obs = batch["obs"], batch["next_obs"]  # [B, W, S]
        reward, discount, action = batch["reward"], batch["discount"], batch["action"]  # [B], [B], [B, br]
        size = obs.shape[0]
        online, target = self.online, self.target
        best = online.greedy(online.q_values(online.c51_logits(online.features(next_obs))))  # [B, br]
        both = target.features(torch.cat([obs, next_obs]))  # [2B, d]: one pass over s and s'
        target_logits = target.c51_logits(both)  # [2B, br, n, A]
        v_target = target.q_values(_take_atoms(target_logits[:size], action)).mean(-1)  # [B]
        next_probs = torch.softmax(_take_atoms(target_logits[size:], best), dim=-1, dtype=torch.float32)  # [B, br, A]
        taus = torch.rand(size, self.net_config.iqn_quantiles, device=self.device)  # [B, N']
        next_quantiles = _take_quantiles(target.quantiles(both[size:], taus), best)  # [B, N', br]
        rewards = reward  # [B] (or [B, br] below)
        if self.learn_config.iql_in_target:
            next_q = (next_probs * target.support).sum(-1)  # [B, br]
            v_next = self.value(next_obs[:, -1]).unsqueeze(-1)  # [B, 1]
            rewards = reward.unsqueeze(-1) + discount.unsqueeze(-1) * (v_next - next_q)  # target mean r + d V(s')
            next_quantiles = next_quantiles + (v_next - next_quantiles.mean(1)).unsqueeze(1)
        c51_target = categorical_projection(next_probs, rewards, discount, target.support)
        iqn_target = reward.view(-1, 1, 1) + discount.view(-1, 1, 1) * next_quantiles  # [B, N', br]
        return c51_target, iqn_target, v_target

    # ------------------------------------------------------------------ acting

    @property
    def evaluated(self) -> QNetwork:
        """The network backtests, ``best.pt`` and the report use (``evaluate.reported_network``): the online one, or the
        target network (its Polyak average). Its parameters are read in place, so a captured backtest follows
        the updates."""
        return self.target if self.config.evaluate.reported_network == "target" else self.online

    def act(self, obs: torch.Tensor, epsilon: torch.Tensor, generator: torch.Generator | None = None,
            network: QNetwork | None = None) -> torch.Tensor:
        """``obs [E, W, S]``, ``epsilon`` float tensor -> ``[E, branches]`` int64 (learn.risk decides), by the
        online network (collection) or ``network`` (``evaluated`` for the backtests)."""
        cfg = self.learn_config
        with autocast(self.device, self.autocast_dtype):
            return select_actions(network if network is not None else self.online, obs, epsilon, cfg.risk,
                                  cfg.cvar_alpha, cfg.risk_aversion, self.net_config.iqn_act_quantiles, generator)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Nets, target, optimizer and step counter. Like ``nn.Module.state_dict`` it holds references to the
        live tensors: ``torch.save`` it, or deep-copy it for an in-memory snapshot."""
        return {
            "online": self.online.state_dict(),
            "target": self.target.state_dict(),
            "value": self.value.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a state in place: every tensor keeps its address, so a captured update graph stays valid."""
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        self.value.load_state_dict(state["value"])
        own = self.optimizer.state_dict()
        loaded = state["optimizer"]
        if len(own["param_groups"]) != len(loaded["param_groups"]) or set(own["state"]) != set(loaded["state"]):
            raise ValueError("optimizer state does not match this learner's parameters")
        with torch.no_grad():
            for index, slots in own["state"].items():
                for key, tensor in slots.items():
                    tensor.copy_(loaded["state"][index][key])
        for group, loaded_group in zip(self.optimizer.param_groups, loaded["param_groups"], strict=True):
            for key, value in loaded_group.items():
                if key == "params":
                    continue
                if isinstance(group[key], torch.Tensor):  # the rate tensor: in place (a graph reads it)
                    group[key].copy_(value)
                else:
                    group[key] = value
        self.step.copy_(state["step"])

    # ------------------------------------------------------------------ setup

    def _keep_gradients(self) -> None:
        """Copy the gradients backward wrote into the ones kept at fixed addresses (one multi-tensor copy; zeros
        for a parameter that got none) and put those back as ``.grad``: what the all-reduce, the clip and Adam
        read, and what persists between updates."""
        targets, grads, unwritten = [], [], []
        for p, kept in zip(self.params, self.gradients, strict=True):
            if p.grad is None:
                unwritten.append(kept)
            else:
                targets.append(kept)
                grads.append(p.grad)
            p.grad = kept
        if grads:
            torch._foreach_copy_(targets, grads)
        if unwritten:
            torch._foreach_zero_(unwritten)

    def _init_grads_and_optimizer(self) -> None:
        """Allocate gradients and Adam state now (fixed memory, fixed addresses), leaving Adam at step 0."""
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.gradients = [p.grad for p in self.params]  # [P]: kept for good (``_keep_gradients``)
        self.optimizer.step()  # zero gradients: moments stay 0 and parameters do not move
        for slots in self.optimizer.state.values():
            slots["step"].zero_()


def _take_atoms(logits: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """The taken sub-action per branch: ``logits [B, br, n, A]``, ``action [B, br]`` -> ``[B, br, A]``."""
    index = action.unsqueeze(-1).unsqueeze(-1).expand(-1, -1, 1, logits.shape[-1])  # [B, br, 1, A]
    return gather_in_place_grad(logits, 2, index).squeeze(2)


def _take_quantiles(values: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """``values [B, N, br, n]``, ``action [B, br]`` -> ``[B, N, br]``."""
    index = action.unsqueeze(1).unsqueeze(-1).expand(-1, values.shape[1], -1, 1)  # [B, N, br, 1]
    return gather_in_place_grad(values, 3, index).squeeze(3)
