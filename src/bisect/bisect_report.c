/*
 * Bisect reports (include/moeaudit_bisect.h): text, JSON, one self-contained
 * HTML page (inline SVG: the run x metric matrix coloured by harm, the
 * needle's margin and the stream error per layer, the length x depth
 * heatmap). Writers take a FILE * the caller opened.
 *
 * Invariant: the JSON holds only numbers computed from the checkpoint, the
 * prompt and the patches (no time, host, thread count or process rank), so
 * identical inputs give identical bytes.
 */
#include "core/core.h"
#include "moeaudit_bisect.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

/* The CSA layer that shows the needle worst in r: fewest entries kept, then
 * smallest margin; -1 without CSA layers. */
static int worst_csa(const moe_bisect_result *r) {
    int w = -1;
    for (int l = 0; l < r->n_layers; l++) {
        const moe_bisect_layer *L = &r->layers[l];
        if (L->type != MOE_ATTN_CSA || L->needle_entries == 0) continue;
        if (w < 0) { w = l; continue; }
        const moe_bisect_layer *W = &r->layers[w];
        if (L->kept < W->kept || (L->kept == W->kept && !L->dense && (W->dense || L->margin < W->margin))) w = l;
    }
    return w;
}

static const char *type_name(const moe_bisect_layer *L) { return moe_attn_type_name(L->type); }

static double last_err(const moe_bisect_result *r) { return r->n_layers ? r->layers[r->n_layers - 1].stream_err : 0; }

/* ------------------------------------------------------------------ text */

static void text_row(FILE *f, const moe_bisect_report *r, const char *grade, const char *name, const moe_bisect_result *x) {
    if (x->status != MOE_OK) {
        fprintf(f, "%-9s %-34s failed: %s\n", "FAILED", name, x->msg);
        return;
    }
    char needle[64] = "-";
    int w = worst_csa(x);
    if (w < 0) w = worst_csa(&r->reference);
    if (w >= 0) {
        const moe_bisect_layer *L = &x->layers[w];
        if (L->dense) snprintf(needle, sizeof needle, "L%d %d/%d dense", w, L->kept, L->needle_entries);
        else snprintf(needle, sizeof needle, "L%d %d/%d r%lld %+.2f", w, L->kept, L->needle_entries, (long long)L->best_rank,
                      L->margin);
    }
    double mass = 0;
    for (int l = 0; l < x->n_layers; l++) mass += x->layers[l].mass;
    fprintf(f, "%-9s %-34s %-22s %8.3f %10.3g %6d%s %11.4f %10.3g\n", grade, name, needle, mass / (x->n_layers ? x->n_layers : 1),
            x->kl, x->top1, x->top1_agrees ? " " : "*", x->answer_logprob, last_err(x));
}

