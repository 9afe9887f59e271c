"""toolkit.classify on literal log texts: every kind, both PyTorch wordings, every unit, ranks, files."""

import gzip
import time
from dataclasses import FrozenInstanceError
from pathlib import Path
from types import SimpleNamespace

import pytest

from toolkit.classify import (
    KINDS,
    OOM_KINDS,
    JobRecord,
    Verdict,
    classify,
    classify_file,
    classify_paths,
    parse_size_to_mib,
    split_prefix,
)
from toolkit.errors import HpcmemError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
SIGKILL_REASON = "killed by SIGKILL, probably host memory; confirm with sacct"


def new_oom(tried="20.00 MiB", gpu=0, total="79.15 GiB", free="3.12 MiB", processes=(), this="78.00 GiB",
            allocated="77.50 GiB", unallocated="10.00 MiB", exc="torch.OutOfMemoryError", pools=None):
    """A PyTorch >= 2.1 caching-allocator message."""
    procs = "".join(f"Process {pid} has {size} memory in use. " for pid, size in processes)
    own = f"Including non-PyTorch memory, this process has {this} memory in use. " if this else ""
    pool = f"with {pools} allocated in private pools (e.g., CUDA Graphs), " if pools else ""
    return (
        f"{exc}: CUDA out of memory. Tried to allocate {tried}. GPU {gpu} has a total capacity of {total} of which "
        f"{free} is free. {procs}{own}Of the allocated memory {allocated} is allocated by PyTorch, {pool}and "
        f"{unallocated} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
        "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


def old_oom(tried="20.00 MiB", gpu=0, total="15.78 GiB", allocated="14.56 GiB", free="3.12 MiB",
            reserved="14.57 GiB", exc="RuntimeError"):
    """A PyTorch <= 2.0 caching-allocator message."""
    return (
        f"{exc}: CUDA out of memory. Tried to allocate {tried} (GPU {gpu}; {total} total capacity; {allocated} "
        f"already allocated; {free} free; {reserved} reserved in total by PyTorch) If reserved memory is >> "
        "allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory "
        "Management and PYTORCH_CUDA_ALLOC_CONF"
    )


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    "text, mib",
    [
        ("0 bytes", 0.0),
        ("1 byte", 1 / 2**20),
        ("512 bytes", 512 / 2**20),
        ("1024 B", 1 / 1024),
        ("1.50 KiB", 1.5 / 1024),
        ("4 KB", 4 / 1024),
        ("20.00 MiB", 20.0),
        ("100 MB", 100.0),
        ("1024M", 1024.0),
        ("1.50 GiB", 1536.0),
        ("3 GB", 3072.0),
        ("2 gib", 2048.0),
        ("1.25 TiB", 1.25 * 2**20),
    ],
)
def test_parse_size_to_mib(text, mib):
    assert parse_size_to_mib(text) == pytest.approx(mib)


@pytest.mark.parametrize("text", ["", "MiB", "1.5", "one GiB", "1.5 GiBs", "-1 MiB"])
def test_parse_size_rejects_non_sizes(text):
    with pytest.raises(ValueError):
        parse_size_to_mib(text)


# ------------------------------------------------------------------ the Verdict


def test_verdict_to_dict_and_is_oom():
    v = Verdict("gpu_oom", {"tried_to_allocate_mib": 20.0}, 0, 3, ((7, "x"),), "r.")
    assert v.to_dict() == {
        "kind": "gpu_oom", "numbers": {"tried_to_allocate_mib": 20.0}, "gpu": 0, "rank": 3,
        "evidence": [{"line": 7, "text": "x"}], "reason": "r.", "ranks": [], "cause": None, "confidence": "high",
        "confirm": "", "phase": None, "step": None, "total_steps": None, "deepspeed_version": None,
    }
    assert Verdict.from_dict(v.to_dict()) == v
    assert v.is_oom and not Verdict("not_oom").is_oom and not Verdict("unknown").is_oom
    assert set(OOM_KINDS) | {"not_oom", "unknown"} == set(KINDS) and len(OOM_KINDS) == 7


def test_verdict_is_frozen_and_checks_its_kind():
    with pytest.raises(FrozenInstanceError):
        Verdict("gpu_oom").kind = "host_oom"
    with pytest.raises(ValueError):
        Verdict("oom")


# ------------------------------------------------------------------ PyTorch >= 2.1 wording


def test_new_wording_all_numbers():
    v = classify(None, new_oom(tried="2.00 GiB", total="79.15 GiB", free="1.06 GiB", this="78.08 GiB",
                               allocated="76.50 GiB", unallocated="1.02 GiB", gpu=3))
    # 1.02 GiB idle in the cache + 1.06 GiB free >= 2 GiB: the allocator's split blocks, not a full card
    assert v.kind == "gpu_oom_fragmentation" and v.gpu == 3 and v.rank is None and v.confidence == "medium"
    assert v.numbers == pytest.approx({
        "tried_to_allocate_mib": 2048.0, "total_capacity_mib": 79.15 * 1024, "free_mib": 1.06 * 1024,
        "process_in_use_mib": 78.08 * 1024, "allocated_by_pytorch_mib": 76.5 * 1024,
        "reserved_unallocated_mib": 1.02 * 1024,
    })
    assert v.evidence == ((1, new_oom(tried="2.00 GiB", total="79.15 GiB", free="1.06 GiB", this="78.08 GiB",
                                       allocated="76.50 GiB", unallocated="1.02 GiB", gpu=3)),)
    assert "2.00 GiB" in v.reason and "GPU 3" in v.reason


@pytest.mark.parametrize(
    "tried, mib",
    [("512 bytes", 512 / 2**20), ("1.50 KiB", 1.5 / 1024), ("20.00 MiB", 20.0), ("1.50 GiB", 1536.0), ("2 GiB", 2048.0)],
)
def test_new_wording_each_unit(tried, mib):
    v = classify(None, new_oom(tried=tried, free="0 bytes", unallocated="1.00 KiB"))
    assert v.numbers["tried_to_allocate_mib"] == pytest.approx(mib)
    assert v.numbers["free_mib"] == 0.0 and v.numbers["reserved_unallocated_mib"] == pytest.approx(1 / 1024)


@pytest.mark.parametrize("exc", ["torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError", "RuntimeError", "OutOfMemoryError"])
def test_exception_name_does_not_matter(exc):
    assert classify(None, new_oom(exc=exc)).kind == "gpu_oom"
    assert classify(None, old_oom(exc=exc)).kind == "gpu_oom"


def test_torch_2_1_0_typo_capacty_and_no_process_lines():
    text = (
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 27.12 GiB. GPU 0 has a total capacty of "
        "11.99 GiB of which 0 bytes is free. Of the allocated memory 16.16 GiB is allocated by PyTorch, and 144.59 MiB "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "max_split_size_mb to avoid fragmentation."
    )
    v = classify(None, text)
    assert v.kind == "gpu_oom"
    assert v.numbers["total_capacity_mib"] == pytest.approx(11.99 * 1024)
    assert v.numbers["free_mib"] == 0.0 and "process_in_use_mib" not in v.numbers


def test_private_pools_clause():
    v = classify(None, new_oom(pools="1.00 GiB", allocated="8.00 GiB", unallocated="200.00 MiB"))
    assert v.numbers["allocated_by_pytorch_mib"] == 8192.0 and v.numbers["reserved_unallocated_mib"] == 200.0


def test_hip_out_of_memory():
    assert classify(None, new_oom().replace("CUDA out of memory", "HIP out of memory")).kind == "gpu_oom"


def test_message_only_mentioning_the_words_is_not_an_oom():
    text = "hint: if you see CUDA out of memory, lower --batch-size\nall good\n"
    assert classify(None, text).kind == "unknown"


def test_message_wrapped_over_lines_of_the_same_rank():
    text = "\n".join([
        "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 2 has a total",
        "[rank0]: step 3",
        "[rank2]: capacity of 39.39 GiB of which 50.00 MiB is free. Including non-PyTorch memory, this process has",
        "[rank2]: 39.30 GiB memory in use. Of the allocated memory 30.00 GiB is allocated by PyTorch, and 8.00 GiB",
        "[rank2]: is reserved by PyTorch but unallocated.",
        "[rank2]: next thing",
    ])
    v = classify(None, text)
    assert v.kind == "gpu_oom_fragmentation" and v.rank == 2 and v.gpu == 2
    assert [n for n, _ in v.evidence] == [1, 3, 4, 5]
    assert v.numbers["total_capacity_mib"] == pytest.approx(39.39 * 1024)
    assert v.numbers["reserved_unallocated_mib"] == 8192.0


