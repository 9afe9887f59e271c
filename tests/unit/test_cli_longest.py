"""hpcmem estimate / plan --max-seq-len and --seq-len-hist: the plan is sized for the data's longest sequence."""

import json
from pathlib import Path

import pytest

from hpcmem_cli import run_cli

REPO = Path(__file__).resolve().parents[2]
WHERE = ("--site", "example-hpc", "--partition", "a100-40gb")


def estimate(tmp_path, *args):
    result = run_cli("estimate", "--model", "gpt2", "--seq-len", "128", "--micro-batch", "8", *WHERE, "--json",
                     *args, home=tmp_path, check=True)
    return json.loads(result.stdout)


def test_estimate_is_sized_for_the_longest_sequence(tmp_path):
    plain = estimate(tmp_path)
    assert "sized_for_longest" not in plain
    longest = estimate(tmp_path, "--max-seq-len", "1024")
    assert longest["sized_for_longest"]["sized_seq_len"] == 1024 and longest["sized_for_longest"]["seq_len"] == 128
    assert longest["peak_allocated_mib"] > plain["peak_allocated_mib"] * 1.5  # activations scale with the length
    hist = tmp_path / "lengths.json"
    hist.write_text(json.dumps({"64": 5000, "128": 900, "1024": 2, "4096": 0}))
    from_hist = estimate(tmp_path, "--seq-len-hist", hist)
    assert from_hist["sized_for_longest"]["longest"] == 1024  # 4096 has no sample
    assert from_hist["peak_allocated_mib"] == longest["peak_allocated_mib"]
    text = run_cli("estimate", "--model", "gpt2", "--seq-len", "128", *WHERE, "--max-seq-len", "1024",
                   home=tmp_path, check=True).stdout
    assert "sized for the longest sequence: 1024 tokens (--max-seq-len 1024) instead of the plan's seq_len 128" in text


def test_plan_is_sized_for_the_longest_sequence(tmp_path):
    args = ("plan", REPO / "jobs" / "gpt2-clm.yaml", *WHERE, "--set", "seq_len=256", "--json")
    plain = json.loads(run_cli(*args, home=tmp_path, check=True).stdout)
    sized = json.loads(run_cli(*args, "--max-seq-len", "1024", home=tmp_path, check=True).stdout)
    assert sized["sized_for_longest"]["sized_seq_len"] == 1024 and "sized_for_longest" not in plain
    assert sized["sized_for_longest"]["seq_len"] == 256
    assert all(c["plan"]["seq_len"] == 256 for c in plain["candidates"])
    assert all(c["plan"]["seq_len"] == 1024 for c in sized["candidates"])


@pytest.mark.parametrize("content, says", [
    ("128,1\n256", "line 2: expected 'length,count'"),
    ('{"128": "many"}', "the count must be a non-negative integer"),
    (b"\xff\xfe", "not UTF-8 text"),
])
def test_bad_histogram_files_are_one_line_errors(tmp_path, content, says):
    hist = tmp_path / "h.csv"
    hist.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = run_cli("estimate", "--model", "gpt2", *WHERE, "--seq-len-hist", hist, home=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("hpcmem: error: --seq-len-hist") and says in line


def test_a_missing_histogram_and_a_bad_length(tmp_path):
    result = run_cli("estimate", "--model", "gpt2", *WHERE, "--seq-len-hist", tmp_path / "nope.csv", home=tmp_path)
    assert result.returncode == 2 and "cannot read: No such file or directory" in result.stderr
    result = run_cli("estimate", "--model", "gpt2", *WHERE, "--max-seq-len", "0", home=tmp_path)
    assert result.returncode == 2 and "--max-seq-len" in result.stderr
