#!/bin/sh
# Issue #18 A/B on a many-core host, one device call (about 4 minutes on 16
# cores): the avx512 drivers' row spread (row_spread, gemm_avx512.c) against
# adjacent rows, in the same run. Logs to $OUT (or ./cpu-spread-out; 5 files).
#
#   sh bench/cpu_spread_ab.sh
#
# Two builds (RelWithDebInfo, no CUDA): build-host (this tree) and
# build-host-nospread (-DMOE_AVX512_ROW_SPREAD=0); they give the same bits
# (test-kernels' test_row_spread, run here on the first). Then, each build
# in turn: moe-kernel-loop --stream (one avx512 core, then 2 pinned ones,
# streaming MXFP4 from DRAM at n = 1), `moeaudit bench` at 2 pinned threads
# (T = 1, 16, 128) and at all cores (T = 1). Where the image lacks cJSON,
# carry a copy in .cjson/ (as bench/cuda/run.sh).
set -u
OUT=${OUT:-./cpu-spread-out}
mkdir -p "$OUT"
. bench/cjson_env.sh
TS2="taskset -c 0,1" TS1="taskset -c $(( $(nproc) > 2 ? 2 : 1 ))"
command -v taskset >/dev/null || { TS2=""; TS1=""; }
date -u
cmake -S . -B build-host -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build.log" 2>&1
cmake -S . -B build-host-nospread -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_FLAGS=-DMOE_AVX512_ROW_SPREAD=0 >> "$OUT/build.log" 2>&1
(timeout 150 cmake --build build-host -j8 --target moeaudit-cli test-kernels moe-kernel-loop >> "$OUT/build.log" 2>&1) &
(timeout 150 cmake --build build-host-nospread -j8 --target moeaudit-cli moe-kernel-loop > "$OUT/build0.log" 2>&1) &
wait
[ -x build-host/moeaudit ] && [ -x build-host-nospread/moeaudit ] || { tail -20 "$OUT/build.log" "$OUT/build0.log"; exit 1; }
timeout 100 ./build-host/test-kernels > "$OUT/test-kernels.log" 2>&1
echo "test-kernels rc $? $(tail -1 "$OUT/test-kernels.log")"
grep -E "amx: available|row_spread" "$OUT/test-kernels.log"
for d in build-host build-host-nospread; do
    echo "== $d: 2 pinned threads"
    OMP_NUM_THREADS=2 timeout 60 $TS2 ./$d/moeaudit bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512 \
        --threads 2 2>&1 | grep -E "^read|act f32"
done 2>&1 | tee "$OUT/bench-ab.log"
echo "== moe-kernel-loop --stream"
for d in build-host build-host-nospread; do
    OMP_PROC_BIND=true timeout 30 $TS2 ./$d/moe-kernel-loop --rounds 1 --calls 3 --stream 2 | grep "avx512 | mxfp4 [0-9]" | sed "s|^|$d |"
    OMP_PROC_BIND=true timeout 30 $TS1 ./$d/moe-kernel-loop --rounds 1 --calls 3 --stream 1 | grep "avx512 | mxfp4 [0-9]" | sed "s|^|$d |"
done 2>&1 | tee "$OUT/stream-ab.log"
for d in build-host build-host-nospread; do
    echo "== $d: all cores"
    timeout 30 ./$d/moeaudit bench --weights mxfp4 --act f32 --tokens 1 --isa avx512 2>&1 | grep -E "^read|act f32"
done 2>&1 | tee -a "$OUT/bench-ab.log"
date -u
