#!/usr/bin/env bash
# The test command: create the environment if needed, then run the CPU tests: the package's unit
# tests (tests/unit, one folder per subpackage), the repository's own checks (tests/repo) and the
# tests of the benchmark and GPU-test tooling (tests/harness).
#   bash scripts/test.sh [extra pytest args]            # every CPU test (what CI runs)
#   bash scripts/test.sh --quick [extra pytest args]    # the quick tier: no slow or GPU tests
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
cd "$REPO_ROOT"
if [ "${1:-}" = "--quick" ]; then
    shift
    set -- -m "not slow and not gpu" "$@"
fi
exec "$VENV_DIR/bin/python" -m pytest tests/unit tests/repo tests/harness -q "$@"
