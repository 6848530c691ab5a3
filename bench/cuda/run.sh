#!/bin/sh
# Build, test and time the GPU block in one call on the device machine
# (docs/performance-cuda.md records what it printed). Logs go to $OUT (or ./out).
#   sh bench/cuda/run.sh [quick|short|gemv|wg|final|last|tma|tma2|cdec|cdec2|qg|qg2|qg3|smallt|smallt2]
#   MOE_CUDA_PREBUILT=DIR: use the binaries in DIR (moeaudit, test-cuda, built
#   elsewhere for sm_90a) instead of configuring and building here; the test
#   binary finds its fixtures at the path it was built in (MOE_TEST_DATA)
#   gemv: after the tests, the FP4 small-T paths side by side
#   short: tests, sanitizer, the audit with GPU rows, T = 1 and 16 for every
#   format (with the peer) and MXFP4 at T = 8192
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
B=build-cuda
# The device image lacks cJSON: a carried copy (.cjson/) when present.
. bench/cjson_env.sh
log() { echo "== $*"; }
# The closing steps of a wgmma call (tma, tma2): racecheck on the kernels'
# self-tests, memcheck on the quick set, the full tests; then exit.
sanitize_then_full_tests() {
    log "racecheck (self-tests), memcheck (quick set)"
    MOE_TEST_CUDA_ONLY=units timeout ${WG_RACE_S:-45} compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/racecheck.log" 2>&1
    echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed" "$OUT/racecheck.log" | tail -3
    MOE_TEST_CUDA_QUICK=1 timeout 60 compute-sanitizer --tool memcheck --leak-check no ./$B/test-cuda >"$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed" "$OUT/memcheck.log" | tail -2
    log "test-cuda full"
    t0=$(date +%s)
    timeout ${WG_TEST_S:-90} ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst" "$OUT/test-cuda.log" | head -20; echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    rm -f "$OUT/gpu.txt" "$OUT/build.log"
    exit 0
}
# The table of a closing wgmma call (tma2, cdec2): AUTO with the torch peer
# (timeout $1 s; bench-auto.json when $2 is "json"), then the new kernel
# (wgmma) and the old one ($3) per T without the peer, appended to
# bench-paths.log.
auto_then_paths() {
    log "AUTO with the torch peer"
    t0=$(date +%s)
    timeout $1 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 1,16,128,1024,4096,8192 \
        ${2:+--json "$OUT/bench-auto.json"} >"$OUT/bench-auto.log" 2>&1; echo "rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^\||PEER|rror|copy bandwidth|peak" "$OUT/bench-auto.log"
    log "new (wgmma) and old ($3) per T, no peer"
    for pth in wgmma $3; do
        echo "-- $pth"
        timeout 60 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 128,1024,4096,8192 \
            --path $pth --no-peer 2>&1 | tee -a "$OUT/bench-paths.log" | grep -E "^  |rror"
    done
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
if [ -n "${MOE_CUDA_PREBUILT:-}" ]; then
    B=$MOE_CUDA_PREBUILT
    log "prebuilt binaries in $B"
    ls -l $B/moeaudit $B/test-cuda || exit 1
else
log configure+build
t0=$(date +%s)
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc) \
    >"$OUT/build.log" 2>&1 &&
