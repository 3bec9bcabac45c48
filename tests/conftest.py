"""The fixtures the test folders share: a small run's config writing into the test's temporary folder.

The suite runs torch on one CPU thread (``OMP_NUM_THREADS``, unless set), in this process and in every command a
test starts: ``train.threads = 0`` otherwise takes the cores the machine's load leaves idle, and runs a test compares
would then differ with the load (a sum over 1 or 2 threads rounds differently)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch sizes its thread pool

import pytest  # noqa: E402
from support.small_run import SMALL_RUN  # noqa: E402

from fitdqn.config import Config, with_overrides  # noqa: E402

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
