#!/usr/bin/env bash
# Instructions per operation: the daemon's own cost, counted by callgrind.
#
# Runs the release `pluglet` daemon under `valgrind --tool=callgrind` (every thread of the daemon
# process in one count) and the example device plugins and `pluglet ctl` as ordinary processes,
# so only the daemon's instructions are counted. For each row it warms up, dumps the counters
# (callgrind zeroes them at each dump), runs N operations, lets the daemon settle (the checkpoint
# writer's rewrite that follows an allocation is inside the count), dumps again and prints
#   (instructions after the N operations − instructions after the warm-up) / N.
# Rows that need a setup step between operations (allocate 1,024 of 1,024 needs a release, a
# registration needs a new plugin) dump around each operation and sum those counts instead;
# for those, each window's count (all but the writer) and their median are printed as well.
#
# Reading the table: "all threads" is every thread of the daemon; "of which the checkpoint
# writer" is the thread that rewrites kubelet_internal_checkpoint off the allocation path (it
# batches changes quiet for 20 ms, so how many rewrites fall in a row varies with timing; the
# rewrites are counted from the daemon's metric, read outside the counted windows), with the
# idle trim that a large rewrite sets off (the `memory-purge` thread handing the rewrite's
# freed memory back to the kernel half a second later: on a node of 10,000 allocations each
# rewrite frees megabytes, and the trim's cost grows with the heap, not with the operations);
# "all but the writer" is the operation's own path, the figure to compare between builds. It
# repeats run to run; what still differs is the daemon's timers while it waits (a settle, a
# plugin starting), which is the spread printed for two runs or more.
#
# "with 10,000 held": a native daemon first fills the node through `pluglet ctl`, then stops;
# the daemon under callgrind restores those allocations from disk and is measured on them. The
# same rows (allocate 1 of the 64 free devices, release it, sync-pods freeing one pod, and
# allocate 1 once the checkpoint rewrites of an allocation and a release before it have
# finished) are measured first on a node with one plugin of 64 devices and nothing held, so that
# the two can be compared: what an operation costs more on a full node. Both sync-pods rows send
# the same keep list (the full node's 10,000 pod UIDs), so they differ only by what the node
# holds. The rewrite of a full node reads and writes megabytes: with
# CALLGRIND_ARGS="--cache-sim=yes --LL=<the core's L2 size>,<ways>,64" and KEEP=1, the "after a
# rewrite" windows show the cache misses it leaves to the allocation that follows (simulated:
# BENCHMARKS.md says what they cost in wall time).
#
# How operations reach the daemon (CLIENT): `kept` (the default) sends the allocations, releases
# and admin calls over one connection kept open by `admin-driver`, as an orchestrator keeps its
# connection; `ctl` runs one `pluglet ctl` process per operation, so each also pays for setting
# up and closing a connection in the daemon. The sync-pods rows always use `pluglet ctl`.
#
# Usage: scripts/instructions.sh [RUNS]   (default 1; with 2 or more, prints every run and the
#        spread: (max − min) / min per row)
# Environment: BIN_DIR (default target/release; build it with
#   `cargo build --release --bins -p pluglet -p example-device-plugin -p admin-driver`),
#   CLIENT (kept or ctl, see above),
#   HELD (allocations held for the "held" row, default 10000; 0 skips that row),
#   SETTLE (seconds to let the daemon settle before a dump, default 1.5),
#   KEEP=1 (keep the work directory: the daemon's and the plugins' logs, the nodes' files, and
#   every counted window's callgrind files in cg-*/<row>/ for callgrind_annotate),
#   ROWS=held (only the rows of the nothing-held and the full node), ROWS=alloc (only the
#   allocation, release and admin rows of the first node), ROWS=hook (only the hook call;
#   default all),
#   CALLGRIND_ARGS (more options for the daemon's callgrind, as words: `--cache-sim=yes` with
#   KEEP=1 adds simulated cache misses to every kept window's files),
#   HOOK_BENCH (the hook_call bench's executable for the "hook call" row, default the newest
#   target/release/deps/hook_call-*; build it with
#   `cargo bench -p pluglet-handler-runtime --bench hook_call --no-run`).
#
# "hook call" is measured in process, not through the daemon: the hook_call bench makes a few
# and then many `validate` calls on the built-in CSI handler, as the daemon makes them (in a
# reused instance, as built-ins are run; and in a fresh instance each, as a configured module
# is by default), each run under callgrind from a compile cache a first run filled; each row is
# the difference of two runs' totals (every thread) over the difference of their calls.
set -euo pipefail
# shellcheck source=scripts/bench-node.sh
. "$(dirname "$0")/bench-node.sh"

