"""The published GPU measurement set (benchmarks/data/) and its scoring script's loader."""

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from toolkit.modelshape import ModelShape
from toolkit.plan import Plan

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "benchmarks" / "data"


def _script():
    spec = importlib.util.spec_from_file_location("estimator_gpu", REPO / "benchmarks" / "estimator_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu():
    return _script()


@pytest.fixture(scope="module")
def cases(gpu):
    return gpu.load_cases(DATA)


def test_every_file_is_json_with_the_schema_fields():
    files = sorted(DATA.glob("*.json"))
    assert files, "no data files"
    for path in files:
        doc = json.loads(path.read_text())
        for name in ("source", "title", "retrieved", "quote", "setup", "measured", "context_mib", "context_note",
                     "model", "model_config", "task", "gpu", "gpu_mem_gib", "rows"):
            assert name in doc, f"{path.name}: {name}"
        # a public page, or this repository's own measurement (repo:PATH, made on a lent GPU) that must exist
        assert doc["source"].startswith("https://") or (
            doc["source"].startswith("repo:") and (REPO / doc["source"][5:]).is_file()), path.name
        for i, row in enumerate(doc["rows"]):
            assert row["quote"].strip() and row["inferred"].strip(), f"{path.name} rows[{i}]"


def test_enough_rows_and_independent_sources(cases):
    assert len(cases) >= 25
    assert len({c.source.doc["source"] for c in cases}) >= 3
    assert {c.source.doc["measured"] for c in cases} >= {"nvidia_smi_used", "max_reserved", "max_allocated"}


def test_every_row_builds_a_plan_and_a_model_shape(cases):
    for case in cases:
        row, doc = case.row, case.source.doc
        assert isinstance(case.plan, Plan)
        assert case.plan.micro_batch == row["micro_batch"] and case.plan.grad_accum == row["grad_accum"]
        assert case.plan.world_size == row["gpus"] and case.plan.precision == row["precision"]
        assert case.plan.checkpointing == row["checkpointing"] and case.plan.attention == row["attention"]
        assert case.plan.alloc_conf == row.get("alloc_conf", "")
        if case.plan.launcher == "fsdp":  # FULL_SHARD reshards after forward, SHARD_GRAD_OP keeps the weights
            assert row["launcher"] == "fsdp" and case.plan.reshard_after_forward == (row["zero_stage"] == 3)
        else:
            assert case.plan.zero_stage == row["zero_stage"]
            assert case.plan.launcher == ("deepspeed" if row["launcher"] == "fsdp" else row["launcher"])
        shape = ModelShape.from_config(doc["model_config"], task=doc["task"])
        assert shape.n_params == case.shape.n_params > 0
        case.partition.check_plan(case.plan)


def test_known_parameter_counts(cases):
    """The stored configs are the models the sources trained (public parameter counts)."""
    counts = {c.source.name: c.shape.n_params for c in cases}
    assert counts["hf-guide-bert-large-v100"] == 335_143_938  # BertForSequenceClassification, 2 labels
    assert 303_000_000 < counts["rasbt-pytorch-memory-optim-vit-l16"] < 304_500_000  # ViT-L/16, 10 classes
    assert 3_400_000_000 < counts["lightning-thunder-open-llama-3b-a100"] < 3_450_000_000  # open_llama_3b
    assert counts["rasbt-vit-finetuning-precision-vit-l16"] == counts["rasbt-pytorch-memory-optim-vit-l16"]
    assert 85_700_000 < counts["rasbt-vit-finetuning-precision-vit-b16"] < 85_900_000  # ViT-B/16, 10 classes
    assert 124_000_000 < counts["rasbt-llms-from-scratch-gpt2-124m-a100"] - 50257 * 768 < 125_000_000  # untied head


def test_the_shared_table_is_kept_whole():
    shared = json.loads(Path("/work/shared/data/gpu-measured-hf-bert-large-v100.json").read_text()) \
        if Path("/work/shared/data/gpu-measured-hf-bert-large-v100.json").is_file() else None
    if shared is None:
        pytest.skip("the shared table is not on this machine")
    ours = json.loads((DATA / "hf-guide-bert-large-v100.json").read_text())
    assert [r["used_mib"] for r in ours["rows"]] == [r["used_mib"] for r in shared["rows"]]
    assert [r["measured_mib"] for r in ours["rows"]] == [r["used_mib"] for r in shared["rows"]]
    assert ours["context_mib"] == shared["context_mib"] == 1343
    assert ours["model_config"] == shared["model_config"]


def _write(tmp_path, doc, name="bad.json"):
    (tmp_path / name).write_text(json.dumps(doc))
    return tmp_path


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["rows"][0].pop("micro_batch"), "rows[0].micro_batch"),
    (lambda d: d["rows"][1].update(precision="fp8"), "rows[1].precision"),
    (lambda d: d["rows"][0].update(measured_mib="14949"), "rows[0].measured_mib"),
    (lambda d: d.update(measured="nvidia-smi"), ".measured"),
    (lambda d: d.update(context_mib=None), ".context_mib"),
    (lambda d: d["model_config"].pop("hidden_size"), "hidden_size"),
    (lambda d: d["rows"][0].update(zero_stage=2), "rows[0]"),
    (lambda d: d.update(held_out="yes"), ".held_out"),
    (lambda d: d.update(stand_in=" "), ".stand_in"),
])
def test_a_malformed_file_is_named_with_its_field(gpu, tmp_path, edit, field):
    doc = copy.deepcopy(json.loads((DATA / "hf-guide-bert-large-v100.json").read_text()))
    edit(doc)
    with pytest.raises(gpu.DataError) as info:
        gpu.load_cases(_write(tmp_path, doc))
    assert "bad.json" in str(info.value) and field in str(info.value)


