import pytest

from fitdqn.config import Config, with_overrides

SMALL = {
    "market.data": "synthetic", "market.synthetic_bars": 1200, "market.episode_length": 32,
    "net.window": 4, "net.trunk_hidden": 64, "net.d_model": 32, "net.stream_hidden": 32, "net.num_atoms": 11,
    "net.iqn_embedding": 16, "net.iqn_quantiles": 8, "net.iqn_act_quantiles": 8, "net.iql_hidden": 32,
    "collect.num_envs": 16, "collect.steps_per_epoch": 16,
    "replay.capacity": 4096, "replay.min_fill": 128,
    "budget.batch_size": 64,
    "train.device": "cpu", "train.epochs": 4, "train.eval_every": 2, "train.checkpoint_every": 2,
    "train.sample_reuse": 1.0, "train.min_updates": 1,
    "train.eval_seeds": 1,
}


@pytest.fixture
def small_config(tmp_path):
    def make(**overrides):
        values = {**SMALL, "train.out": str(tmp_path / "run"), **overrides}
        return with_overrides(Config(), values)

    return make
