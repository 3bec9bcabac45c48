"""Walk-forward folds: test blocks tile the tail once, purge gaps between ranges, no fold sees its future."""

import pytest

from fitdqn.config import Config, with_overrides
from fitdqn.errors import UserError
from fitdqn.evaluate.walk_forward import folds_for, purge_for, walk_forward_folds


def test_folds_tile_the_tail_with_purged_gaps():
    folds = walk_forward_folds(5000, 4, 0.7, 0.15, purge=50)
    assert [f.test.start for f in folds] == [3500, 3875, 4250, 4625]
    assert folds[-1].test.stop == 5000
    for f, nxt in zip(folds, folds[1:] + [None], strict=True):
        assert f.train.start == 0 and f.train.stop + 50 == f.validation.start
        assert f.validation.stop + 50 == f.test.start and len(f.validation) == 750
        if nxt is not None:
            assert f.test.stop == nxt.test.start  # back to back: every tail bar is tested once
            assert nxt.train.stop > f.train.stop  # expanding window
        assert f.train.stop <= f.validation.start < f.validation.stop <= f.test.start  # the past only


def test_auto_purge_and_refusal():
    config = Config()
    assert purge_for(config, 5031) == 51
    assert purge_for(with_overrides(config, {"evaluate.purge_bars": 0}), 5031) == 0
    assert len(folds_for(with_overrides(config, {"evaluate.folds": 3}), 5031)) == 3
    with pytest.raises(UserError, match="evaluate.folds"):
        walk_forward_folds(300, 4, 0.1, 0.15, purge=40)
    with pytest.raises(UserError, match="evaluate.folds"):
        with_overrides(config, {"evaluate.folds": 0})
