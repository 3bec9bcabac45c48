"""Checkpoints: atomic writes, ``weights_only=True`` loads, and clear errors for damaged or foreign files.

A checkpoint is a plain nested dict of tensors and primitives (what ``weights_only`` loading accepts), with
``format_version`` and ``contents`` (what each top-level entry is and how many bytes of tensors it holds)
added on save. Writes go to a temporary file in the same directory, are flushed to disk, then renamed over
the old file, so a crash mid-write leaves the previous checkpoint intact. Nothing here knows which file of
a run it writes: the latest checkpoint and a best-by-validation one use the same two functions.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.files import BEST_NAME, CHECKPOINT_NAME, atomic_write_bytes, atomic_write_text

__all__ = ["BEST_NETWORK", "CheckpointError", "atomic_write_text", "best_network_weights", "checkpoint_summary",
           "load_checkpoint", "save_checkpoint", "tensor_bytes"]  # atomic_write_text: for tune/ (home: fitdqn.files)

FORMAT_VERSION = 1
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive

WHAT = {  # what each top-level entry of a checkpoint holds, in words (the `contents` record of the file)
    "learner": "online, target and IQL value networks and the Adam state",
    "replay": "the replay buffer: stored transitions and their priorities (needed to continue training exactly)",
    "collector": "the state of every parallel episode and the env-step counter",
    "generators": "the random generators' states",
    "history": "the per-epoch metrics so far",
    "config": "the run's config",
    "logs": "how many metrics.jsonl records the checkpoint covers (the rest are rolled back on resume)",
    "network": "the weights of the network the report is about (evaluate.reported_network: online or target)",
}
BEST_NETWORK = "network"  # best.pt's entry of the evaluated network's weights ('online' in older files)


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def best_network_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The evaluated network's weights of a best.pt state (``BEST_NETWORK``; older files call them 'online')."""
    return state[BEST_NETWORK] if BEST_NETWORK in state else state["online"]


def restore_network(learner: Any, run_dir: Path, network: str, device: str | torch.device) -> dict[str, Any]:
    """Load a run directory's trained network into ``learner`` (built from the run's config) and return the
    checkpoint's state: ``network = 'best'`` puts ``best.pt``'s validation-chosen weights into the network the
    report evaluates (``learner.evaluated``), ``'last'`` restores the whole learner from the latest checkpoint."""
    path = run_dir / (BEST_NAME if network == "best" else CHECKPOINT_NAME)
    if network == "best" and not path.is_file():
        raise UserError(f"'{run_dir}' has no {BEST_NAME} (written at the first validation backtest); use the latest "
                        "network with --network last")
    state = load_checkpoint(path, map_location=device)
    try:
        if network == "best":
            learner.evaluated.load_state_dict(best_network_weights(state))
        else:
            learner.load_state_dict(state["learner"])
    except (KeyError, RuntimeError, ValueError) as error:
        raise UserError(f"checkpoint in '{run_dir}' does not fit its config.toml ({error}); was it edited?") from None
    return state


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a nested dict/list/tuple."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def contents_of(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {key: {"bytes": tensor_bytes(value), "what": WHAT.get(key, "")} for key, value in state.items()}


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically with its format version and a ``contents`` record."""
    path = Path(path)
    payload = {"format_version": FORMAT_VERSION, "contents": contents_of(state), **state}
    atomic_write_bytes(path, lambda file: torch.save(payload, file))
    return path


def checkpoint_summary(path: str | Path, state: dict[str, Any]) -> str:
    """One line: the file's size and the biggest parts of it, e.g. for the end of a run."""
    path = Path(path)
    contents = state.get("contents") or contents_of(state)
    parts = sorted(((v["bytes"], k) for k, v in contents.items() if v["bytes"]), reverse=True)
    size = path.stat().st_size if path.is_file() else sum(b for b, _ in parts)
    listed = ", ".join(f"{key} {format_bytes(n)}" for n, key in parts[:4])
    return f"{path.name}: {format_bytes(size)} ({listed})" if listed else f"{path.name}: {format_bytes(size)}"


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with ``weights_only=True``; anything unreadable is a CheckpointError, never a fresh start."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at '{path}': check the run directory, or start a new run")
    head = b""
    try:
        with open(path, "rb") as file:
            head = file.read(len(ZIP_MAGIC))
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as error:
        raise CheckpointError(load_failure_message(path, error, head)) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format {state.get('format_version') if isinstance(state, dict) else '?'}, "
            f"this fitdqn reads format {FORMAT_VERSION}: use the fitdqn version that wrote it, or start a new run"
        )
    return state


BLOCKED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_failure_message(path: Path, error: BaseException, head: bytes) -> str:
    """What went wrong in words: a pickle that would run code, a damaged file, or not a checkpoint at all."""
    text = str(error)
    blocked = BLOCKED_GLOBAL.search(text) if isinstance(error, pickle.UnpicklingError) else None
    if blocked:
        return (f"'{path}' is not a fitdqn checkpoint and was not loaded: it holds pickled objects beyond tensors "
                f"and plain data, and loading it would call {blocked.group(1)} (a pickle can run any code). "
                "Nothing in it ran. fitdqn never writes such a file: delete it unless you know who made it")
    if isinstance(error, OSError) and not isinstance(error, zipfile.BadZipFile):
        return f"cannot read checkpoint '{path}': {error.strerror or error}"
    if head != ZIP_MAGIC:
        return (f"'{path}' is not a fitdqn checkpoint (not a PyTorch checkpoint file, or damaged at its start)"
                f"{kept_beside(path)}")
    cause = first_sentence(text) or type(error).__name__
    return (f"the last checkpoint '{path}' is damaged (truncated or corrupt: {cause}), so the run cannot continue "
            f"from it; fitdqn keeps only the latest checkpoint of a run{kept_beside(path)}. Start a new run with "
            f"the same config: fitdqn train --config {path.parent / 'config.toml'} --out NEW_FOLDER")


def kept_beside(path: Path) -> str:
    """What else of the run in ``path``'s folder is still there (so the user knows what is not lost)."""
    folder = path.parent
    others = sorted(p.name for p in folder.glob("*.pt") if p.name != path.name)
    logs = [n for n in ("config.toml", "metrics.jsonl", "report.md") if (folder / n).is_file()]
    parts = []
    if logs:
        parts.append(f"{', '.join(logs)} in '{folder}' are intact")
    if others:
        parts.append(f"other checkpoint files kept there: {', '.join(others)}")
    return ("; " + "; ".join(parts)) if parts else ""


def first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.split(". ")[0].rstrip(".")
