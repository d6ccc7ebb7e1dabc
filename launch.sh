#!/usr/bin/env bash
# Set-up and the common commands. Every command creates or reuses ./.venv and installs what is missing.
#
#   ./launch.sh compare [args]      every strategy, one table + results/  (python -m parallel compare)
#   ./launch.sh test [pytest args]  the test suite (gloo on CPU): ruff, then pytest
#   ./launch.sh run STRATEGY [args] one strategy through the harness       (python -m parallel run)
#   ./launch.sh preflight [args]    every strategy, a torchrun restart and the GPU basics for two steps:
#                                   one line per check (the first command to run on a machine with GPUs)
#   ./launch.sh devices             what hardware is here, and its memory
#   ./launch.sh bench KIND [args]   GPU basics: cpu-vs-gpu | streams | memory  (python -m parallel bench)
#   ./launch.sh sweep [args]        a grid of runs, RunManager-style           (python -m parallel sweep)
#   ./launch.sh plan [args]         which layout for a model on a cluster; --validate (python -m parallel plan)
#   ./launch.sh tensorboard OUT     TensorBoard (with the profiler plugin) on 127.0.0.1 for a results folder
#   ./launch.sh python ...          anything else inside the environment
#   ./launch.sh multinode --nnodes N --rdzv-endpoint HOST:PORT [--nproc-per-node P] [--rdzv-id ID]
#                         [--node-rank R] [--other-torchrun-option=value ...] STRATEGY [strategy options]
#                                   this node's torchrun for a run over N nodes: run it on every node
#                                   (c10d rendezvous at HOST:PORT, on the first node; see scripts/slurm/)
#
# PARALLEL_NO_SETUP=1 uses $VENV as it is (e.g. on a cluster's compute nodes after `./launch.sh setup`).
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

uv_install() {
    # pip's find-links (this machine's local torch wheels) as uv options: uv does not read pip's config.
    local links=() link
    for link in ${PIP_FIND_LINKS:-}; do
        [ -d "$link" ] || [[ "$link" == *://* ]] && links+=(--find-links "$link")
    done
    pip_install uv && "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --compile-bytecode \
        "${links[@]}" "$TORCH_SPEC" -e ".[test]"
}

setup() {
    [ "${PARALLEL_NO_SETUP:-0}" = 1 ] && return
    if [ ! -x "$VENV/bin/python" ]; then
        echo "launch.sh: creating $VENV" >&2
        "$PY" -m venv "$VENV"
    fi
    # Re-install only when the requirements changed: the stamp is a hash of pyproject.toml and TORCH_SPEC.
    local stamp
    stamp="$VENV/.installed-$( (cat pyproject.toml; echo "$TORCH_SPEC") | sha256sum | cut -c1-16)"
    if [ ! -f "$stamp" ]; then
        echo "launch.sh: installing $TORCH_SPEC and the project into $VENV" >&2
        # uv resolves, fetches and compiles bytecode on every core (50 s here from nothing; pip took 95 s
        # with compileall after it). torch is pinned in the same resolution, so the project's own range
        # never pulls a different build. pip, as before, where uv cannot be had or cannot install.
        if ! uv_install; then
            echo "launch.sh: uv could not install; using pip" >&2
            pip_install --no-compile "$TORCH_SPEC"
            pip_install --no-compile -e ".[test]"
            "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
        fi
        rm -f "$VENV"/.installed-*
        touch "$stamp"
    fi
}

multinode() {
    # torchrun's c10d rendezvous: every node's agent meets at HOST:PORT (the first node hosts it unless
    # told otherwise) and ranks are handed out as agents arrive, so --node-rank is only a label there.
    local nnodes="" endpoint="" nproc=1 rdzv_id=parallel node_rank="" extra=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --nnodes) nnodes=${2:?--nnodes needs a value}; shift 2 ;;
            --rdzv-endpoint) endpoint=${2:?--rdzv-endpoint needs HOST:PORT}; shift 2 ;;
            --nproc-per-node) nproc=${2:?--nproc-per-node needs a value}; shift 2 ;;
            --rdzv-id) rdzv_id=${2:?--rdzv-id needs a value}; shift 2 ;;
            --node-rank) node_rank=${2:?--node-rank needs a value}; shift 2 ;;
            --*=*) extra+=("$1"); shift ;;
            --*) echo "launch.sh multinode: unknown option '$1' (torchrun's own options go as --name=value)" >&2
                 exit 2 ;;
            *) break ;;
        esac
    done
    local strategy=${1:-}
    if [ -z "$nnodes" ] || [ -z "$endpoint" ] || [ -z "$strategy" ]; then
        echo "launch.sh multinode: needs --nnodes N, --rdzv-endpoint HOST:PORT and a strategy" >&2
        exit 2
    fi
    shift
    if [ ! -f "scripts/$strategy.py" ]; then
        local names=(scripts/*.py)
        names=("${names[@]#scripts/}")
        echo "launch.sh multinode: no scripts/$strategy.py (strategies: ${names[*]%.py})" >&2
        exit 2
    fi
    setup
    [ -n "$node_rank" ] && extra+=("--node-rank=$node_rank")
    # torchrun's agent otherwise keeps one store for its life, and a restarted group reads the failed
    # attempt's keys (gloo: connectFullMesh refused; nccl: a stale unique id, pytorch#135712): with this,
    # each attempt's rank 0 hosts a fresh one. Read by the agent, so it is set here, not in the workers.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    exec "$VENV/bin/python" -m torch.distributed.run --nnodes="$nnodes" --nproc-per-node="$nproc" \
        --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$rdzv_id" "${extra[@]}" \
        "scripts/$strategy.py" "$@"
}

cmd=${1:-help}
[ $# -gt 0 ] && shift
case "$cmd" in
    compare|run|devices|bench|sweep|preflight|plan)
        setup
        exec "$VENV/bin/python" -m parallel "$cmd" "$@" ;;
    test)
        setup
        "$VENV/bin/python" -m ruff check parallel scripts tests examples
        # Bytecode compiled once: the suite starts a few hundred Python processes, and where
        # PYTHONDONTWRITEBYTECODE is set each would compile the package again (~0.07 s apiece).
        "$VENV/bin/python" -m compileall -q parallel scripts tests examples >/dev/null
        # Two test processes, each test file whole in one of them (its module fixtures run once): most
        # tests wait on spawned ranks and child processes, so two overlap well on two cores. The files in
        # the order conftest gives (the longest first), not xdist's own (the most tests first).
        exec "$VENV/bin/python" -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" ;;
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
    multinode)
        multinode "$@" ;;
    help|-h|--help)
        awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
    *)
        echo "launch.sh: unknown command '$cmd' (compare, test, run, preflight, devices, bench, sweep, plan, tensorboard, python, setup, multinode)" >&2
        exit 2 ;;
esac
