#!/usr/bin/env bash
# The test command (README, .ci/run): install what the tests need, start the Slurm
# test cluster, run pytest. Safe to run again: every step reuses what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! dpkg -s libaio-dev >/dev/null 2>&1; then   # DeepSpeed NVMe offload (ZeRO-Infinity) builds against it
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev
fi
# torch first, pinned to the CPU wheel on disk; DeepSpeed's build needs torch, so no build isolation.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q --no-build-isolation -e '.[job,test]'

bash tests/cluster/slurm-up.sh
export HPCMEM_CI_CLUSTER=1
exec "$PY" -m pytest -ra "$@"
