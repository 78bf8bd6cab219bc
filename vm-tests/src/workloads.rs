//! Built-in guest workloads.

/// The demo's mixed workload: 4 KiB random reads and writes (O_DIRECT), a 128 KiB
/// sequential stream, and buffered writes with fsync — sized for a TCG guest.
pub const DEMO: &str = r#"set -e
echo "== preparing a 64 MiB file"
fio --name=prep --filename=/data/demo.dat --size=64M --rw=write --bs=1M --direct=1 --output-format=terse >/dev/null
echo "== 4 KiB random read, QD1, O_DIRECT"
fio --name=randread --filename=/data/demo.dat --size=64M --rw=randread --bs=4k --direct=1 --ioengine=psync --runtime=5 --time_based --group_reporting | grep -E 'IOPS|clat \(|lat \(' | head -3
echo "== 4 KiB random write, QD4 libaio, O_DIRECT"
fio --name=randwrite --filename=/data/demo.dat --size=64M --rw=randwrite --bs=4k --direct=1 --ioengine=libaio --iodepth=4 --runtime=5 --time_based --group_reporting | grep -E 'IOPS|clat \(|lat \(' | head -3
echo "== 128 KiB sequential read stream"
fio --name=seqread --filename=/data/demo.dat --size=64M --rw=read --bs=128k --direct=1 --ioengine=psync --runtime=4 --time_based --group_reporting | grep -E 'IOPS|clat \(|lat \(' | head -3
echo "== buffered writes with fsync"
fio --name=fsync --filename=/data/fsync.dat --size=8M --rw=write --bs=16k --fsync=8 --ioengine=psync --runtime=4 --time_based --group_reporting | grep -E 'IOPS|sync' | head -3
echo "== demo workload done"
"#;
