#!/usr/bin/env bash
# The demo: a QEMU guest with both viotrace agents on a built-in mixed workload, live output.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec cargo run -q --release -p viotrace-vm-tests --bin viotrace-vm -- demo "$@"
