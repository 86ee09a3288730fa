#!/usr/bin/env bash
# Every fuzz target for FLOTILLA_FUZZ_SECONDS (default 60) each, from the committed
# corpus; new inputs go to a scratch directory, crashes to fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${FLOTILLA_FUZZ_SECONDS:-60}"
cache="$HOME/.cache/flotilla"
export PATH="$cache/tools/cargo-fuzz/bin:$PATH"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked --root "$cache/tools/cargo-fuzz"
fi
export CARGO_TARGET_DIR="$cache/fuzz-target"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
for target in render agent_message; do
  mkdir -p "$scratch/$target" "fuzz/corpus/$target"
  echo "==> fuzz $target for ${seconds}s"
  cargo +nightly fuzz run --fuzz-dir fuzz "$target" "$scratch/$target" "fuzz/corpus/$target" \
    -- -max_total_time="$seconds" -print_final_stats=1 2>&1 | tail -n 40
done
