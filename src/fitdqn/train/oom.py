"""The OOM guard: if the device runs out of memory anyway (another process took memory after planning),
re-plan the batch from what is free now, rebuild what the batch size touches (the update graph), log it,
and go on from the last consistent state.

Re-planning traces the update at the candidate batch, as the planner does (``fitdqn.plan.build.build_components``
anchored there, with the replay capacity the trainer holds): the batch whose traced step, with its graph pool,
fits in what is free now, not a guess such as half the old one. The batch it settles on is the trainer's
``oom_batch_size``, which the checkpoint keeps and a resumed run uses.

What is consistent: an update that raised out-of-memory has not finished its optimizer step, or raised
inside it before any parameter moved (the allocations come first); the collected experience, the replay and
every finished update stand. Only the remaining updates of the epoch run again, at the new batch. An
evaluation or a checkpoint that runs out of memory runs again once the update graph's pool and the cache are
released; if it still does not fit, the run stops with a message, and the last checkpoint stands.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from fitdqn.device.probe import system_memory
from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError
from fitdqn.memory.component import ComponentName
from fitdqn.plan.build import PlanInputs, build_components
from fitdqn.plan.planner import BatchSearch

REPLAN_ROUNDS = 4  # traced candidates per re-plan (as plan.build.refine_auto_batch)
REPLAN_CONVERGED = 0.01  # stop when the next candidate would move the batch by less than this fraction


class OomGuard:
    def __init__(self, trainer, console, logger) -> None:
        self.trainer, self.console, self.logger = trainer, console, logger
        self.max_retries = trainer.config.train.oom_retries

    def run_epoch(self):
        trainer = self.trainer
        for attempt in range(self.max_retries + 1):
            try:
                return trainer.run_epoch()
            except torch.OutOfMemoryError:
                if attempt == self.max_retries:
                    raise
                old = trainer.batch_size
                new = self.replan()
                message = (f"out of device memory at batch {old}: re-planned to batch {new}, the largest whose "
                           "traced update fits in the memory free now")
                self.console.print(message, style="yellow")
                self.logger.log(trainer.epoch, "oom", {"old_batch": old, "new_batch": new})
        raise AssertionError("unreachable")

    def run(self, what: str, call: Callable[..., Any], *args, **kwargs) -> Any:
        """``call(*args, **kwargs)`` (an evaluation, a checkpoint), run again after releasing the update graph's
        pool and the allocator's cache if it runs out of device memory."""
        for attempt in range(self.max_retries + 1):
            try:
                return call(*args, **kwargs)
            except torch.OutOfMemoryError:
                if attempt == self.max_retries:
                    raise UserError(
                        f"the {what} ran out of device memory {self.max_retries + 1} times, even with the update "
                        f"graph released ({format_bytes(self.free_bytes())} free now): another process holds the "
                        "memory; free it and continue the run with --resume (the last checkpoint stands)"
                    ) from None
                self.release()
                self.console.print(f"out of device memory in the {what}: released the update graph and the "
                                   "allocator's cache, trying again", style="yellow")
                self.logger.log(self.trainer.epoch, "oom", {"in": what, "batch": self.trainer.batch_size})
        raise AssertionError("unreachable")

    def release(self) -> None:
        """Drop what the batch touches (the update graph and its pool; recaptured at the next update)."""
        self.trainer.update_graph = None
        gc.collect()
        if self.trainer.device.type == "cuda":
            torch.cuda.empty_cache()

    def replan(self) -> int:
        """Free what the batch touches, measure what is free now, and trace candidate batches below the old one
        until the largest whose step fits is found; refuse below ``budget.min_batch``."""
        trainer = self.trainer
        self.release()
        free = self.free_bytes()
        budget = trainer.config.budget
        room = free - int(budget.headroom_fraction * free)
        new = fitting_batch(lambda batch: step_need(trainer, batch), room, trainer.batch_size - 1,
                            max(trainer.plan.per_sample_bytes, 1), budget.min_batch)
        if new is None:
            raise UserError(
                f"the device ran out of memory and only {format_bytes(free)} is free now: a batch of "
                f"{budget.min_batch} (budget.min_batch) no longer fits; free memory on the device (another "
                f"process took it) and resume with --resume"
            )
        trainer.set_batch_size(int(new))
        trainer.oom_batch_size = int(new)
        return int(new)

    def free_bytes(self) -> int:
        device = self.trainer.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free, _total = torch.cuda.mem_get_info(device)  # host sync: driver query
            return int(free)
        return system_memory()[1]


def step_need(trainer, batch: int) -> int:
    """Bytes the update at ``batch`` takes beyond what the trainer already holds: every component's per-sample
    bytes with the step traced at ``batch`` (the plan's own components, anchored there), and the graph pool's
    pages. The replay, collector and networks are allocated already: their fixed bytes are not asked again."""
    inputs = PlanInputs.from_market(trainer.market, trainer.plan_inputs.world_size)
    components, _capacity = build_components(trainer.config, trainer.device_info, inputs, anchor=batch)
    pages = sum(c.fixed_bytes for c in components if c.name == ComponentName.CUDA_GRAPHS)
    return sum(c.per_sample_bytes for c in components) * batch + pages


def fitting_batch(need: Callable[[int], int], room: int, below: int, per_sample_guess: int,
                  min_batch: int) -> int | None:
    """The largest batch under ``below`` whose traced ``need(batch)`` fits in ``room``, or None below
    ``min_batch``. The first candidate is ``room / per_sample_guess``; each next one is what the last trace says
    fits (each check is exact at its own batch; kept under a miss as :class:`fitdqn.plan.planner.BatchSearch`
    says), stopping when that moves it by less than ``REPLAN_CONVERGED``."""
    candidate, search = min(below, room // per_sample_guess), BatchSearch(REPLAN_CONVERGED)
    for _ in range(REPLAN_ROUNDS):
        if candidate is None or candidate < min_batch:
            break
        needed = need(candidate)
        in_proportion = min(below, candidate * room // max(needed, 1))  # what the trace at the candidate says fits
        proposal = search.next(candidate, needed <= room, in_proportion)
        if needed <= room and candidate >= below:  # the old batch fits again: nothing larger is asked
            break
        candidate = proposal
    if search.fitted is None and below >= min_batch and need(min_batch) <= room:
        return min_batch  # the rounds overshot each time: the smallest batch allowed, checked by its own trace
    return search.fitted
