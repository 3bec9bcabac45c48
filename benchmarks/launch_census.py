"""The ops one training step runs for a CUDA target, counted on a CPU: a census of the update's kernel launches.

    PYTHONPATH=src python benchmarks/launch_census.py --out census.json            # the default CUDA config
    PYTHONPATH=src python benchmarks/launch_census.py --list                       # op by op

The update is launch-bound on a GPU (a few microseconds a kernel in its CUDA graph), so the number of ops it runs is
a first measure of a change that fuses some, before any GPU is at hand. The step is the trainer's own
(``fitdqn.plan.build.make_train_step``: replay sampling, the learner's update, the new priorities), traced as the
planner traces it (``fitdqn.memory.trace``: fake tensors, CUDA's autocast rules, the network widths of a CUDA run,
the operators' fake kernels); a dispatch mode inside the trace counts every op the last traced step dispatches.

What the count is and is not: each ATen op and each ``fitdqn::`` operator counts once; views, allocations and host
scalars launch nothing and are left out. It is not the GPU's launch count: an operator may launch several Triton
kernels (the C51 fold one per branch), a CPU trace runs some ops the CUDA path fuses (``aten::mm`` with
``out_dtype`` is an mm and a cast here) and cuBLAS may add a split-K reduction. Compare counts of two commits with
each other; the GPU's launches come from ``benchmarks/update_vs_compile.py --profile-batch``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch
from _common import write_json
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fitdqn.config import Config, for_device, with_overrides
from fitdqn.device import what_if
from fitdqn.memory.trace import StepSetup, trace_step_memory
from fitdqn.plan.build import make_train_step, trace_config
from fitdqn.provenance import code_commit

LAUNCH_FREE = {  # ops that move no data on a GPU: views, allocations, host scalars, metadata
    "view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
    "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "_reshape_alias", "reshape", "narrow",
    "diagonal", "unfold", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "_local_scalar_dense", "is_same_size", "view_as", "expand_as", "scalar_tensor", "sym_size", "sym_stride",
    "_record_function_enter_new", "_record_function_exit", "device",
}
NUM_BARS = 3000  # the stand-in market's length: moves no op of the step
CAPACITY = 1 << 16  # the stand-in replay's capacity: likewise


class OpCensus(TorchDispatchMode):
    """Records ``(op, input shapes, input dtypes)`` for every op that launches work (not :data:`LAUNCH_FREE`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]], list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "overloadpacket", None)
        name = packet.__name__ if packet is not None else str(func)
        if name not in LAUNCH_FREE:
            tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
            self.ops.append((f"{func.namespace}::{name}", [tuple(t.shape) for t in tensors],
                             [str(t.dtype).removeprefix("torch.") for t in tensors]))
        return func(*args, **(kwargs or {}))


def census(config: Config, batch_size: int) -> list[tuple[str, list[tuple[int, ...]], list[str]]]:
    """The ops of the last of the traced steps (the tracer runs a warm-up step first)."""
    device = what_if("NVIDIA H200", 141 * 2**30, 100 * 2**30)
    traced, _note = trace_config(config, device)
    make_step = make_train_step(traced, NUM_BARS, CAPACITY)
    steps: list[OpCensus] = []

    def counted(batch: int, fake_device: torch.device) -> StepSetup:
        setup = make_step(batch, fake_device)

        def step():
            steps.append(OpCensus())
            with steps[-1]:
                return setup.step()

        return setup._replace(step=step)

    trace_step_memory(counted, batch_size, "cuda")
    return steps[-1].ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8192, help="the update's batch (default 8192)")
    parser.add_argument("--list", action="store_true", help="print every op in order, with shapes and dtypes")
    parser.add_argument("--out", help="JSON results file")
    args = parser.parse_args(argv)
    config = with_overrides(Config(), {"market.data": "synthetic", "budget.batch_size": args.batch})
    config = for_device(config, "cuda")
    ops = census(config, args.batch)
    counts = collections.Counter(name for name, _, _ in ops)
    if args.list:
        for index, (name, shapes, dtypes) in enumerate(ops, 1):
            print(f"{index:4d} {name} {shapes} {dtypes}")
    for name, count in counts.most_common():
        print(f"{count:5d} {name}")
    print(f"{len(ops)} ops in one step at batch {args.batch}, commit {code_commit()}")
    if args.out:
        result = {"commit": code_commit(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
                  "command": " ".join(["launch_census.py", *(argv if argv is not None else sys.argv[1:])]),
                  "batch": args.batch, "ops": len(ops), "by_op": dict(counts.most_common())}
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
