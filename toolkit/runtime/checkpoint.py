"""Checkpoints a run's attempts share: where they live, how one is written atomically, which one to resume.

A run owns one directory (``HPCMEM_CHECKPOINT_DIR``, ``runs/<id>/checkpoints``); every attempt writes into it
and the next attempt resumes from the newest *complete* save (docs/resume.md)::

    checkpoints/
      step-00000012/          a complete save: the ``complete`` marker is written last, then the directory is renamed
        complete              JSON: step, format, layout, the files and their sizes, time, attempt
        rank-00000.pt         per rank: torch/CUDA/python RNG, the data generator's state, the grad scaler
        state.pt | dcp/ | ds/ the engine's part (a full state_dict, torch.distributed.checkpoint shards, DeepSpeed's)
      .partial-step-00000013-<token>/   being written, or left by a killed job: skipped, never deleted

Writing (``begin``/``commit``): every rank writes into the same temporary directory; after a barrier rank 0
fsyncs every file, writes the marker, fsyncs, renames the directory to ``step-<n>`` and fsyncs the parent.
Reading (``candidates``/``newest``): complete saves newest first; one whose marker is unreadable or whose files
are missing or of another size than the marker says is skipped with a warning (and kept on disk).

Pure apart from the file system: no torch at import time.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .collectives import any_rank

ENV_CHECKPOINT_DIR = "HPCMEM_CHECKPOINT_DIR"
MARKER = "complete"
PREFIX = "step-"
PARTIAL = ".partial-"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d{8,})")

# Engine formats: which engines can read which saves (conversion where torch.distributed.checkpoint allows it).
FORMAT_FULL = "full"        # DDP / single process: one full state_dict (model + FQN-keyed optimizer) by rank 0
FORMAT_DCP = "dcp"          # FSDP2: torch.distributed.checkpoint, sharded, reshardable on load
FORMAT_DEEPSPEED = "deepspeed"  # engine.save_checkpoint: per-rank ZeRO partitions
FORMAT_ACCELERATE = "accelerate"  # accelerator.save_state in a user's loop (userloops.py)


def warn(text: str) -> None:
    print(f"hpcmem: warning: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Saved:
    """One complete save on disk."""

    path: Path
    step: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def format(self) -> str:
        return str(self.meta.get("format", ""))

    @property
    def layout(self) -> dict[str, Any]:
        return dict(self.meta.get("layout") or {})

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step}


def step_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def checkpoint_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """``HPCMEM_CHECKPOINT_DIR`` (None when unset)."""
    value = (os.environ if env is None else env).get(ENV_CHECKPOINT_DIR, "").strip()
    return Path(value) if value else None


# -- reading ---------------------------------------------------------------------------------------------------

def read_marker(path: Path) -> dict[str, Any]:
    """The marker of save ``path``; ValueError saying what is wrong (missing, not JSON, files missing or resized)."""
    marker = path / MARKER
    try:
        meta = json.loads(marker.read_text())
    except FileNotFoundError:
        raise ValueError("no 'complete' marker (a partial save)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"its marker is unreadable ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or not isinstance(meta.get("files"), dict):
        raise ValueError("its marker is not a checkpoint marker (step, files)")
    for rel, size in meta["files"].items():
        target = path / rel
        try:
            actual = target.stat().st_size
        except OSError:
            raise ValueError(f"{rel} is missing") from None
        if actual != size:
            raise ValueError(f"{rel} has {actual} bytes, the marker says {size} (truncated or overwritten)")
    return meta


def candidates(root: Path, *, report: Callable[[str], None] | None = warn) -> list[Saved]:
    """The complete, intact saves under ``root``, newest step first. Partial and damaged ones are skipped with a
    warning through ``report`` (None: silently); nothing is deleted."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[Saved] = []
    for entry in root.iterdir():
        m = _STEP_DIR.fullmatch(entry.name)
        if not m or not entry.is_dir():
            if entry.name.startswith(PARTIAL) and report:
                report(f"checkpoint {entry} is a partial save (interrupted while written): skipped, kept")
            continue
        try:
            meta = read_marker(entry)
        except ValueError as exc:
            if report:
                report(f"checkpoint {entry}: {exc}: skipped, kept")
            continue
        if meta["step"] != int(m.group(1)):
            if report:
                report(f"checkpoint {entry}: its marker says step {meta['step']}: skipped, kept")
            continue
        found.append(Saved(entry, meta["step"], meta))
    return sorted(found, key=lambda s: s.step, reverse=True)


