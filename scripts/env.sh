# Shared by scripts/train.sh and scripts/test.sh: find Python 3.12 and make the project's
# virtual environment (.venv) with torch 2.11, megatron-core 0.19.2 and this package.
# Source it; it defines find_python312 and ensure_venv.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${VENV_DIR:-$REPO_ROOT/.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.11.0}"

find_python312() {
    # `python3.12` may be a shim that exists but fails to run: try each candidate by running it.
    local candidates=(python3.12)
    if command -v pyenv >/dev/null 2>&1; then
        local version
        for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V -r); do
            candidates+=("$(pyenv root)/versions/$version/bin/python3.12")
        done
    fi
    candidates+=(python3)
    local candidate
    for candidate in "${candidates[@]}"; do
        if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; then
            command -v "$candidate" 2>/dev/null || echo "$candidate"
            return 0
        fi
    done
    echo "error: Python 3.12 not found (tried: ${candidates[*]}). Install Python 3.12 (the" \
         "prebuilt dataset helper of megatron-core 0.19.2 is built for CPython 3.12)." >&2
    return 1
}

ensure_venv() {
    if [ -x "$VENV_DIR/bin/python" ] && "$VENV_DIR/bin/python" -c 'import torch, megatron.core, megatron.bounded, pytest, psutil' >/dev/null 2>&1; then
        return 0
    fi
    local python
    python="$(find_python312)" || return 1
    echo "[env] creating $VENV_DIR with $python" >&2
    "$python" -m venv "$VENV_DIR" || return 1
    "$VENV_DIR/bin/python" -m pip install --quiet "$TORCH_SPEC" -e "$REPO_ROOT[test,data]" || return 1
}
