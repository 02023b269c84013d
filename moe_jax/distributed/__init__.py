"""Layouts, plans, meshes and the expert-parallel layer; `initialize()` joins a multi-process job."""

from .runtime import ProcessEnvironment, initialize, is_main_process, leave, process_environment
from .targets import target_devices

__all__ = ["ProcessEnvironment", "initialize", "is_main_process", "leave", "process_environment", "target_devices"]
