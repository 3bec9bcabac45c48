"""`fitdqn plan --json` for the default config keeps its batch and components (within 0.5 %) on the RTX 3050
what-if (1.7 GiB free) and an H200 what-if: a restructuring of the planner must not move them.

The reference (``plan_reference.json``) holds each plan's batch and components as a machine with the card (CUDA and
Triton) makes them. The planner traces the operators' fake kernels, which need no Triton and no GPU, so every
machine, a CPU-only one included, must make that same plan of the card: the what-if plans the card's own kernels.
Regenerate it only for a change that is meant to move the plan, and say why in the commit:

    python tests/plan/regenerate_reference.py
"""

import json
from pathlib import Path

import pytest

from fitdqn.cli import main
from fitdqn.memory.component import NETWORK_COMPONENTS

REFERENCE = json.loads((Path(__file__).parent / "plan_reference.json").read_text())
WHAT_IFS = {"rtx3050_1.7GiB": ["--gpu", "rtx3050", "--free-memory", "1.7GiB"], "h200": ["--gpu", "h200"]}
TOLERANCE = 0.005
# The traced step's bytes outside the networks, split by the trace's attribution of the replay's own calls
# (``System.memory_calls``): the split moved when it replaced hand-typed rows; their sum must not move.
SAMPLING_SPLIT = ("replay", "her", "batch")


def close(value: int, reference: int) -> bool:
    return abs(value - reference) <= max(TOLERANCE * abs(reference), 64)  # 64 B: a slope's rounding


@pytest.mark.parametrize("what_if", sorted(WHAT_IFS))
def test_the_what_if_is_the_plan_the_card_makes_of_itself(what_if, capsys, tmp_path):
    """Planned here (on a CPU-only machine too: no Triton, no GPU), the card's plan is the reference, its own."""
    reference = REFERENCE[what_if]
    assert main(["plan", *WHAT_IFS[what_if], "--batch-size", "0", "--json", "--budget.trace_cache_dir",
                 str(tmp_path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert abs(plan["batch_size"] - reference["batch_size"]) <= TOLERANCE * reference["batch_size"]
    components = {c["name"]: c for c in plan["components"]}
    assert set(components) == set(reference["components"])
    for name, (fixed, per_sample) in reference["components"].items():
        assert close(components[name]["fixed_bytes"], fixed), (name, components[name]["fixed_bytes"], fixed)
        if name not in SAMPLING_SPLIT:
            assert close(components[name]["per_sample_bytes"], per_sample), (name, components[name], per_sample)
    split = sum(components[name]["per_sample_bytes"] for name in SAMPLING_SPLIT)
    assert close(split, sum(reference["components"][name][1] for name in SAMPLING_SPLIT)), split
    # every head's activations are attributed to it: none shows 0 B a sample (the IQN head's operator included)
    for group in NETWORK_COMPONENTS:
        assert components[group]["per_sample_bytes"] > 0, group
