/* bench/amx_parts: the AMX kernel, v2 without the decode arithmetic (times the rest). */
#define AMX_PARTS_V(x) x##_nd
#define MOE_AMX_KB 8
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 1
#define MOE_AMX_TPIPE 0
#define AMX_PARTS_NO_DECODE 1
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
