"""MemoryMonitor: what one rank used and how fast it trained, written to metrics files.

Per rank it records torch's CUDA peaks (``max_memory_allocated``/``max_memory_reserved``,
read once at the end: they are host-side counters), the device memory in use as
pynvml sees it and the process RSS, both sampled by a background thread (~10 Hz),
and the peak RSS the kernel kept (``ru_maxrss``). ``step(samples, loss)`` only reads
the clock: the caller's ``loss.item()`` already synchronised the device, so the
monitor adds no synchronisation of its own.

Per step (``begin_step(step, seq_len)`` ... ``step(samples, loss)``) it also records the batch's sequence length
and the step's peak memory: on a GPU ``max_memory_allocated`` with ``reset_peak_memory_stats`` at each step's
start (the run's own peaks are kept as running maxima), on a CPU the process RSS's peak within the step (the
sampling thread, and a reading at each step's end). The series is bounded (``peaks.SeriesRecorder``: at most
``peaks.SERIES_CAP`` evenly spaced steps, plus the last, the longest and the one in progress) and goes into the
rank record as ``step_peaks``; ``toolkit/peaks.py`` reads it (a long batch, a leak, a first-step failure).

On CUDA the allocator's history is recorded (``torch.cuda.memory._record_memory_history``, at most
``HISTORY_MAX_ENTRIES`` events; ``HPCMEM_MEMORY_HISTORY=0`` turns it off) and, when training ends in an
out-of-memory error, the snapshot is written to ``<attempt_dir>/memory-snapshot-rank<r>.pickle`` (open it at
https://pytorch.org/memory_viz; ``toolkit/triage/snapshot.py`` reads it). On a CPU nothing is recorded.
Python stacks go with each event only where the caller says the training runs no non-reentrant activation
checkpointing (``attach_device(device, stacks=True)``: the reference trainer without checkpointing): on an H100
with torch 2.11 a checkpointed backward with dropout died under stack recording ("SystemError: ... returned NULL
without setting an exception"; benchmarks/gpu_session/probe.py, benchmarks/results/gpu-session-20261127.txt), and
a user's script may checkpoint without saying so. ``drop_stacks()`` turns them off mid-run (before in-job
recovery turns checkpointing on); the events recorded so far stay.

The device memory NVML sees is sampled as nvidia-smi shows it (``devices.nvml_used_bytes``): this process's own
use where NVML lists it, else the device's use without the memory the driver reserves for itself.

Files: every rank writes ``<attempt_dir>/metrics/rank-<r>.json`` (also every few
seconds while running, so a job killed by the host's OOM killer leaves what it saw);
at a clean end rank 0 waits at a barrier and merges them into ``metrics.json``.
When training raises, the rank records ``status: failed`` and the error's first line,
merges what exists without waiting for the others, and the exception goes on.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from . import metrics
from ..devices import nvml_used_bytes
from .inflight import is_oom
from .jobenv import MIB, Ranks, ranks as env_ranks
from ..peaks import SeriesRecorder

SAMPLE_INTERVAL_S = 0.1
FLUSH_INTERVAL_S = 5.0
# A rank file written on another node may show up late on a shared filesystem.
RANK_FILE_WAIT_S = 10.0
HISTORY_MAX_ENTRIES = 20000
"""Allocator events kept for the OOM snapshot (a ring buffer; up to a few KB each with their stacks)."""
SNAPSHOT_FILE = "memory-snapshot-rank{rank}.pickle"


class MemoryMonitor:
    """Records one rank's memory and step times; a context manager or ``start()``/``stop()``.

    ``attempt_dir``: where metrics go (None: record and print only, write nothing).
    ``plan``: the plan dict echoed in metrics.json. ``warmup_steps``: steps left out
    of the timing. ``device``: the torch device the rank trains on (``attach_device``
    sets it later when it is chosen after the monitor starts).
    """

    def __init__(self, attempt_dir: str | os.PathLike | None = None, *, plan: Mapping[str, Any] | None = None,
                 warmup_steps: int = 1, device: Any = None, rank_info: Ranks | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S, flush_interval_s: float = FLUSH_INTERVAL_S):
        self.attempt_dir = Path(attempt_dir) if attempt_dir is not None else None
        self.plan = dict(plan) if plan is not None else None
        self.warmup_steps = warmup_steps
        self.ranks = rank_info or env_ranks()
        self.interval_s = interval_s
        self.flush_interval_s = flush_interval_s
        self.applied: dict[str, Any] = {}
        self.durations_s: list[float] = []
        self.samples: list[int] = []
        self.loss: float | None = None
        self._device = None
        self._cuda_index: int | None = None
        self._nvml = None  # (pynvml module, handle) when sampling device memory
        self._driver: str | None = None
        self._rss_peak = 0
        self._device_used_peak = 0
        self._peak_lock = threading.Lock()
        self._peak_generation = 0  # restart_peaks() bumps it: a sample taken before then is dropped
        self._proc = _psutil_process()
        self._pid = os.getpid()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_mark = time.perf_counter()
        self._started = False
        self._stopped = False
        self.result: dict[str, Any] | None = None
        # resume and checkpoint facts (docs/resume.md): resumed_from_step, checkpoint, resume, inflight_moves
        self.fields: dict[str, Any] = {"resumed_from_step": None, "checkpoint": None}
        self._series: SeriesRecorder | None = None
        self._step_rss_peak = 0
        self._cuda_run_peaks = [0, 0]  # max_memory_allocated / reserved of the steps already reset
        self.history_recording = False
        self.history_stacks = False
        self.snapshot_path: Path | None = None
        self._host = socket.gethostname()
        self._package_versions = metrics.versions()  # read once: package metadata costs milliseconds
        if device is not None:
            self.attach_device(device)

    # -- life cycle --------------------------------------------------------------

    def start(self) -> "MemoryMonitor":
        """Start sampling in a background thread; returns self."""
        if self._started:
            return self
        self._started = True
        self._sample()
        self._thread = threading.Thread(target=self._run, name="hpcmem-memory-monitor", daemon=True)
        self._thread.start()
        self._last_mark = time.perf_counter()
        return self

    def stop(self, error: BaseException | None = None) -> dict[str, Any] | None:
        """Stop sampling and write the metrics files. Returns this rank's record.

        With ``error`` the record says ``failed`` and the merge does not wait for the
        other ranks. Without it, and with a process group, all ranks meet at a
        barrier and rank 0 merges (its merged metrics are in ``self.result``).
        """
        if self._stopped:
            return self.result
        self._stopped = True
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sample()
        if error is not None:
            self._dump_snapshot(error)
        record = self.record(metrics.STATUS_FAILED if error else metrics.STATUS_OK, error)
        self._shutdown_nvml()
        if self.attempt_dir is None:
            self.result = record
            return record
        metrics.write_json_atomic(metrics.rank_file(self.attempt_dir, self.ranks.rank), record)
        if error is None:
            _barrier()
            if self.ranks.is_main:
                _wait_for_rank_files(self.attempt_dir, self.ranks.world_size)
                self.result = metrics.collect(self.attempt_dir, self.ranks.world_size, self.plan)
        else:
            # Any failing rank merges: rank 0 may be stuck in a collective or already gone.
            self.result = metrics.collect(self.attempt_dir, self.ranks.world_size, self.plan)
        return record

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and isinstance(exc, SystemExit) and exc.code in (0, None):
            exc = None
        self.stop(exc)
        return False  # never swallow the exception

    # -- what training code calls ------------------------------------------------

    def attach_device(self, device: Any, stacks: bool = False) -> None:
        """The torch device this rank trains on; starts pynvml sampling and the allocator's history on a GPU
        (with Python stacks only when ``stacks``: the caller knows no non-reentrant checkpointing runs)."""
        import torch

        self._device = torch.device(device)
        if self._device.type == "cuda":
            index = self._device.index if self._device.index is not None else torch.cuda.current_device()
            self._cuda_index = index
            self._nvml = _nvml_handle(index)
            self.history_recording = _start_history(torch, stacks)
            self.history_stacks = self.history_recording and stacks
            if self._nvml is not None:
                try:
                    self._driver = _text(self._nvml[0].nvmlSystemGetDriverVersion())
                except Exception:  # noqa: BLE001 - a missing figure, not a failure
                    self._driver = None

    def drop_stacks(self) -> None:
        """Record the allocator's history without stacks from now on (before activation checkpointing is turned
        on: see the module docstring). The events already recorded stay (torch >= 2.3 keeps them)."""
        if not self.history_stacks:
            return
        import torch

        self.history_stacks = False
        try:
            torch.cuda.memory._record_memory_history(**history_settings(False))
        except Exception as exc:  # noqa: BLE001 - without the history there is no snapshot, training goes on
            self.history_recording = False
            try:  # never stacks under checkpointing: off altogether
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                pass
            print(f"hpcmem: warning: the CUDA allocator's history is no longer recorded: {_first_line(exc)}",
                  file=sys.stderr, flush=True)

    def restart_peaks(self) -> None:
        """Forget the peaks so far (after an in-job move, once the failed try's memory is freed: its peak is not
        the new plan's)."""
        with self._peak_lock:
            self._peak_generation += 1
            self._device_used_peak = 0
            self._step_rss_peak = self._rss_now()
        self._cuda_run_peaks = [0, 0]
        if self._cuda_index is not None:
            import torch

            torch.cuda.reset_peak_memory_stats(self._cuda_index)

    def begin_steps(self) -> None:
        """Restart the step clock (call right before the training loop)."""
        self._last_mark = time.perf_counter()

    def begin_step(self, step: int, seq_len: int | None = None) -> None:
        """Optimizer step ``step`` begins with batches of ``seq_len`` tokens (the longest in the batch; None for
        inputs without a length). Resets the step's peak; a batch longer than every completed one (and than the
        plan's seq_len) writes the rank file at once, so a job the OOM killer ends still names it."""
        if self._series is None:
            plan_seq = (self.plan or {}).get("seq_len")
            self._series = SeriesRecorder("max_memory_allocated" if self._cuda_index is not None else "rss",
                                          plan_seq if isinstance(plan_seq, int) else None)
        if self._cuda_index is not None:
            import torch

            self._cuda_run_peaks = [max(self._cuda_run_peaks[0], torch.cuda.max_memory_allocated(self._cuda_index)),
                                    max(self._cuda_run_peaks[1], torch.cuda.max_memory_reserved(self._cuda_index))]
            torch.cuda.reset_peak_memory_stats(self._cuda_index)
        self._step_rss_peak = self._rss_now()
        longer = self._series.begin(step, seq_len)
        plan_seq = self._series.plan_seq_len
        if longer and plan_seq is not None and seq_len is not None and seq_len > plan_seq:
            self._write_now()

    def step(self, samples: int, loss: float) -> float:
        """Mark the end of one optimizer step of ``samples`` samples on this rank; returns its seconds."""
        if self._series is not None and self._series.current is not None:
            if self._cuda_index is not None:
                import torch

                peak = torch.cuda.max_memory_allocated(self._cuda_index) / MIB
            else:
                peak = max(self._step_rss_peak, self._rss_now()) / MIB
            self._series.end(peak)
        now = time.perf_counter()
        took = now - self._last_mark
        self._last_mark = now
        self.durations_s.append(took)
        self.samples.append(int(samples))
        self.loss = float(loss)
        return took

    def data_peak(self):
        """What this rank's step series shows so far (``peaks.PeakDiagnosis``; None before the first step): for
        code that answers an OOM inside the job, which should not answer a leak with a smaller micro-batch."""
        from ..peaks import analyse

        return analyse(self._series.to_dict(), rank=self.ranks.rank) if self._series is not None else None

    def note(self, key: str, value: Any, reason: str | None = None) -> None:
        """Record in metrics.json "applied" what the runtime did differently from the plan, and why.

        ``applied[key] = value``; the reason goes to ``applied["reasons"][key]``.
        """
        self.applied[key] = value
        if reason:
            self.applied.setdefault("reasons", {})[key] = reason

    def set_fields(self, **fields: Any) -> None:
        """Record resume facts in this rank's record (``resume`` also sets ``resumed_from_step``) and write the
        rank file now, so a job killed right after a save still says so."""
        if "resume" in fields:
            self.fields["resumed_from_step"] = (fields["resume"] or {}).get("resumed_from_step")
        self.fields.update(fields)
        self._write_now()

    def _write_now(self) -> None:
        """Write this rank's file now (while running)."""
        if self.attempt_dir is not None and self._started and not self._stopped:
            try:
                metrics.write_json_atomic(metrics.rank_file(self.attempt_dir, self.ranks.rank), self.record())
            except Exception:  # noqa: BLE001 - a full disk must not kill training
                pass

    @property
    def steps(self) -> int:
        return len(self.durations_s)

    def peak_rss_mib(self) -> float:
        """Peak resident memory of this process so far (MiB)."""
        return max(_ru_maxrss_bytes(), self._rss_peak) / MIB

    def peak_allocated_mib(self) -> float | None:
        """torch.cuda.max_memory_allocated on this rank's GPU (MiB), None on CPU."""
        if self._cuda_index is None:
            return None
        import torch

        return max(self._cuda_run_peaks[0], torch.cuda.max_memory_allocated(self._cuda_index)) / MIB

    def record(self, status: str = metrics.STATUS_RUNNING, error: BaseException | None = None) -> dict[str, Any]:
        """This rank's record as the rank file holds it."""
        summary = metrics.step_summary(list(self.durations_s), list(self.samples), self.warmup_steps)
        reserved = None
        if self._cuda_index is not None:
            import torch

            reserved = max(self._cuda_run_peaks[1], torch.cuda.max_memory_reserved(self._cuda_index)) / MIB
        record = {
            "rank": self.ranks.rank,
            "local_rank": self.ranks.local_rank,
            "world_size": self.ranks.world_size,
            "host": self._host,
            "pid": os.getpid(),
            "device": self._device.type if self._device is not None else "cpu",
            "status": status,
            "error": _first_line(error) if error is not None else None,
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "timed_steps": summary["timed_steps"],
            "samples_per_s": summary["samples_per_s"],
            "step_time_s": summary["step_time_s"],
            "loss": self.loss,
            "peak_allocated_mib": self.peak_allocated_mib(),
            "peak_reserved_mib": reserved,
            "device_used_mib": self._device_used_peak / MIB if self._nvml is not None else None,
            "peak_rss_mib": self.peak_rss_mib(),
            "applied": dict(self.applied),
            "step_peaks": self._series.to_dict() if self._series is not None else None,
            "memory_snapshot": str(self.snapshot_path) if self.snapshot_path is not None else None,
            "versions": self._versions(),
            **self.fields,
        }
        return record

    # -- sampling ----------------------------------------------------------------

    def _run(self) -> None:
        last_flush = time.monotonic()
        while not self._stop_event.wait(self.interval_s):
            self._sample()
            if self.attempt_dir is not None and time.monotonic() - last_flush >= self.flush_interval_s:
                last_flush = time.monotonic()
                try:
                    metrics.write_json_atomic(metrics.rank_file(self.attempt_dir, self.ranks.rank), self.record())
                except Exception:  # noqa: BLE001 - a full disk must not kill training
                    pass

    def _sample(self) -> None:
        generation = self._peak_generation
        rss = self._rss_now()
        used = None
        if self._nvml is not None:
            pynvml, handle = self._nvml
            try:
                used = nvml_used_bytes(pynvml, handle, self._pid)
            except Exception:  # noqa: BLE001
                pass
        with self._peak_lock:  # a reading taken across restart_peaks() belongs to the try that failed
            if generation != self._peak_generation:
                return
            self._rss_peak = max(self._rss_peak, rss)
            self._step_rss_peak = max(self._step_rss_peak, rss)
            if used is not None:
                self._device_used_peak = max(self._device_used_peak, used)

    def _rss_now(self) -> int:
        """The process's resident memory now (bytes; 0 without psutil)."""
        if self._proc is not None:
            try:
                return self._proc.memory_info().rss
            except Exception:  # noqa: BLE001
                self._proc = None
        return 0

    def _dump_snapshot(self, error: BaseException) -> None:
        """On an out-of-memory error with the allocator's history on: its snapshot into the attempt directory."""
        if not self.history_recording or self.attempt_dir is None or not is_oom(error):
            return
        try:
            import torch

            path = self.attempt_dir / SNAPSHOT_FILE.format(rank=self.ranks.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            self.snapshot_path = path
        except Exception as exc:  # noqa: BLE001 - the snapshot is a help, the OOM is what must be reported
            print(f"hpcmem: warning: no allocator snapshot: {_first_line(exc)}", file=sys.stderr, flush=True)

    def _shutdown_nvml(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml[0].nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass

    def _versions(self) -> dict[str, Any]:
        out = dict(self._package_versions)
        torch = sys.modules.get("torch")
        out["cuda"] = getattr(getattr(torch, "version", None), "cuda", None) if torch else None
        out["driver"] = self._driver
        return out


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _start_history(torch, stacks: bool) -> bool:
    """Record the CUDA allocator's history (bounded; Python stacks when ``stacks``) unless HPCMEM_MEMORY_HISTORY=0;
    True when on."""
    if os.environ.get("HPCMEM_MEMORY_HISTORY", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        torch.cuda.memory._record_memory_history(**history_settings(stacks))
        return True
    except Exception as exc:  # noqa: BLE001 - an older torch or a driver without it: no snapshot, training goes on
        print(f"hpcmem: warning: the CUDA allocator's history is not recorded: {_first_line(exc)}",
              file=sys.stderr, flush=True)
        return False


def history_settings(stacks: bool) -> dict[str, Any]:
    """``_record_memory_history``'s arguments: every event, with Python stacks or none (``context=None``)."""
    return {"max_entries": HISTORY_MAX_ENTRIES, **({"stacks": "python"} if stacks else {"context": None})}


def _ru_maxrss_bytes() -> int:
    # Linux reports KiB, macOS bytes.
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


def _psutil_process():
    try:
        import psutil

        return psutil.Process()
    except Exception:  # noqa: BLE001 - psutil is optional; ru_maxrss still gives the peak
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_handle(cuda_index: int):
    """(pynvml, handle) for torch's CUDA device ``cuda_index``, or None when pynvml is missing or fails.

    torch numbers devices after CUDA_VISIBLE_DEVICES; NVML numbers all of them, so
    the device is found by UUID, falling back to the visible-devices list.
    """
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
        for candidate in (uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}", uuid):
            try:
                return pynvml, pynvml.nvmlDeviceGetHandleByUUID(candidate)
            except Exception:  # noqa: BLE001
                continue
        from ..devices import visible_nvml_handle

        return pynvml, visible_nvml_handle(pynvml, cuda_index)
    except Exception:  # noqa: BLE001
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return None


def _barrier() -> None:
    """Wait for every rank when a process group exists (a failed barrier is not fatal here)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                import torch

                dist.barrier(device_ids=[torch.cuda.current_device()])  # NCCL needs to know the device
            else:
                dist.barrier()
    except Exception:  # noqa: BLE001 - merge what there is rather than lose the metrics
        pass


def _wait_for_rank_files(attempt_dir: Path, world_size: int) -> None:
    deadline = time.monotonic() + RANK_FILE_WAIT_S
    while time.monotonic() < deadline:
        done = [metrics.rank_file(attempt_dir, r) for r in range(world_size)]
        if all(p.exists() for p in done):
            records = metrics.read_rank_files(attempt_dir)
            if all(r.get("status") != metrics.STATUS_RUNNING for r in records):
                return
        time.sleep(0.1)
