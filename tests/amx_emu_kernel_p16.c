/*
 * test-amx-emu's build of the AMX kernel with the decode pipelined across
 * row blocks in chunk runs (MOE_AMX_DSPLIT 3), K blocks of 16 steps and the
 * B tiles loaded by TILELOADDT1 (MOE_AMX_BSTREAM 1), as
 * tests/amx_emu_kernel.c builds the defaults: its own table and fault count.
 */
#define MOE_AMX_TABLE_NAME moe_cpu_amx_emulated_p16_table
#define AMX_EMU_FAULT_COUNT amx_emu_fault_count_p16
#define MOE_AMX_DSPLIT 3
#define MOE_AMX_BSTREAM 1
#define MOE_AMX_KB 16

#include <immintrin.h>

#include "amx_emulate.h"

#include "../src/cpu/amx/gemm_amx.c"
