"""The trace and plan caches: a repeated plan traces nothing, a changed key traces again, a bad file is rewritten."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitdqn.config import Config, with_overrides
from fitdqn.device import what_if
from fitdqn.plan import build, plan_cache, trace_cache
from fitdqn.plan.trace_cache import TraceCache, TraceSummary, cache_folder, trace_key

GIB = 2**30
SMALL = {
    "market.data": "synthetic", "market.synthetic_bars": 600, "market.episode_length": 32,
    "net.window": 4, "net.trunk_hidden": 32, "net.d_model": 16, "net.stream_hidden": 16, "net.num_atoms": 11,
    "net.iqn_embedding": 8, "net.iqn_quantiles": 8, "net.iqn_act_quantiles": 8, "net.iql_hidden": 16,
    "collect.num_envs": 16, "replay.capacity": 4096, "replay.min_fill": 128, "budget.batch_size": 0,
    "budget.max_batch": 2048, "train.cuda_graphs": False,  # no graph-pool traces: a fast plan
}


def small(cache: Path, **overrides) -> Config:
    return with_overrides(Config(), {**SMALL, "budget.trace_cache_dir": str(cache), **overrides})


@pytest.fixture
def count_traces(monkeypatch):
    """Counts the traces really run (not found in a cache; each plan keeps its own memo, ``build.Planning``)."""
    calls = []
    original = build.TraceSession.trace

    def counted(session, name, batch, *args, **kwargs):
        calls.append(batch)
        return original(session, name, batch, *args, **kwargs)

    monkeypatch.setattr(build.TraceSession, "trace", counted)
    return calls


def plan_json(config, device):
    return build.plan_for_device(config, device).to_json()  # a plan of its own memo: only the disk cache is shared


CARD = what_if("NVIDIA GeForce RTX 3050 Laptop GPU", 4 * GIB, GIB)


def test_a_repeated_plan_traces_nothing_and_a_changed_key_traces_again(tmp_path, count_traces):
    first = plan_json(small(tmp_path), CARD)
    traced = len(count_traces)
    assert traced >= 3  # the collector step and the update at two batches at least
    assert plan_json(small(tmp_path), CARD) == first and len(count_traces) == traced  # all from the disk cache
    # what the trace never sees (the budget's knobs, the run's bookkeeping) does not re-trace
    plan_json(small(tmp_path, **{"budget.headroom_fraction": 0.1, "train.epochs": 3}), CARD)
    assert len(count_traces) == traced
    # a knob the step reads does
    plan_json(small(tmp_path, **{"net.iql_hidden": 24}), CARD)
    assert len(count_traces) > traced
    # so does another card shape (the SM count caps reduction scratch) or another torch/fitdqn source
    again = len(count_traces)
    plan_json(small(tmp_path), what_if("NVIDIA A100-SXM4-40GB", 4 * GIB, GIB))
    assert len(count_traces) > again


def test_another_source_or_torch_version_is_another_key(monkeypatch):
    key = trace_key(what="update", batch=512)
    monkeypatch.setattr(trace_cache, "source_hash", lambda: "edited")
    assert trace_key(what="update", batch=512) != key
    monkeypatch.setattr(trace_cache.torch, "__version__", "9.9.9")
    assert trace_key(what="update", batch=512)["torch"] == "9.9.9"


def test_a_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, count_traces):
    first = plan_json(small(tmp_path), CARD)
    traced = len(count_traces)
    files = sorted((tmp_path / "traces").glob("*.json"))
    assert files
    for index, path in enumerate(files):  # garbage, half a file, valid JSON under another key
        path.write_text(["{not json", path.read_text()[: len(path.read_text()) // 2],
                         json.dumps({"key": {"other": 1}, "value": {}})][index % 3])
    assert plan_json(small(tmp_path), CARD) == first
    assert len(count_traces) > traced  # traced again ...
    for path in files:  # ... and rewritten whole
        data = json.loads(path.read_text())
        assert {"key", "value"} <= set(data)
    assert not list((tmp_path / "traces").glob("*.tmp"))


def test_writes_are_atomic(tmp_path, monkeypatch):
    cache = TraceCache(tmp_path)
    key = trace_key(what="update", batch=1)
    cache.put(key, TraceSummary(1, 10, {"dqn": 10}))

    def failing_replace(source, target):
        raise OSError("disk full")

    monkeypatch.setattr(trace_cache.os, "replace", failing_replace)
    cache.put(key, TraceSummary(1, 99, {"dqn": 99}))  # fails part-way: skipped, the old file stands
    assert cache.get(key).step_bytes == 10
    assert not list(tmp_path.glob("*.tmp"))


def test_the_cache_folder_follows_the_knob_the_environment_and_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv(trace_cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder("") == tmp_path / "xdg" / "fitdqn" / "traces"
    monkeypatch.setenv(trace_cache.ENV_DIR, str(tmp_path / "env"))
    assert cache_folder("") == tmp_path / "env" / "traces"
    assert cache_folder(str(tmp_path / "knob")) == tmp_path / "knob" / "traces"
    assert cache_folder("off") is None
    monkeypatch.setenv(trace_cache.ENV_DIR, "off")
    assert cache_folder("") is None
    assert TraceCache(None).get(trace_key(what="x")) is None  # off: nothing stored, nothing found


def test_a_cached_plan_is_the_plan_and_its_key_covers_the_data_file(tmp_path):
    config, device = small(tmp_path), CARD
    fresh = plan_cache.plan_for_device(config, device)
    cached, _key = plan_cache.cached_plan(config, device)
    assert cached is not None and cached.to_json() == fresh.to_json()
    assert plan_cache.cached_plan(small(tmp_path, **{"budget.headroom_fraction": 0.1}), device)[0] is None
    bars = tmp_path / "bars.csv"
    bars.write_text("a")
    before = trace_cache.data_provenance(str(bars))
    bars.write_text("ab")
    assert trace_cache.data_provenance(str(bars)) != before


def test_a_repeated_plan_command_imports_nothing_of_the_system(tmp_path):
    """The warm path of `fitdqn plan` reads the stored plan without the market, nets or replay modules; the cold
    one traces the stand-in system without the data pipeline (pandas, pyarrow: a second of a cold plan)."""
    script = (
        "import sys\n"
        "from fitdqn.cli import main\n"
        f"args = ['plan', '--gpu', 'rtx3050', '--free-memory', '1GiB', '--batch-size', '0', '--json', "
        f"'--budget.trace_cache_dir', {str(tmp_path)!r}] + {[f'--{k}={v}' for k, v in SMALL.items()]!r}\n"
        "assert main(args) == 0\n"
        "print('IMPORTED', 'fitdqn.plan.build' in sys.modules, 'fitdqn.market' in sys.modules,\n"
        "      'pandas' in sys.modules or 'pyarrow' in sys.modules)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    outputs = [run.stdout[: run.stdout.index("IMPORTED")] for run in runs]
    assert json.loads(outputs[0]) == json.loads(outputs[1])
    assert "IMPORTED True True False" in runs[0].stdout
    assert "IMPORTED False False False" in runs[1].stdout


def test_a_plan_from_the_cache_keeps_the_notes_its_traces_made(tmp_path, count_traces, monkeypatch):
    """When the update cannot be derived from two traces the plan says so; the same plan served from the disk cache
    says it too (on an H200 the triton kernels' trace of this config did not fit, and the cached plan lost the
    note)."""
    monkeypatch.setattr(build, "fit_traces", lambda first, second: (None, "forced for the test"))
    first = plan_json(small(tmp_path), CARD)
    assert any("forced for the test" in note for note in first["notes"])
    traced = len(count_traces)
    assert plan_json(small(tmp_path), CARD) == first and len(count_traces) == traced
