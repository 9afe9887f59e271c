"""Render one attempt: plan + spec + partition -> job.sbatch, plan.json and the engine's config file
(ds_config.json for DeepSpeed, fsdp_config.json for FSDP).

Python decides everything here (``job_context`` is pure); the templates only lay
the values out. Every value that reaches a shell line goes through the ``q``
filter (``shlex.quote``); ``#SBATCH`` values are checked by ``sbatch_value``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .errors import ConfigError, HpcmemError, RenderError
from .modelshape import largest_param_numel
from .models import load_model_config
from .jobspec import JobSpec, fill_placeholders
from .plan import Plan
from .sites import SCRIPT_ENV, Partition, format_minutes
from .templating import render_template

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._+-]")


@dataclass(frozen=True)
class Attempt:
    """Where one rendered attempt lives."""

    dir: Path
    script: Path
    plan_json: Path
    config: Path | None
    """the engine's config file (ds_config.json, fsdp_config.json), None when it has none"""


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""Control characters (C0, DEL, C1, Unicode line separators): none may reach a job script, quoted or not."""


def sbatch_value(value: Any) -> str:
    """A value for an ``#SBATCH`` line: sbatch reads these itself, so no control characters (a newline would end
    the comment and start a shell line), no quotes, no ``#``."""
    text = str(value)
    if _CONTROL.search(text) or any(c in text for c in "\"'`$\\#") or not text.strip():
        raise RenderError(f"value {text[:80]!r} cannot go on an #SBATCH line (control character, quote, $, `, \\, # "
                          "or empty)")
    return shlex.quote(text) if re.search(r"\s", text) else text


def check_context(context: Any, key: str = "") -> None:
    """Refuse a job-script context holding a control character anywhere (every string, however deep).

    Values reach the script quoted (``q``), on ``#SBATCH`` lines (``sbatch_value``) or in comments (the plan
    summary, the config path); a newline in any of them would start a new shell line. Checking every value
    here, rather than the ones thought of, keeps a new value from becoming a new hole. Site ``setup`` lines are
    shell by design (the site administrator's) and pass through, one line each."""
    if isinstance(context, str):
        bad = _CONTROL.search(context)
        if bad:
            raise RenderError(f"{key or 'value'}: {context[:80]!r} holds a control character ({bad.group()!r}): "
                              "it cannot go into a job script")
    elif isinstance(context, dict):
        for name, value in context.items():
            check_context(value, f"{key}.{name}" if key else str(name))
    elif isinstance(context, (list, tuple)):
        for i, value in enumerate(context):
            check_context(value, f"{key}[{i}]")


def job_name(name: str, run_id: str = "", attempt: int = 0) -> str:
    """The Slurm job name: ``<spec name>.<run id>.a<n>``, unique per attempt (the controller finds a job
    by it after a crash), with anything but [A-Za-z0-9._+-] replaced by '_'."""
    safe = _SAFE_NAME.sub("_", name)[:80] or "hpcmem"
    return f"{safe}.{run_id}.a{attempt}" if run_id else safe


def directives(spec: JobSpec, partition: Partition, plan: Plan, attempt_dir: Path, run_id: str = "",
               attempt: int = 0) -> list[str]:
    """The ``#SBATCH`` options of an attempt, in order."""
    out = [f"--job-name={job_name(spec.name, run_id, attempt)}",
           f"--partition={sbatch_value(partition.slurm_partition)}",
           f"--nodes={plan.nodes}",
           "--ntasks-per-node=1",
           f"--cpus-per-task={cpus_per_task(partition, plan)}",
           f"--time={format_minutes(plan.time_min)}",
           f"--output={sbatch_value(slurm_pattern_dir(attempt_dir) + '/slurm-%j.out')}",
           f"--signal=B:USR1@{time_limit_warning_s(plan)}"]
    if partition.has_gpu:
        gres = f"{partition.gres_type}:{plan.gpus_per_node}" if partition.gres_type else str(plan.gpus_per_node)
        out.append(f"--gpus-per-node={sbatch_value(gres)}")
    mem = plan.mem_mib or partition.default_mem_mib
    if mem:
        out.append(f"--mem={mem}M")
    for flag, value in (("account", partition.account), ("qos", partition.qos), ("constraint", partition.constraint)):
        if value:
            out.append(f"--{flag}={sbatch_value(value)}")
    return out


