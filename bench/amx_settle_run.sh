#!/bin/sh
# Issue #18 on the AMX Xeon (the H200 machine's host), one device call per
# mode; logs to $OUT (or ./amx-settle-out; at most 6 files). Results:
# docs/performance.md, "Intel Xeon, run H".
#
#   CALL=1 sh bench/amx_settle_run.sh   # run H: the official bf16 T = 4096 row
#       three times at all threads and twice at 2 (taskset -c 0,1), the load
#       average before each; moe-amx-parts' peaks by thread count and the
#       block with the step's split per thread for BUILDS x both drivers
#       (static, claim) at all threads, and BUILDS2 at 2 threads
#   CALL=2 sh bench/amx_settle_run.sh   # run I (docs/performance.md): test-kernels and
#       test-amx-emu, the official bf16 T = 4096 rows (all threads twice, 2
#       threads once), the f32 T = 1, 16, 128 rows (avx512) at all threads and
#       at 2, and the block's split for BUILDS2 at all threads with the drivers
#       alternated (claim, static, claim, static: run H timed every static
#       build before every claim one)
set -u
OUT=${OUT:-./amx-settle-out}
mkdir -p "$OUT"
NP=$(nproc)
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
CALL=${CALL:-1}
BUILDS=${BUILDS:-v5,v6,v8,v10,v12,v13}
BUILDS2=${BUILDS2:-v5,v8}
B=./build/moeaudit
row() { # label, then the command
    l=$1; shift
    echo "== $l (t=$(el) s) load: $(cut -d' ' -f1-3 /proc/loadavg)"
    "$@" 2>&1 | grep -E 'load average|read bandwidth|  act |FLOOR|rror|not available' | cut -c1-240
}
{
    echo "== host"; date -u; nproc; lscpu | grep -E 'Model name|MHz|L2|L3|NUMA|Thread|Core'
    grep -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | sort | uniq -c; gcc --version | head -1; uptime
} > "$OUT/host.txt" 2>&1
TG="moeaudit-cli moe-amx-parts"
[ "$CALL" = 2 ] && TG="$TG test-kernels test-amx-emu"
cmake -S . -B build -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build.txt" 2>&1 &&
    cmake --build build -j"$NP" --target $TG >> "$OUT/build.txt" 2>&1 ||
    { echo "build failed"; grep -E 'error|warning' "$OUT/build.txt" | head -20; exit 1; }
echo "built at $(el) s"
if [ "$CALL" = 2 ]; then
    { timeout 60 ./build/test-kernels 2>&1 | tail -25; timeout 30 ./build/test-amx-emu 2>&1 | tail -3; } > "$OUT/tests.txt" 2>&1
    echo "tests at $(el) s: $(grep -E 'passed' "$OUT/tests.txt" | tr '\n' ' ')"
fi
{
    if [ "$CALL" = 1 ]; then
        for i in 1 2 3; do row "bench bf16 T=4096 amx, $NP threads, run $i" timeout 40 $B bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx; done
        for i in 1 2; do row "bench bf16 T=4096 amx, 2 threads (taskset -c 0,1), run $i" env OMP_NUM_THREADS=2 taskset -c 0,1 timeout 40 $B bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx --iters 2; done
    else
        for i in 1 2; do row "bench bf16 T=4096 amx, $NP threads, run $i" timeout 40 $B bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx; done
        row "bench bf16 T=4096 amx, 2 threads (taskset -c 0,1)" env OMP_NUM_THREADS=2 taskset -c 0,1 timeout 40 $B bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx --iters 2
        row "bench f32 T=1,16,128 avx512, $NP threads" timeout 40 $B bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512
        row "bench f32 T=1,16,128 avx512, 2 threads" env OMP_NUM_THREADS=2 taskset -c 0,1 timeout 40 $B bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512
    fi
    echo "== done (t=$(el) s) load: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$OUT/bench.txt" 2>&1
echo "bench at $(el) s"
{
    echo "== moe-amx-parts, $NP threads, unbound as the bench (t=$(el) s) load: $(cut -d' ' -f1-3 /proc/loadavg)"
    if [ "$CALL" = 1 ]; then
        OMP_NUM_THREADS=$NP timeout 60 ./build/moe-amx-parts --block-only --builds "$BUILDS"
    else
        OMP_NUM_THREADS=$NP timeout 60 ./build/moe-amx-parts --block-only --builds "$BUILDS2" --drivers claim,static,claim,static
    fi
    if [ "$CALL" = 1 ]; then
        echo "== moe-amx-parts, 2 threads, taskset -c 0,1 (t=$(el) s) load: $(cut -d' ' -f1-3 /proc/loadavg)"
        OMP_NUM_THREADS=2 taskset -c 0,1 timeout 45 ./build/moe-amx-parts --block-only --iters 2 --builds "$BUILDS2"
    fi
    echo "== done (t=$(el) s)"
} > "$OUT/parts.txt" 2>&1
echo "parts at $(el) s"
