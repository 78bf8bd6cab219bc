# Run with viotrace-vm run (see README.md here); each result is a RESULT line on the console (also appended to lab-out/results.txt).
set -e
fio --name=prep --filename=/data/bench.dat --size=128M --rw=write --bs=1M --direct=1 --output=/dev/null
run() {
  fio --name=$1 --filename=/data/bench.dat --size=128M --direct=1 --rw=randread --bs=4k \
    --ioengine=libaio --iodepth=32 --runtime=4 --time_based --output-format=terse \
    --output=/out/$1.terse >/dev/null
  echo "$1 $(cut -d';' -f8 /out/$1.terse)" | tee -a /out/results.txt
}
attach() {
  bpftrace -e "$2" > /out/bt-$1.out 2>&1 &
  echo $! > /run/bt.pid
  i=0; until grep -q Attaching /out/bt-$1.out; do i=$((i+1)); [ $i -gt 1800 ] && { cat /out/bt-$1.out; exit 1; }; sleep 0.1; done
}
detach() { kill -INT $(cat /run/bt.pid); wait $(cat /run/bt.pid) || true; }
FENTRY='kfunc:virtio_queue_rq {} kfunc:virtqueue_add_sgs {} kretfunc:virtqueue_kick_prepare {} kfunc:vring_interrupt {} kfunc:blk_mq_complete_request {} kretfunc:blk_update_request {} kfunc:aio_prep_rw {}'
TP='tracepoint:block:block_rq_issue {} tracepoint:block:block_rq_complete {} tracepoint:block:block_rq_insert {} tracepoint:block:block_bio_queue {} tracepoint:irq:irq_handler_entry {} tracepoint:irq:irq_handler_exit {} tracepoint:block:block_getrq {}'
for r in 1 2 3; do
  run none-$r
  attach fentry-$r "$FENTRY"; run fentry-$r; detach
  attach tp-$r "$TP"; run tp-$r; detach
done
