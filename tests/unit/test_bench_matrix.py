"""Benchmark matrices: every shipped one loads and expands; the technique table; bad matrices fail in one line."""

import textwrap

import pytest

from toolkit import sites
from toolkit.bench import matrix, techniques
from toolkit.bench.runner import cell_spec, parse_night
from toolkit.bench.techniques import Skip
from toolkit.errors import ConfigError, UnknownNameError
from toolkit.jobspec import load_spec
from toolkit.plan import Plan

HPC = sites.load_site("example-hpc")
TEST = sites.load_site("testcluster")


@pytest.mark.parametrize("name", matrix.shipped_matrices())
def test_every_shipped_matrix_loads_and_expands_on_its_sites(name):
    m = matrix.load_matrix(name)
    assert m.models and m.techniques
    for site_name in m.sites:
        site = sites.load_site(site_name)
        cells = matrix.expand(m, site)
        run = [c for c in cells if c.plan is not None]
        assert run, f"{name} runs nothing on {site_name}"
        for c in run:
            site.partition(c.partition).check_plan(c.plan)
            assert c.plan.global_batch == matrix.base_plan(m, c.model).global_batch
        assert all(c.skip for c in cells if c.plan is None)


def test_shipped_matrices_are_the_documented_ones():
    assert {"reference", "ci-small"} <= set(matrix.shipped_matrices())
    ci = matrix.load_matrix("ci-small")
    assert "zero3-offload-cpu" in ci.techniques and ci.sites == {"testcluster": ("cpu",)}
    assert ci.warmup_steps == 2 and 4 <= ci.steps <= 6
    ref = matrix.load_matrix("reference")
    assert set(ref.techniques) == set(techniques.NAMES)
    assert {"v100-16gb", "a100-40gb"} <= set(ref.sites["example-hpc"])


def test_reference_matrix_skips_what_a_partition_cannot_do_and_says_why():
    cells = {c.label: c for c in matrix.expand(matrix.load_matrix("reference"), HPC)}
    bf16_v100 = cells["v100-16gb/gpt2/bf16-mixed"]
    assert bf16_v100.plan is None and "no bf16" in bf16_v100.skip
    assert cells["a100-40gb/gpt2/bf16-mixed"].plan.precision == "bf16-mixed"
    assert not any(label.startswith("v100") and "/llama-7b/" in label for label in cells)  # A100s only
    fits_7b = [c for label, c in cells.items() if "/llama-7b/" in label and c.plan is not None]
    assert fits_7b and all(c.plan.strategy.sharded for c in fits_7b)
    assert all("predicted" in c.skip for label, c in cells.items()
               if "/llama-7b/" in label and c.plan is None and c.technique != "adamw-8bit")


def _base(**kw):
    return Plan(**{"global_batch": 16, "micro_batch": 8, "grad_accum": 2, **kw})


def test_accum_keeps_the_global_batch_and_checkpointing_is_added_on_top():
    cpu = TEST.partition("cpu")
    accum = techniques.apply("accum", _base(), cpu)
    assert accum.micro_batch == 2 and accum.grad_accum == 8 and accum.global_batch == 16
    ckpt = techniques.apply("accum+ckpt", _base(), cpu)
    assert ckpt.checkpointing and ckpt.micro_batch == 2
    odd = techniques.apply("accum", Plan(global_batch=12, micro_batch=6, grad_accum=2), cpu)
    assert odd.micro_batch * odd.grad_accum == 12 and odd.micro_batch < 6


@pytest.mark.parametrize("technique, partition, needle", [
    ("fp16-mixed", ("testcluster", "cpu"), "no GPU"),
    ("bf16-mixed", ("example-hpc", "v100-16gb"), "no bf16"),
    ("adamw-8bit", ("testcluster", "cpu"), "no GPU"),
])
def test_what_a_partition_cannot_do_is_a_skip_with_a_reason(technique, partition, needle):
    part = sites.load_site(partition[0]).partition(partition[1])
    result = techniques.apply(technique, _base(), part)
    assert isinstance(result, Skip) and needle in result.reason and technique in result.reason


def test_nvme_offload_without_scratch_and_a_plan_the_partition_refuses_are_skips():
    import dataclasses

    no_nvme = dataclasses.replace(HPC.partition("a100-40gb"), nvme_path=None)
    assert "nvme_path" in techniques.apply("zero3-offload-nvme", _base(), no_nvme).reason
    too_wide = techniques.apply("vanilla", Plan(gpus_per_node=8, global_batch=8, micro_batch=1), HPC.partition("v100-16gb"))
    assert isinstance(too_wide, Skip) and "gpus_per_node=8" in too_wide.reason


def test_zero_techniques_use_deepspeed_with_their_stage_and_offload():
    plan = techniques.apply("zero3-offload-cpu", _base(), TEST.partition("cpu"))
    assert (plan.launcher, plan.zero_stage, plan.offload_optimizer, plan.offload_params) == ("deepspeed", 3, "cpu", "cpu")
    assert techniques.apply("zero1", _base(), TEST.partition("cpu")).zero_stage == 1
    together = techniques.apply("all-together", _base(), HPC.partition("a100-40gb"))
    assert together.precision == "bf16-mixed" and together.checkpointing and together.micro_batch == 2
    assert techniques.apply("all-together", _base(), HPC.partition("v100-16gb")).precision == "fp16-mixed"


