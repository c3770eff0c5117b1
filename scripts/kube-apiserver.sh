#!/usr/bin/env bash
# Provides a real `kube-apiserver` for the end-to-end tests that publish to a Kubernetes API
# server, and makes sure `etcd`, `openssl` and `kubectl` (which those tests also run) are
# installed.
#
# Debian ships no kube-apiserver binary, but it ships the source package `kubernetes` (1.20.2,
# with its whole vendor/ tree), Go 1.19 and etcd-server. So this script downloads that source
# package once, builds `cmd/kube-apiserver` from it and caches the binary under
#     ${PLUGLET_KUBE_CACHE:-$HOME/.cache/pluglet/kube-apiserver}/<sha256 of the orig tarball>/
# A run with the binary cached touches neither apt nor the network and takes well under a second.
#
# The binary's absolute path is the LAST line written to stdout; everything else goes to stderr.
# Run as root, it installs the Debian packages it needs (and, when no `deb-src` entry exists,
# adds one for the machine's Debian archive); otherwise it names what is missing and fails.
set -euo pipefail

# Everything goes to stderr except the final path, written to fd 3 (the real stdout).
exec 3>&1 1>&2

log() { echo "kube-apiserver.sh: $*"; }
die() {
    echo "kube-apiserver.sh: error: $*"
    exit 1
}

home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
cache=${PLUGLET_KUBE_CACHE:-$home/.cache/pluglet/kube-apiserver}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd -P)
export DEBIAN_FRONTEND=noninteractive

# One run at a time per cache: a second run waits here, then finds the binary the first built.
exec 9>"$cache/.lock"
if ! flock -n 9; then
    log "another run holds $cache/.lock; waiting for it"
    flock 9
fi

