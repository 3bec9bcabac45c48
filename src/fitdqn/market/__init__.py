"""fitdqn.market: bars, contract specs, causal features, the vectorised futures env, a gymnasium adapter.

Importing this package registers the gymnasium id ``fitdqn/Futures-v0`` (``gymnasium.make`` for one
episode, ``gymnasium.make_vec(..., vectorization_mode="vector_entry_point")`` for the native batched env).
"""

import gymnasium

from fitdqn.market.contract import ContractSpec, available_contracts, contract_for, load_contract
from fitdqn.market.data import Split, load_bars, normalise_bars, read_bars_file, split_bars, walk_forward
from fitdqn.market.env import (
    AGENT_FIELDS,
    GOAL_COLUMN,
    STATE_DIM,
    FuturesEnv,
    transition_spec,
)
from fitdqn.market.features import FEATURE_NAMES, WARMUP, compute_features
from fitdqn.market.loader import Market, load_market
from fitdqn.market.observation import build_observation

GYM_ID = "fitdqn/Futures-v0"
if GYM_ID not in gymnasium.registry:
    gymnasium.register(
        id=GYM_ID,
        entry_point="fitdqn.market.gym_env:FuturesGymEnv",
        vector_entry_point="fitdqn.market.gym_env:FuturesVectorEnv",
    )

__all__ = [
    "AGENT_FIELDS",
    "FEATURE_NAMES",
    "GOAL_COLUMN",
    "GYM_ID",
    "STATE_DIM",
    "WARMUP",
    "ContractSpec",
    "FuturesEnv",
    "Market",
    "Split",
    "available_contracts",
    "build_observation",
    "compute_features",
    "contract_for",
    "load_bars",
    "load_contract",
    "load_market",
    "normalise_bars",
    "read_bars_file",
    "split_bars",
    "transition_spec",
    "walk_forward",
]
