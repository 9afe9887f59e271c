"""Training engines, one module each, registered by name (see ``base``): ``torchrun`` (DDP), ``deepspeed``,
``fsdp``. ``of(plan)`` is the plan's engine; ``names()`` the launcher choices."""

from . import ddp, deepspeed, fsdp  # noqa: F401  (registration)
from .base import (Dtypes, Layout, ModelStates, Placement, Strategy, all_strategies, get, infer_launcher, names, of,
                   register, switch_to)

__all__ = ["Dtypes", "Layout", "ModelStates", "Placement", "Strategy", "all_strategies", "get", "infer_launcher",
           "names", "of", "register", "switch_to"]
