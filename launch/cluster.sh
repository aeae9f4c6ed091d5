#!/usr/bin/env bash
# Start the nodes of a treeopsd Ray cluster with GPU pools, and submit a run to it (docs/cluster.md).
#
#   launch/cluster.sh head   [--port 6379] [--pool NAME=COUNT ...] [--num-cpus N] [--num-gpus N] [options]
#   launch/cluster.sh worker --address HOST:PORT [--pool NAME=COUNT ...] [--num-cpus N] [--num-gpus N] [options]
#   launch/cluster.sh submit [--address http://HOST:8265] [--working-dir .] -- treeopsd train --config ...
#
# A pool is a Ray custom resource: `--pool sample=1` becomes `ray start ... --resources '{"pool_sample": 1}'`
# (repeat --pool to put a node in several pools); `resources.<role>.pool: sample` in the config then keeps
# that role on those nodes. COUNT is any positive number: roles ask for 0.01 of it, so CPUs and GPUs, not the
# pool count, bound how many actors a node takes (by convention COUNT = the node's GPU count).
#
# Options (head and worker):
#   --node-ip IP       address the node advertises (default $TREEOPSD_NODE_IP or 127.0.0.2, see below)
#   --pool NAME=COUNT  join pool NAME (letters, digits, _ -); repeatable
#   --num-cpus N, --num-gpus N   override what Ray detects
#   --temp-dir DIR     Ray's temp/log dir for this node (give each node on one machine its own)
#   --block            stay in the foreground; Ctrl-C / SIGTERM stops this node's processes
#   --dry-run          print the ray command instead of running it
#   -- ARGS...         passed to `ray start` unchanged (e.g. -- --object-store-memory 2000000000)
# worker:     --address HOST:PORT of the head's GCS (default $RAY_HEAD_ADDRESS or 127.0.0.2:6379)
# head only:  --port P (GCS, default 6379), --dashboard-host H (default 127.0.0.1), --dashboard-port P
#             (default 8265), --no-dashboard
# submit:     --address URL (default $RAY_API_SERVER_ADDRESS or http://127.0.0.1:8265), --working-dir DIR
#             (default .), --dry-run; everything after -- is the entrypoint run on the head node.
#
# Loopback-safe defaults: with no --node-ip every node advertises 127.0.0.2 and the dashboard (job API)
# binds 127.0.0.1, so a head and workers on one machine talk over loopback only, and no address outside the
# machine is ever used (Ray's gRPC servers still listen on all interfaces: firewall them on an open network).
# 127.0.0.2 rather than 127.0.0.1 because Ray rewrites 127.0.0.1/localhost to the machine's network
# address, and the switch that stops it (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) also makes `ray start
# --address` refuse to add a worker; every 127.x address is loopback on Linux. For a real multi-machine
# cluster pass --node-ip <this machine's cluster-network IP> on every node, and reach the dashboard through
# an SSH tunnel (ssh -L 8265:127.0.0.1:8265 head) or --dashboard-host on a trusted network.
# Token auth is off (RAY_AUTH_MODE=disabled, as in the rest of the project); set RAY_AUTH_MODE=token on every
# node and client to turn it on. This script never runs `ray stop`, which kills every Ray process on the
# machine: stop a --block node with Ctrl-C, or run `ray stop` yourself knowing that.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
if [[ -x "$VENV/bin/ray" ]]; then
    export PATH="$VENV/bin:$PATH" # job entrypoints (treeopsd, python) resolve to the project's venv
fi
if [[ -x "$VENV/bin/python" ]]; then
    PY="$VENV/bin/python"
else
    PY="$(command -v python3 || command -v python)"
fi

export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export VLLM_HOST_IP="${VLLM_HOST_IP:-127.0.0.1}"
# the roles at the priority of the rest of the machine, not Ray's nice 15 (runtime/topology.py: why)
export RAY_worker_niceness="${RAY_worker_niceness:-0}"

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//'
}

die() {
    echo "cluster.sh: $*" >&2
    exit 2
}

need_value() { # $1 = flag, $2 = number of args left after the flag
    [[ $2 -ge 2 ]] || die "$1 needs a value"
}

pools_json() { # NAME=COUNT ... -> {"pool_NAME": COUNT, ...}, validated, built by json.dumps
    "$PY" - "$@" <<'EOF'
import json, re, sys

out = {}
for item in sys.argv[1:]:
    name, sep, count = item.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        sys.exit(f"cluster.sh: --pool {item!r}: expected NAME=COUNT with NAME of letters, digits, _ -")
    try:
        value = float(count)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        sys.exit(f"cluster.sh: --pool {item!r}: COUNT must be a positive number")
    if f"pool_{name}" in out:
        sys.exit(f"cluster.sh: --pool {name} given twice")
    out[f"pool_{name}"] = int(value) if value.is_integer() else value
print(json.dumps(out))
EOF
}

