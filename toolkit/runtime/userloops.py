"""Resume for user training code: an Accelerate loop and the Hugging Face Trainer (issue 14, docs/resume.md).

The reference trainer checkpoints through ``checkpoint.Checkpointer`` with a strategy's engine. User code gets
the same saves, shared by a run's attempts in ``HPCMEM_CHECKPOINT_DIR``, with the same policy (an interval, the
job's time limit, SIGUSR1) and the same atomic commit:

An Accelerate loop (``accelerator.save_state``/``load_state`` inside hpcmem's ``step-<n>`` directories)::

    ckpt = runtime.AccelerateCheckpoints(accelerator, model, optimizer, every_steps=500)
    start = ckpt.resume()                       # 0 on a fresh start
    for step in range(start + 1, total + 1):
        ...                                     # one optimizer step
        ckpt.maybe_save(step)

The HF Trainer keeps its own ``checkpoint-<step>`` directories; ``hf_time_limit_callback()`` makes it save before
the job's time limit (or on SIGUSR1), and ``hf_resume_checkpoint()`` finds the newest complete one::

    trainer = Trainer(..., callbacks=[runtime.hf_time_limit_callback()])
    trainer.train(resume_from_checkpoint=runtime.hf_resume_checkpoint())

Both decide "save now" on every rank with one small all-reduce, because each rank's clock reads the deadline a
few milliseconds apart and a save is collective.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from . import checkpoint
from .jobenv import in_hpcmem_job, load_plan, ranks as job_ranks

FORMAT_ACCELERATE = checkpoint.FORMAT_ACCELERATE
ACCELERATE_DIR = "accelerate"


def _plan_dict() -> dict[str, Any]:
    return load_plan().to_dict() if in_hpcmem_job() else {}


def _policy(plan: dict[str, Any], every_steps: int | None, every_min: float | None,
            margin_s: float | None) -> checkpoint.Policy:
    deadline = checkpoint.job_deadline(plan if in_hpcmem_job() else None)
    limit = (deadline - time.time()) if deadline is not None else 0.0
    return checkpoint.Policy(every_steps=every_steps or None, every_s=60.0 * every_min if every_min else None,
                             deadline=deadline, margin_s=checkpoint.margin_s(max(limit, 0.0), margin_s))


def _any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank (``collectives.any_rank``)."""
    try:
        import torch.distributed  # noqa: F401
    except ImportError:  # pragma: no cover - torch is a job dependency
        return flag
    from .collectives import any_rank

    return any_rank(flag)


class _AccelerateEngine:
    """The engine part of a save (``Checkpointer``'s engine protocol) written by ``accelerator.save_state``."""

    def __init__(self, accelerator, model, optimizer):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer

    def save_state(self, directory: Path, ranks) -> str:
        self.accelerator.save_state(str(Path(directory) / ACCELERATE_DIR))
        return FORMAT_ACCELERATE

    def load_state(self, directory: Path, saved) -> None:
        self.accelerator.load_state(str(Path(directory) / ACCELERATE_DIR))

    def digest(self) -> dict[str, str] | None:
        return checkpoint.torch_digest(self.accelerator.unwrap_model(self.model), self.optimizer)


