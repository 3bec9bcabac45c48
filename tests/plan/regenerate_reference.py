"""Rewrite ``plan_reference.json`` from `fitdqn plan --json` of each what-if (the same on every machine: the planner
traces the operators' fake kernels). Only for a change meant to move the plan; say why in the commit.

    python tests/plan/regenerate_reference.py            # prints the new reference and writes the file
    python tests/plan/regenerate_reference.py --print    # prints only
"""

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from fitdqn.cli import main

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_plan_reference import WHAT_IFS  # noqa: E402


def entries() -> dict:
    plans = {}
    for name, options in WHAT_IFS.items():
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(out):
            assert main(["plan", *options, "--batch-size", "0", "--json", "--budget.trace_cache_dir", cache]) == 0
        plan = json.loads(out.getvalue())
        plans[name] = {"batch_size": plan["batch_size"],
                       "components": {c["name"]: [c["fixed_bytes"], c["per_sample_bytes"]]
                                      for c in sorted(plan["components"], key=lambda c: c["name"])}}
    return plans


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the entries, do not write the file")
    args = parser.parse_args()
    plans = entries()
    print(json.dumps(plans, indent=1))
    if not args.print:
        (HERE / "plan_reference.json").write_text(json.dumps(plans, indent=1) + "\n")
