"""The controller's gate on how sure a host OOM is (pure): a lone SIGKILL is retried with a memory move only
when the scheduler's record agrees (sacct MaxRSS near the job's --mem)."""

from toolkit.classify import JobRecord, classify
from toolkit.controller import HOST_CONFIRM_SHARE, host_oom_confirmed

SIGKILL_LOG = """\
[2024-05-01 10:00:00] step 120/1000 loss 2.31
WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 4242 closing signal SIGTERM
ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 4241) of binary: /usr/bin/python3
"""


def lone_sigkill(**numbers):
    verdict = classify(None, SIGKILL_LOG)
    assert verdict.kind == "host_oom" and verdict.confidence == "medium", verdict
    from dataclasses import replace

    return replace(verdict, numbers={**verdict.numbers, **numbers})


def test_a_lone_sigkill_is_retried_only_when_maxrss_reached_the_limit():
    ok, why = host_oom_confirmed(lone_sigkill(max_rss_mib=7900.0), 8192)
    assert ok and why == ""
    ok, why = host_oom_confirmed(lone_sigkill(max_rss_mib=2000.0), 8192)
    assert not ok and "2000 MiB of the 8192 MiB --mem" in why
    ok, why = host_oom_confirmed(lone_sigkill(), 8192)
    assert not ok and "no MaxRSS" in why
    ok, why = host_oom_confirmed(lone_sigkill(max_rss_mib=8000.0), None)
    assert not ok
    assert HOST_CONFIRM_SHARE * 8192 <= 7900


def test_what_the_record_already_confirms_is_never_held_back():
    cgroup = classify(JobRecord(state="OUT_OF_MEMORY", exit_code=0, signal=125), SIGKILL_LOG)
    assert cgroup.kind == "host_oom" and cgroup.confidence == "high"
    assert host_oom_confirmed(cgroup, 8192) == (True, "")
    gpu = classify(None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB "
                         "total capacity; 14.50 GiB already allocated; 2.00 MiB free; 14.90 GiB reserved in total by "
                         "PyTorch)")
    assert gpu.is_oom and host_oom_confirmed(gpu, None) == (True, "")
    assert host_oom_confirmed(classify(None, "ValueError: bad shape"), None) == (True, "")
