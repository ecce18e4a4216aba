#!/usr/bin/env bash
# The test command: create the environment if needed, then run the CPU unit tests.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
ensure_venv
cd "$REPO_ROOT"
exec "$VENV_DIR/bin/python" -m pytest tests/unit -q "$@"
