"""Site profiles: what a cluster offers, partition by partition.

A site is one YAML file, ``<site>.yaml``, found in (first match wins):
the ``--sites-dir`` directories, the ``HPCMEM_SITES`` directories (``:``-separated),
then the shipped ``site_configs/``. Every file is checked against
``site_configs/schema.json``; a bad key names itself and its file.
GPU capabilities (fp16, bf16, tf32, flash attention) are derived from the GPU model; a CPU
partition's fp16 support depends on the CPU and is measured by ``hpcmem calibrate``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from . import detect
from .errors import ConfigError, PlanError, UnknownNameError
from .plan import Plan
from .resources import data_dir, home_dir
from .schema import load_schema, load_yaml, validate

# (substring of the GPU model, bf16, tf32, flash attention). Volta and Turing have
# fp16 tensor cores only; Ampere and later add bf16 and tf32, and FlashAttention-2
# needs sm80+. First match wins, so longer names come first.
GPU_FAMILIES = (
    ("V100", False, False, False),
    ("P100", False, False, False),
    ("T4", False, False, False),
    ("RTX 20", False, False, False),
    ("A100", True, True, True),
    ("A800", True, True, True),
    ("A10", True, True, True),
    ("A30", True, True, True),
    ("A40", True, True, True),
    ("L40", True, True, True),
    ("L4", True, True, True),
    ("H100", True, True, True),
    ("H200", True, True, True),
    ("H800", True, True, True),
    ("GH200", True, True, True),
    ("B200", True, True, True),
    ("RTX 30", True, True, True),
    ("RTX 40", True, True, True),
    ("RTX A", True, True, True),
)


# Share of this machine's memory a local job may use when nothing else is said.
LOCAL_MEM_SHARE = 0.75


@dataclass(frozen=True)
class Partition:
    """One partition of a site (memory in GiB unless the name says MiB, time in minutes)."""

    site: str
    name: str
    slurm_partition: str
    gpu_model: str | None
    """GPU model name; None on a CPU partition."""
    gpu_mem_gib: float
    gpus_per_node: int
    cpus_per_node: int
    host_mem_gib: float
    nvme_path: str | None
    nvme_gib: float
    max_time_min: int
    cuda_context_mib: float
    """CUDA context + cuBLAS workspace per process, as measured on the partition."""
    bf16: bool
    tf32: bool
    flash_attention: bool
    gres_type: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    setup: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    default_mem_mib: int | None = None
    description: str = ""
    allocator_overhead_frac: float | None = None
    """Caching-allocator memory reserved beyond peak allocated, as a fraction (measured; None: the estimator's default)."""
    calibrated: bool = False
    """Values were measured on the partition (``hpcmem calibrate``) and applied over the profile."""
    fp16: bool = True
    """fp16 kernels: every CUDA GPU; a CPU only with oneDNN fp16 (AVX512-FP16 or AMX-FP16), which DeepSpeed's
    CPU accelerator requires (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``). Measured by calibrate."""

    @property
    def has_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def max_time(self) -> str:
        return format_minutes(self.max_time_min)

    def check_plan(self, plan: Plan) -> None:
        """Refuse a plan this partition cannot run, naming the knob and what would work."""
        where = f"partition {self.site}:{self.name}"
        if plan.precision == "fp16-mixed" and not self.fp16:
            raise PlanError(f"precision=fp16-mixed: {where} ({self.gpu_model or 'CPU'}) has no fp16 support; "
                            "use precision=bf16-mixed or fp32")
        if plan.precision.startswith("bf16") and not self.bf16:
            raise PlanError(f"precision={plan.precision}: {where} ({self.gpu_model}) has no bf16; use precision=fp16-mixed")
        if plan.attention == "flash" and not self.flash_attention:
            what = self.gpu_model or "CPU"
            raise PlanError(f"attention=flash: {where} ({what}) has no flash attention; use attention=sdpa")
        if plan.attention == "flash" and plan.precision == "fp32":
            raise PlanError("attention=flash with precision=fp32: flash-attn's kernels take fp16/bf16 only (no autocast "
                            "under fp32); use precision=bf16-mixed or fp16-mixed, or attention=sdpa")
        if self.has_gpu and plan.gpus_per_node > self.gpus_per_node:
            raise PlanError(f"gpus_per_node={plan.gpus_per_node}: {where} has {self.gpus_per_node} GPUs per node")
        if not self.has_gpu and plan.gpus_per_node > self.cpus_per_node:
            raise PlanError(f"gpus_per_node={plan.gpus_per_node} ranks: {where} has {self.cpus_per_node} CPUs per node")
        if plan.time_min > self.max_time_min:
            raise PlanError(f"time_min={plan.time_min}: {where} allows at most {self.max_time_min} minutes ({self.max_time})")
        if plan.mem_mib is not None and plan.mem_mib > self.host_mem_gib * 1024:
            raise PlanError(f"mem_mib={plan.mem_mib}: {where} nodes have {self.host_mem_gib:g} GiB")
        if "nvme" in (plan.offload_optimizer, plan.offload_params) and not self.nvme_path:
            raise PlanError(f"offload to nvme: {where} has no nvme_path")

    def to_dict(self) -> dict:
        """The public view (``hpcmem sites --json``)."""
        return {
            "name": self.name, "slurm_partition": self.slurm_partition, "gpu_model": self.gpu_model,
            "gpu_mem_gib": self.gpu_mem_gib, "gpus_per_node": self.gpus_per_node,
            "cpus_per_node": self.cpus_per_node, "host_mem_gib": self.host_mem_gib,
            "nvme_path": self.nvme_path, "nvme_gib": self.nvme_gib, "fp16": self.fp16, "bf16": self.bf16, "tf32": self.tf32,
            "flash_attention": self.flash_attention, "cuda_context_mib": self.cuda_context_mib,
            "max_time": self.max_time,
        }


@dataclass(frozen=True)
class Site:
    name: str
    scheduler: str
    path: Path
    partitions: dict[str, Partition] = field(default_factory=dict)
    description: str = ""

    def partition(self, name: str | None) -> Partition:
        """The partition called ``name`` (the only one when ``name`` is None and there is one)."""
        if name is None:
            if len(self.partitions) == 1:
                return next(iter(self.partitions.values()))
            raise ConfigError(f"site {self.name} has several partitions; choose one with --partition "
                              f"({', '.join(sorted(self.partitions))})")
        if name not in self.partitions:
            raise UnknownNameError(f"partition of site {self.name}", name, self.partitions)
        return self.partitions[name]

    def to_dict(self) -> dict:
        return {"site": self.name, "scheduler": self.scheduler,
                "partitions": [p.to_dict() for p in self.partitions.values()]}


def search_path(extra: Iterable[str | Path] = ()) -> list[Path]:
    """Directories searched for ``<site>.yaml``, first match wins."""
    dirs = [Path(d) for d in extra]
    dirs += [Path(d) for d in os.environ.get("HPCMEM_SITES", "").split(os.pathsep) if d]
    dirs.append(data_dir("site_configs"))
    return dirs


def site_files(extra: Iterable[str | Path] = ()) -> dict[str, Path]:
    """Every site name found on the search path, mapped to the file that wins."""
    found: dict[str, Path] = {}
    for directory in search_path(extra):
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.yaml")):
            if path.name.endswith(".calibration.yaml"):
                continue
            found.setdefault(path.stem, path)
    return found


def load_site(name: str, extra: Iterable[str | Path] = ()) -> Site:
    """Load and check the site called ``name``."""
    files = site_files(extra)
    if name not in files:
        raise UnknownNameError("site", name, files)
    return load_site_file(files[name])


def load_site_file(path: Path) -> Site:
    """Load and check one site profile file."""
    path = Path(path)
    doc = load_yaml(path)
    validate(doc, load_schema(data_dir("site_configs") / "schema.json"), str(path))
    if doc["site"] != path.stem:
        raise ConfigError(f"{path}: site: {doc['site']!r} must match the file name {path.stem!r}")
    for pname in doc["partitions"]:
        if not isinstance(pname, str) or not _NAME.fullmatch(pname):
            raise ConfigError(f"{path}: partitions: partition name {pname!r} must be text of letters, digits, "
                              "'_', '.', '+' and '-' (quote a number: \"1\")")
    parts = {pname: _partition(doc["site"], pname, raw, path) for pname, raw in doc["partitions"].items()}
    if not parts:
        raise ConfigError(f"{path}: partitions: at least one partition is needed")
    measured = load_calibration(path)
    parts = {name: apply_calibration(p, measured.get(name)) for name, p in parts.items()}
    for name, part in parts.items():
        if part.calibrated and part.has_gpu and part.cuda_context_mib >= part.gpu_mem_gib * 1024:
            files = " and ".join(str(f) for f in calibration_files(path) if f.is_file())
            raise ConfigError(f"{files}: partitions.{name}.cuda_context_mib: {_num(part.cuda_context_mib)} MiB is not "
                              f"below the GPU's memory ({_num(part.gpu_mem_gib)} GiB), applied over {path}")
    return Site(doc["site"], doc["scheduler"], path, parts, doc.get("description", ""))


def calibration_files(site_path: Path) -> list[Path]:
    """Where ``hpcmem calibrate`` may have written this site's measurements (later files win)."""
    name = f"{site_path.stem}.calibration.yaml"
    return [site_path.with_name(name), home_dir() / "calibration" / name]


def load_calibration(site_path: Path) -> dict[str, dict]:
    """Measured values per partition name (empty when the site was never calibrated)."""
    out: dict[str, dict] = {}
    for path in calibration_files(site_path):
        if path.is_file():
            for name, values in read_calibration(path).items():
                out.setdefault(name, {}).update(values)
    return out


_MEASURED_BOOLS = ("fp16", "bf16", "tf32", "flash_attention")


def _measured_bounds() -> dict[str, Bound]:
    """Every number a calibration file may hold -> its range (the site profile's, and for what only calibration
    measures: the allocator's overhead at most 10 (reserved / allocated - 1: a fit on tiny models, whose 20 MiB
    segments hold a few MiB, can pass 1; 10 is far beyond any real one and keeps 1e308 out), GPU and rank counts
    whole numbers)."""
    return {"gpu_mem_gib": GPU_MEM_BOUND, "cuda_context_mib": SIZE_BOUNDS["cuda_context_mib"],
            "host_mem_gib": Bound(0, MAX_HOST_MEM_GIB, unit="GiB per node"), "nvme_gib": SIZE_BOUNDS["nvme_gib"],
            "nvme_free_gib": SIZE_BOUNDS["nvme_gib"],
            "allocator_overhead_frac": Bound(0, 10, unit="reserved / allocated - 1"),
            "gpus": Bound(0, MAX_GPUS_PER_NODE, integer=True), "fitted_from_ranks": Bound(0, 2**31, integer=True)}


def read_calibration(path: Path) -> dict[str, dict]:
    """A ``<site>.calibration.yaml``, checked: partition name -> measurements ({} for an empty file).

    Anything else (a list, a string, a measurement that is not a finite number in its range, a capability that is
    not true/false) is one ConfigError naming the file and key: a damaged calibration is never applied
    half-read, and never silently replaced."""
    return check_calibration(load_yaml(path), path)


def check_calibration(doc, path: Path) -> dict[str, dict]:
    """``read_calibration``'s checks on a loaded (or about to be written) calibration document."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with 'partitions', got {_kind(doc)}")
    parts = doc.get("partitions")
    if parts is None:
        return {}
    if not isinstance(parts, dict):
        raise ConfigError(f"{path}: partitions: expected a mapping of partition name to measurements, got {_kind(parts)}")
    bounds = _measured_bounds()
    out: dict[str, dict] = {}
    for name, values in parts.items():
        if not isinstance(name, str):
            raise ConfigError(f"{path}: partitions: partition name {name!r} is not a string")
        values = values or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: partitions.{name}: expected a mapping of measurements, got {_kind(values)}")
        for key, value in values.items():
            bound = bounds.get(key)
            if bound is not None and value is not None and not bound.holds(value):
                raise ConfigError(f"{path}: partitions.{name}.{key}: expected {bound.words()}, got {_kind(value)}")
            if key in _MEASURED_BOOLS and value is not None and not isinstance(value, bool):
                raise ConfigError(f"{path}: partitions.{name}.{key}: expected true or false, got {_kind(value)}")
            if key == "gpu_model" and value is not None and not (isinstance(value, str) and not _CONTROL.search(value)):
                raise ConfigError(f"{path}: partitions.{name}.{key}: expected the GPU's name as one line of text, "
                                  f"got {_kind(value)}")
        out[name] = dict(values)
    return out


def _kind(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:60] + '...'}"


def apply_calibration(part: Partition, measured: dict | None) -> Partition:
    """The partition with measured values over the profile's (GPU values only when a GPU was seen)."""
    if not measured:
        return part
    changes: dict = {"calibrated": True}
    if part.has_gpu and measured.get("gpus"):
        for key in ("gpu_mem_gib", "bf16", "flash_attention"):
            if measured.get(key) is not None:
                changes[key] = measured[key]
    if not part.has_gpu and not measured.get("gpus"):  # a CPU node: its precision support is the CPU's
        for key in ("fp16", "bf16"):
            if isinstance(measured.get(key), bool):
                changes[key] = measured[key]
    if part.has_gpu and (measured.get("gpus") or measured.get("fitted_from_ranks")) \
            and measured.get("cuda_context_mib") is not None:
        changes["cuda_context_mib"] = measured["cuda_context_mib"]
    if measured.get("allocator_overhead_frac") is not None:
        changes["allocator_overhead_frac"] = float(measured["allocator_overhead_frac"])
    return dataclasses.replace(part, **changes)


def all_sites(extra: Iterable[str | Path] = ()) -> list[Site]:
    return [load_site_file(p) for p in site_files(extra).values()]


def _partition(site: str, name: str, raw: dict, path: Path) -> Partition:
    where = f"{path}: partitions.{name}"
    check_sizes(raw, where)
    raw = _resolve_auto(raw, path, name)
    model = raw["gpu_model"]
    gpus = raw["gpus_per_node"]
    if (model is None) != (gpus == 0):
        raise ConfigError(f"{where}: gpu_model must be null exactly when gpus_per_node is 0")
    caps = dict(zip(CAPABILITIES, capabilities(model, where)))
    caps.update(raw.get("capabilities", {}))
    check_fields(raw, where)
    return Partition(
        site=site, name=name, slurm_partition=raw["slurm_partition"], gpu_model=model,
        gpu_mem_gib=float(raw["gpu_mem_gib"]), gpus_per_node=gpus, cpus_per_node=raw["cpus_per_node"],
        host_mem_gib=float(raw["host_mem_gib"]), nvme_path=raw["nvme_path"], nvme_gib=float(raw["nvme_gib"]),
        max_time_min=parse_minutes(raw["max_time"], f"{where}.max_time"), cuda_context_mib=float(raw["cuda_context_mib"]),
        gres_type=raw.get("gres_type"), account=raw.get("account"), qos=raw.get("qos"),
        constraint=raw.get("constraint"), setup=tuple(raw.get("setup", ())),
        env=tuple((k, str(v)) for k, v in raw.get("env", {}).items()),
        default_mem_mib=raw.get("default_mem_mib"), description=raw.get("description", ""), **caps,
    )


def _resolve_auto(raw: dict, path: Path, name: str) -> dict:
    """Fill ``auto`` values from this machine (the ``local`` site)."""
    auto = [k for k, v in raw.items() if v == "auto"]
    if not auto:
        return raw
    machine = detect.local_machine()
    known = {"gpu_model": machine.gpu_model, "gpu_mem_gib": machine.gpu_mem_gib,
             "gpus_per_node": machine.gpus, "cpus_per_node": machine.cpus, "host_mem_gib": machine.host_mem_gib,
             "default_mem_mib": int(machine.host_mem_gib * 1024 * LOCAL_MEM_SHARE)}
    out = dict(raw)
    for key in auto:
        if key not in known:
            raise ConfigError(f"{path}: partitions.{name}.{key}: 'auto' is not supported for this key")
        out[key] = known[key]
    return out


MAX_GPU_MEM_GIB = 1024
"""GPU memory per GPU, GiB: 1 TiB (the largest GPUs have 192 GB)."""
MAX_HOST_MEM_GIB = 64 * 1024
"""Host memory per node, GiB: 64 TiB (the largest shared-memory nodes have 32 TB)."""
MAX_NVME_GIB = 1024 * 1024
"""Node-local scratch, GiB: 1 PiB."""
MAX_CONTEXT_MIB = 64 * 1024
"""CUDA context per process, MiB: 64 GiB (real ones are 300-1500 MiB)."""
MAX_GPUS_PER_NODE = 4096
"""GPUs per node (Plan's own bound on ranks per node)."""
MAX_CPUS_PER_NODE = 65536
"""CPUs per node (the largest shared-memory nodes have a few thousand)."""


@dataclass(frozen=True)
class Bound:
    """The range a size must lie in: ``least`` (excluded when ``above``) to ``most`` (excluded when ``below``)."""

    least: float
    most: float
    above: bool = False
    below: bool = False
    integer: bool = False
    unit: str = ""

    def holds(self, value) -> bool:
        kinds = int if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return False
        if not math.isfinite(value):
            return False
        low_ok = value > self.least if self.above else value >= self.least
        high_ok = value < self.most if self.below else value <= self.most
        return low_ok and high_ok

    def words(self) -> str:
        kind = "a whole number" if self.integer else "a number"
        low = f"above {_num(self.least)}" if self.above else f"from {_num(self.least)}"
        joint = "and" if self.above else "to"
        high = f"{joint} {'below' if self.below else 'at most' if self.above else ''} {_num(self.most)}".replace("  ", " ")
        return f"{kind} {low} {high}" + (f" ({self.unit})" if self.unit else "")


def _num(value: float) -> str:
    """A bound or size as a person writes it: 65536, 19.5, 1e+308."""
    if isinstance(value, int):
        return str(value)
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


SIZE_BOUNDS = {
    "gpu_mem_gib": Bound(0, MAX_GPU_MEM_GIB, unit="GiB per GPU"),
    "host_mem_gib": Bound(0, MAX_HOST_MEM_GIB, above=True, unit="GiB per node"),
    "nvme_gib": Bound(0, MAX_NVME_GIB, unit="GiB"),
    "cuda_context_mib": Bound(0, MAX_CONTEXT_MIB, unit="MiB per process"),
    "gpus_per_node": Bound(0, MAX_GPUS_PER_NODE, integer=True),
    "cpus_per_node": Bound(1, MAX_CPUS_PER_NODE, integer=True),
    "default_mem_mib": Bound(1, MAX_HOST_MEM_GIB * 1024, integer=True, unit="MiB"),
}
"""Every size a site profile states -> its range: finite, far above any real hardware, so that no size drives the
estimator's arithmetic to inf or NaN and none reaches an ``#SBATCH`` line absurd."""
GPU_MEM_BOUND = Bound(0, MAX_GPU_MEM_GIB, above=True, unit="GiB per GPU")
"""A GPU partition's GPU memory: above 0."""


def _out_of_range(where: str, key: str, value, bound: Bound, why: str = "") -> ConfigError:
    shown = _num(value) if _number(value) else _clip(value)
    return ConfigError(f"{where}.{key}: {shown} is out of range: expected {bound.words()}{why}")


def check_sizes(raw: dict, where: str) -> None:
    """The sizes a site profile states, each within ``SIZE_BOUNDS`` (``auto`` values are this machine's, not
    checked): a GPU partition's GPU memory above 0, its CUDA context below that memory, ``default_mem_mib``
    within the node's memory. Each problem is one ConfigError naming the file and key."""
    gpus = raw.get("gpus_per_node")
    gpu = _number(gpus) and gpus > 0
    for key, bound in SIZE_BOUNDS.items():
        value = raw.get(key)
        if value is None or value == "auto":
            continue
        why = ""
        if key == "gpu_mem_gib" and gpu:
            bound, why = GPU_MEM_BOUND, " on a GPU partition"
        host = raw.get("host_mem_gib")
        if key == "default_mem_mib" and _number(host) and SIZE_BOUNDS["host_mem_gib"].holds(host):
            bound = dataclasses.replace(bound, most=math.floor(host * 1024))
            why = f", the node's memory at most (host_mem_gib: {_num(host)})"
        if not bound.holds(value):
            raise _out_of_range(where, key, value, bound, why)
    context, memory = raw.get("cuda_context_mib"), raw.get("gpu_mem_gib")
    if gpu and _number(memory) and _number(context) and context >= memory * 1024:
        raise ConfigError(f"{where}.cuda_context_mib: {_num(context)} MiB is not below the GPU's memory "
                          f"(gpu_mem_gib: {_num(memory)} GiB)")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


CAPABILITIES = ("fp16", "bf16", "tf32", "flash_attention")

_NAME = re.compile(r"[A-Za-z0-9_.+-]+", re.ASCII)
_SLURM_NAMES = re.compile(r"[A-Za-z0-9_.+-]+(?:,[A-Za-z0-9_.+-]+)*", re.ASCII)
_CONSTRAINT = re.compile(r"[A-Za-z0-9_.+\-&|\[\]*(),!:]+", re.ASCII)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
FIELD_FORMS = {"slurm_partition": (_SLURM_NAMES, "partition names (letters, digits, _ . + -), comma-separated"),
               "account": (_NAME, "letters, digits, _ . + -"), "qos": (_NAME, "letters, digits, _ . + -"),
               "gres_type": (_NAME, "letters, digits, _ . + -"),
               "constraint": (_CONSTRAINT, "Slurm features joined by & | , * [ ] ( ) !")}
"""Site fields that reach ``#SBATCH`` lines -> (the form they must have, said in words)."""


def check_fields(raw: dict, where: str) -> None:
    """Every site field that reaches the job script, checked: the ``#SBATCH`` values against the Slurm name forms
    (``FIELD_FORMS``), env names as shell identifiers, and no control character (a newline above all) in env values,
    paths, descriptions or setup lines. Setup lines are shell by design (the site administrator's module loads);
    each must be one line."""
    for key, (form, words) in FIELD_FORMS.items():
        value = raw.get(key)
        if value is not None and not (isinstance(value, str) and form.fullmatch(value)):
            raise ConfigError(f"{where}.{key}: {value!r} is not a valid value ({words})")
    for key in ("nvme_path", "gpu_model", "description"):
        value = raw.get(key)
        if isinstance(value, str) and _CONTROL.search(value):
            raise ConfigError(f"{where}.{key}: {value!r} holds a control character (a newline?)")
    for i, line in enumerate(raw.get("setup", ())):
        if _CONTROL.search(line.replace("\t", " ")):
            raise ConfigError(f"{where}.setup.{i}: {line!r}: one shell line each, without control characters")
    for name, value in (raw.get("env") or {}).items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"{where}.env: {name!r} is not a valid environment variable name")
        refused = reserved_env(name)
        if refused:
            raise ConfigError(f"{where}.env.{name}: {refused}")
        if _CONTROL.search(str(value)):
            raise ConfigError(f"{where}.env.{name}: {str(value)!r} holds a control character (a newline?)")


