"""The acting network as a standalone program: ``torch.export`` of observation -> actions, saved as ``.pt2``.

The program takes ``obs [B, W, S]`` float32 (any B; :func:`fitdqn.market.observation.build_observation`:
W bar tokens of the S = Fm + Fa state, the names in the metadata) and returns ``(actions [B, 3] int64,
q [B, 3, n] float32)``: the sub-action index per branch and the value it was chosen on. It runs the plain
PyTorch kernels in fp32 (no Triton, no autocast), so it loads anywhere ``torch.export.load`` does, without
fitdqn. ``learn.risk = 'neutral'`` picks the best C51 mean, as the learner does; ``'cvar'`` averages the IQN
quantiles at ``net.iqn_act_quantiles`` evenly spaced levels in ``(0, learn.cvar_alpha)`` (the learner samples
those levels at random: the same CVaR, without the noise); ``'mean_variance'`` picks the best C51 mean minus
``learn.risk_aversion`` x C51 variance, as the learner does. The networks' ``fitdqn::`` operators are exported as
their plain maths (:mod:`fitdqn.ops.decompositions`). The metadata (``fitdqn.json`` in the archive) says how
to read the actions: target positions in contracts, stop and take-profit ATR multiples, the observation layout,
and what a program outside fitdqn needs to build ``obs`` itself and check it: every feature's formula and windows
(``features``, read from :func:`fitdqn.market.features.feature_columns` itself), how the tokens are assembled
(``observation``), and a reference observation of the run's last bar with the program's output for it
(``reference``). The program takes a batch; a single observation is ``obs[None]`` (a ``[W, S]`` tensor is refused
by the program's input check).

A study exports its ensemble (:mod:`fitdqn.evaluate.ensemble`): the members' acting networks in one program that
returns ``(actions [B, 3], q [B, M, 3, n])``, branch 0 indexing the ensemble's mean positions (the metadata's
``target_contracts``) and the bracket the closest member's, and each member's values.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fitdqn
from fitdqn.deploy.policy import RunPolicy
from fitdqn.errors import UserError
from fitdqn.evaluate.ensemble import BRACKET_RULE, combine
from fitdqn.files import atomic_write_rendered
from fitdqn.market import features as market_features
from fitdqn.market.env import AGENT_FIELDS, STOP_ATR, TAKE_PROFIT_ATR, position_levels, sizing_target
from fitdqn.market.features import FEATURE_NAMES
from fitdqn.nets.qnet import QNetwork
from fitdqn.ops.decompositions import plain_decompositions

METADATA_NAME = "fitdqn.json"


class ActingNetwork(nn.Module):
    """``obs [B, W, S] -> (actions [B, branches] int64, q [B, branches, max_n] fp32)``, greedy, no exploration."""

    def __init__(self, net: QNetwork, risk: str, cvar_alpha: float, risk_aversion: float, quantiles: int) -> None:
        super().__init__()
        self.net = net
        self.risk = risk
        self.risk_aversion = risk_aversion
        levels = cvar_alpha * (torch.arange(quantiles, dtype=torch.float32) + 0.5) / quantiles  # [K]
        self.register_buffer("taus", levels, persistent=False)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.net.features(obs)  # [B, d]
        if self.risk == "cvar":
            taus = self.taus.expand(obs.shape[0], -1)  # [B, K]
            values = self.net.iqn(features, taus)  # [B, K, sum(branches)]
            if not self.net.uniform:
                values = values[..., self.net.pad_index]
            q = values.view(*values.shape[:-1], len(self.net.branches), self.net.max_n).mean(1)  # [B, br, n]
        elif self.risk == "mean_variance":
            q = self.net.mean_minus_variance(self.net.c51_logits(features), self.risk_aversion)  # [B, br, n]
        else:
            q = self.net.q_values(self.net.c51_logits(features))  # [B, br, n]
        return self.net.greedy(q), q


class EnsembleActingNetwork(nn.Module):
    """``obs [B, W, S] -> (actions [B, 3] int64, q [B, M, branches, max_n] fp32)``: M members' greedy actions
    combined as :func:`fitdqn.evaluate.ensemble.combine` does, and each member's values."""

    def __init__(self, members: list[ActingNetwork], levels: list[float]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)
        self.register_buffer("levels", torch.tensor(levels, dtype=torch.float32), persistent=False)  # [n]

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        picked = [member(obs) for member in self.members]
        actions = torch.stack([a for a, _ in picked])  # [M, B, 3]
        return combine(actions, self.levels), torch.stack([q for _, q in picked], dim=1)