moe_status moe_bisect_report_text(FILE *f, const moe_bisect_report *r, const moe_bisect_grid *g) {
    if (r) {
        const moe_fwd_config *c = r->cfg;
        fprintf(f, "moeaudit bisect: %s (%d layers:", r->model, c->n_layers);
        for (int l = 0; l < c->n_layers; l++) {
            if (c->attn[l] == MOE_ATTN_CSA) fprintf(f, " csa/%d", c->ratio[l]);
            else if (c->attn[l] == MOE_ATTN_HCA) fprintf(f, " hca/%d", c->ratio[l]);
            else fprintf(f, " sliding");
        }
        fprintf(f, "; index_topk %d, window %d)\n", c->index_topk, c->window);
        fprintf(f, "prompt %lld tokens, needle %lld:%lld, query %lld as %s", (long long)r->n_ids, (long long)r->needle_start,
                (long long)r->needle_end, (long long)r->query,
                r->decode_from == r->query ? "a decode step after the prefill" : "the prefill's last position");
        if (r->n_answer) fprintf(f, ", answer of %d ids", r->n_answer);
        fprintf(f, "\n\n%-9s %-34s %-22s %8s %10s %7s %11s %10s\n", "grade", "run", "needle (worst CSA)", "mass/L", "KL nats",
                "top-1", "answer lp", "err out");
        text_row(f, r, "", "reference (float64)", &r->reference);
        for (int i = 0; i < r->n_runs; i++)
            text_row(f, r, moe_bisect_grade_name(r->results[i].grade), r->runs[i].name, &r->results[i]);
        fprintf(f, "\n(needle: CSA layer with the fewest needle entries kept / entries, best rank, margin to the cut in "
                   "sigma; mass/L: attention weight on the needle summed over heads, mean over layers; * top-1 differs)\n");
        fprintf(f, "\nverdict: %s\n", r->verdict);
    }
    if (g && g->n_cells) {
        fprintf(f, "\nneedle in a haystack (deployment vs reference; onset of discarding at %lld tokens):\n", (long long)g->onset);
        fprintf(f, "%8s %7s %6s %9s %9s %10s %10s %s\n", "length", "depth", "mod", "ref kept", "dep kept", "min margin", "KL",
                "grade");
        for (int i = 0; i < g->n_cells; i++) {
            const moe_bisect_cell *c = &g->cells[i];
            if (c->status != MOE_OK) {
                fprintf(f, "%8lld %7.2f %6lld failed: %s\n", (long long)c->length, c->depth,
                        (long long)(g->ratio ? c->length % g->ratio : 0), c->msg);
                continue;
            }
            fprintf(f, "%8lld %7.2f %6lld %5d/%-3d %5d/%-3d %10.3f %10.3g %s%s\n", (long long)c->length, c->depth,
                    (long long)(g->ratio ? c->length % g->ratio : 0), c->ref_kept_layers, c->csa_layers,
                    c->dep_kept_layers, c->csa_layers, c->dep_min_margin, c->kl, moe_bisect_grade_name(c->grade),
                    c->sparse ? "" : " (dense)");
        }
    }
    return ferror(f) ? MOE_ERR_IO : MOE_OK;
}

/* ------------------------------------------------------------------ JSON */

static void add_num(cJSON *o, const char *k, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, k, v);
    else cJSON_AddNullToObject(o, k);
}

static cJSON *result_json(const moe_bisect_result *x) {
    cJSON *o = cJSON_CreateObject();
    if (x->status != MOE_OK) {
        cJSON_AddStringToObject(o, "status", moe_status_str(x->status));
        cJSON_AddStringToObject(o, "error", x->msg);
        return o;
    }
    cJSON_AddStringToObject(o, "status", "ok");
    add_num(o, "kl", x->kl);
    cJSON_AddNumberToObject(o, "top1", x->top1);
    cJSON_AddBoolToObject(o, "top1_agrees", x->top1_agrees);
    add_num(o, "answer_logprob", x->answer_logprob);
    add_num(o, "logits_err", x->logits_err);
    cJSON *ls = cJSON_AddArrayToObject(o, "layers");
    for (int l = 0; l < x->n_layers; l++) {
        const moe_bisect_layer *L = &x->layers[l];
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "layer", L->layer);
        cJSON_AddStringToObject(e, "attention", type_name(L));
        if (L->type != MOE_ATTN_SLIDING) {
            cJSON_AddNumberToObject(e, "visible", (double)L->visible);
            cJSON_AddNumberToObject(e, "needle_entries", L->needle_entries);
            cJSON_AddNumberToObject(e, "kept", L->kept);
        }
        if (L->type == MOE_ATTN_CSA) {
            cJSON_AddNumberToObject(e, "topk", L->topk);
            cJSON_AddBoolToObject(e, "dense", L->dense);
            cJSON_AddNumberToObject(e, "best_rank", (double)L->best_rank);
            add_num(e, "best_score", L->best_score);
            if (!L->dense) {
                add_num(e, "cutoff", L->cutoff);
                add_num(e, "margin", L->margin);
            }
        }
        add_num(e, "mass", L->mass);
        add_num(e, "stream_err", L->stream_err);
        cJSON_AddItemToArray(ls, e);
    }
    return o;
}

static cJSON *mask_names(const moe_patch_set *s, uint64_t mask) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < moe_patch_set_count(s); i++)
        if (mask >> i & 1) cJSON_AddItemToArray(a, cJSON_CreateString(moe_patch_set_at(s, i)->text));
    return a;
}

