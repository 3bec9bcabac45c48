"""Rewrite ``plan_reference.json``'s entries for the kernels this machine resolves (``triton`` on a GPU machine with
Triton, else ``torch``), from `fitdqn plan --json` of each what-if. Only for a change meant to move the plan; say
why in the commit.

    python tests/plan/regenerate_reference.py            # prints the new entries and writes the file
    python tests/plan/regenerate_reference.py --print    # prints only (e.g. on a GPU machine, to copy back)
"""

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from fitdqn.cli import main
from fitdqn.ops.kernels import resolve_kernels

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_plan_reference import WHAT_IFS  # noqa: E402


def entries() -> tuple[str, dict]:
    kernels = resolve_kernels("auto", "cuda")
    plans = {}
    for name, options in WHAT_IFS.items():
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(out):
            assert main(["plan", *options, "--batch-size", "0", "--json", "--budget.trace_cache_dir", cache]) == 0
        plan = json.loads(out.getvalue())
        plans[name] = {"batch_size": plan["batch_size"],
                       "components": {c["name"]: [c["fixed_bytes"], c["per_sample_bytes"]]
                                      for c in sorted(plan["components"], key=lambda c: c["name"])}}
    return kernels, plans


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the entries, do not write the file")
    args = parser.parse_args()
    kernels, plans = entries()
    print(json.dumps({kernels: plans}, indent=1))
    if not args.print:
        path = HERE / "plan_reference.json"
        reference = json.loads(path.read_text())
        reference[kernels] = plans
        path.write_text(json.dumps(reference, indent=1) + "\n")
