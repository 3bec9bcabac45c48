"""Learning checks on the DEFAULT config (`fitdqn train --data synthetic` on a CPU: the small nets, 32 envs x 64 steps
x 20 epochs = 40,960 env steps, train.sample_reuse 8), seed 0:

* at the CPU's batch 256 (1,280 updates) it trades the synthetic market's planted edge profitably on the held-out
  test split, beside buy-and-hold, random and the last-bar momentum rule (the rule the market plants);
* at batch 2048 the same config learns the same: its budget (the same env steps and samples, here raised to the
  floor of train.min_updates = 200 updates; the learning-rate rule; target and exploration schedules in samples and
  fractions of the run) keeps the validation Sharpe of the network it reports within 20 % of batch 256's.

Why validation and not test for the 20 %: the test Sharpe of one seed moves more than 20 % between seeds at the same
batch (batch 256, seeds 20-29: 0.76 to 3.02), so a 20 % band on it would be a coin flip; the validation Sharpe of
the reported network (chosen on validation alone) moves less (2.64 to 4.14). The test figures are
checked against the baselines at both batches. Why not 16384 here: an update of 16,384 samples through nets that
learn this edge takes about 2 s on two cores, and the floor's 200 of them would be 7 minutes; the H200 check at
2048 / 8192 / 16384 with the default nets is in BENCHMARKS.md ("Batch invariance" under "On a GPU").
"""

import pytest

from fitdqn.config import Config, with_overrides
from fitdqn.train.run import train

BATCHES = (256, 2048)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = {}
    for batch in BATCHES:
        config = with_overrides(Config(), {"market.data": "synthetic", "train.device": "cpu", "train.seed": 0,
                                           **({} if batch == 256 else {"budget.batch_size": batch})})
        out[batch] = train(config, tmp_path_factory.mktemp(f"b{batch}") / "run")
    return out


def beats_the_baselines(test: dict) -> None:
    sharpe = test["agent"]["sharpe"]
    assert sharpe > test["buy_and_hold"]["sharpe"] + 1.0
    assert sharpe > test["random"]["sharpe"] + 1.0
    assert test["agent"]["total_return"] > max(test["buy_and_hold"]["total_return"], test["random"]["total_return"])


def test_the_default_config_learns_the_planted_edge_and_beats_the_baselines(reports):
    report = reports[256]
    assert report["batch_size"] == 256 and report["updates"] == 1280  # the default budget, nothing tuned here
    test = report["test"]
    # seed 0 clears these; another thread count reorders float sums and so moves one seed's run. Over CPU seeds
    # 20-29 the test Sharpe is 0.76 .. 3.02, median 2.03, the momentum rule sized like the agent 2.14 (BENCHMARKS.md,
    # "Position sizing")
    assert test["agent"]["sharpe"] >= 1.0
    assert test["agent"]["sharpe"] >= 0.5 * test["last_bar_momentum"]["sharpe"]
    beats_the_baselines(test)


def test_the_same_config_learns_the_same_at_a_larger_batch(reports):
    small, large = reports[256], reports[2048]
    assert large["batch_size"] == 2048 and small["env_steps"] == large["env_steps"]
    assert large["updates"] == 200 and large["schedule"]["sample_reuse"] > 8  # 160 by reuse alone: the floor
    validation = [r["validation"]["agent"]["sharpe"] for r in (small, large)]
    assert min(validation) >= 0.8 * max(validation), validation
    beats_the_baselines(large["test"])
