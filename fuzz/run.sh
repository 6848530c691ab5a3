#!/usr/bin/env bash
# Run one libFuzzer target for a bounded time; stop on any finding.
#
#   fuzz/run.sh BUILD_DIR TARGET SECONDS [WORK_DIR [LIBFUZZER_FLAG ...]]
#
# TARGET is a name of fuzz/fuzz-<TARGET>.c (safetensors, config, checkpoint,
# dump, input, forward, needle, hc, placement). The seed corpus fuzz/corpus-<TARGET>
# is copied into WORK_DIR/corpus (kept between runs when WORK_DIR is given,
# so a long run resumes where the last one stopped; flags after it go to
# libFuzzer, e.g. -runs=10000000 to stop after 10^7 inputs); the dictionary
# fuzz/<TARGET>.dict and the target's max_len are passed. Exit status: 0 when
# the time ran out with no finding; otherwise the fuzzer's (77: a crash, an
# ASan/UBSan report or a broken property; 70: a timeout; OOM: -rss_limit_mb),
# after printing the end of the log and the reproducer's path. UBSan halts on
# the first report (the fuzz build has -fno-sanitize-recover=all; the
# options below make the run abort too).
set -euo pipefail
build=$1 target=$2 secs=$3 work=${4:-}
extra=("${@:5}")
root=$(cd "$(dirname "$0")" && pwd)
bin="$build/fuzz-$target"
[ -x "$bin" ] || { echo "fuzz/run.sh: $bin is not built" >&2; exit 2; }
case "$target" in
  safetensors|checkpoint) max_len=65536 ;;
  config) max_len=16384 ;;
  placement) max_len=4096 ;;
  *) max_len=8192 ;;
esac
if [ -z "$work" ]; then work=$(mktemp -d); fi
mkdir -p "$work/corpus" "$work/artifacts"
cp -n "$root/corpus-$target/"* "$work/corpus/" 2>/dev/null || true
dict=()
if [ -f "$root/$target.dict" ]; then dict=(-dict="$root/$target.dict"); fi
log="$work/fuzz-$target.log"
# One core per fuzzer: the library's OpenMP regions run on the calling
# thread (the same code, so the same coverage), and no idle worker spins
# on a second core between inputs (LLVM's libomp spins 200 ms by default).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}
set +e
"$bin" -max_total_time="$secs" -max_len="$max_len" -timeout=20 -rss_limit_mb=2048 -error_exitcode=77 \
  -timeout_exitcode=70 -print_final_stats=1 -artifact_prefix="$work/artifacts/" "${dict[@]}" "${extra[@]}" "$work/corpus" \
  >"$log" 2>&1
rc=$?
set -e
grep -E '^#[0-9]+[[:space:]]+(DONE|INITED)' "$log" | tail -n 2 || true
grep -E '^stat::' "$log" || true
echo "corpus: $(ls "$work/corpus" | wc -l) files"
if [ $rc -ne 0 ]; then
  echo "fuzz-$target: FINDING (exit $rc); the end of $log:" >&2
  tail -n 40 "$log" >&2
  ls -l "$work/artifacts/" >&2
  exit $rc
fi
