/* bench/amx_parts: the AMX kernel, v15 (DSPLIT 3, K blocks of 128) with the
 * B tiles loaded by TILELOADDT1 (MOE_AMX_BSTREAM 1). */
#define AMX_PARTS_V(x) x##_v17
#define MOE_AMX_KB 128
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 3
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 1
#include "amx_parts_kernel.h"
