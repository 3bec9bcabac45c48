"""Time-ordered splits of a bar series: train / validation / test (walk-forward folds, with their purge gaps:
:mod:`fitdqn.evaluate.walk_forward`). Index arithmetic only (no pandas: the planner's stand-in system imports it)."""

from __future__ import annotations

from dataclasses import dataclass

from fitdqn.errors import UserError


@dataclass(frozen=True)
class Split:
    """Bars ``[start, stop)`` of the full series. Features are computed on the whole series (they are causal),
    so a later split's first bars see the history before it."""

    name: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def split_bars(num_bars: int, train_fraction: float, validation_fraction: float) -> dict[str, Split]:
    """Time-ordered ``train``, ``validation``, ``test`` splits (the test split is the rest)."""
    if not (0 < train_fraction and 0 < validation_fraction and train_fraction + validation_fraction < 1):
        raise UserError(
            "market.train_fraction and market.validation_fraction must be positive with a sum below 1"
        )
    train_stop = int(round(num_bars * train_fraction))
    validation_stop = int(round(num_bars * (train_fraction + validation_fraction)))
    return {
        "train": Split("train", 0, train_stop),
        "validation": Split("validation", train_stop, validation_stop),
        "test": Split("test", validation_stop, num_bars),
    }
