"""Job specs: what the user wants to train (``jobs/<name>.yaml``).

A spec names the command (a module or script, its arguments), the launcher and
shape (nodes, ranks per node, time), the model (for estimation) and the training
settings, from which the first Plan of a run is made. A spec is found by path,
or by name among the shipped ``jobs/`` (so ``hpcmem submit quickstart`` works from
any install).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import optimizers
from .errors import ConfigError, PlanError, UnknownNameError
from .plan import LIMITS, Plan, with_changes
from .resources import data_dir
from .schema import load_schema, load_yaml, validate
from .sites import Partition, parse_minutes, reserved_env

DEFAULT_ALLOW = ("alloc_conf", "precision", "attention", "micro_batch", "checkpointing", "zero", "fsdp", "offload", "nvme",
                 "mem", "workers")
"""Retry moves allowed when a spec says nothing: all that keep what is learned and the resources asked."""
DEFAULT_MAX_ATTEMPTS = 6
DEFAULT_RESUME = {"TIMEOUT": 1, "PREEMPTED": 1}
"""One resume each after a time limit or a preemption, when the attempt left a newer checkpoint (docs/resume.md)."""

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
PATH_PLACEHOLDERS = ("plan_json", "config", "ds_config", "attempt_dir", "spec_dir", "checkpoint_dir")
"""{config} is the engine's config file (ds_config.json, fsdp_config.json); {ds_config} its older name."""
SCRIPT_RUNNER = Path(__file__).resolve().parent / "runtime" / "run_script.py"
"""Starts a user's script in the job (by path: it imports nothing of hpcmem, so any ``command.python`` runs it)."""


