"""``python -m toolkit.train``: the reference trainer's public entry point (job specs, templates and the DeepSpeed
launcher's ``--module toolkit.train`` name it). The trainer itself runs inside the job and lives with the rest of
the job side in ``toolkit/runtime/train.py`` (docs/architecture.md, "Which side a module runs on")."""

import sys

from .runtime.train import main

if __name__ == "__main__":
    sys.exit(main())
