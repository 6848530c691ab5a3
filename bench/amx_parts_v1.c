/* bench/amx_parts: the AMX kernel, B tiles by a register transpose. */
#define AMX_PARTS_V(x) x##_v1
#define MOE_AMX_KB 8
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 0
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
