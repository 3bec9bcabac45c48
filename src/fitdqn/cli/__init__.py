"""The `fitdqn` command — the only door for people. One module per command, over library functions that never
see argparse; :mod:`fitdqn.cli.app` builds the parser and dispatches.

    fitdqn plan          where every byte of GPU memory will go, and the batch size that leaves
                         (--calibrate: measure the step on this GPU and plan with the measurement)
    fitdqn gpu-profiles  list the GPU profiles and where their numbers came from (old name: profiles)
    fitdqn profile       measure step time across batch sizes on this GPU and write its profile TOML
    fitdqn train         plan, allocate, train, evaluate: the whole run, resumable
    fitdqn evaluate      backtest a run's checkpoint on a split beside buy-and-hold and random
    fitdqn bench         update, replay and collector throughput on this device (CPU too)
    fitdqn tune          hyperparameter trials with Optuna, K at once (each planned within its share of the GPU)
    fitdqn act           a run's policy on new bars: target position and bracket per bar (CSV/Parquet)
    fitdqn export        a run's acting network as a torch.export program (.pt2)

``fitdqn <command> --help`` shows the command's common options and the config sections, ``--help-all`` every
option (:mod:`fitdqn.cli.args`); every default of a run lives in ``fitdqn.config``, a command's own options (such
as ``bench --iters``) are declared once, in its module. Torch's CPU threads are set once at start
(:mod:`fitdqn.device.threads`). Startup stays light: a command module imports torch and the library only when
the command runs, so ``fitdqn --help`` does not import torch.
"""

from fitdqn.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
