#!/usr/bin/env bash
# Fuzzes Pluglet's parsers with cargo-fuzz (libFuzzer) for a bounded time per target.
#
#   bash scripts/fuzz.sh                 # every target, FUZZ_SECONDS (default 60) each
#   FUZZ_SECONDS=600 bash scripts/fuzz.sh hpack authority
#
# The targets live in fuzz/ (a crate outside the workspace). libFuzzer needs compiler flags that
# only nightly toolchains accept; RUSTC_BOOTSTRAP=1 lets the pinned stable toolchain take them.
# No sanitizer (`-s none`): the workspace denies unsafe code, so what a target can find is a
# panic, an abort, a hang or runaway memory, which libFuzzer catches without AddressSanitizer.
# The corpus grows in fuzz/corpus/<target> (not committed), seeded from fuzz/seeds/<target>;
# a crash leaves its input in fuzz/artifacts/<target>/ and makes this script fail. The same
# parsers get stable-toolchain property tests in the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "installing cargo-fuzz from crates.io"
    cargo install --locked cargo-fuzz
fi
export RUSTC_BOOTSTRAP=1

if (($#)); then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list)
fi

failed=()
for target in "${targets[@]}"; do
    corpus="fuzz/corpus/$target"
    mkdir -p "$corpus"
    seeds=()
    [[ -d "fuzz/seeds/$target" ]] && seeds=("fuzz/seeds/$target")
    echo "== $target: ${seconds} s"
    if ! cargo fuzz run -s none "$target" "$corpus" "${seeds[@]}" -- \
        -max_total_time="$seconds" -print_final_stats=1 -max_len=65536; then
        failed+=("$target")
    fi
done

if ((${#failed[@]})); then
    echo "fuzzing found crashes in: ${failed[*]} (inputs in fuzz/artifacts/)" >&2
    exit 1
fi
echo "fuzzing: ${#targets[@]} targets, ${seconds} s each, no crash"