# ------------------------------------------------------------------ PyTorch <= 2.0 wording


def test_old_wording_all_numbers():
    v = classify(None, old_oom(tried="148.00 MiB", gpu=1, total="2.00 GiB", allocated="959.93 MiB", free="96.16 MiB",
                               reserved="1.03 GiB"))
    # 1.03 GiB - 959.93 MiB = 94.79 MiB idle + 96.16 MiB free >= 148 MiB; the 0.88 GiB outside the cache is
    # within this process's own context allowance (OWN_CONTEXT_MIB), so no other process is blamed
    assert v.kind == "gpu_oom_fragmentation" and v.gpu == 1
    assert v.numbers == pytest.approx({
        "tried_to_allocate_mib": 148.0, "total_capacity_mib": 2048.0, "already_allocated_mib": 959.93,
        "free_mib": 96.16, "reserved_total_mib": 1.03 * 1024,
    })


@pytest.mark.parametrize(
    "tried, mib", [("0 bytes", 0.0), ("1024.00 KiB", 1.0), ("2.00 MiB", 2.0), ("1.71 GiB", 1.71 * 1024)]
)
def test_old_wording_each_unit(tried, mib):
    assert classify(None, old_oom(tried=tried)).numbers["tried_to_allocate_mib"] == pytest.approx(mib)


def test_torch_1_x_cached_wording():
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 11.17 GiB total capacity; "
            "10.90 GiB already allocated; 576.00 KiB free; 30.96 MiB cached)")
    v = classify(None, text)
    # <= 1.3 printed "cached" = cached minus allocated (idle): 30.96 MiB idle >= 1 MiB asked
    assert v.kind == "gpu_oom_fragmentation"
    assert v.numbers == pytest.approx({
        "tried_to_allocate_mib": 1.0, "total_capacity_mib": 11.17 * 1024, "already_allocated_mib": 10.90 * 1024,
        "free_mib": 576 / 1024, "reserved_unallocated_mib": 30.96,
    })


# ------------------------------------------------------------------ fragmentation and other processes


def test_fragmentation_new_wording():
    v = classify(None, new_oom(tried="2.00 GiB", total="79.15 GiB", unallocated="6.90 GiB"))
    assert v.kind == "gpu_oom_fragmentation" and v.is_oom
    assert "6.90 GiB" in v.reason and "fragmentation" in v.reason


def test_fragmentation_old_wording():
    v = classify(None, old_oom(tried="512.00 MiB", total="15.78 GiB", allocated="11.82 GiB", reserved="14.23 GiB"))
    assert v.kind == "gpu_oom_fragmentation"


def test_idle_reserved_smaller_than_the_request_is_not_fragmentation():
    assert classify(None, new_oom(tried="8.00 GiB", total="79.15 GiB", unallocated="6.90 GiB")).kind == "gpu_oom"


def test_idle_reserved_that_could_serve_the_request_is_fragmentation_on_any_card():
    # 1.71 GiB idle >= 1.53 GiB asked, though under 5 % of 79.15 GiB: the allocator's move is still the first one
    v = classify(None, new_oom(tried="1.53 GiB", total="79.15 GiB", unallocated="1.71 GiB"))
    assert v.kind == "gpu_oom_fragmentation" and v.confidence == "high"


def test_free_memory_alone_covering_the_request_is_fragmentation_with_low_confidence():
    v = classify(None, new_oom(tried="1.00 GiB", total="79.15 GiB", free="2.00 GiB", this="77.00 GiB",
                               unallocated="10.00 MiB"))
    assert v.kind == "gpu_oom_fragmentation" and v.confidence == "low" and "memory_snapshot" in v.confirm


def test_idle_plus_free_short_of_the_request_is_plain():
    v = classify(None, new_oom(tried="1.00 GiB", total="79.15 GiB", free="500.00 MiB", this="78.60 GiB",
                               unallocated="500.00 MiB"))
    assert v.kind == "gpu_oom" and v.confidence == "high"


def test_old_format_memory_held_outside_the_cache_is_another_process():
    # the example: ~22 GiB of 23.65 held outside this process's PyTorch cache
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 23.65 GiB total capacity; 1.20 GiB "
            "already allocated; 18.00 MiB free; 1.31 GiB reserved in total by PyTorch)")
    v = classify(None, text)
    assert v.kind == "gpu_oom_other_process" and v.confidence == "medium" and "nvidia-smi" in v.confirm
    assert v.numbers["other_process_mib"] > 20 * 1024


def test_a_small_card_context_is_not_another_process():
    # 0.56 GiB outside the cache on a 4 GiB card is this process's CUDA context, not a foreign process
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 38.00 MiB (GPU 0; 4.00 GiB total capacity; 3.41 GiB "
            "already allocated; 0 bytes free; 3.44 GiB reserved in total by PyTorch)")
    assert classify(None, text).kind == "gpu_oom_fragmentation" or classify(None, text).kind == "gpu_oom"
    assert classify(None, text).kind != "gpu_oom_other_process"


def test_a_message_wrapped_mid_word_keeps_its_numbers():
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.12 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 2.11 GiB is free. Including non-PyTorch memory, this process has 76.96 GiB memory in "
            "use. Of the allocated memory 43.48 GiB is allocated by P\n"
            "yTorch, and 30.59 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large")
    v = classify(None, text)
    assert v.numbers["allocated_by_pytorch_mib"] == pytest.approx(43.48 * 1024)
    assert v.numbers["reserved_unallocated_mib"] == pytest.approx(30.59 * 1024)


def test_old_message_without_its_closing_parenthesis():
    text = ("RuntimeError: CUDA out of memory. Tried to allocate 92.00 MiB (GPU 0; 1.96 GiB total capacity; 1.46 GiB "
            "already allocated; 16.38 MiB free; 1.51 GiB reserved in total by PyTorch\n\nI tried everything")
    v = classify(None, text)
    assert v.numbers["reserved_total_mib"] == pytest.approx(1.51 * 1024) and v.numbers["free_mib"] == 16.38


@pytest.mark.parametrize("line", [
    "RuntimeError: cuda runtime error (2) : out of memory at /opt/conda/torch/lib/THC/generic/THCStorage.cu:66",
    "THCudaCheck FAIL file=/torch/lib/THC/generic/THCStorage.cu line=66 error=2 : out of memory",
])
def test_pre_1_0_thc_out_of_memory_is_gpu_oom(line):
    v = classify(None, line + "\n")
    assert v.kind == "gpu_oom" and v.confidence == "medium"


def test_another_process_holds_the_gpu():
    v = classify(None, new_oom(tried="4.00 GiB", total="79.15 GiB", free="1.00 GiB",
                               processes=[(4242, "30.00 GiB")], this="48.00 GiB", allocated="46.00 GiB",
                               unallocated="500.00 MiB"))
    assert v.kind == "gpu_oom_other_process"
    assert v.numbers["other_process_mib"] == 30 * 1024 and v.numbers["process_in_use_mib"] == 48 * 1024
    assert "other processes hold 30.00 GiB" in v.reason


def test_other_process_wins_over_fragmentation():
    v = classify(None, new_oom(tried="4.00 GiB", total="79.15 GiB", processes=[(1, "20.00 GiB"), (2, "12.00 GiB")],
                               unallocated="10.00 GiB"))
    assert v.kind == "gpu_oom_other_process" and v.numbers["other_process_mib"] == 32 * 1024


def test_small_other_process_is_reported_but_not_blamed():
    v = classify(None, new_oom(tried="4.00 GiB", total="79.15 GiB", processes=[(7, "500.00 MiB")]))
    assert v.kind == "gpu_oom" and v.numbers["other_process_mib"] == 500.0
    assert "other processes hold 500.00 MiB" in v.reason


