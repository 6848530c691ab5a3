#!/bin/sh
# Issue #18 A/B on a many-core host, one device call: the experts' work split
# and the paired E2M1 decode of the AVX-512 f32 kernels, against the code
# before them, in the same run. Logs to $OUT (or ./cpu-ab-out; 7 files).
#
#   OLD_EXPERTS_FAST=<experts_fast.c before the split> sh bench/cpu_split_ab.sh
#
# Three builds (RelWithDebInfo, no CUDA):
#   new     this tree
#   nopair  this tree with -DMOE_AVX512_E2M1_PAIR=0: the new split, the
#           single-chunk E2M1 steps (the kernels as before)
#   old     a copy of this tree (without tests/data) whose
#           src/experts/experts_fast.c is $OLD_EXPERTS_FAST, built with
#           -DMOE_AVX512_E2M1_PAIR=0: the split and the kernels as before
# (the three give the same bits: test-kernels checks every thread count of
# the split, and the paired tiles against a single-step build of the same
# kernels, test_avx512_pairs). Results of 2026-12-01: docs/performance.md,
# "Intel Xeon, run D".
# Then test-kernels (the AMX tiles against their model, the routed block on
# 1/2/3/16 threads) and test-amx-emu on `new`; then the benches interleaved
# old, nopair, new, twice if time allows: all threads and 2 pinned threads,
# MXFP4 f32 T = 1, 16, 128 (avx512 kernels); bf16 T = 4096 on the AMX tiles
# (old and new, all threads; new at 2 threads); and `new` at one thread per
# core (OMP_PLACES=cores) when the host has 2 threads per core.
set -u
OUT=${OUT:-./cpu-ab-out}
OLD=${OLD_EXPERTS_FAST:?set OLD_EXPERTS_FAST to the old src/experts/experts_fast.c}
mkdir -p "$OUT"
NP=$(nproc)
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
{
    echo "== host"; date -u; uname -r; nproc
    lscpu
    lscpu -e
    grep -o -w 'amx_[a-z0-9]*\|avx512_bf16\|avx512vbmi' /proc/cpuinfo | sort | uniq -c
    free -g
    command -v numactl >/dev/null && numactl -H
    gcc --version | head -1
    uptime
} > "$OUT/host.txt" 2>&1
TPC=$(lscpu | awk -F: '/Thread\(s\) per core/ {gsub(/ /, "", $2); print $2}')
echo "== host: $NP cpus, ${TPC:-?} threads per core; load: $(cut -d' ' -f1-3 /proc/loadavg)"

echo "== build ($(el) s)"
rm -rf /tmp/moe-old && mkdir -p /tmp/moe-old
tar --exclude=./tests/data --exclude='./build*' --exclude='./cpu-ab-out' -cf - . | tar -C /tmp/moe-old -xf -
cp "$OLD" /tmp/moe-old/src/experts/experts_fast.c
CF="-DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo"
J=$(( NP / 3 )); [ "$J" -lt 2 ] && J=2
{
    cmake -S . -B build-ab-new $CF &&
    cmake -S . -B build-ab-nopair $CF -DCMAKE_C_FLAGS=-DMOE_AVX512_E2M1_PAIR=0 &&
    cmake -S /tmp/moe-old -B /tmp/moe-old/build $CF -DCMAKE_C_FLAGS=-DMOE_AVX512_E2M1_PAIR=0
} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
(timeout 240 cmake --build build-ab-nopair -j"$J" --target moeaudit-cli > /tmp/moe-build-nopair.log 2>&1; echo "nopair rc $?" >> /tmp/moe-build-nopair.log) &
(timeout 240 cmake --build /tmp/moe-old/build -j"$J" --target moeaudit-cli > /tmp/moe-build-old.log 2>&1; echo "old rc $?" >> /tmp/moe-build-old.log) &
timeout 240 cmake --build build-ab-new -j"$J" --target moeaudit-cli test-kernels test-amx-emu >> "$OUT/build.log" 2>&1
rc=$?
wait
cat /tmp/moe-build-nopair.log /tmp/moe-build-old.log >> "$OUT/build.log"
grep -E "rc |error" "$OUT/build.log" | head -20
[ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
for b in build-ab-new/moeaudit build-ab-nopair/moeaudit /tmp/moe-old/build/moeaudit; do
    [ -x "$b" ] || { echo "missing $b"; exit 1; }
done
echo "== built ($(el) s)"

echo "== tests ($(el) s)"
timeout 150 ./build-ab-new/test-kernels > "$OUT/test-kernels.log" 2>&1
echo "test-kernels rc $?"
grep -E "FAIL|note|amx|block|split|passed" "$OUT/test-kernels.log" | head -30
timeout 60 ./build-ab-new/test-amx-emu >> "$OUT/test-kernels.log" 2>&1
echo "test-amx-emu rc $?"
tail -1 "$OUT/test-kernels.log"

TS="taskset -c 0,1"
command -v taskset >/dev/null || TS=""
bin() { case $1 in old) echo /tmp/moe-old/build/moeaudit ;; nopair) echo ./build-ab-nopair/moeaudit ;; *) echo ./build-ab-new/moeaudit ;; esac; }
# run LABEL LOG THREADS ARGS...: one bench (THREADS: all; N, pinned to CPUs
# 0 and 1 for N = 2; N:free, unpinned), its rows prefixed with LABEL into
# $OUT/summary.txt
run() {
    lab=$1; log=$2; th=$3; shift 3
    echo "== $lab ($(el) s)" >> "$OUT/$log"
    case $th in
    all) timeout 90 "$@" >> "$OUT/$log" 2>&1 ;;
    *:free) OMP_NUM_THREADS=${th%:free} timeout 90 "$@" >> "$OUT/$log" 2>&1 ;;
    *) OMP_NUM_THREADS=$th timeout 90 $TS "$@" >> "$OUT/$log" 2>&1 ;;
    esac
    echo "rc $?" >> "$OUT/$log"
    sed -n "/^== $lab (/,\$p" "$OUT/$log" | grep -E "^read|^load|^  act |^rc [^0]" | sed "s|^|$lab: |" | tee -a "$OUT/summary.txt"
}
F32="bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512"
for round in 1 2; do
    if [ "$round" = 2 ] && [ "$(el)" -gt 230 ]; then echo "== round 2 skipped at $(el) s"; break; fi
    for v in old nopair new; do run "r$round $v $NP-threads" bench-f32.log all $(bin $v) $F32; done
    for v in old nopair new; do run "r$round $v 2-threads" bench-f32.log 2 $(bin $v) $F32; done
    if [ "$round" = 1 ]; then
        for v in old new; do
            run "amx $v $NP-threads" bench-amx.log all $(bin $v) bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx
        done
        run "amx new 2-threads" bench-amx.log 2 $(bin new) bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx
        if [ "${TPC:-1}" -gt 1 ]; then
            C=$(( NP / TPC ))
            export OMP_PLACES=cores OMP_PROC_BIND=spread
            run "new $C-threads-one-per-core" bench-cores.log "$C:free" $(bin new) $F32
            unset OMP_PLACES OMP_PROC_BIND
        fi
    fi
done
echo "== done ($(el) s)"
