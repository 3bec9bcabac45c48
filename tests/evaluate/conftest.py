import pytest
from support.small_run import SMALL_RUN

from fitdqn.config import Config, with_overrides

# the small run in runs of 2 epochs validated after each
SMALL = {**SMALL_RUN, "train.epochs": 2, "train.eval_every": 1, "evaluate.bootstrap_samples": 200}


@pytest.fixture
def small_config(tmp_path):
    def make(**overrides):
        values = {**SMALL, "train.out": str(tmp_path / "run"), **overrides}
        return with_overrides(Config(), values)

    return make
