"""Site profiles: every shipped one loads; broken ones fail naming file and key."""

import json
import textwrap

import pytest

from toolkit import sites
from toolkit.errors import ConfigError, PlanError, UnknownNameError
from toolkit.plan import Plan
from toolkit.resources import data_dir

GOOD = textwrap.dedent("""\
    site: mysite
    scheduler: slurm
    partitions:
      v100:
        slurm_partition: gpu
        gres_type: v100
        gpu_model: Tesla V100-SXM2-32GB
        gpu_mem_gib: 32
        gpus_per_node: 4
        cpus_per_node: 40
        host_mem_gib: 384
        nvme_path: /scratch
        nvme_gib: 1600
        max_time: "1-00:00:00"
        cuda_context_mib: 420
    """)


def write(tmp_path, text, name="mysite"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(data_dir("site_configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_site_loads(path):
    site = sites.load_site_file(path)
    assert site.partitions
    for part in site.partitions.values():
        assert part.max_time_min > 0
        assert (part.gpu_model is None) == (part.gpus_per_node == 0)


def test_example_hpc_has_the_four_partitions_with_capabilities():
    site = sites.load_site("example-hpc")
    assert set(site.partitions) == {"v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb"}
    v100, a100 = site.partition("v100-16gb"), site.partition("a100-80gb")
    assert (v100.bf16, v100.tf32, v100.flash_attention) == (False, False, False)
    assert (a100.bf16, a100.tf32, a100.flash_attention) == (True, True, True)
    assert v100.gpus_per_node == 4 and a100.gpus_per_node in (4, 8)
    assert v100.gpu_mem_gib == 16 and a100.gpu_mem_gib == 80


def test_testcluster_matches_the_cluster_script():
    site = sites.load_site("testcluster")
    assert set(site.partitions) == {"v100", "a100", "cpu"}
    conf = (data_dir("site_configs").parent / "tests" / "cluster").glob("**/*")
    text = "\n".join(p.read_text() for p in conf if p.is_file())
    for part in site.partitions.values():
        assert f"PartitionName={part.slurm_partition}" in text
    cpu = site.partition("cpu")
    assert cpu.gpu_model is None and cpu.gpus_per_node == 0


def test_local_site_describes_this_machine():
    part = sites.load_site("local").partition(None)
    assert part.cpus_per_node >= 1 and part.host_mem_gib > 0
    assert part.default_mem_mib and part.default_mem_mib < part.host_mem_gib * 1024


@pytest.mark.parametrize("edit, needle", [
    (lambda t: t.replace("    cuda_context_mib: 420\n", "    cuda_context_mib: 420\n    gpu_mem: 3\n"), "partitions.v100.gpu_mem: unknown key"),
    (lambda t: t.replace("    nvme_gib: 1600\n", ""), "partitions.v100.nvme_gib: missing required key"),
    (lambda t: t.replace("gpu_mem_gib: 32", "gpu_mem_gib: lots"), "partitions.v100.gpu_mem_gib"),
    (lambda t: t.replace("scheduler: slurm", "scheduler: pbs"), "scheduler: must be one of"),
    (lambda t: t.replace('max_time: "1-00:00:00"', 'max_time: "one day"'), "partitions.v100.max_time"),
    (lambda t: t.replace("site: mysite", "site: other"), "must match the file name"),
    (lambda t: t.replace("Tesla V100-SXM2-32GB", "Quantum QPU-9000"), "state its capabilities"),
    (lambda t: t + "extra: 1\n", "extra: unknown key"),
])
def test_broken_site_names_file_and_key(tmp_path, edit, needle):
    path = write(tmp_path, edit(GOOD))
    with pytest.raises(ConfigError) as err:
        sites.load_site_file(path)
    assert str(path) in str(err.value) and needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unreadable_yaml_is_one_line(tmp_path):
    path = write(tmp_path, "site: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        sites.load_site_file(path)


def test_sites_dir_and_env_are_searched_first(tmp_path, monkeypatch):
    write(tmp_path, GOOD)
    assert "mysite" not in sites.site_files()
    assert sites.load_site("mysite", [tmp_path]).partition("v100").gpu_mem_gib == 32
    monkeypatch.setenv("HPCMEM_SITES", str(tmp_path))
    assert sites.load_site("mysite").name == "mysite"


def test_unknown_site_and_partition_list_the_valid_ones():
    with pytest.raises(UnknownNameError, match="valid: .*example-hpc"):
        sites.load_site("nosuch")
    with pytest.raises(UnknownNameError, match="v100-16gb"):
        sites.load_site("example-hpc").partition("h100")


def test_partition_refuses_what_it_cannot_do():
    v100 = sites.load_site("example-hpc").partition("v100-16gb")
    with pytest.raises(PlanError, match="no bf16.*fp16-mixed"):
        v100.check_plan(Plan(precision="bf16-mixed"))
    with pytest.raises(PlanError, match="flash"):
        v100.check_plan(Plan(attention="flash"))
    with pytest.raises(PlanError, match="4 GPUs per node"):
        v100.check_plan(Plan(gpus_per_node=8, global_batch=64))
    with pytest.raises(PlanError, match="at most"):
        v100.check_plan(Plan(time_min=5000))
    v100.check_plan(Plan(precision="fp16-mixed"))
    a100 = sites.load_site("example-hpc").partition("a100-40gb")
    with pytest.raises(PlanError, match="fp16/bf16 only.*attention=sdpa"):  # flash-attn has no fp32 kernels
        a100.check_plan(Plan(attention="flash", precision="fp32"))
    a100.check_plan(Plan(attention="flash", precision="bf16-mixed"))


def test_a_cpu_partition_measured_without_fp16_refuses_it(tmp_path, monkeypatch):
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "testcluster.calibration.yaml").write_text(
        "partitions:\n  cpu: {gpus: 0, fp16: false, bf16: true}\n  a100: {gpus: 0, fp16: false, bf16: true}\n")
    monkeypatch.setenv("HPCMEM_HOME", str(tmp_path))
    site = sites.load_site("testcluster")
    cpu, a100 = site.partition("cpu"), site.partition("a100")
    assert (cpu.fp16, cpu.bf16) == (False, True)
    with pytest.raises(PlanError, match=r"^precision=fp16-mixed: partition testcluster:cpu \(CPU\) has no fp16 support; "
                                        r"use precision=bf16-mixed or fp32$"):
        cpu.check_plan(Plan(precision="fp16-mixed"))
    cpu.check_plan(Plan(precision="bf16-mixed"))
    assert a100.fp16  # a named GPU partition keeps its GPU's capabilities whatever the probe's CPU could do


def test_time_parsing():
    assert sites.parse_minutes("02:00:00") == 120
    assert sites.parse_minutes("1-12:00:00") == 2160
    assert sites.parse_minutes("00:00:30") == 1
    assert sites.format_minutes(2160) == "1-12:00:00"


def test_sites_json_shape():
    fields = {"name", "slurm_partition", "gpu_model", "gpu_mem_gib", "gpus_per_node", "cpus_per_node", "host_mem_gib",
              "nvme_path", "nvme_gib", "fp16", "bf16", "tf32", "flash_attention", "cuda_context_mib", "max_time"}
    for site in sites.all_sites():
        d = json.loads(json.dumps(site.to_dict()))
        assert set(d) == {"site", "scheduler", "partitions"}
        for p in d["partitions"]:
            assert set(p) == fields