def acting_network(policy: RunPolicy, learner=None) -> ActingNetwork:
    """A CPU fp32 copy of the run's evaluated network (``evaluate.reported_network``; or ``learner``'s, a member of
    the same config) with the plain PyTorch kernels, wrapped to act greedily."""
    config = policy.config
    learner = policy.learner if learner is None else learner
    net = QNetwork(config.net, learner.state_dim)
    net.load_state_dict({k: v.detach().float().cpu() for k, v in learner.evaluated.state_dict().items()})
    learn = config.learn
    return ActingNetwork(net, learn.risk, learn.cvar_alpha, learn.risk_aversion, config.net.iqn_act_quantiles).eval()


def metadata(policy: RunPolicy) -> dict[str, Any]:
    config = policy.config
    return {
        "fitdqn_version": fitdqn.__version__,
        "torch_version": torch.__version__,
        "run_dir": str(policy.run_dir),
        "checkpoint_epoch": policy.epoch,
        "inputs": {"obs": ["batch", config.net.window, policy.learner.state_dim]},
        "outputs": {"actions": ["batch", len(config.net.branches)], "q": ["batch", len(config.net.branches),
                                                                          max(config.net.branches)]},
        "feature_names": list(FEATURE_NAMES),
        "agent_fields": list(AGENT_FIELDS),
        "branches": {
            "target_contracts": policy.levels() or position_levels(config.net.branches[0], config.market.max_contracts),
            "stop_atr": list(STOP_ATR),
            "take_profit_atr": list(TAKE_PROFIT_ATR),
        },
        "position_sizing": {  # what a target_contracts level holds (fitdqn.market.env.FuturesEnv.target_contracts)
            "mode": config.market.position_sizing,
            "target_volatility": sizing_target(config.market),
            "contracts": ("target_contracts[i] x min(1, target_volatility / (ATR(14) / close)) of the decision bar"
                          if sizing_target(config.market) > 0 else "target_contracts[i]"),
        },
        "risk": config.learn.risk,
        "risk_aversion": config.learn.risk_aversion if config.learn.risk == "mean_variance" else None,
        "contract": dataclasses.asdict(policy.contract) if dataclasses.is_dataclass(policy.contract) else None,
        "config": {"net": dataclasses.asdict(config.net), "market": dataclasses.asdict(config.market)},
        **({"ensemble": {"members": [str(d) for d in policy.member_dirs], "target": "the mean of the members' target "
                         "positions", "bracket": BRACKET_RULE},
            "outputs": {"actions": ["batch", len(config.net.branches)],
                        "q": ["batch", len(policy.members), len(config.net.branches), max(config.net.branches)]}}
           if policy.members else {}),
    }


# the helpers feature_columns calls, whose source the metadata carries (each is a few lines of torch)
FEATURE_HELPERS = ("_nan", "shift", "rolling", "rolling_mean", "rolling_sum", "rolling_std", "rolling_max",
                   "rolling_min", "rolling_zscore", "_rolling_skew", "rolling_corr", "linear_recurrence",
                   "seeded_ema", "sma", "ema", "wilder", "true_range", "atr", "rsi", "macd", "calendar_fields")


