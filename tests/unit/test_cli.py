"""Bad input at the command line: one clear line on stderr and a non-zero exit; --json where it reports."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


from hpcmem_cli import run_cli as hpcmem  # noqa: E402


@pytest.mark.parametrize("args, needle", [
    (["submit", "nosuch-spec", "--site", "local"], "unknown job spec 'nosuch-spec'; valid: "),
    (["submit", "/no/such/file.yaml", "--site", "local"], "/no/such/file.yaml: no such job spec file"),
    (["submit", "quickstart", "--site", "nosite"], "unknown site 'nosite'; valid: example-hpc, local, testcluster"),
    (["submit", "quickstart", "--site", "example-hpc", "--partition", "h100"], "valid: a100-40gb, a100-80gb"),
    (["submit", "quickstart", "--site", "example-hpc"], "choose one with --partition"),
    (["submit", "gpt2-clm", "--site", "example-hpc", "--partition", "v100-16gb"], "has no bf16; use precision=fp16-mixed"),
    (["render", "quickstart", "--site", "local", "--set", "micro_batch=3", "-o", "/tmp/x"], "not global_batch 16"),
    (["render", "quickstart", "--site", "local", "--set", "microbatch=3", "-o", "/tmp/x"], "unknown knob 'microbatch'"),
    (["runs", "no-such-run"], "no run 'no-such-run'"),
])
def test_bad_input_is_one_line(tmp_path, args, needle):
    result = hpcmem(*args, home=tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_unreadable_yaml_spec(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [oops\n")
    result = hpcmem("submit", str(bad), "--site", "local", home=tmp_path)
    assert result.returncode != 0 and "not valid YAML" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_script_is_refused_before_submitting(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\ncommand: {script: does-not-exist.py}\ngpus_per_node: 1\ntraining: {global_batch: 1}\n")
    result = hpcmem("submit", str(spec), "--site", "local", home=tmp_path)
    assert result.returncode != 0 and "does-not-exist.py: no such script" in result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_sites_and_render_json(tmp_path):
    sites = json.loads(hpcmem("sites", "--json", home=tmp_path).stdout)
    assert {s["site"] for s in sites} >= {"example-hpc", "testcluster", "local"}
    out = json.loads(hpcmem("render", "quickstart", "--site", "testcluster", "--partition", "a100", "--set",
                            "launcher=deepspeed", "--set", "zero_stage=2", "-o", str(tmp_path / "r"), "--json",
                            home=tmp_path).stdout)
    assert out["plan"]["zero_stage"] == 2 and len(out["files"]) == 3