check_node_ip() {
    case "$1" in
        127.0.0.1 | localhost | ::1)
            die "--node-ip $1: Ray rewrites it to the machine's network address; use 127.0.0.2 (loopback too)"
            ;;
    esac
}

shell_join() { # the command as one copy-pasteable line
    "$PY" -c 'import shlex, sys; print(shlex.join(sys.argv[1:]))' "$@"
}

run_or_print() {
    if [[ "$DRY_RUN" == 1 ]]; then
        shell_join "$@"
    else
        echo "+ $(shell_join "$@")" >&2
        exec "$@"
    fi
}

start_node() { # $1 = head | worker, then the options
    local kind="$1"
    shift
    local node_ip="${TREEOPSD_NODE_IP:-127.0.0.2}" port=6379 address=""
    local dash_host=127.0.0.1 dash_port=8265 dashboard=auto
    local -a pools=() extra=() passthrough=()
    DRY_RUN=0
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --node-ip) need_value "$1" $#; node_ip="$2"; shift 2 ;;
            --port) need_value "$1" $#; port="$2"; shift 2 ;;
            --address) need_value "$1" $#; address="$2"; shift 2 ;;
            --pool) need_value "$1" $#; pools+=("$2"); shift 2 ;;
            --num-cpus | --num-gpus | --temp-dir)
                need_value "$1" $#; extra+=("$1" "$2"); shift 2 ;;
            --dashboard-host) need_value "$1" $#; dash_host="$2"; shift 2 ;;
            --dashboard-port) need_value "$1" $#; dash_port="$2"; shift 2 ;;
            --no-dashboard) dashboard=off; shift ;;
            --block) extra+=(--block); shift ;;
            --dry-run) DRY_RUN=1; shift ;;
            -h | --help) usage; exit 0 ;;
            --) shift; passthrough=("$@"); break ;;
            *) die "$kind: unknown option $1 (see launch/cluster.sh --help)" ;;
        esac
    done
    check_node_ip "$node_ip"
    local -a cmd=(ray start "--node-ip-address=$node_ip" --disable-usage-stats)
    if [[ ${#pools[@]} -gt 0 ]]; then
        cmd+=(--resources "$(pools_json "${pools[@]}")")
    fi
    if [[ "$kind" == head ]]; then
        [[ -z "$address" ]] || die "head: --address is for workers (the head listens on --port)"
        cmd+=(--head "--port=$port" "--dashboard-host=$dash_host" "--dashboard-port=$dash_port")
        if [[ "$dashboard" == off ]]; then
            cmd+=(--include-dashboard=false)
        elif ! "$PY" -c "import ray.dashboard.optional_deps" 2>/dev/null; then
            echo "cluster.sh: ray[default] is not installed here: the head runs without the dashboard, so" \
                "there is no \`ray job submit\` and no state API (pip install 'ray[default]')" >&2
        fi
    else
        address="${address:-${RAY_HEAD_ADDRESS:-127.0.0.2:6379}}"
        [[ "$address" == *:* ]] || die "worker: --address must be HOST:PORT, got $address"
        cmd+=("--address=$address")
    fi
    cmd+=("${extra[@]}" "${passthrough[@]}")
    # A worker that Ray treats as on Windows/macOS is refused; the project's Makefile sets this to 0
    # (loopback for single-node runs), which would refuse our workers too.
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
    unset RAY_ADDRESS
    run_or_print "${cmd[@]}"
}

submit() {
    local address="${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}" working_dir=.
    DRY_RUN=0
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --address) need_value "$1" $#; address="$2"; shift 2 ;;
            --working-dir) need_value "$1" $#; working_dir="$2"; shift 2 ;;
            --dry-run) DRY_RUN=1; shift ;;
            -h | --help) usage; exit 0 ;;
            --) shift; break ;;
            *) die "submit: unknown option $1 (the entrypoint goes after --)" ;;
        esac
    done
    [[ $# -gt 0 ]] || die "submit: give the entrypoint after --, e.g. -- treeopsd train --config configs/cluster_example.yaml"
    [[ "$address" == http://* || "$address" == https://* ]] ||
        die "submit: --address is the dashboard URL (http://HOST:8265), got $address"
    # --working-dir ships the tree to the cluster (Ray skips .gitignore'd paths such as .venv and runs/);
    # the entrypoint runs on the head node, inside that copy, with the head's environment (its venv on PATH
    # when the head was started by this script).
    run_or_print ray job submit "--address=$address" --working-dir "$working_dir" -- "$@"
}

case "${1:-}" in
    head | worker) start_node "$@" ;;
    submit) shift; submit "$@" ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
esac
