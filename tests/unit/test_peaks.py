"""toolkit/peaks.py on literal step series: a long batch, a leak, a first-step OOM, and what is none of them."""

import dataclasses

import pytest

from toolkit import peaks
from toolkit.errors import ConfigError
from toolkit.ladder import size_for_long_batch
from toolkit.plan import Plan


def series(steps, current=None, plan_seq_len=128, measure="rss", longest=None, last=None):
    lens = [s[1] for s in steps if s[1] is not None]
    return {"measure": measure, "plan_seq_len": plan_seq_len, "first_step": steps[0][0] if steps else None,
            "every": 1, "cap": 1024, "steps": [list(s) for s in steps],
            "last": last if last is not None else (list(steps[-1]) if steps else None),
            "longest_done": longest if longest is not None else (
                [next(s[0] for s in steps if s[1] == max(lens)), max(lens)] if lens else None),
            "current": current}


# Recorded by the reference trainer on CPU (tiny-gpt2, micro-batch 8, lengths drawn from [64, 128], no leak):
# RSS per step moves by tens of MiB with the length, with no trend.
STEADY_VARIABLE = [(1, 119, 479.5), (2, 79, 499.3), (3, 93, 512.7), (4, 73, 512.7), (5, 97, 523.1), (6, 89, 523.1),
                   (7, 104, 522.0), (8, 71, 496.6), (9, 90, 519.1), (10, 72, 519.1), (11, 102, 522.9),
                   (12, 83, 495.0), (13, 80, 496.6), (14, 122, 527.1), (15, 77, 505.9), (16, 120, 550.9),
                   (17, 64, 506.0), (18, 81, 507.1), (19, 106, 523.5), (20, 108, 524.0)]
# Recorded with --leak-mib-per-step 40 (tiny-gpt2, seq_len 64): about 40 MiB more every step.
LEAKING = [(1, 64, 489.2), (2, 64, 557.6), (3, 64, 603.6), (4, 64, 644.6), (5, 64, 676.6), (6, 64, 720.6),
           (7, 64, 760.6), (8, 64, 808.6), (9, 64, 848.6), (10, 64, 888.7), (11, 64, 928.7), (12, 64, 976.7),
           (13, 64, 1016.7), (14, 64, 1040.8)]


def test_a_steady_run_with_variable_lengths_is_no_case():
    d = peaks.analyse(series(STEADY_VARIABLE))
    assert d.case is None and d.answers_with_ladder


def test_a_leak_is_named_with_its_slope_and_the_code_remedy():
    d = peaks.analyse(series(LEAKING, current={"step": 15, "seq_len": 64}, plan_seq_len=64))
    assert d.case == peaks.LEAK and not d.answers_with_ladder
    assert 38 < d.numbers["slope_mib_per_step"] < 45 and d.numbers["tau"] == 1.0
    assert d.numbers["from_step"] == 4  # the first SKIP_STEPS steps are left out
    assert "loss.item()" in d.remedies[0] and "detach()" in d.remedies[0]
    assert "smaller micro-batch" in d.remedies[1]


def test_one_high_step_does_not_make_a_leak_and_one_low_step_does_not_hide_one():
    flat = [(s, 128, 1000.0 + (3.0 if s % 2 else -3.0)) for s in range(1, 30)]
    flat[20] = (21, 128, 1900.0)  # one odd step (a cache growing once)
    assert peaks.analyse(series(flat)).case is None
    leak = [(s, 128, 1000.0 + 10.0 * s) for s in range(1, 30)]
    leak[20] = (21, 128, 900.0)
    assert peaks.analyse(series(leak)).case == peaks.LEAK


def test_a_slow_rise_below_the_floor_is_not_a_leak():
    # 0.5 MiB a step over 20 steps on a 4 GiB peak: within allocator jitter (floor: 5 % of the median peak)
    slow = [(s, 128, 4096.0 + 0.5 * s) for s in range(1, 25)]
    assert peaks.analyse(series(slow)).case is None


def test_too_few_steps_for_a_trend():
    short = [(s, 128, 1000.0 + 100.0 * s) for s in range(1, peaks.SKIP_STEPS + peaks.LEAK_MIN_POINTS)]
    assert peaks.analyse(series(short)).case is None
    longer = [(s, 128, 1000.0 + 100.0 * s) for s in range(1, peaks.SKIP_STEPS + peaks.LEAK_MIN_POINTS + 1)]
    assert peaks.analyse(series(longer)).case == peaks.LEAK


