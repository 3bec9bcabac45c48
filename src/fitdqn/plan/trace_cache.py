"""A cache of traced training steps on disk, so that planning the same config again is instant.

Tracing the update on fake tensors costs seconds per batch on a CPU; what the plan keeps of a trace is a few
numbers (``TraceSummary``: the step's bytes above the baseline, per group, and what a CUDA graph's pool would
reserve for it). They are stored as one small JSON file per trace in the user's cache directory
(``$XDG_CACHE_HOME/fitdqn/traces``, else ``~/.cache/fitdqn/traces``; ``FITDQN_CACHE_DIR`` or
``budget.trace_cache_dir`` relocates it, ``off`` turns it off) under a key that hashes everything that changes
a trace: the traced config (every section but the budget's and the run's bookkeeping), the bars, the replay
capacity, the batch, the target device class, compute capability and SM shape, the torch version and the
fitdqn version and source. A file that cannot be read or does not match its key is ignored and rewritten;
writes go to a temporary file renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

import fitdqn
from fitdqn.memory.allocator_model import PoolUsage, pool_usage

CACHE_FORMAT = 1
OFF = "off"
ENV_DIR = "FITDQN_CACHE_DIR"
# fields of the run's bookkeeping that no trace reads (the budget section is left out whole: the trace never
# sees it, the plan uses it after the trace)
UNTRACED_TRAIN_FIELDS = ("seed", "epochs", "minutes", "eval_every", "checkpoint_every", "eval_seeds", "capital",
                         "out", "device")


@dataclass(frozen=True)
class TraceSummary:
    """What a plan keeps of one traced step (``trace.StepTrace``)."""

    batch_size: int
    step_bytes: int  # peak - baseline
    step_by_group: dict[str, int]
    # the step's allocations replayed in a fresh graph pool (allocator_model.pool_usage), by allocator mode:
    # 'expandable' and 'default'; empty when the trace kept no events
    pools: dict[str, PoolUsage] = field(default_factory=dict)
    # what tracing it said of itself (the plan's notes: e.g. why the update was not derived from two traces),
    # kept so that a plan from the cache says the same as the plan that traced
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, trace, with_pools: bool) -> TraceSummary:

        pools = {mode: pool_usage(trace, mode == "expandable") for mode in ("expandable", "default")} \
            if with_pools else {}
        return cls(trace.batch_size, trace.step_bytes, dict(trace.step_by_group), pools)

    def pool(self, expandable: bool) -> PoolUsage:
        return self.pools["expandable" if expandable else "default"]

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "step_bytes": self.step_bytes, "step_by_group": self.step_by_group,
                "pools": {mode: dataclasses.asdict(usage) for mode, usage in self.pools.items()},
                "notes": list(self.notes)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TraceSummary:
        groups = {str(name): int(count) for name, count in data["step_by_group"].items()}
        pools = {str(mode): PoolUsage(**usage) for mode, usage in data["pools"].items()}
        return cls(int(data["batch_size"]), int(data["step_bytes"]), groups, pools,
                   tuple(str(note) for note in data["notes"]))


def cache_folder(configured: str = "") -> Path | None:
    """Where traces are cached: ``budget.trace_cache_dir``, else ``$FITDQN_CACHE_DIR``, else the user's cache
    directory; None when either says ``off``."""
    chosen = configured or os.environ.get(ENV_DIR, "")
    if chosen.strip().lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser() / "traces"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fitdqn" / "traces"


@lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of fitdqn's own source and data files: any edit to the package changes every key."""
    root = Path(fitdqn.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".toml") and p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def traced_config_fields(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The config as the key sees it: every section a trace may read."""
    fields = {name: section for name, section in config_dict.items() if name != "budget"}
    if isinstance(fields.get("train"), dict):
        fields["train"] = {k: v for k, v in fields["train"].items() if k not in UNTRACED_TRAIN_FIELDS}
    return fields


def trace_key(**fields: Any) -> dict[str, Any]:
    """Everything a trace depends on, with the versions of what runs it."""
    return {"format": CACHE_FORMAT, "torch": torch.__version__, "fitdqn": fitdqn.__version__,
            "source": source_hash(), **fields}


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


class TraceCache:
    """Summaries of traced steps by key, in ``folder`` (None: nothing kept on disk)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder

    def path(self, key: dict[str, Any]) -> Path | None:
        return None if self.folder is None else self.folder / f"{key_digest(key)}.json"

    def get(self, key: dict[str, Any]) -> TraceSummary | None:
        """The stored summary, or None (absent, unreadable, or stored under another key)."""
        value = self.get_value(key)
        try:
            return None if value is None else TraceSummary.from_json(value)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # another layout: traced again and rewritten

    def put(self, key: dict[str, Any], summary: TraceSummary) -> None:
        self.put_value(key, summary.to_json())

    def get_value(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The JSON object stored under ``key``, or None (absent, unreadable, or stored under another key)."""
        path = self.path(key)
        if path is None:
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("key") != json.loads(json.dumps(key, sort_keys=True, default=str)):
                return None
            value = data["value"]
            return value if isinstance(value, dict) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # absent or corrupt: computed again and rewritten

    def put_value(self, key: dict[str, Any], value: dict[str, Any]) -> None:
        """Write atomically (a temporary file renamed over the old); a cache that cannot be written is skipped."""
        path = self.path(key)
        if path is None:
            return
        text = json.dumps({"key": key, "value": value}, sort_keys=True, default=str)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
            try:
                with os.fdopen(handle, "w") as file:
                    file.write(text)
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError:
            pass  # a read-only or full cache directory costs a re-trace next time, nothing else


def data_provenance(data: str) -> dict[str, Any]:
    """What the bar count of ``market.data`` depends on besides the config: a file's size and modification
    time, else (a built-in or synthetic dataset) the version of fitdqn, which ships them."""
    path = Path(data).expanduser()
    if path.is_file():
        stat = path.stat()
        return {"file": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"name": data, "fitdqn": fitdqn.__version__}
