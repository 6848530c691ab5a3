/* bench/amx_parts: the AMX kernel's packing and blocking as before the
 * breakdown of issue #18 (run E of docs/performance.md); the decode's row
 * loop is the file's current one, shared by every build. */
#define AMX_PARTS_V(x) x##_v0
#define MOE_AMX_KB 8
#define MOE_AMX_PACK_T 0
#define MOE_AMX_DSPLIT 0
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
