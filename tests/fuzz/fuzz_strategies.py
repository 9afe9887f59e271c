"""Hypothesis strategies for hostile input: text with control characters, shell metacharacters and odd digits,
nested documents, log lines built from real failure messages."""

from __future__ import annotations

import os

from hypothesis import strategies as st

SCALE = float(os.environ.get("HPCMEM_FUZZ_EXAMPLES", "1"))


def examples(n: int) -> int:
    """``n`` examples, scaled by HPCMEM_FUZZ_EXAMPLES (10: a longer hunt)."""
    return max(1, int(n * SCALE))


PIECES = ["\n", "\r", "\x00", "\x1b[31m", "\x1b]0;t\x07", "\x9b2J", "\u202e", "\u2028", "'", '"', "`", "$(", ")",
          ";", "&&", "|", "#", "\\", " ", "\t", "{", "}", "{plan_json}", "{nope}", "%j", "..", "/", "~", "*", "?",
          "1_6", "١٦", "²", "0x1f", "1e9", "-1", "0", "nan", "inf", "True", "null", "~", ":", ",", "[", "]",
          "expandable_segments:True", "max_split_size_mb:128", "a" * 300]

hostile_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(PIECES),
    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=8).map("".join),
)
"""Short text that is most often hostile."""

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), hostile_text)

documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(hostile_text, inner, max_size=4)),
                         max_leaves=20)
"""Nested JSON/YAML-like values of any shape."""

LOG_LINES = [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB "
    "of which 1.10 GiB is free. Of the allocated memory 13.2 GiB is allocated by PyTorch, and 1.1 GiB is reserved "
    "by PyTorch but unallocated.",
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.2 GiB "
    "already allocated; 3.19 MiB free; 14.5 GiB reserved in total by PyTorch)",
    "slurmstepd: error: Detected 1 oom_kill event in StepId=123.batch. Some of the step tasks have been OOM Killed.",
    "[rank1]: Traceback (most recent call last):",
    "RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you tried to "
    "allocate 1073741824 bytes.",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "slurmstepd: error: *** JOB 77 ON node1 CANCELLED AT 2026-01-01T00:00:00 DUE TO TIME LIMIT ***",
    "hpcmem: job 55 attempt 1 on node1 at 2026-01-01T00:00:00+00:00",
    "Killed", "Segmentation fault (core dumped)", "RuntimeError: CUDA error: an illegal memory access was encountered",
    "  File \"train.py\", line 10, in <module>", "epoch 1 step 10/100 loss 2.3", "",
]

log_text = st.lists(st.one_of(st.sampled_from(LOG_LINES), hostile_text,
                              st.tuples(hostile_text, st.sampled_from(LOG_LINES)).map("".join)),
                    max_size=30).map("\n".join)
"""Logs made of real failure lines, noise and hostile text, in any order."""

log_bytes = st.one_of(
    log_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=2000),
    st.tuples(st.binary(max_size=200), log_text).map(lambda p: p[0] + p[1].encode("utf-8", "surrogatepass")),
)
