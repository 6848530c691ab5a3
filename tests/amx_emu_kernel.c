/*
 * test-amx-emu's build of the AMX kernel: src/cpu/amx/gemm_amx.c compiled
 * against the software tiles of amx_emulate.h (included first: it replaces
 * gcc's tile macros), with MOE_AMX_EMULATE set by CMakeLists.txt.
 */
#include <immintrin.h>

#include "amx_emulate.h"

#include "../src/cpu/amx/gemm_amx.c"