class AccelerateCheckpoints:
    """Saves and resume of an Accelerate training loop in the run's checkpoint directory.

    ``root`` defaults to ``HPCMEM_CHECKPOINT_DIR``; without it (outside hpcmem) nothing is saved and ``resume``
    returns 0. ``every_steps``/``every_min``: the save interval; a save is also made once ``margin_s`` (default:
    10 % of the time limit, within 20-300 s) before the job's time limit, and after a step during which SIGUSR1
    arrived. The model and optimizer are what ``accelerator.prepare`` returned; other state (a scheduler, a data
    loader's position) goes in through ``accelerator.register_for_checkpointing`` as Accelerate documents.
    """

    def __init__(self, accelerator, model, optimizer=None, *, root: str | Path | None = None,
                 every_steps: int | None = None, every_min: float | None = None, margin_s: float | None = None,
                 keep: int = 0, digest: bool = False, monitor=None):
        root = Path(root) if root is not None else checkpoint.checkpoint_dir()
        self.enabled = root is not None
        self.engine = _AccelerateEngine(accelerator, model, optimizer)
        plan = _plan_dict()
        self.plan = plan
        self._ckpt = None
        if self.enabled:
            self._ckpt = checkpoint.Checkpointer(
                root, _policy(plan, every_steps, every_min, margin_s), job_ranks(), plan, monitor=monitor,
                digest=digest, keep=keep)
            self._ckpt.install_signal()

    @property
    def last(self) -> checkpoint.Saved | None:
        return None if self._ckpt is None else self._ckpt.last

    def resume(self) -> int:
        """Load the newest complete save an Accelerate loop of this layout can read; its step (0: fresh start)."""
        if self._ckpt is None:
            return 0
        return self._ckpt.resume(self.engine, lambda extras, step: None, FORMAT_ACCELERATE)

    def maybe_save(self, step: int) -> checkpoint.Saved | None:
        """After optimizer step ``step``: save when the policy says so on any rank (every rank calls this)."""
        if self._ckpt is None:
            return None
        return self._ckpt.maybe_save(step, self.engine, dict)

    def save(self, step: int, reason: str = "requested") -> checkpoint.Saved | None:
        """Save now (every rank calls this)."""
        if self._ckpt is None:
            return None
        return self._ckpt.save(step, self.engine, dict, reason)


def _time_limit_state(margin_s: float | None) -> dict[str, Any]:
    deadline = checkpoint.job_deadline(_plan_dict() if in_hpcmem_job() else None)
    limit = (deadline - time.time()) if deadline is not None else 0.0
    return {"deadline": deadline, "margin_s": checkpoint.margin_s(max(limit, 0.0), margin_s), "requested": False,
            "deadline_saved": False, "asked_at": None, "save_cost_s": 0.0}


def hf_time_limit_callback(margin_s: float | None = None, *, signal_save: bool = True):
    """A ``transformers.TrainerCallback`` that makes the Trainer save a checkpoint before the job's time limit
    (once, ``margin_s`` before it, or twice the last save's duration if longer) and after a step during which
    SIGUSR1 arrived (Slurm's ``--signal=USR1@...``). The deadline is ``SLURM_JOB_END_TIME``, else the job's
    start plus the plan's ``time_min`` (inside an hpcmem job); without one only the signal saves."""
    from transformers import TrainerCallback

    class HpcmemTimeLimitCallback(TrainerCallback):
        def __init__(self):
            self.state = _time_limit_state(margin_s)

        def on_train_begin(self, args, state, control, **kwargs):
            if signal_save:
                def handler(signum, frame):
                    self.state["requested"] = True

                try:
                    signal.signal(signal.SIGUSR1, handler)
                except ValueError:  # not the main thread
                    pass
            return control

        def on_step_end(self, args, state, control, **kwargs):
            s = self.state
            policy = checkpoint.Policy(deadline=s["deadline"], margin_s=s["margin_s"])
            reason = policy.due(state.global_step, time.time(), time.time(), s["requested"], s["deadline_saved"],
                                s["save_cost_s"])
            if _any_rank(reason is not None):
                if reason == "time-limit":  # a signal save does not stand for it (Slurm's warning may come early)
                    s["deadline_saved"] = True
                s["requested"] = False
                s["asked_at"] = time.time()
                control.should_save = True
            return control

        def on_save(self, args, state, control, **kwargs):
            s = self.state
            if s["asked_at"] is not None:
                s["save_cost_s"] = time.time() - s["asked_at"]
                s["asked_at"] = None
            return control

    return HpcmemTimeLimitCallback()
