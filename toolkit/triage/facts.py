"""Job facts: what triage knows about one job, and from where.

``JobFacts`` is the answer (frozen, JSON-ready); ``FactsBuilder`` collects it from the
sources ``toolkit/triage/sources.py`` finds, best source first: a field or knob keeps the
first value given (so exact sources are added before guesses), every source used is named
in ``sources`` and every fact that could not be found gets one sentence in ``missing``.

The readers here turn files into facts: a scheduler record (sacct / scontrol, see
``slurm.parse_sacct_facts``), hpcmem's plan.json and spec.yaml, a job script and a
DeepSpeed config (``scriptread``). They never raise for a missing or malformed file: they
say so in ``missing``. Every knob is checked against the Plan's field types and ranges
(``knob_problem``) before it is kept: a knob of the wrong type or out of range (``"abc"`` for
``time_min``, ``0`` for ``global_batch``) is named in ``missing`` and never reaches ``plan_knobs``.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping


from ..errors import HpcmemError
from ..plan import ATTENTIONS, KNOBS, LAUNCHERS, LIMITS, OFFLOADS, OPTIMIZERS, PRECISIONS, check_alloc_conf
from ..schema import MAX_DEPTH, parse_yaml
from . import scriptread

MAX_FILE_BYTES = 4 * 2**20
"""Largest job script, plan or config read (bytes): anything larger is not one."""

PLAN_JSON = "plan.json"
DS_CONFIG_JSON = "ds_config.json"
LEDGER = "ledger"
SACCT = "sacct"
SCONTROL = "scontrol"
JOB_SCRIPT = scriptread.JOB_SCRIPT
TRAINER_ARGS = scriptread.TRAINER_ARGS

_RECORD_FIELDS = ("name", "user", "partition", "cluster", "state", "exit_code", "signal", "elapsed_s", "timelimit_s",
                  "max_rss_mib", "req_tres", "alloc_tres", "nodes", "workdir", "submit", "start", "end")


@dataclass(frozen=True)
class JobFacts:
    """Everything known about one job (times in seconds, memory in MiB). None / empty: not found."""

    job_id: str | None = None
    """Slurm job id: ``123`` or ``123_4`` for an array task."""
    name: str | None = None
    user: str | None = None
    partition: str | None = None
    cluster: str | None = None
    state: str | None = None
    """Normalized state (FAILED, OUT_OF_MEMORY, TIMEOUT, CANCELLED, ...); a FAILED job with an OOM step is OUT_OF_MEMORY."""
    exit_code: int | None = None
    signal: int | None = None
    elapsed_s: float | None = None
    timelimit_s: float | None = None
    max_rss_mib: float | None = None
    """Largest MaxRSS over the job's steps."""
    req_tres: dict = field(default_factory=dict)
    """Requested TRES, e.g. ``{"cpu": "8", "mem": "6G", "gres/gpu": "2"}``."""
    alloc_tres: dict = field(default_factory=dict)
    nodes: str | None = None
    workdir: str | None = None
    submit: str | None = None
    start: str | None = None
    end: str | None = None
    reason: str | None = None
    """The scheduler's reason (who cancelled, which step ran out of memory)."""
    steps: tuple = ()
    """sacct's steps: dicts {step, name, state, exit_code, signal, max_rss_mib}."""
    run_id: str | None = None
    attempt: int | None = None
    site: str | None = None
    attempts: tuple = ()
    """Earlier attempts of the run (ledger): dicts {n, job_id, state, verdict, plan, decision}."""
    plan_knobs: dict = field(default_factory=dict)
    """Plan knob -> value (``toolkit/plan.py`` names) as the job ran."""
    knob_sources: dict = field(default_factory=dict)
    """Knob -> where it was read: plan.json, ledger, ds_config.json, trainer args, job script."""
    runtime: dict = field(default_factory=dict)
    """``estimate.gpu.Runtime`` fields the job's files state (``scriptread.read_script``'s ``runtime``: the HF
    Trainer's FSDP accumulation without a sync on every micro-batch, ``fsdp_no_sync``)."""
    accelerator_config: str | None = None
    """The HF Trainer's ``--accelerator_config`` as the job script wrote it (inline JSON or a file), or None: a
    remedy that asks for ``sync_each_batch`` merges into it, since the Trainer takes only the last one given."""
    model: str | None = None
    task: str | None = None
    script_path: str | None = None
    """The job script read (a path, or ``sacct -B JOBID`` when accounting kept it)."""
    ds_config_path: str | None = None
    sources: tuple = ()
    """Where facts came from: sacct, scontrol, ledger, job script, ds_config.json, plan.json, spec.yaml."""
    missing: tuple = ()
    """One sentence each: what could not be found, and why."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the field names above, tuples as lists."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, tuple):
                out[key] = list(value)
        return out


@dataclass(frozen=True)
class Case:
    """One job (or one log) to triage."""

    target: str
    """The TARGET as typed."""
    kind: str
    """job, run, file, dir or stdin."""
    log_paths: tuple[Path, ...]
    """Logs to classify, in rank/file order; empty when none was found (``facts.missing`` says why)."""
    log_text: str | None
    """The log itself when it came on standard input (its last ``logtail.DEFAULT_MAX_BYTES`` at most)."""
    facts: JobFacts
    log_first_line: int | None = None
    """For ``log_text``: the line number in the whole input of its first line (1 unless the start was dropped)."""


class FactsBuilder:
    """Collects ``JobFacts``; the first value given for a field or knob wins."""

    def __init__(self, **known: Any):
        self._values: dict[str, Any] = {}
        self._knobs: dict[str, Any] = {}
        self._knob_sources: dict[str, str] = {}
        self._sources: list[str] = []
        self._missing: list[str] = []
        self.set(None, **known)

    def get(self, name: str) -> Any:
        return self._values.get(name)

    def set(self, source: str | None, **values: Any) -> None:
        """Set fields not set yet (None and empty values are ignored); name ``source`` when one was used."""
        used = False
        for name, value in values.items():
            if name not in _FIELDS:
                raise ValueError(f"JobFacts has no field {name!r}")
            if value is None or value == {} or value == () or value == []:
                continue
            if name not in self._values:
                self._values[name] = value
                used = True
        if used and source:
            self.source(source)

    def knobs(self, knobs: Mapping[str, Any], sources: str | Mapping[str, str], label: str | None = None) -> None:
        """Add Plan knobs (unknown names are ignored) with their source (one for all, or per knob).

        A value of the wrong type or out of range is not kept: ``missing`` names it (``label``: the
        file it came from, default the source)."""
        used = set()
        for name, value in knobs.items():
            if name in KNOBS and name not in self._knobs and value is not None:
                where = sources if isinstance(sources, str) else sources.get(name, JOB_SCRIPT)
                problem = knob_problem(name, value)
                if problem:
                    self.miss(f"{label or where}: {name} {problem}: not used")
                    continue
                self._knobs[name], self._knob_sources[name] = value, where
                used.add(where)
        for where in sorted(used):
            self.source(where)

    def source(self, name: str) -> None:
        if name not in self._sources:
            self._sources.append(name)

    def miss(self, sentence: str) -> None:
        if sentence not in self._missing:
            self._missing.append(sentence)

    def build(self) -> JobFacts:
        return JobFacts(**self._values, plan_knobs=dict(self._knobs), knob_sources=dict(self._knob_sources),
                        sources=tuple(self._sources), missing=tuple(self._missing))


_FIELDS = {f for f in JobFacts.__dataclass_fields__} - {"plan_knobs", "knob_sources", "sources", "missing"}

_CHOICES = {"launcher": LAUNCHERS, "precision": PRECISIONS, "optimizer": OPTIMIZERS, "attention": ATTENTIONS,
            "offload_optimizer": OFFLOADS, "offload_params": OFFLOADS}
_AT_LEAST = {name: least for name, (least, _most) in LIMITS.items()}
_AT_MOST = {name: most for name, (_least, most) in LIMITS.items()}


def knob_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the Plan knob ``name`` (wrong type, out of range, not a choice), or None (pure).

    The types are the Plan's own: integers (never bools or strings, ``"8"`` included), a bool for
    ``checkpointing``, a string for ``alloc_conf``, one of the choices for the named ones."""
    if name in _CHOICES:
        return None if isinstance(value, str) and value in _CHOICES[name] else \
            f"is {_short(value)}, not one of {', '.join(_CHOICES[name])}"
    if name == "checkpointing":
        return None if isinstance(value, bool) else f"is {_short(value)}, not true or false"
    if name == "alloc_conf":
        if not isinstance(value, str):
            return f"is {_short(value)}, not a string"
        try:
            check_alloc_conf(value)
        except HpcmemError:
            return f"is {_short(value)}, not PyTorch allocator options (name:value,...)"
        return None
    if name in _AT_LEAST:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"is {_short(value)}, not an integer"
        least, most = _AT_LEAST[name], _AT_MOST[name]
        if value < least or value > most:
            bound = f"{least} to {most}" if most <= 100 else f"at least {least}" if value < least else f"at most {most}"
            return f"is {_short(value)}, not {bound}"
    return None


