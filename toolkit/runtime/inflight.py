"""In-job recovery from an out-of-memory error: answer it in the same process, re-run the step (docs/resume.md).

One implementation, used by the reference trainer (``python -m toolkit.train``) and by a user's plain-PyTorch loop:

    recovery = inflight.Recovery(plan, ranks=jobenv.ranks(), device=device)
    for step in range(1, steps + 1):
        recovery.run_step(step, lambda plan: one_step(model, plan), rewind=..., discard=...)
        optimizer.step(); optimizer.zero_grad()

``run_step`` runs the step's micro-batch loop (``step_fn(plan)``, which reads ``plan.micro_batch`` and
``plan.grad_accum``); when it raises an out-of-memory error on any rank, every rank agrees (one all-reduce of
"I failed": MAX), the partial step is discarded (``discard``: gradients zeroed, what the step held freed), the
step's data position and RNG are rewound (``rewind``), the next in-job move is applied and the step runs again.

The moves, in order, none needing a new process (all keep the global batch):

1. ``micro_batch`` halved (to the largest divisor of the rank's share of the global batch at most half of it),
   ``grad_accum`` up to keep the global batch;
2. at micro-batch 1: activation checkpointing on (``checkpointing``), when the caller can turn it on in the running
   model (``enable_checkpointing``; an HF model's ``gradient_checkpointing_enable``);
3. nothing left: the error is raised, the job ends, the controller's resubmit answers it (precision, ZeRO/FSDP,
   offload, more memory, more GPUs need a new process or allocation).

The allocator setting (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) is not a move here: CUDA's caching
allocator reads the variable once, at its first use, so setting it after an OOM changes nothing; torch's private
``torch.cuda.memory._set_allocator_settings`` can switch it for segments allocated afterwards, but that is a
private API, and it was not tested here (no GPU on the machines this was written on): left to the controller's
``alloc_conf`` rung (a new process reads it).

The switch: on by default; ``HPCMEM_INFLIGHT=0`` (the rendered job sets it when the spec says
``retry: {inflight: false}``) or the trainer's ``--inflight-recovery false`` turns it off.

Limits (why FSDP and DeepSpeed are left to the controller): FSDP2 all-gathers parameters inside each block's
forward and reduce-scatters inside backward, so a rank that fails in forward leaves the others waiting in a
collective it will never join; the agreement below comes after the micro-batch loop and cannot reach them.
Unless every rank fails in the same collective-free place (the rehearsal before the forward), the ranks
deadlock until the process group's timeout. That was not proven safe with a real two-rank run, so FSDP is not
recovered in the job. DeepSpeed's engine owns its micro-batch loop and gradient accumulation boundary.
"""

from __future__ import annotations

import gc
import os
import traceback
from typing import Any, Callable, Mapping

from ..errors import ConfigError, HpcmemError
from ..plan import Plan, with_changes
from .collectives import any_rank, world_size

ENV_INFLIGHT = "HPCMEM_INFLIGHT"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether in-job recovery is on: ``HPCMEM_INFLIGHT`` (default on); a value that is not a boolean is an error."""
    value = (os.environ if env is None else env).get(ENV_INFLIGHT, "").strip().lower()
    if not value or value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{ENV_INFLIGHT}={value[:40]!r}: expected true or false (1/0, yes/no, on/off)")


_switch = enabled


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error an in-job move can answer: CUDA's OutOfMemoryError, the CPU allocator's
    "can't allocate memory" (an address-space cap), Python's MemoryError. (A cgroup's OOM killer sends SIGKILL:
    nothing to catch.)"""
    import torch

    if isinstance(exc, (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)):
        return True
    dist_error = getattr(getattr(torch, "distributed", None), "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return False  # NCCL's own "Cuda failure 'out of memory'": its communicator is broken, no step re-runs
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


REASON_CHARS = 1000
"""How much of an error's first line an in-job move keeps: all of a CUDA OOM message (about 650 characters with
torch 2.11's memory-fraction clause and documentation link), whose numbers triage reads back from the log."""


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:REASON_CHARS]}" if lines else type(exc).__name__


