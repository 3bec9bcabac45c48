import pytest
from support.small_run import SMALL_RUN

from fitdqn.config import Config, with_overrides

SMALL = {**SMALL_RUN, "train.epochs": 4, "train.eval_every": 2, "train.sample_reuse": 1.0, "train.min_updates": 1}


@pytest.fixture
def small_config(tmp_path):
    def make(**overrides):
        values = {**SMALL, "train.out": str(tmp_path / "run"), **overrides}
        return with_overrides(Config(), values)

    return make
