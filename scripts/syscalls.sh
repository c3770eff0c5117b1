#!/usr/bin/env bash
# System calls per allocation: what the daemon asks of the kernel for one allocate + release.
#
# Callgrind (scripts/instructions.sh) counts the daemon's own instructions and nothing the kernel
# does for it, yet under many clients about half the daemon's CPU is in the kernel (the parallel
# row of `cargo bench -p pluglet --bench outside` prints it). This script counts the system calls
# behind that: it starts the daemon natively with one example device plugin of 8 devices, sends
# N allocate 1 + release pairs over one kept admin connection (`admin-driver`), and traces every
# thread of the daemon with `strace -f -c` from after a warm-up until the daemon has settled
# after the last pair (so the checkpoint writer's rewrite that follows is in the count). It
# prints each system call's count per pair, and the total.
#
# Usage: scripts/syscalls.sh
# Environment: BIN_DIR (default target/release; build it with
#   `cargo build --release --bins -p pluglet -p example-device-plugin -p admin-driver`),
#   N (pairs, default 200), KEEP=1 (keep the work directory: logs and strace's table).
# TOKIO_WORKER_THREADS, which tokio reads, passes through to the daemon.
set -euo pipefail
# shellcheck source=scripts/bench-node.sh
. "$(dirname "$0")/bench-node.sh"

BIN_DIR=${BIN_DIR:-target/release}
N=${N:-200}
SETTLE=1.5

command -v strace >/dev/null || {
    echo "error: strace not found: install the strace package (apt-get install -y strace)" >&2
    exit 2
}
for bin in pluglet example-device-plugin admin-driver; do
    [ -x "$BIN_DIR/$bin" ] || {
        echo "error: $BIN_DIR/$bin missing: cargo build --release --bins -p pluglet -p example-device-plugin -p admin-driver" >&2
        exit 2
    }
done
PLUGLET=$(realpath "$BIN_DIR/pluglet")
PLUGIN=$(realpath "$BIN_DIR/example-device-plugin")
DRIVER=$(realpath "$BIN_DIR/admin-driver")

start_work
ROOT=$WORK/node
attached() { grep -q "attached" "$WORK/strace.err" 2>/dev/null; }

mkdir -p "$ROOT"
"$PLUGLET" run --root "$ROOT" --handler-pool-size 1 --log-level warn 2>>"$WORK/daemon.log" &
DAEMON_PID=$!
CHILDREN+=("$DAEMON_PID")
until_true 120 is_ready || fail "the daemon did not become ready"
"$PLUGIN" --resource bench.io/r8 --devices 8 \
    --kubelet-socket "$ROOT/device-plugins/kubelet.sock" >>"$WORK/plugin.log" 2>&1 &
CHILDREN+=("$!")
until_true 120 has_allocatable bench.io/r8 8 || fail "bench.io/r8 did not show 8 allocatable devices"
coproc DRIVER_IO { "$DRIVER" --socket "$ROOT/pluglet.sock" 2>>"$WORK/driver.log"; }
CHILDREN+=("$DRIVER_IO_PID")

for i in $(seq 1 10); do
    driver_op allocate "warm-$i" c bench.io/r8 1
    driver_op release "warm-$i"
done
# The warm-up's checkpoint rewrite and the idle work after it fall before the count.
sleep "$SETTLE"
strace -f -c -p "$DAEMON_PID" -o "$WORK/strace.txt" 2>"$WORK/strace.err" &
STRACE_PID=$!
until_true 30 attached || fail "strace did not attach to the daemon (ptrace may be restricted here)"
for i in $(seq 1 "$N"); do
    driver_op allocate "p-$i" c bench.io/r8 1
    driver_op release "p-$i"
done
sleep "$SETTLE"
kill -INT "$STRACE_PID"
wait "$STRACE_PID" || true

echo "system calls per allocate 1 + release ($N pairs, kept admin connection, every thread of the daemon):"
awk -v n="$N" '
    $1 ~ /^[0-9.]+$/ && $NF != "total" {
        printf "  %-20s %8.2f\n", $NF, $4 / n
    }
    $NF == "total" { total = $4 }
    END { printf "  %-20s %8.2f\n", "total", total / n }
' "$WORK/strace.txt" | sort -k2 -nr