def test_a_long_batch_at_the_failing_step():
    d = peaks.analyse(series(STEADY_VARIABLE, current={"step": 21, "seq_len": 512}))
    assert d.case == peaks.LONG_BATCH and d.answers_with_ladder
    assert d.numbers == {"step": 21, "seq_len": 512, "plan_seq_len": 128, "ratio": 4.0, "longest_done": 122,
                         "usual_peak_mib": 550.9}
    assert d.measure == "rss"
    assert "step 21" in d.reason and "512 tokens" in d.reason
    assert any("--max-seq-len 512" in r for r in d.remedies)
    assert any("bucket" in r for r in d.remedies) and any("cap the sequence length at 128" in r for r in d.remedies)


def test_a_long_batch_wins_over_a_leak_at_the_same_failure():
    d = peaks.analyse(series(LEAKING, current={"step": 15, "seq_len": 256}, plan_seq_len=64))
    assert d.case == peaks.LONG_BATCH


def test_a_length_that_already_completed_is_not_the_cause():
    steps = STEADY_VARIABLE[:10] + [(11, 300, 700.0)] + STEADY_VARIABLE[11:]
    d = peaks.analyse(series(steps, current={"step": 21, "seq_len": 300}))
    assert d.case is None
    # nor is a batch within the plan's seq_len
    assert peaks.analyse(series(STEADY_VARIABLE, current={"step": 21, "seq_len": 128})).case is None


def test_a_first_step_oom():
    d = peaks.analyse({"measure": "rss", "plan_seq_len": 128, "steps": [], "last": None, "longest_done": None,
                       "current": {"step": 1, "seq_len": 128}})
    assert d.case == peaks.FIRST_STEP and "first step" in d.reason
    # a resumed attempt's first step is its own first, whatever its number
    d = peaks.analyse({"steps": [], "last": None, "current": {"step": 41, "seq_len": 128}, "plan_seq_len": 128})
    assert d.case == peaks.FIRST_STEP and d.numbers["step"] == 41


def test_diagnose_over_ranks_prefers_the_rank_that_shows_a_case():
    quiet = {"rank": 0, "step_peaks": series(STEADY_VARIABLE)}
    long = {"rank": 1, "step_peaks": series(STEADY_VARIABLE, current={"step": 21, "seq_len": 400})}
    d = peaks.diagnose([quiet, long])
    assert d.case == peaks.LONG_BATCH and d.rank == 1
    assert peaks.diagnose([{"rank": 0}]) is None  # no series recorded (an older runtime)
    assert peaks.diagnose([quiet]).case is None


def test_garbage_entries_are_skipped_not_fatal():
    s = series(LEAKING)
    s["steps"] += [["x", 1, 2], [1, 2], [99, 64, float("nan")], None]
    assert peaks.analyse(s, 64).case == peaks.LEAK


def test_the_recorder_stays_bounded_and_evenly_spaced():
    rec = peaks.SeriesRecorder("rss", 128, cap=16)
    for step in range(1, 1001):
        rec.begin(step, 128 if step != 700 else 200)
        rec.end(float(step))
    out = rec.to_dict()
    assert len(out["steps"]) < 16  # never the cap: it halves on reaching it
    assert out["every"] * len(out["steps"]) >= 1000 - out["every"]  # and still spans the whole run
    gaps = {b[0] - a[0] for a, b in zip(out["steps"], out["steps"][1:])}
    assert gaps == {out["every"]} and out["steps"][0][0] == 1
    assert out["last"] == [1000, 128, 1000.0] and out["longest_done"] == [700, 200]
    assert rec.begin(1001, 300) is True and rec.begin(1001, 100) is False
    assert out["current"] is None and rec.to_dict()["current"] == {"step": 1001, "seq_len": 100}


def test_a_leak_survives_downsampling():
    rec = peaks.SeriesRecorder("rss", 128, cap=32)
    for step in range(1, 5001):
        rec.begin(step, 128)
        rec.end(2000.0 + 0.2 * step + (5.0 if step % 3 else -5.0))
    assert peaks.analyse(rec.to_dict()).case == peaks.LEAK


def test_theil_sen_and_kendall():
    pts = [(1, 1.0), (2, 2.0), (3, 3.0), (4, 100.0), (5, 5.0)]
    assert peaks.theil_sen_slope(pts) == 1.0
    assert peaks.kendall_tau([(1, 3.0), (2, 2.0), (3, 1.0)]) == -1.0
    assert peaks.kendall_tau([(1, 1.0)]) == 0.0


# --------------------------------------------------------------------------- the controller's answer

@dataclasses.dataclass(frozen=True)
class _Decision:  # the fields of ladder.Decision that after_ladder reads
    action: str
    plan: object
    moves: tuple = ()
    reason: str = ""