cmake --build $B -j16 --target test-cuda moeaudit-cli >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
fi
# Issue 17, seventh session: small T. smallt (first call): the read-only
# floor of the T = 1 step (bench/cuda/smallt_floor.cu, MXFP4 and NVFP4:
# two launches, two with PDL, with down's L2 prefetch, one launch), the
# AUTO table at T = 1, 16, 128 with the torch peer, the same per small-T
# launch without the peer (MOE_CUDA_SMALLT_LAUNCH: plain is the earlier
# launch), ncu on the MXFP4 GEMV kernels at T = 1 and the grouped ones at
# T = 128 (durations, DRAM bytes and throughput, occupancy, issue, stalls),
# the quick tests. smallt2 (closing call): the floor, the table and the A/B
# again, ncu, the full tests, memcheck and racecheck (quick set).
smallt_table() {
    log "AUTO with the torch peer, T = 1, 16, 128"
    t0=$(date +%s)
    timeout ${ST_PEER_S:-100} ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 1,16,128 \
        ${1:+--json "$OUT/bench-auto.json"} >"$OUT/bench-auto.log" 2>&1; echo "rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^\||PEER|rror|copy bandwidth|small-T" "$OUT/bench-auto.log"
    log "per small-T launch, no peer (plain: the earlier launch)"
    for l in ${ST_LAUNCHES:-plain pdl-l2 plain pdl-l2}; do
        echo "-- $l"
        MOE_CUDA_SMALLT_LAUNCH=$l timeout 40 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 \
            --tokens 1,16,128 --no-peer 2>&1 | grep -E "^  |rror"
    done 2>&1 | tee "$OUT/bench-launch.log"
    for l in pdl l2; do
        echo "-- $l"
        MOE_CUDA_SMALLT_LAUNCH=$l timeout 30 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4 --act bf16 \
            --tokens 1,16,128 --no-peer 2>&1 | grep -E "^  |rror"
    done 2>&1 | tee -a "$OUT/bench-launch.log"
}
smallt_ncu() {
    log "ncu: MXFP4 T = 1 (gate/up, down, combine) and T = 128 (grouped gate/up, down)"
    NCU_SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
    NCU_MET="--metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active"
    for tk in 1 128; do
        timeout ${ST_NCU_S:-40} ncu --clock-control none -k regex:'^k_(gateup|down)_(tc|grp)$|^k_combine$' --launch-count 3 \
            $NCU_SEC $NCU_MET ./$B/moeaudit bench --device cuda --weights mxfp4 --tokens $tk --iters 1 --no-peer --no-graphs \
            >>"$OUT/ncu.txt" 2>&1
        echo "ncu T = $tk rc=$?"
    done
    grep -E "^  k_|Duration|DRAM Throughput|dram__bytes_read|sector_hit|Achieved Occupancy|Issue Slots Busy|issue_active|warps_active|Registers Per|Waves Per SM|Block Limit" "$OUT/ncu.txt" | head -90
}
if [ "${1:-}" = smallt ] || [ "${1:-}" = smallt2 ]; then
    rm -f "$OUT/gpu.txt" "$OUT/build.log"
    log "read-only floor of the T = 1 step"
    NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    $NVCC -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/cuda/smallt_floor.cu -o /tmp/smallt_floor &&
        { timeout 30 /tmp/smallt_floor; timeout 30 /tmp/smallt_floor nvfp4; } 2>&1 | tee "$OUT/floor.log"
    if [ "$1" = smallt ]; then
        smallt_table
        smallt_ncu
        # nsys, where the image has it: each graph node's start and end at
        # T = 1 (launch gaps inside the graph)
        NSYS=$(command -v nsys || ls /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -1)
        echo "nsys: ${NSYS:-none}"
        if [ -n "$NSYS" ]; then
            timeout 25 $NSYS profile --cuda-graph-trace=node -o /tmp/st1 -f true ./$B/moeaudit bench --device cuda \
                --weights mxfp4 --tokens 1 --iters 20 --no-peer >/tmp/nsys.log 2>&1; echo "nsys rc=$?"; tail -3 /tmp/nsys.log
            timeout 15 $NSYS stats -r cuda_gpu_trace -f csv -o /tmp/st1 /tmp/st1.nsys-rep >/dev/null 2>&1; echo "nsys stats rc=$?"
            ls /tmp/st1* 2>/dev/null; grep -E "k_gateup_tc|k_down_tc|k_combine" /tmp/st1*.csv 2>/dev/null | tail -60 >"$OUT/nsys-t1.csv"
        fi
        log "test-cuda quick"
        t0=$(date +%s)
        MOE_TEST_CUDA_QUICK=1 timeout ${ST_QUICK_S:-40} ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
        grep -E "FAIL|passed|worst" "$OUT/test-quick.log" | head -20; echo "test-cuda quick rc=$rc ($(( $(date +%s) - t0 )) s)"
        exit 0
    fi
    smallt_table
    log "test-cuda full"
    t0=$(date +%s)
    timeout ${ST_TEST_S:-100} ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst" "$OUT/test-cuda.log" | head -20; echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    log "memcheck, racecheck (quick set)"
    MOE_TEST_CUDA_QUICK=1 timeout ${ST_MEM_S:-60} compute-sanitizer --tool memcheck --leak-check no ./$B/test-cuda >"$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed" "$OUT/memcheck.log" | tail -2
    MOE_TEST_CUDA_QUICK=1 timeout ${ST_RACE_S:-60} compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/racecheck.log" 2>&1
    echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed" "$OUT/racecheck.log" | tail -3
    smallt_ncu
    exit 0