moe_status moe_bisect_report_json(FILE *f, const moe_bisect_report *r, const moe_bisect_grid *g) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return MOE_ERR_NOMEM;
    cJSON_AddNumberToObject(j, "schema_version", 1); /* docs/schemas/bisect.schema.json */
    cJSON_AddStringToObject(j, "tool", "moeaudit " MOEAUDIT_VERSION);
    cJSON_AddStringToObject(j, "report", "bisect");
    if (r) {
        const moe_fwd_config *c = r->cfg;
        cJSON_AddStringToObject(j, "model", r->model);
        cJSON *ly = cJSON_AddArrayToObject(j, "model_layers");
        for (int l = 0; l < c->n_layers; l++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "layer", l);
            cJSON_AddStringToObject(e, "attention", moe_attn_type_name(c->attn[l]));
            cJSON_AddNumberToObject(e, "ratio", c->ratio[l]);
            cJSON_AddItemToArray(ly, e);
        }
        cJSON_AddNumberToObject(j, "index_topk", c->index_topk);
        cJSON_AddNumberToObject(j, "window", c->window);
        cJSON *p = cJSON_AddObjectToObject(j, "prompt");
        cJSON_AddNumberToObject(p, "tokens", (double)r->n_ids);
        cJSON *nd = cJSON_AddArrayToObject(p, "needle");
        cJSON_AddItemToArray(nd, cJSON_CreateNumber((double)r->needle_start));
        cJSON_AddItemToArray(nd, cJSON_CreateNumber((double)r->needle_end));
        cJSON_AddNumberToObject(p, "query", (double)r->query);
        cJSON_AddNumberToObject(p, "decode_from", (double)r->decode_from);
        cJSON *an = cJSON_AddArrayToObject(p, "answer");
        for (int i = 0; i < r->n_answer; i++) cJSON_AddItemToArray(an, cJSON_CreateNumber((double)r->answer[i]));
        cJSON *ch = cJSON_AddArrayToObject(p, "prefill_chunks");
        for (int i = 0; i < r->n_chunks; i++) cJSON_AddItemToArray(ch, cJSON_CreateNumber((double)r->chunks[i]));
        cJSON *ps = cJSON_AddArrayToObject(j, "patches");
        for (int i = 0; i < moe_patch_set_count(r->patches); i++) {
            const moe_patch *q = moe_patch_set_at(r->patches, i);
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "patch", q->text);
            cJSON *comp = cJSON_AddArrayToObject(e, "components");
            for (int k = 0; k < q->info->n_set; k++)
                cJSON_AddItemToArray(comp, cJSON_CreateString(moe_patch_comp_name(q->info->comp[k])));
            cJSON *lr = cJSON_AddArrayToObject(e, "layers");
            cJSON_AddItemToArray(lr, cJSON_CreateNumber(q->first));
            cJSON_AddItemToArray(lr, cJSON_CreateNumber(q->last));
            cJSON_AddStringToObject(e, "phase", moe_phase_name(q->phase));
            cJSON_AddNumberToObject(e, "first_changed_layer", q->first_changed);
            cJSON_AddStringToObject(e, "what", q->info->what);
            cJSON_AddItemToArray(ps, e);
        }
        cJSON_AddItemToObject(j, "reference", result_json(&r->reference));
        cJSON *rs = cJSON_AddArrayToObject(j, "runs");
        for (int i = 0; i < r->n_runs; i++) {
            const moe_bisect_run_info *ri = &r->runs[i];
            const moe_bisect_result *x = &r->results[i];
            cJSON *e = result_json(x);
            cJSON_AddStringToObject(e, "run", ri->name);
            cJSON_AddStringToObject(e, "kind", moe_bisect_kind_name(ri->kind));
            cJSON_AddItemToObject(e, "patches", mask_names(r->patches, ri->mask));
            cJSON_AddNumberToObject(e, "start_layer", ri->start_layer);
            cJSON_AddBoolToObject(e, "prefix_shared", ri->prefix_shared);
            if (x->status == MOE_OK) {
                cJSON_AddStringToObject(e, "grade", moe_bisect_grade_name(x->grade));
                cJSON_AddBoolToObject(e, "needle_lost", x->needle_lost);
                if (x->needle_lost) cJSON_AddNumberToObject(e, "lost_layer", x->lost_layer);
                cJSON_AddBoolToObject(e, "output_changed", x->output_changed);
            }
            cJSON_AddItemToArray(rs, e);
        }
        cJSON *v = cJSON_AddObjectToObject(j, "verdict");
        cJSON_AddStringToObject(v, "sentence", r->verdict);
        cJSON_AddItemToObject(v, "culprits", mask_names(r->patches, r->culprits));
        cJSON_AddItemToObject(v, "harmful_alone", mask_names(r->patches, r->harmful_alone));
        cJSON_AddItemToObject(v, "harmless", mask_names(r->patches, r->harmless));
    }
    if (g && g->n_cells) {
        cJSON *gj = cJSON_AddObjectToObject(j, "grid");
        cJSON_AddNumberToObject(gj, "onset_tokens", (double)g->onset);
        cJSON_AddNumberToObject(gj, "ratio", g->ratio);
        cJSON *cs = cJSON_AddArrayToObject(gj, "cells");
        for (int i = 0; i < g->n_cells; i++) {
            const moe_bisect_cell *c = &g->cells[i];
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "length", (double)c->length);
            cJSON_AddNumberToObject(e, "depth", c->depth);
            cJSON_AddNumberToObject(e, "length_mod_ratio", (double)(g->ratio ? c->length % g->ratio : 0));
            cJSON_AddNumberToObject(e, "needle_start", (double)c->needle_start);
            if (c->status != MOE_OK) {
                cJSON_AddStringToObject(e, "status", moe_status_str(c->status));
                cJSON_AddStringToObject(e, "error", c->msg);
            } else {
                cJSON_AddStringToObject(e, "status", "ok");
                cJSON_AddBoolToObject(e, "sparse", c->sparse);
                cJSON_AddNumberToObject(e, "csa_layers", c->csa_layers);
                cJSON_AddNumberToObject(e, "ref_kept_layers", c->ref_kept_layers);
                cJSON_AddNumberToObject(e, "dep_kept_layers", c->dep_kept_layers);
                add_num(e, "dep_min_margin", c->dep_min_margin);
                add_num(e, "kl", c->kl);
                cJSON_AddBoolToObject(e, "top1_agrees", c->top1_agrees);
                add_num(e, "answer_logprob_ref", c->answer_logprob_ref);
                add_num(e, "answer_logprob_dep", c->answer_logprob_dep);
                cJSON_AddStringToObject(e, "grade", moe_bisect_grade_name(c->grade));
            }
            cJSON_AddItemToArray(cs, e);
        }
    }
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text) return MOE_ERR_NOMEM;
    int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    free(text);
    return ok ? MOE_OK : MOE_ERR_IO;
}

