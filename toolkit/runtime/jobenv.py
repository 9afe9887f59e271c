"""What a job learns from its environment: the plan, the attempt directory, the
DeepSpeed config, its rank, and the GPU memory cap of the partition it emulates.

The rendered job script sets ``HPCMEM_PLAN``, ``HPCMEM_ATTEMPT_DIR``,
``HPCMEM_DS_CONFIG`` and ``HPCMEM_GPU_MEM_GIB`` (docs/architecture.md); torchrun
and the deepspeed launcher set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``.
Every reader takes an optional ``env`` mapping so it can be tested without
touching ``os.environ``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .. import strategies
from ..errors import ConfigError, HpcmemError
from ..plan import Plan

ENV_PLAN = "HPCMEM_PLAN"
ENV_ATTEMPT_DIR = "HPCMEM_ATTEMPT_DIR"
ENV_DS_CONFIG = strategies.get("deepspeed").env_var
ENV_GPU_MEM_GIB = "HPCMEM_GPU_MEM_GIB"

MIB = 2**20
GIB = 2**30


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _path_from(name: str, env: Mapping[str, str] | None, what: str) -> Path:
    value = _env(env).get(name, "").strip()
    if not value:
        raise HpcmemError(f"{name} is not set: this must run inside an hpcmem job (it names the {what})")
    return Path(value)


def in_hpcmem_job(env: Mapping[str, str] | None = None) -> bool:
    """True when the job script set ``HPCMEM_PLAN``."""
    return bool(_env(env).get(ENV_PLAN, "").strip())


def load_plan(env: Mapping[str, str] | None = None) -> Plan:
    """The Plan in the file named by ``HPCMEM_PLAN``; HpcmemError when unset, missing or invalid."""
    path = _path_from(ENV_PLAN, env, "plan.json")
    return Plan.from_dict(_read_json(path, "plan"))


def attempt_dir(env: Mapping[str, str] | None = None, required: bool = True) -> Path | None:
    """The attempt directory from ``HPCMEM_ATTEMPT_DIR`` (None when unset and not ``required``)."""
    if not required and not _env(env).get(ENV_ATTEMPT_DIR, "").strip():
        return None
    return _path_from(ENV_ATTEMPT_DIR, env, "attempt directory")


def ds_config_path(env: Mapping[str, str] | None = None) -> Path:
    """The ds_config.json path from ``HPCMEM_DS_CONFIG``."""
    return _path_from(ENV_DS_CONFIG, env, "DeepSpeed config")


def ds_config(env: Mapping[str, str] | None = None, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict from ``path`` or, by default, ``HPCMEM_DS_CONFIG``."""
    return _read_json(Path(path) if path else ds_config_path(env), "DeepSpeed config")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HpcmemError(f"{what} file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} file {path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the job (torchrun / deepspeed launcher variables)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks(env: Mapping[str, str] | None = None) -> Ranks:
    """Rank, local rank and world size from the launcher's variables (a single process without them)."""
    e = _env(env)

    def num(name: str, default: int) -> int:
        try:
            return int(e.get(name, default))
        except ValueError:
            raise HpcmemError(f"environment variable {name} must be an integer, got {e.get(name)!r}") from None

    world = num("WORLD_SIZE", 1)
    return Ranks(rank=num("RANK", 0), local_rank=num("LOCAL_RANK", 0), world_size=world,
                 local_world_size=num("LOCAL_WORLD_SIZE", world))


def gpu_mem_cap_gib(env: Mapping[str, str] | None = None) -> float | None:
    """``HPCMEM_GPU_MEM_GIB`` as a number of GiB (None when unset)."""
    text = _env(env).get(ENV_GPU_MEM_GIB, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise HpcmemError(f"{ENV_GPU_MEM_GIB} must be a number of GiB, got {text!r}") from None
    if value <= 0:
        raise HpcmemError(f"{ENV_GPU_MEM_GIB} must be positive, got {text!r}")
    return value


def memory_fraction(cap_gib: float | None, total_bytes: int) -> float | None:
    """The per-process CUDA memory fraction that makes a card of ``total_bytes`` look like ``cap_gib``.

    None when there is no cap or the card is not larger than the cap.
    """
    if cap_gib is None or total_bytes <= 0:
        return None
    cap = cap_gib * GIB
    if total_bytes <= cap:
        return None
    return cap / total_bytes


def apply_gpu_memory_cap(device: Any = None, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Cap this process's CUDA memory to ``HPCMEM_GPU_MEM_GIB`` when the card is larger.

    This is how an 80 GB card emulates a 16/32/40 GB partition. Returns what was
    applied (``{"gpu_mem_gib", "card_gib", "memory_fraction"}``) or None when nothing
    was (no cap, no GPU, or a card no larger than the cap).
    """
    cap = gpu_mem_cap_gib(env)
    if cap is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = None if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = memory_fraction(cap, total)
    if fraction is None:
        return None
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return {"gpu_mem_gib": cap, "card_gib": round(total / GIB, 2), "memory_fraction": round(fraction, 6)}
