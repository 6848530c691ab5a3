/* bench/amx_parts: the experts driver (src/experts/experts_fast.c) built
 * again with MOE_EXPERTS_CLAIM 0 (the static split of invariant 4 always), under
 * another name, so that the drivers are timed side by side whatever the
 * library's default. */
#define MOE_EXPERTS_CLAIM 0
#define moe_experts_fast amx_parts_experts_static
#define moe_experts_fast_scratch amx_parts_experts_static_scratch
#define moe_experts_fast_threads amx_parts_experts_static_threads
#define moe_experts_fast_claims amx_parts_experts_static_claims
#include "experts/experts_fast.c"
