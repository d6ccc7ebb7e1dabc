#!/usr/bin/env bash
# Set-up and the common commands. Every command creates or reuses ./.venv and installs what is missing.
#
#   ./launch.sh compare [args]      every strategy, one table + results/  (python -m parallel compare)
#   ./launch.sh test [pytest args]  the test suite (gloo on CPU): ruff, then pytest
#   ./launch.sh run STRATEGY [args] one strategy through the harness       (python -m parallel run)
#   ./launch.sh devices             what hardware is here
#   ./launch.sh tensorboard OUT     TensorBoard (with the profiler plugin) on 127.0.0.1 for a results folder
#   ./launch.sh python ...          anything else inside the environment
#
# TORCH_SPEC picks the torch build installed first (default torch==2.13.0: the CPU wheel on this
# project's machines; on a GPU machine the same pin from PyPI is a CUDA build).
set -euo pipefail
cd "$(dirname "$0")"

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PY=${PYTHON:-python3}

pip_install() {
    # This machine's pip config lists mirror folders that may be absent; drop that noise, keep real errors.
    "$VENV/bin/python" -m pip install --quiet "$@" 2> >(grep -v "neither a file nor a directory" >&2)
}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "launch.sh: creating $VENV" >&2
        "$PY" -m venv "$VENV"
    fi
    # Re-install only when the requirements changed: the stamp is a hash of pyproject.toml and TORCH_SPEC.
    local stamp
    stamp="$VENV/.installed-$( (cat pyproject.toml; echo "$TORCH_SPEC") | sha256sum | cut -c1-16)"
    if [ ! -f "$stamp" ]; then
        echo "launch.sh: installing $TORCH_SPEC and the project into $VENV" >&2
        # torch first and pinned, so that the project's own range never pulls a different build.
        pip_install "$TORCH_SPEC"
        pip_install -e ".[test]"
        rm -f "$VENV"/.installed-*
        touch "$stamp"
    fi
}

cmd=${1:-help}
[ $# -gt 0 ] && shift
case "$cmd" in
    compare|run|devices)
        setup
        exec "$VENV/bin/python" -m parallel "$cmd" "$@" ;;
    test)
        setup
        "$VENV/bin/python" -m ruff check parallel scripts tests
        exec "$VENV/bin/python" -m pytest "$@" ;;
    tensorboard)
        setup
        out=${1:?usage: ./launch.sh tensorboard RESULTS_DIR [tensorboard options]}
        shift
        exec "$VENV/bin/tensorboard" --logdir "$out/tb" --host 127.0.0.1 "$@" ;;
    python)
        setup
        exec "$VENV/bin/python" "$@" ;;
    setup)
        setup ;;
    help|-h|--help)
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
    *)
        echo "launch.sh: unknown command '$cmd' (compare, test, run, devices, tensorboard, python, setup)" >&2
        exit 2 ;;
esac