fi
# SASS counts per wgmma kernel (HGMMA, TMA and cp.async issues, local
# memory, named-barrier syncs, register-count changes).
wg_sass_counts() {
    CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    $CUOBJ -sass $B/libmoeaudit_cuda.a 2>/dev/null | awk '/Function : .*k_(wg|qg)/{p=1} /Function : /&&!/k_(wg|qg)/{p=0} p' > "$OUT/wg.sass"
    awk '/Function :/ {f=$3; n[f]=1} /UTMALDG/ {t[f]++} /LDGSTS/ {c[f]++} /HGMMA/ {h[f]++} /QGMMA/ {q[f]++} /LDL|STL/ {l[f]++}
         /BAR.SYNC/ {b[f]++} /SETMAXREG/ {r[f]++}
         END {for (k in n) printf "  %-40s HGMMA %2d QGMMA %2d UTMALDG %d LDGSTS %2d LDL/STL %d BAR.SYNC %d SETMAXREG %d\n", k, h[k], q[k], t[k], c[k], l[k], b[k], r[k]}' \
        "$OUT/wg.sass" | sort
    # WG_SASS_FN: that kernel's tensor-core, barrier, shared-memory and
    # register-count instructions in program order (where the decode sits
    # between a step's HGMMA and its wait)
    if [ -n "${WG_SASS_FN:-}" ]; then
        awk -v f="$WG_SASS_FN" '/Function :/ {p = ($3 == f)} p' "$OUT/wg.sass" |
            grep -nE "HGMMA|QGMMA|WARPGROUP|DEPBAR|BAR\.|SYNCS|LDS|STS|SETMAXREG|UTMALDG|LDGSTS|BRA|EXIT" |
            awk '{$1=$1};1' | cut -c1-110 > "$OUT/sass-excerpt.txt"
        wc -l < "$OUT/sass-excerpt.txt"
    fi
    rm -f "$OUT/wg.sass"
}
# ncu at T = 8192 on the wgmma GEMMs of format $1, path $2, $3 launches
# (1: gate/up; 2: gate/up then down), appended to ncu.txt.
wg_ncu() {
    timeout ${WG_NCU_S:-45} ncu --clock-control none -k regex:"${WG_NCU_K:-^k_wg\$}" --launch-count $3 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy \
        ./$B/moeaudit bench --device cuda --weights $1 --act ${WG_NCU_ACT:-bf16} --tokens 8192 --iters 1 --no-peer --no-graphs \
        --path $2 >>"$OUT/ncu.txt" 2>&1
    echo "ncu $1 $2 rc=$?"
}
if [ "${1:-}" = qg3 ]; then
    # Issue 17, seventh session, after AUTO's FP8 x FP8 crossover moved to
    # T = 8: the full tests, then the AUTO table with the torch peer at
    # every T (fp8 weights, fp8 activations).
    rm -f "$OUT/gpu.txt" "$OUT/build.log"
    log "test-cuda full"
    t0=$(date +%s)
    timeout 150 ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst" "$OUT/test-cuda.log" | head -20; echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    log "AUTO with the torch peer: fp8 weights, fp8 activations, every T"
    timeout 150 ./$B/moeaudit bench --device cuda --weights fp8 --act fp8 --tokens 1,8,16,128,1024,4096,8192 \
        --json "$OUT/bench-auto.json" >"$OUT/bench-auto.log" 2>&1; echo "rc=$?"
    grep -E "^\||PEER|rror|copy bandwidth|operands\)" "$OUT/bench-auto.log"
    exit 0
fi
if [ "${1:-}" = qg2 ]; then
    # Issue 17, seventh session, closing call: the full tests first (after
    # the tolerance of fp8-f32scale), racecheck, memcheck; the small-T
    # crossover of the FP8 x FP8 GEMMs against the GEMV (fp8 weights, fp8
    # activations, T = 8 .. 64); the AUTO table with the torch peer again
    # (the spread against the first call).
    rm -f "$OUT/gpu.txt" "$OUT/build.log"
    log "test-cuda full"
    t0=$(date +%s)
    timeout 150 ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst|QGMMA" "$OUT/test-cuda.log" | head -20; echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    log "racecheck (self-tests), memcheck (quick set)"
    MOE_TEST_CUDA_ONLY=units timeout 90 compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/racecheck.log" 2>&1
    echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed" "$OUT/racecheck.log" | tail -3
    MOE_TEST_CUDA_QUICK=1 timeout 90 compute-sanitizer --tool memcheck --leak-check no ./$B/test-cuda >"$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed" "$OUT/memcheck.log" | tail -2
    log "small-T crossover: gemv against wgmma (FP8 tensor cores), fp8 weights, fp8 activations, no peer"
    for pth in gemv wgmma; do
        echo "-- $pth"
        timeout 60 ./$B/moeaudit bench --device cuda --weights fp8 --act fp8 --tokens 8,16,32,64 --path $pth --no-peer 2>&1 |
            tee -a "$OUT/bench-paths.log" | grep -E "^  |rror"
    done
    log "ncu at T = 8192: the new down launch (k_qg<false>)"
    timeout 60 ncu --clock-control none -k regex:'^k_qg$' --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        ./$B/moeaudit bench --device cuda --weights fp8 --act fp8 --tokens 8192 --iters 1 --no-peer --no-graphs --path wgmma \
        >"$OUT/ncu.txt" 2>&1; echo "ncu rc=$?"
    grep -E "k_qg|Duration|Throughput|Busy|Issue|Eligible|hit|==ERR" "$OUT/ncu.txt" | head -30
    log "AUTO with the torch peer: fp8 weights, fp8 activations (second run)"
    timeout 120 ./$B/moeaudit bench --device cuda --weights fp8 --act fp8 --tokens 128,1024,4096,8192 \
        --json "$OUT/bench-auto.json" >"$OUT/bench-auto.log" 2>&1; echo "rc=$?"
    grep -E "^\||PEER|rror|copy bandwidth|operands\)" "$OUT/bench-auto.log"
    exit 0
