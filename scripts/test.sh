#!/usr/bin/env bash
# The test suite: formatting, lints, unit tests and the VM tests in the QEMU lab.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo fmt --all --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo test --workspace --release "$@"