def slurm_pattern_dir(directory: Path) -> str:
    """A directory for the start of an sbatch file name pattern (``--output``, ``--error``): Slurm expands
    ``%j``, ``%x``, ``%u``, ... anywhere in the pattern, so each ``%`` of the directory is written ``%%`` (a literal
    ``%``); hpcmem's own placeholders (``slurm-%j.out``) follow it unescaped."""
    return str(directory).replace("%", "%%")


def time_limit_warning_s(plan: Plan) -> int:
    """Seconds before the time limit at which Slurm sends USR1 to the batch shell (``--signal=B:USR1@...``), which
    asks the trainer for a save (templates/launch.sbatch.j2): the runtime's own margin for the plan's limit
    (``checkpoint.margin_s``: 10% of it, within 20-300 s)."""
    import math

    from .runtime.checkpoint import margin_s

    return int(math.ceil(margin_s(60.0 * plan.time_min)))


def cpus_per_task(partition: Partition, plan: Plan) -> int:
    """CPUs for the one task per node: the GPUs' share of the node, or one per rank on a CPU partition."""
    if partition.has_gpu:
        return max(1, partition.cpus_per_node * plan.gpus_per_node // partition.gpus_per_node)
    return min(partition.cpus_per_node, max(1, plan.gpus_per_node + plan.workers * plan.gpus_per_node))


def job_env(spec: JobSpec, partition: Partition, plan: Plan, paths: dict[str, str]) -> list[tuple[str, str]]:
    """Environment variables exported by the script, in order (later wins). hpcmem's own come first; the
    site's and spec's after them may not name any of them (refused at load; checked again here, so a
    recorded site or a spec built in code cannot override them either); the plan's ``alloc_conf`` comes last,
    over a site's default ``PYTORCH_CUDA_ALLOC_CONF``."""
    env = [("HPCMEM_PLAN", paths["plan_json"]), ("HPCMEM_ATTEMPT_DIR", paths["attempt_dir"]),
           ("HPCMEM_CHECKPOINT_DIR", paths["checkpoint_dir"]), ("PYTHONUNBUFFERED", "1")]
    if plan.strategy.env_var:
        env.append((plan.strategy.env_var, paths["config"]))
    if partition.has_gpu:
        env.append(("HPCMEM_GPU_MEM_GIB", f"{partition.gpu_mem_gib:g}"))
    for name, _ in env:
        if name not in SCRIPT_ENV:
            raise RenderError(f"environment variable {name} is exported by hpcmem but missing from sites.SCRIPT_ENV")
    for source, pairs in ((f"partition {partition.site}:{partition.name}", partition.env), (str(spec.path), spec.env)):
        for name, _ in pairs:
            if name in SCRIPT_ENV:
                raise RenderError(f"{source}: env.{name}: hpcmem sets {name} in the job script itself "
                                  f"({SCRIPT_ENV[name]})")
    env += list(partition.env) + list(spec.env)
    if plan.alloc_conf:  # after a site's default allocator settings: the plan's (a remedy's) win
        env.append(("PYTORCH_CUDA_ALLOC_CONF", plan.alloc_conf))
    for name, _ in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise RenderError(f"environment variable name {name!r} is not valid")
    return env


def job_context(spec: JobSpec, partition: Partition, plan: Plan, attempt_dir: Path, *, run_id: str = "-",
                attempt: int = 1, workdir: Path | None = None, python: str | None = None) -> dict[str, Any]:
    """Everything the templates need, computed (pure)."""
    attempt_dir = resolved(attempt_dir)
    paths = attempt_paths(plan, attempt_dir)
    program = spec.argv(plan, paths)
    engine = plan.strategy
    context = {
        "version": __version__, "site": partition.site, "partition": partition.name, "run_id": run_id,
        "attempt": attempt, "plan_summary": plan_summary(plan),
        "directives": directives(spec, partition, plan, attempt_dir, "" if run_id == "-" else run_id, attempt),
        "setup": list(partition.setup), "env": job_env(spec, partition, plan, paths),
        "workdir": str(workdir or Path.cwd()), "python": python or spec.python or sys.executable,
        "nodes": plan.nodes, "nproc_per_node": plan.gpus_per_node, "program": program,
        "engine": engine.describe(plan), "config": paths["config"] if engine.config_file else "",
        **engine.context(plan, partition),
    }
    check_context(context)
    return context


def attempt_paths(plan: Plan, attempt_dir: Path) -> dict[str, str]:
    """The files of an attempt a job and its arguments name (absolute): ``plan_json``, ``attempt_dir``,
    ``config`` (the engine's config file, "" when it has none) and its old name ``ds_config``, and
    ``checkpoint_dir``: the run's, shared by every attempt (docs/resume.md)."""
    config = str(attempt_dir / plan.strategy.config_file) if plan.strategy.config_file else ""
    return {"plan_json": str(attempt_dir / "plan.json"), "attempt_dir": str(attempt_dir), "config": config,
            "ds_config": str(attempt_dir / "ds_config.json"), "checkpoint_dir": str(checkpoint_dir(attempt_dir))}


def checkpoint_dir(attempt_dir: Path) -> Path:
    """The checkpoint directory every attempt of a run shares: ``runs/<id>/checkpoints`` beside the attempt
    directories (``runs/<id>/attempt-<n>``); an attempt rendered on its own (``hpcmem render -o DIR``) keeps its
    checkpoints in ``DIR/checkpoints``."""
    attempt_dir = Path(attempt_dir)
    if re.fullmatch(r"attempt-\d+", attempt_dir.name):
        return attempt_dir.parent / "checkpoints"
    return attempt_dir / "checkpoints"


def plan_summary(plan: Plan) -> str:
    """The plan in one line, for status lines and script headers."""
    parts = [f"{plan.launcher} {plan.nodes}x{plan.gpus_per_node}", f"mb={plan.micro_batch}x{plan.grad_accum}",
             f"gb={plan.global_batch}", plan.precision, plan.optimizer, plan.attention]
    if plan.checkpointing:
        parts.append("ckpt")
    parts += plan.strategy.summary(plan)
    if plan.alloc_conf:
        parts.append(f"alloc={plan.alloc_conf}")
    if plan.mem_mib:
        parts.append(f"mem={plan.mem_mib}M")
    return " ".join(parts)


def render_script(launcher: str, context: dict[str, Any]) -> str:
    """The job script text for a launcher (its strategy's template)."""
    from .strategies import get

    return render_template(get(launcher).template, **context).rstrip("\n") + "\n"


def render_attempt(spec: JobSpec, partition: Partition, plan: Plan, attempt_dir: Path, **context_args) -> Attempt:
    """Write job.sbatch, plan.json and the engine's config file into ``attempt_dir``.

    All or nothing: everything is rendered, and every file's place checked (a directory or other non-file where
    a file goes is refused), before anything is written; the files are then written to temporary names and
    renamed into place together, so a refusal or a failed write leaves no new file (and no directory hpcmem
    created) behind."""
    attempt_dir = resolved(attempt_dir)
    partition.check_plan(plan)
    check_program(spec)
    # everything is decided and rendered before the directory exists: a refusal leaves nothing behind
    context = job_context(spec, partition, plan, attempt_dir, **context_args)
    cfg = plan.strategy.config(plan, nvme_path=partition.nvme_path, gpu=partition.has_gpu,
                               largest_param=largest_param(spec))
    text = render_script(plan.launcher, context)
    check_syntax(text)
    config_path = attempt_dir / plan.strategy.config_file if cfg is not None else None
    script = attempt_dir / "job.sbatch"
    files = [(attempt_dir / "plan.json", plan.to_json(), None), (script, text, 0o755)]
    if cfg is not None:
        files.insert(0, (config_path, json.dumps(cfg, indent=2, sort_keys=True) + "\n", None))
    for path, _, _ in files:
        check_file_place(path)
    created = make_dirs(attempt_dir)
    write_all(files, attempt_dir, created)
    return Attempt(attempt_dir, script, attempt_dir / "plan.json", config_path)


def check_file_place(path: Path) -> None:
    """Refuse to write ``path`` where something other than a regular file (or a symlink, which is replaced) is:
    a directory, a FIFO, a socket or a device. One ConfigError naming it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:  # a file where a parent directory should be: make_dirs says so
            return
        raise ConfigError(f"{path}: cannot look at the file: {exc.strerror or exc}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise ConfigError(f"{path}: {what} is in the way; nothing was written (remove it or choose another -o)")


def write_all(files: list[tuple[Path, str, int | None]], attempt_dir: Path, created: list[Path]) -> None:
    """Write each (path, text, mode) to a synced temporary file beside it, then rename them all into place; on
    any failure the temporary files and the directories ``make_dirs`` created are removed (a ConfigError)."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, text, mode in files:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as out:
                os.fchmod(out.fileno(), mode if mode is not None else 0o666 & ~_umask())
                out.write(text.encode())
                out.flush()
                os.fsync(out.fileno())
        for tmp, path in staged:
            os.replace(tmp, path)
    except BaseException as exc:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        remove_created(created)
        if isinstance(exc, OSError):
            raise ConfigError(f"{attempt_dir}: cannot write the attempt's files: {exc.strerror or exc}") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_syntax(text: str) -> None:
    """Refuse a job script ``bash -n`` would refuse: every value is quoted or checked, so what can still break it
    is a site's ``setup`` lines (shell by design, e.g. an unbalanced quote). Found here, at render time, not by
    a job that fails on its first line after waiting in the queue. Skipped where there is no bash."""
    from .proc import CommandNotFoundError, run

    try:
        done = run(["bash", "-n"], input=text, timeout=30, check=False)
    except CommandNotFoundError:
        return
    if done.returncode != 0:
        problem = (done.stderr.strip().splitlines() or ["a syntax error"])[-1]
        raise RenderError(f"the job script would not parse (bash -n: {problem[:200]}); look at the site's setup lines")


def resolved(path) -> Path:
    """``path`` made absolute with symlinks resolved; a symlink loop is a one-line ConfigError."""
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as exc:
        raise ConfigError(f"{path}: cannot resolve the path ({exc})") from None


def make_dirs(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; the ones created, deepest first (for ``remove_created``).
    A path that cannot be a directory (under /proc, through a file, no permission) is a one-line ConfigError
    and leaves no directory behind."""
    directory = Path(directory)
    missing = []
    for parent in (directory, *directory.parents):
        if parent.is_dir():
            break
        missing.append(parent)
    created: list[Path] = []
    try:
        for path in reversed(missing):
            path.mkdir()
            created.insert(0, path)
    except FileExistsError:
        remove_created(created)
        raise ConfigError(f"{directory}: not a directory (a file is in the way)") from None
    except OSError as exc:
        remove_created(created)
        raise ConfigError(f"{directory}: cannot create the directory: {exc.strerror or exc}") from None
    return created


def remove_created(created: list[Path]) -> None:
    """Remove directories ``make_dirs`` created (deepest first), each only while it is empty."""
    for path in created:
        try:
            path.rmdir()
        except OSError:
            return


def largest_param(spec: JobSpec) -> int | None:
    """Elements of the model's largest weight, when the spec names a config hpcmem can read."""
    name = spec.model.get("config")
    if not name:
        return None
    try:
        return largest_param_numel(load_model_config(fill_placeholders(name, {"spec_dir": str(spec.spec_dir)}, spec.path)))
    except (HpcmemError, KeyError, TypeError, ValueError):
        return None  # an unknown model leaves DeepSpeed's default buffer size


def check_program(spec: JobSpec) -> None:
    """Refuse a script that does not exist here (login nodes share the file system with compute nodes)."""
    if spec.script is not None and not spec.script.is_file():
        raise ConfigError(f"{spec.path}: command.script: {spec.script}: no such script")
