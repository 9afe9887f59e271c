"""The MemoryMonitor's step series and the allocator-snapshot wiring on CPU (this process, real files)."""

import json
import mmap

from toolkit import peaks
from toolkit.plan import Plan
from toolkit.runtime import metrics
from toolkit.runtime.jobenv import Ranks
from toolkit.runtime.monitor import MemoryMonitor


def resident(mib: int) -> mmap.mmap:
    """``mib`` MiB of new resident memory, written page by page. Fresh anonymous pages, not malloc's: after the
    suite's earlier tests this process's allocator serves even 40 MiB tensors from memory already resident, and
    the RSS (what the monitor measures on a CPU) does not move."""
    block = mmap.mmap(-1, mib * 2**20)
    block.write(b"\x01" * (mib * 2**20))
    return block


def test_each_step_records_its_length_and_rss_peak(tmp_path):
    mon = MemoryMonitor(tmp_path, plan=Plan(seq_len=64).to_dict(), rank_info=Ranks(), device="cpu",
                        flush_interval_s=3600)
    kept = []
    with mon:
        for step in range(1, 6):
            mon.begin_step(step, 48 if step % 2 else 64)
            kept.append(resident(8))  # 8 MiB kept every step
            mon.step(samples=2, loss=1.0)
    series = json.loads(metrics.rank_file(tmp_path, 0).read_text())["step_peaks"]
    assert series["measure"] == "rss" and series["plan_seq_len"] == 64 and series["current"] is None
    assert [s[:2] for s in series["steps"]] == [[1, 48], [2, 64], [3, 48], [4, 64], [5, 48]]
    rss = [s[2] for s in series["steps"]]
    assert rss == sorted(rss) and rss[-1] - rss[0] >= 4 * 8 * 0.9  # the kept tensors show in the RSS peaks
    assert series["longest_done"] == [2, 64] and series["last"][0] == 5
    assert not mon.history_recording and mon.snapshot_path is None  # CPU: no allocator history
    assert mon.data_peak().case is None  # 5 steps: too few for a trend


def test_the_live_series_names_a_leak_for_in_job_code(tmp_path):
    mon = MemoryMonitor(None, plan=Plan(seq_len=64).to_dict(), rank_info=Ranks(), device="cpu")
    assert mon.data_peak() is None
    kept = []
    with mon:
        for step in range(1, 13):
            mon.begin_step(step, 64)
            kept.append(resident(40))  # 40 MiB kept every step
            mon.step(samples=1, loss=1.0)
        mon.begin_step(13, 64)
        d = mon.data_peak()
    assert d.case == peaks.LEAK and 30 < d.numbers["slope_mib_per_step"] < 50


def test_a_long_batch_is_written_down_before_its_step_runs(tmp_path):
    mon = MemoryMonitor(tmp_path, plan=Plan(seq_len=64).to_dict(), rank_info=Ranks(), device="cpu",
                        flush_interval_s=3600).start()
    try:
        mon.begin_step(1, 64)
        mon.step(samples=1, loss=1.0)
        mon.begin_step(2, 512)  # a job the OOM killer ends in this step leaves this much
        on_disk = json.loads(metrics.rank_file(tmp_path, 0).read_text())["step_peaks"]
        assert on_disk["current"] == {"step": 2, "seq_len": 512}
        d = peaks.analyse(on_disk)
        assert d.case == peaks.LONG_BATCH and d.numbers["longest_done"] == 64
    finally:
        mon.stop(MemoryError("rehearsal over"))


def test_an_oom_on_cpu_writes_no_snapshot_and_the_failure_is_recorded(tmp_path):
    mon = MemoryMonitor(tmp_path, plan=Plan().to_dict(), rank_info=Ranks(), device="cpu", flush_interval_s=3600)
    try:
        with mon:
            mon.begin_step(1, 128)
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
    except RuntimeError:
        pass
    record = json.loads(metrics.rank_file(tmp_path, 0).read_text())
    assert record["status"] == "failed" and record["memory_snapshot"] is None
    assert record["step_peaks"]["current"] == {"step": 1, "seq_len": 128}
    assert not list(tmp_path.glob("memory-snapshot-*"))
    merged = json.loads((tmp_path / "metrics.json").read_text())
    assert "memory_snapshots" not in merged
    assert peaks.diagnose(metrics.attempt_rank_records(tmp_path)).case == peaks.FIRST_STEP

