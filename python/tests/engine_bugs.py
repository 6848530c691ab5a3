"""Contract bugs injected into a *running* engine (monkey-patching its modules
in memory, never its files), for transformers' DeepseekV3MoE and
DeepseekV4SparseMoeBlock and for the test module of the same shape
(tiny_moe.py). Each inject_* takes an MoE block and returns an undo callable.

The patches reuse the engine's own routing code where they can (they wrap
and post-process it), so that what is dumped is what that engine computes
with one contract broken:

  scale_double     the expert runner multiplies the routed sum by s although the router folded it
  scale_missing    nobody multiplies by s (the runner divides the router's weights back)
  shared_scaled    the factor is applied to the shared expert too (shared x s)
  not_renormalized the top-k weights are not renormalized
  biased_weights   the weights are gathered from the bias-corrected scores (top-k layers)
  wrong_score      the wrong scoring function (V4: sigmoid for sqrtsoftplus; V3: softmax for sigmoid)
  hash_off_by_one  tid2eid rows shifted by one (token t routed by row t-1), hash layers
"""
import torch


def _s(block):
    g = block.gate
    for obj in (g, block, getattr(block, "config", None), getattr(g, "config", None)):
        v = getattr(obj, "routed_scaling_factor", None) if obj is not None else None
        if v is not None:
            return float(v)
    raise AttributeError("cannot find routed_scaling_factor on %s" % type(block).__name__)


def _is_hash(block):
    return getattr(block, "is_hash", False) or hasattr(block.gate, "tid2eid")


def _bias(block):
    for obj in (block.gate, block):
        b = getattr(obj, "e_score_correction_bias", None)
        if isinstance(b, torch.Tensor):
            return b
    return None


def _wrap(obj, attr, make):
    orig = getattr(obj, attr)
    had_own = attr in obj.__dict__
    setattr(obj, attr, make(orig))

    def undo():
        if had_own:
            setattr(obj, attr, orig)
        else:
            delattr(obj, attr)
    return undo


def _wrap_weights(block, fn):
    """Post-process the router's (ids, weights): fn(logits, ids, weights) -> weights.
    V4 routers return (logits, weights, ids); V3 (transformers 5) routes in
    block.route_tokens_to_experts(logits) -> (ids, weights)."""
    if hasattr(block, "route_tokens_to_experts"):
        def make(orig):
            def route(logits, *a, **k):
                ids, w = orig(logits, *a, **k)
                return ids, fn(logits.reshape(-1, logits.shape[-1]), ids, w).to(w.dtype)
            return route
        return _wrap(block, "route_tokens_to_experts", make)

    def make(orig):
        def forward(*a, **k):
            out = orig(*a, **k)
            if isinstance(out, tuple) and len(out) == 3:
                logits, w, ids = out
                return logits, fn(logits, ids, w).to(w.dtype), ids
            if isinstance(out, tuple) and len(out) == 2:      # transformers 4.x V3 gate: (ids, weights)
                ids, w = out
                x = a[0].reshape(-1, block.gate.weight.shape[1])
                logits = torch.nn.functional.linear(x.float(), block.gate.weight.float())
                return ids, fn(logits, ids, w).to(w.dtype)
            raise TypeError("gate returns %s, not (logits, weights, ids)" % type(out).__name__)
        return forward
    return _wrap(block.gate, "forward", make)


def _scores(block, logits):
    f = getattr(block.gate, "score_fn", None)
    return f(logits) if f is not None else torch.sigmoid(logits)


def _scale_weights_arg(block, factor):
    """The expert runner multiplies the weights it is given by `factor`: the
    third positional argument (transformers: experts(hidden, top_k_index,
    top_k_weights)) or the keyword top_k_weights."""
    def make(orig):
        def forward(*a, **k):
            if len(a) >= 3:
                a = a[:2] + (a[2] * factor,) + tuple(a[3:])
            elif "top_k_weights" in k:
                k = dict(k, top_k_weights=k["top_k_weights"] * factor)
            else:
                raise TypeError("experts called without routing weights: cannot rescale them")
            return orig(*a, **k)
        return forward
    return _wrap(block.experts, "forward", make)


def inject_scale_double(block):
    return _scale_weights_arg(block, _s(block))


def inject_scale_missing(block):
    return _scale_weights_arg(block, 1.0 / _s(block))


def inject_shared_scaled(block):
    s = _s(block)

    def make(orig):
        def forward(*a, **k):
            return orig(*a, **k) * s
        return forward
    return _wrap(block.shared_experts, "forward", make)


def inject_not_renormalized(block):
    s = _s(block)
    return _wrap_weights(block, lambda logits, ids, w: _scores(block, logits.float()).gather(1, ids.long()) * s)