/* ------------------------------------------------------------------ HTML */


#define C_OK "#c8e6c9"
#define C_MARG "#ffe0b2"
#define C_BAD "#ffcdd2"
#define C_NA "#eeeeee"

static const char *grade_bg(moe_bisect_grade g) {
    return g == MOE_BISECT_HARMFUL ? C_BAD : g == MOE_BISECT_MARGINAL ? C_MARG : C_OK;
}

static void cell(FILE *f, const char *bg, const char *fmt, double v) {
    fprintf(f, "<td style=\"background:%s\">", bg);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("&ndash;", f);
    fputs("</td>", f);
}

/* One row of the run x metric matrix; each metric coloured by its own harm. */
static void matrix_row(FILE *f, const moe_bisect_report *r, const char *name, const char *kind, const moe_bisect_result *x,
                       bool is_ref) {
    const moe_bisect_result *R = &r->reference;
    fputs("<tr><td class=\"l\">", f);
    moe_html_esc(f, name);
    fprintf(f, "</td><td class=\"l\">%s</td>", kind);
    if (x->status != MOE_OK) {
        fputs("<td colspan=\"8\" class=\"l\" style=\"background:" C_NA "\">failed: ", f);
        moe_html_esc(f, x->msg);
        fputs("</td></tr>\n", f);
        return;
    }
    fprintf(f, "<td style=\"background:%s\"><b>%s</b></td>", is_ref ? C_NA : grade_bg(x->grade),
            is_ref ? "reference" : moe_bisect_grade_name(x->grade));
    /* needle: CSA layers keeping an entry, of those where the reference does */
    int ref_k = 0, k = 0, csa = 0;
    double min_margin = INFINITY, ref_margin = INFINITY;
    for (int l = 0; l < x->n_layers; l++) {
        if (x->layers[l].type != MOE_ATTN_CSA) continue;
        csa++;
        ref_k += R->layers[l].kept > 0;
        k += x->layers[l].kept > 0 && R->layers[l].kept > 0;
        if (!x->layers[l].dense && x->layers[l].margin < min_margin) min_margin = x->layers[l].margin;
        if (!R->layers[l].dense && R->layers[l].margin < ref_margin) ref_margin = R->layers[l].margin;
    }
    if (ref_k == 0) fputs("<td style=\"background:" C_NA "\" title=\"the reference keeps none\">0 / 0</td>", f);
    else fprintf(f, "<td style=\"background:%s\">%d / %d</td>", x->needle_lost ? C_BAD : k < ref_k ? C_MARG : C_OK, k, ref_k);
    /* red: the reference keeps the needle above the cut and this run does not; orange: half a sigma lower */
    cell(f, is_ref || !isfinite(min_margin) ? C_NA
            : ref_margin >= 0 && min_margin < 0 ? C_BAD
            : min_margin < ref_margin - 0.5 ? C_MARG : C_OK, "%+.2f", min_margin);
    double mass = 0, mref = 0;
    for (int l = 0; l < x->n_layers; l++) {
        mass += x->layers[l].mass;
        mref += R->layers[l].mass;
    }
    cell(f, mref > 0 && fabs(mass - mref) > 0.5 * mref ? C_MARG : C_OK, "%.3f", mass);
    cell(f, x->kl > 0.1 ? C_BAD : x->kl > 1e-3 ? C_MARG : C_OK, "%.3g", x->kl);
    fprintf(f, "<td style=\"background:%s\">%d</td>", x->top1_agrees ? C_OK : C_BAD, x->top1);
    double d = x->answer_logprob - R->answer_logprob;
    if (r->n_answer) cell(f, d < -0.6931 ? C_BAD : fabs(d) > 0.05 ? C_MARG : C_OK, "%+.3f", d);
    else fputs("<td style=\"background:" C_NA "\">&ndash;</td>", f);
    cell(f, C_NA, "%.3g", last_err(x));
    fputs("</tr>\n", f);
}