def smaller_micro_batch(plan: Plan) -> int | None:
    """The largest micro-batch at most half the plan's that divides the rank's share of the global batch
    (so the global batch stays the same); None at micro-batch 1."""
    per_rank = plan.global_batch // max(1, plan.world_size)
    for micro in range(plan.micro_batch // 2, 0, -1):
        if per_rank % micro == 0:
            return micro
    return None


def next_move(plan: Plan, *, can_checkpoint: bool) -> dict[str, Any] | None:
    """The next in-job change of ``plan`` (pure): a smaller micro-batch, then activation checkpointing; None when
    no in-job move is left."""
    micro = smaller_micro_batch(plan)
    if micro is not None:
        return {"micro_batch": micro}
    if can_checkpoint and not plan.checkpointing:
        return {"checkpointing": True}
    return None


MOVE_KNOBS = ("micro_batch", "grad_accum", "checkpointing")
"""What an in-job move may change, as recorded in each move's ``from`` and ``to``."""


def plan_after_moves(plan: Plan, moves: list[Mapping[str, Any]] | None) -> Plan:
    """The plan an attempt ended with: its recorded plan with its in-job moves applied (pure). The controller
    starts the next attempt's plan from it, so a resubmit never goes back to what already failed in the job."""
    if not moves:
        return plan
    to = moves[-1].get("to") or {}
    changes = {k: to[k] for k in MOVE_KNOBS if k in to and to[k] != getattr(plan, k)}
    if not changes:
        return plan
    try:
        return plan.replace(**changes)
    except (HpcmemError, TypeError, ValueError):  # not a move of ours (it would change the global batch): ignored
        return plan


def move_text(move: Mapping[str, Any]) -> str:
    """One in-job move (metrics.json ``inflight_moves``) in a line: its step, verdict kind and what changed."""
    before, after = move.get("from") or {}, move.get("to") or {}
    if not isinstance(before, Mapping) or not isinstance(after, Mapping):
        before, after = {}, {}
    changed = ", ".join(f"{k} {before.get(k)} -> {v}" for k, v in after.items() if before.get(k) != v)
    verdict = move.get("verdict") if isinstance(move.get("verdict"), Mapping) else {}
    kind = verdict.get("kind")
    return (f"in-job move at step {move.get('step')}" + (f" [{kind}]" if kind else "")
            + (f": {changed}" if changed else ""))


class PeerOOM(Exception):
    """Another rank ran out of memory in this micro-batch's forward: this rank drops its try too."""


class Recovery:
    """Runs steps, answering an OOM inside the job (see the module's docstring).

    ``enabled``: None (the default) follows the job's switch (``HPCMEM_INFLIGHT``, on unless the spec says
    ``retry: {inflight: false}``).
    ``enable_checkpointing``: a function turning on activation checkpointing in the running model (None: that
    move is not offered). ``on_move(move, new_plan)``: called on every rank after a move (e.g. to record it).
    ``log``: prints one line (the caller chooses which ranks print).
    ``data_peak``: what the rank's step series shows (``MemoryMonitor.data_peak``, a ``peaks.PeakDiagnosis``);
    when any rank's series shows a leak, no in-job move is made and the error ends the job: a smaller
    micro-batch only postpones a leak, and the controller answers it with the code remedy (docs/resume.md)."""

    def __init__(self, plan: Plan, *, device=None, enabled: bool | None = None,
                 enable_checkpointing: Callable[[], None] | None = None,
                 on_move: Callable[[dict[str, Any], Plan], None] | None = None,
                 log: Callable[[str], None] | None = None,
                 data_peak: Callable[[], Any] | None = None):
        self.data_peak = data_peak
        self.plan, self.device = plan, device
        self.enabled = _switch() if enabled is None else enabled
        self.enable_checkpointing, self.on_move, self.log = enable_checkpointing, on_move, log
        self.moves: list[dict[str, Any]] = []
        self._phase = "forward"

    def forward_done(self) -> None:
        """Call after each micro-batch's forward, before its backward. Over several ranks this is where they agree
        whether any ran out of memory in its forward (one all-reduce, which a rank that did joins from
        ``run_step``): DDP's backward all-reduces then never meet a rank that left the step (a ``PeerOOM``
        here)."""
        self._phase = "backward"
        if self.enabled and world_size() > 1 and any_rank(False, self.device):
            raise PeerOOM()

    def backward_done(self) -> None:
        """Call after each micro-batch's backward."""
        self._phase = "forward"

    def capture(self, generator=None) -> tuple:
        """The state to rewind a step to: torch's CPU RNG, the CUDA generators' (dropout on a GPU draws from
        them) and the data generator's state."""
        import torch

        if not self.enabled:
            return ()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return (torch.get_rng_state(), generator.get_state() if generator is not None else None, cuda)

    @staticmethod
    def restore(state: tuple, generator=None) -> None:
        import torch

        if not state:
            return
        torch.set_rng_state(state[0])
        if generator is not None and state[1] is not None:
            generator.set_state(state[1])
        if len(state) > 2 and state[2] is not None:
            torch.cuda.set_rng_state_all(state[2])

    def run_step(self, step: int, step_fn: Callable[[Plan], Any], *, discard: Callable[[], None] | None = None,
                 rewind: Callable[[], None] | None = None) -> Any:
        """Run ``step_fn(self.plan)`` (the step's micro-batch loop), answering an OOM: returns its result once a
        try succeeded on every rank. ``discard``: drop the partial step (zero the gradients, free what it held);
        ``rewind``: put the data position and RNG back to the step's start. Off: one plain call.

        Over several ranks ``step_fn`` calls ``forward_done`` / ``backward_done`` around each backward: an OOM in
        a forward is agreed on there and answered; one in a backward is raised (another rank may be waiting in
        that backward's all-reduce: the controller answers it)."""
        if not self.enabled:
            return step_fn(self.plan)
        while True:
            failed: BaseException | None = None
            result = None
            peer = False
            self._phase = "forward"
            try:
                result = step_fn(self.plan)
            except PeerOOM:
                peer = True  # agreed in forward_done: no second all-reduce
            except BaseException as exc:  # noqa: BLE001 - only an OOM is answered; the rest is raised
                if not is_oom(exc):
                    raise
                if self._phase == "backward" and world_size() > 1:
                    raise
                failed = exc
            if not peer and not any_rank(failed is not None, self.device):
                return result
            result = None
            self._answer(step, failed, discard, rewind)

    def _leaking(self) -> bool:
        """Whether any rank's step series shows a leak (every rank calls this: one all-reduce)."""
        diagnosis = self.data_peak() if self.data_peak is not None else None
        return any_rank(getattr(diagnosis, "case", None) == "leak", self.device)

    def _answer(self, step: int, error: BaseException | None, discard, rewind) -> None:
        plan = self.plan
        if self._leaking():
            if self.log:
                self.log(f"out of memory at step {step}: the step series shows a leak; no in-job move answers it")
            if error is not None:
                raise error
            raise HpcmemError(f"out of memory at step {step} on another rank, whose step series shows a leak: "
                              "no in-job move answers it")
        changes = next_move(plan, can_checkpoint=self.enable_checkpointing is not None)
        if changes is None:
            if error is not None:
                raise error
            raise HpcmemError(f"out of memory at step {step} on another rank with micro_batch {plan.micro_batch}"
                              f"{' and checkpointing' if plan.checkpointing else ''}: no in-job move is left")
        reason = first_line(error) if error is not None else "out of memory on another rank"
        if error is not None and error.__traceback__ is not None:
            # The failed try's frames (its loss, hence its activations) live on in the traceback: free them first.
            traceback.clear_frames(error.__traceback__)
            error.__traceback__ = None
        del error
        if discard:
            discard()
        gc.collect()
        if getattr(self.device, "type", None) == "cuda":
            import torch

            torch.cuda.empty_cache()
        new = with_changes(plan, changes)
        if "checkpointing" in changes:
            self.enable_checkpointing()
        kind = "gpu_oom" if getattr(self.device, "type", None) == "cuda" else "cpu_alloc_oom"
        move = {"step": step, "verdict": {"kind": kind, "reason": reason},
                "from": {k: getattr(plan, k) for k in MOVE_KNOBS}, "to": {k: getattr(new, k) for k in MOVE_KNOBS},
                "global_batch": new.global_batch}
        self.moves.append(move)
        self.plan = new
        if rewind:
            rewind()
        if self.on_move:
            self.on_move(move, new)
        if self.log:
            what = ("activation checkpointing on" if "checkpointing" in changes else
                    f"micro_batch {plan.micro_batch} x grad_accum {plan.grad_accum} -> {new.micro_batch} x "
                    f"{new.grad_accum}")
            self.log(f"hpcmem: out of memory in step {step} ({reason}); in-job move: {what} "
                     f"(global {new.global_batch}), step re-run")
