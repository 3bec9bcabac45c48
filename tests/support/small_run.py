"""The small run every CPU training test builds on: tiny nets on 1,200 synthetic bars, 16 envs, batch 64, no floor of
updates (a test's run makes the updates its sample reuse gives, not train.min_updates)."""

SMALL_RUN = {
    "market.data": "synthetic", "market.synthetic_bars": 1200, "market.episode_length": 32,
    "net.window": 4, "net.trunk_hidden": 64, "net.d_model": 32, "net.stream_hidden": 32, "net.num_atoms": 11,
    "net.iqn_embedding": 16, "net.iqn_quantiles": 8, "net.iqn_act_quantiles": 8, "net.iql_hidden": 32,
    "collect.num_envs": 16, "collect.steps_per_epoch": 16,
    "replay.capacity": 4096, "replay.min_fill": 128,
    "budget.batch_size": 64,
    "train.device": "cpu", "train.checkpoint_every": 2, "train.eval_seeds": 1, "train.min_updates": 0,
}