SCRIPT_ENV = {
    "HPCMEM_PLAN": "the attempt's plan.json", "HPCMEM_ATTEMPT_DIR": "the attempt's directory",
    "HPCMEM_CHECKPOINT_DIR": "the run's checkpoints", "HPCMEM_GPU_MEM_GIB": "the partition's gpu_mem_gib",
    "HPCMEM_DS_CONFIG": "the attempt's ds_config.json", "HPCMEM_FSDP_CONFIG": "the attempt's fsdp_config.json",
    "PYTHONUNBUFFERED": "the job's log is read while it runs",
    "MASTER_PORT": "a rendezvous port per job", "SLURM_JOB_ID": "set by Slurm, read by the job script",
    "SLURM_JOB_NODELIST": "set by Slurm, read by the job script",
}
"""Environment variables the job script itself exports (``render.job_env``, the templates) or reads -> what they carry.
A site's or spec's ``env`` is exported after hpcmem's own, so none of these may be set there
(``sites.reserved_env``): it would silently override hpcmem's value. Other ``HPCMEM_*`` names are the runtime's
knobs for users (``HPCMEM_MEMORY_HISTORY``, ``HPCMEM_TEARDOWN_TIMEOUT_S``, ...) and may be set.
``PYTORCH_CUDA_ALLOC_CONF`` may be set too (a site's default allocator settings): the plan's ``alloc_conf``,
when it has one, is exported after the site's and spec's and wins. The templates set no ``PATH``,
``LD_LIBRARY_PATH`` or ``PYTHONPATH``: those are the job's to set."""


