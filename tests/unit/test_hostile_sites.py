"""Hostile site profiles, calibration files, job specs and output directories (the second probe): absurd sizes are
refused at load by file and key, a '%' in the attempt directory reaches no Slurm pattern, a spec cannot override
hpcmem's own environment, errors name the field the user wrote, and a refused render writes nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path

import pytest

from toolkit import jobspec, render, sites
from toolkit.backends.slurm import expand_filename_pattern
from toolkit.errors import ConfigError, HpcmemError, PlanError, RenderError

REPO = Path(__file__).resolve().parents[2]

SITE = textwrap.dedent("""\
    site: hostile
    scheduler: slurm
    partitions:
      a100:
        slurm_partition: a100
        gres_type: a100
        gpu_model: NVIDIA A100-SXM4-40GB
        gpu_mem_gib: 40
        gpus_per_node: 2
        cpus_per_node: 8
        host_mem_gib: 19.5
        nvme_path: /tmp/hpcmem-nvme
        nvme_gib: 20
        max_time: "02:00:00"
        cuda_context_mib: 520
        default_mem_mib: 6144
      cpu:
        slurm_partition: cpu
        gpu_model: null
        gpu_mem_gib: 0
        gpus_per_node: 0
        cpus_per_node: 8
        host_mem_gib: 19.5
        nvme_path: null
        nvme_gib: 0
        max_time: "02:00:00"
        cuda_context_mib: 0
        default_mem_mib: 6144
    """)

SPEC = textwrap.dedent("""\
    name: hostile
    command:
      module: toolkit.train
      args: [--plan, "{plan_json}"]
    launcher: torchrun
    nodes: 1
    gpus_per_node: 1
    time: "00:15:00"
    training:
      global_batch: 16
      micro_batch: 8
      seq_len: 128
      precision: fp32
    """)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def edit_a100(key: str, value: str, text: str = SITE) -> str:
    """The site with the a100 partition's ``key`` set to ``value`` (YAML text), added when absent."""
    lines = text.splitlines(keepends=True)
    start = lines.index("  a100:\n")
    end = lines.index("  cpu:\n")
    for i in range(start + 1, end):
        if lines[i].startswith(f"    {key}:"):
            lines[i] = f"    {key}: {value}\n"
            return "".join(lines)
    lines.insert(end, f"    {key}: {value}\n")
    return "".join(lines)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


@pytest.fixture
def home(hpcmem_home):
    """No calibration of the tester's own $HPCMEM_HOME is read."""
    return hpcmem_home


# ---------------------------------------------------------------- 1: sizes in a site profile


@pytest.mark.parametrize("key, value", [
    ("gpu_mem_gib", "1.0e+300"),
    ("gpu_mem_gib", "1.0e+290"),
    ("gpu_mem_gib", "0"),                     # a GPU partition without GPU memory
    ("gpu_mem_gib", "1025"),                  # above 1 TiB per GPU
    ("host_mem_gib", "0"),
    ("host_mem_gib", "1.0e+308"),
    ("host_mem_gib", "65537"),                # above 64 TiB per node
    ("cuda_context_mib", "1.0e+308"),
    ("cuda_context_mib", "65537"),            # above 64 GiB
    ("cuda_context_mib", "40960"),            # the whole 40 GiB GPU
    ("default_mem_mib", "4611686018427387904"),
    ("default_mem_mib", "19969"),             # 1 MiB more than the node's 19.5 GiB
    ("nvme_gib", "1.0e+308"),
    ("gpus_per_node", "4611686018427387904"),
    ("cpus_per_node", "4611686018427387904"),
    ("max_time", '"00:00"'),
    ("max_time", '"367-00:00:00"'),
])
def test_an_absurd_size_in_a_site_is_one_line_naming_file_and_key(tmp_path, home, key, value):
    path = write(tmp_path / "hostile.yaml", edit_a100(key, value))
    with pytest.raises(ConfigError) as err:
        sites.load_site_file(path)
    text = one_line(err.value)
    assert text.startswith(f"{path}: partitions.a100.{key}:"), text


