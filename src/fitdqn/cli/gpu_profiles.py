"""`fitdqn gpu-profiles` (old name: `profiles`): the GPU profiles (tested batch sizes) and where their numbers came
from."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from fitdqn.cli.args import add_config_arguments, config_from_args
from fitdqn.cli.common import Commands, add_command


def add_parser(commands: Commands) -> argparse.ArgumentParser:
    profiles = add_command(
        commands, "gpu-profiles", "list the GPU profiles (tested batch sizes) and where their numbers came from",
        ("fitdqn gpu-profiles", "fitdqn gpu-profiles --budget.profiles_dir profiles   # yours beside the shipped ones"),
        "List the GPU profiles: the batch size each card trains fastest at, and where that number came from. "
        "Lists only; to measure a new profile on this GPU, run `fitdqn profile`. (`fitdqn profiles` is the old "
        "name of this command.)",
        aliases=("profiles",),
    )
    add_config_arguments(profiles, ("budget.profiles_dir",))
    profiles.set_defaults(run=run, uses_torch=False)  # torch's threads are not set: it is not imported
    return profiles


def run(args: argparse.Namespace) -> int:
    # imported when the command runs, so `fitdqn --help` stays fast; neither imports torch
    from fitdqn.device.profiles import load_profiles
    from fitdqn.device.sizes import format_bytes

    config = config_from_args(args)
    profiles = load_profiles(config.budget.profiles_dir or None)
    table = Table(title="GPU profiles", title_justify="left")
    for column in ("name", "batch", "matches device names", "memory", "source", "date"):
        table.add_column(column)
    ordered = sorted(profiles.values(), key=lambda p: p.name)
    for profile in ordered:
        table.add_row(
            profile.name, str(profile.batch_size), ", ".join(profile.match) or "(any other GPU)",
            format_bytes(profile.total_memory_bytes) if profile.total_memory_bytes else "-",
            str(profile.source["kind"]), str(profile.source["date"]),
        )
    console = Console()
    console.print(table)
    for profile in ordered:
        line = f"{profile.name}: {profile.source['description']} ({profile.path})"
        console.print(line, highlight=False, markup=False)
    return 0