def test_other_process_not_blamed_when_the_request_would_not_fit_anyway():
    v = classify(None, new_oom(tried="60.00 GiB", total="79.15 GiB", free="1.00 GiB", processes=[(7, "10.00 GiB")]))
    assert v.kind == "gpu_oom"


def test_container_lists_this_process_by_pid_only():
    # no "this process" clause (pid namespace): the process holding PyTorch's reserved memory is this one
    v = classify(None, new_oom(tried="20.00 MiB", total="14.75 GiB", processes=[(24345, "14.74 GiB")], this=None,
                               allocated="14.56 GiB", unallocated="11.13 MiB"))
    assert v.kind == "gpu_oom" and "other_process_mib" not in v.numbers
    assert v.numbers["process_in_use_mib"] == pytest.approx(14.74 * 1024)  # "Process P has M" is this process


def test_container_with_a_second_process():
    v = classify(None, new_oom(tried="2.00 GiB", total="79.15 GiB", free="0 bytes", this=None,
                               processes=[(100, "40.00 GiB"), (200, "39.00 GiB")], allocated="38.00 GiB",
                               unallocated="500.00 MiB"))
    # this process: the smallest holding >= 38.49 GiB, i.e. 39 GiB; the other holds 40 GiB
    assert v.kind == "gpu_oom_other_process" and v.numbers["other_process_mib"] == 40 * 1024


# ------------------------------------------------------------------ GPU memory outside PyTorch's allocator


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: CUDA error: out of memory",
        "RuntimeError: CUDA driver error: out of memory",
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
        "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
        "jaxlib.xla_extension.XlaRuntimeError: INTERNAL: CUDA_ERROR_OUT_OF_MEMORY: out of memory",
    ],
)
def test_driver_oom(line):
    text = f"Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n{line}\n"
    v = classify(None, text)
    assert v.kind == "gpu_driver_oom" and v.evidence == ((3, line),)


def test_cudnn_error_next_to_memory_pressure_is_driver_oom():
    text = "\n".join([
        "WARNING: cudaMalloc failed to allocate 2147483648 bytes, retrying with a smaller workspace",
        "Traceback (most recent call last):",
        '  File "t.py", line 9, in <module>',
        "RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
    ])
    v = classify(None, text)
    assert v.kind == "gpu_driver_oom"
    assert [n for n, _ in v.evidence] == [1, 4]


def test_cudnn_not_supported_alone_is_not_oom():
    text = ("RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
            "non-contiguous input.\n")
    v = classify({"state": "FAILED", "exit_code": 1}, text)
    assert v.kind == "not_oom" and "CUDNN_STATUS_NOT_SUPPORTED" in v.reason


def test_cudnn_internal_error_alone_is_unknown():
    v = classify(None, "RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR\n")
    assert v.kind == "unknown" and "CUDNN_STATUS_INTERNAL_ERROR" in v.reason


# ------------------------------------------------------------------ NCCL


def test_nccl_cuda_oom_fixture():
    v = classify(None, fixture("nccl_cuda_oom.log"))
    assert v.kind == "nccl_oom" and v.gpu == 3 and v.rank == 3
    texts = [t for _, t in v.evidence]
    assert any("NCCL WARN Cuda failure 'out of memory'" in t for t in texts)
    assert any("DistBackendError" in t for t in texts)


def test_nccl_shm_is_nccl_oom_not_disk_full():
    v = classify(None, fixture("nccl_shm_full.log"))
    assert v.kind == "nccl_oom" and v.gpu == 0
    assert v.numbers == {"nccl_bytes": 9637892}
    assert "/dev/shm" in v.reason and v.cause == "shm"


def test_nccl_calloc_failure():
    text = "node1:11:22 [1] include/alloc.h:36 NCCL WARN Failed to CUDA calloc 6291456 bytes\n"
    v = classify(None, text)
    assert v.kind == "nccl_oom" and v.gpu == 1 and v.numbers["tried_to_allocate_mib"] == 6.0


def test_nccl_last_error_without_warn_lines():
    text = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'\n")
    assert classify(None, text).kind == "nccl_oom"


# ------------------------------------------------------------------ host memory


OLD_CGROUP = ("slurmstepd: error: Detected 1 oom-kill event(s) in StepId=4711.batch. Some of your processes may have "
              "been killed by the cgroup out-of-memory handler.")
NEW_CGROUP = "slurmstepd: error: Detected 2 oom_kill events in StepId=4712.0. Some of the step tasks have been OOM Killed."


@pytest.mark.parametrize("line", [OLD_CGROUP, NEW_CGROUP, "srun: error: cpu-node-3: task 0: Out Of Memory",
                                  "slurmstepd: error: Job 77 exceeded memory limit (4300000 > 4194304), being killed"])
def test_host_oom_lines(line):
    v = classify({"state": "FAILED", "exit_code": 1}, f"step 1\n{line}\n")
    assert v.kind == "host_oom" and v.evidence == ((2, line),)


def test_srun_out_of_memory_names_the_task():
    assert classify(None, "srun: error: cpu-node-3: task 5: Out Of Memory").rank == 5


@pytest.mark.parametrize(
    "record",
    [
        {"state": "OUT_OF_MEMORY", "exit_code": 0, "signal": 125},
        JobRecord("OUT_OF_MEMORY"),
        JobRecord("OUT_OF_ME+"),
        JobRecord(None, 0, 125),
        {"state": "FAILED", "exit_code": "0:125"},
        SimpleNamespace(state="OUT_OF_MEMORY", exit_code=0, signal=125, elapsed_s=3.0),
    ],
)
def test_host_oom_from_the_record_alone(record):
    v = classify(record, "")
    assert v.kind == "host_oom" and v.evidence == ()
    assert "OUT_OF_MEMORY" in v.reason or "0:125" in v.reason


def test_cpu_partition_cgroup_kill_as_on_the_test_cluster():
    text = f"epoch 0 step 3\n{OLD_CGROUP}\n"
    v = classify({"state": "OUT_OF_MEMORY", "exit_code": 0, "signal": 125}, text)
    assert v.kind == "host_oom" and v.evidence == ((2, OLD_CGROUP),)


# ------------------------------------------------------------------ SIGKILL


SIGKILL_LINES = [
    "[2024-05-02 10:13:06,002] [ERROR] [launch.py:325:sigkill_handler] ['python', '-u', 'train.py', '--local_rank=0'] "
    "exits with return code = -9",
    "E0502 11:02:10.612000 51200 torch/distributed/elastic/multiprocessing/api.py:826] failed (exitcode: -9) "
    "local_rank: 0 (pid: 51234) of binary: /usr/bin/python3",
    "  traceback : Signal 9 (SIGKILL) received by PID 51234",
    "subprocess.CalledProcessError: Command '['python', 'train.py']' died with <Signals.SIGKILL: 9>.",
    "srun: error: cpu-node-1: task 0: Exited with exit code 137",
    "Killed",
    "/var/spool/slurmd/job00123/slurm_script: line 12: 45678 Killed                  python train.py",
    "srun: error: cpu-node-1: task 1: Killed",
    "RuntimeError: DataLoader worker (pid 9123) is killed by signal: Killed. ",
]


@pytest.mark.parametrize("line", SIGKILL_LINES)
def test_a_lone_sigkill_is_host_oom_with_medium_confidence(line):
    v = classify({"state": "FAILED", "exit_code": 1}, f"step 10 loss 2.0\n{line}\n")
    assert v.kind == "host_oom" and v.cause == "sigkill" and v.confidence == "medium"
    assert "sacct" in v.confirm and "MaxRSS" in v.confirm and "dmesg" in v.confirm
    assert (2, line) in v.evidence


@pytest.mark.parametrize("line", SIGKILL_LINES)
def test_sigkill_confirmed_by_the_record_is_host_oom(line):
    v = classify({"state": "OUT_OF_MEMORY", "exit_code": 0, "signal": 125}, f"{line}\n")
    assert v.kind == "host_oom" and v.evidence == ((1, line),)


def test_sigkill_confirmed_by_the_cgroup_line_is_host_oom():
    v = classify(None, f"{SIGKILL_LINES[0]}\n{OLD_CGROUP}\n")
    assert v.kind == "host_oom" and [n for n, _ in v.evidence] == [1, 2]


