"""Run logs: one JSON object per line (metrics.jsonl) and the same scalars as TensorBoard events."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class RunLogger:
    """Append-only JSONL + TensorBoard. Each line is flushed, so a crash loses nothing written."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, kind: str, values: dict[str, Any]) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in values.items()}
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
        self.jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            for key, value in clean.items():
                if isinstance(value, float):
                    self.writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
