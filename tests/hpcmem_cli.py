"""Run the real `hpcmem` command line in a subprocess, as a user would (shared by the test files)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args, home, env=None, timeout=900, check=False, input=None):
    """``python -m toolkit.cli ARGS`` with HPCMEM_HOME=home (plus ``env``), ``input`` on stdin (text, or
    bytes: then stdout and stderr are bytes too);
    ``check``: fail the test on a non-zero exit."""
    full = {**os.environ, "HPCMEM_HOME": str(home), **(env or {})}
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", *map(str, args)], capture_output=True,
                            text=not isinstance(input, bytes), env=full, timeout=timeout, cwd=REPO, input=input)
    if check and result.returncode:
        raise AssertionError(f"hpcmem {' '.join(map(str, args))} exited {result.returncode}\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result
