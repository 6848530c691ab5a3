#!/bin/sh
# One call on a many-core (AMX) host: build the CPU code, run the kernel
# tests (the AMX tiles against their scalar model), then `moeaudit bench`
# at all cores and at 2, logs to $OUT (or ./cpu-host-out; 7 files).
#   sh bench/cpu_host_run.sh
# Steps are bounded by `timeout` so that the logs come back whatever hangs.
set -u
OUT=${OUT:-./cpu-host-out}
mkdir -p "$OUT"
NP=$(nproc)
{
    echo "== host"; date -u; uname -r; nproc
    lscpu
    grep -o -w 'amx_[a-z0-9]*\|avx512_bf16\|avx512vbmi' /proc/cpuinfo | sort | uniq -c
    free -g
    command -v numactl >/dev/null && numactl -H
    ls /sys/devices/system/node/ | grep node
    gcc --version | head -1
} > "$OUT/host.txt" 2>&1
echo "== build"
cmake -S . -B build-host -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build.log" 2>&1 &&
    timeout 120 cmake --build build-host -j"$NP" --target moeaudit-cli test-kernels >> "$OUT/build.log" 2>&1
rc=$?
tail -3 "$OUT/build.log"
[ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
echo "== test-kernels"
timeout 60 ./build-host/test-kernels > "$OUT/test-kernels.log" 2>&1
echo "test-kernels rc $?"
grep -E "FAIL|amx|passed|note" "$OUT/test-kernels.log" | head -40
B=./build-host/moeaudit
echo "== bench, $NP threads"
timeout 60 $B bench --weights mxfp4 --act f32,bf16 --tokens 1,16,128,1024,4096 --isa amx \
    > "$OUT/bench-all-amx.log" 2>&1
grep -E "^read|act " "$OUT/bench-all-amx.log"
timeout 30 $B bench --weights mxfp4 --act bf16 --tokens 1,16,128,1024,4096 --isa avx512 \
    > "$OUT/bench-all-avx512.log" 2>&1
grep -E "^read|act " "$OUT/bench-all-avx512.log"
TS="taskset -c 0,1"
command -v taskset >/dev/null || TS=""
echo "== bench, 2 threads (${TS:-no taskset: unpinned})"
OMP_NUM_THREADS=2 timeout 45 $TS $B bench --weights mxfp4 --act f32,bf16 --tokens 1,16,128,4096 --isa amx \
    > "$OUT/bench-2-amx.log" 2>&1
grep -E "^read|act " "$OUT/bench-2-amx.log"
OMP_NUM_THREADS=2 timeout 20 $TS $B bench --weights mxfp4 --act bf16 --tokens 1,16,128 --isa avx512 \
    > "$OUT/bench-2-avx512.log" 2>&1
grep -E "^read|act " "$OUT/bench-2-avx512.log"
echo "== done"