fi
if [ "${1:-}" = qg ]; then
    # Issue 17, seventh session: FP8 weights x FP8 activations on the FP8
    # tensor cores (cuda_qgmma.cu, --path wgmma / AUTO) against the
    # bf16-operand kernel (--path wgmma-bf16). SASS counts; the quick tests
    # (self-tests first; on a failure the sanitizers on the self-tests, then
    # stop); AUTO with the torch peer, then new and old per T (fp8 weights,
    # fp8 activations); ncu at T = 8192 on the new gate/up (sections, stall
    # reasons, tensor pipe, shared memory); racecheck, memcheck, the full
    # tests. QG_TOKENS: the T list.
    rm -f "$OUT/gpu.txt" "$OUT/build.log" # printed above; 8 files come back
    wg_sass_counts
    log "test-cuda quick"
    t0=$(date +%s)
    MOE_TEST_CUDA_QUICK=1 timeout 90 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
    grep -E "decoder|GEMM|Y\[|FAIL|passed|worst|qgmma|wgmma |fp8" "$OUT/test-quick.log" | grep -vE ": 0 of [0-9]+ outputs wrong" | head -60
    echo "test-cuda quick rc=$rc ($(( $(date +%s) - t0 )) s)"
    if [ $rc -ne 0 ]; then
        MOE_TEST_CUDA_ONLY=units timeout 60 compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/racecheck.log" 2>&1
        echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed" "$OUT/racecheck.log" | tail -5
        MOE_TEST_CUDA_ONLY=units timeout 60 compute-sanitizer --tool memcheck ./$B/test-cuda >"$OUT/memcheck.log" 2>&1
        echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|passed" "$OUT/memcheck.log" | head -5
        exit 1
    fi
    TL=${QG_TOKENS:-128,1024,4096,8192}
    log "AUTO with the torch peer: fp8 weights, fp8 activations"
    t0=$(date +%s)
    timeout 120 ./$B/moeaudit bench --device cuda --weights fp8 --act fp8 --tokens $TL --json "$OUT/bench-auto.json" \
        >"$OUT/bench-auto.log" 2>&1; echo "rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^\||PEER|rror|copy bandwidth|operands\)" "$OUT/bench-auto.log"
    log "new (wgmma: FP8 tensor cores) and old (wgmma-bf16) per T, no peer"
    for pth in wgmma wgmma-bf16; do
        echo "-- $pth"
        timeout 60 ./$B/moeaudit bench --device cuda --weights fp8 --act fp8 --tokens $TL --path $pth --no-peer 2>&1 |
            tee -a "$OUT/bench-paths.log" | grep -E "^  |rror"
    done
    log "ncu at T = 8192: the new gate/up (k_qg): sections, stall reasons, tensor pipe, shared memory, DRAM, L2"
    timeout ${WG_NCU_S:-60} ncu --clock-control none -k regex:'^k_qg$' --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy \
        --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio,smsp__average_warps_issue_stalled_membar_per_issue_active.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \
        ./$B/moeaudit bench --device cuda --weights fp8 --act fp8 --tokens 8192 --iters 1 --no-peer --no-graphs --path wgmma \
        >"$OUT/ncu.txt" 2>&1; echo "ncu rc=$?"
    grep -E "k_qg|Duration|Throughput|Pipe|Busy|Issue|Eligible|Stall|Bank|Registers|stalled|pipe_tensor|shared|hit_rate|==ERR" "$OUT/ncu.txt" | grep -vE " 0(\.00)?$" | head -90
    WG_RACE_S=${WG_RACE_S:-90} WG_TEST_S=${WG_TEST_S:-150} sanitize_then_full_tests
