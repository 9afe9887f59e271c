"""What every hostile-input test checks, in one place (imported by tests/fuzz/ and tests/unit/test_hostile_input.py).

The rule of issue 13: bad input gets one ``HpcmemError`` or a correct result, never another exception, never a
hang, never a raw terminal escape; a rendered job script parses (``bash -n``) and runs no value it was given.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from toolkit import render
from toolkit.errors import HpcmemError

MARKER_NAME = "INJECTED"


def payloads(marker: Path) -> list[str]:
    """Values that break out of a shell line if anything reaches the script unquoted: a newline, both quotes,
    ``$()``, backticks, ``;``, a CR, an escape, a NUL, a backslash at the end, a ``#``."""
    m = shlex.quote(str(marker))
    return [f"a\ntouch {m}", f"a'; touch {m}; '", f'a"; touch {m}; "', f"$(touch {m})", f"`touch {m}`",
            f"a; touch {m}", f"a\rtouch {m}", "a\x1b[31mb", "a\x00b", "a\\", f"a #\ntouch {m}", f"a\u2028touch {m}",
            f"a&&touch {m}", f"a|touch {m}", "a b"]


def outcome(call: Callable[[], Any], seconds: float = 20.0) -> tuple[str, Any]:
    """Run ``call`` with a time bound: ("ok", result) or ("error", HpcmemError). Any other exception fails the
    test with its traceback; running past ``seconds`` fails it as a hang."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["ok"] = call()
        except HpcmemError as exc:
            box["error"] = exc
        except BaseException as exc:  # noqa: BLE001 - reported below with its traceback
            box["bug"] = exc

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"no answer within {seconds} s (a hang on hostile input)")
    if "bug" in box:
        raise box["bug"]
    if "error" in box:
        check_one_line(str(box["error"]))
        return "error", box["error"]
    assert time.monotonic() - start <= seconds
    return "ok", box.get("ok")


def check_one_line(message: str) -> None:
    """An HpcmemError message is one line once the CLI prints it (toolkit.cli.entry escapes the rest)."""
    from toolkit.templating import safe_text

    shown = safe_text(message, 2000)
    assert "\n" not in shown and "\x1b" not in shown and "\r" not in shown, shown


def render_outcome(spec, partition, plan, out: Path, marker: Path) -> str:
    """Render an attempt for possibly hostile values: "error" (refused with an HpcmemError) or "ok", and when ok
    the script passes ``bash -n``, every shell line is balanced, and running it (python = /bin/true, so the
    launch is a no-op) creates no ``marker``: no value given ran as a command."""
    kind, attempt = outcome(lambda: render.render_attempt(spec, partition, plan, out / "attempt", workdir=out,
                                                          python="/bin/true"))
    if kind == "error":
        assert not (out / "attempt").exists(), "a refused render left its directory behind"
        return kind
    check_script(attempt.script, out, marker)
    return kind


def check_script(script: Path, workdir: Path, marker: Path) -> None:
    """``bash -n``; no control character but newline and tab; each line splits like the shell splits it; run it
    with the site's setup lines and the launch, and no marker appears."""
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True, capture_output=True, timeout=30)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f\u2028\u2029]", text), "a control character in the script"
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            shlex.split(line.rstrip("\\"))  # raises on an unbalanced quote
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), "SLURM_JOB_ID": "1",
           "SLURM_JOB_NODELIST": "localhost"}
    subprocess.run(["bash", str(script)], cwd=workdir, env=env, capture_output=True, timeout=60)
    assert not marker.exists(), f"a value ran as a command:\n{text}"


def with_fields(partition, **fields):
    """The partition with some fields replaced (no checks: what code, not a site file, could build)."""
    return dataclasses.replace(partition, **fields)
