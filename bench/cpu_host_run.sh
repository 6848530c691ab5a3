#!/bin/sh
# One call on a many-core (AMX) host: build the CPU code, run the kernel
# tests (the AMX tiles against their scalar model), then `moeaudit bench`
# at all cores and at 2, logs to $OUT (or ./cpu-host-out; at most 8 files).
#   sh bench/cpu_host_run.sh            full tables
#   QUICK=1 sh bench/cpu_host_run.sh    the tests, the bf16 AMX rows, and the
#                                       f32 T=1 row with the weight prefetches
#                                       into L1 (T0, the default) and into L2
#                                       (T1, a second build) side by side
# Steps are bounded by `timeout` so that the logs come back whatever hangs.
set -u
OUT=${OUT:-./cpu-host-out}
QUICK=${QUICK:-0}
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
if [ "$QUICK" = 1 ]; then
    cmake -S . -B build-host-t1 -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS=-DMOE_PF_HINT=_MM_HINT_T1 \
        >> "$OUT/build.log" 2>&1
    (timeout 150 cmake --build build-host-t1 -j"$NP" --target moeaudit-cli > "$OUT/build-t1.log" 2>&1) &
fi
timeout 150 cmake --build build-host -j"$NP" --target moeaudit-cli test-kernels test-amx-emu >> "$OUT/build.log" 2>&1
rc=$?
wait
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
if [ "$QUICK" = 1 ]; then
    echo "== bench, $NP threads: bf16 AMX rows"
    timeout 40 $B bench --weights mxfp4 --act bf16 --tokens 1,16,128,4096 --isa amx > "$OUT/bench-amx.log" 2>&1
    grep -E "^read|act " "$OUT/bench-amx.log"
    for t in $NP 2; do
        for v in build-host build-host-t1; do
            echo "== f32 T=1, $t threads, $v"
            if [ "$t" = 2 ]; then
                OMP_NUM_THREADS=2 timeout 25 $TS ./$v/moeaudit bench --weights mxfp4 --tokens 1 --experts 128 >> "$OUT/bench-pf.log" 2>&1
            else
                timeout 25 ./$v/moeaudit bench --weights mxfp4 --tokens 1 --experts 128 >> "$OUT/bench-pf.log" 2>&1
            fi
            tail -6 "$OUT/bench-pf.log" | grep -E "act f32"
        done
    done
    echo "== done"
    exit 0
fi
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
echo "== done"
