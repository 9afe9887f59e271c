"""Fuzzing the parsers of local input: job specs, site profiles, calibration files, ``--set`` and plan.json.

Every property: the parser gives a valid result or one HpcmemError (one line), never another exception, within
a time bound (``hostile.outcome``); what it accepts is what the Plan and the renderer accept, and a rendered
script from it passes the script checks (``hostile.render_outcome``)."""

from __future__ import annotations

import copy
import json

import yaml
from hostile import outcome, render_outcome
from hypothesis import given, settings
from hypothesis import strategies as st
from fuzz_strategies import examples, documents, hostile_text, scalars

from model_configs import TINY_GEMMA, TINY_QWEN3, TINY_ROBERTA
from toolkit import jobspec, sites
from toolkit.estimate.analytic import estimate_analytic
from toolkit.models import load_model_config
from toolkit.modelshape import ModelShape
from toolkit.plan import CHOICES, KNOBS, Plan, parse_knob, parse_sets, with_changes
from toolkit.resources import data_dir

CPU = sites.load_site("testcluster").partition("cpu")
QUICKSTART = yaml.safe_load((data_dir("jobs") / "quickstart.yaml").read_text())
SITE = yaml.safe_load((data_dir("site_configs") / "testcluster.yaml").read_text())


def paths_of(doc, prefix=()):
    """Every key path of a nested dict/list document."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths_of(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths_of(v, prefix + (i,))
    return out


def mutated(doc, data):
    """``doc`` with one to three values (or keys) replaced by hostile ones, at paths drawn from it."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        path = data.draw(st.sampled_from(paths_of(doc)[1:]), label="path")
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if not isinstance(parent, (dict, list)):
            continue
        value = data.draw(st.one_of(scalars, documents), label="value")
        if isinstance(parent, dict) and data.draw(st.booleans(), label="rename key"):
            parent[data.draw(st.one_of(hostile_text, st.integers(-3, 3)), label="key")] = parent.pop(path[-1])
        else:
            parent[path[-1]] = value
    return doc


def as_file(tmp_path, name, doc, data) -> "Path":
    """The document as YAML (or, sometimes, as raw bytes that break the encoding)."""
    path = tmp_path / name
    try:
        text = yaml.safe_dump(doc, allow_unicode=data.draw(st.booleans(), label="unicode"))
    except (yaml.YAMLError, ValueError, TypeError):
        text = json.dumps(doc, default=str)
    raw = text.encode("utf-8", "surrogatepass")
    if data.draw(st.integers(0, 9), label="corrupt") == 0:
        at = data.draw(st.integers(0, max(0, len(raw) - 1)), label="at")
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=8), label="bytes") + raw[at:]
    path.write_bytes(raw)
    return path


