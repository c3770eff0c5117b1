#!/usr/bin/env bash
# The test command: installs the programs the tests need, adds the WASM target the built-in
# handlers are compiled to, builds the binaries the end-to-end tests start, and runs every test.
# The end-to-end tests of publishing to a real Kubernetes API server also need etcd and a
# kube-apiserver: scripts/kube-apiserver.sh installs the one and builds the other from Debian's
# source package (minutes the first time, cached per machine after that), beside the Rust build.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests run, as package:program: `minisign` makes the keys and signatures
# of the handler signature tests; `systemd` brings `systemd-analyze`, which checks the shipped
# unit file; `mount` mounts the small tmpfs and read-only bind mounts of the state tests;
# podman with runc runs a container given an allocation by its CDI name, in an image made of
# busybox-static; `curl` reads the daemon's HTTP endpoints in the pages of docs/, whose
# commands a test runs; `docker-registry` (distribution 2.8) is the real OCI registry handler
# modules are pushed to and pulled from, with `htpasswd` (apache2-utils) making its password
# file, `openssl` its TLS files, and `skopeo` reading what `pluglet handler push` wrote.
packages=(minisign:minisign systemd:systemd-analyze mount:mount podman:podman runc:runc
    busybox-static:busybox curl:curl docker-registry:docker-registry apache2-utils:htpasswd
    openssl:openssl skopeo:skopeo)
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

# kube-apiserver (and etcd, openssl, kubectl) for the Kubernetes end-to-end tests, in the
# background so that its Go build overlaps the Rust build. Its last line of stdout is the
# binary's path; its progress goes to the log.
mkdir -p target
kube_log=target/kube-apiserver-setup.log
bash scripts/kube-apiserver.sh >target/kube-apiserver-setup.path 2>"$kube_log" &
kube_setup=$!

# wkg, the Bytecode Alliance's registry client (wasm-pkg-tools), which the registry
# interoperability tests push and pull with: a pinned version, built once per machine with
# `cargo install` into a cache (a few minutes the first time on 2 cores; nothing after that),
# in the background beside the Rust build. Built without optimisation (`--debug`): the tests
# push and pull a few small modules with it, and an optimised build takes twice the CPU time.
# Without debug info: its build directory peaks at 0.7 GB instead of 1.2 GB beside the Rust
# build, and the binary kept is 61 MB instead of 246 MB.
# Keep the version in step with WKG_VERSION in host/test-support/src/e2e/oci_registry.rs.
wkg_version=0.16.1
wkg_home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
wkg_root=${PLUGLET_WKG_CACHE:-$wkg_home/.cache/pluglet}/wkg-$wkg_version
wkg_log=target/wkg-install.log
wkg_setup=
if [[ ! -x $wkg_root/bin/wkg ]]; then
    echo "installing wkg $wkg_version into $wkg_root (needed by the tests; log: $wkg_log)"
    env -u CARGO_TARGET_DIR CARGO_PROFILE_DEV_DEBUG=false \
        cargo install --debug --locked wkg --version "$wkg_version" --root "$wkg_root" \
        >"$wkg_log" 2>&1 &
    wkg_setup=$!
fi

rustup target add wasm32-wasip2

# The test build turns on the daemon's test hooks (`pluglet/test-hooks`: environment variables
# the end-to-end tests steer it by, never in a shipped binary). The build and the test run use the
# same features, so the binary the end-to-end tests start, target/debug/pluglet, is the one built
# here, with the hooks.
features=(--features pluglet/test-hooks)
cargo build --workspace --bins "${features[@]}"

if ! wait "$kube_setup"; then
    echo "error: setting up kube-apiserver for the Kubernetes end-to-end tests failed" >&2
    echo "       (bash scripts/kube-apiserver.sh); the end of $kube_log:" >&2
    tail -n 40 "$kube_log" >&2
    exit 1
fi
if [[ -n $wkg_setup ]] && ! wait "$wkg_setup"; then
    echo "error: installing wkg $wkg_version for the registry tests failed" >&2
    echo "       (CARGO_PROFILE_DEV_DEBUG=false cargo install --debug --locked wkg" >&2
    echo "       --version $wkg_version --root $wkg_root);" >&2
    echo "       the end of $wkg_log:" >&2
    tail -n 40 "$wkg_log" >&2
    exit 1
fi
PLUGLET_WKG=$wkg_root/bin/wkg
export PLUGLET_WKG
echo "wkg: $PLUGLET_WKG"
PLUGLET_KUBE_APISERVER=$(tail -n 1 target/kube-apiserver-setup.path)
PLUGLET_ETCD=$(command -v etcd)
export PLUGLET_KUBE_APISERVER PLUGLET_ETCD
echo "kube-apiserver: $PLUGLET_KUBE_APISERVER; etcd: $PLUGLET_ETCD"

cargo test --workspace --no-fail-fast "${features[@]}"