def test_sigkill_in_the_record_alone_is_host_oom_medium():
    v = classify(JobRecord("FAILED", 0, 9), "")
    assert v.kind == "host_oom" and v.confidence == "medium" and v.cause == "sigkill"


def test_a_sigkill_after_an_exception_is_not_the_first_failure():
    text = "[rank1]: ValueError: bad shape\nE0502 failed (exitcode: -9) local_rank: 0 (pid: 5) of binary: python\n"
    v = classify(None, text)
    assert v.kind == "not_oom" and v.cause == "python_error"


def test_a_sigkill_whose_root_cause_is_another_rank_is_unknown():
    text = ("Failures:\n[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -9 (pid: 14689)\n"
            "  traceback : Signal 9 (SIGKILL) received by PID 14689\n------\nRoot Cause (first observed failure):\n"
            "[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 14690)\n")
    v = classify(None, text)
    assert v.kind == "unknown" and v.cause == "child_failed_bare"


def test_host_memory_stated_before_a_launcher_kill():
    text = ("[INFO] [utils.py:799:see_memory_usage] CPU Virtual Memory: used = 26.4 GB, percent = 84.6%\n"
            "[INFO] [launch.py:315:sigkill_handler] Killing subprocess 1080504\n")
    v = classify(None, text)
    assert v.kind == "host_oom" and v.numbers["host_used_mib"] == pytest.approx(26.4 * 1024)


@pytest.mark.parametrize("state, label", [("TIMEOUT", "time limit"), ("CANCELLED by 1000", "cancelled")])
def test_sigkill_explained_by_the_scheduler_is_not_oom(state, label):
    v = classify({"state": state}, "srun: error: node1: task 0: Killed\n")
    assert v.kind == "not_oom" and label in v.reason


def test_bare_word_killed_inside_a_sentence_is_not_a_sigkill():
    assert classify(None, "Killed 3 stale workers before start\n").kind == "unknown"
    assert SIGKILL_REASON not in classify(None, "Killed 3 stale workers before start\n").reason


# ------------------------------------------------------------------ host memory inside the process


def test_cpu_allocator():
    line = ("RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 134217728 bytes. Error code 12 (Cannot allocate memory)")
    v = classify(None, f"Traceback (most recent call last):\n{line}\n")
    assert v.kind == "cpu_alloc_oom" and v.numbers == {"tried_to_allocate_mib": 128.0}
    assert v.evidence == ((2, line),) and "128.00 MiB" in v.reason


def test_cpu_allocator_not_enough_memory_wording():
    line = "RuntimeError: [enforce fail at alloc_cpu.cpp:72] data. DefaultCPUAllocator: not enough memory: you tried to allocate 9663676416 bytes."
    assert classify(None, line).numbers == {"tried_to_allocate_mib": 9216.0}


def test_numpy_array_memory_error():
    line = "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 3.00 GiB for an array with shape (402653184,) and data type float64"
    v = classify(None, line)
    assert v.kind == "cpu_alloc_oom" and v.numbers == {"tried_to_allocate_mib": 3072.0}


def test_plain_memory_error():
    assert classify(None, "Traceback (most recent call last):\nMemoryError\n").kind == "cpu_alloc_oom"


# ------------------------------------------------------------------ not OOM


@pytest.mark.parametrize(
    "text, label",
    [
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "illegal memory access"),
        ("RuntimeError: CUDA error: device-side assert triggered", "device-side assert"),
        ("[rank0]:[E502 12:10:40.0 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: "
         "WorkNCCL(SeqNum=1203, OpType=ALLREDUCE) ran for 600071 milliseconds before timing out.", "NCCL watchdog timeout"),
        ("slurmstepd: error: *** JOB 4720 ON gpu-node-09 CANCELLED AT 2024-05-02T12:30:00 DUE TO TIME LIMIT ***", "time limit"),
        ("slurmstepd: error: *** STEP 4720.0 ON gpu-node-09 CANCELLED AT 2024-05-02T12:30:00 ***", "cancelled"),
        ("slurmstepd: error: *** JOB 4721 ON n1 CANCELLED AT 2024-05-02T12:30:00 DUE TO PREEMPTION ***", "preempted"),
        ("OSError: [Errno 28] No space left on device: '/scratch/ckpt/step_1000.pt'", "disk full"),
        ("RuntimeError: [enforce fail at inline_container.cc:595] . unexpected pos 8192 vs 0: No space left on device", "disk full"),
        ("OSError: [Errno 122] Disk quota exceeded", "disk quota"),
        ("ModuleNotFoundError: No module named 'flash_attn'", "import error"),
        ("ImportError: cannot import name 'LlamaConfig' from 'transformers'", "import error"),
        ("/var/spool/slurmd/job00123/slurm_script: line 9: torchrun: command not found", "command not found"),
        ("ValueError: micro_batch must divide global_batch", "ValueError"),
        ("KeyboardInterrupt", "interrupted"),
    ],
)
def test_not_oom(text, label):
    log = f"Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n{text}\n"
    v = classify({"state": "FAILED", "exit_code": 1}, log)
    assert v.kind == "not_oom" and not v.is_oom
    assert label in v.reason and (3, text) in v.evidence


@pytest.mark.parametrize("line", [
    # runpy's own lines when `python -m torch.distributed.run` (the rendered launch) finds no torch: the job's log
    # of a login-node install without hpcmem[job] (no traceback follows them)
    "/opt/venv/bin/python3: Error while finding module specification for 'torch.distributed.run' "
    "(ModuleNotFoundError: No module named 'torch')",
    "/usr/bin/python3: No module named deepspeed",
])
def test_a_launch_without_the_package_is_an_import_error(line):
    log = f"hpcmem: job 4242 attempt 1 on node7 at 2026-11-28T18:19:31+00:00\n{line}\n"
    v = classify({"state": "FAILED", "exit_code": 1}, log)
    assert v.kind == "not_oom" and not v.is_oom and "import error" in v.reason and (2, line) in v.evidence


def test_a_log_line_that_quotes_no_module_named_is_not_an_import_error():
    v = classify({"state": "FAILED", "exit_code": 1}, "step 3: the fallback for 'No module named apex' was used\n")
    assert "import error" not in v.reason


@pytest.mark.parametrize(
    "state, label",
    [("TIMEOUT", "time limit"), ("CANCELLED by 1000", "cancelled"), ("CANCELLED+", "cancelled"),
     ("NODE_FAIL", "node failure"), ("PREEMPTED", "preempted"), ("COMPLETED", "completed")],
)
def test_not_oom_from_the_record(state, label):
    v = classify({"state": state, "exit_code": 0, "signal": 0}, "step 1 loss 3.2\n")
    assert v.kind == "not_oom" and label in v.reason


def test_completed_with_a_logged_traceback_is_still_completed():
    text = "Traceback (most recent call last):\nValueError: optional plot failed\nsaved model\n"
    v = classify(JobRecord("COMPLETED", 0, 0), text)
    assert v.kind == "not_oom" and "completed" in v.reason


def test_illegal_memory_access_fixture_with_oom_looking_words():
    v = classify({"state": "FAILED", "exit_code": 134}, fixture("illegal_memory_access.log"))
    assert v.kind == "not_oom" and "illegal memory access" in v.reason and v.rank == 0


def test_nothing_recognisable_is_unknown():
    v = classify({"state": "FAILED", "exit_code": 2}, "starting\nstep 1\n")
    assert v.kind == "unknown" and "FAILED" in v.reason and v.evidence == ()
    assert classify(None, "").kind == "unknown"


def test_wrappers_alone_do_not_make_a_cause():
    text = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            "subprocess.CalledProcessError: Command '['python']' returned non-zero exit status 1.\n")
    assert classify(None, text).kind == "unknown"


# ------------------------------------------------------------------ precedence


def test_time_limit_after_an_oom_is_still_oom():
    v = classify({"state": "TIMEOUT"}, fixture("time_limit_after_oom.log"))
    assert v.kind == "gpu_oom" and v.rank == 1 and v.gpu == 1
    assert "TIMEOUT" in v.reason


def test_cancelled_record_after_an_oom_is_oom():
    assert classify({"state": "CANCELLED by 0"}, new_oom()).kind == "gpu_oom"


