"""Use what was trained: load a run's policy, act on new bars, export the acting network for deployment."""

from fitdqn.deploy.act import act_on_bars, act_run, write_actions
from fitdqn.deploy.export import export_policy, load_exported
from fitdqn.deploy.policy import RunPolicy, load_run_policy

__all__ = ["RunPolicy", "act_on_bars", "act_run", "export_policy", "load_exported", "load_run_policy",
           "write_actions"]
