"""Where to look when a failure is not out-of-memory: what it is, and the next thing to check (no memory advice)."""

from __future__ import annotations

from ..classify import Verdict

# --------------------------------------------------------------------------- not a memory failure


_WHERE = (
    (("time limit", "timeout"), "The job reached its time limit: ask for more (--time; hpcmem: --set time_min=...) "
     "up to the partition's limit, or make it checkpoint and resume (#SBATCH --signal=B:USR1@90 --requeue)."),
    (("cancel",), "The job was cancelled: `sacct -j JOBID -o JobID,State,End,User` shows when and by whom "
     "(\"CANCELLED by UID\"); if a rank failed first, its error is the cause."),
    (("preempt",), "The job was preempted by a higher-priority job: resubmit with --requeue, or use a partition "
     "or QOS without preemption."),
    (("node fail", "boot failure"), "A node failed: resubmit (sacct -j JOBID -o JobID,NodeList shows which node; "
     "report it to the admins)."),
    (("illegal memory access", "misaligned address", "launch failure"), "A CUDA kernel faulted: rerun with "
     "CUDA_LAUNCH_BLOCKING=1 (and TORCH_USE_CUDA_DSA=1) to see which operation; often a bug or a version mismatch."),
    (("device-side assert",), "A device-side assert: usually an index out of range (labels >= num_labels, token "
     "ids >= vocab_size); rerun with CUDA_LAUNCH_BLOCKING=1 to see which operation."),
    (("ecc",), "An uncorrectable ECC error is a hardware fault: report the node (nvidia-smi -q -d ECC) and resubmit."),
    (("nccl", "watchdog"), "A collective timed out: rerun with NCCL_DEBUG=INFO (and TORCH_DISTRIBUTED_DEBUG=DETAIL); "
     "look for the rank that stopped first, whose own error is usually the cause."),
    (("no space left", "quota"), "The disk is full or over quota: `df -h PATH`, `quota -s` or `lfs quota -u $USER "
     "PATH`; write checkpoints and caches (HF_HOME, TMPDIR) to scratch."),
    (("import", "no module"), "A package is missing on the compute node: check the job's module/venv lines "
     "(python -c 'import X' inside an srun)."),
    (("command not found",), "A command is missing on the compute node: check PATH and the module lines of the "
     "job script."),
    (("sigkill",), "Killed by SIGKILL with no out-of-memory record: `sacct -j JOBID -o JobID,State,ExitCode,MaxRSS,"
     "ReqMem` (MaxRSS near ReqMem: host memory) and the node's kernel log (dmesg) for the OOM killer."),
    (("completed",), "The job completed: nothing failed."),
)


def where_to_look(verdict: Verdict) -> list[str]:
    """For a failure that is not an OOM: what it is likely to be and where to look, from the verdict's reason
    and evidence (sentences; [] for an OOM, which gets remedies instead)."""
    if verdict.is_oom:
        return []
    text = " ".join([verdict.reason, *(line for _, line in verdict.evidence)]).lower()
    found = [advice for needles, advice in _WHERE if any(n in text for n in needles)]
    if found:
        return found[:2]
    if verdict.kind == "not_oom":
        return ["An error in the program: read the traceback that ends at the evidence line, on the rank that failed "
                "first."]
    return ["No failure signature was found: read the end of every rank's log and `sacct -j JOBID -o "
            "JobID,State,ExitCode,MaxRSS,ReqMem,Elapsed`."]
