# Helpers shared by the scripts that drive a daemon from outside (`instructions.sh`,
# `syscalls.sh`); sourced, not run. They read the caller's PLUGLET (the binary), ROOT (the
# node's state directory), KEEP and DRIVER_IO (the coprocess of `admin-driver`, for
# `driver_op`); `start_work` sets WORK (the work directory for logs) and CHILDREN.
shopt -s extglob

# start_work: makes the work directory, and on exit stops the processes in CHILDREN and
# removes the directory (kept, and said so, with KEEP set).
start_work() {
    WORK=$(mktemp -d)
    CHILDREN=()
    trap cleanup EXIT
}
stop_children() {
    for pid in "${CHILDREN[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    CHILDREN=()
}
cleanup() {
    stop_children
    if [ -n "${KEEP:-}" ]; then echo "work directory kept: $WORK" >&2; else rm -rf "$WORK"; fi
}

# fail MESSAGE: stops the run with MESSAGE, keeping the work directory its logs are in.
fail() {
    echo "error: $1; logs in $WORK" >&2
    KEEP=1
    exit 1
}

# until_true SECONDS COMMAND...: polls COMMAND until it succeeds; fails after SECONDS.
until_true() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.05
    done
}

# Whether the daemon says it is ready.
is_ready() {
    local status
    status=$("$PLUGLET" ctl --root "$ROOT" status -o json 2>/dev/null) || return 1
    [[ $status == *'"ready": true'* ]]
}

# has_allocatable RESOURCE N: whether RESOURCE shows N allocatable devices.
has_allocatable() {
    local resources
    resources=$("$PLUGLET" ctl --root "$ROOT" resources -o json 2>/dev/null | tr -d ' \n') || return 1
    [[ $resources == *"\"resource\":\"$1\",\"capacity\":"+([0-9])",\"allocatable\":$2,"* ]]
}

# driver_op COMMAND...: one admin operation over the kept connection of `admin-driver` (see its
# commands); exits the script naming the operation when it is not answered `ok`.
driver_op() {
    local answer
    echo "$*" >&"${DRIVER_IO[1]}"
    read -r answer <&"${DRIVER_IO[0]}" || answer="admin-driver ended"
    [ "$answer" = ok ] || fail "$* -> $answer"
}
