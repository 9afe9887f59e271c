"""In-job recovery for the HF Trainer: an OOM in a micro-batch is answered by splitting it (docs/resume.md).

A ``TrainerCallback`` cannot catch an exception, but the Trainer calls ``training_step(model, inputs,
num_items_in_batch)`` once per micro-batch inside its accumulation loop, so this wraps that method:

    from toolkit import runtime
    Trainer = runtime.inflight_trainer(transformers.Trainer, monitor=mon)   # mon: a MemoryMonitor, optional
    trainer = Trainer(model=model, args=args, train_dataset=ds)

When a micro-batch's forward (or, in a single process, its backward with no gradient held yet) raises an OOM
(``inflight.is_oom``), the failed try is freed (its traceback frames cleared) and the same micro-batch is run again
as 2 pieces (then 4, ...) one after the other, with the same global batch: nothing of the earlier micro-batches of
the step is touched. Each piece's loss is scaled so the summed gradient is the unsplit micro-batch's: the Trainer
divides a mean loss by ``current_gradient_accumulation_steps``, which is set to ``steps * N / piece`` for the piece
(a loss normalised by ``num_items_in_batch`` already sums over the pieces and ignores it). Once split, every later
micro-batch is split the same way (the move is kept for the run), recorded like ``inflight.Recovery``'s moves
(``self.inflight_moves``; metrics.json ``inflight_moves`` and ``applied`` through the monitor) with one printed line.

Under DDP (world size > 1): the ranks agree after each micro-batch's forward, before its backward (whose
all-reduce a failed rank would never join): one all-reduce of "I failed" (``collectives.any_rank``), so every rank
splits the same way; the earlier pieces run under ``accelerator.no_sync`` and only the last syncs, if the
micro-batch was going to. An OOM in the backward under DDP, or in a single process once gradients of earlier
micro-batches are held (the failed backward may have added part of its gradient to them), is raised: the job ends
and the controller answers it. The switch is the job's (``HPCMEM_INFLIGHT``, ``inflight.enabled()``); under
DeepSpeed or FSDP the wrapper stands aside (as ``inflight.Recovery`` does, see its docstring).
"""

from __future__ import annotations

import contextlib
import gc
import traceback
from typing import Any

from ..errors import HpcmemError
from . import collectives, inflight


_PeerOOM = inflight.PeerOOM
_world_size = collectives.world_size


def split_inputs(inputs: Any, pieces: int) -> list[Any] | None:
    """``inputs`` (a mapping of tensors with the batch on dim 0; other values are passed to every piece) in
    ``pieces`` consecutive near-equal pieces (pure); None when it has no batch to split that far."""
    import torch

    if not hasattr(inputs, "items"):
        return None
    sizes = {v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) != 1:
        return None
    (n,) = sizes
    if n < pieces:
        return None
    out: list[dict[str, Any]] = [dict() for _ in range(pieces)]
    for key, value in inputs.items():
        parts = (torch.tensor_split(value, pieces, dim=0) if isinstance(value, torch.Tensor) and value.dim() > 0
                 else [value] * pieces)
        for piece, part in zip(out, parts):
            piece[key] = part
    return out


def _batch_size(inputs: Any) -> int:
    import torch

    for v in inputs.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 0


