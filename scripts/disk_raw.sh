#!/bin/bash
# Raw read bandwidth of the disk under $1 (default /tmp/diskraw), to set the disk tier's figures
# against: 16 files of 64 MiB written and fsynced, dropped from the page cache, then read cold by
# dd, one stream (bs=4M) and 16 at once; then read again warm. Page cache dropped with
# `echo 3 > /proc/sys/vm/drop_caches` where allowed (root), else posix_fadvise(DONTNEED) per file.
set -uo pipefail
D=${1:-/tmp/diskraw}; mkdir -p "$D"
df -h "$D" | tail -1
for i in $(seq 0 15); do dd if=/dev/urandom of="$D/f$i" bs=4M count=16 conv=fsync status=none; done
drop() {
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null ||
    python3 -c "import os,sys
for p in sys.argv[1:]:
    fd=os.open(p,os.O_RDONLY); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED); os.close(fd)" "$D"/f*
}
rate() { python3 -c "import sys; print(f'{$1/($3-$2)/1e9:.2f} GB/s')"; }
drop; t0=$(date +%s.%N); dd if="$D/f0" of=/dev/null bs=4M status=none; t1=$(date +%s.%N)
echo "cold, 1 stream, 64 MiB: $(rate 67108864 $t0 $t1)"
drop; t0=$(date +%s.%N); for i in $(seq 0 15); do dd if="$D/f$i" of=/dev/null bs=4M status=none & done; wait; t1=$(date +%s.%N)
echo "cold, 16 streams, 1 GiB: $(rate 1073741824 $t0 $t1)"
t0=$(date +%s.%N); for i in $(seq 0 15); do dd if="$D/f$i" of=/dev/null bs=4M status=none & done; wait; t1=$(date +%s.%N)
echo "warm (page cache), 16 streams, 1 GiB: $(rate 1073741824 $t0 $t1)"
rm -rf "$D"
