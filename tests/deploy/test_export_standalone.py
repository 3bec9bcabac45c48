"""An exported program is usable without fitdqn: its metadata rebuilds the run's features from the bars (the formulas
and windows it carries, run here in a namespace of torch and math only), and its reference observation gives the
output it records; a single observation without its batch dimension is refused, ``obs[None]`` accepted."""

import io
import json
import math

import pytest
import torch
from rich.console import Console
from support.small_run import SMALL_RUN

from fitdqn.config import Config, with_overrides
from fitdqn.deploy import export_policy, load_exported, load_run_policy
from fitdqn.market.features import bar_tensors
from fitdqn.market.loader import load_market
from fitdqn.market.observation import build_observation
from fitdqn.train.run import train


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    train(with_overrides(Config(), {**SMALL_RUN, "train.epochs": 1, "train.eval_every": 1}), folder / "run",
          console=Console(file=io.StringIO()))
    policy = load_run_policy(folder / "run", "cpu")
    program, meta = load_exported(export_policy(policy, folder / "policy.pt2"))
    return policy, program, meta


def features_from_metadata(features: dict, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """The metadata's recipe, followed literally: prelude, helpers, terms in order, formulas, then the rules."""
    space: dict = {}
    exec(features["prelude"], space)
    for source in features["helpers"].values():
        exec(source, space)
    space["b"] = b
    for name, expression in features["terms"].items():
        if name != "b":
            exec(f"{name} = {expression}", space)
    columns = [eval(features["formulas"][name], space) for name in features["names"]]  # [T] float64 each
    clip = features["clip"]
    out = torch.stack([torch.nan_to_num(c, nan=0.0, posinf=clip, neginf=-clip).clamp(-clip, clip)
                       for c in columns], dim=1).float()  # [T, Fm]
    out[: features["warmup"]] = 0.0
    return out


def test_the_metadata_rebuilds_the_runs_features(exported):
    policy, _, meta = exported
    market = load_market(policy.config.market, window=policy.config.net.window)
    features = meta["features"]
    assert features["names"] == list(features["formulas"]) and len(features["names"]) == 72
    assert features["windows"]["sma_periods"] == [5, 10, 20, 50, 100] and "import torch" in features["prelude"]
    assert "math" not in features["helpers"] and math  # the namespace is built from the metadata alone
    rebuilt = features_from_metadata(features, bar_tensors(market.bars))
    assert torch.equal(rebuilt, market.features)


def test_the_reference_observation_gives_the_recorded_output(exported):
    policy, program, meta = exported
    reference = meta["reference"]
    obs = torch.tensor(reference["obs"])  # [1, W, S]
    window = policy.config.net.window
    assert obs.shape == (1, window, 80) and meta["observation"]["shape"] == ["batch", window, 80]
    market = load_market(policy.config.market, window=window)
    agent = torch.zeros(1, 8)
    agent[0, meta["observation"]["agent_fields"].index("episode_left")] = 1.0
    assert torch.equal(obs, build_observation(market.features, torch.tensor([market.num_bars - 1]), agent, window))
    actions, q = program.module()(obs)
    assert actions.tolist() == reference["actions"] and torch.allclose(q, torch.tensor(reference["q"]))
    assert json.loads(json.dumps(meta)) == meta  # plain JSON: any language reads it


def test_a_single_observation_needs_its_batch_dimension(exported):
    _, program, meta = exported
    single = torch.tensor(meta["reference"]["obs"][0])  # [W, S]
    with pytest.raises(Exception, match=r"obs|dimensions"):
        program.module()(single)
    actions, _ = program.module()(single[None])
    assert actions.tolist() == meta["reference"]["actions"] and "obs[None]" in meta["observation"]["single"]
