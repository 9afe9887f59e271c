"""The fuzz suite's Hypothesis settings: derandomized (the same examples on every machine and every run, so CI
is reproducible and a failure reproduces), no example database written into the checkout, no per-example
deadline (each property bounds its own time with ``hostile.outcome``: a loaded 2-core CI machine must not make a
timing flaky), and 100-500 examples per property: the whole suite takes about a minute on 2 idle cores, well
within ~2-3 minutes on a loaded CI machine.
``HPCMEM_FUZZ_EXAMPLES`` scales every property's examples (e.g. 10 for a long local hunt; ``fuzz_strategies.examples``)."""

import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

settings.register_profile(
    "hpcmem-fuzz", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture])
settings.load_profile("hpcmem-fuzz")
