"""Checkpoints: atomic writes, ``weights_only=True`` loads, and clear errors for corrupt or foreign files.

A checkpoint is a plain nested dict of tensors and primitives (what ``weights_only`` loading accepts).
Writes go to a temporary file in the same directory, are flushed to disk, then renamed over the old file,
so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from fitdqn.errors import UserError

FORMAT_VERSION = 1


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call ``write(file)`` on a temp file beside ``path``, fsync, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(Path(path), lambda file: file.write(text.encode()))


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    path = Path(path)
    payload = {"format_version": FORMAT_VERSION, **state}
    atomic_write_bytes(path, lambda file: torch.save(payload, file))
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with ``weights_only=True``; anything unreadable is a CheckpointError, never a fresh start."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at '{path}': check the run directory, or start a new run")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"checkpoint '{path}' is corrupt or not a fitdqn checkpoint ({first_line}); "
            "resume from an earlier checkpoint in the run directory or start a new run (--out elsewhere)"
        ) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format {state.get('format_version') if isinstance(state, dict) else '?'}, "
            f"this fitdqn reads format {FORMAT_VERSION}: use the fitdqn version that wrote it, or start a new run"
        )
    return state