def _short(value: Any, width: int = 60) -> str:
    """``repr`` cut to ``width``: a value read from an untrusted file never fills a report (an int of 10**5
    digits has no repr at all in Python 3.11, so its size is said instead)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    return text if len(text) <= width else text[:width] + "..."


# ---------------------------------------------------------------- readers


def add_record(builder: FactsBuilder, record: Mapping[str, Any], source: str) -> None:
    """A ``parse_sacct_facts`` / ``parse_scontrol_facts`` record -> job fields."""
    values = {k: record.get(k) for k in _RECORD_FIELDS}
    values["steps"] = tuple(record.get("steps") or ())
    values["reason"] = record.get("reason")
    values["job_id"] = record.get("job_id")
    builder.set(source, **values)


def add_plan_json(builder: FactsBuilder, path: Path) -> bool:
    """hpcmem's plan.json: every knob, exactly. True when read."""
    data = _read_json(builder, path, "plan")
    if not isinstance(data, dict):
        return False
    builder.knobs({k: v for k, v in data.items() if k != "world_size"}, PLAN_JSON, label=f"plan {path}")
    return True


def add_spec(builder: FactsBuilder, path: Path) -> None:
    """A run's spec.yaml (copy of the job spec): the model and task it trains."""
    text = read_text(builder, path, "job spec")
    if text is None:
        return
    try:
        doc = parse_yaml(text, f"job spec {path}")
    except HpcmemError as exc:
        builder.miss(str(exc))
        return
    model = doc.get("model") if isinstance(doc, dict) else None
    if isinstance(model, dict):
        builder.set("spec.yaml", model=_text(model.get("config") or model.get("name") or model.get("id")),
                    task=_text(model.get("task")))