def newest(root: Path, *, report: Callable[[str], None] | None = warn) -> Saved | None:
    """The newest complete save under ``root`` (None when there is none)."""
    found = candidates(root, report=report)
    return found[0] if found else None


# -- compatibility ---------------------------------------------------------------------------------------------

def layout_of(plan: Mapping[str, Any], engine_format: str) -> dict[str, Any]:
    """What a save's engine part depends on: its format, world size, ZeRO stage, optimizer, precision."""
    return {"format": engine_format, "launcher": plan.get("launcher"), "world_size": plan.get("world_size"),
            "zero_stage": plan.get("zero_stage", 0), "optimizer": plan.get("optimizer"),
            "precision": plan.get("precision")}


def readable(saved: Mapping[str, Any], now: Mapping[str, Any], full_copy: bool = False) -> str | None:
    """Why a save with layout ``saved`` cannot be resumed by a job of layout ``now`` (None: it can).

    ``full_copy``: the save holds a full state (``state.pt``: DDP's own save, or the layout-free copy a DeepSpeed
    save carries when the model is small enough). Full state_dicts and torch.distributed.checkpoint saves
    convert into DDP and FSDP of any world size (the state_dict API reshards them); a full state also loads into
    DeepSpeed ZeRO-1/2/3 of any world size (DeepSpeed's tensor-fragment API), and so does an FSDP2 save once its
    shards are consolidated (strategies/deepspeed.py: ``consolidated_dcp``). A DeepSpeed save without a full
    copy loads into DeepSpeed of the same world size and ZeRO stage, or between ZeRO-1/2 layouts through
    DeepSpeed's universal checkpoint. The optimizer's state has its optimizer's shape: another optimizer cannot
    take it.
    """
    fmt, engine = saved.get("format"), now.get("format")
    full_copy = full_copy or fmt == FORMAT_FULL
    if saved.get("optimizer") != now.get("optimizer"):
        return (f"it holds {saved.get('optimizer')} optimizer state and this attempt runs {now.get('optimizer')}: "
                "optimizer state does not convert between optimizers")
    torch_formats = (FORMAT_FULL, FORMAT_DCP)
    zero_now = now.get("zero_stage") in (1, 2, 3)
    if fmt in torch_formats and engine in torch_formats:
        return None
    if fmt == FORMAT_DEEPSPEED and engine == FORMAT_DEEPSPEED:
        if all(saved.get(k) == now.get(k) for k in ("world_size", "zero_stage")):
            return None
        if full_copy and zero_now:
            return None
        # Another world size or ZeRO 1 <-> 2: DeepSpeed's universal checkpoint (strategies/deepspeed.py) converts.
        if saved.get("zero_stage") in (1, 2) and now.get("zero_stage") in (1, 2):
            return None
        return (f"a DeepSpeed save of ZeRO-{saved.get('zero_stage')} x{saved.get('world_size')} without a full "
                f"copy (state.pt: too large to gather, or ZeRO-0) does not load into ZeRO-{now.get('zero_stage')} "
                f"x{now.get('world_size')}: DeepSpeed's universal checkpoint converts between ZeRO-1/2 layouts "
                "only (its ZeRO-3 loader fails on a ZeRO-2 save in DeepSpeed 0.19.8: KeyError "
                "'optimizer_state_dict') and stage 0 has no partitions to convert")
    if fmt == FORMAT_DEEPSPEED and engine in torch_formats:
        if full_copy:
            return None
        return (f"a DeepSpeed save (ZeRO-{saved.get('zero_stage')}) without a full copy (state.pt: too large to "
                f"gather, or ZeRO-0) does not convert into {engine} ({now.get('launcher')})")
    if fmt in torch_formats and engine == FORMAT_DEEPSPEED:
        if zero_now:
            return None
        return f"a {fmt} save loads into DeepSpeed ZeRO-1/2/3 only (ZeRO-0 has no fragment API to set it through)"
    if fmt == FORMAT_ACCELERATE and engine == FORMAT_ACCELERATE:
        # accelerate's save_state: full model and optimizer under DDP, but its own shards under FSDP/DeepSpeed.
        if all(saved.get(k) == now.get(k) for k in ("launcher", "world_size", "zero_stage")):
            return None
        return (f"an Accelerate save of {saved.get('launcher')} x{saved.get('world_size')} is resumed only by the "
                f"same launcher and world size (this attempt: {now.get('launcher')} x{now.get('world_size')})")
    return (f"a {fmt} save ({saved.get('launcher')}) does not convert into {engine} ({now.get('launcher')}): "
            "DDP and FSDP saves convert into each other (torch.distributed.checkpoint) and into DeepSpeed "
            "ZeRO-1/2/3, a DeepSpeed save with its full copy into any of them")


