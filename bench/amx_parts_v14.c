/* bench/amx_parts: the AMX kernel, v8 with the next panel's decode in equal
 * runs of chunks and one pipeline across row blocks (MOE_AMX_DSPLIT 3). */
#define AMX_PARTS_V(x) x##_v14
#define MOE_AMX_KB 16
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 3
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