# Installs the Debian packages of the `package:path-or-program` entries whose program (or path,
# when it starts with /) is missing; fails with their names when not root.
ensure_packages() {
    local entry what missing=()
    for entry in "$@"; do
        what=${entry#*:}
        if [[ $what == /* ]]; then
            [[ -e $what ]] || missing+=("${entry%%:*}")
        else
            command -v "$what" >/dev/null 2>&1 || missing+=("${entry%%:*}")
        fi
    done
    ((${#missing[@]})) || return 0
    if [[ $(id -u) -ne 0 ]]; then
        die "the Kubernetes end-to-end tests need the Debian package(s): ${missing[*]}
       install them (sudo apt-get install -y ${missing[*]}) or run this script as root."
    fi
    log "installing ${missing[*]}"
    if ! apt-get install -y -q "${missing[@]}"; then
        apt-get update -q
        apt-get install -y -q "${missing[@]}"
    fi
}

# What the tests run next to kube-apiserver: etcd as its store, openssl for its service-account
# key, and kubectl to talk to it (any recent kubectl does; Debian's comes with kubernetes-client).
ensure_packages etcd-server:etcd openssl:openssl kubernetes-client:kubectl

# Fast path: the binary the last successful run built (or found) for this cache.
if [[ -s $cache/current ]]; then
    bin=$cache/$(<"$cache/current")/kube-apiserver
    if [[ -x $bin ]]; then
        echo "$bin" >&3
        exit 0
    fi
fi

# --- Cold path: fetch the source package, build, cache. ---------------------------------------

ensure_packages golang-1.19-go:/usr/lib/go-1.19/bin/go rsync:rsync make:make \
    golang-github-modern-go-reflect2-dev:/usr/share/gocode/src/github.com/modern-go/reflect2/reflect2.go

# Writes deb-src stanzas mirroring the machine's Debian `deb` entries (deb822 `.sources` files
# and one-line `.list` entries alike), falling back to deb.debian.org for this release. Called
# only as root.
write_deb_src() {
    local out=/etc/apt/sources.list.d/pluglet-deb-src.sources tmp
    tmp=$(mktemp)
    {
        local f
        for f in /etc/apt/sources.list.d/*.sources; do
            [[ -f $f && $f != "$out" ]] || continue
            awk '
                function flush() {
                    if (types ~ /(^| )deb( |$)/ && enabled != "no" && uris != "" &&
                        (signed ~ /debian-archive-keyring/ || uris ~ /debian/)) {
                        print "Types: deb-src"; print "URIs: " uris; print "Suites: " suites
                        print "Components: " (comps == "" ? "main" : comps)
                        if (signed != "") print "Signed-By: " signed
                        print ""
                    }
                    types = uris = suites = comps = signed = enabled = ""
                }
                /^[ \t]*$/ { flush(); next }
                /^[ \t]*#/ { next }
                {
                    key = tolower($1); sub(/:$/, "", key)
                    val = $0; sub(/^[^:]*:[ \t]*/, "", val)
                    if (key == "types") types = val
                    else if (key == "uris") uris = val
                    else if (key == "suites") suites = val
                    else if (key == "components") comps = val
                    else if (key == "signed-by") signed = val
                    else if (key == "enabled") enabled = tolower(val)
                }
                END { flush() }
            ' "$f"
        done
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [[ -f $f ]] || continue
            # deb [options] URI suite components...
            awk '
                $1 != "deb" { next }
                {
                    signed = ""; i = 2
                    if ($2 ~ /^\[/) {
                        while (i <= NF) {
                            opt = $i; gsub(/[\[\]]/, "", opt)
                            if (opt ~ /^signed-by=/) { signed = opt; sub(/^signed-by=/, "", signed) }
                            if ($i ~ /\]$/) { i++; break }
                            i++
                        }
                    }
                    if ($i !~ /debian/ && signed !~ /debian-archive-keyring/) next
                    comps = ""
                    for (j = i + 2; j <= NF; j++) comps = comps (comps == "" ? "" : " ") $j
                    print "Types: deb-src"; print "URIs: " $i; print "Suites: " $(i + 1)
                    print "Components: " (comps == "" ? "main" : comps)
                    if (signed != "") print "Signed-By: " signed
                    print ""
                }
            ' "$f"
        done
    } >"$tmp"
    if [[ ! -s $tmp ]]; then
        local codename
        # shellcheck disable=SC1091
        codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
        [[ -n $codename ]] || die "found no Debian deb entry to mirror as deb-src"
        printf '%s\n' "Types: deb-src" "URIs: http://deb.debian.org/debian" \
            "Suites: $codename $codename-updates" "Components: main" \
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" >"$tmp"
    fi
    chmod 644 "$tmp"
    mv "$tmp" "$out"
    log "added $out:"
    sed 's/^/    /' "$out"
}

# The orig tarball of Debian's `kubernetes` source package, as "name sha256", from apt's index.
orig_tarball() {
    apt-get source --print-uris -q kubernetes 2>/dev/null |
        awk '$2 ~ /^kubernetes_.*\.orig\.tar\.[a-z0-9]+$/ {
                 sum = $4; sub(/^SHA256:/, "", sum); print $2, sum; exit
             }'
}

download=$cache/download
mkdir -p "$download"
read -r tarball sum < <(orig_tarball) || true
if [[ -z ${tarball:-} ]]; then
    [[ $(id -u) -eq 0 ]] || die "apt knows no source package 'kubernetes': add a deb-src entry \
for the Debian archive and run apt-get update (or run this script as root, which does both)"
    [[ -e /etc/apt/sources.list.d/pluglet-deb-src.sources ]] || write_deb_src
    apt-get update -q
    read -r tarball sum < <(orig_tarball) || true
    [[ -n ${tarball:-} ]] || die "apt-get source finds no source package 'kubernetes'"
fi