def add_script(builder: FactsBuilder, text: str, label: str, ds_search: list[Path]) -> dict[str, Any]:
    """A job script's knobs, model and DeepSpeed config (found via ``--deepspeed X`` or in ``ds_search``).

    Knob order: a DeepSpeed config the job really used outranks the Trainer flags, which outrank the
    ``#SBATCH`` lines. ``ds_search``: directories where a relative config path or ``ds_config.json``
    may lie (the job's working directory, the script's, the log's). Returns ``read_script``'s dict.
    """
    script = scriptread.read_script(text)
    builder.set(JOB_SCRIPT, script_path=label, model=script["model"], runtime=script["runtime"],
                accelerator_config=script["accelerator_config"])
    builder.set(JOB_SCRIPT, partition=script["partition"])  # after sacct / scontrol / the ledger: theirs wins
    search = list(ds_search)
    if script["cd"]:  # the launch runs there: relative paths start from it
        cd = Path(script["cd"])
        search.insert(0, cd if cd.is_absolute() or not search else search[0] / cd)
    add_ds_config(builder, list(dict.fromkeys(search)), script["ds_config"])
    builder.knobs(script["knobs"], script["knob_origin"], label=f"job script {label}")
    return script


def add_ds_config(builder: FactsBuilder, search: list[Path], named: str | None = None) -> None:
    """The DeepSpeed config ``named`` (absolute, or relative to a ``search`` directory), else a
    ``ds_config.json`` in one of them; its knobs go to ``builder``."""
    if builder.get("ds_config_path"):
        return
    if named and "$" in named:
        builder.miss(f"DeepSpeed config {named!r} is given through a shell variable: not read")
        return
    candidates = [Path(named)] if named and os.path.isabs(named) else \
        [d / named for d in search] if named else [d / DS_CONFIG_JSON for d in search]
    path = next((p for p in candidates if is_file(p)), None)
    if path is None:
        if named:
            builder.miss(f"DeepSpeed config {named} named by the job script was not found "
                         f"(tried {', '.join(map(str, candidates))})")
        return
    data = _read_json(builder, path, "DeepSpeed config")
    if isinstance(data, dict):
        builder.set(DS_CONFIG_JSON, ds_config_path=str(path))
        builder.knobs(scriptread.read_ds_config(data), DS_CONFIG_JSON, label=f"DeepSpeed config {path}")