fi
if [ "${1:-}" = cdec ] || [ "${1:-}" = cdec2 ]; then
    # Issue 17, sixth session: the FP8 / FP4 decode in the consumer
    # warpgroups (--path wgmma) against the producer's decode (wgmma-pd).
    # cdec: SASS counts, the quick tests (self-tests of the three kernels
    # first; on a failure the sanitizers on the self-tests, then stop), new
    # and old at T = 1024, 8192, ncu on the new MXFP4 GEMMs at T = 8192,
    # racecheck, memcheck, the full tests (WG_QUICK: stop after ncu, with
    # FP8's new gate/up too). cdec2: the quick tests, the AUTO table with
    # the torch peer at every T, new and old per T, ncu at T = 8192 (NVFP4
    # and BF16 new, MXFP4 and FP8 old), stall reasons, tensor pipe and
    # shared memory metrics of MXFP4 and FP8 new and old, racecheck,
    # memcheck, the full tests (7 files back).
    rm -f "$OUT/gpu.txt" "$OUT/build.log" # printed above; 8 files come back
    wg_sass_counts
    if [ "$1" = cdec ]; then
        log "test-cuda quick"
        t0=$(date +%s)
        MOE_TEST_CUDA_QUICK=1 timeout 60 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
        grep -E "decoder|GEMM|Y\[|FAIL|passed|worst" "$OUT/test-quick.log" | head -40
        echo "test-cuda quick rc=$rc ($(( $(date +%s) - t0 )) s)"
        if [ $rc -ne 0 ]; then
            MOE_TEST_CUDA_ONLY=units timeout 60 compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/racecheck.log" 2>&1
            echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed" "$OUT/racecheck.log" | tail -5
            MOE_TEST_CUDA_ONLY=units timeout 60 compute-sanitizer --tool memcheck ./$B/test-cuda >"$OUT/memcheck.log" 2>&1
            echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|passed" "$OUT/memcheck.log" | head -5
            exit 1
        fi
        log "new (wgmma: consumer decode) and old (wgmma-pd: producer decode), T = 1024, 8192, no peer"
        for pth in wgmma wgmma-pd; do
            echo "-- $pth"
            timeout 60 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 1024,8192 \
                --path $pth --no-peer 2>&1 | tee -a "$OUT/bench-paths.log" | grep -E "^  |rror"
        done
        log "ncu: the new wgmma GEMMs at T = 8192, MXFP4 (gate/up, then down)"
        wg_ncu mxfp4 wgmma 2
        [ -n "${WG_QUICK:-}" ] && wg_ncu fp8 wgmma 1
        grep -E "k_wg|Duration|Throughput|Pipe|Busy|Issue|Eligible|Active Warps|Stall|Bank|Registers" "$OUT/ncu.txt" | head -60
        [ -n "${WG_QUICK:-}" ] && exit 0 # WG_QUICK: no sanitizers, no full tests
        WG_RACE_S=${WG_RACE_S:-90} WG_TEST_S=${WG_TEST_S:-100} sanitize_then_full_tests
    fi
    log "test-cuda quick"
    MOE_TEST_CUDA_QUICK=1 timeout 60 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
    grep -E "GEMM|FAIL|passed" "$OUT/test-quick.log" | grep -vE ": 0 of" | head -20; echo "test-cuda quick rc=$rc"
    [ $rc -eq 0 ] || exit 1
    rm -f "$OUT/test-quick.log"
    auto_then_paths 150 "" wgmma-pd
    log "ncu at T = 8192: the new gate/up of NVFP4 and BF16, the old (wgmma-pd) of MXFP4 and FP8"
    wg_ncu nvfp4 wgmma 1; wg_ncu bf16 wgmma 1; wg_ncu mxfp4 wgmma-pd 1; wg_ncu fp8 wgmma-pd 1
    grep -E "k_wg|Duration|Throughput|Pipe|Busy|Issue|Eligible|Stall|Bank" "$OUT/ncu.txt" | head -90
    log "ncu metrics at T = 8192, gate/up, MXFP4 and FP8, new then old: stall reasons, tensor pipe, shared memory"
    for wf in mxfp4 fp8; do
        for pth in wgmma wgmma-pd; do
            echo "-- $wf $pth" >>"$OUT/ncu-metrics.txt"
            timeout 45 ncu --clock-control none -k regex:'^k_wg$' --launch-count 1 \
                --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
                ./$B/moeaudit bench --device cuda --weights $wf --tokens 8192 --iters 1 --no-peer --no-graphs --path $pth \
                >>"$OUT/ncu-metrics.txt" 2>&1; echo "stalls $wf $pth rc=$?"
            timeout 45 ncu --clock-control none -k regex:'^k_wg$' --launch-count 1 \
                --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed.sum,sm__cycles_elapsed.avg \
                ./$B/moeaudit bench --device cuda --weights $wf --tokens 8192 --iters 1 --no-peer --no-graphs --path $pth \
                >>"$OUT/ncu-metrics.txt" 2>&1; echo "pipes $wf $pth rc=$?"
        done
    done
    grep -E "^--|k_wg|stalled|pipe_tensor|shared|inst_executed|cycles_elapsed|ERROR" "$OUT/ncu-metrics.txt" | grep -vE " 0(\.00)?$" | head -120
    log "racecheck (self-tests), memcheck (quick set)"
    MOE_TEST_CUDA_ONLY=units timeout 90 compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/sanitizer.log" 2>&1
    echo "racecheck rc=$?"
    MOE_TEST_CUDA_QUICK=1 timeout 60 compute-sanitizer --tool memcheck --leak-check no ./$B/test-cuda >>"$OUT/sanitizer.log" 2>&1
    echo "memcheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed" "$OUT/sanitizer.log" | tail -6
    log "test-cuda full"
    t0=$(date +%s)
    timeout ${WG_TEST_S:-100} ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst" "$OUT/test-cuda.log" | head -20; echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    exit 0
fi
if [ "${1:-}" = tma2 ]; then
    # Issue 17, second call: the same checks as tma, then the AUTO table with
    # the torch peer, the new path (wgmma: TMA tiles, activations pre-gathered)
    # and the old one (wgmma-cp) per T, mma.sync and the GEMV at the AUTO
    # crossovers, ncu on the new path at T = 8192 (MXFP4 and BF16), the
    # sanitizers and the full tests (8 files back: the sanitizers share one).
    CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    $CUOBJ -sass $B/libmoeaudit_cuda.a 2>/dev/null | awk '/Function : .*k_wg/{p=1} /Function : /&&!/k_wg/{p=0} p' > "$OUT/wg.sass"
    awk '/Function :/ {f=$3; n[f]=1} /UTMALDG/ {t[f]++} /LDGSTS/ {c[f]++} /HGMMA/ {h[f]++} /LDL|STL/ {l[f]++}
         /HMUL2/ {m[f]++} END {for (k in n) printf "  %-34s HGMMA %2d UTMALDG %d LDGSTS %2d HMUL2 %3d LDL/STL %d\n", k, h[k], t[k], c[k], m[k], l[k]}' \
        "$OUT/wg.sass" | sort
    rm -f "$OUT/wg.sass"
    log "test-cuda quick"
    t0=$(date +%s)
    MOE_TEST_CUDA_QUICK=1 timeout 60 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
    grep -E "decoder|GEMM|Y\[|FAIL|passed|worst" "$OUT/test-quick.log" | head -30
    echo "test-cuda quick rc=$rc ($(( $(date +%s) - t0 )) s)"
    [ $rc -eq 0 ] || exit 1
    auto_then_paths 120 json wgmma-cp
    if [ -n "${WG_CROSS:-}" ]; then
        log "crossovers: mma.sync (bf16), GEMV and wgmma at small T (bf16, fp8)"
        { echo "-- mma"; timeout 40 ./$B/moeaudit bench --device cuda --weights bf16 --tokens 128,1024,8192 --path mma --no-peer 2>&1
          for pth in gemv wgmma; do echo "-- $pth"
              timeout 40 ./$B/moeaudit bench --device cuda --weights bf16,fp8 --tokens 8,16,32,64 --path $pth --no-peer 2>&1; done
        } | tee -a "$OUT/bench-paths.log" | grep -E "^--|^  |rror"
    fi
    log "ncu: the wgmma GEMMs at T = 8192 (gate/up, then down), MXFP4 then BF16"
    for wf in mxfp4 bf16; do
        timeout ${WG_NCU_S:-50} ncu --clock-control none -k regex:k_wg --launch-count 3 --section SpeedOfLight \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
            ./$B/moeaudit bench --device cuda --weights $wf --tokens 8192 --iters 1 --no-peer --no-graphs --path wgmma \
            >>"$OUT/ncu.txt" 2>&1 # 3 launches: the gather, gate/up, down
        echo "ncu $wf rc=$?"
    done
    grep -E "k_wg|Duration|Throughput|Pipe|Busy|Issue|Eligible|Stall|stalled|Bank|highest" "$OUT/ncu.txt" | head -80
    sanitize_then_full_tests