static const char *const line_colors[] = {"#1565c0", "#c62828", "#2e7d32", "#8e24aa", "#ef6c00", "#00838f",
                                          "#6d4c41", "#ad1457", "#558b2f", "#283593", "#f9a825", "#37474f"};

/* Lines of one per-layer value over runs: the reference, each patch alone, the deployment. */
static void layer_chart(FILE *f, const moe_bisect_report *r, const char *title, int what, bool logy) {
    const int nl = r->reference.n_layers;
    int xs[MOE_BISECT_MAX_LAYERS], nx = 0;
    for (int l = 0; l < nl; l++)
        if (what == 0 ? r->reference.layers[l].type == MOE_ATTN_CSA && !r->reference.layers[l].dense : true) xs[nx++] = l;
    if (nx == 0) {
        fprintf(f, "<p class=\"muted\">%s: no CSA layer discards entries at this prompt length (dense).</p>\n", title);
        return;
    }
    const moe_bisect_result *series[64];
    const char *labels[64];
    int ns = 0;
    series[ns] = &r->reference;
    labels[ns++] = "reference";
    for (int i = 0; i < r->n_runs && ns < 64; i++) {
        if (r->results[i].status != MOE_OK) continue;
        if (r->runs[i].kind == MOE_BISECT_ALONE || r->runs[i].kind == MOE_BISECT_ALL || r->runs[i].kind == MOE_BISECT_FIX) {
            series[ns] = &r->results[i];
            labels[ns++] = r->runs[i].name;
        }
    }
    double lo = INFINITY, hi = -INFINITY;
    for (int s = 0; s < ns; s++)
        for (int k = 0; k < nx; k++) {
            const moe_bisect_layer *L = &series[s]->layers[xs[k]];
            double v = what == 0 ? L->margin : L->stream_err;
            if (logy) {
                if (!(v > 0)) continue;
                v = log10(v);
            }
            if (!isfinite(v)) continue;
            if (v < lo) lo = v;
            if (v > hi) hi = v;
        }
    if (what == 0) {
        if (lo > 0) lo = 0;
        if (hi < 0) hi = 0;
    }
    if (!(hi > lo)) {
        hi = lo + 1;
    }
    const int W = 860, Hh = 300, L0 = 70, R0 = 250, T0 = 20, B0 = 40;
    const int pw = W - L0 - R0, ph = Hh - T0 - B0;
#define XP(k) (L0 + (nx == 1 ? pw / 2.0 : pw * (double)(k) / (nx - 1)))
#define YP(v) (T0 + ph * (1 - ((v) - lo) / (hi - lo)))
    fprintf(f, "<figure><figcaption>%s</figcaption>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "font-family=\"sans-serif\" font-size=\"11\">\n", title, W, Hh);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#bbb\"/>\n", L0, T0, pw, ph);
    for (int t = 0; t <= 4; t++) {
        double v = lo + (hi - lo) * t / 4;
        fprintf(f, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">", L0 - 4, YP(v) + 4);
        if (logy) fprintf(f, "1e%.1f", v);
        else fprintf(f, "%.2f", v);
        fputs("</text>\n", f);
    }
    if (what == 0)
        fprintf(f, "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#c62828\" stroke-dasharray=\"5 3\"/>"
                   "<text x=\"%d\" y=\"%.1f\" fill=\"#c62828\">cut (top-k)</text>\n",
                L0, L0 + pw, YP(0), YP(0), L0 + 4, YP(0) - 4);
    for (int k = 0; k < nx; k++)
        fprintf(f, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%d</text>\n", XP(k), T0 + ph + 16, xs[k]);
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">layer</text>\n", L0 + pw / 2, Hh - 6);
    for (int s = 0; s < ns; s++) {
        const char *col = line_colors[s % 12];
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\" points=\"", col, s == 0 ? "3" : "1.6");
        for (int k = 0; k < nx; k++) {
            const moe_bisect_layer *L = &series[s]->layers[xs[k]];
            double v = what == 0 ? L->margin : L->stream_err;
            if (logy) v = v > 0 ? log10(v) : lo;
            if (!isfinite(v)) continue;
            fprintf(f, "%.1f,%.1f ", XP(k), YP(v));
        }
        fputs("\"/>\n", f);
        for (int k = 0; k < nx && what == 0; k++) {
            const moe_bisect_layer *L = &series[s]->layers[xs[k]];
            fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"><title>", XP(k), YP(L->margin), col);
            moe_html_esc(f, labels[s]);
            fprintf(f, ", layer %d: rank %lld of %lld, margin %+.3f, %d/%d kept</title></circle>\n", xs[k],
                    (long long)L->best_rank, (long long)L->visible, L->margin, L->kept, L->needle_entries);
        }
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"4\" fill=\"%s\"/><text x=\"%d\" y=\"%d\">", W - R0 + 12,
                T0 + 6 + 15 * s, col, W - R0 + 30, T0 + 10 + 15 * s);
        moe_html_esc(f, labels[s]);
        fputs("</text>\n", f);
    }