def test_a_long_batch_is_sized_for_then_the_usual_length_given_back():
    d = peaks.analyse(series(STEADY_VARIABLE, current={"step": 21, "seq_len": 512}))
    plan = Plan(seq_len=128, mem_mib=2000)
    assert peaks.plan_for_ladder(plan, d).seq_len == 512
    assert peaks.plan_for_ladder(plan, None) is plan
    out = size_for_long_batch(_Decision("retry", Plan(seq_len=512, mem_mib=4000), ("mem:2000->4000",), "more --mem."),
                             d, 128)
    assert out.plan.seq_len == 128 and out.plan.mem_mib == 4000
    assert out.moves == ("sized-for-seq-len:512", "mem:2000->4000")
    assert out.reason.startswith("A long batch: step 21") and "sized for it" in out.reason
    assert out.plan.mem_mib == 4000  # no mem cap given and 551 x 512/122 x 1.1 = 2544 MiB < 4000: kept
    leak = peaks.analyse(series(LEAKING), 64)
    same = _Decision("retry", plan)
    assert size_for_long_batch(same, leak, 128) is same
    assert "Not retried" in peaks.give_up_reason(leak, 2, "77") and "loss.item()" in peaks.give_up_reason(leak, 2, "77")


# --------------------------------------------------------------------------- the data's longest sequence

def test_length_histograms_json_and_csv():
    assert peaks.parse_length_hist('{"128": 900, "512": 3, "2048": 0}') == {128: 900, 512: 3, 2048: 0}
    assert peaks.parse_length_hist("length,count\n# comment\n128,900\n\n512, 3\n") == {128: 900, 512: 3}
    assert peaks.longest_sequence(None, {128: 900, 512: 3, 2048: 0}) == 512  # a length with no sample is not data
    assert peaks.longest_sequence(1024, {128: 1}) == 1024 and peaks.longest_sequence(None, None) is None


@pytest.mark.parametrize("text, says", [
    ("", "is empty"),
    ("{", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"a": 1}', "the length must be a positive integer"),
    ('{"0": 1}', "the length must be a positive integer"),
    ('{"12": -1}', "the count must be a non-negative integer"),
    ('{"12": 1.5}', "the count must be a non-negative integer"),
    ('{"12": true}', "the count must be a non-negative integer"),
    ('{"12": 0}', "no length with a count above 0"),
    ("128,1,2", "line 1: expected 'length,count'"),
    ("128,1\n128,2", "length 128 is given twice"),
    ("1_28,1", "the length must be a positive integer"),
    ("\u0661\u0662,1", "the length must be a positive integer"),
    ('"x"', "line 1: expected 'length,count'"),
])
def test_bad_histograms_are_one_line_errors(text, says):
    with pytest.raises(ConfigError) as err:
        peaks.parse_length_hist(text, "hist.json")
    assert says in str(err.value) and "\n" not in str(err.value) and "hist.json" in str(err.value)


def test_sized_for_longest_says_what_it_did():
    out = peaks.sized_for_longest(128, 512, "--max-seq-len")
    assert out["sized_seq_len"] == 512 and "instead of the plan's seq_len 128" in out["note"]
    within = peaks.sized_for_longest(1024, 512, "hist.csv")
    assert within["sized_seq_len"] == 1024 and "within" in within["note"]
    assert peaks.sized_for_longest(128, None, "x") is None


def test_a_long_batch_on_host_memory_gets_the_mem_it_needs_not_a_doubling():
    # the usual steps peaked at 740 MiB RSS with batches of at most 64 tokens; step 5's batch is 512 tokens
    steps = [(s, 64, 700.0 + 10 * s) for s in range(1, 5)]
    d = peaks.analyse(series(steps, current={"step": 5, "seq_len": 512}, plan_seq_len=64))
    assert peaks.long_batch_host_mib(d, 1) == 740 * 8 and peaks.long_batch_host_mib(d, 2) == 2 * 740 * 8
    ladder = _Decision("retry", Plan(seq_len=512, mem_mib=3600), ("mem_mib:1800->3600",),
                       "the cheapest host-memory move left: mem_mib:1800->3600.")
    out = size_for_long_batch(ladder, d, 64, mem_cap_mib=20000)
    assert out.plan.mem_mib == 6512 and out.moves == ("sized-for-seq-len:512", "mem_mib:1800->6512")  # 5920 x 1.1
    assert "mem_mib:1800->6512" in out.reason and "3600" not in out.reason
    assert size_for_long_batch(ladder, d, 64, mem_cap_mib=5000).plan.mem_mib == 5000  # within the node
    # not a memory move: left to the ladder (no --mem invented where the spec does not allow it)
    micro = _Decision("retry", Plan(seq_len=512, micro_batch=4, global_batch=8, grad_accum=2), ("micro_batch:8->4",))
    assert size_for_long_batch(micro, d, 64).plan.mem_mib is None
    # a GPU series (max_memory_allocated): the ladder's GPU moves size it, no host figure
    gpu = peaks.analyse(series(steps, current={"step": 5, "seq_len": 512}, plan_seq_len=64,
                               measure="max_memory_allocated"))
    assert peaks.long_batch_host_mib(gpu, 1) is None