def has_full_copy(saved: Saved) -> bool:
    """Whether the save holds a full state (``state.pt``, listed in its marker)."""
    return STATE_FILE in (saved.meta.get("files") or {})


def choose(found: list[Saved], now: Mapping[str, Any], *, report: Callable[[str], None] | None = warn
           ) -> tuple[Saved | None, list[str]]:
    """The newest save this layout can read, and why each newer one was passed over."""
    passed: list[str] = []
    for saved in found:
        why = readable(saved.layout, now, full_copy=has_full_copy(saved))
        if why is None:
            return saved, passed
        passed.append(f"step {saved.step}: {why}")
        if report:
            report(f"checkpoint {saved.path} not resumed: {why}")
    return None, passed


# -- writing ---------------------------------------------------------------------------------------------------

def partial_name(step: int, token: str | None = None) -> str:
    return f"{PARTIAL}{step_name(step)}-{token or secrets.token_hex(4)}"


def begin(root: Path, step: int, token: str | None = None) -> Path:
    """Create the temporary directory a save of ``step`` is written into (rank 0 calls this)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / partial_name(step, token)
    tmp.mkdir()
    return tmp


def _files(directory: Path) -> Iterator[Path]:
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            yield Path(dirpath) / name


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, step: int, meta: Mapping[str, Any]) -> Saved:
    """Make the save in ``tmp`` complete: fsync its files, write the marker (with every file's size), fsync, rename
    to ``step-<n>`` and fsync the parent. Raises FileExistsError when ``step-<n>`` already exists (kept)."""
    tmp = Path(tmp)
    files: dict[str, int] = {}
    for path in sorted(_files(tmp)):
        _fsync_path(path)
        files[str(path.relative_to(tmp))] = path.stat().st_size
    for dirpath, _dirs, _names in os.walk(tmp):
        _fsync_path(Path(dirpath), directory=True)
    record = {**meta, "step": step, "files": files, "version": FORMAT_VERSION, "time": time.time()}
    marker = tmp / MARKER
    with open(marker, "w") as fh:
        json.dump(record, fh, indent=1, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_path(tmp, directory=True)
    final = tmp.parent / step_name(step)
    if final.exists():
        raise FileExistsError(f"{final} exists")
    os.rename(tmp, final)
    _fsync_path(tmp.parent, directory=True)
    return Saved(final, step, record)


def prune(root: Path, keep: int, *, report: Callable[[str], None] | None = None) -> list[Path]:
    """Remove complete saves beyond the ``keep`` newest (0: keep all). Partial and damaged saves are never removed
    (they are evidence), nor anything that is not a ``step-<n>`` directory. Returns what was removed."""
    import shutil

    if keep <= 0:
        return []
    removed = []
    for saved in candidates(root, report=None)[keep:]:
        shutil.rmtree(saved.path, ignore_errors=True)
        removed.append(saved.path)
        if report:
            report(f"removed old checkpoint {saved.path} (--checkpoint-keep {keep})")
    return removed


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.pt"


# -- state digests (layout-independent: the same for a full state_dict and its shards gathered) -----------------

def state_digest(model_sd: Mapping[str, Any], optim_sd: Mapping[str, Any] | None) -> dict[str, str]:
    """sha256 over the model's tensors (by name) and the optimizer's per-parameter state (by parameter FQN and
    key), each tensor as contiguous CPU bytes with its dtype and shape: equal digests mean bitwise-equal state."""
    import hashlib

    def tensor_bytes(h, value) -> None:
        import torch

        if isinstance(value, torch.Tensor):
            t = value.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            t = t.cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(value).encode())

    out = {}
    h = hashlib.sha256()
    for name in sorted(model_sd):
        h.update(name.encode())
        tensor_bytes(h, model_sd[name])
    out["model"] = h.hexdigest()
    if optim_sd is not None:
        h = hashlib.sha256()
        state = optim_sd.get("state", {})
        for name in sorted(state, key=str):
            for key in sorted(state[name]):
                h.update(f"{name}/{key}".encode())
                tensor_bytes(h, state[name][key])
        out["optimizer"] = h.hexdigest()
    return out


# -- the runtime side: when to save, saving, resuming (inside the job) ---------------------------------------------

SAVE_REQUEST = "save-request"
"""A file in the attempt directory (``HPCMEM_ATTEMPT_DIR``) asking for a save: the rendered script's USR1 trap
writes it when Slurm's time-limit warning reaches the batch shell (templates/launch.sbatch.j2); rank 0 looks for
it after every step and removes it when it takes the request."""

DEFAULT_MARGIN_FRACTION = 0.1
MIN_MARGIN_S, MAX_MARGIN_S = 20.0, 300.0


def margin_s(limit_s: float, given: float | None = None) -> float:
    """Seconds before the time limit at which the job saves: ``given``, else 10% of the limit in [20 s, 300 s]."""
    if given is not None:
        return float(given)
    return min(MAX_MARGIN_S, max(MIN_MARGIN_S, DEFAULT_MARGIN_FRACTION * limit_s))


def job_deadline(plan: Mapping[str, Any] | None, env: Mapping[str, str] | None = None,
                 started: float | None = None) -> float | None:
    """When the scheduler will stop this job (epoch seconds): ``SLURM_JOB_END_TIME`` when Slurm gives it, else the
    job's start (``SLURM_JOB_START_TIME``, else ``started``: this process's start) plus the plan's ``time_min``."""
    env = os.environ if env is None else env
    for name in ("SLURM_JOB_END_TIME",):
        text = env.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return float(text)
    minutes = (plan or {}).get("time_min")
    if not isinstance(minutes, (int, float)) or minutes <= 0:
        return None
    start = env.get("SLURM_JOB_START_TIME", "").strip()
    begin_s = float(start) if start.isdigit() else (started if started is not None else time.time())
    return begin_s + 60.0 * float(minutes)


