"""Which side a module runs on (docs/architecture.md, "Which side a module runs on"), kept true by its imports.

- the job side, ``toolkit/runtime/`` (and the ``python -m toolkit.train`` entry point): runs inside the job, on
  the compute node; it never imports a login-side module (sites, the controller, the ladder, triage, ...);
- the engines, ``toolkit/strategies/``: facts the login side plans with, and a runtime side the job calls; they
  reach the job side only inside functions (lazily), never at import;
- shared leaves (plan, errors, files, optimizers, models, modelshape, resources, peaks, devices): both sides use them, and
  they import only each other and the engines;
- the login side: everything else. Of the job side it reads only the contract between the two, modules that are
  pure and import no torch: the record the job writes (``runtime.metrics``), the checkpoint layout and the
  time-limit margin (``runtime.checkpoint``), the in-job moves' record and switch (``runtime.inflight``).

The imports are read from the source (the ``ast``), top-level and inside functions, relative and absolute.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "toolkit"

SHARED = {"toolkit", "toolkit.errors", "toolkit.files", "toolkit.plan", "toolkit.optimizers", "toolkit.models",
          "toolkit.modelshape", "toolkit.resources", "toolkit.peaks", "toolkit.devices"}
LOGIN_READS_OF_JOB = {"toolkit.runtime.metrics", "toolkit.runtime.checkpoint", "toolkit.runtime.inflight"}


def module_names() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = module_names()


def side(name: str) -> str:
    if name == "toolkit.train" or name == "toolkit.runtime" or name.startswith("toolkit.runtime."):
        return "job"
    if name == "toolkit.strategies" or name.startswith("toolkit.strategies."):
        return "engine"
    if name in SHARED:
        return "shared"
    return "login"


def imports(name: str) -> list[tuple[str, bool]]:
    """(imported toolkit module, at import time?) for every import in module ``name``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def resolve(module: str | None, level: int) -> str:
        if not level:
            return module or ""
        base = package.split(".")
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def visit(node, at_import: bool):
        for child in ast.iter_child_nodes(node):
            lazy = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                target = resolve(child.module, child.level)
                for alias in child.names:
                    full = f"{target}.{alias.name}"
                    found.append((full if full in MODULES else target, at_import))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, at_import) for alias in child.names)
            visit(child, at_import and not lazy)

    visit(tree, True)
    return [(m, t) for m, t in found if m.split(".")[0] == "toolkit" and m in MODULES and m != name]


def violations() -> list[str]:
    bad = []
    for name in sorted(MODULES):
        mine = side(name)
        for target, at_import in imports(name):
            theirs = side(target)
            if mine == "job" and theirs == "login":
                bad.append(f"{name} (job side) imports {target} (login side)")
            elif mine == "shared" and theirs in ("job", "login"):
                bad.append(f"{name} (shared) imports {target} ({theirs} side)")
            elif mine == "engine" and theirs == "login":
                bad.append(f"{name} (engine) imports {target} (login side)")
            elif mine == "engine" and theirs == "job" and at_import:
                bad.append(f"{name} (engine) imports {target} (job side) at import time, not inside a function")
            elif mine == "login" and theirs == "job" and target not in LOGIN_READS_OF_JOB:
                bad.append(f"{name} (login side) imports {target} (job side)")
    return bad


def test_every_module_imports_only_what_its_side_may():
    assert violations() == []


def test_the_rules_see_a_violation():
    """The reader finds what it must: the job side's trainer imports the runtime; an engine reaches the job side
    only lazily; and a login module importing the trainer would be reported."""
    assert ("toolkit.runtime.checkpoint", True) in imports("toolkit.runtime.train")
    assert ("toolkit.runtime.checkpoint", False) in imports("toolkit.strategies.ddp")
    assert side("toolkit.runtime.train") == "job" and side("toolkit.controller") == "login"
    assert side("toolkit.strategies.fsdp") == "engine" and side("toolkit.plan") == "shared"


def test_the_job_side_lives_in_runtime():
    """Everything that runs inside the job is under toolkit/runtime/; toolkit/train.py is only the public
    ``python -m toolkit.train`` entry point."""
    job = sorted(n for n in MODULES if side(n) == "job")
    assert all(n.startswith("toolkit.runtime") for n in job if n != "toolkit.train")
    entry = MODULES["toolkit.train"].read_text()
    assert "from .runtime.train import main" in entry and entry.count("\ndef ") == 0


def test_the_login_side_and_the_contract_import_no_torch():
    """The login side (the CLI, the controller, triage) and the job-side modules it reads start without torch,
    DeepSpeed, transformers or accelerate: a login node need not have them, and every command starts fast."""
    import subprocess
    import sys

    names = ["toolkit.cli", "toolkit.controller", "toolkit.triage", *sorted(LOGIN_READS_OF_JOB)]
    code = ("import sys\n" + "".join(f"import {n}\n" for n in names)
            + "print([m for m in ('torch', 'deepspeed', 'transformers', 'accelerate') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
