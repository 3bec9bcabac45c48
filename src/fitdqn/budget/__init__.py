"""The VRAM budget: components, traced per-sample bytes, the planner and its reports."""

from fitdqn.budget.component import Component, buffer_bytes, parameter_bytes, tensor_bytes

__all__ = ["Component", "buffer_bytes", "parameter_bytes", "tensor_bytes"]
