#!/bin/sh
# One call on a many-core (AMX) host: build the CPU code, run the kernel
# tests (the AMX tiles against their scalar model), then `moeaudit bench`
# at all cores and at 2, then the single-core kernel loop with its issue
# rates and its rate from DRAM (moe-kernel-loop --ops --stream 1), logs to
# $OUT (or ./cpu-host-out; at most 8 files).
#   sh bench/cpu_host_run.sh            full tables
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
    gcc --version | head -1
} > "$OUT/host.txt" 2>&1
echo "== build"
cmake -S . -B build-host -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build.log" 2>&1
timeout 150 cmake --build build-host -j"$NP" --target moeaudit-cli test-kernels test-amx-emu moe-kernel-loop >> "$OUT/build.log" 2>&1
rc=$?
tail -2 "$OUT/build.log"
[ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
echo "== test-kernels"
timeout 90 ./build-host/test-kernels > "$OUT/test-kernels.log" 2>&1
echo "test-kernels rc $?"
grep -E "FAIL|amx|passed|note|e2m1" "$OUT/test-kernels.log" | head -40
timeout 60 ./build-host/test-amx-emu >> "$OUT/test-kernels.log" 2>&1
echo "test-amx-emu rc $?"
tail -1 "$OUT/test-kernels.log"
B=./build-host/moeaudit
TS="taskset -c 0,1"
command -v taskset >/dev/null || TS=""
# Full tables (issue #18): f32 rows (avx512 kernels under --isa amx) and bf16
# rows (AMX tiles) at all cores for T = 1, 16, 128, 4096; the AVX2 table on
# this Intel core (MOE_ISA=avx2: the AVX2 kernels as an AVX2-only Intel CPU
# runs them); then the same at 2 pinned threads (f32 to T = 128, bf16 AMX at
# T = 4096). Each bench prints its load average before and after.
echo "== bench, $NP threads"
timeout 70 $B bench --weights mxfp4 --act f32,bf16 --tokens 1,16,128,4096 --isa amx \
    > "$OUT/bench-all-amx.log" 2>&1
grep -E "^read|^load|act " "$OUT/bench-all-amx.log"
echo "== bench, 2 threads (${TS:-no taskset: unpinned})"
OMP_NUM_THREADS=2 timeout 45 $TS $B bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa amx \
    > "$OUT/bench-2-amx.log" 2>&1
OMP_NUM_THREADS=2 timeout 45 $TS $B bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx \
    >> "$OUT/bench-2-amx.log" 2>&1
grep -E "^read|^load|act " "$OUT/bench-2-amx.log"
echo "== bench avx2 table, $NP threads and 2"
timeout 40 $B bench --weights mxfp4 --tokens 1,16,128 --isa avx2 > "$OUT/bench-avx2.log" 2>&1
OMP_NUM_THREADS=2 timeout 45 $TS $B bench --weights mxfp4 --tokens 1,16,128 --isa avx2 >> "$OUT/bench-avx2.log" 2>&1
grep -E "^read|^load|act " "$OUT/bench-avx2.log"
echo "== kernel loop, issue rates and the rate from DRAM, one pinned core"
timeout 60 ${TS:+taskset -c 2} ./build-host/moe-kernel-loop --rounds 3 --calls 100 --ops --stream 1 > "$OUT/kernel-loop.log" 2>&1
grep -E "mxfp4 \| 1 \||mxfp4 [0-9]|ops per|vperm|vfmadd|clock" "$OUT/kernel-loop.log"
echo "== done"
