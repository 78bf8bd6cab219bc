# Run with viotrace-vm run (see README.md here); each result is a RESULT line on the console (also appended to lab-out/results.txt).
set -e
fio --name=prep --filename=/data/bench.dat --size=128M --rw=write --bs=1M --direct=1 --output=/dev/null
run() {
  fio --name=$1 --filename=/data/bench.dat --size=128M --direct=1 --rw=randread --bs=4k \
    --ioengine=libaio --iodepth=32 --runtime=4 --time_based --output-format=terse \
    --output=/out/$1.terse >/dev/null
  echo "RESULT $1 $(cut -d';' -f8 /out/$1.terse)" | tee -a /out/results.txt
}
waitfor() { i=0; until eval "$1"; do i=$((i+1)); [ $i -gt 2400 ] && { echo "timeout $2"; exit 1; }; sleep 0.1; done; }
agent() {
  n=$1; shift
  rm -f /run/g.ready
  viotrace-guest --ready-file /run/g.ready "$@" >/out/g-$n.out 2>/out/g-$n.log &
  echo $! > /run/g.pid
  waitfor "[ -e /run/g.ready ]" $n
  run $n
  kill -INT $(cat /run/g.pid); wait $(cat /run/g.pid) || true
}
anchor() {
  bpftrace -e 'tracepoint:block:block_rq_issue { @s[args->dev, args->sector] = nsecs; } tracepoint:block:block_rq_complete /@s[args->dev, args->sector]/ { @usecs = hist((nsecs - @s[args->dev, args->sector]) / 1000); delete(@s[args->dev, args->sector]); }' > /out/bt-$1.out 2>&1 &
  echo $! > /run/bt.pid
  waitfor "grep -q Attaching /out/bt-$1.out" $1
  run $1
  kill -INT $(cat /run/bt.pid); wait $(cat /run/bt.pid) || true
}
c_none() { run none-$1; }
c_def() { agent def-$1; }
c_systp() { agent systp-$1 --syscall-tracepoints; }
c_tp() { agent tp-$1 --mode tracepoint; }
c_anchor() { anchor anchor-$1; }
set -- none def systp tp anchor
for r in 1 2 3 4; do
  for c in "$@"; do c_$c $r; done
  first=$1; shift; set -- "$@" $first
done