def inject_biased_weights(block):
    b = _bias(block)
    if b is None or _is_hash(block):
        return None          # hash layers have no bias: nothing to break
    s = _s(block)

    def fn(logits, ids, w):
        pb = (_scores(block, logits.float()) + b.float()).gather(1, ids.long())
        return pb / (pb.sum(-1, keepdim=True) + 1e-20) * s
    return _wrap_weights(block, fn)


def _v3_gate_forward(g, score):
    """transformers 5.17's DeepseekV3TopkRouter.forward (printed by make_engine_dumps.py on the
    device) with `score` in place of sigmoid: the engine's own grouping, -inf mask and top-k."""
    def forward(hidden_states):
        h = hidden_states.view(-1, g.hidden_dim)
        logits = torch.nn.functional.linear(h.type(torch.float32), g.weight.type(torch.float32))
        scores = score(logits)
        choice = scores + g.e_score_correction_bias
        G = g.num_group
        gs = choice.view(-1, G, g.num_experts // G).topk(2, dim=-1)[0].sum(dim=-1)
        gi = torch.topk(gs, k=g.topk_group, dim=-1, sorted=False)[1]
        gm = torch.zeros_like(gs).scatter_(1, gi, 1)
        sm = gm.unsqueeze(-1).expand(-1, G, g.num_experts // G).reshape(-1, g.num_experts)
        idx = torch.topk(choice.masked_fill(~sm.bool(), float("-inf")), k=g.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if g.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * g.routed_scaling_factor, idx
    return forward


def inject_wrong_score(block):
    g = block.gate
    if hasattr(g, "score_fn"):                      # V4: sqrtsoftplus -> sigmoid
        old = g.score_fn
        new = torch.nn.Sigmoid() if isinstance(old, torch.nn.Module) else torch.sigmoid
        setattr(g, "score_fn", new)

        def undo():
            setattr(g, "score_fn", old)
        return undo
    if hasattr(g, "num_group") and hasattr(g, "e_score_correction_bias"):   # V3 (transformers 5): softmax
        return _wrap(g, "forward", lambda orig: _v3_gate_forward(g, lambda l: torch.softmax(l, dim=-1)))
    if hasattr(block, "route_tokens_to_experts"):   # V3 routing outside the gate: softmax through its own code
        def make(orig):
            def route(logits, *a, **k):
                p = torch.softmax(logits.float(), -1).clamp(1e-30, 1 - 1e-7)
                return orig(torch.log(p) - torch.log1p(-p), *a, **k)   # sigmoid(this) = softmax(logits)
            return route
        return _wrap(block, "route_tokens_to_experts", make)
    raise TypeError("%s: no scoring function to replace" % type(block).__name__)


def inject_hash_off_by_one(block):
    t = getattr(block.gate, "tid2eid", None)
    if t is None:
        return None
    orig = t.detach().clone()
    with torch.no_grad():
        t.copy_(torch.roll(orig, 1, 0))

    def undo():
        with torch.no_grad():
            t.copy_(orig)
    return undo


BUGS = {
    "none": None,
    "scale_double": inject_scale_double,
    "scale_missing": inject_scale_missing,
    "shared_scaled": inject_shared_scaled,
    "not_renormalized": inject_not_renormalized,
    "biased_weights": inject_biased_weights,
    "wrong_score": inject_wrong_score,
    "hash_off_by_one": inject_hash_off_by_one,
}

# The verdict moeaudit diagnose must give, per bug, on a layer the bug reaches
# (hash: a hash-routed layer; topk: a learned top-k layer); "OK" where the bug
# does not apply to that kind of layer.
EXPECTED = {
    "none": ("OK", "OK"),
    "scale_double": ("SCALE_DOUBLE", "SCALE_DOUBLE"),
    "scale_missing": ("SCALE_MISSING", "SCALE_MISSING"),
    "shared_scaled": ("SHARED_WEIGHT", "SHARED_WEIGHT"),
    "not_renormalized": ("NOT_RENORMALIZED", "NOT_RENORMALIZED"),
    "biased_weights": ("OK", "BIASED_WEIGHTS"),
    "wrong_score": ("WRONG_SCORE", "WRONG_SCORE"),
    "hash_off_by_one": ("SELECTION", "OK"),
}


def inject(model_blocks, bug):
    """Inject `bug` into every block; returns one undo for all."""
    undos = []
    f = BUGS[bug]
    if f is not None:
        for blk in model_blocks:
            u = f(blk)
            if u is not None:
                undos.append(u)

    def undo():
        for u in reversed(undos):
            u()
    return undo

