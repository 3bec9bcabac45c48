"""`fitdqn export`: a run's acting network as a torch.export program (:func:`fitdqn.deploy.export_policy`)."""

from __future__ import annotations

import argparse

from fitdqn.cli.common import Commands, add_command, add_network_option, writing_into


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    export = add_command(
        commands, "export", "export the acting network for deployment (torch.export, .pt2)",
        ("fitdqn export runs/sp500 --out policy.pt2",
         "python -c \"import torch; p = torch.export.load('policy.pt2').module(); actions, q = p(obs)\""),
        "Save RUN_DIR's acting network as a torch.export program: obs [B, W, S] float32 -> (actions [B, 3] "
        "int64, q [B, 3, n]), greedy on the C51 means (learn.risk = 'cvar': on the IQN CVaR at evenly spaced "
        "levels), plain PyTorch kernels in fp32; it loads with torch.export.load, without fitdqn. The archive's "
        "fitdqn.json says how to build obs (feature and agent-state names, window) and how to read the actions "
        "(target contracts, stop and take-profit ATR multiples). `fitdqn act` does all of that for you.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by fitdqn train, or a study's: "
                        "its latest fold's ensemble, actions combined in the program and q [B, members, 3, n]")
    export.add_argument("--out", required=True, metavar="FILE.pt2", help="where to write the program")
    add_network_option(export)
    export.set_defaults(run=run)
    return export


def run(args: argparse.Namespace) -> int:
    # torch.export: imported when the command runs, so `fitdqn --help` stays fast
    from fitdqn.deploy import export_policy, load_run_policy

    with writing_into(args.run_dir, args.out):  # a program written into the run: one writer at a time
        out = export_policy(load_run_policy(args.run_dir, "cpu", args.network), args.out)
    print(f"acting network of {args.run_dir} exported to {out} (torch.export.load('{out}').module()(obs) -> "
          "actions, q)")
    return 0
