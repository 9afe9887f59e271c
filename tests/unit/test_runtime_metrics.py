"""toolkit.runtime.metrics and the MemoryMonitor (in this process, real threads and files)."""

import json
import math
import time

import pytest

from toolkit.plan import Plan
from toolkit.runtime import metrics
from toolkit.runtime.jobenv import Ranks
from toolkit.runtime.monitor import MemoryMonitor


def _rank(rank, **over):
    record = {"rank": rank, "device": "cpu", "status": "ok", "error": None, "steps": 10, "warmup_steps": 2,
              "samples_per_s": 10.0, "step_time_s": 0.8, "loss": 6.0 + rank,
              "peak_allocated_mib": None, "peak_reserved_mib": None, "device_used_mib": None,
              "peak_rss_mib": 800.0 + rank, "applied": {}, "versions": {"torch": "2.13.0"}}
    record.update(over)
    return record


def test_step_summary_skips_warmup():
    got = metrics.step_summary([5.0, 1.0, 1.0, 2.0], [8, 8, 8, 8], warmup_steps=1)
    assert got == {"step_time_s": pytest.approx(4 / 3), "samples_per_s": pytest.approx(24 / 4), "timed_steps": 3}


def test_step_summary_short_runs_and_no_steps():
    assert metrics.step_summary([2.0, 2.0], [4, 4], warmup_steps=5)["samples_per_s"] == pytest.approx(2.0)
    assert metrics.step_summary([], [], warmup_steps=1) == {"step_time_s": None, "samples_per_s": None, "timed_steps": 0}


def test_merge_two_ranks():
    plan = Plan(gpus_per_node=2, global_batch=16).to_dict()
    merged = metrics.merge_ranks([_rank(1, step_time_s=0.9), _rank(0)], world_size=2, plan=plan)
    assert merged["status"] == "ok" and merged["error"] is None
    assert merged["world_size"] == 2 and merged["steps"] == 10 and merged["warmup_steps"] == 2
    assert merged["samples_per_s"] == pytest.approx(20.0)       # ranks train different samples
    assert merged["step_time_s"] == pytest.approx(0.9)          # the slowest rank
    assert merged["loss"] == pytest.approx(6.5)
    assert merged["peak_rss_mib"] == pytest.approx(801.0)       # max over ranks
    assert merged["peak_allocated_mib"] is None                 # CPU
    assert list(merged["ranks"]) == ["0", "1"]
    assert "versions" not in merged["ranks"]["0"] and merged["versions"] == {"torch": "2.13.0"}
    assert merged["plan"] == plan
    assert "missing_ranks" not in merged


def test_merge_gpu_figures_are_max_over_ranks():
    merged = metrics.merge_ranks([_rank(0, peak_allocated_mib=100.0, peak_reserved_mib=120.0, device_used_mib=900.0),
                                  _rank(1, peak_allocated_mib=150.0, peak_reserved_mib=110.0, device_used_mib=950.0)], 2)
    assert (merged["peak_allocated_mib"], merged["peak_reserved_mib"], merged["device_used_mib"]) == (150.0, 120.0, 950.0)


