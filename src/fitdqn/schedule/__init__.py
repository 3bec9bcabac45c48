"""One queue of runs for every multi-run workload (a study's seed x fold members, tune trials), packed on a device.

``packing``: how many runs at once and which to start (a pure function of the runs' planned bytes, the free memory
and the cores); ``shares``: each run's planned bytes, from its own plan; ``queue``: the queue in this process or on
Optuna's RDB storage (shared by workers on several machines); ``scheduler``: runs taken from a queue as packed
processes (``member``: one run in its own process); ``study``: ``fitdqn train --seeds/--folds`` through them, and
``fitdqn worker``.
"""
