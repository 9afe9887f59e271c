"""Fuzzing triage's readers of untrusted files: plan.json, DeepSpeed configs, job scripts and Trainer arguments
(``triage/scriptread.py``, ``triage/facts.py``), the log classifier (``toolkit/classify.py``), the log tail
reader, the triage sources (bytes, huge lines, control characters, nesting, odd file names) and the reports.

Every property: a valid result or one HpcmemError, never another exception, within a time bound; knobs read from
files have the Plan's types and bounds; text and markdown reports carry no raw control character."""

from __future__ import annotations

import gzip
import io
import json
import os
import re

from hostile import outcome
from hypothesis import given, settings
from hypothesis import strategies as st
from fuzz_strategies import examples, LOG_LINES, PIECES, documents, hostile_text, log_bytes, log_text, scalars

from toolkit.classify import classify, classify_file
from toolkit.logtail import read_stream_tail, read_tail
from toolkit.plan import KNOBS
from toolkit.triage.facts import FactsBuilder, add_ds_config, add_files_near, add_plan_json, knob_problem
from toolkit.triage.formats import render_report, safe_report
from toolkit.triage.scriptread import read_ds_config, read_script
from toolkit.triage.sources import cases

UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def check_knobs(knobs: dict) -> None:
    """Knobs kept from files: Plan names, Plan types and bounds (``facts.knob_problem``)."""
    for name, value in knobs.items():
        assert name in KNOBS, name
        assert knob_problem(name, value) is None, (name, value)


def check_read_knobs(knobs: dict, origin=None) -> None:
    """Knobs a reader found: Plan names and Python types; what ``FactsBuilder.knobs`` keeps of them is within
    the Plan's bounds, and each one it drops is named in ``missing``."""
    for name, value in knobs.items():
        assert name in KNOBS and type(value) in (int, bool, str), (name, value)
    builder = FactsBuilder()
    builder.knobs(knobs, origin or "job script")
    facts = builder.build()
    check_knobs(facts.plan_knobs)
    for name in set(knobs) - set(facts.plan_knobs):
        assert any(f" {name} " in m and m.endswith("not used") for m in facts.missing), (name, facts.missing)


nested_json = st.one_of(
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 3000).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.integers(1, 200_000).map(lambda n: "[" * n),
)

script_words = st.sampled_from(["#SBATCH --nodes=2", "#SBATCH --gres=gpu:²", "#SBATCH --time=00:99:99",
                                "#SBATCH --mem=1_6G", "#SBATCH -p $PART", "torchrun --nproc_per_node ٤ train.py",
                                "deepspeed --num_gpus 8 train.py --deepspeed ds.json", "--per_device_train_batch_size",
                                "--gradient_accumulation_steps", "--bf16", "--fsdp 'full_shard offload'", "\\",
                                "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "accelerate launch",
                                "--num_processes", "--optim", "adamw_torch", "--max_seq_length", "99999999999999999999",
                                "cd /tmp", "python -m torch.distributed.run", "--nnodes=0", "'", '"',
                                "#SBATCH --output=%9999999999j.out", "#SBATCH --error=%4a-%x-%99u.err",
                                "--deepspeed " + "d" * 5000, "cd " + "c/" * 3000, "--deepspeed /dev/zero"])
scripts = st.lists(st.one_of(script_words, hostile_text, st.integers(-3, 2**70).map(str)), max_size=40).map(
    lambda ws: " ".join(w if not w.startswith("#SBATCH") else "\n" + w + "\n" for w in ws))


@settings(max_examples=examples(500))
@given(text=st.one_of(scripts, hostile_text, st.text(max_size=300)))
def test_fuzz_read_script(text):
    kind, found = outcome(lambda: read_script(text), 10)
    assert kind == "ok"  # a script reader never refuses: what it cannot read is left out
    check_read_knobs(found["knobs"], found["knob_origin"])
    assert set(found["knob_origin"]) == set(found["knobs"])


@settings(max_examples=examples(500))
@given(cfg=st.one_of(documents, st.dictionaries(st.sampled_from(
    ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "fp16", "bf16",
     "zero_optimization", "optimizer"]), st.one_of(scalars, st.dictionaries(
         st.sampled_from(["enabled", "stage", "offload_optimizer", "offload_param", "type", "device"]),
         st.one_of(scalars, st.dictionaries(st.just("device"), scalars)))), max_size=6)))
def test_fuzz_read_ds_config(cfg):
    if not isinstance(cfg, dict):
        return
    kind, knobs = outcome(lambda: read_ds_config(cfg), 5)
    assert kind == "ok"
    check_read_knobs(knobs, "ds_config.json")


@settings(max_examples=examples(200))
@given(content=st.one_of(documents.map(lambda d: json.dumps(d, default=str)), nested_json, hostile_text,
                         st.dictionaries(st.sampled_from(KNOBS + ("world_size",)), scalars).map(json.dumps)),
       name=st.sampled_from(["plan.json", "ds_config.json"]))
def test_fuzz_plan_and_ds_config_files(tmp_path_factory, content, name):
    tmp = tmp_path_factory.mktemp("files")
    path = tmp / name
    path.write_text(content, encoding="utf-8", errors="surrogatepass")
    builder = FactsBuilder()
    reader = (lambda: add_plan_json(builder, path)) if name == "plan.json" else (lambda: add_ds_config(builder, [tmp]))
    kind, _ = outcome(reader, 20)
    assert kind == "ok"
    facts = builder.build()
    check_knobs(facts.plan_knobs)
    assert all(len(m) < 2000 for m in facts.missing)


@settings(max_examples=examples(300))
@given(text=log_text, state=st.sampled_from([None, "FAILED", "OUT_OF_MEMORY", "COMPLETED", "TIMEOUT", "CANCELLED"]),
       code=st.one_of(st.none(), st.integers(-300, 300)))