def test_sizes_at_their_bounds_still_load(tmp_path, home):
    text = SITE
    for key, value in (("gpu_mem_gib", "1024"), ("host_mem_gib", "65536"), ("cuda_context_mib", "65536"),
                       ("nvme_gib", "1048576"), ("cpus_per_node", "65536"), ("default_mem_mib", "19968")):
        text = edit_a100(key, value, text)
    part = sites.load_site_file(write(tmp_path / "hostile.yaml", text)).partition("a100")
    assert (part.gpu_mem_gib, part.host_mem_gib, part.cuda_context_mib, part.default_mem_mib) == (1024, 65536, 65536,
                                                                                                  19968)
    cpu = sites.load_site_file(tmp_path / "hostile.yaml").partition("cpu")
    assert cpu.gpu_mem_gib == 0 and cpu.cuda_context_mib == 0  # a CPU partition has no GPU memory


def test_a_site_at_its_bounds_is_estimated_and_planned(tmp_path, home):
    from toolkit.estimate import estimate, spec_model

    text = edit_a100("gpu_mem_gib", "1024", edit_a100("cuda_context_mib", "65536", edit_a100("host_mem_gib", "65536")))
    part = sites.load_site_file(write(tmp_path / "hostile.yaml", text)).partition("a100")
    spec = jobspec.load_spec("quickstart")
    plan = spec.first_plan(part)
    est = estimate(spec_model(spec), plan, part)
    assert est.to_dict()  # finite numbers, no OverflowError / NaN conversion


def test_every_shipped_site_and_job_still_loads(home):
    for path in sorted((REPO / "site_configs").glob("*.yaml")):
        assert sites.load_site_file(path).partitions
    for path in sorted((REPO / "jobs").glob("*.yaml")):
        assert jobspec.load_spec(path).name


def test_a_recorded_site_with_an_absurd_size_is_refused(tmp_path, home):
    site = sites.load_site_file(write(tmp_path / "hostile.yaml", SITE))
    record = json.loads(json.dumps(sites.site_record(site)))
    assert sites.site_from_record(record, "site.json").partition("a100").gpu_mem_gib == 40
    record["partitions"]["a100"]["gpu_mem_gib"] = 1e300
    with pytest.raises(ConfigError, match=r"^site\.json: partitions\.a100\.gpu_mem_gib:"):
        sites.site_from_record(record, "site.json")


# ---------------------------------------------------------------- 1: calibration files


@pytest.mark.parametrize("key, value", [
    ("gpu_mem_gib", "1.0e+308"),
    ("gpu_mem_gib", "0"),
    ("cuda_context_mib", "1.0e+308"),
    ("cuda_context_mib", "-1"),
    ("allocator_overhead_frac", "1.0e+308"),
    ("allocator_overhead_frac", "11.0"),
    ("allocator_overhead_frac", "-0.5"),
    ("gpus", "lots"),
    ("gpus", "2.5"),
    ("gpus", "true"),
    ("fitted_from_ranks", "'yes'"),
    ("host_mem_gib", "1.0e+300"),
    ("nvme_free_gib", "1.0e+300"),
    ("gpu_model", "[1, 2]"),
])
def test_an_absurd_calibration_value_is_one_line_naming_file_and_key(tmp_path, home, key, value):
    site = write(tmp_path / "hostile.yaml", SITE)
    cal = write(tmp_path / "hostile.calibration.yaml", f"partitions:\n  a100:\n    gpus: 2\n    {key}: {value}\n")
    with pytest.raises(ConfigError) as err:
        sites.load_site_file(site)
    assert one_line(err.value).startswith(f"{cal}: partitions.a100.{key}: expected "), str(err.value)


def test_a_sane_calibration_applies(tmp_path, home):
    site = write(tmp_path / "hostile.yaml", SITE)
    write(tmp_path / "hostile.calibration.yaml", "partitions:\n  a100:\n    gpus: 2\n    gpu_mem_gib: 39.4\n"
          "    cuda_context_mib: 611\n    allocator_overhead_frac: 0.06\n    fitted_from_ranks: 4\n")
    part = sites.load_site_file(site).partition("a100")
    assert (part.calibrated, part.gpu_mem_gib, part.cuda_context_mib, part.allocator_overhead_frac) == (True, 39.4, 611,
                                                                                                        0.06)