RUNS=${1:-1}
BIN_DIR=${BIN_DIR:-target/release}
HELD=${HELD:-10000}
SETTLE=${SETTLE:-1.5}
ROWS=${ROWS:-all}
CLIENT=${CLIENT:-kept}
case $CLIENT in
kept | ctl) ;;
*)
    echo "error: CLIENT must be kept or ctl, not $CLIENT" >&2
    exit 2
    ;;
esac

for tool in valgrind callgrind_control; do
    command -v "$tool" >/dev/null || {
        echo "error: $tool not found: install valgrind (it provides callgrind_control)" >&2
        exit 2
    }
done
for bin in pluglet example-device-plugin admin-driver; do
    [ "$ROWS" = hook ] || [ -x "$BIN_DIR/$bin" ] || {
        echo "error: $BIN_DIR/$bin missing: cargo build --release --bins -p pluglet -p example-device-plugin -p admin-driver" >&2
        exit 2
    }
done
PLUGLET=$(realpath -m "$BIN_DIR/pluglet")
PLUGIN=$(realpath -m "$BIN_DIR/example-device-plugin")
DRIVER=$(realpath -m "$BIN_DIR/admin-driver")
if [ "$ROWS" = all ] || [ "$ROWS" = hook ]; then
    HOOK_BENCH=${HOOK_BENCH:-$(find target/release/deps -maxdepth 1 -type f -executable \
        -name 'hook_call-*' -printf '%T@ %p\n' 2>/dev/null | sort -rn | head -n 1 | cut -d' ' -f2-)}
    [ -n "$HOOK_BENCH" ] && [ -x "$HOOK_BENCH" ] || {
        echo "error: no hook_call bench executable (HOOK_BENCH): cargo bench -p pluglet-handler-runtime --bench hook_call --no-run" >&2
        exit 2
    }
fi

start_work

ctl() { "$PLUGLET" ctl --root "$ROOT" --timeout 60s "$@" >/dev/null; }

# op COMMAND...: one admin operation (see admin-driver's commands), over the kept connection or
# through `pluglet ctl`.
op() {
    if [ "$CLIENT" = ctl ]; then
        case $1 in
        allocate) ctl allocate --pod "$2" --container "$3" --resource "$4" --count "$5" ;;
        release) ctl release --pod "$2" ;;
        allocations) ctl allocations ;;
        esac
        return
    fi
    driver_op "$@"
}
checkpoint() { echo "$ROOT/device-plugins/kubelet_internal_checkpoint"; }
inode() { stat -c %i "$(checkpoint)" 2>/dev/null || echo none; }

# Waits until the checkpoint file is replaced (a rename after a device change).
checkpoint_replaced() { [ "$(inode)" != "$1" ]; }
wait_checkpoint_after() {
    until_true 120 checkpoint_replaced "$1" || fail "the checkpoint was not rewritten within 120 s"
}

# Starts an example device plugin through kubelet.sock; its pid lands in PLUGIN_PID.
start_plugin() {
    local resource=$1 devices=$2
    "$PLUGIN" --resource "$resource" --devices "$devices" \
        --kubelet-socket "$ROOT/device-plugins/kubelet.sock" >>"$WORK/plugins.log" 2>&1 &
    PLUGIN_PID=$!
    PLUGIN_ARGS=("$resource" "$devices")
    CHILDREN+=("$PLUGIN_PID")
}

# Whether the plugin started last has exited (a zombie counts).
plugin_gone() {
    ! kill -0 "$PLUGIN_PID" 2>/dev/null ||
        [ "$(cut -d' ' -f3 "/proc/$PLUGIN_PID/stat" 2>/dev/null)" = Z ]
}

shows_or_plugin_gone() { has_allocatable "$@" || plugin_gone; }
# wait_allocatable RESOURCE N: waits until RESOURCE shows N allocatable devices. Under valgrind
# the daemon runs about 50 times slower than natively, and the built-in's first `validate` call
# can pass its 50 ms CPU deadline: the Register is refused and the plugin exits. The hook's
# instance is warm after that, so the plugin is started once more, and said so.
wait_allocatable() {
    local restarted=
    until has_allocatable "$@"; do
        until_true 300 shows_or_plugin_gone "$@" ||
            fail "$1 did not show $2 allocatable devices within 300 s"
        has_allocatable "$@" && break
        if [ -z "$restarted" ] && tail -n 3 "$WORK/plugins.log" | grep -q "deadline of"; then
            restarted=1
            echo "note: the Register of $1 passed the validate hook's deadline; starting the plugin once more" >&2
            start_plugin "${PLUGIN_ARGS[@]}"
            continue
        fi
        fail "the plugin of $1 exited before it showed $2 allocatable devices"
    done
}

