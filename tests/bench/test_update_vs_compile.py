"""benchmarks/update_vs_compile.py: its plain PyTorch update is the learner's maths, and it runs (so it cannot rot).

The plain implementation gets the weights of a fitdqn learner (the unfused CPU path) and must give the same losses
and priorities on the same batch and quantile levels; then its step runs, gives finite losses and moves the
parameters; the script's driver writes its JSON at tiny sizes.
"""

from __future__ import annotations

import json
import time

import torch
from support.benchmarks import load_benchmark

from fitdqn.config import Config, NetConfig
from fitdqn.learn import Learner, random_batch

STATE_DIM = 10
SMALL_NET = NetConfig(window=4, trunk_hidden=32, d_model=16, attention_heads=4, stream_hidden=16, num_atoms=11,
                      iqn_embedding=8, iqn_quantiles=8, iqn_act_quantiles=4, iql_hidden=16)


def small_config() -> Config:
    return Config(net=SMALL_NET)


def make_learner(seed: int, config: Config) -> Learner:
    torch.manual_seed(seed)
    return Learner(config, STATE_DIM, "cpu")


def make_batch(size: int, config: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    return random_batch(config, STATE_DIM, size, "cpu", seed=seed)


def load_bench():
    return load_benchmark("update_vs_compile")


def copy_weights(learner, plain) -> None:
    """fitdqn's online/target/value weights into the plain nets (fused stream layer split, padding dropped)."""
    net = learner.net_config
    atoms, n, hidden = net.num_atoms, net.branches[0], net.stream_hidden
    with torch.no_grad():
        for source, target in ((learner.online, plain.online), (learner.target, plain.target)):
            for name in ("fc1", "fc2"):
                getattr(target, name).load_state_dict(getattr(source.tokens, name).state_dict())
            for name in ("query", "key_value", "out", "norm"):
                getattr(target, name).load_state_dict(getattr(source.attention, name).state_dict())
            streams = source.c51.hidden
            target.value[0].weight.copy_(streams.weight[:hidden])
            target.value[0].bias.copy_(streams.bias[:hidden])
            target.value[2].weight.copy_(source.c51.value.weight[:atoms])
            target.value[2].bias.copy_(source.c51.value.bias[:atoms])
            for b, (layer, adv) in enumerate(zip(source.c51.advantages, target.advantages, strict=True)):
                rows = slice((1 + b) * hidden, (2 + b) * hidden)
                adv[0].weight.copy_(streams.weight[rows])
                adv[0].bias.copy_(streams.bias[rows])
                adv[2].weight.copy_(layer.weight[:n * atoms])
                adv[2].bias.copy_(layer.bias[:n * atoms])
            target.iqn_embed.load_state_dict(source.iqn.embed.state_dict())
            target.iqn_out.load_state_dict(source.iqn.out.state_dict())
        for i, name in ((0, "fc1"), (2, "fc2"), (4, "fc3")):
            plain.value[i].load_state_dict(getattr(learner.value, name).state_dict())


def test_plain_update_is_fitdqns_maths():
    bench = load_bench()
    config = small_config()
    learner = make_learner(seed=1, config=config)
    batch = make_batch(64, seed=2, config=config)
    plain = bench.PlainLearner(config.net, config.learn, STATE_DIM, torch.device("cpu"))
    copy_weights(learner, plain)
    size, quantiles = 64, config.net.iqn_quantiles
    torch.manual_seed(5)
    next_taus = torch.rand(size, quantiles)  # the learner draws the target's levels first, then the online's
    taus = torch.rand(size, quantiles)
    torch.manual_seed(5)
    expected = learner.update(batch)  # learn.obs_noise is drawn where batches are sampled, not in the update
    got = plain.losses(batch, taus, next_taus)
    for key in ("loss", "c51_loss", "iqn_loss", "iql_loss", "priorities"):
        torch.testing.assert_close(got[key].detach(), expected[key], rtol=1e-4, atol=1e-5, msg=key)
    assert float(expected["iqn_loss"]) > 0 and float(expected["iql_loss"]) > 0


def test_plain_projection_keeps_mass_and_mean():
    bench = load_bench()
    support = torch.linspace(-2.0, 2.0, 11)
    probs = torch.softmax(torch.randn(32, 3, 11), -1)
    reward, discount = torch.randn(32) * 0.5, torch.full((32,), 0.9)
    target = bench.project(probs, reward, discount, support)
    torch.testing.assert_close(target.sum(-1), torch.ones(32, 3))
    shifted = (reward[:, None, None] + discount[:, None, None] * support).clamp(-2.0, 2.0)
    torch.testing.assert_close((target * support).sum(-1), (probs * shifted).sum(-1), rtol=1e-5, atol=1e-5)
    edge = bench.project(probs, torch.full((32,), 2.0), torch.zeros(32), support)  # every atom lands on v_max
    torch.testing.assert_close(edge[..., -1], torch.ones(32, 3))


def test_plain_step_runs_and_learns_something():
    bench = load_bench()
    config = small_config()
    torch.manual_seed(0)
    plain = bench.PlainLearner(config.net, config.learn, STATE_DIM, torch.device("cpu"))
    batch = make_batch(32, config=config)
    before = [p.detach().clone() for p in plain.params]
    target_before = [p.detach().clone() for p in plain.target_params]
    for _ in range(3):
        out = plain.step(batch)
    assert all(torch.isfinite(v).all() for v in out.values())
    assert out["priorities"].shape == (32,)
    assert any(not torch.equal(a, b) for a, b in zip(before, plain.params, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(target_before, plain.target_params, strict=True))


def test_driver_writes_json_on_cpu(tmp_path):
    bench = load_bench()
    out = tmp_path / "uvc.json"
    tiny = ["--set", "net.window=4", "--set", "net.trunk_hidden=16", "--set", "net.d_model=8", "--set",
            "net.stream_hidden=8", "--set", "net.num_atoms=5", "--set", "net.iqn_embedding=4", "--set",
            "net.iqn_quantiles=4", "--set", "net.iql_hidden=8"]
    assert bench.main(["--device", "cpu", "--batches", "8,16", "--iters", "1", "--warmup", "0", "--state-dim", "10",
                       "--modes", "fitdqn-eager,eager", "--out", str(out), *tiny]) == 0
    result = json.loads(out.read_text())
    rows = result["results"]
    assert [(r["impl"], r["mode"], r["batch"]) for r in rows] == [
        ("fitdqn", "eager", 8), ("plain", "eager", 8), ("fitdqn", "eager", 16), ("plain", "eager", 16)]
    assert all(r["ms"] > 0 and r["outputs_finite"] for r in rows)


def test_compile_limit_is_recognised_through_wrappers():
    bench = load_bench()
    try:
        with bench.time_limit(0.05):
            time.sleep(5)
    except bench.CompileTimeout as error:
        caught = error
    assert isinstance(caught, bench.CompileTimeout)
    try:
        try:
            raise bench.CompileTimeout
        except bench.CompileTimeout as inner:
            raise RuntimeError("InductorError") from inner
    except RuntimeError as wrapped:
        assert bench.timed_out(wrapped)
    assert not bench.timed_out(ValueError("shape mismatch"))


def test_marginal_bytes_and_ratios():
    bench = load_bench()
    rows = [{"impl": "fitdqn", "mode": "graph", "batch": 1024, "ms": 1.0, "peak_bytes": 3 * 2**20},
            {"impl": "plain", "mode": "compile", "batch": 1024, "ms": 2.0, "peak_bytes": 6 * 2**20},
            {"impl": "fitdqn", "mode": "graph", "batch": 2048, "ms": 2.0, "peak_bytes": 5 * 2**20},
            {"impl": "plain", "mode": "compile", "batch": 2048, "ms": 3.0, "peak_bytes": 12 * 2**20}]
    bench.add_ratios(rows)
    assert rows[2]["marginal_kb_per_sample"] == 2.0 and rows[3]["marginal_kb_per_sample"] == 6.0
    assert rows[1]["ms_over_fitdqn_graph"] == 2.0 and rows[3]["ms_over_fitdqn_graph"] == 1.5
    assert rows[3]["kb_over_fitdqn_graph"] == 12 / 5
