"""The queue of runs a scheduler takes from: here in this process (:class:`LocalQueue`), or on Optuna's RDB storage
shared by workers on several machines (``fitdqn.schedule.shared.SharedQueue``). Both answer the same calls."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fitdqn.config import Config


@dataclass
class Run:
    """One run of a workload: its name in the workload, its run directory and its config (``train.out`` is the
    directory); ``ticket``: what the queue knows it by."""

    key: str
    run_dir: Path
    config: Config
    ticket: Any = None


class RunQueue(Protocol):
    def waiting(self) -> list[Run]:
        """The runs nobody has taken, in queue order."""

    def claim(self, run: Run) -> bool:
        """Take ``run`` for this scheduler; False if another took it first."""

    def finished(self, run: Run, report: dict[str, Any]) -> None:
        """The run's report exists: it is done."""

    def failed(self, run: Run, error: str) -> None:
        """The run ended with an error: not run again by this queue."""

    def released(self, run: Run) -> None:
        """The run was interrupted (its checkpoint saved): back in the queue."""

    def heartbeat(self, runs: list[Run]) -> None:
        """The runs this scheduler runs are alive."""

    def recover(self) -> None:
        """Runs of schedulers that died (silent past the grace period) go back into the queue."""

    def open_runs(self) -> int:
        """Runs waiting or running anywhere: 0 when the workload is done."""


@dataclass
class LocalQueue:
    """The queue of one process's workload: every run of it, taken in order."""

    runs: list[Run]
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)

    def waiting(self) -> list[Run]:
        return [r for r in self.runs if r.key not in self.taken]

    def claim(self, run: Run) -> bool:
        if run.key in self.taken:
            return False
        self.taken.add(run.key)
        return True

    def finished(self, run: Run, report: dict[str, Any]) -> None:
        self.done[run.key] = report

    def failed(self, run: Run, error: str) -> None:
        self.errors[run.key] = error

    def released(self, run: Run) -> None:
        self.taken.discard(run.key)

    def heartbeat(self, runs: list[Run]) -> None:
        pass

    def recover(self) -> None:
        pass

    def open_runs(self) -> int:
        return len(self.runs) - len(self.done) - len(self.errors)