def test_user_cancellation_without_oom_is_not_oom():
    text = "step 5\nslurmstepd: error: *** JOB 99 ON n1 CANCELLED AT 2024-05-02T12:30:00 ***\nsrun: error: n1: task 0: Killed\n"
    v = classify({"state": "CANCELLED by 1000"}, text)
    assert v.kind == "not_oom" and "cancelled" in v.reason


def test_illegal_memory_access_before_an_oom_is_not_oom():
    text = "[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered\n" + new_oom()
    assert classify(None, text).kind == "not_oom"


def test_oom_before_a_device_fault_is_oom():
    text = new_oom() + "\n[rank0]: RuntimeError: CUDA error: an illegal memory access was encountered\n"
    assert classify(None, text).kind == "gpu_oom"


def test_the_first_oom_in_the_log_decides():
    text = f"{NEW_CGROUP}\n{new_oom()}\n"
    assert classify(None, text).kind == "host_oom"
    text = f"{new_oom()}\n{NEW_CGROUP}\n"
    assert classify(None, text).kind == "gpu_oom"


def test_gpu_oom_in_the_log_wins_over_a_completed_record():
    v = classify(JobRecord("COMPLETED", 0, 0), new_oom())
    assert v.kind == "gpu_oom" and "COMPLETED" in v.reason


def test_sigkill_then_watchdog_timeout_is_the_sigkill():
    text = f"{SIGKILL_LINES[1]}\n[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)\n"
    assert classify(None, text).kind == "host_oom"


def test_a_specific_failure_beats_a_generic_exception():
    text = "[rank1]: ValueError: bad\n[rank0]: RuntimeError: CUDA error: device-side assert triggered\n"
    v = classify(None, text)
    assert v.kind == "not_oom" and "device-side assert" in v.reason and v.rank == 0


def test_peer_failure_errors_do_not_hide_the_real_exception():
    text = ("[rank0]: torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error\n"
            "[rank1]: ValueError: tokenizer has no pad token\n")
    v = classify(None, text)
    assert v.kind == "not_oom" and "ValueError" in v.reason and v.rank == 1


def test_nccl_losing_a_peer_is_unknown_with_the_peer_named_unless_the_log_shows_a_cause():
    """A collective that failed because its peer went away ("Connection closed by remote peer", "remote process
    exited or there was a network error", ncclRemoteError) shows a consequence: the cause is on the other rank or in
    the network (unknown, nccl_peer). A cause the log does show still decides: a SIGKILL, an OOM, an exception."""
    peer = ("GroupNCCL.cpp:1275, internal error, NCCL version 2.14.3\nncclInternalError: Internal check failed.\n"
            "Last error:\nNet : Connection closed by remote peer node-7<43236>\n")
    v = classify(None, peer)
    assert (v.kind, v.cause, v.confidence) == ("unknown", "nccl_peer", "low") and "peer" in v.reason
    assert v.evidence[0][0] == 4
    remote = "[rank1]: torch.distributed.DistBackendError: NCCL error: remote process exited or there was a network error\n"
    assert classify(None, remote).cause == "nccl_peer" and classify(None, remote).rank == 1
    assert classify(None, peer + "    exitcode  : -9 (pid: 42)\n").kind == "host_oom"
    assert classify(None, peer + new_oom() + "\n").kind == "gpu_oom"
    assert classify(None, peer + "ValueError: bad shape\n").cause == "python_error"


def test_a_memory_fraction_cap_is_the_capacity_an_oom_is_judged_against():
    """Under torch.cuda.set_per_process_memory_fraction the message still states the card's capacity and free memory
    and adds "N allowed;" (CUDACachingAllocator.cpp's allowed_info). The cap is what ran out: a plain gpu_oom against
    the cap, not fragmentation or another process for the card's free memory."""
    from toolkit.classify import usable_capacity_mib

    capped = new_oom(tried="2.00 GiB", total="79.19 GiB", free="38.51 GiB", this="40.12 GiB", allocated="38.90 GiB",
                     unallocated="563.20 MiB").replace("memory in use. ", "memory in use. 40.00 GiB allowed; ", 1)
    v = classify(None, capped)
    assert v.kind == "gpu_oom" and v.confidence == "high" and v.numbers["allowed_mib"] == 40960.0
    assert usable_capacity_mib(v.numbers) == 40960.0 and "cap allowed 40.00 GiB" in v.reason
    uncapped = classify(None, capped.replace("40.00 GiB allowed; ", ""))
    assert uncapped.kind == "gpu_oom_fragmentation" and usable_capacity_mib(uncapped.numbers) == 81090.56
    # the cap's own room covers the request with idle cache: fragmentation under the cap
    idle = capped.replace("563.20 MiB is reserved", "2.50 GiB is reserved")
    assert classify(None, idle).kind == "gpu_oom_fragmentation"


H100_CAPPED_OOMS = (
    # benchmarks/results/gpu-session-20261127-logs: one H100 80GB capped at 16 GiB (HPCMEM_GPU_MEM_GIB), four other
    # jobs on the card. The first as hpcmem's in-job line printed it before REASON_CHARS (cut after "Of the a"),
    # the second whole, as torch 2.11 raised it.
    "hpcmem: out of memory in step 1 (OutOfMemoryError: CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has "
    "a total capacity of 79.18 GiB of which 49.00 GiB is free. Process 1032 has 12.43 GiB memory in use. Process "
    "1043 has 1.17 GiB memory in use. Including non-PyTorch memory, this process has 16.55 GiB memory in use. 16.00 "
    "GiB allowed; Of the a); in-job move: micro_batch 32 x grad_accum 1 -> 16 x 2 (global 32), step re-run\n",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.54 GiB. GPU 0 has a total capacity of 79.18 GiB "
    "of which 48.86 GiB is free. Including non-PyTorch memory, this process has 15.62 GiB memory in use. Process "
    "1048 has 14.68 GiB memory in use. 16.00 GiB allowed; Of the allocated memory 13.94 GiB is allocated by PyTorch, "
    "and 965.01 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc"
    "-conf)\n",
)


def test_under_a_memory_fraction_cap_other_jobs_on_the_card_are_not_the_cause():
    """Real H100 lines: the card had 49 GiB free, so the 16 GiB cap refused the request, not the other jobs' 13.6
    GiB. Without PyTorch's figures (a line cut short) this process's whole use bounds the cap's room (none left):
    a plain gpu_oom; with them, the cap's room (1.12 GiB) plus the idle cache (965 MiB) would have served 1.54 GiB:
    fragmentation under the cap."""
    from toolkit.classify import _capped_free_mib, binding_cap_mib

    cut, whole = (classify(None, text) for text in H100_CAPPED_OOMS)
    assert cut.kind == "gpu_oom" and cut.numbers["allowed_mib"] == 16384.0 and cut.numbers["other_process_mib"] > 0
    assert _capped_free_mib(cut.numbers) == 0.0 and "this process's 16.55 GiB" in cut.reason
    assert whole.kind == "gpu_oom_fragmentation" and whole.confidence == "medium"
    assert _capped_free_mib(whole.numbers) == pytest.approx(16384 - 13.94 * 1024 - 965.01)
    # a cap at or above the card limits nothing; a card the other jobs left short is their doing
    assert binding_cap_mib({**whole.numbers, "allowed_mib": 90000.0}) is None
    short = H100_CAPPED_OOMS[1].replace("48.86 GiB is free", "500.00 MiB is free").replace("14.68 GiB", "66.00 GiB")
    assert classify(None, short).kind == "gpu_oom_other_process"


def test_a_slurm_step_id_is_not_a_training_step_and_names_the_job():
    from toolkit.triage.logfind import job_id_in_text

    text = ("Epoch 1:  40%|####      | 40/100 [00:10<00:15]\n"
            "slurmstepd: error: Detected 8 oom-kill event(s) in step 59137890.batch cgroup. Some of your processes "
            "may have been killed by the cgroup out-of-memory handler.\n")
    v = classify(None, text)
    assert v.kind == "host_oom" and v.step == 40
    assert classify(None, text.split("\n", 1)[1]).step is None
    assert job_id_in_text(text) == "59137890"
    assert classify(None, "RuntimeError: boom during step 12\n").step == 12


