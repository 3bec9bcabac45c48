"""`fitdqn worker`: take runs from a queue on Optuna's RDB storage and run them packed on this machine's device
(:func:`fitdqn.schedule.study.run_worker`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fitdqn.cli.common import Commands, add_command
from fitdqn.config import Config
from fitdqn.errors import UserError

INSTALL_HINT = "pip install 'fitdqn[workers]' (Optuna, and psycopg for PostgreSQL)"


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    defaults = Config()
    worker = add_command(
        commands, "worker", "take runs from a shared queue (another machine's study) and run them here",
        ("fitdqn train --seeds 5 --folds 4 --out /shared/study --storage postgresql+psycopg://user@db-host/fitdqn",
         "fitdqn worker --storage postgresql+psycopg://user@db-host/fitdqn   # on every other machine",
         "fitdqn worker --storage sqlite:////shared/queue.db --out /mnt/shared/study --parallel 4"),
        "A study started with `fitdqn train --storage URL` queues its runs (seed x fold members) in an Optuna "
        "storage; each worker takes waiting runs and runs them as packed processes on its own device (as many at "
        "once as their plans fit in the free memory), beating a heartbeat in the storage. A worker killed mid-run "
        "goes silent: its run is queued again and resumed from its checkpoint by another worker; a run whose report "
        "exists is never run again. The worker ends when no run is waiting or running. Run directories are "
        "written where the study was queued, or under --out (a shared folder: the study's report pools them).",
    )
    worker.add_argument("--storage", metavar="URL", required=True, help="the queue's storage: an SQLAlchemy URL, "
                        "e.g. postgresql+psycopg://user@host/db or sqlite:///FILE")
    worker.add_argument("--out", "--dir", metavar="DIR", help="this machine's path of the study directory "
                        "(default: the path it was queued with)")
    worker.add_argument("--study", metavar="NAME", help="serve this queue only (default: every one in the storage)")
    worker.add_argument("--device", default="auto", help="device of the runs here (default: %(default)s)")
    worker.add_argument("--parallel", type=int, default=defaults.train.parallel, metavar="K",
                        help="runs at once: 0 = auto (as many as fit); K caps it (default: %(default)s)")
    worker.add_argument("--threads", type=int, default=defaults.train.threads, metavar="N",
                        help="CPU threads of all the runs together; 0 = auto (default: %(default)s)")
    worker.add_argument("--heartbeat", type=int, default=defaults.tune.heartbeat_seconds, metavar="SECONDS",
                        help="seconds between heartbeats; a worker silent for twice this has its runs queued again "
                        "(default: %(default)s)")
    worker.set_defaults(run=run)
    return worker


def run(args: argparse.Namespace) -> int:
    try:  # Optuna is optional: looked for only when the command runs
        import optuna  # noqa: F401
    except ImportError:
        raise UserError(f"fitdqn worker needs Optuna, which is not installed: {INSTALL_HINT}") from None
    if args.parallel < 0 or args.threads < 0:
        raise UserError("--parallel and --threads must be 0 (auto) or more")
    from rich.console import Console

    from fitdqn.schedule.study import run_worker

    console = Console()
    served = run_worker(args.storage, Path(args.out) if args.out else None, args.study, args.device, args.parallel,
                        args.heartbeat, args.threads, console)
    console.print(f"no run left: served {served} queue(s)", highlight=False, markup=False)
    return 0
