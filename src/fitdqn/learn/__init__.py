"""The update: losses, the single capturable update function, target updates, acting.

CUDA graphs of the update are captured by :func:`fitdqn.device.graphs.capture_graph`, the one capture path.
"""

from fitdqn.learn.act import select_actions
from fitdqn.learn.batch import random_batch
from fitdqn.learn.learner import BATCH_KEYS, OUTPUT_KEYS, Learner
from fitdqn.learn.losses import categorical_projection, expectile_loss, quantile_huber_loss
from fitdqn.learn.precision import autocast, autocast_dtype
from fitdqn.learn.schedule import Schedule, scaled_lr, target_period_at, target_tau_at, updates_owed
from fitdqn.learn.target import target_weight, update_target

__all__ = [
    "BATCH_KEYS", "OUTPUT_KEYS", "Learner", "Schedule", "autocast",
    "autocast_dtype", "categorical_projection", "expectile_loss",
    "quantile_huber_loss", "random_batch", "scaled_lr", "select_actions", "target_period_at", "target_tau_at",
    "target_weight", "update_target", "updates_owed",
]
