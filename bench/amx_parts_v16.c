/* bench/amx_parts: the AMX kernel, v8 with the B tiles loaded by TILELOADDT1
 * (MOE_AMX_BSTREAM 1: the activations do not push the panel out of L1). */
#define AMX_PARTS_V(x) x##_v16
#define MOE_AMX_KB 16
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 2
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 1
#include "amx_parts_kernel.h"