@dataclass
class Policy:
    """When to save: every ``every_steps`` optimizer steps, every ``every_s`` seconds, once ``margin_s`` before
    ``deadline`` (epoch seconds), and whenever SIGUSR1 arrived (Slurm's ``--signal=USR1@...``)."""

    every_steps: int | None = None
    every_s: float | None = None
    deadline: float | None = None
    margin_s: float = MIN_MARGIN_S

    def due(self, step: int, now: float, last_save: float, requested: bool, deadline_saved: bool,
            save_cost_s: float = 0.0) -> str | None:
        """Why this rank would save after ``step`` (None: not now)."""
        if requested:
            return "signal"
        if self.deadline is not None and not deadline_saved and now >= self.deadline - max(self.margin_s,
                                                                                           2 * save_cost_s):
            return "time-limit"
        if self.every_steps and step % self.every_steps == 0:
            return "interval"
        if self.every_s and now - last_save >= self.every_s:
            return "interval"
        return None


class Checkpointer:
    """One rank's checkpointing for a training loop (the reference trainer's; usable by any loop).

    ``engine``: an object with ``save_state(directory, ranks) -> format`` and ``load_state(directory, saved)``
    (the strategy's runtime side bound to the model and optimizer: ``strategies/{ddp,fsdp,deepspeed}.py``).
    ``extras``: callables giving and taking the rank's own state (RNG, data position, scaler).
    ``monitor``: where ``resumed_from_step`` and ``checkpoint`` are recorded (a MemoryMonitor).
    """

    def __init__(self, root: Path, policy: Policy, ranks, plan: Mapping[str, Any], *, monitor=None,
                 device=None, digest: bool = False, attempt: str | None = None, keep: int = 0):
        self.keep = keep
        self.root, self.policy, self.ranks, self.plan = Path(root), policy, ranks, dict(plan)
        self.monitor, self.device, self.digest, self.attempt = monitor, device, digest, attempt
        self.requested = False
        self.deadline_saved = False
        self.last_save = time.time()
        self.save_cost_s = 0.0
        self.last: Saved | None = None
        attempt_dir = os.environ.get("HPCMEM_ATTEMPT_DIR", "").strip()
        self.request_file = Path(attempt_dir) / SAVE_REQUEST if attempt_dir and ranks.is_main else None

    # -- signals --

    def take_request(self) -> bool:
        """Whether the batch shell asked for a save (``SAVE_REQUEST``, rank 0 only: one stat a step); the file is
        removed when taken."""
        if self.request_file is None:
            return False
        try:
            self.request_file.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            warn(f"cannot remove the save request {self.request_file} ({exc.strerror or exc}): saving anyway")
            self.request_file = None  # not again every step
        return True

    def install_signal(self) -> None:
        """SIGUSR1 asks for a save at the end of the current step (Slurm's time-limit warning, when a signal
        reaches the trainer itself: ``scancel -s USR1 --full``, or a launch line that forwards it)."""
        import signal

        def handler(signum, frame):
            self.requested = True

        try:
            signal.signal(signal.SIGUSR1, handler)
        except ValueError:  # not the main thread
            pass

    # -- collectives (no-ops without a process group) --

    def _dist(self):
        try:
            import torch.distributed as dist

            return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None
        except Exception:  # noqa: BLE001
            return None

    def _any(self, flag: bool) -> bool:
        if self._dist() is None:
            return flag
        return any_rank(flag, self.device)  # the flag on the device the backend takes (NCCL: the rank's GPU)

    def _from_rank0(self, value):
        dist = self._dist()
        if dist is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, device=self.device if getattr(self.device, "type", "") == "cuda"
                                   else None)
        return box[0]

    def _barrier(self) -> None:
        dist = self._dist()
        if dist is not None:
            if dist.get_backend() == "nccl":
                import torch

                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()

    # -- resume --

    def resume(self, engine, extras_load: Callable[[dict | None, int], str | None], layout_format: str) -> int:
        """Load the newest save this layout can read into ``engine``; returns its step (0: a fresh start).

        Records ``resumed_from_step`` (None on a fresh start) and, when a newer save was passed over, why
        (``resume.passed``)."""
        now = layout_of(self.plan, layout_format)
        found = candidates(self.root, report=warn if self.ranks.is_main else None)
        info: dict[str, Any] = {"dir": str(self.root), "resumed_from_step": None}
        passed: list[str] = []
        while True:
            saved, skipped = choose(found, now, report=warn if self.ranks.is_main else None)
            passed += skipped
            if saved is None:
                break
            ok, error = True, None
            try:
                engine.load_state(saved.path, saved)
            except Exception as exc:  # noqa: BLE001 - a damaged save: the previous one is used
                ok, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self._any(not ok):
                why = f"step {saved.step}: loading failed ({error or 'on another rank'})"
                passed.append(why)
                if self.ranks.is_main:
                    warn(f"checkpoint {saved.path}: {why}: skipped, kept")
                found = [s for s in found if s.step < saved.step]
                continue
            extras = None
            path = rank_file(saved.path, self.ranks.rank)
            if path.exists():
                import torch

                extras = torch.load(path, map_location="cpu", weights_only=False)
            note = extras_load(extras, saved.step)
            info.update({"resumed_from_step": saved.step, "path": str(saved.path), "format": saved.format,
                         "from_layout": saved.layout})
            if note:
                info["data"] = note
            self.last = saved
            self.last_save = time.time()
            break
        if passed:
            info["passed"] = passed
            if info["resumed_from_step"] is None:
                info["restart_reason"] = "no complete checkpoint this layout can read: " + "; ".join(passed)
        if self.digest and info["resumed_from_step"] is not None:
            info["digest"] = engine.digest()
        self._record(resume=info)
        if self.ranks.is_main:
            if info["resumed_from_step"] is not None:
                print(f"hpcmem: resumed from {info['path']} (step {info['resumed_from_step']})", flush=True)
            elif passed:
                print(f"hpcmem: starting from step 0: {info['restart_reason']}", flush=True)
        return int(info["resumed_from_step"] or 0)

    # -- save --

    def maybe_save(self, step: int, engine, extras_save: Callable[[], dict]) -> Saved | None:
        """Save after ``step`` when the policy says so on any rank (one small collective per step)."""
        if self.take_request():
            self.requested = True
        reason = self.policy.due(step, time.time(), self.last_save, self.requested, self.deadline_saved,
                                 self.save_cost_s)
        if not self._any(reason is not None):
            return None
        if reason == "time-limit":  # a signal save does not stand for it: Slurm's warning may come a minute early
            self.deadline_saved = True
        self.requested = False
        return self.save(step, engine, extras_save, reason or "another rank")

    def save(self, step: int, engine, extras_save: Callable[[], dict], reason: str = "") -> Saved | None:
        """Write a save of ``step`` (every rank calls this): temp dir, engine part, rank extras, commit by rank 0."""
        import torch

        t0 = time.time()
        if self.last is not None and self.last.step == step:
            return self.last
        tmp = None
        if self.ranks.is_main:
            tmp = str(begin(self.root, step))
        tmp = Path(self._from_rank0(tmp))
        fmt = engine.save_state(tmp, self.ranks)
        torch.save(extras_save(), rank_file(tmp, self.ranks.rank))
        digest = engine.digest() if self.digest else None
        self._barrier()
        saved = None
        if self.ranks.is_main:
            meta = {"format": fmt, "layout": layout_of(self.plan, fmt), "reason": reason, "attempt": self.attempt,
                    "world_size": self.ranks.world_size}
            if digest:
                meta["digest"] = digest
            try:
                saved = commit(tmp, step, meta)
            except FileExistsError:
                warn(f"checkpoint of step {step} exists already; this one is left as {tmp}")
            else:
                prune(self.root, self.keep)
        saved = self._from_rank0(None if saved is None else (str(saved.path), saved.step, saved.meta))
        self._barrier()
        self.last_save = time.time()
        self.save_cost_s = self.last_save - t0
        if saved is not None:
            self.last = Saved(Path(saved[0]), saved[1], saved[2])
            self._record(checkpoint=self.last.to_dict())
            if self.ranks.is_main:
                print(f"hpcmem: checkpoint step {step} ({reason}) -> {self.last.path} in {self.save_cost_s:.1f} s",
                      flush=True)
        return self.last

    def _record(self, **fields) -> None:
        if self.monitor is not None:
            self.monitor.set_fields(**fields)


