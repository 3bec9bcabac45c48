"""One run of a queue in its own process: ``python -m fitdqn.schedule.member RUN_DIR/member.json``.

The scheduler writes ``member.json`` (the run's config, its threads and its memory share) and starts this process
with ``OMP_NUM_THREADS`` set to its threads. Here: cap the allocator at the share before anything touches the GPU
(``torch.cuda.set_per_process_memory_fraction``: the probe reads the cap and the plan is made within it), then train
the run, resuming its checkpoint if it has one; a walk-forward member trains on its fold's bars (its ``fold.json``).
The run's ``report.json`` is its completion marker: the scheduler reads the outcome from the run directory and the
exit status (0 done, 130 interrupted: its checkpoint is saved and it goes back to the queue, as does a run whose
directory another live process is writing (fitdqn.run_lock), else failed).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

SPEC_FILE = "member.json"
LOG_FILE = "train.log"
REPORT_FILE = "report.json"  # written last by a run (fitdqn.train.run): the run is finished when it exists
EXIT_INTERRUPTED = 130


def cap_memory(device_spec: str, fraction: float | None) -> None:
    """This process's share of the GPU: PyTorch's allocator may hold at most ``fraction`` x total."""
    if fraction is None:
        return
    import torch

    from fitdqn.device.probe import configure_allocator, resolve_device

    configure_allocator()  # before the first allocation, as a plain run does
    device = resolve_device(device_spec)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction, device)


def run_member(spec: dict[str, Any]) -> None:
    import torch

    from fitdqn.config import config_from_dict
    from fitdqn.files import CHECKPOINT_NAME
    from fitdqn.train.run import train
    from fitdqn.train.study import member_market

    torch.set_num_threads(spec["threads"])
    config = config_from_dict(spec["config"])
    cap_memory(config.train.device, spec.get("memory_fraction"))
    run_dir = Path(spec["run_dir"])
    train(config, run_dir, resume=(run_dir / CHECKPOINT_NAME).is_file(), market=member_market(config, run_dir))


def main(argv: list[str] | None = None) -> int:
    from fitdqn.errors import UserError
    from fitdqn.run_lock import RunInUse

    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    try:
        run_member(spec)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except RunInUse as error:  # another process writes this run: back to the queue, never run twice at once
        print(f"not started: {error}", flush=True)
        return EXIT_INTERRUPTED
    except UserError as error:
        print(f"error: {error}", flush=True)
        return 2
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