#undef XP
#undef YP
    fputs("</svg></figure>\n", f);
}

static void heatmap(FILE *f, const moe_bisect_grid *g) {
    int64_t lens[256];
    double deps[64];
    int nlen = 0, ndep = 0;
    for (int i = 0; i < g->n_cells; i++) {
        bool seen = false;
        for (int k = 0; k < nlen; k++) seen |= lens[k] == g->cells[i].length;
        if (!seen && nlen < 256) lens[nlen++] = g->cells[i].length;
        seen = false;
        for (int k = 0; k < ndep; k++) seen |= deps[k] == g->cells[i].depth;
        if (!seen && ndep < 64) deps[ndep++] = g->cells[i].depth;
    }
    const int cw = nlen > 24 ? 30 : 56, ch = 34, L0 = 80, T0 = 40;
    const int W = L0 + nlen * cw + 20, Hh = T0 + ndep * ch + 70;
    fprintf(f, "<figure><figcaption>Needle in a haystack: the deployment against the reference, prompt length x "
               "needle depth (cell: smallest margin to the top-k cut over CSA layers, in sigma)</figcaption>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
               "font-size=\"11\">\n", W, Hh);
    for (int a = 0; a < nlen; a++) {
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%lld</text>", L0 + a * cw + cw / 2, T0 - 20,
                (long long)lens[a]);
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"%s\">mod %d: %lld</text>\n", L0 + a * cw + cw / 2,
                T0 - 6, g->ratio && lens[a] % g->ratio == g->ratio - 1 ? "#c62828" : "#777", g->ratio,
                (long long)(g->ratio ? lens[a] % g->ratio : 0));
    }
    for (int d = 0; d < ndep; d++) {
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">depth %.2f</text>\n", L0 - 6, T0 + d * ch + ch / 2 + 4,
                deps[d]);
        for (int a = 0; a < nlen; a++) {
            const moe_bisect_cell *c = NULL;
            for (int i = 0; i < g->n_cells; i++)
                if (g->cells[i].length == lens[a] && g->cells[i].depth == deps[d]) c = &g->cells[i];
            if (!c) continue;
            const char *bg = c->status != MOE_OK ? C_NA
                             : c->ref_kept_layers < c->csa_layers ? "#cfd8dc"
                                                                  : grade_bg(c->grade);
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" stroke=\"#fff\"><title>length "
                       "%lld, depth %.2f: %s; CSA layers keeping the needle: reference %d, deployment %d of %d; KL %.3g"
                       "</title></rect>\n",
                    L0 + a * cw, T0 + d * ch, cw, ch, bg, (long long)c->length, c->depth,
                    c->status != MOE_OK ? "failed" : moe_bisect_grade_name(c->grade), c->ref_kept_layers,
                    c->dep_kept_layers, c->csa_layers, c->kl);
            if (c->status == MOE_OK)
                fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%s</text>\n", L0 + a * cw + cw / 2,
                        T0 + d * ch + ch / 2 + 4, c->sparse ? "" : "dense");
            if (c->status == MOE_OK && c->sparse)
                fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%+.1f</text>\n", L0 + a * cw + cw / 2,
                        T0 + d * ch + ch / 2 + 4, c->dep_min_margin);
        }
    }
    /* the onset: the first length past index_topk x ratio */
    for (int a = 0; a < nlen; a++)
        if (lens[a] > g->onset && (a == 0 || lens[a - 1] <= g->onset)) {
            int x = L0 + a * cw;
            fprintf(f, "<line x1=\"%d\" x2=\"%d\" y1=\"%d\" y2=\"%d\" stroke=\"#c62828\" stroke-width=\"2\"/>"
                       "<text x=\"%d\" y=\"%d\" fill=\"#c62828\">onset: %lld tokens = index_topk x ratio</text>\n",
                    x, x, T0 - 2, T0 + ndep * ch + 4, x + 3, T0 + ndep * ch + 18, (long long)g->onset);
            break;
        }
    int ly = T0 + ndep * ch + 40;
    const char *lab[] = {"harmless", "marginal", "harmful", "the reference loses it too"};
    const char *col[] = {C_OK, C_MARG, C_BAD, "#cfd8dc"};
    for (int i = 0; i < 4; i++)
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/><text x=\"%d\" y=\"%d\">%s</text>\n",
                L0 + 150 * i, ly, col[i], L0 + 150 * i + 16, ly + 10, lab[i]);
    fputs("</svg></figure>\n", f);
}

