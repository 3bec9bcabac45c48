"""Time-ordered splits of a bar series: train / validation / test, and walk-forward folds. Index arithmetic only
(no pandas: the planner's stand-in system imports it)."""

from __future__ import annotations

from collections.abc import Iterator
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


def walk_forward(
    num_bars: int,
    folds: int,
    validation_bars: int,
    *,
    end: int | None = None,
    train_bars: int | None = None,
) -> Iterator[tuple[Split, Split]]:
    """Successive ``(train, validation)`` ranges: ``folds`` back-to-back validation blocks of
    ``validation_bars`` ending at ``end`` (default: all bars; pass the test split's start to keep the test
    split untouched), each trained on the bars before it: all of them (anchored, ``train_bars=None``) or the
    last ``train_bars`` (rolling)."""
    end = num_bars if end is None else end
    first = end - folds * validation_bars
    if folds < 1 or validation_bars < 1 or first <= 0 or end > num_bars:
        raise UserError(
            f"walk-forward: {folds} folds of {validation_bars} validation bars do not fit before bar {end} "
            f"of {num_bars}; use fewer folds or shorter validation blocks"
        )
    for k in range(folds):
        v_start = first + k * validation_bars
        t_start = 0 if train_bars is None else max(0, v_start - train_bars)
        yield (
            Split(f"train_{k}", t_start, v_start),
            Split(f"validation_{k}", v_start, v_start + validation_bars),
        )
