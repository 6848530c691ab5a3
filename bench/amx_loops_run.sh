#!/bin/sh
# Issue #18 on the AMX Xeon, one device call (fourteenth session; results in
# docs/performance.md, "Issue #18, fourteenth session"). Logs to $OUT (or
# ./amx-loops-out); carry .cjson (the device image lacks libcjson).
#   CALL=1 sh bench/amx_loops_run.sh   the tile loop alone (moe-amx-parts --loops)
#                                      at all threads and at 2 pinned, then the
#                                      official rows: f32 and bf16 at T = 1, 16,
#                                      128, 4096 twice at all threads, f32 at T = 1,
#                                      16, 128 at 2 pinned threads
#   CALL=2 sh bench/amx_loops_run.sh   test-amx-emu, then the kernel builds v8,
#                                      v14, v15 side by side (moe-amx-parts, the
#                                      claimed chunks twice) at all threads and
#                                      at 2 pinned
#   CALL=3 sh bench/amx_loops_run.sh   (call 3, at 13b049b, where MOE_AMX_BSTREAM
#                                      was 0 by default; from 0a50056 on both
#                                      of its builds have it: use CALL=4)
#                                      the B tiles by TILELOADDT1: the tile loop
#                                      (--loops, one round), the builds v8, v16,
#                                      v17 side by side at all threads, then a
#                                      second library build with MOE_AMX_BSTREAM=1:
#                                      its test-kernels (the tiles against
#                                      amx_model on the hardware) and the official
#                                      bf16 T = 4096 row, both builds alternated
#   CALL=4 sh bench/amx_loops_run.sh   with TILELOADDT1 the default: test-kernels,
#                                      the block with the builds v8, v16, v18,
#                                      v19, v20 at all threads, the
#                                      official bf16 T = 4096 row alternated with
#                                      a build of MOE_AMX_BSTREAM=0, and at 2
#                                      pinned threads
set -u
OUT=${OUT:-./amx-loops-out}
mkdir -p "$OUT"
. bench/cjson_env.sh
NP=$(nproc)
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
{ date -u; nproc; lscpu | grep -E "Model name|MHz|L1d|L2|L3|Thread|Core"; uptime; } > "$OUT/host.txt" 2>&1
cmake -S . -B build-host -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build.txt" 2>&1 &&
    timeout 200 cmake --build build-host -j"$NP" --target moeaudit-cli moe-amx-parts test-amx-emu >> "$OUT/build.txt" 2>&1 ||
    { tail -30 "$OUT/build.txt"; exit 1; }
echo "built at $(el) s"
B=./build-host
# A second library build in $1 with MOE_AMX_BSTREAM=$2, targets $3...
second_build() {
    d=$1 v=$2
    shift 2
    cmake -S . -B "$d" -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS=-DMOE_AMX_BSTREAM="$v" \
        > "$OUT/$d.txt" 2>&1 && timeout 200 cmake --build "$d" -j"$NP" --target "$@" >> "$OUT/$d.txt" 2>&1 ||
        { tail -30 "$OUT/$d.txt"; return 1; }
}
# The official bf16 T = 4096 row at all threads, the default build and build
# $1 alternated, twice
ab_rows() {
    for r in 1 2; do
        for b in build-host "$1"; do
            echo "== $b, run $r (t=$(el))"
            timeout 60 ./$b/moeaudit bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx
        done
    done
}
if [ "${CALL:-1}" = 1 ]; then
    {
        echo "== loops, $NP threads (t=$(el))"; timeout 60 $B/moe-amx-parts --loops --iters 2
        echo "== loops, 2 pinned (t=$(el))"; OMP_NUM_THREADS=2 taskset -c 0,1 timeout 40 $B/moe-amx-parts --loops --iters 2
        uptime
    } > "$OUT/loops.txt" 2>&1
    echo "loops at $(el) s"
    {
        for r in 1 2; do
            echo "== bench $NP threads, run $r (t=$(el))"
            timeout 100 $B/moeaudit bench --weights mxfp4 --act f32,bf16 --tokens 1,16,128,4096 --isa amx
            [ $r = 1 ] || continue
            echo "== bench 2 pinned (t=$(el))"
            OMP_NUM_THREADS=2 taskset -c 0,1 timeout 60 $B/moeaudit bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa amx --threads 2
        done
        uptime
    } > "$OUT/bench.txt" 2>&1
    echo "bench at $(el) s"
elif [ "$CALL" = 4 ]; then
    second_build build-b0 0 moeaudit-cli &&
        timeout 200 cmake --build build-host -j"$NP" --target test-kernels >> "$OUT/build.txt" 2>&1 ||
        { tail -30 "$OUT/build.txt"; exit 1; }
    echo "second build at $(el) s"
    timeout 90 $B/test-kernels > "$OUT/test-kernels.txt" 2>&1
    echo "test-kernels rc $? at $(el) s: $(tail -1 "$OUT/test-kernels.txt")"
    {
        echo "== $NP threads (t=$(el))"; timeout 150 $B/moe-amx-parts --block-only --builds v8,v16,v18,v19,v20 --drivers claim,claim
        uptime
    } > "$OUT/parts.txt" 2>&1
    echo "parts at $(el) s"
    {
        ab_rows build-b0
        echo "== build-host, 2 pinned (t=$(el))"
        OMP_NUM_THREADS=2 taskset -c 0,1 timeout 60 $B/moeaudit bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx --threads 2 --iters 2
        uptime
    } > "$OUT/bench.txt" 2>&1
    echo "bench at $(el) s"
elif [ "$CALL" = 3 ]; then
    second_build build-bs 1 moeaudit-cli test-kernels || exit 1
    echo "bstream build at $(el) s"
    timeout 90 ./build-bs/test-kernels > "$OUT/test-kernels-bs.txt" 2>&1
    echo "test-kernels (bstream) rc $? at $(el) s: $(tail -1 "$OUT/test-kernels-bs.txt")"
    {
        echo "== loops, $NP threads (t=$(el))"; timeout 40 $B/moe-amx-parts --loops --iters 1
        echo "== $NP threads (t=$(el))"; timeout 150 $B/moe-amx-parts --builds v8,v16,v17 --drivers claim,claim
        uptime
    } > "$OUT/parts.txt" 2>&1
    echo "parts at $(el) s"
    {
        ab_rows build-bs
        uptime
    } > "$OUT/bench.txt" 2>&1
    echo "bench at $(el) s"
else
    timeout 60 $B/test-amx-emu > "$OUT/emu.txt" 2>&1
    echo "test-amx-emu rc $? at $(el) s: $(tail -1 "$OUT/emu.txt")"
    {
        echo "== $NP threads (t=$(el))"; timeout 150 $B/moe-amx-parts --builds v8,v14,v15 --drivers claim,claim
        echo "== 2 pinned (t=$(el))"
        OMP_NUM_THREADS=2 taskset -c 0,1 timeout 100 $B/moe-amx-parts --block-only --iters 2 --builds v8,v14,v15 --drivers claim,claim
        uptime
    } > "$OUT/parts.txt" 2>&1
    echo "parts at $(el) s"
fi