class _Bound(ast.NodeTransformer):
    """Replaces loop variables by their values in one pass of a ``for`` loop over literal or named constants."""

    def __init__(self, values: dict[str, ast.expr]) -> None:
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self.values.get(node.id, node) if isinstance(node.ctx, ast.Load) else node


def _loop_values(loop: ast.For) -> list[dict[str, ast.expr]]:
    """The loop's bindings per pass: ``for n in (7, 14)``, ``for n in SMA_PERIODS``, ``for name, x in ((..), ..)``."""
    items = loop.iter
    if isinstance(items, ast.Name):
        items = ast.parse(repr(tuple(getattr(market_features, items.id))), mode="eval").body
    names = [t.id for t in (loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target])]
    passes = []
    for item in items.elts:
        values = item.elts if isinstance(item, ast.Tuple) and len(names) > 1 else [item]
        passes.append(dict(zip(names, values, strict=True)))
    return passes


def feature_definitions() -> tuple[dict[str, str], dict[str, str]]:
    """Every market feature as its formula, read from :func:`fitdqn.market.features.feature_columns` (so it is the
    code that runs): ``({name: expression}, {term: expression})``, the expressions over the bars (``o h low c v``:
    open, high, low, close, volume, float64) and the terms (``v20``, ``atr14``, ...), loops unrolled."""
    tree = ast.parse(inspect.getsource(market_features.feature_columns))
    body = tree.body[0].body
    formulas: dict[str, str] = {}
    terms: dict[str, str] = {}

    def visit(statements: list[ast.stmt], bound: dict[str, ast.expr]) -> None:
        bound = dict(bound)  # a loop's own terms (top, bottom = ... per pass) are written into its formulas
        for statement in statements:
            if isinstance(statement, ast.For):
                for values in _loop_values(statement):
                    visit(statement.body, {**bound, **values})
            elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                target = statement.targets[0]
                node = _Bound(bound).visit(copy.deepcopy(statement.value))
                if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "f":
                    key = _Bound(bound).visit(copy.deepcopy(target.slice))
                    formulas[eval(compile(ast.Expression(key), "<feature>", "eval"))] = ast.unparse(node)  # a name
                elif bound and isinstance(target, ast.Tuple) and isinstance(node, ast.Tuple):
                    bound.update({t.id: ast.parse(f"({ast.unparse(v)})", mode="eval").body
                                  for t, v in zip(target.elts, node.elts, strict=True)})
                elif bound and isinstance(target, ast.Name):
                    bound[target.id] = node
                elif ast.unparse(target) != "f":
                    terms[ast.unparse(target)] = ast.unparse(node)

    visit(body, {})
    return formulas, terms


def features_metadata() -> dict[str, Any]:
    """What a program needs to compute the market features without fitdqn (:func:`feature_definitions`): run
    ``prelude`` and ``helpers``, set ``b`` to the bars (``terms['b']``), then ``terms`` in order, then ``formulas``;
    then the ``rules``."""
    formulas, terms = feature_definitions()
    windows = ("RETURN_HORIZONS", "LAGS", "SMA_PERIODS", "EMA_PERIODS", "CHANNELS", "LONG", "_ROLL_CHUNK",
               "_SCAN_CHUNK")
    prelude = "import math\n\nimport torch\nfrom torch import Tensor\n\n" + "".join(
        f"{name} = {getattr(market_features, name)!r}\n" for name in windows)
    return {
        "names": list(FEATURE_NAMES),
        "formulas": formulas,
        "terms": {**terms, "b": "the bars as float64 tensors [T]: b['open'], b['high'], b['low'], b['close'], "
                                "b['volume'] (0 without volume); b['ns']: int64 epoch nanoseconds of the bars' "
                                "wall times"},
        "windows": {name.lower(): getattr(market_features, name) for name in windows if not name.startswith("_")},
        "rules": f"row t uses bars <= t only; computed in float64, stored as float32; every value clipped to "
                 f"[-{market_features.CLIP:g}, {market_features.CLIP:g}], NaN (too little history, 0/0) to 0, +-inf "
                 f"to the clip's end of its sign; rows before {market_features.WARMUP} are 0; the volume features "
                 "are 0 for bars without volume",
        "volume_features": list(market_features.VOLUME_FEATURES),
        "warmup": market_features.WARMUP,
        "clip": market_features.CLIP,
        "prelude": prelude,
        "helpers": {name: inspect.getsource(getattr(market_features, name)) for name in FEATURE_HELPERS},
    }