def test_merge_failed_and_missing_ranks():
    failed = _rank(1, status="failed", error="OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                   steps=3, samples_per_s=None)
    merged = metrics.merge_ranks([_rank(0, status="running"), failed], world_size=4)
    assert merged["status"] == "failed"
    assert merged["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert merged["steps"] == 3
    assert merged["samples_per_s"] is None    # not every rank has a figure
    assert merged["missing_ranks"] == [2, 3]
    assert metrics.merge_ranks([_rank(0)], world_size=2)["status"] == "incomplete"


def test_merge_names_the_failing_rank_not_the_ones_stopped_after_it():
    stopped = _rank(0, status="failed", error="Terminated: received signal SIGTERM")
    cause = _rank(1, status="failed", error="OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB")
    assert metrics.merge_ranks([stopped, cause], 2)["error"].startswith("OutOfMemoryError")
    assert metrics.merge_ranks([stopped], 1)["error"].startswith("Terminated")


def test_merge_applied_and_reasons():
    r0 = _rank(0, applied={"attention": "sdpa", "reasons": {"attention": "no flash on CPU"}})
    r1 = _rank(1, applied={"gpu_memory_fraction": 0.2, "reasons": {"gpu_memory_fraction": "16 GiB"}})
    merged = metrics.merge_ranks([r0, r1], 2)
    assert merged["applied"] == {"attention": "sdpa", "gpu_memory_fraction": 0.2,
                                 "reasons": {"attention": "no flash on CPU", "gpu_memory_fraction": "16 GiB"}}


def test_write_json_atomic_is_strict_json(tmp_path):
    path = metrics.write_json_atomic(tmp_path / "sub" / "m.json", {"loss": math.nan, "x": [math.inf, 1.5]})
    assert json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
        "loss": "nan", "x": ["inf", 1.5]}
    assert [p.name for p in path.parent.iterdir()] == ["m.json"]  # no temp file left


def test_collect_reads_rank_files_and_plan_json(tmp_path):
    plan = Plan(gpus_per_node=2, global_batch=16)
    (tmp_path / "plan.json").write_text(plan.to_json())
    for r in (0, 1):
        metrics.write_json_atomic(metrics.rank_file(tmp_path, r), _rank(r, world_size=2))
    (tmp_path / "metrics" / "rank-9.json").write_text("{broken")
    merged = metrics.collect(tmp_path)
    assert merged["status"] == "ok" and merged["world_size"] == 2
    assert merged["plan"] == plan.to_dict()
    assert json.loads((tmp_path / "metrics.json").read_text())["peak_rss_mib"] == pytest.approx(801.0)
    assert metrics.collect(tmp_path / "empty") is None


def test_versions_names_the_stack():
    v = metrics.versions()
    assert {"torch", "deepspeed", "transformers", "accelerate", "hpcmem"} <= set(v)
    assert v["hpcmem"]


def test_monitor_writes_rank_and_merged_metrics(tmp_path):
    plan = Plan().to_dict()
    with MemoryMonitor(tmp_path, plan=plan, warmup_steps=1, rank_info=Ranks(), interval_s=0.01) as mon:
        block = bytearray(64 * 2**20)  # touch 64 MiB so the RSS peak moves
        block[::4096] = b"x" * len(block[::4096])
        for loss in (3.0, 2.0, 1.0):
            time.sleep(0.02)
            mon.step(samples=8, loss=loss)
        mon.note("attention", "sdpa", "no flash on CPU")
    rank = json.loads(metrics.rank_file(tmp_path, 0).read_text())
    assert rank["status"] == "ok" and rank["steps"] == 3 and rank["timed_steps"] == 2
    assert rank["loss"] == 1.0 and rank["peak_rss_mib"] > 64
    merged = json.loads((tmp_path / "metrics.json").read_text())
    assert merged["status"] == "ok" and merged["device"] == "cpu" and merged["world_size"] == 1
    assert merged["plan"] == plan
    assert merged["samples_per_s"] > 0 and merged["step_time_s"] >= 0.02
    assert merged["applied"]["attention"] == "sdpa"
    assert merged["versions"]["cuda"] is None or isinstance(merged["versions"]["cuda"], str)
    assert mon.result["status"] == "ok"


def test_monitor_records_a_failure_and_reraises(tmp_path):
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        with MemoryMonitor(tmp_path, rank_info=Ranks(rank=0, world_size=2)) as mon:
            mon.step(samples=4, loss=7.0)
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 134217728 bytes.\nsecond line")
    merged = json.loads((tmp_path / "metrics.json").read_text())
    assert merged["status"] == "failed"
    assert merged["error"] == ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 134217728 bytes.")
    assert merged["steps"] == 1 and merged["loss"] == 7.0
    assert merged["missing_ranks"] == [1]
    assert merged["peak_rss_mib"] > 0


def test_monitor_flushes_periodically_while_running(tmp_path):
    mon = MemoryMonitor(tmp_path, rank_info=Ranks(), interval_s=0.01, flush_interval_s=0.02).start()
    try:
        mon.step(samples=1, loss=1.0)
        deadline = time.monotonic() + 5
        while not metrics.rank_file(tmp_path, 0).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert json.loads(metrics.rank_file(tmp_path, 0).read_text())["status"] in ("running", "ok")
    finally:
        mon.stop()
    assert not mon._thread.is_alive()


def test_monitor_without_a_directory_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with MemoryMonitor(None, rank_info=Ranks()) as mon:
        mon.step(samples=2, loss=0.5)
    assert mon.result["steps"] == 1
    assert list(tmp_path.iterdir()) == []


def test_a_step_mark_writes_nothing(tmp_path, monkeypatch):
    # The monitor's cost (goal: < 1 % of a step) is measured by benchmarks/foundation.py, not timed here; what
    # keeps it small is that a step mark only appends to lists: the rank file is written by the flusher thread,
    # at the end, or when a step is longer than the plan's sequence (begin_step), never by step() itself.
    mon = MemoryMonitor(tmp_path, rank_info=Ranks(), flush_interval_s=3600).start()
    try:
        writes = []
        monkeypatch.setattr(metrics, "write_json_atomic", lambda *a, **k: writes.append(a))
        for i in range(1000):
            mon.begin_step(i, None)
            mon.step(samples=8, loss=1.0)
        assert writes == [] and mon.steps == 1000 and len(mon.samples) == 1000 and mon.loss == 1.0
    finally:
        monkeypatch.undo()
        mon.stop()


class FakeNvml:
    """A stand-in for pynvml (no GPU here): which lookup the code asked for."""

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("uuid", uuid)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("index", index)


def test_the_nvml_handle_is_the_jobs_gpu_as_cuda_visible_devices_names_it():
    """NVML numbers every GPU on the node; CUDA numbers the visible ones: device 1 under CUDA_VISIBLE_DEVICES=3,5 is
    NVML's 5; a UUID entry (GPU-..., MIG-...) is looked up by UUID; without the variable the numbers agree."""
    from toolkit.devices import visible_nvml_handle

    nvml = FakeNvml()
    assert visible_nvml_handle(nvml, 0, {"CUDA_VISIBLE_DEVICES": "3,5"}) == ("index", 3)
    assert visible_nvml_handle(nvml, 1, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == ("index", 5)
    assert visible_nvml_handle(nvml, 0, {"CUDA_VISIBLE_DEVICES": "MIG-1c2d"}) == ("uuid", "MIG-1c2d")
    assert visible_nvml_handle(nvml, 2, {}) == ("index", 2)


class FakeNvmlMemory:
    """FAKE pynvml (no GPU here) with the figures an H100 80GB on driver 580 gave (benchmarks/results/
    gpu-session-20261127.txt): the first ``nvmlDeviceGetMemoryInfo`` counts the ~480 MiB the driver reserves as
    used, ``_v2`` reports it apart; a process list with this job and another."""

    nvmlMemory_v2 = 0x02000028

    class _Process:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    def __init__(self, processes=(), v2=True):
        self.processes = [self._Process(pid, used) for pid, used in processes]
        self.v2 = v2

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self.processes

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        class Info:
            pass

        info = Info()
        others = sum(p.usedGpuMemory or 0 for p in self.processes)
        if version is None:
            info.used = others + 480 * 2**20
        elif self.v2:
            info.used, info.reserved = others, 480 * 2**20
        else:
            raise RuntimeError("Function Not Found")
        return info


def test_device_memory_in_use_is_what_nvidia_smi_shows():
    """This process's own use where NVML lists it (another job's 12 GiB on the same GPU is not ours); else the
    device's without the driver's reservation (_v2); a driver without _v2: the first call's figure."""
    from toolkit.devices import nvml_process_used_bytes, nvml_used_bytes

    gib = 2**30
    shared = FakeNvmlMemory([(1032, 12 * gib), (4242, 5 * gib)])
    assert nvml_used_bytes(shared, "h", pid=4242) == 5 * gib
    assert nvml_process_used_bytes(shared, "h", 4242) == 5 * gib
    assert nvml_process_used_bytes(shared, "h", 7) is None
    assert nvml_used_bytes(shared, "h", pid=7) == 17 * gib  # not listed: the device, reservation left out
    assert nvml_used_bytes(FakeNvmlMemory([(7, None)]), "h", pid=7) == 0  # NVML cannot tell the process's
    assert nvml_used_bytes(FakeNvmlMemory([], v2=False), "h") == 480 * 2**20


class FakeCudaMemory:
    """FAKE torch.cuda history and peak calls (no GPU here): records what the monitor asked."""

    def __init__(self):
        self.history_calls, self.resets = [], []

    def _record_memory_history(self, **kwargs):
        self.history_calls.append(kwargs)


def test_the_allocator_history_has_stacks_only_where_no_checkpointing_runs(monkeypatch):
    """On an H100 (torch 2.11) a checkpointed backward with dropout died under stack recording, python or all
    (gpu_session/probe.py): the monitor records stacks only when asked (the reference trainer without
    checkpointing), drops them before checkpointing is turned on, and a user's script gets none."""
    import torch

    from toolkit.runtime import monitor as monitor_module

    fake = FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "memory", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index=None: fake.resets.append(index))
    monkeypatch.setattr(monitor_module, "_nvml_handle", lambda index: None)
    monkeypatch.delenv("HPCMEM_MEMORY_HISTORY", raising=False)

    mon = MemoryMonitor(None, rank_info=Ranks(0, 0, 1))
    mon.attach_device("cuda:0", stacks=True)
    assert mon.history_recording and mon.history_stacks
    assert fake.history_calls[-1] == {"max_entries": monitor_module.HISTORY_MAX_ENTRIES, "stacks": "python"}
    mon.drop_stacks()
    assert not mon.history_stacks and mon.history_recording
    assert fake.history_calls[-1] == {"max_entries": monitor_module.HISTORY_MAX_ENTRIES, "context": None}
    mon.drop_stacks()
    assert len(fake.history_calls) == 2  # once is enough

    user = MemoryMonitor(None, rank_info=Ranks(0, 0, 1), device="cuda:0")  # runtime.MemoryMonitor in a user script
    assert user.history_recording and not user.history_stacks
    assert fake.history_calls[-1] == {"max_entries": monitor_module.HISTORY_MAX_ENTRIES, "context": None}

    user._cuda_run_peaks = [16 * 2**30, 16 * 2**30]  # the failed try's peaks, kept as the run's
    user._device_used_peak = 17 * 2**30
    user.restart_peaks()
    assert user._cuda_run_peaks == [0, 0] and user._device_used_peak == 0 and fake.resets == [0]


def test_the_calibration_probe_keeps_its_figures_when_the_training_steps_fail(monkeypatch):
    """calibrate's probe loads the kernels a training step loads before it reads the context; a node where that
    step cannot run (transformers missing, a kernel the card lacks) still gets the figure after a bare product,
    with the reason, instead of a failed calibration. torch.cuda's calls are FAKE here (no GPU)."""
    import torch

    from toolkit import calibrate
    from toolkit.estimate import measure

    def broken(*args, **kwargs):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(measure, "train_setup", broken)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    note = calibrate._train_kernels(torch, ["fp32"])
    assert note.startswith("context after a bare matrix product only") and "transformers" in note