def reserved_env(name: str) -> str | None:
    """Why a site profile or job spec may not set the environment variable ``name`` (None: it may). The job script
    exports hpcmem's own variables first and the site's and spec's after them, so one of ``SCRIPT_ENV`` would
    silently override what hpcmem set. ``PATH``, ``LD_LIBRARY_PATH`` and ``PYTHONPATH`` are the job's own (the
    script sets none of them)."""
    if name in SCRIPT_ENV:
        return f"hpcmem sets {name} in the job script itself ({SCRIPT_ENV[name]}); remove it here"
    return None


def capabilities(gpu_model: str | None, where: str) -> tuple[bool, bool, bool, bool]:
    """(fp16, bf16, tf32, flash_attention) for a GPU model. A CPU (None) runs bf16 everywhere (PyTorch has
    reference kernels; DeepSpeed's CPU accelerator accepts it) and is taken to run fp16 until calibration
    measures that it cannot (the runtime then falls back and says so in metrics.json)."""
    if gpu_model is None:
        return True, True, False, False
    upper = gpu_model.upper()
    for family, bf16, tf32, flash in GPU_FAMILIES:
        if family in upper:
            return True, bf16, tf32, flash
    raise ConfigError(f"{where}: gpu_model {gpu_model!r} is not a GPU hpcmem knows; "
                      "state its capabilities: {fp16: ..., bf16: ..., tf32: ..., flash_attention: ...}")


