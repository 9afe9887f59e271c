"""Benchmark matrices (``jobs/nightly/<name>.yaml``): models x partitions x techniques -> cells.

A matrix names the partitions it runs on per site, the models (a reference config, its
batch and shape) and the techniques (techniques.py). ``load_matrix`` checks the file
against ``jobs/nightly/schema.json`` and the technique names; ``expand`` turns it into
cells for one site, each with the fixed plan it runs or the reason it is skipped.
An unknown technique, site or partition is a one-line error naming it and the file.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, HpcmemError, UnknownNameError
from ..models import load_model_config
from ..plan import Plan, with_changes
from ..resources import data_dir
from ..schema import load_schema, load_yaml, validate
from ..sites import Partition, Site, parse_minutes
from . import techniques
from .techniques import Skip


def matrices_dir() -> Path:
    """The shipped matrices: ``jobs/nightly/``."""
    return data_dir("jobs") / "nightly"


@dataclass(frozen=True)
class Model:
    """One model row of a matrix: what is trained and its base (vanilla) shape."""

    name: str
    """The name cells and the results store use (unique in the matrix)."""
    config: str
    """A name in jobs/models/, or an absolute path to a config.json (relative ones are made absolute on load)."""
    task: str
    num_labels: int | None
    nodes: int
    gpus_per_node: int
    training: Mapping[str, int]
    """global_batch, micro_batch, seq_len (samples, tokens)."""
    sets: Mapping[str, Any]
    """Knob overrides for every cell of this model (e.g. mem_mib, attention)."""
    partitions: tuple[str, ...] | None
    """Only these partitions (None: every partition of the matrix)."""
    techniques: tuple[str, ...] | None
    """Only these techniques (None: the matrix's)."""
    skip_predicted_oom: bool = False
    """Skip a cell the analytic estimate says does not fit (a 7B model's vanilla cell on a 40 GB GPU)."""


@dataclass(frozen=True)
class Matrix:
    name: str
    path: Path
    description: str
    steps: int
    """Optimizer steps each cell trains, warm-up included (the trainer's --steps)."""
    warmup_steps: int
    """Steps not timed (the trainer's --warmup-steps)."""
    time_min: int
    """Slurm --time of each cell, minutes."""
    sites: Mapping[str, tuple[str, ...]]
    """Partition names per site name."""
    models: tuple[Model, ...]
    techniques: tuple[str, ...]


@dataclass(frozen=True)
class Cell:
    """One benchmark cell: a model with a technique on a partition; ``plan`` None when skipped."""

    model: Model
    partition: str
    technique: str
    plan: Plan | None
    skip: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        return f"{self.partition}/{self.model.name}/{self.technique}"


def find_matrix(ref: str | Path) -> Path:
    """A matrix by path, or by name among the shipped ones (``ci-small`` -> jobs/nightly/ci-small.yaml)."""
    path = Path(ref)
    if path.is_file():
        return path
    shipped = matrices_dir() / f"{ref}.yaml"
    if shipped.is_file() and str(ref) not in NOT_MATRICES:
        return shipped
    if path.suffix in (".yaml", ".yml") or "/" in str(ref):
        raise ConfigError(f"{ref}: no such matrix file")
    raise UnknownNameError("matrix", str(ref), shipped_matrices())


NOT_MATRICES = ("references",)
"""YAML files of jobs/nightly/ that are not matrices (the report's declared references)."""


def shipped_matrices() -> list[str]:
    return sorted(p.stem for p in matrices_dir().glob("*.yaml") if p.stem not in NOT_MATRICES)


def load_matrix(ref: str | Path) -> Matrix:
    """Load and check a matrix file (schema, technique names, model names, shapes)."""
    path = find_matrix(ref).resolve()
    doc = load_yaml(path)
    validate(doc, load_schema(matrices_dir() / "schema.json"), str(path))
    listed = tuple(doc["techniques"])
    _check_techniques(listed, path, "techniques")
    models = tuple(_model(raw, i, path) for i, raw in enumerate(doc["models"]))
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{path}: models: name {dupes[0]!r} is used twice (cells are keyed by model name)")
    matrix = Matrix(name=doc["name"], path=path, description=doc.get("description", ""), steps=doc.get("steps", 6),
                    warmup_steps=doc.get("warmup_steps", 2), time_min=parse_minutes(doc.get("time", "00:30:00")),
                    sites={s: tuple(p) for s, p in doc["sites"].items()}, models=models, techniques=listed)
    if matrix.warmup_steps >= matrix.steps:
        raise ConfigError(f"{path}: warmup_steps {matrix.warmup_steps} leaves no timed step of steps {matrix.steps}")
    for m in models:
        wanted = set(m.partitions or ())
        everywhere = {p for parts in matrix.sites.values() for p in parts}
        if wanted - everywhere:
            raise ConfigError(f"{path}: models.{m.name}.partitions: unknown partition {sorted(wanted - everywhere)[0]!r}"
                              f" (the matrix lists: {', '.join(sorted(everywhere))})")
    return matrix


def _check_techniques(names, path: Path, key: str) -> None:
    for name in names:
        if name not in techniques.TECHNIQUES:
            raise ConfigError(f"{path}: {key}: unknown technique {name!r}; valid: {', '.join(techniques.NAMES)}")


def _model(raw: Mapping[str, Any], index: int, path: Path) -> Model:
    where = f"models.{raw.get('name', index)}"
    config = str(raw["config"])
    if config.endswith(".json") or "/" in config and not config.startswith("/"):
        candidate = (path.parent / config).resolve()
        if candidate.exists():
            config = str(candidate)
    try:
        load_model_config(config)  # a model that cannot be read fails here, not in 13 jobs tonight
    except HpcmemError as exc:
        raise ConfigError(f"{path}: {where}.config: {exc}") from exc
    if raw.get("techniques") is not None:
        _check_techniques(raw["techniques"], path, f"{where}.techniques")
    sets = dict(raw.get("set", {}))
    bad = set(sets) - set(Plan().to_dict()) | ({"world_size"} & set(sets))
    if bad:
        raise ConfigError(f"{path}: {where}.set: unknown knob {sorted(bad)[0]!r}")
    return Model(name=raw["name"], config=config, task=raw.get("task", "causal-lm"), num_labels=raw.get("num_labels"),
                 nodes=raw.get("nodes", 1), gpus_per_node=raw.get("gpus_per_node", 1), training=dict(raw["training"]),
                 sets=sets, partitions=tuple(raw["partitions"]) if raw.get("partitions") else None,
                 techniques=tuple(raw["techniques"]) if raw.get("techniques") else None,
                 skip_predicted_oom=raw.get("skip_predicted_oom", False))


def base_plan(matrix: Matrix, model: Model) -> Plan:
    """The vanilla plan of a model: fp32, AdamW, no checkpointing, DDP; micro-batches accumulated to the global batch."""
    t = model.training
    world = model.nodes * model.gpus_per_node
    micro = t.get("micro_batch", max(1, t["global_batch"] // world))
    if t["global_batch"] % (micro * world):
        raise ConfigError(f"{matrix.path}: models.{model.name}.training: global_batch {t['global_batch']} is not a "
                          f"multiple of micro_batch {micro} x {world} ranks")
    plan = Plan(nodes=model.nodes, gpus_per_node=model.gpus_per_node, global_batch=t["global_batch"],
                micro_batch=micro, grad_accum=t["global_batch"] // (micro * world), seq_len=t.get("seq_len", 128),
                time_min=matrix.time_min)
    try:
        return with_changes(plan, model.sets)
    except (HpcmemError, TypeError) as exc:
        raise ConfigError(f"{matrix.path}: models.{model.name}.set: {exc}") from exc


def site_partitions(matrix: Matrix, site: Site, only_partition: str | None = None) -> list[Partition]:
    """The partitions of ``site`` this matrix runs on (checked against the site), or just ``only_partition``."""
    if site.name not in matrix.sites:
        raise ConfigError(f"{matrix.path}: sites: the matrix has no partitions for site {site.name!r} "
                          f"(it lists: {', '.join(sorted(matrix.sites)) or 'none'})")
    names = matrix.sites[site.name]
    for name in names:
        if name not in site.partitions:
            raise ConfigError(f"{matrix.path}: sites.{site.name}: unknown partition {name!r} of site {site.name}; "
                              f"valid: {', '.join(sorted(site.partitions))}")
    if only_partition is not None:
        if only_partition not in names:
            raise ConfigError(f"--partition {only_partition}: matrix {matrix.name} does not run on it for site "
                              f"{site.name} (it lists: {', '.join(names)})")
        names = (only_partition,)
    return [site.partitions[n] for n in names]


def matches(cell_label: str, model: str, technique: str, pattern: str | None) -> bool:
    """``--only PATTERN`` (shell-style): matches the technique, the model, ``model/technique`` or the full label."""
    if not pattern:
        return True
    return any(fnmatch.fnmatchcase(text, pattern)
               for text in (technique, model, f"{model}/{technique}", cell_label))


def expand(matrix: Matrix, site: Site, partition: str | None = None, only: str | None = None,
           estimator=None) -> list[Cell]:
    """The cells of ``matrix`` on ``site``: partitions x models x techniques, each planned or skipped.

    ``estimator(model, plan, partition) -> Estimate`` decides ``skip_predicted_oom`` (default: the
    analytic estimate). Order: partition, model, technique as listed.
    """
    cells = []
    for part in site_partitions(matrix, site, partition):
        for model in matrix.models:
            if model.partitions is not None and part.name not in model.partitions:
                continue
            base = base_plan(matrix, model)
            for name in model.techniques or matrix.techniques:
                label = f"{part.name}/{model.name}/{name}"
                if not matches(label, model.name, name, only):
                    continue
                cells.append(_cell(model, part, name, base, estimator))
    return cells


def _cell(model: Model, part: Partition, name: str, base: Plan, estimator) -> Cell:
    planned = techniques.apply(name, base, part)
    if isinstance(planned, Skip):
        return Cell(model, part.name, name, None, planned.reason)
    if model.skip_predicted_oom:
        est = (estimator or _analytic)(model, planned, part)
        if est is not None and not est.fits:
            return Cell(model, part.name, name, None,
                        f"{name}: predicted {est.device_used_mib:,.0f} MiB per GPU > {est.capacity_mib:,.0f} MiB "
                        f"on {part.name} (skip_predicted_oom)")
    return Cell(model, part.name, name, planned)


def model_ref(model: Model):
    """The estimator's ModelRef for a matrix model."""
    from ..estimate import model_ref as ref

    return ref(model.config, model.task, model.num_labels)


def _analytic(model: Model, plan: Plan, part: Partition):
    from ..estimate import estimate

    try:
        return estimate(model_ref(model), plan, part)
    except (HpcmemError, KeyError, TypeError, ValueError):
        return None  # a model the analytic method does not cover: run the cell and see
