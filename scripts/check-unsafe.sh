#!/usr/bin/env bash
# Unsafe policy: `unsafe` only under ffi/ and kernels/; every other crate
# root says #![forbid(unsafe_code)] so the compiler enforces it. (Inside
# ffi/, clippy's undocumented_unsafe_blocks = deny demands a SAFETY comment.)
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
while IFS= read -r root; do
    case "$root" in ffi/*|kernels/*) continue ;; esac
    if ! grep -q '^#!\[forbid(unsafe_code)\]' "$root"; then
        echo "check-unsafe: $root lacks #![forbid(unsafe_code)]" >&2
        fail=1
    fi
done < <(find . -name target -prune -o \( -path '*/src/lib.rs' -o -path '*/src/main.rs' -o -path '*/src/bin/*.rs' \) -print | sed 's|^\./||')
if grep -rn --include='*.rs' -E '\bunsafe\s*(\{|fn|impl)' --exclude-dir=target . | grep -v -E '^\./(ffi|kernels)/' ; then
    echo "check-unsafe: unsafe code outside ffi/ and kernels/" >&2
    fail=1
fi
exit $fail