def test_script_exits_2_with_one_line_on_bad_data(gpu, tmp_path, capsys):
    doc = json.loads((DATA / "hf-guide-bert-large-v100.json").read_text())
    doc["rows"][0]["gpus"] = 0
    assert gpu.main(["--data", str(_write(tmp_path, doc))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json" in err[0] and "gpus" in err[0]


def test_like_with_like(gpu, cases):
    """nvidia-smi rows get device_used (context + reserved); allocated rows the allocated peak."""
    from toolkit.estimate import ModelRef, estimate

    by_measure = {}
    for case in cases:
        by_measure.setdefault(case.source.doc["measured"], case)
    for measured, case in by_measure.items():
        doc = case.source.doc
        est = estimate(ModelRef(doc["model_config"], doc["task"]), case.plan, case.partition, "analytic")
        value, how = gpu.predicted_mib(est, measured)
        if measured == "nvidia_smi_used":
            assert value == est.device_used_mib and case.partition.cuda_context_mib == doc["context_mib"]
        elif measured == "max_allocated":
            assert value == est.peak_allocated_mib
        else:
            assert value >= est.peak_allocated_mib and "reserved" in how


def test_report_runs_and_summarizes(gpu, capsys):
    assert gpu.main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) >= 25 and all(r["error_pct"] is not None for r in out["rows"])
    overall = [s for s in out["summary"] if s["source"] == "ALL"]
    assert len(overall) == 1 and overall[0]["rows"] == len(out["rows"])
    exact = [s for s in out["summary"] if s["source"] == gpu.EXACT]
    assert len(exact) == 1 and exact[0]["rows"] == sum(1 for r in out["rows"] if not r["gaps"]) > 0
    assert all(s["worst_under_pct"] <= 0 and s["max_abs_pct"] >= s["median_abs_pct"] for s in out["summary"])


def test_only_scores_the_matching_rows_and_a_bad_filter_is_one_line(gpu, capsys):
    assert gpu.main(["--json", "--only", "rasbt-llms-from-scratch"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] and {r["source"] for r in out["rows"]} == {"rasbt-llms-from-scratch-gpt2-124m-a100"}
    assert gpu.main(["--only", "no-such-row"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-row" in err[0]


def test_runtime_facts_are_checked_and_a_row_overrides_its_source(gpu, tmp_path, capsys):
    doc = json.loads((DATA / "rasbt-pytorch-memory-optim-vit-l16.json").read_text())
    rt = gpu.runtime_of(Path("x.json"), doc, doc["rows"][0])
    assert rt.zero_grad == "before_backward" and rt.model_code == "torchvision" and rt.torch_version.startswith("2.1.0.dev")
    accum = next(r for r in doc["rows"] if r["grad_accum"] > 1)
    assert gpu.runtime_of(Path("x.json"), doc, accum).zero_grad == "after_step"  # the script's own loop
    bad = copy.deepcopy(doc)
    bad["runtime"]["zero_grad"] = "sometimes"
    assert gpu.main(["--data", str(_write(tmp_path, bad))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runtime" in err[0] and "zero_grad" in err[0]
    bad = copy.deepcopy(doc)
    bad["runtime"]["torch"] = "2.1"
    assert gpu.main(["--data", str(_write(tmp_path, bad))]) == 2
    assert "runtime.torch" in capsys.readouterr().err


def test_every_runtime_fact_can_be_stated_by_a_data_file(gpu):
    """A data file's ``runtime`` takes every ``estimate.gpu.Runtime`` field (none of the job's software facts is
    out of the data's reach); the GPT-2 script's loop keeps its output, and its one-GPU row wraps DDP."""
    import dataclasses

    from toolkit.estimate.gpu import Runtime

    assert set(gpu.RUNTIME_FIELDS) == {f.name for f in dataclasses.fields(Runtime)}
    doc = json.loads((DATA / "neel429-llm-training-systems-gpt2-ddp-fsdp-a100.json").read_text())
    rts = [gpu.runtime_of(Path("x.json"), doc, row) for row in doc["rows"]]
    assert [(r.output_kept, r.ddp_single_process) for r in rts] == [("model_output", False)] * 2 + [
        ("model_output", True)]


def test_held_out_sources_are_summarized_apart(gpu, tmp_path, capsys):
    """A source marked held_out is in ALL and in HELD OUT, never in IN-SAMPLE, and is flagged per source."""
    doc = json.loads((DATA / "hf-guide-bert-large-v100.json").read_text())
    (tmp_path / "tuned.json").write_text(json.dumps(doc))
    held = copy.deepcopy(doc)
    held["held_out"] = True
    held["rows"] = held["rows"][:2]
    (tmp_path / "new.json").write_text(json.dumps(held))
    assert gpu.main(["--json", "--data", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["held_out"] for r in out["rows"]] == [True, True] + [False] * len(doc["rows"])
    groups = {s["source"]: s for s in out["summary"]}
    assert groups["ALL"]["rows"] == len(doc["rows"]) + 2
    assert groups[gpu.HELD_OUT]["rows"] == 2 and groups[gpu.HELD_OUT]["held_out"]
    assert groups[gpu.IN_SAMPLE]["rows"] == len(doc["rows"]) and not groups[gpu.IN_SAMPLE]["held_out"]
    assert groups["new"]["held_out"] and not groups["tuned"]["held_out"]
    held_errs = sorted(abs(r["error_pct"]) for r in out["rows"] if r["held_out"])
    assert groups[gpu.HELD_OUT]["max_abs_pct"] == held_errs[-1]
    assert gpu.main(["--data", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "new *" in text and "tuned *" not in text


def test_a_rows_fsdp_reduce_dtype_and_the_jobs_limit_all_gathers_reach_the_estimate(gpu, tmp_path, capsys):
    """What an FSDP1 script passes (MixedPrecision's reduce dtype, limit_all_gathers) is stated in the data and
    changes the estimate; a value the Plan or Runtime does not know is one line naming the field."""
    doc = json.loads((DATA / "llama-recipes-issue100-llama2-7b-fsdp-a100.json").read_text())
    row = doc["rows"][1]
    assert gpu.runtime_of(Path("x.json"), doc, row).fsdp_limit_all_gathers is True
    source = gpu.Source(Path("x.json"), doc)
    assert gpu.build_case(source, 1).plan.reduce_dtype == row["reduce_dtype"] == "param"
    # the same row without the script's limiter: torch 2.0's default (off) reserves every unit's gathers
    unlimited = copy.deepcopy(doc)
    del unlimited["runtime"]["fsdp_limit_all_gathers"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.json").write_text(json.dumps(doc))
    (tmp_path / "b" / "x.json").write_text(json.dumps(unlimited))
    peaks = []
    for d in ("a", "b"):
        assert gpu.main(["--json", "--data", str(tmp_path / d), "--only", "sdpa"]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["rows"][0]["predicted_mib"])
    assert peaks[1] > peaks[0] * 1.5
    for where, value, field in (("runtime", "yes", "fsdp_limit_all_gathers"), ("row", "bf8", "reduce_dtype")):
        bad = copy.deepcopy(doc)
        (bad["runtime"] if where == "runtime" else bad["rows"][0])[field] = value
        assert gpu.main(["--data", str(_write(tmp_path, bad))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and field in err[0]


def test_only_an_fsdp1_row_carries_the_fsdp1_gap(gpu):
    """A row whose torch is before 2.4 ran FSDP1 (flat parameters), which hpcmem's launcher is not: a gap. The
    same row under a later torch ran FSDP2, hpcmem's own: no gap."""
    doc = json.loads((DATA / "llama-recipes-issue100-llama2-7b-fsdp-a100.json").read_text())
    assert any("FSDP1" in g for g in gpu.build_case(gpu.Source(Path("x.json"), doc), 0).gaps)
    later = copy.deepcopy(doc)
    later["runtime"]["torch_version"] = "2.7"
    del later["runtime"]["fsdp_limit_all_gathers"]  # an FSDP1 knob
    case = gpu.build_case(gpu.Source(Path("x.json"), later), 0)
    assert case.plan.launcher == "fsdp" and not case.runtime.fsdp_flat_params
    assert not any("FSDP1" in g for g in case.gaps)
    later["runtime"]["fsdp_api"] = "fsdp1"  # Accelerate's plugin wraps with FSDP1 on any torch
    case = gpu.build_case(gpu.Source(Path("x.json"), later), 0)
    assert case.runtime.fsdp_flat_params and any("FSDP1" in g for g in case.gaps)
    later["runtime"]["fsdp_api"] = "fsdp3"
    with pytest.raises(gpu.DataError, match="fsdp_api"):
        gpu.build_case(gpu.Source(Path("x.json"), later), 0)


def test_a_stand_in_model_is_a_gap_on_every_row(gpu):
    """A source whose config stands in for a model family the estimator does not know (``stand_in``) is never
    scored as exact: every row carries the stand-in as a gap, so the EXACT summary leaves it out."""
    doc = json.loads((DATA / "hf-guide-bert-large-v100.json").read_text())
    assert not gpu.build_case(gpu.Source(Path("x.json"), doc), 0).gaps
    doc["stand_in"] = "a BERT-shaped config for a model of another family"
    for i in range(len(doc["rows"])):
        assert gpu.build_case(gpu.Source(Path("x.json"), doc), i).gaps == [
            "stand-in model: a BERT-shaped config for a model of another family"]


def test_a_rows_alloc_conf_reaches_the_plan_and_a_bad_one_is_named(gpu, tmp_path, capsys):
    """A row's ``alloc_conf`` (PYTORCH_CUDA_ALLOC_CONF as the job set it) is the Plan's ``alloc_conf``, shows in the
    row's setup label, and the estimate replays under it; a value the Plan or the allocator model refuses is a
    DataError (exit 2, one line) naming the row's field."""
    doc = json.loads((DATA / "hf-guide-bert-large-v100.json").read_text())
    doc["rows"] = doc["rows"][:2]
    doc["rows"][1]["alloc_conf"] = "expandable_segments:True"
    cases = gpu.load_cases(_write(tmp_path, doc, "ok.json"))
    assert cases[0].plan.alloc_conf == "" and "alloc_conf" not in cases[0].label
    assert cases[1].plan.alloc_conf == "expandable_segments:True"
    assert "alloc_conf=expandable_segments:True" in cases[1].label
    assert gpu.main(["--json", "--data", str(tmp_path), "--only", "expandable_segments"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 1 and rows[0]["row"] == 1 and rows[0]["error_pct"] is not None
    (tmp_path / "ok.json").unlink()
    for value in ("expandable_segments", "no_such_option:1", "expandable_segments:maybe", 5):
        bad = copy.deepcopy(doc)
        bad["rows"][1]["alloc_conf"] = value
        with pytest.raises(gpu.DataError) as info:
            gpu.load_cases(_write(tmp_path, bad))
        assert "bad.json" in str(info.value) and "rows[1].alloc_conf" in str(info.value), value
        assert gpu.main(["--data", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "rows[1].alloc_conf" in err[0], value


def test_the_gpjt_expandable_segments_rows_pair_with_rows_without_it(cases):
    """Every gpjt row measured with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True has a row of the same setup
    without it (the 8B no-checkpointing sweeps were run at lengths 40 tokens apart: 1001/2001 vs 1041/2041)."""
    for name in ("gpjt-fine-tune-qwen1.5-0.5b-deepspeed-zero3", "gpjt-fine-tune-llama3-8b-deepspeed-8gpu"):
        rows = [c for c in cases if c.source.name == name]
        assert rows and rows[0].source.doc["held_out"] is False and "session 7" in rows[0].source.doc["held_out_note"]
        with_es = [c for c in rows if c.row.get("alloc_conf")]
        without = [c for c in rows if not c.row.get("alloc_conf")]
        assert len(with_es) == len(without) > 0
        for case in with_es:
            assert case.plan.alloc_conf == "expandable_segments:True"
            assert "expandable" in case.row["quote"] or "env-var" in case.row["quote"]
            same = [c for c in without if (c.row["micro_batch"], c.row["checkpointing"], c.row["zero_stage"],
                                           c.row["offload_optimizer"]) == (case.row["micro_batch"],
                                           case.row["checkpointing"], case.row["zero_stage"], case.row["offload_optimizer"])
                    and abs(c.row["seq_len"] - case.row["seq_len"]) <= 40]
            assert len(same) == 1, case.label
