#!/usr/bin/env bash
# Pluglet demo: builds what it runs, runs the daemon on a temporary root with the example CSI
# plugin and the example device plugin (both registering through the plugin watcher), shows what
# registered, then stops everything cleanly.
#
# Usage: bash examples/demo.sh                 (from a fresh clone; needs rustup with the stable
#                                               toolchain: the script adds the wasm32-wasip2
#                                               target itself)
#        bash examples/demo.sh --bin-dir DIR   (runs the binaries already built in DIR and builds
#                                               nothing; CI passes target/debug, which the test
#                                               build made)
#
# The build is of the three binaries the demo runs, `pluglet` (with the built-in handlers, built
# by its wasm-guests dependency), `example-csi-plugin` and `example-device-plugin`, with the
# `demo` profile (Cargo.toml): the quickest to build from a fresh clone, into target/demo.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

binaries=(pluglet example-csi-plugin example-device-plugin)
bin=""
while (($#)); do
    case "$1" in
    --bin-dir)
        bin="${2:?--bin-dir needs a directory}"
        shift 2
        ;;
    --bin-dir=*)
        bin="${1#--bin-dir=}"
        shift
        ;;
    -h | --help)
        sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "error: unknown argument $1 (usage: bash examples/demo.sh [--bin-dir DIR])" >&2
        exit 2
        ;;
    esac
done

if [ -z "$bin" ]; then
    # Toolchain auto-install may be off, so add the guests' target explicitly (idempotent).
    rustup target add wasm32-wasip2 >/dev/null || {
        echo "error: could not add the wasm32-wasip2 target; run 'rustup target add wasm32-wasip2' and retry" >&2
        exit 1
    }
    build=(cargo build --profile demo --bins -p pluglet -p example-csi-plugin -p example-device-plugin)
    echo "==> ${build[*]}"
    "${build[@]}"
    bin="${CARGO_TARGET_DIR:-target}/demo"
fi
for name in "${binaries[@]}"; do
    if [ ! -x "$bin/$name" ]; then
        echo "error: no $name in $bin: build it (cargo build --workspace --bins) or run without --bin-dir" >&2
        exit 1
    fi
done
bin="$(cd "$bin" && pwd)"
echo "==> binaries from $bin"

root="$(mktemp -d /tmp/pluglet-demo.XXXXXX)"
daemon_pid=""
plugin_pids=()

stop() {
    # Plugins first (they remove their sockets, the daemon deregisters them), then the daemon.
    for pid in "${plugin_pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${plugin_pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    plugin_pids=()
    if [ -n "$daemon_pid" ]; then
        kill -TERM "$daemon_pid" 2>/dev/null || true
        local status=0
        wait "$daemon_pid" || status=$?
        daemon_pid=""
        echo "pluglet exited with status $status"
    fi
}
cleanup() {
    stop
    rm -rf "$root"
}
trap cleanup EXIT

# Waits (up to 60 s) until "$@" succeeds.
wait_until() {
    local deadline=$((SECONDS + 60))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "timed out waiting for: $*" >&2
            return 1
        fi
        sleep 0.1
    done
}

ctl() { "$bin/pluglet" ctl --root "$root" "$@"; }

echo "==> pluglet run --root $root"
"$bin/pluglet" run --root "$root" 2>"$root/pluglet.log" &
daemon_pid=$!
wait_until ctl plugins

mkdir -p "$root/plugins"
echo "==> example CSI plugin (registration socket in the registry, CSI socket beside it)"
"$bin/example-csi-plugin" \
    --reg-socket "$root/plugins_registry/csi.example.com-reg.sock" \
    --csi-socket "$root/plugins/csi.example.com.sock" \
    --name csi.example.com --versions 1.0.0 --node-id "$(hostname)" \
    --max-volumes 16 --topology topology.kubernetes.io/zone=zone-a \
    >/dev/null 2>"$root/csi-plugin.log" &
plugin_pids+=($!)

echo "==> example device plugin (watcher flow, resource vendor.com/gpu)"
"$bin/example-device-plugin" \
    --resource vendor.com/gpu --devices 4 --numa-nodes 2 \
    --reg-socket "$root/plugins_registry/vendor.com-gpu-reg.sock" \
    --socket "$root/plugins/vendor.com-gpu.sock" \
    >/dev/null 2>"$root/device-plugin.log" &
plugin_pids+=($!)

registered() { [ "$(ctl plugins -o json | grep -c '"registered_at"')" -ge 2 ]; }
wait_until registered

echo
echo "==> pluglet ctl plugins"
ctl plugins
echo
echo "==> pluglet ctl sockets -o json"
ctl sockets -o json
echo
echo "==> pluglet ctl handlers"
ctl handlers
echo

# The device plugin's devices arrive over its ListAndWatch stream right after registration.
has_devices() { ctl resources -o json | grep -q '"Healthy"'; }
wait_until has_devices
echo "==> pluglet ctl resources"
ctl resources
echo
echo "==> pluglet ctl allocate --pod demo-pod --container main --resource vendor.com/gpu --count 2 -o json"
ctl allocate --pod demo-pod --container main --resource vendor.com/gpu --count 2 -o json
echo
echo "==> pluglet ctl allocations"
ctl allocations
echo
echo "==> pluglet ctl status"
ctl status
echo
echo "==> pluglet ctl events"
ctl events
echo
# The allocation was answered once its journal record was on disk; the kubelet-format
# checkpoint follows right after.
in_checkpoint() { grep -q demo-pod "$root/device-plugins/kubelet_internal_checkpoint"; }
wait_until in_checkpoint
echo "==> kubelet_internal_checkpoint (kubelet format, readable by a kubelet)"
cat "$root/device-plugins/kubelet_internal_checkpoint"; echo
echo
echo "==> $root/state (journal, side file, lock)"
ls -l "$root/state"
echo
echo "==> stopping (SIGTERM: plugins, then the daemon)"
stop