def add_files_near(builder: FactsBuilder, directory: Path, extra_dirs: list[Path] = ()) -> None:
    """What lies next to a log: plan.json, spec.yaml here or one level up (an hpcmem run), the job script
    (job.sbatch, or the one ``*.sbatch``/``*.slurm``/``*.sh`` with ``#SBATCH`` lines) and its DeepSpeed
    config (named by the script, else ``ds_config.json`` here or in ``extra_dirs``)."""
    directory = Path(directory)
    if is_file(directory / PLAN_JSON):
        add_plan_json(builder, directory / PLAN_JSON)
    for spec in (directory / "spec.yaml", directory.parent / "spec.yaml"):
        if is_file(spec) and not builder.get("model"):
            add_spec(builder, spec)
            break
    search = list(dict.fromkeys([*extra_dirs, directory]))
    if not builder.get("script_path"):
        script = find_script(directory)
        text = read_text(builder, script, "job script") if script else None
        if text is not None:
            add_script(builder, text, str(script), search)
    add_ds_config(builder, search)


def find_script(directory: Path) -> Path | None:
    """The job script in ``directory``: ``job.sbatch``, else the only ``*.sbatch``/``*.slurm``/``*.sh``
    holding ``#SBATCH`` lines (None when there are none, or several)."""
    directory = Path(directory)
    if is_file(directory / "job.sbatch"):
        return directory / "job.sbatch"
    try:
        names = sorted(p for p in itertools.islice(directory.iterdir(), 10000)
                       if p.suffix in (".sbatch", ".slurm", ".sh", ".job") and is_file(p))
    except OSError:
        return None
    with_directives = [p for p in names if _has_directives(p)]
    return with_directives[0] if len(with_directives) == 1 else None


def ledger_attempts(attempts: list, chosen_n: int) -> tuple:
    """Ledger rows of the attempts before ``chosen_n`` -> the dicts of ``JobFacts.attempts``."""
    return tuple({"n": a.n, "job_id": a.job_id, "state": a.state, "verdict": a.verdict, "plan": a.plan,
                  "decision": a.decision} for a in attempts if a.n < chosen_n)


# ---------------------------------------------------------------- small helpers


def is_file(path) -> bool:
    """A regular file (symlinks followed) at ``path``; False, never an exception, for a path that cannot be
    looked at (too long, a NUL byte, a symlink loop, no permission): paths here come from untrusted scripts."""
    return os.path.isfile(path)


def _has_directives(path: Path) -> bool:
    try:
        from ..logtail import open_regular

        with open_regular(path) as handle:
            return b"#SBATCH" in handle.read(65536)
    except OSError:
        return False


def read_text(builder: FactsBuilder, path: Path, what: str) -> str | None:
    """A small regular file (at most ``MAX_FILE_BYTES``) as text, or None with the reason in ``missing``.

    Only a regular file is read: a FIFO, a device or a socket named by an untrusted script (``--deepspeed
    /dev/zero``) is opened without blocking and refused before a byte is read. Its content is never quoted in
    ``missing``: a file that is not what it should be is named, not shown."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        builder.miss(f"{what} {path} could not be read ({exc.strerror or exc})")
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            builder.miss(f"{what} {path} is not a regular file: not read")
            return None
        if info.st_size > MAX_FILE_BYTES:
            builder.miss(f"{what} {path} is {info.st_size} bytes, too large to be one: not read")
            return None
        data = b""
        while len(data) <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > MAX_FILE_BYTES:
            builder.miss(f"{what} {path} grew past {MAX_FILE_BYTES} bytes while read: not read")
            return None
        return data.decode("utf-8", errors="replace")
    except OSError as exc:
        builder.miss(f"{what} {path} could not be read ({exc.strerror or exc})")
        return None
    finally:
        os.close(fd)


def _read_json(builder: FactsBuilder, path: Path, what: str) -> Any:
    """A JSON file (plan.json, a DeepSpeed config), or None with the reason in ``missing``: not JSON, nested
    deeper than ``schema.MAX_DEPTH`` (json's recursion would overflow), or numbers Python will not convert."""
    text = read_text(builder, path, what)
    if text is None:
        return None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        builder.miss(f"{what} {path} is nested too deeply to be one: not read")
        return None
    except ValueError as exc:  # JSONDecodeError, a 5000-digit integer, NaN/Infinity
        problem = str(exc).splitlines()[0][:120] if isinstance(exc, json.JSONDecodeError) else "a number out of range"
        builder.miss(f"{what} {path} is not valid JSON ({problem})")
        return None
    if _depth(data) > MAX_DEPTH:
        builder.miss(f"{what} {path} is nested more than {MAX_DEPTH} levels deep: not read")
        return None
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth(data: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return deepest


def _text(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)
