"""The training budget: what a run does, in quantities the batch size does not move.

The planner picks the batch for the card (64 on a small card, 16384 on an H200); what the agent learns must
not follow that choice. So a run is set by:

* **sample reuse** (``train.sample_reuse``): samples drawn per transition collected. After ``C`` transitions
  have been collected the run owes ``floor(reuse x C / batch)`` updates in all; each epoch makes the updates
  still owed (the fractional remainder is carried, so the run's total is exact, and a batch changed by the
  OOM guard changes the count of the remaining updates, not the samples);
* **the learning rate at a base batch** (``learn.lr`` at ``learn.lr_base_batch``, by default the tested batch of
  the device's profile), scaled for the batch in use by ``learn.lr_scaling``: ``'linear'`` (default; ``lr x
  batch / lr_base_batch``: Goyal et al. 2017; with Adam each update moves the weights by about the rate, so the
  rate times the updates, the weights' travel, stays the same at every batch for the same samples: on the H200 the
  square-root rule, capped, left batch 2048 at validation Sharpe 1.45 where the profile's 16384 reached 3.09, the
  linear rule 2.11), ``'sqrt'`` (``lr x sqrt(batch / lr_base_batch)``, Malladi et al. 2022, "On the SDEs and
  scaling rules for adaptive gradient algorithms") or ``'none'``, never above ``learn.lr_max`` (the rules hold
  while the rate is small: at batch 16384 the square-root rule's 4e-3 from 5e-4 at 256 diverged on the synthetic
  market), and over the run by ``learn.lr_decay`` (``lr_factor``: cosine or linear down to ``learn.lr_final`` of
  it, on the clock of the run's env steps, so the decay sits at the same point of the run at every batch);
* **target-network time constants in samples**: the soft factor ``learn.target_tau`` is the Polyak factor of
  one update at the base batch; at batch ``B`` it is ``1 - (1 - tau)^(B / base_batch)``, so after any number
  of samples the online weights' share in the target is the same at every batch. A hard copy every
  ``learn.target_period`` updates at the base batch is a copy every ``period x base_batch / B`` updates;
* **exploration and importance-weight schedules as fractions of the run's env steps**: epsilon decays over
  ``learn.epsilon_decay_fraction`` of them, beta anneals from ``replay.beta_start`` to ``replay.beta_end``
  over all of them;
* **a floor of updates** (``train.min_updates``): past a batch size, fewer, larger steps stop making the same
  progress per sample (McCandlish et al. 2018, "An empirical model of large-batch training": a run needs at
  least a minimum number of steps whatever its batch), and the learning-rate rule is capped. A run whose
  ``reuse x env steps / batch`` falls below the floor draws more samples per transition so that it makes
  ``train.min_updates`` updates (the plan table and the report say so); above the floor the samples are the same
  at every batch;
* **min_fill bounded by what the run collects**: updates start once ``min(replay.min_fill, one epoch's
  transitions)`` are stored, whatever the batch (a batch larger than the replay holds draws with replacement,
  as prioritized sampling always does), so a large batch does not start learning epochs after a small one.

:class:`Schedule` holds the values at one batch; the plan table and the run's report print it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from fitdqn.config import Config, LearnConfig, knob_choices

LR_SCALINGS = knob_choices(LearnConfig, "lr_scaling")
LR_DECAYS = knob_choices(LearnConfig, "lr_decay")


def scaled_lr(learn: LearnConfig, batch_size: int) -> float:
    """``learn.lr`` (given at ``learn.lr_base_batch``) for ``batch_size`` under ``learn.lr_scaling``; the rule
    scales up to ``learn.lr_max`` (a ``learn.lr`` above it is kept as given). An unresolved ``lr_base_batch`` (0:
    a config that ``fitdqn.resolve.resolve_for_device`` has not seen) counts from ``learn.base_batch``."""
    ratio = batch_size / (learn.lr_base_batch or learn.base_batch)
    cap = max(learn.lr_max, learn.lr)
    if learn.lr_scaling == "sqrt":
        return min(learn.lr * math.sqrt(ratio), cap)
    if learn.lr_scaling == "linear":
        return min(learn.lr * ratio, cap)
    if learn.lr_scaling == "none":
        return learn.lr
    raise ValueError(f"learn.lr_scaling must be one of {LR_SCALINGS}, got {learn.lr_scaling!r}")


def lr_factor(learn: LearnConfig, progress: float) -> float:
    """The share of the batch's learning rate at ``progress`` (0 = the run's start, 1 = its end) under
    ``learn.lr_decay``: 1 throughout for 'none'; 'cosine' and 'linear' go from 1 down to ``learn.lr_final``."""
    progress = min(max(progress, 0.0), 1.0)
    if learn.lr_decay == "none":
        return 1.0
    if learn.lr_decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif learn.lr_decay == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"learn.lr_decay must be one of {LR_DECAYS}, got {learn.lr_decay!r}")
    return learn.lr_final + (1.0 - learn.lr_final) * shape


def target_tau_at(learn: LearnConfig, batch_size: int) -> float:
    """Polyak factor per update at ``batch_size`` with the same time constant in samples as
    ``learn.target_tau`` per update at ``learn.base_batch``."""
    return 1.0 - (1.0 - learn.target_tau) ** (batch_size / learn.base_batch)


def target_period_at(learn: LearnConfig, batch_size: int) -> int:
    """Updates between hard target copies at ``batch_size``: ``learn.target_period`` updates at the base batch
    in samples (at least 1)."""
    return max(1, round(learn.target_period * learn.base_batch / batch_size))


def floored_reuse(sample_reuse: float, min_updates: int, env_steps: int, batch_size: int) -> float:
    """``sample_reuse``, or the larger reuse that makes ``min_updates`` updates of ``batch_size`` over ``env_steps``
    (the floor of updates)."""
    if env_steps <= 0 or updates_owed(sample_reuse, env_steps, 0, batch_size) >= min_updates:
        return float(sample_reuse)
    return min_updates * batch_size / env_steps


def updates_owed(sample_reuse: float, collected: int, samples_done: int, batch_size: int) -> int:
    """Updates still owed after ``collected`` transitions, ``samples_done`` samples drawn so far."""
    return max(0, math.floor((sample_reuse * collected - samples_done) / batch_size + 1e-9))


@dataclass(frozen=True)
class Schedule:
    """A run's budget at one batch size (module docstring): totals over the planned epochs and the derived
    per-update values."""

    batch_size: int
    epochs: int
    requested_reuse: float  # train.sample_reuse
    env_steps_per_epoch: int  # num_envs x steps_per_epoch
    env_steps: int  # over the run
    sample_reuse: float  # the reuse the run draws: train.sample_reuse, or more where the floor of updates binds
    samples: int  # drawn over the run: updates x batch (<= reuse x env_steps)
    updates: int  # over the run
    lr: float  # at the run's start
    lr_end: float  # at its end (learn.lr_decay)
    lr_decay: str
    target_update: str
    target_tau: float  # per update (soft)
    target_period: int  # updates (hard)
    epsilon_decay_steps: int  # env steps
    min_fill: int  # transitions stored before the first update
    min_updates: int  # the floor below which the run is reported as too short

    @classmethod
    def from_config(cls, config: Config, batch_size: int) -> Schedule:
        """The schedule of ``config`` (device values resolved: ``collect.num_envs`` > 0) at ``batch_size``."""
        learn, train = config.learn, config.train
        per_epoch = config.collect.num_envs * config.collect.steps_per_epoch
        env_steps = per_epoch * train.epochs
        reuse = floored_reuse(train.sample_reuse, train.min_updates, env_steps, batch_size)
        updates = updates_owed(reuse, env_steps, 0, batch_size)
        return cls(
            batch_size=batch_size,
            epochs=train.epochs,
            requested_reuse=train.sample_reuse,
            env_steps_per_epoch=per_epoch,
            env_steps=env_steps,
            sample_reuse=reuse,
            samples=updates * batch_size,
            updates=updates,
            lr=scaled_lr(learn, batch_size),
            lr_end=scaled_lr(learn, batch_size) * lr_factor(learn, 1.0),
            lr_decay=learn.lr_decay,
            target_update=learn.target_update,
            target_tau=target_tau_at(learn, batch_size),
            target_period=target_period_at(learn, batch_size),
            epsilon_decay_steps=max(1, round(learn.epsilon_decay_fraction * env_steps)),
            min_fill=min(config.replay.min_fill, per_epoch),
            min_updates=train.min_updates,
        )

    def progress(self, env_steps: int) -> float:
        """The share of the run's env steps collected after ``env_steps`` (0..1): the clock of the annealed knobs
        (importance-weight beta, the learning rate's decay)."""
        return min(env_steps / max(self.env_steps, 1), 1.0)

    @property
    def floored(self) -> bool:
        """The floor of updates binds: the run draws more than ``train.sample_reuse`` samples per transition."""
        return self.sample_reuse > self.requested_reuse

    def warning(self) -> str | None:
        """What the floor of updates changed, and how to avoid it; None where it does not bind."""
        if not self.floored:
            return None
        return (
            f"{self.env_steps:,} env steps x train.sample_reuse {self.requested_reuse:g} / batch {self.batch_size:,} "
            f"would make {updates_owed(self.requested_reuse, self.env_steps, 0, self.batch_size):,} updates, "
            f"fewer than train.min_updates = {self.min_updates:,}: the run draws {self.sample_reuse:.3g} samples "
            f"per transition instead ({self.updates:,} updates). For the same samples at every batch, raise "
            "train.epochs (or collect.steps_per_epoch) or give a smaller --batch-size; train.min_updates 0 turns "
            "the floor off"
        )

    def rows(self) -> list[tuple[str, str]]:
        """(what, value) lines for the plan table and the report."""
        target = (f"soft, tau {self.target_tau:.4g} per update" if self.target_update == "soft"
                  else f"hard copy every {self.target_period:,} updates")
        reuse = (f"train.sample_reuse {self.requested_reuse:g} per env step" if not self.floored
                 else f"{self.sample_reuse:.3g} per env step: the floor of train.min_updates {self.min_updates:,}")
        return [
            ("env steps", f"{self.env_steps:,}  ({self.epochs} epochs x {self.env_steps_per_epoch:,})"),
            ("updates", f"{self.updates:,}  at batch {self.batch_size:,}"),
            ("samples", f"{self.samples:,}  ({reuse})"),
            ("learning rate", f"{self.lr:.4g}" if self.lr_decay == "none"
             else f"{self.lr:.4g} -> {self.lr_end:.4g}  ({self.lr_decay} over the run)"),
            ("target network", target),
            ("epsilon decay", f"over {self.epsilon_decay_steps:,} env steps"),
            ("updates start", f"after {self.min_fill:,} transitions"),
        ]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