# ------------------------------------------------------------------ ranks and prefixes


@pytest.mark.parametrize(
    "prefix, rank",
    [("[rank3]: ", 3), ("[rank12]:", 12), ("[default3]:", 3), ("3: ", 3), (" 3: ", 3), ("[1,3]<stderr>:", 3),
     ("[1,3]<stdout>: ", 3), ("0: [rank5]: ", 5), ("1: [default2]:", 2), ("", None)],
)
def test_rank_from_each_prefix_style(prefix, rank):
    line = prefix + new_oom()
    v = classify(None, f"{prefix}step 1\n{line}\n")
    assert v.kind == "gpu_oom" and v.rank == rank and v.evidence == ((2, line),)


def test_split_prefix():
    assert split_prefix("[rank3]: x") == (3, "x")
    assert split_prefix("12:34:56 x") == (None, "12:34:56 x")
    assert split_prefix("[1,7]<stderr>:Traceback") == (7, "Traceback")


def test_interleaved_ranks_report_the_first_oom():
    text = "\n".join([
        "[rank0]: step 7",
        "[rank2]: Traceback (most recent call last):",
        "[rank0]: Traceback (most recent call last):",
        "[rank2]:   File \"train.py\", line 9, in <module>",
        "[rank2]: " + new_oom(tried="1.00 GiB", gpu=2),
        "[rank0]: " + new_oom(tried="2.00 GiB", gpu=0),
        "[rank1]: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)",
    ])
    v = classify(None, text)
    assert v.kind == "gpu_oom" and v.rank == 2 and v.gpu == 2
    assert v.numbers["tried_to_allocate_mib"] == 1024.0
    assert [n for n, _ in v.evidence] == [5, 6]


@pytest.mark.parametrize("prefix", ["{r}: ", "[default{r}]:", "[1,{r}]<stderr>:"])
def test_interleaved_ranks_each_prefix_style(prefix):
    lines = []
    for step in range(3):
        for r in range(4):
            lines.append(prefix.format(r=r) + f"step {step} loss 1.0")
    lines.insert(7, prefix.format(r=3) + old_oom(gpu=3))
    v = classify(None, "\n".join(lines))
    assert v.kind == "gpu_oom" and v.rank == 3 and v.gpu == 3 and v.evidence[0][0] == 8


def test_rank_written_in_the_text():
    assert classify(None, "[Rank 6] " + new_oom()).rank == 6


def test_torchrun_summary_rank():
    v = classify(None, fixture("torchrun_sigkill_summary.log"))
    assert v.kind == "host_oom" and v.cause == "sigkill"
    assert any("Signal 9 (SIGKILL)" in t for _, t in v.evidence)


def test_evidence_is_capped():
    text = "\n".join(f"[rank{r}]: " + new_oom(gpu=r % 8) for r in range(32))
    v = classify(None, text)
    assert len(v.evidence) == 10 and v.evidence[0] == (1, "[rank0]: " + new_oom(gpu=0)) and v.rank == 0


def test_crlf_lines_are_stripped_in_evidence():
    v = classify(None, "step 1\r\n" + new_oom() + "\r\n")
    assert v.evidence == ((2, new_oom()),)


# ------------------------------------------------------------------ realistic fixtures


@pytest.mark.parametrize(
    "name, record, kind, rank, gpu",
    [
        ("hf_trainer_gpu_oom_torch22.log", {"state": "FAILED", "exit_code": 1}, "gpu_oom", None, 0),
        ("lightning_gpu_oom_torch113_fragmentation.log", {"state": "FAILED", "exit_code": 1}, "gpu_oom_fragmentation", None, 0),
        ("torchrun_rank_oom_childfailed.log", {"state": "FAILED", "exit_code": 1}, "gpu_oom_fragmentation", 1, 1),
        ("time_limit_after_oom.log", {"state": "TIMEOUT"}, "gpu_oom", 1, 1),
        ("nccl_cuda_oom.log", None, "nccl_oom", 3, 3),
        ("nccl_shm_full.log", None, "nccl_oom", None, 0),
        ("deepspeed_launcher_sigkill.log", {"state": "FAILED", "exit_code": 9}, "host_oom", None, None),
        ("deepspeed_launcher_sigkill.log", {"state": "OUT_OF_MEMORY", "exit_code": 0, "signal": 125}, "host_oom", None, None),
        ("deepspeed_cgroup_oom_slurm2205.log", {"state": "FAILED", "exit_code": 1}, "host_oom", None, None),
        ("torchrun_sigkill_summary.log", None, "host_oom", None, None),
        ("torchrun_sigkill_cgroup_slurm2302.log", None, "host_oom", 0, None),
        ("illegal_memory_access.log", None, "not_oom", 0, None),
    ],
)
def test_fixture(name, record, kind, rank, gpu):
    v = classify(record, fixture(name))
    assert (v.kind, v.rank, v.gpu) == (kind, rank, gpu)
    assert v.reason and v.reason.endswith(".")
    lines = fixture(name).split("\n")
    for n, text in v.evidence:
        assert lines[n - 1] == text


def test_hf_trainer_numbers():
    v = classify(None, fixture("hf_trainer_gpu_oom_torch22.log"))
    assert v.numbers == pytest.approx({
        "tried_to_allocate_mib": 3.91 * 1024, "total_capacity_mib": 39.39 * 1024, "free_mib": 1.27 * 1024,
        "process_in_use_mib": 38.11 * 1024, "allocated_by_pytorch_mib": 35.02 * 1024,
        "reserved_unallocated_mib": 2.57 * 1024,
    })
    assert v.evidence[0][0] == 35


def test_deepspeed_cgroup_evidence_has_both_lines():
    v = classify(None, fixture("deepspeed_cgroup_oom_slurm2205.log"))
    texts = [t for _, t in v.evidence]
    assert any("exits with return code = -9" in t for t in texts) and any("oom-kill event" in t for t in texts)


# ------------------------------------------------------------------ files


def test_classify_file_plain(tmp_path):
    path = tmp_path / "slurm-12.out"
    path.write_text(fixture("torchrun_rank_oom_childfailed.log"))
    v = classify_file(path)
    assert v == classify(None, fixture("torchrun_rank_oom_childfailed.log"))


def test_classify_file_gzip_numbers_lines_in_the_whole_file(tmp_path):
    text = "".join(f"step {i}\n" for i in range(50_000)) + new_oom() + "\n"
    path = tmp_path / "rank0.log.gz"
    path.write_bytes(gzip.compress(text.encode()))
    v = classify_file(path, max_bytes=4096)
    assert v.kind == "gpu_oom" and v.evidence == ((50_001, new_oom()),)
    assert "line numbers" not in v.reason