fi
if [ "${1:-}" = tma ]; then
    # Issue 17, TMA weight loads: per-kernel SASS counts, the quick tests (the
    # self-tests of both load paths first; stop if they fail), the new path
    # (wgmma, TMA) with the torch peer and the old one (wgmma-cp) in the same
    # call, ncu on the new path's two launches at T = 8192 (MXFP4), racecheck
    # on the self-tests, memcheck on the quick set, then the full tests.
    CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    $CUOBJ -sass $B/libmoeaudit_cuda.a 2>/dev/null | awk '/Function : .*k_wg/{p=1} /Function : /&&!/k_wg/{p=0} p' > "$OUT/wg.sass"
    awk '/Function :/ {f=$3} /UTMALDG/ {t[f]++} /LDGSTS/ {c[f]++} /HGMMA/ {h[f]++} /LDL|STL/ {l[f]++}
         /Function :/ {n[f]=1} END {for (k in n) printf "  %-34s HGMMA %3d UTMALDG %2d LDGSTS %3d LDL/STL %d\n", k, h[k], t[k], c[k], l[k]}' \
        "$OUT/wg.sass" | sort
    log "test-cuda quick"
    t0=$(date +%s)
    MOE_TEST_CUDA_QUICK=1 timeout 60 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
    grep -E "decoder|GEMM|Y\[|FAIL|passed|worst" "$OUT/test-quick.log" | head -30
    echo "test-cuda quick rc=$rc ($(( $(date +%s) - t0 )) s)"
    [ $rc -eq 0 ] || exit 1
    log "bench: wgmma (TMA) with the torch peer, then wgmma-cp (cp.async), same call"
    t0=$(date +%s)
    timeout 110 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens ${WG_TOKENS:-128,1024,4096,8192} \
        --path wgmma >"$OUT/bench-tma.log" 2>&1; echo "rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^\||PEER|rror|copy bandwidth|peak" "$OUT/bench-tma.log"
    t0=$(date +%s)
    timeout 70 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens ${WG_TOKENS:-128,1024,4096,8192} \
        --path wgmma-cp --no-peer >"$OUT/bench-cp.log" 2>&1; echo "rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -E "^\||rror" "$OUT/bench-cp.log"
    log "ncu: the wgmma GEMMs at T = 8192, MXFP4, TMA (gate/up, then down)"
    timeout ${WG_NCU_S:-60} ncu --clock-control none -k regex:k_wg --launch-count 2 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        ./$B/moeaudit bench --device cuda --weights mxfp4 --tokens 8192 --iters 1 --no-peer --no-graphs --path wgmma \
        >"$OUT/ncu.txt" 2>&1
    echo "ncu rc=$?"
    grep -E "k_wg|Duration|Throughput|Pipe|Busy|Issue|Eligible|Active Warps|Stall|Bank" "$OUT/ncu.txt" | head -50
    sanitize_then_full_tests
