"""A non-editable install finds templates/, site_configs/ and jobs/ inside the package."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_wheel_install_carries_the_data(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(REPO)], check=True, timeout=300, cwd=tmp_path)
    (wheel,) = wheels.glob("hpcmem-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import toolkit; print(toolkit.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, check=True).stdout
    assert str(venv) in where, "the installed copy, not the checkout, must be imported"
    out = subprocess.run([str(venv / "bin" / "hpcmem"), "sites", "--json"], capture_output=True, text=True,
                         cwd=elsewhere, env=env, check=True).stdout
    assert {s["site"] for s in json.loads(out)} >= {"example-hpc", "testcluster", "local"}
    subprocess.run([str(venv / "bin" / "hpcmem"), "render", "llama-7b-zero3-nvme", "--site", "example-hpc",
                    "--partition", "a100-40gb", "-o", str(tmp_path / "r")], cwd=elsewhere, env=env, check=True)
    assert (tmp_path / "r" / "ds_config.json").is_file()
    assert "models/llama-7b.json" in (tmp_path / "r" / "job.sbatch").read_text()
    assert str(REPO) not in (tmp_path / "r" / "job.sbatch").read_text()