def test_classify_file_truncated_gzip(tmp_path):
    text = new_oom() + "\n" + "".join(f"step {i} loss 1.0\n" for i in range(100_000))
    packed = gzip.compress(text.encode())
    path = tmp_path / "cut.log.gz"
    path.write_bytes(packed[: len(packed) // 2])
    v = classify_file(path)
    assert v.kind == "gpu_oom" and "damaged gzip" in v.reason


def test_classify_file_binary_garbage(tmp_path):
    path = tmp_path / "garbage.log"
    path.write_bytes(bytes(range(256)) * 100 + b"\n" + new_oom().encode() + b"\n\x00\xff\xfe")
    assert classify_file(path).kind == "gpu_oom"
    path.write_bytes(bytes(range(256)) * 100)
    assert classify_file(path).kind == "unknown"


def test_classify_file_empty(tmp_path):
    path = tmp_path / "empty.log"
    path.write_bytes(b"")
    assert classify_file(path).kind == "unknown"
    assert classify_file(path, {"state": "OUT_OF_MEMORY"}).kind == "host_oom"


def test_classify_file_missing_raises_hpcmem_error(tmp_path):
    with pytest.raises(HpcmemError):
        classify_file(tmp_path / "missing.log")


def test_classify_file_2gb_sparse_log_reads_only_the_tail(tmp_path):
    path = tmp_path / "huge.log"
    with open(path, "wb") as f:
        f.seek(2 * 2**30)
        f.write(b"\n[rank7]: " + new_oom(gpu=7).encode() + b"\n")
    start = time.monotonic()
    v = classify_file(path)
    assert time.monotonic() - start < 5.0
    assert v.kind == "gpu_oom" and v.rank == 7 and v.gpu == 7
    assert "line numbers count from the start of the last 8.00 MiB" in v.reason


def test_classify_paths_one_file_per_rank(tmp_path):
    (tmp_path / "rank0.log").write_text("[rank0]: step 1\n[rank0]: [Rank 0] Watchdog caught collective operation timeout: x\n")
    (tmp_path / "rank1.log").write_text("step 1\nstep 2\n" + new_oom(gpu=1) + "\n")
    v = classify_paths([tmp_path / "rank0.log", tmp_path / "rank1.log"])
    assert v.kind == "gpu_oom" and v.gpu == 1
    assert v.evidence == ((3, new_oom(gpu=1)),) and "rank1.log" in v.reason


def test_classify_paths_record_and_sigkill_across_files(tmp_path):
    (tmp_path / "a.log").write_text("step 1\n")
    (tmp_path / "b.log").write_text("x\n" + SIGKILL_LINES[0] + "\n")
    v = classify_paths([tmp_path / "a.log", tmp_path / "b.log"], {"state": "OUT_OF_MEMORY"})
    assert v.kind == "host_oom" and v.evidence == ((2, SIGKILL_LINES[0]),)


def test_classify_paths_nothing():
    assert classify_paths([]).kind == "unknown"


def test_classify_is_fast_on_a_full_8_mib_tail():
    noise = "".join(f"[rank{i % 8}]: step {i} loss 2.{i % 97} lr 3e-4 grad_norm 0.8 tokens/s 41234\n" for i in range(120_000))
    text = noise[-8 * 2**20:] + new_oom() + "\n"
    start = time.monotonic()
    v = classify(None, text)
    assert time.monotonic() - start < 5.0 and v.kind == "gpu_oom"


def test_verdict_round_trips_through_its_dict():
    from toolkit.classify import Verdict, classify

    v = classify(None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                       "capacity of 15.77 GiB of which 1.00 GiB is free.")
    assert v.is_oom and Verdict.from_dict(v.to_dict()) == v


def test_ranks_that_failed_differently_first_one_first():
    text = "\n".join([
        "[rank0]: step 10 loss 2.1",
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity "
        "of 15.77 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 14.66 GiB memory in use. "
        "Of the allocated memory 13.90 GiB is allocated by PyTorch, and 0.40 GiB is reserved by PyTorch but unallocated.",
        "[rank0]: [E ProcessGroupNCCL.cpp:475] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42)",
        "[rank0]: RuntimeError: NCCL communicator was aborted on rank 0.",
    ])
    v = classify(None, text)
    assert v.kind == "gpu_oom" and v.rank == 1
    assert [(r["rank"], r["kind"], r["line"]) for r in v.ranks] == [(1, "gpu_oom", 2), (0, "not_oom", 3)]
    assert "timeout" in v.ranks[1]["what"].lower()
    assert Verdict.from_dict(v.to_dict()).ranks == v.ranks


def test_one_rank_gives_no_rank_list():
    v = classify(None, "[rank0]: RuntimeError: boom\n[rank0]: ValueError: again\n")
    assert v.ranks == ()


def test_rank_lines_are_numbered_in_their_own_files(tmp_path):
    a, b = tmp_path / "rank0.log", tmp_path / "rank1.log"
    a.write_text("hello\n[rank0]: RuntimeError: NCCL communicator was aborted on rank 0.\n")
    b.write_text("x\ny\n[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered\n")
    v = classify_paths([a, b])
    assert {(r["rank"], r["line"], r["file"]) for r in v.ranks} == {(0, 2, str(a)), (1, 3, str(b))}


# ------------------------------------------------------------------ issue 12: causes, teardown, phase, step


@pytest.mark.parametrize("text, cause", [
    ("E1223 api.py:882] failed (exitcode: -11) local_rank: 0 (pid: 3304209) of binary: python\n", "segfault"),
    ("Process finished with exit code 139 (interrupted by signal 11: SIGSEGV)\n", "segfault"),
    ("Segmentation fault (core dumped)\n", "segfault"),
    ("RuntimeError: Function 'LogSoftmaxBackward' returned nan values in its 0th output.\n", "nan"),
    ("Loss is nan, stopping training\n", "nan"),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)\n", "nccl_timeout"),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-"
     "contiguous input.\n", "cudnn_not_supported"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered\n", "illegal_memory_access"),
    ("node08:1:2 [0] include/shm.h:27 NCCL WARN Call to shm_open failed : Permission denied\n"
     "node08:1:2 [0] include/shm.h:48 NCCL WARN Error while creating shared memory segment nccl-shm-recv-b7 "
     "(size 4460544)\n", "nccl_shm_permission"),
    # endings named on a neighbouring line: an abort's what(), the kernel's own assert line, NCCL's Cuda failure
    ("terminate called after throwing an instance of 'c10::DistBackendError'\n"
     "  what():  [PG 1 Rank 7] Process group watchdog thread terminated with exception: [Rank 7] Watchdog caught "
     "collective operation timeout: WorkNCCL(SeqNum=199, OpType=_REDUCE_SCATTER_BASE, Timeout(ms)=600000) ran for "
     "882725 milliseconds before timing out.\n", "nccl_timeout"),
    ("/pytorch/aten/src/THCUNN/generic/SpatialClassNLLCriterion.cu:103: nll_loss2d_forward_kernel: block: [5,0,0], "
     "thread: [996,0,0] Assertion `t >= 0 && t < n_classes` failed.\n", "device_assert"),
    ("[1] misc/shmutils.cc:103 NCCL WARN Cuda failure 'invalid argument'\n\n"  # cudaHostRegister refused it
     "[1] misc/shmutils.cc:114 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-NzwJ7O "
     "(size 9637888)\n", "nccl_shm_register"),
    ("[1] misc/shmutils.cc:103 NCCL WARN Cuda failure 1 'invalid argument'\n\n"  # newer NCCL numbers the error
     "[1] misc/shmutils.cc:114 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-Nz "
     "(size 9637888)\n", "nccl_shm_register"),
])
def test_known_endings_are_not_oom_with_their_cause(text, cause):
    v = classify(None, text)
    assert v.kind == "not_oom" and v.cause == cause


HF_DONE = ("{'train_runtime': 812.3, 'train_samples_per_second': 9.8, 'train_steps_per_second': 0.6, "
           "'train_loss': 1.92, 'epoch': 3.0}\n100%|##########| 500/500 [13:32<00:00,  1.62s/it]\n")


def test_abort_after_the_final_metrics_is_a_teardown_crash():
    text = HF_DONE + "terminate called without an active exception\n" + (
        "[2026-11-20 10:00:00,000] [ERROR] [launch.py:325:sigkill_handler] ['python', 'train.py'] exits with "
        "return code = -6\n")
    v = classify({"state": "FAILED", "exit_code": 1}, text)
    assert v.kind == "not_oom" and v.cause == "teardown" and v.phase == "teardown"
    assert "Training completed" in v.reason and v.step == 500 and v.total_steps == 500


def test_the_watchdog_abort_names_its_rank():
    text = ("terminate called after throwing an instance of 'c10::DistBackendError'\n"
            "  what():  [PG 3 Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9141)\n")
    assert classify(None, text).rank == 1


def test_an_abort_whose_what_line_is_not_a_known_ending_stays_an_abort():
    text = ("terminate called after throwing an instance of 'std::runtime_error'\n  what():  bad thing\n")
    assert classify(None, text).cause == "sigabrt_no_context"


def test_dataloader_bus_error_in_the_main_process_is_shm():
    text = ("RuntimeError: DataLoader worker (pid 56811) is killed by signal: Bus error. It is possible that "
            "dataloader's workers are out of shared memory. Please try to raise your shared memory limit.\n")
    v = classify(None, text)
    assert (v.kind, v.cause, v.confidence, v.phase) == ("host_oom", "shm", "medium", "data")


TRAIN_DONE_BAR = "Train: 100%|##########| 74/74 [32:09<00:00, 26.08s/it]\n"


@pytest.mark.parametrize("bar, teardown", [
    (TRAIN_DONE_BAR, True),
    ("100%|##########| 74/74 [32:09<00:00, 26.08s/it]\n", True),  # an unnamed bar: training's
    ("Train:  99%|#########9| 73/74 [32:09<00:26, 26.08s/it]\n", False),
    ("Loading checkpoint shards: 100%|##########| 2/2 [00:09<00:00,  4.5s/it]\n", False),
    ("Evaluating: 100%|##########| 10/10 [00:09<00:00,  1.1it/s]\n", False),
])
def test_an_abort_after_a_finished_training_bar_is_teardown(bar, teardown):
    text = bar + ("E0911 16:21:58.831000 325 torch/distributed/elastic/multiprocessing/api.py:869] failed "
                  "(exitcode: -6) local_rank: 0 (pid: 470) of binary: /opt/conda/bin/python\n")
    v = classify(None, text)
    assert (v.cause == "teardown") is teardown, v


@pytest.mark.parametrize("bars", [
    "Epoch 0: 100%|######| 74/74 [01:00<00:00]\nEpoch 1:  40%|##   | 30/74 [00:20<00:30]\n",  # the next epoch ran
    " 31%|###       | 310/1000 [10:00<20:00]\n100%|##########| 13/13 [00:05<00:00]\n",  # an eval inside training
])
def test_a_finished_bar_that_is_not_the_end_of_training_is_no_teardown(bars):
    v = classify(None, bars + "Segmentation fault (core dumped)\n")
    assert v.cause == "segfault", v


def test_a_preparing_bar_is_not_a_training_step():
    text = ("Preparing test set...:  46%|####6     | 31/67 [00:02<00:02, 14.1it/s]\n"
            "slurmstepd: error: *** STEP 6053.0 ON node12 CANCELLED AT 2024-05-02T10:00:00 ***\n")
    v = classify(None, text)
    assert v.cause == "cancelled" and v.step is None


def test_abort_with_no_context_is_unknown():
    v = classify(None, "step 3 loss 2.1\nterminate called without an active exception\nAborted (core dumped)\n")
    assert v.kind == "unknown" and v.cause == "sigabrt_no_context" and v.confidence == "low"


def test_dmesg_oom_killer_is_host_oom_with_the_resident_size():
    text = ("[3017506.733819] Out of memory: Kill process 25635 (python) score 974 or sacrifice child\n"
            "[3017506.736861] Killed process 25635 (python) total-vm:55518724kB, anon-rss:23902876kB, file-rss:1kB\n")
    v = classify(None, text)
    assert v.kind == "host_oom" and v.cause == "oom_killer" and v.confidence == "high"
    assert v.numbers["host_used_mib"] == pytest.approx(23902876 / 1024)


def test_dataloader_shm_bus_error_is_host_memory():
    v = classify(None, "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient "
                       "shared memory (shm).\n")
    assert v.kind == "host_oom" and v.cause == "shm" and v.phase == "data"


TRACE = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    main()\n"


@pytest.mark.parametrize("frames, phase", [
    ('  File "m.py", line 1, in forward\n    x = self.fc(x)\n', "forward"),
    ('  File "t.py", line 3, in training_step\n    loss.backward()\n  File "torch/_tensor.py", line 5, in backward\n',
     "backward"),
    ('  File "torch/optim/adamw.py", line 5, in _multi_tensor_adamw\n    exp_avg_sq.mul_(beta2)\n', "optimizer"),
    ('  File "trainer.py", line 5, in evaluate\n  File "trainer.py", line 9, in prediction_step\n'
     '  File "m.py", line 1, in forward\n', "eval"),
    ('  File "m.py", line 5, in generate\n  File "m.py", line 1, in forward\n', "generate"),
    ('  File "modeling_utils.py", line 5, in from_pretrained\n  File "module.py", line 9, in _apply\n', "load"),
    ('  File "trainer.py", line 5, in _save_checkpoint\n  File "serialization.py", line 9, in save\n', "checkpoint"),
])
def test_phase_from_the_traceback(frames, phase):
    v = classify(None, TRACE + frames + new_oom() + "\n")
    assert v.phase == phase


def test_no_traceback_no_phase_and_step_from_progress_lines():
    text = " 12%|#2        | 120/1000 [01:10<08:40,  1.69it/s]\n" + new_oom() + "\n"
    v = classify(None, text)
    assert v.phase is None and v.step == 120 and v.total_steps == 1000


def test_a_preprocessing_bar_is_not_a_step():
    text = "Map: 100%|##########| 5000/5000 [00:03<00:00, 1500 examples/s]\n" + new_oom() + "\n"
    assert classify(None, text).step is None


def test_a_kill_followed_by_the_schedulers_time_limit_is_the_time_limit():
    text = ("srun: error: node1: task 0: Killed\n"
            "slurmstepd: error: *** STEP 12.0 ON node1 CANCELLED AT 2026-11-20T10:00:00 DUE TO TIME LIMIT ***\n")
    v = classify(None, text)
    assert v.kind == "not_oom" and v.cause == "time_limit"


def test_a_loss_scalers_skipped_step_is_not_a_nan_stop():
    text = "[deepspeed] OVERFLOW! Rank 0 Skipping step. Detected inf or nan in gradients\nKilled\n"
    assert classify(None, text).kind == "host_oom"


@pytest.mark.parametrize("line, kind", [
    ("RuntimeError: MPS backend out of memory (MPS allocated: 18.04 GB, other allocations: 30.58 MB, max allowed: "
     "18.13 GB). Tried to allocate 256.00 MB on private pool.", "gpu_oom"),
    ("torch.OutOfMemoryError: XPU out of memory. Tried to allocate 2.00 GiB.", "gpu_oom"),
    ("RuntimeError: cudaMalloc failed: out of memory", "gpu_driver_oom"),
    ("OSError: [WinError 1455] The paging file is too small for this operation to complete. Error loading "
     "\"caffe2_detectron_ops.dll\"", "cpu_alloc_oom"),
])
def test_other_allocators_running_out(line, kind):
    v = classify(None, line + "\n")
    assert v.kind == kind


@pytest.mark.parametrize("line, kind, cause", [
    ("node1:1:2 [0] NCCL WARN Cuda failure 2 'out of memory'", "nccl_oom", "device"),
    ("[1]+  Killed                  python train.py", "host_oom", "sigkill"),
    ("Process finished with exit code -1073741819 (0xC0000005)", "not_oom", "segfault"),
])
def test_newer_and_other_platform_wordings(line, kind, cause):
    v = classify(None, line + "\n")
    assert (v.kind, v.cause) == (kind, cause)


def test_nccl_calloc_async_states_its_size():
    v = classify(None, "node1:1:2 [3] include/alloc.h:125 NCCL WARN Failed to CUDA calloc async 608 bytes\n")
    assert v.kind == "nccl_oom" and v.numbers["nccl_bytes"] == 608 and v.gpu == 3


def test_the_deepspeed_version_is_read_from_a_head_the_tail_skipped(tmp_path):
    """The engine prints 'DeepSpeed info: version=...' once, at start-up; a long log's tail does not hold it, so the
    head is read for it. A hostile version (thousands of digits) is not a version."""
    from toolkit.classify import classify_paths, deepspeed_version

    banner = "[2024-08-06 10:00:01,123] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: version=0.14.2, x\n"
    oom = new_oom(tried="1.00 GiB", total="39.39 GiB", free="0.50 GiB", this="38.80 GiB", allocated="37.00 GiB",
                  unallocated="1.20 GiB")
    log = tmp_path / "slurm-1.out"
    log.write_text(banner + "{'loss': 1.0, 'learning_rate': 1e-05, 'epoch': 0.1}\n" * 5000 + oom + "\n")
    assert classify_paths([log], max_bytes=4096).deepspeed_version == "0.14.2"
    assert classify_paths([log]).deepspeed_version == "0.14.2"  # the whole log read
    log.write_text("no banner\n" * 5000 + oom + "\n")
    assert classify_paths([log], max_bytes=4096).deepspeed_version is None
    assert deepspeed_version("DeepSpeed info: version=" + "9" * 5000 + ".1") is None
    assert deepspeed_version("DeepSpeed info: version=0.16.4+cu121, git-hash=unknown") == "0.16.4"