fi
if [ "${1:-}" = last ]; then
    # Closing call of the wgmma work: tests, the AUTO table with the torch
    # peer, sanitizers, the opcode histogram of the MXFP4 gate/up kernel and
    # ncu on the wgmma GEMMs at T = 8192 (8 files back at most).
    CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    $CUOBJ -sass -fun '_Z4k_wgILi2ELb1EEv7wg_args' $B/libmoeaudit_cuda.a 2>/dev/null |
        awk '/\/\*[0-9a-f]+\*\// {op=$2; if (op ~ /^@/) op=$3; sub(/\..*/, "", op); n[op]++; t++}
             END {for (o in n) printf "%6d %s\n", n[o], o; printf "%6d total\n", t}' | sort -rn > "$OUT/sass-hist.txt"
    head -25 "$OUT/sass-hist.txt" | tr '\n' ' '; echo
    log "test-cuda quick"
    MOE_TEST_CUDA_QUICK=1 timeout 60 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
    grep -E "decoder|GEMM|FAIL|passed" "$OUT/test-quick.log" | head -20; echo "test-cuda quick rc=$rc"
    [ $rc -eq 0 ] || exit 1
    log "test-cuda full"
    t0=$(date +%s)
    timeout 90 ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst" "$OUT/test-cuda.log" | head -20; echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    log "AUTO with the torch peer"
    timeout 150 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 1,16,128,1024,4096,8192 \
        --json "$OUT/bench-cuda.json" >"$OUT/bench.log" 2>&1; grep -E "^\||PEER|rror|copy bandwidth" "$OUT/bench.log"
    log "memcheck (quick set), racecheck (self-tests)"
    MOE_TEST_CUDA_QUICK=1 timeout 60 compute-sanitizer --tool memcheck --leak-check no ./$B/test-cuda >"$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed" "$OUT/memcheck.log" | tail -2
    MOE_TEST_CUDA_ONLY=units timeout 45 compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/racecheck.log" 2>&1
    echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|passed" "$OUT/racecheck.log" | tail -2
    log "ncu: the wgmma GEMMs at T = 8192, MXFP4 (gate/up, then down)"
    timeout ${WG_NCU_S:-75} ncu --clock-control none -k regex:k_wg --launch-count 2 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        ./$B/moeaudit bench --device cuda --weights mxfp4 --tokens 8192 --iters 1 --no-peer --no-graphs \
        >"$OUT/ncu.txt" 2>&1
    echo "ncu rc=$?"
    grep -E "k_wg|Duration|Throughput|Pipe|Busy|Issue|Eligible|Active Warps|Stall|Bank" "$OUT/ncu.txt" | head -60
    rm -f "$OUT/gpu.txt" "$OUT/build.log" "$OUT/test-quick.log"
    exit 0
fi
if [ "${1:-}" = final ]; then
    # One call for the wgmma work: quick tests (stop there if they fail), the
    # per-path sweep (crossovers), the AUTO table with the torch peer, the full
    # tests, memcheck on the quick set, racecheck on the kernels' self-tests.
    CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    $CUOBJ -sass $B/libmoeaudit_cuda.a 2>/dev/null | awk '/Function : .*k_wg/{p=1} /Function : /&&!/k_wg/{p=0} p' > "$OUT/wg.sass"
    echo "SASS lines $(wc -l < "$OUT/wg.sass"): HGMMA $(grep -c HGMMA "$OUT/wg.sass"), LDL/STL $(grep -cE 'LDL|STL' "$OUT/wg.sass")"
    log "test-cuda quick"
    t0=$(date +%s)
    MOE_TEST_CUDA_QUICK=1 timeout 60 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
    grep -E "decoder|GEMM|Y\[|FAIL|passed|worst" "$OUT/test-quick.log" | head -30
    echo "test-cuda quick rc=$rc ($(( $(date +%s) - t0 )) s)"
    [ $rc -eq 0 ] || exit 1
    log "sweep (no peer)"
    ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --tokens 64,128,256,512,1024,8192 --path wgmma \
        --no-peer 2>&1 | tee "$OUT/sweep.log" | grep -E "^  |rror|fp8 "
    echo "-- mma"; ./$B/moeaudit bench --device cuda --weights bf16,mxfp4 --tokens 128,1024,8192 --path mma --no-peer 2>&1 | grep -E "^  |rror"
    echo "-- grouped"; ./$B/moeaudit bench --device cuda --weights mxfp4 --tokens 128,256 --path grouped --no-peer 2>&1 | grep -E "^  |rror"
    log "AUTO with the torch peer"
    timeout 150 ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 1,16,128,1024,4096,8192 \
        --json "$OUT/bench-cuda.json" 2>&1 | tee "$OUT/bench.log" | grep -E "^\||PEER|rror"
    log "test-cuda full"
    t0=$(date +%s)
    timeout ${WG_TEST_S:-90} ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst" "$OUT/test-cuda.log" | head -20
    echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    log "memcheck (quick set), racecheck (self-tests)"
    t0=$(date +%s)
    MOE_TEST_CUDA_QUICK=1 timeout ${WG_MEMCHECK_S:-90} compute-sanitizer --tool memcheck --leak-check no ./$B/test-cuda \
        >"$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "ERROR SUMMARY|passed" "$OUT/memcheck.log" | tail -2
    t0=$(date +%s)
    MOE_TEST_CUDA_ONLY=units timeout 60 compute-sanitizer --tool racecheck ./$B/test-cuda >"$OUT/racecheck.log" 2>&1
    echo "racecheck rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|hazard|passed" "$OUT/racecheck.log" | tail -3
    exit 0
