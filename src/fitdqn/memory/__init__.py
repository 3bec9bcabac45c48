"""Measuring device memory: tensor bytes, traced steps, attribution, the allocator model, CUDA's own rules.

A leaf: imports only torch and ``fitdqn.device``."""

from fitdqn.memory.component import Component, ComponentName, buffer_bytes, parameter_bytes, tensor_bytes

__all__ = ["Component", "ComponentName", "buffer_bytes", "parameter_bytes", "tensor_bytes"]