# start_daemon [callgrind]: runs the daemon on $ROOT (under callgrind, with its metrics served
# on $METRICS) until ready.
start_daemon() {
    local args=(run --root "$ROOT" --handler-pool-size 1 --log-level warn)
    if [ "${1:-}" = callgrind ]; then
        METRICS=127.0.0.1:$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        mkdir -p "$CG_DIR"
        # shellcheck disable=SC2086 # CALLGRIND_ARGS is a list of words
        valgrind --tool=callgrind ${CALLGRIND_ARGS:-} --dump-instr=no --compress-strings=no \
            --collect-atstart=yes --separate-threads=yes --callgrind-out-file="$CG_DIR/cg.out" \
            "$PLUGLET" "${args[@]}" --metrics-addr "$METRICS" 2>>"$WORK/daemon.log" &
    else
        "$PLUGLET" "${args[@]}" 2>>"$WORK/daemon.log" &
    fi
    DAEMON_PID=$!
    CHILDREN+=("$DAEMON_PID")
    until_true 600 is_ready || fail "the daemon did not become ready"
    if [ "$CLIENT" = kept ]; then
        coproc DRIVER_IO { "$DRIVER" --socket "$ROOT/pluglet.sock" 2>>"$WORK/driver.log"; }
        DRIVER_PID=$DRIVER_IO_PID
        CHILDREN+=("$DRIVER_PID")
    fi
}

stop_daemon() {
    if [ "$CLIENT" = kept ]; then
        local fd=${DRIVER_IO[1]}
        exec {fd}>&-
        wait "$DRIVER_PID" 2>/dev/null || true
    fi
    kill -TERM "$DAEMON_PID"
    wait "$DAEMON_PID" 2>/dev/null || true
}

# Checkpoint rewrites so far (the daemon's metric; read outside the counted windows).
rewrites() {
    curl -s "http://$METRICS/metrics" | awk '/^pluglet_checkpoint_writes_total/ { n += $NF } END { print n + 0 }'
}

# Dumps the counters (one file per thread) and prints the instructions since the previous dump:
# every thread, then the checkpoint writer's thread (the thread that computed a kubelet
# checksum: the writer runs on a thread of its own, and nothing else computes one; named
# `KubeletCheckpoint::checksum` since the checkpoint is written from kept bytes, and
# `pluglet_checkpoint::checksum::checksum` in builds before it) with the memory purger's (the
# idle trim after a rewrite; see the comment at the top).
dump() {
    callgrind_control --dump "$DAEMON_PID" >/dev/null 2>&1
    local files=("$CG_DIR"/cg.out.*)
    [ -e "${files[0]}" ] || {
        echo "error: callgrind_control --dump wrote no file" >&2
        exit 1
    }
    awk '/^(summary|totals):/ { n[FILENAME] = $2 }
        /^fn=.*(KubeletCheckpoint::checksum|pluglet_checkpoint::checksum::checksum)/ { writer[FILENAME] = 1 }
        /^fn=.*pluglet::ops::memory::purger/ { writer[FILENAME] = 1 }
        END { for (f in n) { all += n[f]; if (f in writer) w += n[f] }; print all + 0, w + 0 }' "${files[@]}"
    if [ -n "${KEEP:-}" ] && [ -n "${1:-}" ]; then
        mkdir -p "$CG_DIR/$1"
        mv "${files[@]}" "$CG_DIR/$1/"
    else
        rm -f "${files[@]}"
    fi
}

settle() { sleep "$SETTLE"; }

