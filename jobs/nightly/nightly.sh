#!/usr/bin/env bash
# The whole nightly cycle in one command: submit the matrix, wait for its cells, collect, report.
# Exits with the report's status: 0 clean, 1 a regression or a newly failing cell, 2 an error.
#
#   jobs/nightly/nightly.sh MATRIX SITE [REPORT_DIR]
#   jobs/nightly/nightly.sh reference example-hpc /shared/www/bench
#
# Environment: HPCMEM (the command, default: hpcmem), COLLECT_TIMEOUT_S (how long to wait for the
# cells, default 6 h; cells still running are collected by the next night's collect), REFERENCES
# (declared references, e.g. jobs/nightly/references.yaml), FORMAT (html or markdown, default html).
# Run it from a directory the compute nodes can see (the jobs start there, as with `hpcmem submit`).
set -euo pipefail

matrix=${1:?usage: nightly.sh MATRIX SITE [REPORT_DIR]}
site=${2:?usage: nightly.sh MATRIX SITE [REPORT_DIR]}
night=$(date +%F)
out=${3:-${HPCMEM_HOME:-$HOME/.hpcmem}/bench/report/$night}
read -r -a hpcmem <<< "${HPCMEM:-hpcmem}"

"${hpcmem[@]}" bench run "$matrix" --site "$site" --night "$night"
if ! "${hpcmem[@]}" bench collect --wait --timeout "${COLLECT_TIMEOUT_S:-21600}"; then
    echo "nightly.sh: cells still running after ${COLLECT_TIMEOUT_S:-21600} s; the next collect stores them" >&2
fi
refs=()
if [[ -n "${REFERENCES:-}" ]]; then
    refs=(--references "$REFERENCES")
fi
exec "${hpcmem[@]}" bench report --format "${FORMAT:-html}" -o "$out" ${refs[@]+"${refs[@]}"}