moe_status moe_bisect_report_html(FILE *f, const moe_bisect_report *r, const moe_bisect_grid *g) {
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>moeaudit bisect</title>\n<style>\n"
          "body{font-family:sans-serif;max-width:1150px;margin:2em auto;color:#222;padding:0 1em}\n"
          "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{padding:4px 8px;border:1px solid #fff;"
          "text-align:right}td.l,th.l{text-align:left}th{background:#455a64;color:#fff}\n"
          ".v{background:#fff8e1;border-left:5px solid #ef6c00;padding:.8em 1em;font-size:15px}\n"
          "figure{margin:1.5em 0}figcaption{font-weight:bold;margin-bottom:.4em}.muted{color:#666}\n"
          "</style></head><body>\n<h1>moeaudit bisect</h1>\n", f);
    if (r) {
        const moe_fwd_config *c = r->cfg;
        fputs("<p>Model: <b>", f);
        moe_html_esc(f, r->model);
        fprintf(f, "</b>, %d layers (", c->n_layers);
        for (int l = 0; l < c->n_layers; l++)
            fprintf(f, "%s%s%s", l ? " " : "", moe_attn_type_name(c->attn[l]), "");
        fprintf(f, "), index_topk %d, window %d. Prompt: %lld tokens, needle at %lld:%lld, query at %lld as %s%s.</p>\n",
                c->index_topk, c->window, (long long)r->n_ids, (long long)r->needle_start, (long long)r->needle_end,
                (long long)r->query,
                r->decode_from == r->query ? "a decode step after the prefill" : "the prefill's last position",
                r->n_answer ? ", answer teacher-forced" : "");
        fputs("<p class=\"v\"><b>Verdict.</b> ", f);
        moe_html_esc(f, r->verdict);
        fputs("</p>\n<h2>Runs x metrics</h2>\n<table><tr><th class=\"l\">run</th><th class=\"l\">kind</th><th>grade</th>"
              "<th>CSA layers keeping the needle</th><th>smallest margin (&sigma;)</th><th>needle weight (sum over "
              "layers)</th><th>KL nats</th><th>top-1</th><th>answer &Delta;log p</th><th>stream err (last layer)</th></tr>\n",
              f);
        matrix_row(f, r, "reference (float64)", "reference", &r->reference, true);
        for (int i = 0; i < r->n_runs; i++)
            matrix_row(f, r, r->runs[i].name, moe_bisect_kind_name(r->runs[i].kind), &r->results[i], false);
        fputs("</table>\n<p class=\"muted\">Colours: red harmful, orange marginal, green harmless, per metric (docs/bisect.md "
              "gives the thresholds). Margin: the best needle entry's indexer score minus the top-k cut among the "
              "other entries, in units of the reference's score spread.</p>\n", f);
        layer_chart(f, r, "The needle's margin to the top-k cut per CSA layer (sigma units; below the dashed line it is "
                          "discarded)", 0, false);
        layer_chart(f, r, "Stream error at the query, layer by layer (relative, log scale)", 1, true);
        fputs("<h2>Patches</h2>\n<table><tr><th class=\"l\">patch</th><th class=\"l\">layers</th><th class=\"l\">phase</th>"
              "<th class=\"l\">what it models</th></tr>\n", f);
        for (int i = 0; i < moe_patch_set_count(r->patches); i++) {
            const moe_patch *p = moe_patch_set_at(r->patches, i);
            fputs("<tr><td class=\"l\">", f);
            moe_html_esc(f, p->text);
            fprintf(f, "</td><td class=\"l\">%d..%d (first changed: %d)</td><td class=\"l\">%s</td><td class=\"l\">", p->first,
                    p->last, p->first_changed, moe_phase_name(p->phase));
            moe_html_esc(f, p->info->what);
            fputs("</td></tr>\n", f);
        }
        fputs("</table>\n", f);
    }
    if (g && g->n_cells) heatmap(f, g);
    fputs("<p class=\"muted\">Made by moeaudit " MOEAUDIT_VERSION ". Self-contained: no scripts, no network.</p>\n"
          "</body></html>\n", f);
    return ferror(f) ? MOE_ERR_IO : MOE_OK;
}