def test_unknown_technique_name_in_code_lists_the_valid_ones():
    with pytest.raises(UnknownNameError, match="unknown technique 'zero4'.*zero3-offload-cpu"):
        techniques.apply("zero4", _base(), TEST.partition("cpu"))


def _write(tmp_path, body):
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """\
    name: m
    sites: {testcluster: [cpu]}
    techniques: [vanilla, zero2]
    models:
      - {name: tiny, config: tiny-gpt2, training: {global_batch: 8, micro_batch: 8}}
    """


def _one_line_error(exc_info):
    text = str(exc_info.value)
    assert "\n" not in text
    return text


def test_unknown_technique_is_one_line_naming_it_and_the_file(tmp_path):
    path = _write(tmp_path, GOOD.replace("[vanilla, zero2]", "[vanilla, zero4]"))
    with pytest.raises(ConfigError) as exc:
        matrix.load_matrix(path)
    text = _one_line_error(exc)
    assert str(path) in text and "'zero4'" in text and "techniques" in text and "zero3-offload-cpu" in text


def test_unknown_technique_of_one_model_names_the_model(tmp_path):
    path = _write(tmp_path, GOOD.replace("training: {global_batch: 8, micro_batch: 8}}",
                                         "training: {global_batch: 8}, techniques: [vanila]}"))
    with pytest.raises(ConfigError) as exc:
        matrix.load_matrix(path)
    assert "models.tiny.techniques" in _one_line_error(exc) and "'vanila'" in str(exc.value)


def test_unknown_partition_is_one_line_naming_it_and_the_site(tmp_path):
    m = matrix.load_matrix(_write(tmp_path, GOOD.replace("[cpu]", "[cpu, h100]")))
    with pytest.raises(ConfigError) as exc:
        matrix.expand(m, TEST)
    text = _one_line_error(exc)
    assert "'h100'" in text and "testcluster" in text and "a100" in text  # lists the valid ones


def test_a_site_the_matrix_does_not_name_and_a_partition_outside_it_are_errors(tmp_path):
    m = matrix.load_matrix(_write(tmp_path, GOOD))
    with pytest.raises(ConfigError, match="no partitions for site 'example-hpc'"):
        matrix.expand(m, HPC)
    with pytest.raises(ConfigError, match="--partition a100"):
        matrix.expand(m, TEST, partition="a100")


def test_model_partition_outside_the_matrix_and_unknown_keys_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="models.tiny.partitions: unknown partition 'v100'"):
        matrix.load_matrix(_write(tmp_path, GOOD.replace("micro_batch: 8}}", "micro_batch: 8}, partitions: [v100]}")))
    with pytest.raises(ConfigError, match="techinques: unknown key"):
        matrix.load_matrix(_write(tmp_path, GOOD + "techinques: [vanilla]\n"))
    with pytest.raises(ConfigError, match="unknown knob 'micro'"):
        matrix.load_matrix(_write(tmp_path, GOOD.replace("micro_batch: 8}}", "micro_batch: 8}, set: {micro: 2}}")))
    with pytest.raises(ConfigError, match="models.tiny.config: unknown model 'tiny-gpt3'"):
        matrix.load_matrix(_write(tmp_path, GOOD.replace("config: tiny-gpt2", "config: tiny-gpt3")))
    with pytest.raises(UnknownNameError, match="unknown matrix 'nightly-huge'"):
        matrix.find_matrix("nightly-huge")


def test_only_selects_cells_by_technique_model_or_label(tmp_path):
    m = matrix.load_matrix(_write(tmp_path, GOOD))
    assert [c.technique for c in matrix.expand(m, TEST, only="zero*")] == ["zero2"]
    assert len(matrix.expand(m, TEST, only="tiny")) == 2
    assert [c.technique for c in matrix.expand(m, TEST, only="cpu/tiny/vanilla")] == ["vanilla"]
    assert matrix.expand(m, TEST, only="nothing*") == []


def test_a_cell_spec_is_a_valid_job_spec_that_never_retries(tmp_path):
    m = matrix.load_matrix(_write(tmp_path, GOOD.replace("micro_batch: 8}}", "micro_batch: 8}, set: {mem_mib: 900}}")))
    cell = matrix.expand(m, TEST, only="zero2")[0]
    import yaml

    path = tmp_path / "cell.yaml"
    path.write_text(yaml.safe_dump(cell_spec(m, cell, "2026-01-02", TEST)))
    spec = load_spec(path)
    assert spec.max_attempts == 1 and spec.allow == () and spec.launcher == "deepspeed"
    assert spec.mem_mib == 900 and "--warmup-steps" in spec.args
    assert spec.first_plan(TEST.partition("cpu")).zero_stage == 2


def test_night_is_a_checked_date():
    assert parse_night("2026-03-01") == "2026-03-01"
    assert len(parse_night(None)) == 10
    for bad in ("2026-3-1", "2026-02-30", "yesterday"):
        with pytest.raises(ConfigError, match="--night"):
            parse_night(bad)


def test_bench_run_refuses_a_pattern_that_selects_nothing_before_recording_anything(tmp_path):
    from toolkit.bench.runner import run_matrix
    from toolkit.ledger import Ledger

    m = matrix.load_matrix(_write(tmp_path, GOOD))
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        with pytest.raises(ConfigError, match="no cell on testcluster matches --only 'nothing\\*'"):
            run_matrix(ledger, m, TEST, only="nothing*", home=tmp_path)
        assert ledger.runs() == []
    assert not (tmp_path / "bench").exists()
