"""The OOM guard: if the device runs out of memory anyway (another process took memory after planning),
re-plan the batch from what is free now, rebuild what the batch size touches (the update graph), log it,
and go on from the last consistent state.

What is consistent: an update that raised out-of-memory has not finished its optimizer step, or raised
inside it before any parameter moved (the allocations come first); the collected experience, the replay and
every finished update stand. Only the remaining updates of the epoch run again, at the new batch.
"""

from __future__ import annotations

import gc

import torch

from fitdqn.device.sizes import format_bytes
from fitdqn.errors import UserError


class OomGuard:
    def __init__(self, trainer, console, logger, max_retries: int = 4) -> None:
        self.trainer, self.console, self.logger = trainer, console, logger
        self.max_retries = max_retries

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
                message = f"out of device memory at batch {old}: re-planned to batch {new} from the memory free now"
                self.console.print(message, style="yellow")
                self.logger.log(trainer.epoch, "oom", {"old_batch": old, "new_batch": new})
        raise AssertionError("unreachable")

    def replan(self) -> int:
        """Free what the batch touches, measure what is free now, pick a smaller batch; refuse below min."""
        trainer = self.trainer
        trainer.update_graph = None
        gc.collect()
        free = self.free_bytes()
        budget = trainer.config.budget
        headroom = int(budget.headroom_fraction * free)
        fits = max((free - headroom) // max(trainer.plan.per_sample_bytes, 1), 0)
        new = min(trainer.batch_size // 2, fits)
        if new < budget.min_batch:
            raise UserError(
                f"the device ran out of memory and only {format_bytes(free)} is free now: a batch of "
                f"{budget.min_batch} (budget.min_batch) no longer fits; free memory on the device (another "
                f"process took it) and resume with --resume"
            )
        trainer.set_batch_size(int(new))
        return int(new)

    def free_bytes(self) -> int:
        device = self.trainer.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free, _total = torch.cuda.mem_get_info(device)  # host sync: driver query
            return int(free)
        from fitdqn.device.probe import system_memory

        return system_memory()[1]
