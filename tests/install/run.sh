#!/bin/sh
# CTest test-install: `cmake --install` into a temporary prefix, then
#  1. the layout: CLI, both libraries, headers, moeaudit.pc, the CMake
#     package, the bundled checkpoints, the man page, the guide and schemas;
#  2. the installed CLI runs on its bundled checkpoint, found relative to its
#     own location: also after the prefix is moved;
#  3. an external program (tests/install/consumer.c) built with
#     find_package(moeaudit) (shared and static), with `pkg-config --cflags
#     --libs moeaudit` (shared) and `pkg-config --static` against a prefix
#     holding only the static library: one try each, no flags guessed;
#  4. moeaudit as a subproject (add_subdirectory) of another project (not in
#     sanitizer builds: it rebuilds the library).
# Every build prints the same line. Usage: run.sh SRC BUILD CMAKE CC [SANITIZE]
set -eu
src=$1 build=$2 cmake=$3 cc=$4 sanitize=${5:-OFF}
work=$(mktemp -d "${TMPDIR:-/tmp}/moeaudit-install-XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
flags=""
if [ "$sanitize" = ON ]; then flags="-fsanitize=address,undefined"; fi

prefix=$work/prefix
"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; fail "cmake --install"; }
echo "== installed (find $prefix)"
(cd "$prefix" && find . \( -type f -o -type l \) | LC_ALL=C sort)

pc=$(cd "$prefix" && find . -name moeaudit.pc)
[ -n "$pc" ] || fail "moeaudit.pc not installed"
libdir=$(dirname "$(dirname "$pc")") # lib (or lib/<multiarch>)
for f in bin/moeaudit include/moeaudit.h "$libdir/libmoeaudit.a" "$libdir/libmoeaudit.so" \
         "$libdir/cmake/moeaudit/moeauditConfig.cmake" "$libdir/cmake/moeaudit/moeauditConfigVersion.cmake" \
         share/moeaudit/dsv4-tiny/config.json share/moeaudit/dsv4-tiny/model.safetensors \
         share/moeaudit/dsv3-tiny/config.json share/man/man1/moeaudit.1 share/doc/moeaudit/guide.md \
         share/doc/moeaudit/schemas/audit.schema.json; do
  [ -e "$prefix/$f" ] || fail "$f not installed"
done
for h in "$src"/include/*.h; do
  [ -e "$prefix/include/$(basename "$h")" ] || fail "include/$(basename "$h") not installed"
done
[ -e "$prefix/$libdir/libmoeaudit.so.0" ] || fail "libmoeaudit.so.0 (soname) not installed"

echo "== the installed CLI finds its bundled checkpoint"
unset MOEAUDIT_DATA || true
out=$("$prefix/bin/moeaudit" run --layer 3 --tokens 2) || fail "installed moeaudit run: $out"
real=$(cd "$prefix" && pwd -P)
echo "$out" | grep -q "model $real/share/moeaudit/dsv4-tiny " || fail "not the installed checkpoint: $out"
mv "$prefix" "$work/moved"
prefix=$work/moved
real=$(cd "$prefix" && pwd -P)
out=$("$prefix/bin/moeaudit" run --layer 3 --tokens 2) || fail "moved moeaudit run: $out"
echo "$out" | grep -q "model $real/share/moeaudit/dsv4-tiny " || fail "not found after the move: $out"
"$prefix/bin/moeaudit" --version
if command -v man >/dev/null 2>&1; then
  man -l "$prefix/share/man/man1/moeaudit.1" >/dev/null 2>&1 || fail "man -l moeaudit.1"
fi

ckpt=$prefix/share/moeaudit/dsv4-tiny
echo "== find_package(moeaudit)"
"$cmake" -S "$src/tests/install" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" >"$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "configure the find_package consumer"; }
"$cmake" --build "$work/consumer" >>"$work/consumer.log" 2>&1 || { cat "$work/consumer.log"; fail "build it"; }
want=$("$work/consumer/consumer_shared" "$ckpt") || fail "consumer_shared"
echo "shared (find_package): $want"
got=$("$work/consumer/consumer_static" "$ckpt") || fail "consumer_static"
[ "$got" = "$want" ] || fail "static (find_package) printed: $got"

echo "== pkg-config --cflags --libs moeaudit"
export PKG_CONFIG_PATH="$prefix/$libdir/pkgconfig"
# shellcheck disable=SC2046
"$cc" $flags "$src/tests/install/consumer.c" -o "$work/consumer_pc" $(pkg-config --cflags --libs moeaudit) -lm ||
  fail "link with pkg-config --libs moeaudit: $(pkg-config --cflags --libs moeaudit)"
got=$(LD_LIBRARY_PATH="$prefix/$libdir" "$work/consumer_pc" "$ckpt") || fail "consumer_pc"
[ "$got" = "$want" ] || fail "pkg-config (shared) printed: $got"
# a prefix with the static library alone: --static must list everything it needs
mkdir -p "$work/static/lib/pkgconfig"
cp "$prefix/$libdir/libmoeaudit.a" "$work/static/lib/"
cp "$prefix/$pc" "$work/static/lib/pkgconfig/"
ln -s "$prefix/include" "$work/static/include"
export PKG_CONFIG_PATH="$work/static/lib/pkgconfig"
# shellcheck disable=SC2046
"$cc" $flags "$src/tests/install/consumer.c" -o "$work/consumer_pc_static" $(pkg-config --static --cflags --libs moeaudit) ||
  fail "static link with pkg-config --static --libs moeaudit: $(pkg-config --static --cflags --libs moeaudit)"
got=$("$work/consumer_pc_static" "$ckpt") || fail "consumer_pc_static"
[ "$got" = "$want" ] || fail "pkg-config (static) printed: $got"
echo "pkg-config: shared and static, the same line"

if [ "$sanitize" = ON ]; then
  echo "note: add_subdirectory not checked in the sanitizer build (it rebuilds the library)"
  exit 0
fi
echo "== add_subdirectory(moeaudit)"
"$cmake" -S "$src/tests/install/subdir" -B "$work/sub" -DMOEAUDIT_SOURCE="$src" -DMOE_CUDA=OFF \
  -DCMAKE_C_COMPILER="$cc" >"$work/sub.log" 2>&1 || { cat "$work/sub.log"; fail "configure the parent project"; }
"$cmake" --build "$work/sub" --target consumer -j2 >>"$work/sub.log" 2>&1 || { tail -40 "$work/sub.log"; fail "build it"; }
got=$("$work/sub/consumer" "$ckpt") || fail "subproject consumer"
[ "$got" = "$want" ] || fail "subproject printed: $got"
echo "add_subdirectory: the same line"
echo "test-install: ok"
