"""The fixtures the test folders share: a small run's config writing into the test's temporary folder."""

import pytest
from support.small_run import SMALL_RUN

from fitdqn.config import Config, with_overrides

# the trainer's tests: 4 epochs validated every 2nd, one sample drawn per transition, at least one update
SMALL = {**SMALL_RUN, "train.epochs": 4, "train.eval_every": 2, "train.sample_reuse": 1.0, "train.min_updates": 1}
# the evaluation's tests: 2 epochs validated after each, a short bootstrap
TWO_EPOCHS = {**SMALL_RUN, "train.epochs": 2, "train.eval_every": 1, "evaluate.bootstrap_samples": 200}


def config_maker(values: dict, tmp_path):
    def make(**overrides):
        return with_overrides(Config(), {**values, "train.out": str(tmp_path / "run"), **overrides})

    return make


@pytest.fixture
def small_config(tmp_path):
    return config_maker(SMALL, tmp_path)


@pytest.fixture
def two_epoch_config(tmp_path):
    return config_maker(TWO_EPOCHS, tmp_path)
