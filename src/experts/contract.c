/*
 * The routed-scaling contract, in one place (SEMANTICS.md section 2).
 *
 * Invariants:
 *  1. For every owner, router_mult * runner_mult * output_mult == s: the
 *     routed branch is scaled exactly once.
 *  2. The effective weight of the shared branch is 1: unfused it is added
 *     unweighted; fused its column weight times runner_mult is 1.
 *  3. OUTPUT ownership cannot carry a fused shared column (the output stage
 *     would scale the shared expert too), so it is refused.
 */
#include "core/core.h"

#include <string.h>

static const char *const owner_names[] = {"router", "runner", "output"};

const char *moe_scale_owner_name(moe_scale_owner o) {
    return (unsigned)o < 3 ? owner_names[o] : "?";
}

bool moe_scale_owner_parse(const char *s, moe_scale_owner *o) {
    for (int i = 0; i < 3; i++) {
        if (strcmp(s, owner_names[i]) == 0) { *o = (moe_scale_owner)i; return true; }
    }
    return false;
}

moe_status moe_contract_for(moe_scale_owner o, bool fuse_shared, double s, moe_contract *c,
                            moe_error *err) {
    c->router_mult = c->runner_mult = c->output_mult = 1.0;
    c->fused_shared_w = 1.0;
    switch (o) {
    case MOE_SCALE_ROUTER:
        c->router_mult = s;
        break;
    case MOE_SCALE_RUNNER:
        c->runner_mult = s;
        c->fused_shared_w = 1.0 / s; /* the runner scales every column, shared included */
        break;
    case MOE_SCALE_OUTPUT:
        if (fuse_shared)
            return moe_errf(err, MOE_ERR_ARG,
                            "scale owner 'output' cannot be combined with fused shared experts: "
                            "the output stage would scale the shared column too");
        c->output_mult = s;
        break;
    default:
        return moe_errf(err, MOE_ERR_ARG, "unknown scale owner %d", (int)o);
    }
    return MOE_OK;
}

moe_run_opts moe_run_opts_default(void) {
    moe_run_opts o;
    memset(&o, 0, sizeof o);
    o.precision = MOE_PREC_REF;
    o.act = MOE_ACT_EXACT;
    o.router = MOE_ROUTER_PATH;
    o.owner = MOE_SCALE_ROUTER;
    o.fuse_shared = false;
    o.check_invariants = false;
    return o;
}
