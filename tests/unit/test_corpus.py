"""The classifier on the triage corpus (tests/fixtures/corpus/: real failure logs from public issue trackers).

Asserts issue 12's "Done means" with the scoring of ``benchmarks/triage.py`` (``score_corpus``):
    - exact kind on >= 95 % of the logs;
    - no log labelled not_oom or unknown is called an out-of-memory kind (0, not a share);
    - >= 98 % of the numbers the labels state are read exactly (MiB, to the message's printed precision);
    - phase right on >= 90 % of the logs that show a traceback. A log "shows a traceback" when any of its lines holds
      Python's ``Traceback (most recent call last)`` header (``benchmarks/triage.py: TRACEBACK``); the label's phase,
      null included, is what must match.
The held-out fifth (every 5th stem) was kept aside while the rules were developed; its figures are printed by
``python benchmarks/triage.py --corpus-only`` and must not fall below the same goals' floor used here.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.classify import KINDS, PHASES

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "fixtures" / "corpus"
LAUNCHERS = {"torchrun", "deepspeed", "accelerate", "lightning", "srun", "python", "unknown"}


def _bench():
    spec = importlib.util.spec_from_file_location("triage_bench", REPO / "benchmarks" / "triage.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _bench()


@pytest.fixture(scope="module")
def result(bench):
    return bench.score_corpus(CORPUS)


def test_every_case_has_a_log_and_a_well_formed_label():
    labels = sorted(CORPUS.glob("*.yaml"))
    assert len(labels) >= 150
    for path in labels:
        label = yaml.safe_load(path.read_text())
        assert (CORPUS / f"{path.stem}.log").is_file(), path.stem
        assert label["kind"] in KINDS, path.stem
        assert label["confidence"] in ("high", "medium", "low"), path.stem
        assert label.get("phase") in (None, *PHASES), path.stem
        assert label.get("launcher") in LAUNCHERS, path.stem
        assert label["source"].startswith("http"), path.stem
        assert path.stem.split("-")[0] in ("gpu", "host", "other"), path.stem
        assert (CORPUS / f"{path.stem}.log").stat().st_size < 64 * 1024, path.stem


def test_exact_kind_on_95_percent(result):
    assert result["all"]["kind_exact"] >= 0.95, result["all"]


def test_no_failure_that_is_not_oom_is_called_oom(result):
    wrong = [r["stem"] for r in result["rows"] if r["false_oom"]]
    assert wrong == []


def test_stated_numbers_exact_on_98_percent(result):
    assert result["all"]["numbers_exact"] >= 0.98, result["all"]


def test_phase_right_on_90_percent_of_logs_with_a_traceback(result):
    assert result["all"]["traceback_logs"] >= 40
    assert result["all"]["phase_exact"] >= 0.90, result["all"]


def test_held_out_fifth_meets_the_kind_and_safety_goals(result):
    held = result["held_out"]
    assert held["cases"] == len(list(CORPUS.glob("*.yaml"))) // 5
    assert held["kind_exact"] >= 0.90 and held["false_oom"] == 0


def test_the_traceback_rule_is_mechanical(bench):
    assert bench.TRACEBACK.search("[rank3]: Traceback (most recent call last):")
    assert bench.TRACEBACK.search("2022-12-28 [ERROR] Traceback (most recent call last):")
    assert not bench.TRACEBACK.search("  File \"train.py\", line 3, in <module>")


def test_per_kind_group_and_launcher_breakdowns_cover_the_corpus(result):
    for key in ("per_kind", "per_group", "per_launcher"):
        assert sum(s["cases"] for s in result[key].values()) == result["all"]["cases"]
    assert set(result["per_group"]) == {"gpu", "host", "other"}
