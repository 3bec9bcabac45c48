"""README's promise: bars without a volume column train with the volume features off, and the run says so."""

import io

import pytest
from rich.console import Console

from fitdqn.market.data import synthetic_bars
from fitdqn.train.run import train


class Planned(Exception):
    """Raised once the run has planned and printed its notes: the epochs are not needed here."""


def stop(trainer):
    raise Planned


def test_a_run_on_bars_without_volume_says_volume_features_off(small_config, tmp_path):
    path = tmp_path / "bars.csv"
    synthetic_bars(1200, 0.3, 0).drop(columns="volume").to_csv(path, index=False)
    out = io.StringIO()
    with pytest.raises(Planned):
        train(small_config(**{"market.data": str(path)}), tmp_path / "run", console=Console(file=out, width=200),
              trainer_hook=stop)
    assert "volume features off (no volume column)" in out.getvalue()