_TIME = re.compile(r"(?:([0-9]{1,3})-)?([0-9]{1,5}):([0-9][0-9])(?::([0-9][0-9]))?", re.ASCII)
MAX_TIME_MIN = 366 * 1440
"""The longest time limit taken (a year): beyond any partition's, and Plan.time_min's bound."""


def parse_minutes(text: str, where: str = "") -> int:
    """Slurm ``[D-]HH:MM[:SS]`` as whole minutes (seconds round up). Minutes and seconds are 00-59 and,
    after a day count, hours 00-23: ``00:99:99`` is a typo, not 01:40:39. ``where`` (``FILE: key``) starts
    every error, so that it names the file and key the time came from."""
    label = f"{where}:" if where else "time"
    if not isinstance(text, str):
        raise ConfigError(f"{label} {_clip(text)}: expected [D-]HH:MM[:SS] as text")
    m = _TIME.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"{label} {text[:40]!r}: expected [D-]HH:MM[:SS]")
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    if minutes > 59 or seconds > 59 or (m.group(1) and hours > 23):
        raise ConfigError(f"{label} {text!r}: minutes and seconds go to 59 (and hours to 23 after a day count)")
    total = days * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    if not 1 <= total <= MAX_TIME_MIN:
        raise ConfigError(f"{label} {text!r}: must be between 00:01:00 and {MAX_TIME_MIN // 1440}-00:00:00")
    return total


