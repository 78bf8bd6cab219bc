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
bt() {
  n=$1; shift
  bpftrace -e "$1" > /out/bt-$n.out 2>&1 &
  echo $! > /run/bt.pid
  waitfor "grep -q Attaching /out/bt-$n.out" $n
  run $n
  kill -INT $(cat /run/bt.pid); wait $(cat /run/bt.pid) || true
}
F='virtio_queue_rq virtqueue_add_sgs virtqueue_kick_prepare vring_interrupt blk_mq_complete_request blk_update_request aio_prep_rw'
ENTRY=""; EXIT=""
for f in $F; do ENTRY="$ENTRY kfunc:$f {}"; EXIT="$EXIT kretfunc:$f {}"; done
c_none() { run none-$1; }
c_entry() { bt entry-$1 "$ENTRY"; }
c_exit() { bt exit-$1 "$EXIT"; }
set -- none entry exit
for r in 1 2 3 4; do
  for c in "$@"; do c_$c $r; done
  first=$1; shift; set -- "$@" $first
done
