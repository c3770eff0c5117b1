#!/usr/bin/env bash
# The test command: installs the programs the tests need, adds the WASM target the built-in
# handlers are compiled to, builds the binaries the end-to-end tests start, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests run, as package:program: `minisign` makes the keys and signatures
# of the handler signature tests; `systemd` brings `systemd-analyze`, which checks the shipped
# unit file; `mount` mounts the small tmpfs and read-only bind mounts of the state tests;
# podman with runc runs a container given an allocation by its CDI name, in an image made of
# busybox-static.
packages=(minisign:minisign systemd:systemd-analyze mount:mount podman:podman runc:runc
    busybox-static:busybox)
missing=()
for entry in "${packages[@]}"; do
    command -v "${entry#*:}" >/dev/null 2>&1 || missing+=("${entry%%:*}")
done
# Python modules, for Debian's Python (/usr/bin/python3): the Prometheus project's own parser
# reads `/metrics` in the metrics tests; grpcio is a stock gRPC client of the admin API.
for entry in python3-prometheus-client:prometheus_client python3-grpcio:grpc; do
    /usr/bin/python3 -c "import ${entry#*:}" >/dev/null 2>&1 || missing+=("${entry%%:*}")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]]; then
        echo "installing ${missing[*]} (needed by the tests)"
        if ! apt-get install -y -q "${missing[@]}"; then
            apt-get update -q
            apt-get install -y -q "${missing[@]}"
        fi
    else
        echo "error: the tests need the Debian package(s): ${missing[*]}" >&2
        echo "       install them (sudo apt-get install -y ${missing[*]}) or run this script as root." >&2
        exit 1
    fi
fi

rustup target add wasm32-wasip2

cargo build --workspace --bins
cargo test --workspace
