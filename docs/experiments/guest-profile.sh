# A viotrace-vm run workload (see README.md here): where the guest's vCPU goes while fio runs,
# sampled by perf inside the guest (needs `--guest-tool perf`; the host's perf binary works in
# the Debian guests). Writes /out/perf-sym.txt (by symbol), /out/perf-comm.txt (by task and
# object), /out/perf-agent.txt (the guest agent's own symbols) and /out/fio.terse.
# `perf-shares.sh lab-out` (here) sums the symbols by category.
JOB="--rw=randread --bs=4k --ioengine=libaio --iodepth=32"
SECS=20
set -e
fio --name=prep --filename=/data/bench.dat --size=128M --rw=write --bs=1M --direct=1 --output=/dev/null
# kernel and BPF program symbols for perf (the guest is a throw-away VM)
echo 0 >/proc/sys/kernel/kptr_restrict
echo -1 >/proc/sys/kernel/perf_event_paranoid
fio --name=x --filename=/data/bench.dat --size=128M --direct=1 $JOB --runtime=$((SECS + 4)) \
  --time_based --output-format=terse --output=/out/fio.terse &
sleep 2
perf record -a -e cpu-clock -F 1999 -o /tmp/perf.data -- sleep "$SECS" 2>/out/perf-record.log
wait
perf report -i /tmp/perf.data --stdio --sort sym --no-children 2>/dev/null | head -600 >/out/perf-sym.txt
perf report -i /tmp/perf.data --stdio --sort comm,dso --no-children 2>/dev/null | head -60 >/out/perf-comm.txt
perf report -i /tmp/perf.data --stdio --comm viotrace-guest --sort dso,sym --no-children \
  2>/dev/null | head -80 >/out/perf-agent.txt
echo "IOPS $(cut -d';' -f8 /out/fio.terse) (read) $(cut -d';' -f49 /out/fio.terse) (write)"