def test_fuzz_classifier(text, state, code):
    record = None if state is None else {"state": state, "exit_code": code, "signal": None}
    kind, verdict = outcome(lambda: classify(record, text), 20)
    assert kind == "ok" and verdict.kind and isinstance(verdict.reason, str)
    for line, evidence in verdict.evidence:
        assert isinstance(line, int) and line >= 1 and evidence in text


@settings(max_examples=examples(200))
@given(data=log_bytes, max_bytes=st.integers(1, 4096), gz=st.booleans(), long_line=st.integers(0, 20_000))
def test_fuzz_log_tail(tmp_path_factory, data, max_bytes, gz, long_line):
    data = data + (b"q" * long_line + b" " + LOG_LINES[0].encode() + b"\n" if long_line else b"")
    tmp = tmp_path_factory.mktemp("tail")
    path = tmp / "slurm-1.out"
    path.write_bytes(gzip.compress(data) if gz else data)
    kind, tail = outcome(lambda: read_tail(path, max_bytes, number_lines=True), 20)
    assert kind == "ok"
    stream = read_stream_tail(io.BytesIO(path.read_bytes()), max_bytes)
    if not gz and data[:2] == b"\x1f\x8b":  # gzip's magic on bytes that are not gzip: read as a damaged gzip
        assert tail.damaged and stream.damaged
        return
    whole = data.decode("utf-8", "replace")
    assert len(tail.text.encode("utf-8", "surrogatepass")) <= 3 * max_bytes + 3
    try:
        data.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    if valid:
        assert whole.endswith(tail.text) and whole.endswith(stream.text)
    if re.search(rb"[!-~]", data[-max_bytes:]):  # a visible ASCII character at the end: the tail is never empty
        assert tail.text.strip() and stream.text.strip()
    if len(data) <= max_bytes:
        assert tail.text == whole and not tail.truncated
    kind, verdict = outcome(lambda: classify_file(path, max_bytes=max_bytes), 20)
    assert kind == "ok"
    if long_line and max_bytes >= len(LOG_LINES[0]) + 2:
        assert verdict.kind != "unknown" or verdict.evidence, verdict  # an OOM at the end is never "empty"


odd_names = st.one_of(st.sampled_from(["slurm-12.out", "slurm-12_3.err", "rank-0.log", "train.log.gz", "x.txt",
                                       "job.sbatch", "plan.json", "ds_config.json", "spec.yaml", "attempt-1"]),
                      hostile_text.map(lambda t: (t.replace("/", "_").replace("\x00", "") or "n")[:60] + ".out"))


@settings(max_examples=examples(120))
@given(files=st.lists(st.tuples(odd_names, st.one_of(log_bytes, nested_json.map(str.encode),
                                                     scripts.map(lambda s: s.encode("utf-8", "surrogatepass")))),
                      min_size=1, max_size=5),
       links=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=3), fifo=st.booleans())
def test_fuzz_triage_directory(tmp_path_factory, files, links, fifo):
    """A directory of odd logs, configs, scripts, symlink loops and a FIFO: cases in bounded time, and reports
    whose text and markdown hold no raw control character."""
    tmp = tmp_path_factory.mktemp("dir")
    names = []
    for name, content in files:
        if name in ("attempt-1", ".", ".."):
            name = name + ".log"
        path = tmp / name
        if path.exists():
            continue
        path.write_bytes(content)
        names.append(name)
    for a, b in links:
        if names:
            link = tmp / f"link-{a}-{b}.out"
            if not os.path.lexists(link):
                os.symlink(tmp / names[b % len(names)] if a % 2 else tmp / f"link-{b}-{a}.out", link)
    if fifo:
        os.mkfifo(tmp / "pipe.out")
    kind, found = outcome(lambda: cases(str(tmp)), 30)
    assert kind == "ok" and found
    for case in found:
        check_knobs(case.facts.plan_knobs)
    from toolkit.triage import run_triage

    targets = [str(tmp)] + [str(tmp / n) for n in names[:2] if (tmp / n).is_file()]
    for fmt in ("text", "markdown"):
        kind, text = outcome(lambda: run_triage(targets, None, fmt), 60)
        if kind == "ok":
            assert not UNSAFE.search(text.replace("\n", "")), repr(text[:500])
        else:
            assert "not a regular file" in str(text) or "no such file" in str(text), text


@settings(max_examples=examples(300))
@given(report=documents, evidence=st.lists(st.one_of(hostile_text, st.integers(0, 300_000).map(
    lambda n: "x" * n + LOG_LINES[0] + "y" * (n // 3))), max_size=3))
def test_fuzz_safe_report(report, evidence):
    data = {"findings": [{"verdict": {"evidence": [{"line": 1, "text": e} for e in evidence]}, "extra": report}]}
    kind, safe = outcome(lambda: safe_report(data), 10)
    assert kind == "ok"
    text = json.dumps(safe, ensure_ascii=False)
    assert not UNSAFE.search(text.replace("\\n", ""))
    for e in safe["findings"][0]["verdict"]["evidence"]:
        assert len(e["text"]) <= 1100 + 200


@settings(max_examples=examples(120))
@given(text=log_text, gz=st.booleans())
def test_fuzz_triage_stdin(text, gz):
    from toolkit.triage import run_triage

    raw = text.encode("utf-8", "surrogatepass")
    stdin = io.BytesIO(gzip.compress(raw) if gz else raw)
    kind, out = outcome(lambda: run_triage(["-"], None, "text", stdin=stdin), 30)
    assert kind == "ok" and not UNSAFE.search(out.replace("\n", ""))
