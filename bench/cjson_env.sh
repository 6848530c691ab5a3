# Sourced by the device-machine scripts (bench/*.sh, bench/cuda/run.sh), run
# from the repository root: the device image lacks cJSON, so a carried copy
# in .cjson/ (see docs/performance-cuda.md) goes on the pkg-config and loader
# paths when present.
if [ -d .cjson ]; then
    export PKG_CONFIG_PATH="$PWD/.cjson/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    export LD_LIBRARY_PATH="$PWD/.cjson/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