def test_a_calibrated_context_as_large_as_the_gpu_is_refused(tmp_path, home):
    site = write(tmp_path / "hostile.yaml", SITE)
    cal = write(tmp_path / "hostile.calibration.yaml", "partitions:\n  a100:\n    gpus: 2\n    gpu_mem_gib: 16\n"
                "    cuda_context_mib: 20000\n")
    with pytest.raises(ConfigError, match=rf"^{cal}: partitions\.a100\.cuda_context_mib: "):
        sites.load_site_file(site)


def test_calibrate_never_writes_what_it_could_not_read(tmp_path, home):
    from toolkit.calibrate import write_calibration

    cal = tmp_path / "hostile.calibration.yaml"
    with pytest.raises(ConfigError, match=rf"^{cal}: partitions\.a100\.allocator_overhead_frac: "):
        write_calibration(cal, "a100", {"allocator_overhead_frac": 34.0, "cuda_context_mib": 600.0})
    assert not cal.exists()
    write_calibration(cal, "a100", {"gpus": 2, "cuda_context_mib": 600.0})
    before = cal.read_text()
    with pytest.raises(ConfigError, match="partitions.cpu.gpus"):
        write_calibration(cal, "cpu", {"gpus": "lots"})
    assert cal.read_text() == before


# ---------------------------------------------------------------- 2: '%' in the attempt directory


@pytest.mark.parametrize("name", ["pct%x%j", "100%", "a%%b", "%5j%A_%a", "plain"])
def test_a_percent_in_the_attempt_directory_is_escaped_for_slurm(tmp_path, home, name):
    spec = jobspec.load_spec("quickstart")
    part = sites.load_site("testcluster").partition("cpu")
    out = tmp_path / name
    attempt = render.render_attempt(spec, part, spec.first_plan(part), out)
    [line] = [x for x in attempt.script.read_text().splitlines() if x.startswith("#SBATCH --output=")]
    pattern = line.split("=", 1)[1]
    assert pattern == str(out).replace("%", "%%") + "/slurm-%j.out"
    # what Slurm makes of it: the directory as it is, hpcmem's own %j filled in
    assert expand_filename_pattern(pattern, job_id="4242") == f"{out}/slurm-4242.out"
    paths = [x for x in attempt.script.read_text().splitlines() if x.startswith("#SBATCH") and "/" in x]
    assert paths == [line]  # the only #SBATCH line that carries a path


# ---------------------------------------------------------------- 3: hpcmem's own environment


@pytest.mark.parametrize("name", ["HPCMEM_PLAN", "HPCMEM_ATTEMPT_DIR", "HPCMEM_CHECKPOINT_DIR", "HPCMEM_GPU_MEM_GIB",
                                  "HPCMEM_DS_CONFIG", "PYTHONUNBUFFERED", "MASTER_PORT", "SLURM_JOB_ID"])
def test_a_spec_cannot_set_what_hpcmem_sets(tmp_path, name):
    path = write(tmp_path / "spec.yaml", SPEC + f"env:\n  {name}: /etc/passwd\n")
    with pytest.raises(ConfigError) as err:
        jobspec.load_spec(path)
    assert one_line(err.value).startswith(f"{path}: env.{name}: "), str(err.value)


def test_a_site_cannot_set_what_hpcmem_sets(tmp_path, home):
    for name in ("HPCMEM_PLAN", "MASTER_PORT"):
        path = write(tmp_path / "hostile.yaml", edit_a100("env", "{%s: x}" % name))
        with pytest.raises(ConfigError, match=rf"^{path}: partitions\.a100\.env\.{name}: "):
            sites.load_site_file(path)