class InflightTrainingStep:
    """Mixin for a ``transformers.Trainer`` subclass (put it first): ``training_step`` answers an OOM by
    splitting the micro-batch (see the module's docstring). Class attributes: ``inflight_enabled`` (None: the
    job's switch), ``inflight_monitor`` (a MemoryMonitor or None), ``inflight_log`` (prints one line)."""

    inflight_enabled: bool | None = None
    inflight_monitor: Any = None
    inflight_log: Any = print

    def _inflight_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_hpcmem_inflight")
        if state is None:
            on = inflight.enabled() if self.inflight_enabled is None else bool(self.inflight_enabled)
            # DeepSpeed's engine counts its own micro-steps and FSDP gathers inside the forward (docs/resume.md):
            # left to the controller
            kind = str(getattr(getattr(self, "accelerator", None), "distributed_type", ""))
            on = on and "DEEPSPEED" not in kind.upper() and "FSDP" not in kind.upper()
            state = {"on": on, "pieces": 1, "agree": False, "phase": None}
            self.__dict__["_hpcmem_inflight"] = state
            self.inflight_moves: list[dict[str, Any]] = []
        return state

    def compute_loss(self, model, inputs, *args, **kwargs):
        result = super().compute_loss(model, inputs, *args, **kwargs)
        state = self.__dict__.get("_hpcmem_inflight")
        if state is not None and state["phase"] == "forward":
            if state["agree"] and collectives.any_rank(False):  # the agreement, before the backward's all-reduce
                del result
                raise _PeerOOM()
            state["phase"] = "backward"
        return result

    def training_step(self, model, inputs, num_items_in_batch=None):
        state = self._inflight_state()
        if not state["on"]:
            return super().training_step(model, inputs, num_items_in_batch)
        state["agree"] = _world_size() > 1
        n = _batch_size(inputs)
        pending = (split_inputs(inputs, state["pieces"]) if state["pieces"] > 1 else None) or [inputs]
        syncs = bool(getattr(model, "require_backward_grad_sync", False))  # DDP outside a no_sync context
        total = None
        while pending:
            try:
                loss = self._inflight_piece(model, pending[0], num_items_in_batch, n, syncs and len(pending) > 1)
            except BaseException as exc:  # noqa: BLE001 - only an OOM in a forward is answered
                phase, state["phase"] = state["phase"], None
                peer = isinstance(exc, _PeerOOM)
                if not peer and not inflight.is_oom(exc):
                    raise
                if not peer and phase != "forward" and (state["agree"] or not state["grads_were_empty"]):
                    # the backward may have added part of this piece's gradient to what earlier ones hold, or
                    # another rank waits in its all-reduce: not answerable here
                    raise
                if not peer and state["agree"]:
                    collectives.any_rank(True)  # joins the others' agreement after their forward
                reason = "out of memory on another rank" if peer else inflight.first_line(exc)
                if exc.__traceback__ is not None:  # the failed try's frames hold its activations
                    traceback.clear_frames(exc.__traceback__)
                    exc.__traceback__ = None
                if not peer and phase != "forward":
                    model.zero_grad(set_to_none=True)  # nothing was held before this piece: drop its part
                halves = [split_inputs(p, 2) for p in pending]
                if halves[0] is None:  # micro-batch 1 (or no batch dimension): no in-job move is left
                    if peer:
                        raise HpcmemError(f"out of memory on another rank at micro-batch {_batch_size(pending[0])}"
                                          ": no in-job move is left") from None
                    raise exc
                del exc
                self._inflight_move(n, reason)
                pending = [q for h, p in zip(halves, pending) for q in (h or [p])]
                gc.collect()
                if getattr(getattr(self.args, "device", None), "type", None) == "cuda":
                    import torch

                    torch.cuda.empty_cache()
                if self.inflight_monitor is not None:  # once the failed try's memory is back: its peak is not ours
                    self.inflight_monitor.restart_peaks()
                continue
            pending.pop(0)
            total = loss if total is None else total + loss
        return total

    def _inflight_piece(self, model, part, num_items_in_batch, n: int, no_sync: bool):
        """One piece's forward and backward; a mean loss is divided by the accumulation steps: N/piece times
        more of them for a piece of the micro-batch N, so the pieces' gradients sum to the micro-batch's."""
        state = self.__dict__["_hpcmem_inflight"]
        state["grads_were_empty"] = all(p.grad is None for p in model.parameters())
        steps = self.current_gradient_accumulation_steps
        size = _batch_size(part)
        if size != n:
            self.current_gradient_accumulation_steps = steps * n / size
        try:
            with (self.accelerator.no_sync(model=model) if no_sync else contextlib.nullcontext()):
                state["phase"] = "forward"
                loss = super().training_step(model, part, num_items_in_batch)
                state["phase"] = None
        finally:
            self.current_gradient_accumulation_steps = steps
        return loss

    def _inflight_move(self, n: int, reason: str) -> None:
        state = self.__dict__["_hpcmem_inflight"]
        pieces = state["pieces"] * 2
        accum = int(self.args.gradient_accumulation_steps)
        old_micro, new_micro = -(-n // state["pieces"]), -(-n // pieces)
        step = int(self.state.global_step) + 1
        kind = "gpu_oom" if getattr(getattr(self.args, "device", None), "type", None) == "cuda" else "cpu_alloc_oom"
        move = {"step": step, "verdict": {"kind": kind, "reason": reason},
                "from": {"micro_batch": old_micro, "grad_accum": accum * state["pieces"], "checkpointing": False},
                "to": {"micro_batch": new_micro, "grad_accum": accum * pieces, "checkpointing": False},
                "global_batch": n * accum * _world_size()}
        state["pieces"] = pieces
        self.inflight_moves.append(move)
        monitor = self.inflight_monitor
        if monitor is not None:
            why = f"in-job move after an out-of-memory error in step {step}: the same global batch"
            monitor.note("micro_batch", new_micro, why)
            monitor.note("grad_accum", accum * pieces, why)
            monitor.set_fields(inflight_moves=list(self.inflight_moves))
        if self.inflight_log is not None and self.is_world_process_zero():
            self.inflight_log(f"hpcmem: out of memory in step {step} ({reason}); in-job move: micro_batch "
                              f"{old_micro} x grad_accum {accum * pieces // 2} -> {new_micro} x {accum * pieces} "
                              f"(global {move['global_batch']}), micro-batch re-run in {pieces} pieces")


def inflight_trainer(trainer_cls: type, *, monitor: Any = None, enabled: bool | None = None,
                     log: Any = print) -> type:
    """A subclass of ``trainer_cls`` (``transformers.Trainer`` or a subclass) whose ``training_step`` answers an
    OOM by splitting the micro-batch (see the module's docstring). ``monitor``: a MemoryMonitor that records the
    moves in metrics.json; ``enabled``: None follows the job's switch (``HPCMEM_INFLIGHT``)."""
    return type(f"Inflight{trainer_cls.__name__}", (InflightTrainingStep, trainer_cls),
                {"inflight_monitor": monitor, "inflight_enabled": enabled, "inflight_log": staticmethod(log)
                 if log is not None else None})