def observation_metadata(window: int) -> dict[str, Any]:
    return {
        "shape": ["batch", window, len(FEATURE_NAMES) + len(AGENT_FIELDS)],
        "token": f"token k (0..{window - 1}) = concat(features[bar - {window - 1} + k], agent state): the last token "
                 "is the decision bar",
        "agent_fields": list(AGENT_FIELDS),
        "single": "the program takes a batch: one observation [W, S] is obs[None] ([1, W, S])",
    }


def reference_case(policy: RunPolicy, program: torch.export.ExportedProgram) -> dict[str, Any]:
    """A real observation (the run's last bar, flat, the episode ahead) and what the program returns for it: a
    program that builds ``obs`` itself checks its features and its runtime against these."""
    from fitdqn.market.loader import load_market
    from fitdqn.market.observation import build_observation

    window = policy.config.net.window
    market = load_market(policy.config.market, window=window, device="cpu")
    agent = torch.zeros(1, len(AGENT_FIELDS))  # [1, Fa]: no position, nothing open
    agent[0, AGENT_FIELDS.index("episode_left")] = 1.0
    last = market.features.shape[0] - 1
    obs = build_observation(market.features, torch.tensor([last]), agent, window)  # [1, W, S]
    with torch.no_grad():
        actions, q = program.module()(obs)
    return {"bar_time": str(market.bars["timestamp"].iloc[last]), "obs": obs.tolist(), "actions": actions.tolist(),
            "q": q.tolist()}


def export_policy(policy: RunPolicy, out: str | Path, example_batch: int = 2) -> Path:
    """``torch.export`` the acting network with a dynamic batch and save it with its metadata to ``out``."""
    out = Path(out)
    if out.suffix != ".pt2":
        raise UserError(f"--out {out}: torch.export archives end in .pt2 (e.g. --out policy.pt2)")
    module = (EnsembleActingNetwork([acting_network(policy, m) for m in policy.members], policy.member_levels()).eval()
              if policy.members else acting_network(policy))
    net = policy.config.net
    example = torch.zeros(example_batch, net.window, policy.learner.state_dim)  # [B, W, S]
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(module, (example,), dynamic_shapes={"obs": {0: batch}})
        program = program.run_decompositions(plain_decompositions())  # plain ATen ops: no fitdqn:: operator
    standalone = {"features": features_metadata(), "observation": observation_metadata(net.window),
                  "reference": reference_case(policy, program)}
    return save_program(program, out, {**metadata(policy), **standalone})


def save_program(program: torch.export.ExportedProgram, out: str | Path, info: dict[str, Any]) -> Path:
    """The program and its metadata (``fitdqn.json``) to ``out``: built in memory (torch.export.save's writer
    aborts the process when its file fails), then a temp file renamed into place, so a full disk or a kill keeps
    any earlier program whole."""
    extra = {METADATA_NAME: json.dumps(info, indent=2, default=str)}
    return atomic_write_rendered(out, lambda buffer: torch.export.save(program, buffer, extra_files=extra))


def load_exported(path: str | Path) -> tuple[torch.export.ExportedProgram, dict[str, Any]]:
    """The exported program and its metadata."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no exported policy at '{path}' (fitdqn export RUN_DIR --out {path.name} writes one)")
    extra = {METADATA_NAME: ""}
    program = torch.export.load(path, extra_files=extra)
    return program, json.loads(extra[METADATA_NAME]) if extra[METADATA_NAME] else {}