def test_the_runtimes_user_knobs_and_a_site_allocator_default_may_be_set(tmp_path, home):
    """HPCMEM_MEMORY_HISTORY, HPCMEM_TEARDOWN_TIMEOUT_S ... are the runtime's knobs for users (docs/resume.md); a
    site's PYTORCH_CUDA_ALLOC_CONF is its default, and a plan's alloc_conf (a remedy) is exported after it."""
    path = write(tmp_path / "spec.yaml", SPEC + "env:\n  HPCMEM_MEMORY_HISTORY: '0'\n  HPCMEM_TEARDOWN_TIMEOUT_S: '30'\n")
    spec = jobspec.load_spec(path)
    site = write(tmp_path / "hostile.yaml", edit_a100("env", "{PYTORCH_CUDA_ALLOC_CONF: 'max_split_size_mb:128'}"))
    part = sites.load_site_file(site).partition("a100")
    plan = spec.first_plan(part).replace(alloc_conf="expandable_segments:True")
    env = render.job_env(spec, part, plan, {"plan_json": "p", "attempt_dir": "a", "checkpoint_dir": "c",
                                            "config": "d"})
    assert ("HPCMEM_MEMORY_HISTORY", "0") in env
    values = [v for n, v in env if n == "PYTORCH_CUDA_ALLOC_CONF"]
    assert values == ["max_split_size_mb:128", "expandable_segments:True"]  # the plan's last: it wins


def test_path_like_variables_the_template_does_not_set_stay_the_jobs(tmp_path, home):
    path = write(tmp_path / "spec.yaml", SPEC + "env:\n  PATH: /opt/x/bin\n  LD_LIBRARY_PATH: /opt/x/lib\n"
                 "  PYTHONPATH: /opt/x/py\n  hpcmem_lower: fine\n")
    spec = jobspec.load_spec(path)
    part = sites.load_site("testcluster").partition("cpu")
    attempt = render.render_attempt(spec, part, spec.first_plan(part), tmp_path / "out")
    text = attempt.script.read_text()
    for name in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH"):
        assert name not in render.SCRIPT_ENV
        assert text.count(f"export {name}=") == 1  # the spec's, and the template sets none
    exports = [x.split("=", 1)[0] for x in text.splitlines() if x.startswith("export ")]
    assert exports.index("export HPCMEM_PLAN") < exports.index("export PATH")


def test_the_renderer_refuses_an_override_built_in_code(tmp_path, home):
    spec = jobspec.load_spec("quickstart")
    part = sites.load_site("testcluster").partition("cpu")
    plan = spec.first_plan(part)
    bad = dataclasses.replace(spec, env=spec.env + (("HPCMEM_PLAN", "/etc/passwd"),))
    with pytest.raises(RenderError, match="env.HPCMEM_PLAN"):
        render.render_attempt(bad, part, plan, tmp_path / "out")
    bad_part = dataclasses.replace(part, env=(("MASTER_PORT", "1"),))
    with pytest.raises(RenderError, match="env.MASTER_PORT"):
        render.render_attempt(spec, bad_part, plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 4: errors name the file and the field written


@pytest.mark.parametrize("edit, key", [
    (lambda t: t.replace("global_batch: 16", "global_batch: 4611686018427387904"), "training.global_batch"),
    (lambda t: t.replace("micro_batch: 8", "micro_batch: -5"), "training.micro_batch"),
    (lambda t: t.replace("micro_batch: 8", "micro_batch: 32"), "training.micro_batch"),
    (lambda t: t.replace("seq_len: 128", "seq_len: 1099511627776"), "training.seq_len"),
    (lambda t: t.replace("nodes: 1", "nodes: 4611686018427387904"), "nodes"),
    (lambda t: t.replace("gpus_per_node: 1", "gpus_per_node: 1000000000"), "gpus_per_node"),
    (lambda t: t + "mem_mib: 4611686018427387904\n", "mem_mib"),
    (lambda t: t.replace('time: "00:15:00"', 'time: "00:00"'), "time"),
    (lambda t: t.replace('time: "00:15:00"', 'time: "00:99:99"'), "time"),
])
def test_a_spec_error_names_the_file_and_the_key_written(tmp_path, edit, key):
    path = write(tmp_path / "spec.yaml", edit(SPEC))
    with pytest.raises(ConfigError) as err:
        jobspec.load_spec(path)
    assert one_line(err.value).startswith(f"{path}: {key}: "), str(err.value)


def test_a_site_time_error_names_the_file_and_key(tmp_path, home):
    path = write(tmp_path / "hostile.yaml", edit_a100("max_time", '"00:00"'))
    with pytest.raises(ConfigError, match=rf"^{path}: partitions\.a100\.max_time: '00:00': must be between"):
        sites.load_site_file(path)


def test_a_plan_the_spec_itself_cannot_make_names_the_spec(tmp_path, home):
    path = write(tmp_path / "spec.yaml", SPEC.replace("micro_batch: 8", "micro_batch: 8\n  zero_stage: 3"))
    spec = jobspec.load_spec(path)
    with pytest.raises(PlanError, match=rf"^{path}: zero_stage=3"):
        spec.first_plan(sites.load_site("testcluster").partition("cpu"))


# ---------------------------------------------------------------- 5: a refused render writes nothing


def test_a_directory_where_job_sbatch_goes_leaves_every_file_as_it_was(tmp_path, home):
    spec = jobspec.load_spec("quickstart")
    part = sites.load_site("testcluster").partition("cpu")
    out = tmp_path / "out"
    (out / "job.sbatch").mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"^{out}/job\.sbatch: a directory is in the way"):
        render.render_attempt(spec, part, spec.first_plan(part), out)
    assert sorted(p.name for p in out.iterdir()) == ["job.sbatch"]  # no plan.json, no temporary file
    (out / "plan.json").write_text("the earlier plan")
    with pytest.raises(ConfigError):
        render.render_attempt(spec, part, spec.first_plan(part), out)
    assert (out / "plan.json").read_text() == "the earlier plan"