fi
if [ "${1:-}" = wg ]; then
    # wgmma bring-up: SASS of the kernels, the quick tests (self-test first),
    # a T sweep of the wgmma path against mma.sync, then the full tests.
    CUOBJ=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
    $CUOBJ -sass $B/libmoeaudit_cuda.a 2>/dev/null | awk '/Function : .*k_wg/{p=1} /Function : /&&!/k_wg/{p=0} p' > "$OUT/wg.sass"
    echo "SASS lines $(wc -l < "$OUT/wg.sass"): HGMMA $(grep -c HGMMA "$OUT/wg.sass"), LDL/STL $(grep -cE 'LDL|STL' "$OUT/wg.sass")"
    log "test-cuda quick"
    t0=$(date +%s)
    MOE_TEST_CUDA_QUICK=1 timeout 120 ./$B/test-cuda >"$OUT/test-quick.log" 2>&1; rc=$?
    grep -E "decoder|GEMM|Y\[|FAIL|passed|worst" "$OUT/test-quick.log" | head -40
    echo "test-cuda quick rc=$rc ($(( $(date +%s) - t0 )) s)"
    log "bench sweep: wgmma, mma"
    for p in wgmma mma; do
        timeout 100 ./$B/moeaudit bench --device cuda --weights mxfp4,bf16 --tokens ${WG_TOKENS:-16,128,512,1024,4096,8192} \
            --path $p --no-peer 2>&1 | tee "$OUT/bench-$p.log" | grep -E "^  (mxfp4|bf16|nvfp4|fp8)|rror"
    done
    log "test-cuda full"
    t0=$(date +%s)
    timeout ${WG_TEST_S:-150} ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
    grep -E "FAIL|passed|worst" "$OUT/test-cuda.log" | head -30
    echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
    if [ -n "${WG_NCU:-}" ]; then
        log "ncu: the wgmma GEMMs at T = 8192, MXFP4"
        timeout ${WG_NCU_S:-60} ncu --clock-control none -k regex:k_wg --launch-count 2 --section SpeedOfLight \
            --section Occupancy --section LaunchStats --section WarpStateStats \
            ./$B/moeaudit bench --device cuda --weights mxfp4 --tokens 8192 --iters 1 --no-peer --no-graphs \
            >"$OUT/ncu.txt" 2>&1
        grep -E "k_wg|Duration|Throughput|Pipe|Registers|Achieved Occupancy|Stall|Warp Cycles" "$OUT/ncu.txt" | head -40
    fi
    exit 0
fi
log test-cuda
t0=$(date +%s)
OMP_NUM_THREADS=16 ./$B/test-cuda >"$OUT/test-cuda.log" 2>&1; rc=$?
grep -E "FAIL|ok \(|FAILED|passed|worst|device" "$OUT/test-cuda.log" | head -60
echo "test-cuda rc=$rc ($(( $(date +%s) - t0 )) s)"
log compute-sanitizer memcheck on the fixtures
t0=$(date +%s)
MOE_TEST_CUDA_QUICK=1 timeout 240 compute-sanitizer --tool memcheck --leak-check no ./$B/test-cuda >"$OUT/sanitizer.log" 2>&1
echo "sanitizer rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "ERROR SUMMARY|passed" "$OUT/sanitizer.log" | tail -3
log run --device cuda vs the CPU reference
./$B/moeaudit run --device cuda --tokens 64 --compare --check --fuse-shared --scale-owner runner 2>&1 | tail -12
[ "${1:-}" = quick ] && exit 0
if [ "${1:-}" = short ]; then
    log "audit with the GPU rows (group cuda)"
    t0=$(date +%s)
    OMP_NUM_THREADS=16 ./$B/moeaudit audit --experts 16 --tokens 32 --json "$OUT/audit.json" >"$OUT/audit.txt" 2>&1
    echo "audit rc=$? ($(( $(date +%s) - t0 )) s)"; grep -E "cuda|layer|PASS|MARG|FAIL" "$OUT/audit.txt" | head -70
    log bench
    ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 1,16 \
        --json "$OUT/bench-small.json" 2>&1 | tee "$OUT/bench-small.log" | tail -24
    ./$B/moeaudit bench --device cuda --weights mxfp4 --tokens 8192 --no-peer 2>&1 | tee "$OUT/bench-8192.log" | tail -6
    exit 0
fi
if [ "${1:-}" = gemv ]; then
    # FP4 small-T paths side by side: per-assignment GEMV on the tensor cores
    # (gemv), grouped by expert (grouped), the fp32-FMA GEMV (gemv-f32)
    for p in gemv grouped gemv-f32; do
        echo "-- path $p"
        ./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4 --tokens 1,8,16,32,128 --path $p --no-peer 2>&1 | grep -E "^  (mxfp4|nvfp4)"
    done
    exit 0
fi
log bench
./$B/moeaudit bench --device cuda --weights mxfp4,nvfp4,fp8,bf16 --act bf16 --tokens 1,16,128,1024,4096,8192 \
    --json "$OUT/bench-cuda.json" 2>&1 | tee "$OUT/bench.log" | tail -60
log "bench: GEMV path at moderate T (the AUTO threshold), and T=1 without graphs"
./$B/moeaudit bench --device cuda --weights mxfp4 --tokens 8,16,32,64,128 --path gemv --no-peer 2>&1 | tee "$OUT/bench-gemv.log" | grep -E "^  mxfp4"
./$B/moeaudit bench --device cuda --weights mxfp4 --tokens 1,8 --no-graphs --no-peer 2>&1 | grep -E "^  mxfp4"
