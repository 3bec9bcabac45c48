"""Walk-forward folds with purge gaps: one network per fold, trained on the past, selected on that fold's
validation bars, tested on the next block.

Layout (anchored, expanding train window): the bars after ``market.train_fraction`` of the series are cut into
``evaluate.folds`` back-to-back test blocks, so the pooled test bars cover that whole tail once. Fold k tests
on block k, validates on the ``market.validation_fraction`` of bars that end ``purge`` bars before the block,
and trains on every bar up to ``purge`` bars before its validation::

    | train ..................... | purge | validation | purge | test k | later blocks ...

The purge keeps the end of one range from informing the next (n-step returns near a range end, features
that summarise the last bars); features are causal, so later ranges see earlier bars' history as a trader
would.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from fitdqn.config import Config
from fitdqn.errors import UserError
from fitdqn.files import read_run_json
from fitdqn.market.loader import Market, check_enough_bars
from fitdqn.market.splits import Split


@dataclass(frozen=True)
class Fold:
    index: int
    train: Split
    validation: Split
    test: Split

    def splits(self) -> dict[str, Split]:
        return {"train": self.train, "validation": self.validation, "test": self.test}

    def to_json(self) -> dict:
        return {"index": self.index, **{name: [s.start, s.stop] for name, s in self.splits().items()}}

    @classmethod
    def from_json(cls, data: dict) -> Fold:
        return cls(int(data["index"]), *(Split(name, int(data[name][0]), int(data[name][1]))
                                         for name in ("train", "validation", "test")))


def purge_for(config: Config, num_bars: int) -> int:
    """``evaluate.purge_bars``, or (auto, -1) 1 % of the bars and at least ``learn.n_step``."""
    if config.evaluate.purge_bars >= 0:
        return config.evaluate.purge_bars
    return max(math.ceil(0.01 * num_bars), config.learn.n_step)


def walk_forward_folds(num_bars: int, folds: int, train_fraction: float, validation_fraction: float,
                       purge: int) -> list[Fold]:
    """The folds of the module docstring's layout over bars ``[0, num_bars)``."""
    first_test = int(round(num_bars * train_fraction))
    validation = int(round(num_bars * validation_fraction))
    edges = [first_test + round(k * (num_bars - first_test) / folds) for k in range(folds + 1)]
    out = []
    for k in range(folds):
        v_stop = edges[k] - purge
        v_start = v_stop - validation
        t_stop = v_start - purge
        if t_stop <= 0 or edges[k + 1] - edges[k] < 2:
            raise UserError(
                f"walk-forward: {folds} folds with a purge of {purge} bars do not fit {num_bars} bars (fold {k} "
                "would have no training bars or too short a test block); use fewer evaluate.folds, a smaller "
                "evaluate.purge_bars or market.validation_fraction, or more bars")
        out.append(Fold(k, Split("train", 0, t_stop), Split("validation", v_start, v_stop),
                        Split("test", edges[k], edges[k + 1])))
    return out


def folds_for(config: Config, num_bars: int) -> list[Fold]:
    m = config.market
    return walk_forward_folds(num_bars, config.evaluate.folds, m.train_fraction, m.validation_fraction,
                              purge_for(config, num_bars))


def fold_market(market: Market, fold: Fold, config: Config) -> Market:
    """The same market (tensors shared) with the fold's train/validation/test ranges, checked for enough bars."""
    fold_view = dataclasses.replace(market, splits=fold.splits())
    try:
        check_enough_bars(fold_view, config.net.window, config.market.episode_length)
    except UserError as error:
        raise UserError(f"walk-forward fold {fold.index}: {error}") from None
    return fold_view


FOLD_NAME = "fold.json"


def run_fold(run_dir: Path) -> Fold | None:
    """The fold a run directory was trained on (its fold.json, written by a walk-forward study), or None."""
    path = Path(run_dir) / FOLD_NAME
    if not path.is_file():
        return None
    return read_run_json(path, "it is written by the walk-forward study (fitdqn train --folds); restore it, or delete "
                         "this member's folder and run the study's command again to train its fold anew",
                         Fold.from_json)