def test_a_fifo_where_plan_json_goes_is_refused(tmp_path, home):
    spec = jobspec.load_spec("quickstart")
    part = sites.load_site("testcluster").partition("cpu")
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "plan.json")
    with pytest.raises(ConfigError, match="plan.json: not a regular file"):
        render.render_attempt(spec, part, spec.first_plan(part), out)
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]


def test_a_write_that_fails_midway_leaves_nothing(tmp_path, home, monkeypatch):
    spec = jobspec.load_spec("quickstart")
    part = sites.load_site("testcluster").partition("cpu")
    out = tmp_path / "new" / "out"
    real = render.tempfile.mkstemp
    calls = []

    def failing(*args, **kwargs):
        calls.append(kwargs.get("prefix"))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(render.tempfile, "mkstemp", failing)
    with pytest.raises(ConfigError, match="No space left on device"):
        render.render_attempt(spec, part, spec.first_plan(part), out)
    assert not (tmp_path / "new").exists()


def test_a_rerender_replaces_the_files_and_keeps_the_script_executable(tmp_path, home):
    spec = jobspec.load_spec("quickstart")
    part = sites.load_site("testcluster").partition("cpu")
    out = tmp_path / "out"
    first = render.render_attempt(spec, part, spec.first_plan(part), out)
    second = render.render_attempt(spec, part, spec.first_plan(part), out)
    assert first.script == second.script and os.access(second.script, os.X_OK)
    assert json.loads(second.plan_json.read_text())["global_batch"] == spec.training["global_batch"]
    assert sorted(p.name for p in out.iterdir()) == ["job.sbatch", "plan.json"]


# ---------------------------------------------------------------- the CLI: one line, exit 2


@pytest.mark.parametrize("key, value, args", [
    ("default_mem_mib", "4611686018427387904", ["render", "quickstart", "-o", "OUT"]),
    ("gpu_mem_gib", "1.0e+300", ["estimate", "quickstart"]),
    ("cuda_context_mib", "1.0e+308", ["plan", "quickstart"]),
])
def test_the_cli_says_one_line(tmp_path, key, value, args):
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from hpcmem_cli import run_cli

    sites_dir = tmp_path / "sites"
    write(sites_dir / "hostile.yaml", edit_a100(key, value))
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = run_cli("--sites-dir", sites_dir, *args, "--site", "hostile", "-p", "a100", home=tmp_path / "home", timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and f"partitions.a100.{key}" in r.stderr and str(sites_dir) in r.stderr
    assert not (tmp_path / "out").exists()
