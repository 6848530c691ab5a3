#!/bin/sh
# Issue #18, one device call on the AMX Xeon: where the AMX bf16 experts'
# time goes (bench/amx_parts.c: peaks by thread count, the kernel's parts,
# the block with each build of the kernel) at all threads and at 2 pinned
# threads, then the official `moeaudit bench` rows. Logs to $OUT (or
# ./amx-parts-out; at most 6 files).
#
#   sh bench/amx_parts_run.sh            # the breakdown + A/B (about 150 s)
#   FULL=1 sh bench/amx_parts_run.sh     # then test-kernels, test-amx-emu and
#                                        # the bench's f32 T = 1, 16, 128 rows
set -u
OUT=${OUT:-./amx-parts-out}
mkdir -p "$OUT"
NP=$(nproc)
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
{
    echo "== host"; date -u; nproc; lscpu | head -30; lscpu -e | head -20
    grep -o -w 'amx_[a-z0-9]*\|avx512_bf16' /proc/cpuinfo | sort | uniq -c
    gcc --version | head -1; uptime
} > "$OUT/host.txt" 2>&1
cmake -S . -B build -DMOE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$OUT/build.txt" 2>&1 &&
    cmake --build build -j"$NP" --target moeaudit-cli moe-amx-parts test-kernels test-amx-emu >> "$OUT/build.txt" 2>&1 ||
    { echo "build failed"; tail -40 "$OUT/build.txt"; exit 1; }
echo "built at $(el) s"
{
    echo "== peaks, OMP_PROC_BIND=spread (t=$(el))"
    OMP_NUM_THREADS=$NP OMP_PLACES=cores OMP_PROC_BIND=spread timeout 30 ./build/moe-amx-parts --peaks-only
    echo "== all threads, OMP_PROC_BIND=close (t=$(el))"
    OMP_NUM_THREADS=$NP OMP_PLACES=cores OMP_PROC_BIND=close timeout 70 ./build/moe-amx-parts
    echo "== 2 threads, taskset -c 0,1 (t=$(el))"
    OMP_NUM_THREADS=2 taskset -c 0,1 timeout 80 ./build/moe-amx-parts --iters 2
    echo "== done (t=$(el))"; uptime
} > "$OUT/parts.txt" 2>&1
echo "parts at $(el) s"
{
    echo "== bench amx bf16 T=4096, $NP threads (t=$(el))"
    timeout 60 ./build/moeaudit bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx
    if [ "${FULL:-0}" = 1 ]; then
        echo "== bench amx bf16 T=4096, 2 threads (t=$(el))"
        OMP_NUM_THREADS=2 taskset -c 0,1 timeout 60 ./build/moeaudit bench --weights mxfp4 --act bf16 --tokens 4096 --isa amx --iters 2
    fi
    echo "== done (t=$(el))"
} > "$OUT/bench.txt" 2>&1
echo "bench at $(el) s"
if [ "${FULL:-0}" = 1 ]; then
    { ./build/test-kernels 2>&1 | tail -25; ./build/test-amx-emu 2>&1 | tail -5; } > "$OUT/tests.txt" 2>&1
    echo "tests at $(el) s"
    {
        timeout 60 ./build/moeaudit bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512
        OMP_NUM_THREADS=2 taskset -c 0,1 timeout 60 ./build/moeaudit bench --weights mxfp4 --act f32 --tokens 1,16,128 --isa avx512
    } > "$OUT/bench_f32.txt" 2>&1
    echo "f32 benches at $(el) s"
fi