def rng_state(generator=None, scaler=None) -> dict[str, Any]:
    """This rank's RNG (torch CPU and CUDA, python, numpy), the data generator and the grad scaler."""
    import random

    import torch

    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        out["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if generator is not None:
        out["data"] = generator.get_state()
    if scaler is not None:
        out["scaler"] = scaler.state_dict()
    return out


def restore_rng(state: Mapping[str, Any], generator=None, scaler=None) -> None:
    import random

    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy

            numpy.random.set_state(state["numpy"])
        except ImportError:
            pass
    if generator is not None and "data" in state:
        generator.set_state(state["data"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


# -- torch state_dict helpers shared by the DDP and FSDP strategies ----------------------------------------------

STATE_FILE = "state.pt"
DCP_DIR = "dcp"


def load_torch_state(directory: Path, fmt: str, model, optimizer) -> None:
    """Load a full (``state.pt``: DDP's, or a DeepSpeed save's full copy) or torch.distributed.checkpoint
    (``dcp/``) save into ``model``/``optimizer``, whatever their layout now (plain, DDP or FSDP2, any world size): the state_dict API reshards."""
    import torch
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    if fmt == FORMAT_DEEPSPEED and (Path(directory) / STATE_FILE).exists():
        fmt = FORMAT_FULL  # its full copy (strategies/deepspeed.py: gather_full_state), DDP's format
    if fmt == FORMAT_FULL:
        state = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=opts)
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"], options=opts)
        return
    if fmt == FORMAT_DCP:
        import torch.distributed.checkpoint as dcp

        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=str(Path(directory) / DCP_DIR))
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        return
    raise ValueError(f"a {fmt} save does not load into a torch model")


def torch_digest(model, optimizer) -> dict[str, str] | None:
    """``state_digest`` of the full (gathered) state; every rank calls it (FSDP gathers), rank 0 gets the answer."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    if not model_sd:  # ranks other than 0 get nothing with cpu_offload
        return None
    return state_digest(model_sd, optim_sd)


# -- the HF Trainer's own checkpoints ----------------------------------------------------------------------------

HF_COMPLETE = "trainer_state.json"  # the Trainer writes it after the model, optimizer, scheduler and RNG files


def hf_resume_checkpoint(output_dir: str | os.PathLike | None = None, *,
                         report: Callable[[str], None] | None = warn) -> str | None:
    """For ``Trainer.train(resume_from_checkpoint=...)``: the newest ``checkpoint-<step>`` under ``output_dir``
    (default ``HPCMEM_CHECKPOINT_DIR``) that the Trainer finished writing (it has ``trainer_state.json``, written
    last); None on a fresh start. A half-written one (a job killed while saving) is skipped with a warning and
    kept, where ``resume_from_checkpoint=True`` would pick it and fail::

        args = TrainingArguments(output_dir=os.environ["HPCMEM_CHECKPOINT_DIR"], save_steps=500, ...)
        trainer.train(resume_from_checkpoint=runtime.hf_resume_checkpoint())
    """
    root = Path(output_dir) if output_dir is not None else checkpoint_dir()
    if root is None or not root.is_dir():
        return None
    found = []
    for entry in root.iterdir():
        m = re.fullmatch(r"checkpoint-(\d+)", entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    for step, entry in sorted(found, reverse=True):
        try:
            state = json.loads((entry / HF_COMPLETE).read_text())
        except (OSError, ValueError) as exc:
            if report:
                report(f"checkpoint {entry} is incomplete ({type(exc).__name__}: no readable {HF_COMPLETE}): "
                       "skipped, kept")
            continue
        if isinstance(state, dict):
            return str(entry)
    return None