# apt-get source skips files already in $download whose checksums match.
if [[ ! -f $download/$tarball ]] || ! sha256sum --quiet -c <<<"$sum  $download/$tarball" 2>/dev/null; then
    log "downloading the source package kubernetes ($tarball)"
    if ! (cd "$download" && apt-get source --download-only -q kubernetes); then
        # Stale package lists name a version the archive no longer has: refresh and retry.
        [[ $(id -u) -eq 0 ]] || die "apt-get source --download-only kubernetes failed"
        apt-get update -q
        read -r tarball sum < <(orig_tarball) || true
        [[ -n ${tarball:-} ]] || die "apt-get source finds no source package 'kubernetes'"
        (cd "$download" && apt-get source --download-only -q kubernetes)
    fi
fi
actual=$(sha256sum "$download/$tarball" | cut -d' ' -f1)
[[ $actual == "$sum" ]] || die "$download/$tarball: sha256 $actual, apt's index says $sum"

dir=$cache/$sum
bin=$dir/kube-apiserver
if [[ -x $bin ]]; then
    echo "$sum" >"$cache/current.tmp" && mv -f "$cache/current.tmp" "$cache/current"
    echo "$bin" >&3
    exit 0
fi

# The upstream version, from `kubernetes_1.20.5+really1.20.2.orig.tar.gz` -> 1.20.2.
version=${tarball#kubernetes_}
version=${version%.orig.tar.*}
version=${version##*really}
version=${version%%[-~+]*}
[[ $version =~ ^([0-9]+)\.([0-9]+)\.[0-9]+$ ]] || die "cannot read a version from $tarball"
major=${BASH_REMATCH[1]} minor=${BASH_REMATCH[2]}

# The work tree (source, GOPATH, Go build cache: about 2 GB) lives in the cache dir, never in the
# repository, and is removed however this run ends; only the binary is kept.
work=$cache/work
rm -rf "$work"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src" "$work/gocache"
log "unpacking $tarball"
tar -xf "$download/$tarball" -C "$work/src"
src=$(dirname "$(find "$work/src" -maxdepth 3 -path '*/cmd/kube-apiserver' -type d | head -n1)")
src=${src%/cmd}
[[ -f $src/Makefile ]] || die "no Kubernetes tree with cmd/kube-apiserver in $tarball"

# The vendored reflect2 v1.0.1 mishandles maps under Go >= 1.18; Debian's v1.0.2 fixes that.
reflect2=$src/vendor/github.com/modern-go/reflect2
rm -rf "$reflect2"
mkdir -p "$reflect2"
find /usr/share/gocode/src/github.com/modern-go/reflect2 -maxdepth 1 -type f \
    \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' -exec cp -L {} "$reflect2/" \;

# No git here: stamp the version `kube-apiserver --version` and /version report.
cat >"$work/version" <<EOF
KUBE_GIT_VERSION='v$version'
KUBE_GIT_MAJOR='$major'
KUBE_GIT_MINOR='$minor'
KUBE_GIT_TREE_STATE='clean'
KUBE_GIT_COMMIT=''
EOF

log "building kube-apiserver v$version (takes minutes; log follows)"
start=$SECONDS
(
    cd "$src"
    export PATH=/usr/lib/go-1.19/bin:$PATH GOTOOLCHAIN=local GOPROXY=off CGO_ENABLED=0 \
        GOFLAGS='' GOCACHE=$work/gocache GOENV=off \
        KUBE_GIT_VERSION_FILE=$work/version
    make WHAT=cmd/kube-apiserver 3>&-
)
built=$src/_output/bin/kube-apiserver
[[ -x $built ]] || die "the build finished without $built"
"$built" --version

mkdir -p "$dir"
cp -L "$built" "$dir/kube-apiserver.tmp.$$"
mv -f "$dir/kube-apiserver.tmp.$$" "$bin"
echo "$sum" >"$cache/current.tmp" && mv -f "$cache/current.tmp" "$cache/current"
log "built $bin in $((SECONDS - start)) s"
echo "$bin" >&3