def format_minutes(minutes: int) -> str:
    """Minutes as Slurm ``[D-]HH:MM:SS``."""
    days, rest = divmod(int(minutes), 1440)
    text = f"{rest // 60:02d}:{rest % 60:02d}:00"
    return f"{days}-{text}" if days else text


def site_record(site: Site, partition: Partition | None = None) -> dict:
    """The site as resolved at submission, JSON-ready: every partition with its ``auto`` values filled in and its
    calibration applied (``partition``, when given, is the one the run uses, as used). A run records it
    (``runs/<id>/site.json``) so that its later attempts are planned from it, not from the site file."""
    parts = {**site.partitions, **({partition.name: partition} if partition else {})}
    return {"site": site.name, "scheduler": site.scheduler, "path": str(site.path), "description": site.description,
            "partitions": {name: dataclasses.asdict(p) for name, p in parts.items()}}


def _check_recorded_sizes(raw: dict, where: str) -> None:
    """A recorded partition's sizes within the bounds a site profile's are held to (a hand-edited site.json)."""
    check_sizes(raw, where)
    limits = {"max_time_min": Bound(1, MAX_TIME_MIN, integer=True, unit="minutes"),
              "allocator_overhead_frac": _measured_bounds()["allocator_overhead_frac"]}
    for key, bound in limits.items():
        if raw.get(key) is not None and not bound.holds(raw[key]):
            raise _out_of_range(where, key, raw[key], bound)


def site_from_record(data, where: str) -> Site:
    """A Site from ``site_record``'s data; anything else (a missing or unknown field) is a ConfigError naming
    ``where``."""
    names = {f.name for f in dataclasses.fields(Partition)}
    try:
        parts = {}
        for name, raw in data["partitions"].items():
            unknown = sorted(set(raw) - names)
            if unknown:
                raise ValueError(f"partition {name}: unknown field {unknown[0]!r}")
            _check_recorded_sizes(raw, f"{where}: partitions.{name}")
            parts[name] = Partition(**{**raw, "setup": tuple(raw.get("setup", ())),
                                       "env": tuple((str(k), str(v)) for k, v in raw.get("env", ()))})
        return Site(str(data["site"]), str(data["scheduler"]), Path(data["path"]), parts, data.get("description", ""))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{where}: not a recorded site profile ({type(exc).__name__}: {exc})") from None
