"""fitdqn.market: bars, contract specs, causal features, the vectorised futures env, a gymnasium adapter.

Importing this package registers the gymnasium id ``fitdqn/Futures-v0`` (``gymnasium.make`` for one
episode, ``gymnasium.make_vec(..., vectorization_mode="vector_entry_point")`` for the native batched env).
The names below are loaded on first use (PEP 562): the planner reads ``fitdqn.market.layout`` (shapes only)
without importing the data pipeline (pandas).
"""

import gymnasium

from fitdqn.lazy import lazy_names

GYM_ID = "fitdqn/Futures-v0"
if GYM_ID not in gymnasium.registry:
    gymnasium.register(
        id=GYM_ID,
        entry_point="fitdqn.gym_env:FuturesGymEnv",
        vector_entry_point="fitdqn.gym_env:FuturesVectorEnv",
    )

_HOMES = {
    "ContractSpec": "contract", "available_contracts": "contract", "contract_for": "contract",
    "load_contract": "contract", "Split": "splits", "load_bars": "data", "normalise_bars": "data",
    "read_bars_file": "data", "split_bars": "splits", "AGENT_FIELDS": "layout",
    "GOAL_COLUMN": "layout", "STATE_DIM": "layout", "transition_spec": "layout", "FuturesEnv": "env",
    "FEATURE_NAMES": "layout", "WARMUP": "layout", "compute_features": "features", "Market": "loader",
    "load_market": "loader", "build_observation": "observation",
}

__all__ = sorted(["GYM_ID", *_HOMES])

__getattr__, __dir__ = lazy_names(__name__, _HOMES, globals())
