#!/usr/bin/env bash
# The tests marked `heavy`: whole grids (every family, layout or stage count) and long end-to-end runs whose
# representative case the default suite (README's command) already runs. Run before resolving an issue.
# Extra arguments go to pytest, e.g. scripts/run_heavy_tests.sh tests/models/test_pipeline.py
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest "${@:-tests}" -q -n 2 --dist loadfile --heavy -m heavy