@dataclass(frozen=True)
class JobSpec:
    """A loaded, checked job spec."""

    name: str
    path: Path
    module: str | None
    script: Path | None
    args: tuple[str, ...]
    plan_args: str
    python: str | None
    training: Mapping[str, Any]
    launcher: str = "torchrun"
    nodes: int = 1
    gpus_per_node: int = 1
    time_min: int = 30
    mem_mib: int | None = None
    model: Mapping[str, Any] = field(default_factory=dict)
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    allow: tuple[str, ...] = DEFAULT_ALLOW
    retry_transient: bool = False
    resume: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_RESUME))
    """Scheduler endings answered by resubmitting the same plan to resume from the run's checkpoint, and how
    many times each (``retry.resume``); never counted against the OOM ladder's attempts."""
    env: tuple[tuple[str, str], ...] = ()
    description: str = ""
    inflight: bool = True
    """In-job recovery from an OOM (``retry.inflight``, docs/resume.md): on by default; off, the job's environment
    gets ``HPCMEM_INFLIGHT=0`` (before the spec's own ``env``), which the reference trainer and the runtime read."""

    @property
    def spec_dir(self) -> Path:
        return self.path.parent

    def first_plan(self, partition: Partition, overrides: Mapping[str, Any] | None = None) -> Plan:
        """The plan of attempt 1: the spec's settings, then ``--set`` overrides, checked against the partition."""
        t = dict(self.training)
        base = {
            "launcher": self.launcher, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
            "global_batch": t["global_batch"], "seq_len": t.get("seq_len", 128), "time_min": self.time_min,
            "mem_mib": self.mem_mib,
            **{k: t[k] for k in ("precision", "optimizer", "checkpointing", "attention", "zero_stage",
                                 "offload_optimizer", "offload_params", "reshard_after_forward", "reduce_dtype", "alloc_conf",
                                 "workers") if k in t},
        }
        world = base["nodes"] * base["gpus_per_node"]
        micro = t.get("micro_batch", max(1, t["global_batch"] // world))
        base["micro_batch"] = micro
        if t["global_batch"] % (micro * world):
            raise PlanError(f"{self.path}: training.global_batch {t['global_batch']} is not a multiple of "
                            f"micro_batch {micro} x world_size {world}")
        base["grad_accum"] = t["global_batch"] // (micro * world)
        try:
            plan = Plan(**base)
        except PlanError as exc:  # the spec's own settings do not make a plan: say which file
            raise PlanError(f"{self.path}: {exc}") from None
        plan = with_changes(plan, overrides or {})
        partition.check_plan(plan)
        return plan

    def argv(self, plan: Plan, paths: Mapping[str, str]) -> list[str]:
        """The user's program and arguments for one attempt, placeholders filled in: what follows ``python`` (or
        the launcher) on the job's command line.

        ``paths`` gives ``plan_json``, ``config`` (and ``ds_config``), ``attempt_dir`` (absolute paths).
        A script (``command.script``) is started through ``toolkit/runtime/run_script.py`` (``SCRIPT_RUNNER``),
        which runs it as ``python SCRIPT`` would and then tears torch.distributed down cleanly; a module
        (``command.module``) is started as ``-m MODULE`` (``toolkit.train`` tears down itself).
        """
        values = {**{k: _text(v) for k, v in plan.to_dict().items()}, **paths, "spec_dir": str(self.spec_dir)}
        args = [fill_placeholders(a, values, self.path) for a in self.args]
        if self.plan_args == "hf-trainer":
            args += hf_trainer_args(plan, paths.get("config") or None)
        head = ["-m", self.module] if self.module else [str(SCRIPT_RUNNER), str(self.script)]
        return head + args


def inflight_env(on: bool) -> tuple[tuple[str, str], ...]:
    """What the job's environment needs for ``retry.inflight``: nothing when on (the runtime's default), else
    ``HPCMEM_INFLIGHT=0``."""
    from .runtime.inflight import ENV_INFLIGHT

    return () if on else ((ENV_INFLIGHT, "0"),)


def fill_placeholders(text: str, values: Mapping[str, str], where: Path | str) -> str:
    """Replace ``{name}`` by its value; an unknown name is an error naming it."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ConfigError(f"{where}: command.args: unknown placeholder {{{m.group(1)}}} "
                              f"(valid: {', '.join(sorted(values))})")
        return values[m.group(1)]
    return _PLACEHOLDER.sub(sub, text)


def hf_trainer_args(plan: Plan, config: str | None) -> list[str]:
    """Hugging Face Trainer command-line flags that carry the plan (``config``: the engine's config file)."""
    args = ["--per_device_train_batch_size", str(plan.micro_batch),
            "--gradient_accumulation_steps", str(plan.grad_accum),
            "--optim", optimizers.hf_optim(plan.optimizer)]
    if plan.checkpointing and not plan.strategy.checkpointing_by_config:
        args.append("--gradient_checkpointing")
    if plan.precision == "fp16-mixed":
        args.append("--fp16")
    elif plan.precision.startswith("bf16"):
        args.append("--bf16")
    return args + plan.strategy.trainer_flags(plan, config)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


SPEC_KNOBS = {"nodes": "nodes", "gpus_per_node": "gpus_per_node", "mem_mib": "mem_mib",
              "training.global_batch": "global_batch", "training.micro_batch": "micro_batch",
              "training.seq_len": "seq_len", "training.workers": "workers"}
"""Spec keys -> the Plan knob each becomes, checked against the knob's bounds (``plan.LIMITS``) at load time."""


def _check_knob_bounds(doc: dict, path: Path) -> None:
    """Refuse, at load time and by the key the spec wrote, a number outside its Plan knob's bounds (a
    ``global_batch`` of 2**62 is a typo, and would otherwise be refused later without the file's name)."""
    for key, knob in SPEC_KNOBS.items():
        section, _, name = key.rpartition(".")
        holder = doc.get(section) if section else doc
        value = holder.get(name) if isinstance(holder, dict) else None
        if value is None or isinstance(value, bool) or not isinstance(value, int):
            continue  # absent (or a type the schema has already refused)
        least, most = LIMITS[knob]
        if not least <= value <= most:
            raise ConfigError(f"{path}: {key}: must be from {least} to {most}, got {value}")
    training = doc.get("training") or {}
    micro, total = training.get("micro_batch"), training.get("global_batch")
    if isinstance(micro, int) and isinstance(total, int) and micro > total:
        raise ConfigError(f"{path}: training.micro_batch: {micro} is more than training.global_batch {total}")


def _check_env_names(doc: dict, path: Path) -> None:
    """Refuse a spec ``env`` name hpcmem sets in the job script itself (``sites.reserved_env``): it is exported
    after hpcmem's own and would silently override them."""
    for name in doc.get("env") or {}:
        if not isinstance(name, str):
            continue  # _check_text_fields names it
        refused = reserved_env(name)
        if refused:
            raise ConfigError(f"{path}: env.{name}: {refused}")


def _check_text_fields(spec: JobSpec, path: Path) -> None:
    """Refuse, at load time (before a run is recorded), what cannot reach a job script safely: an env name that is
    not a shell identifier, a control character (a newline above all) in an env value, an argument, the
    interpreter, the script path or the job's name. Values are shell-quoted when rendered; this keeps each one
    line, so the script reads as written."""
    for name, value in spec.env:
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"{path}: env: {str(name)[:80]!r} is not a valid environment variable name")
        if _CONTROL.search(value):
            raise ConfigError(f"{path}: env.{name}: {value[:80]!r} holds a control character (a newline?)")
    fields = [("name", spec.name), ("command.python", spec.python or ""), ("command.module", spec.module or ""),
              ("command.script", str(spec.script or "")), ("training.alloc_conf", str(spec.training.get("alloc_conf", "")))]
    fields += [(f"command.args.{i}", a) for i, a in enumerate(spec.args)]
    for key, value in fields:
        if _CONTROL.search(value):
            raise ConfigError(f"{path}: {key}: {value[:80]!r} holds a control character (a newline?)")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def find_spec(ref: str | Path) -> Path:
    """A spec by path, or by name among the shipped jobs (``quickstart`` -> jobs/quickstart.yaml)."""
    path = Path(ref)
    if path.is_file():
        return path
    shipped = data_dir("jobs")
    for candidate in (shipped / f"{ref}.yaml", shipped / str(ref)):
        if candidate.is_file():
            return candidate
    if path.suffix in (".yaml", ".yml") or "/" in str(ref):
        raise ConfigError(f"{ref}: no such job spec file")
    raise UnknownNameError("job spec", str(ref), [p.stem for p in shipped.glob("*.yaml")])


def load_spec(ref: str | Path) -> JobSpec:
    """Load and check a job spec."""
    path = find_spec(ref).resolve()
    doc = load_yaml(path)
    validate(doc, load_schema(data_dir("jobs") / "schema.json"), str(path))
    _check_knob_bounds(doc, path)
    cmd = doc["command"]
    if ("module" in cmd) == ("script" in cmd):
        raise ConfigError(f"{path}: command: give exactly one of module or script")
    script = None
    if "script" in cmd:
        script = Path(cmd["script"])
        script = script if script.is_absolute() else (path.parent / script)
    retry = doc.get("retry", {})
    spec = JobSpec(
        name=doc["name"], path=path, module=cmd.get("module"), script=script,
        args=tuple(str(a) if not isinstance(a, bool) else _text(a) for a in cmd.get("args", ())),
        plan_args=cmd.get("plan_args", "none"), python=cmd.get("python"), training=doc["training"],
        launcher=doc.get("launcher", "torchrun"), nodes=doc.get("nodes", 1), gpus_per_node=doc.get("gpus_per_node", 1),
        time_min=parse_minutes(doc.get("time", "00:30:00"), f"{path}: time"), mem_mib=doc.get("mem_mib"), model=doc.get("model", {}),
        max_attempts=retry.get("max_attempts", DEFAULT_MAX_ATTEMPTS), allow=tuple(retry.get("allow", DEFAULT_ALLOW)),
        retry_transient=retry.get("retry_transient", False), resume={**DEFAULT_RESUME, **retry.get("resume", {})},
        env=inflight_env(retry.get("inflight", True)) + tuple((k, _text(v)) for k, v in doc.get("env", {}).items()),
        description=doc.get("description", ""), inflight=retry.get("inflight", True),
    )
    _check_text_fields(spec, path)
    _check_env_names(doc, path)
    for arg in spec.args:  # an unknown placeholder is a spec error, found at load time
        fill_placeholders(arg, {k: "" for k in (*Plan().to_dict(), *PATH_PLACEHOLDERS)}, path)
    return spec