# measure ROW N OP [SETUP]: OP and SETUP are functions called with the operation's index.
measure() {
    local row=$1 n=$2 op=$3 setup=${4:-} total=0 writer=0 written=0 i all w before
    local windows=()
    if [ -z "$setup" ]; then
        # The window starts once the warm-up has settled: its checkpoint rewrite, and the purge
        # half a second after a thread hands back a burst's memory, fall outside it.
        settle
        before=$(rewrites)
        dump >/dev/null
        for ((i = 0; i < n; i++)); do "$op" "$i"; done
        settle
        read -r total writer < <(dump "${row//[^A-Za-z0-9,]/_}")
        written=$(($(rewrites) - before))
    else
        for ((i = 0; i < n; i++)); do
            "$setup" "$i"
            settle
            before=$(rewrites)
            dump >/dev/null
            "$op" "$i"
            settle
            read -r all w < <(dump "${row//[^A-Za-z0-9,]/_}.$i")
            written=$((written + $(rewrites) - before))
            total=$((total + all))
            writer=$((writer + w))
            windows+=("$((all - w))")
        done
    fi
    printf '%s\t%d\t%d\t%d\t%d\n' "$row" "$n" "$((total / n))" "$((writer / n))" "$written" >>"$RESULTS"
    printf '  %-40s N=%-3d %12d instructions/op, %d of them the checkpoint writer (%d rewrites)\n' \
        "$row" "$n" "$((total / n))" "$((writer / n))" "$written" >&2
    if [ ${#windows[@]} -gt 0 ]; then
        # One window per operation: a window far above the others (under valgrind, a policy
        # call choosing 1,024 devices can pass the 2 ms CPU budget and run again off the
        # worker, which it does not natively) moves the mean but not the median.
        printf '  %-40s each window, all but the writer: %s; median %d\n' "" "${windows[*]}" \
            "$(printf '%s\n' "${windows[@]}" | sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : int((v[NR / 2] + v[NR / 2 + 1]) / 2) }')" >&2
    fi
}

alloc8() { op allocate "p8-$1" c bench.io/r8 1; }
release8() { op release "p8-$1"; }
alloc1024() { op allocate "p1k-$1" c bench.io/r1k 1; }
release1024() { op release "p1k-$1"; }
alloc_all() { op allocate "pall-$1" c bench.io/r1k 1024; }
release_previous_all() { op release "pall-$(($1 - 1))"; }
admin() { op allocations; }
register() {
    local before
    before=$(inode)
    start_plugin "bench.io/reg$1" 8
    wait_checkpoint_after "$before"
}
flip() {
    local before
    before=$(inode)
    kill -USR1 "$BIG_PID"
    wait_checkpoint_after "$before"
}
# An allocation and its release, whose checkpoint rewrites finish before the window opens.
cycle_held() {
    op allocate "pc-$1" c bench.io/held 1
    op release "pc-$1"
}
alloc_after() { op allocate "pa-$1" c bench.io/held 1; }
alloc_held() { op allocate "ph-$1" c bench.io/held 1; }
release_held() { op release "ph-$1"; }
alloc_sync() { op allocate "ps-$1" c bench.io/held 1; }
sync_one() { ctl sync-pods --keep-file "$KEEP_FILE"; }

# The rows compared between a node holding nothing and one holding $HELD allocations: the
# daemon under callgrind serves bench.io/held with 64 devices free.
held_rows() {
    local label=$1
    for i in 0 1 2; do alloc_held "w$i"; release_held "w$i"; done
    measure "allocate 1 of 64 free, $label" 8 alloc_held
    measure "release, $label" 8 release_held
    measure "sync-pods freeing 1 pod, $label" 4 sync_one alloc_sync
    measure "allocate 1 of 64 free after a rewrite, $label" 6 alloc_after cycle_held
}

# The total instructions (every thread) of the hook_call bench making $1 calls under callgrind,
# each in a reused instance or, with $2 = fresh, in a fresh one.
hook_total() {
    local out=$WORK/hook.$1.${2:-reused}.cg
    PLUGLET_BENCH_CACHE_DIR=$WORK/hook-cache PLUGLET_BENCH_HOOK_CALLS=$1 \
        PLUGLET_BENCH_HOOK_INSTANCE=${2:-reused} \
        valgrind --tool=callgrind --callgrind-out-file="$out" "$HOOK_BENCH" >/dev/null 2>&1
    awk '/^(summary|totals):/ { print $2; exit }' "$out"
}

hook_row() {
    local few=16 many=272 a b instance
    mkdir -p "$WORK/hook-cache"
    # Fills the compile cache, so that both counted runs load the module the same way; under
    # valgrind too, whose CPU's features differ from the machine's (an entry compiled outside
    # would be refused and compiled again inside).
    hook_total 1 >/dev/null
    for instance in reused fresh; do
        a=$(hook_total "$few" $instance)
        b=$(hook_total "$many" $instance)
        echo "  hook call, $instance instance: $few calls $a, $many calls $b instructions" >&2
        printf '%s\t%s\t%s\t0\t0\n' \
            "hook call (validate, built-in CSI handler, in process, $instance instance)" \
            $((many - few)) $(((b - a) / (many - few))) >>"$RESULTS"
    done
}

one_run() {
    local run=$1
    RESULTS=$WORK/results.$run
    : >"$RESULTS"
    echo "run $run" >&2

    if [ "$ROWS" = all ] || [ "$ROWS" = hook ]; then
        hook_row
        [ "$ROWS" = hook ] && return
    fi

    if [ "$ROWS" = all ] || [ "$ROWS" = alloc ]; then
        ROOT=$WORK/node-a.$run
        mkdir -p "$ROOT"
        CG_DIR=$WORK/cg-a.$run
        start_daemon callgrind
        start_plugin bench.io/r8 8
        wait_allocatable bench.io/r8 8
        for i in 0 1 2; do alloc8 "w$i"; release8 "w$i"; done
        measure "allocate 1 of 8" 8 alloc8
        measure "release" 8 release8
        start_plugin bench.io/r1k 1024
        wait_allocatable bench.io/r1k 1024
        for i in 0 1 2; do alloc1024 "w$i"; release1024 "w$i"; done
        measure "allocate 1 of 1,024" 16 alloc1024
        for ((i = 0; i < 16; i++)); do release1024 "$i"; done
        alloc_all w
        op release pall-w
        op allocate pall--1 c bench.io/r1k 1
        measure "allocate 1,024 of 1,024" 4 alloc_all release_previous_all
        op release pall-3
        for i in 0 1 2; do admin; done
        measure "admin round trip (allocations, empty)" 64 admin
    fi
    if [ "$ROWS" = all ]; then
        register w
        measure "kubelet.sock Register -> visible" 4 register
        start_plugin bench.io/big 10000
        BIG_PID=$PLUGIN_PID
        wait_allocatable bench.io/big 10000
        flip
        flip
        measure "10,000-device update -> visible" 4 flip
    fi
    if [ "$ROWS" = all ] || [ "$ROWS" = alloc ]; then
        stop_daemon
        stop_children
    fi
    [ "$ROWS" = alloc ] && return

    # Every sync-pods row keeps the full node's pods (none of them exists on the empty node).
    KEEP_FILE=$WORK/keep
    { echo kept; seq 0 $((HELD - 1)) | sed 's/^/fill-/'; } >"$KEEP_FILE"
    ROOT=$WORK/node-c.$run
    mkdir -p "$ROOT"
    CG_DIR=$WORK/cg-c.$run
    start_daemon callgrind
    start_plugin bench.io/held 64
    wait_allocatable bench.io/held 64
    held_rows "nothing held (64 devices)"
    stop_daemon
    stop_children

    if [ "$HELD" -gt 0 ]; then
        # Fill natively, then measure under callgrind on the restored node.
        ROOT=$WORK/node-b.$run
        mkdir -p "$ROOT"
        start_daemon
        start_plugin bench.io/held $((HELD + 64))
        wait_allocatable bench.io/held $((HELD + 64))
        echo "  filling the node with $HELD allocations (native daemon)" >&2
        seq 0 $((HELD - 1)) | xargs -P 4 -I{} "$PLUGLET" ctl --root "$ROOT" --timeout 60s \
            allocate --pod "fill-{}" --container c --resource bench.io/held --count 1 >/dev/null
        stop_daemon
        CG_DIR=$WORK/cg-b.$run
        start_daemon callgrind
        wait_allocatable bench.io/held $((HELD + 64))
        held_rows "$HELD held ($((HELD + 64)) devices)"
        stop_daemon
        stop_children
    fi
}

for ((run = 1; run <= RUNS; run++)); do one_run "$run"; done

echo
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%d), $RUNS run(s), CLIENT=$CLIENT"
echo "| row | N | all threads | of which the checkpoint writer (and its idle trim) | all but the writer | checkpoint rewrites; writer instructions per rewrite | spread (all / all but the writer) |"
echo "|---|---|---|---|---|---|---|"
paste "$WORK"/results.* | awk -F'\t' -v runs="$RUNS" '
    function spread(lo, hi) { return lo > 0 ? sprintf("%.2f %%", 100 * (hi - lo) / lo) : "-" }
    {
        all = ""; w = ""; path = ""; rw = ""
        for (r = 0; r < runs; r++) {
            a = $(3 + 5 * r); b = $(4 + 5 * r); k = $(5 + 5 * r); c = a - b
            sep = r ? " / " : ""
            all = all sep a; w = w sep b; path = path sep c
            rw = rw sep k "; " (k ? int(b * $2 / k) : "-")
            if (!r || a < amin) amin = a
            if (!r || a > amax) amax = a
            if (!r || c < cmin) cmin = c
            if (!r || c > cmax) cmax = c
        }
        printf "| %s | %s | %s | %s | %s | %s | %s / %s |\n", $1, $2, all, w, path, rw, spread(amin, amax), spread(cmin, cmax)
    }'
