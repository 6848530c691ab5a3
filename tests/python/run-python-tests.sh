#!/bin/sh
# CTest driver of python/tests: finds a Python that has PyTorch (MOE_PYTHON,
# then python3, then /usr/bin/python3, where Debian's python3-torch installs),
# or exits 77 (skipped) saying why.
# usage: run-python-tests.sh SOURCE_DIR MOEAUDIT_CLI
src=$1
cli=$2; case "$cli" in /*) ;; *) cli="$PWD/$cli";; esac
export MOEAUDIT_CLI="$cli" MOEAUDIT_DATA="$src/tests/data"
for py in "$MOE_PYTHON" python3 /usr/bin/python3; do
  [ -n "$py" ] || continue
  if "$py" -c "import torch" >/dev/null 2>&1; then
    echo "python: $py, torch $("$py" -c 'import torch; print(torch.__version__)')"
    cd "$src/python/tests" && exec "$py" -m unittest -v test_dump
  fi
done
echo "SKIPPED: no Python with PyTorch (install python3-torch) -- moeaudit_dump is not tested"
exit 77