@settings(max_examples=examples(200))
@given(data=st.data())
def test_fuzz_job_spec(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("spec")
    path = as_file(tmp, "spec.yaml", mutated(QUICKSTART, data), data)
    kind, spec = outcome(lambda: jobspec.load_spec(path))
    if kind == "ok":
        kind, plan = outcome(lambda: spec.first_plan(CPU))
    if kind == "ok":
        assert isinstance(plan, Plan)
        render_outcome(spec, CPU, plan, tmp, tmp / "INJECTED")


MODEL_CONFIGS = [load_model_config(name) for name in ("gpt2", "bert-large", "llama-7b", "tiny-vit")] + [
    TINY_QWEN3, TINY_GEMMA, TINY_ROBERTA]
A100 = sites.load_site("example-hpc").partition("a100-40gb")


@settings(max_examples=examples(150))
@given(data=st.data())
def test_fuzz_model_config(data):
    """An untrusted config.json (``--model``): its shape and an analytic estimate of it on a GPU, or one
    HpcmemError, within the time bound (a config of millions of layers, or of heads a million times wider than
    the hidden size, once made the per-layer stream run for minutes)."""
    cfg = mutated(data.draw(st.sampled_from(MODEL_CONFIGS), label="config"), data)
    if not isinstance(cfg, dict):
        return
    task = "image-cls" if cfg.get("model_type") == "vit" else data.draw(st.sampled_from(["causal-lm", "seq-cls"]))
    kind, shape = outcome(lambda: ModelShape.from_config(cfg, task))
    if kind == "ok":
        plan = Plan(micro_batch=2, global_batch=2, seq_len=128, precision="bf16-mixed")
        kind, est = outcome(lambda: estimate_analytic(shape, plan, A100))
        if kind == "ok":
            assert est.peak_allocated_mib > 0 and est.peak_reserved_mib >= est.peak_allocated_mib - 1


@settings(max_examples=examples(200))
@given(data=st.data())
def test_fuzz_site_profile(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("site")
    path = as_file(tmp, "testcluster.yaml", mutated(SITE, data), data)
    kind, site = outcome(lambda: sites.load_site_file(path))
    if kind != "ok":
        return
    spec = jobspec.load_spec("quickstart")
    for part in list(site.partitions.values())[:2]:
        kind, plan = outcome(lambda: spec.first_plan(part))
        if kind == "ok":
            render_outcome(spec, part, plan, tmp / part.name.replace("/", "_")[:40], tmp / "INJECTED")


@settings(max_examples=examples(250))
@given(doc=st.one_of(documents, st.fixed_dictionaries({"partitions": st.dictionaries(
    st.one_of(st.sampled_from(["cpu", "v100"]), hostile_text), st.one_of(documents, st.dictionaries(
        st.sampled_from(["gpus", "gpu_mem_gib", "bf16", "fp16", "cuda_context_mib", "allocator_overhead_frac",
                         "fitted_from_ranks"]), scalars)), max_size=3)})))
def test_fuzz_calibration_file(tmp_path_factory, doc):
    tmp = tmp_path_factory.mktemp("cal")
    site = tmp / "testcluster.yaml"
    site.write_text(yaml.safe_dump(SITE))
    try:
        (tmp / "testcluster.calibration.yaml").write_text(yaml.safe_dump(doc))
    except (yaml.YAMLError, UnicodeEncodeError):
        return
    kind, found = outcome(lambda: sites.load_site_file(site))
    if kind == "ok":
        for part in found.partitions.values():
            for key in ("gpu_mem_gib", "cuda_context_mib"):
                assert isinstance(getattr(part, key), (int, float)) and not isinstance(getattr(part, key), bool)
            assert all(isinstance(getattr(part, c), bool) for c in sites.CAPABILITIES)
            assert part.allocator_overhead_frac is None or isinstance(part.allocator_overhead_frac, float)


knob_pairs = st.lists(st.tuples(st.one_of(st.sampled_from(KNOBS), hostile_text),
                                st.one_of(hostile_text, st.integers(-5, 2**45).map(str),
                                          st.sampled_from([v for vs in CHOICES.values() for v in vs]))), max_size=4)


@settings(max_examples=examples(400))
@given(pairs=knob_pairs, sep=st.sampled_from(["=", " = ", "=="]))
def test_fuzz_set_parser(pairs, sep):
    texts = [f"{k}{sep}{v}" for k, v in pairs]
    kind, changes = outcome(lambda: parse_sets(texts), 5)
    if kind != "ok":
        return
    for name, value in changes.items():
        assert name in KNOBS
        assert value is None or type(value) in (int, bool, str)
    kind, plan = outcome(lambda: with_changes(Plan(), changes), 5)
    if kind == "ok":
        assert Plan.from_dict(json.loads(plan.to_json())) == plan


@settings(max_examples=examples(400))
@given(name=st.sampled_from(KNOBS), text=hostile_text)
def test_fuzz_parse_knob_reads_only_what_it_should(name, text):
    kind, value = outcome(lambda: parse_knob(name, text), 5)
    if kind == "ok" and isinstance(value, int) and not isinstance(value, bool):
        assert text.strip().lstrip("-").isascii() and text.strip().lstrip("-").isdigit()


@settings(max_examples=examples(400))
@given(doc=st.one_of(documents, st.dictionaries(st.sampled_from(KNOBS + ("world_size",)), scalars, max_size=6)))
def test_fuzz_plan_from_dict(doc):
    kind, plan = outcome(lambda: Plan.from_dict(doc), 5)
    if kind == "ok":
        assert Plan.from_dict(plan.to_dict()) == plan
