"""A tiny config for whole studies on the CPU (2 epochs of 16 env steps, tiny nets) and its TOML form."""

import io
from pathlib import Path

import tomli_w
from rich.console import Console
from support.small_run import SMALL_RUN

from fitdqn.config import Config, with_overrides

TINY = {**SMALL_RUN, "train.epochs": 2, "train.eval_every": 1, "train.sample_reuse": 1.0,
        "train.min_updates": 1}
SEARCH = {"learn.lr": {"low": 1e-5, "high": 1e-3}, "learn.n_step": {"choices": [1, 3]}}


def tiny_config(tune_dir: Path, **tune) -> Config:
    return with_overrides(Config(), {**TINY, "tune.dir": str(tune_dir), "tune.study": "tiny",
                                     **{f"tune.{k}": v for k, v in tune.items()}})


def quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


def toml_of(values: dict, search: dict) -> str:
    """Dotted config values and a [search] table as one TOML file (what `fitdqn tune --config` reads)."""
    nested: dict[str, dict] = {}
    for dotted, value in values.items():
        section, _, key = dotted.partition(".")
        nested.setdefault(section, {})[key] = value
    return tomli_w.dumps({**nested, "search": search})
