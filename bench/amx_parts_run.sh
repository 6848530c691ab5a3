#!/bin/sh
# Issue #18 on the AMX Xeon, one device call: where the AMX bf16 experts'
# time goes (bench/amx_parts.c: peaks by thread count, the kernel's parts,
# the block with each build of the kernel) at all threads and at 2 pinned
# threads, and the official `moeaudit bench` rows. Logs to $OUT (or
# ./amx-parts-out; at most 7 files). Results: docs/performance.md, "Intel
# Xeon, runs E and F".
#
#   sh bench/amx_parts_run.sh          # run E: the breakdown and the A/B of
#                                      # every build, then the bf16 T = 4096 row
#   FULL=1 BUILDS=v0,v5,v6,v7,nd sh bench/amx_parts_run.sh
#                                      # run F: first test-kernels and
#                                      # test-amx-emu, then the breakdown for
#                                      # BUILDS, the bf16 T = 4096 rows at all
#                                      # and 2 threads, the f32 T = 1, 16, 128 rows
set -u
OUT=${OUT:-./amx-parts-out}
mkdir -p "$OUT"
NP=$(nproc)
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
FULL=${FULL:-0}
SEL=
[ -n "${BUILDS:-}" ] && SEL="--builds $BUILDS"
{
    echo "== host"; date -u; nproc; lscpu | head -30; lscpu -e | head -20
    grep -o -w 'amx_[a-z0-9]*\|avx512_bf16' /proc/cpuinfo | sort | uniq -c
    gcc --version | head -1; uptime
} > "$OUT/host.txt" 2>&1
cmake -S . -B build -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build.txt" 2>&1 &&
    cmake --build build -j"$NP" --target moeaudit-cli moe-amx-parts test-kernels test-amx-emu >> "$OUT/build.txt" 2>&1 ||
    { echo "build failed"; tail -40 "$OUT/build.txt"; exit 1; }
echo "built at $(el) s"
if [ "$FULL" = 1 ]; then
    { timeout 60 ./build/test-kernels 2>&1 | tail -30; timeout 30 ./build/test-amx-emu 2>&1 | tail -4; } > "$OUT/tests.txt" 2>&1
    echo "tests at $(el) s"
fi
{
    if [ "$FULL" = 1 ]; then
        echo "== peaks, OMP_PROC_BIND=close (t=$(el))"
        OMP_NUM_THREADS=$NP OMP_PLACES=cores OMP_PROC_BIND=close timeout 30 ./build/moe-amx-parts --peaks-only
        echo "== all threads, unbound as the bench (t=$(el))"
        OMP_NUM_THREADS=$NP timeout 60 ./build/moe-amx-parts $SEL
    else
        echo "== peaks, OMP_PROC_BIND=spread (t=$(el))"
        OMP_NUM_THREADS=$NP OMP_PLACES=cores OMP_PROC_BIND=spread timeout 30 ./build/moe-amx-parts --peaks-only
        echo "== all threads, OMP_PROC_BIND=close (t=$(el))"
        OMP_NUM_THREADS=$NP OMP_PLACES=cores OMP_PROC_BIND=close timeout 70 ./build/moe-amx-parts $SEL
    fi
    echo "== 2 threads, taskset -c 0,1 (t=$(el))"
    OMP_NUM_THREADS=2 taskset -c 0,1 timeout 60 ./build/moe-amx-parts --iters 2 $SEL
    echo "== done (t=$(el))"; uptime
} > "$OUT/parts.txt" 2>&1
echo "parts at $(el) s"
{
    echo "== bench amx bf16 T=4096, $NP threads (t=$(el))"
    timeout 40 ./build/moeaudit bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx
    if [ "$FULL" = 1 ]; then
        echo "== bench amx bf16 T=4096, 2 threads (t=$(el))"
        OMP_NUM_THREADS=2 taskset -c 0,1 timeout 40 ./build/moeaudit bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx --iters 2
    fi
    echo "== done (t=$(el))"
} > "$OUT/bench.txt" 2>&1
echo "bench at $(el) s"
if [ "$FULL" = 1 ]; then
    {
        timeout 40 ./build/moeaudit bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512
        OMP_NUM_THREADS=2 taskset -c 0,1 timeout 40 ./build/moeaudit bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512
    } > "$OUT/bench_f32.txt" 2>&1
    echo "f32 benches at $(el) s"
fi
