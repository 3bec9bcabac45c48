"""Run logs: one JSON object per line (metrics.jsonl) and the same scalars as TensorBoard events.

metrics.jsonl is the record; TensorBoard mirrors it. Lines are appended and flushed one by one, so a kill loses
at most the line being written. A checkpoint notes how many records it covers (:attr:`RunLogger.records`);
on resume the logger rolls back to that many: metrics.jsonl is rewritten atomically without the records of
the epochs the checkpoint does not hold, and the TensorBoard folder is rebuilt from the kept records into a
fresh event file, so neither holds an epoch twice and both equal those of a run that was never interrupted.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from fitdqn.errors import UserError
from fitdqn.files import atomic_write_text, describe_os_error, read_run_file

METRICS_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class RunLogger:
    """Append-only JSONL + TensorBoard for the run in ``run_dir``.

    ``keep``: None for a new run; on resume, the number of records the checkpoint covers (the rest are rolled
    back, see the module doc).
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool, keep: int | None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_NAME
        kept = read_jsonl(self.path)
        self.dropped = 0  # records rolled back
        if keep is not None:
            self.dropped = max(len(kept) - keep, 0)
            kept = kept[:keep]
            atomic_write_text(self.path, "".join(json_line(r) for r in kept))
        self.records = len(kept)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(self.path, "a")  # noqa: SIM115 - closed in close()
        except OSError as error:
            raise UserError(describe_os_error(error, self.path)) from None
        self.writer = None
        if tensorboard:
            if keep is not None:
                rebuild_tensorboard(self.run_dir / TENSORBOARD_DIR, kept)
            self.writer = summary_writer(self.run_dir / TENSORBOARD_DIR)

    def log(self, step: int, kind: str, values: dict[str, Any]) -> None:
        record = make_record(step, kind, values)
        self.jsonl.write(json_line(record))
        self.jsonl.flush()
        self.records += 1
        if self.writer is not None:
            add_scalars(self.writer, record)

    def close(self) -> None:
        """Idempotent: the run closes its logger on every way out."""
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def make_record(step: int, kind: str, values: dict[str, Any]) -> dict[str, Any]:
    clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in values.items()}
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
    return {"step": step, "kind": kind, **clean}


def json_line(record: dict[str, Any]) -> str:
    return json.dumps(record) + "\n"


def summary_writer(log_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


def add_scalars(writer, record: dict[str, Any]) -> None:
    for key, value in record.items():
        if key not in ("step", "kind") and isinstance(value, float):
            writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])


def rebuild_tensorboard(folder: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``folder``'s event files by one written from ``records`` (built beside it, then swapped in)."""
    fresh = folder.with_name(folder.name + ".rebuild")
    shutil.rmtree(fresh, ignore_errors=True)
    writer = summary_writer(fresh)
    for record in records:
        add_scalars(writer, record)
    writer.close()
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(fresh, folder)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a last line cut short by a kill is left out."""
    path = Path(path)
    if not path.exists():
        return []
    lines = read_run_file(path, str, "delete it, or the lines that are not JSON records").splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break  # the line being written when the run was killed
            raise UserError(f"'{path}' line {number} is not JSON: was the file edited? Fix or delete that "
                            "line") from None
    return records
