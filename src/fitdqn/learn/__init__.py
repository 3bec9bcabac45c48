"""The update: losses, the single capturable update function, target updates, acting.

CUDA graphs of the update are captured by :func:`fitdqn.device.graphs.capture_graph`, the one capture path.

The names below are loaded on first use (PEP 562): ``fitdqn.learn.schedule``, which `fitdqn plan` reads to print
a run's budget, then does not pull in the networks.
"""

from fitdqn.lazy import lazy_names

_HOMES = {
    "select_actions": "act", "random_batch": "batch", "UPDATE_BATCH_KEYS": "learner", "OUTPUT_KEYS": "learner",
    "Learner": "learner", "categorical_projection": "losses",
    "quantile_huber_loss": "losses", "autocast": "precision", "autocast_dtype": "precision", "Schedule": "schedule",
    "scaled_lr": "schedule", "lr_factor": "schedule", "target_period_at": "schedule", "target_tau_at": "schedule",
    "updates_owed": "schedule",
    "target_weight": "target", "update_target": "target",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
