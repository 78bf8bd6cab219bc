#!/bin/bash
# Live A/B of host agent builds: one joined lab run (fio randread 4k QD32, 60 s,
# both agents, always-on) per binary named, in the order given, then each run's
# host agent CPU per joined I/O, by thread (run time from the lab's
# host-threads.txt: user + system).
#
#   docs/experiments/host-ab.sh OUT BIN_A BIN_B BIN_A BIN_B ...
#
# Alternate the binaries: this machine's speed drifts between runs, and the
# cost per I/O falls as IOPS rise (the main thread's passes get longer).
set -euo pipefail
out=$1; shift
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
wl=$out/workload.sh
cat >"$wl" <<'W'
#!/bin/sh
fio --name=w --filename=/data/bench.dat --size=128M --rw=randread --bs=4k --ioengine=libaio \
  --iodepth=32 --direct=1 --time_based --runtime=60 --output-format=terse >/out/fio.txt 2>&1
W
chmod +x "$wl"
i=0
for bin in "$@"; do
  i=$((i + 1))
  run=$out/run$i
  VIOTRACE_HOST_BIN=$bin "$root/target/release/viotrace-vm" run --workload "$wl" \
    --agents both --guest-tables-only --host-always-on --memory 2048 --timeout 5m \
    --quiet --out "$run" >"$run.log" 2>&1 || { echo "run $i ($bin) failed: $run.log"; continue; }
  python3 - "$run" "$bin" <<'P'
import re, sys
run, binary = sys.argv[1], sys.argv[2]
threads = open(f"{run}/host-threads.txt").read().splitlines()
window = float(re.search(r"\(([0-9.]+) s\)", threads[0]).group(1))
agent = [l.split() for l in threads if l.startswith("host-agent")]
net = sum(float(f[3]) for f in agent if f[1] == "viotrace-net")
main = sum(float(f[3]) for f in agent if f[1] != "viotrace-net")
joined = int(re.findall(r"\bjoined=(\d+)", open(f"{run}/host.jsonl").read())[-1])
us = lambda s: s / joined * 1e6
print(f"{binary}: {joined / window:.0f} IOPS; per joined I/O: main {us(main):.3f} µs, "
      f"net {us(net):.3f} µs, both {us(main + net):.3f} µs")
P
done
