/*
 * Audit reports: a text table, JSON, and one self-contained HTML page with
 * inline SVG charts (no scripts, no network). Writers take a FILE * the
 * caller opened; they never print elsewhere.
 *
 * Invariants:
 *  1. Every report sorts rows by moe_audit_harm_cmp (within each layer for
 *     the tables) and opens with the same headline: the most harmful row
 *     (moe_audit_summarize) and the count of rows per grade.
 *  2. Colours are the grade's everywhere (PASS green, MARGINAL amber, FAIL
 *     red, not run grey), in the charts, the heatmap and the tables.
 *  3. The HTML's size is bounded in layers: the bar charts show each path's
 *     worst layer (one bar per path), the path x layer heatmap's cells
 *     shrink to fit (never below 8 px), its layer labels thin out to stay
 *     legible, and the per-layer tables fold (<details>) but the worst one.
 */
#include "audit/tolerances.h"
#include "core/core.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

static double sqnr_db(double nmse) { return nmse > 0 ? -10.0 * log10(nmse) : INFINITY; }

static int row_cmp(const void *a, const void *b) {
    const moe_audit_row *x = *(const moe_audit_row *const *)a, *y = *(const moe_audit_row *const *)b;
    if (x->layer != y->layer) return x->layer - y->layer;
    int c = moe_audit_harm_cmp(x, y);
    return c ? c : strcmp(x->path.name, y->path.name);
}

/* Pointers to rows [n], by layer then harm. */
static const moe_audit_row **sorted(const moe_audit_row *rows, int n) {
    const moe_audit_row **s = moe_malloc((size_t)n + 1, sizeof *s);
    if (!s) return NULL;
    for (int i = 0; i < n; i++) s[i] = &rows[i];
    qsort(s, (size_t)n, sizeof *s, row_cmp);
    return s;
}

static const char *kind_name(moe_layer_kind k) { return k == MOE_LAYER_HASH ? "hash" : k == MOE_LAYER_TOPK ? "top-k" : "dense"; }

static const char *row_grade_name(const moe_audit_row *r) {
    bool ran;
    moe_grade g = moe_audit_row_grade(r, &ran);
    return ran ? moe_grade_name(g) : "n/a";
}

/* The headline: the most harmful row and its cost, then the counts. */
static void headline(char *buf, size_t n, const moe_audit_summary *s, int nrows) {
    const moe_audit_row *w = s->worst;
    size_t used = 0;
    if (!w) {
        used = (size_t)snprintf(buf, n, "No path could run");
    } else if (w->status == MOE_ERR_INVARIANT) {
        used = (size_t)snprintf(buf, n, "Worst: %s on layer %d breaks the scaling contract (%.200s)", w->path.name,
                                w->layer, w->note);
    } else {
        double db = sqnr_db(w->nmse);
        char cost[96];
        if (isnan(w->nmse)) snprintf(cost, sizeof cost, "NaN output");
        else if (isinf(db)) snprintf(cost, sizeof cost, "exact output");
        else snprintf(cost, sizeof cost, "%.1f dB SQNR", db);
        used = (size_t)snprintf(buf, n, "%s %s on layer %d: %s, %lld of %lld tokens routed differently (%s)",
                                w->grade == MOE_GRADE_PASS ? "Every path passes; the costliest is" : "Worst shortcut:",
                                w->path.name, w->layer, cost, (long long)w->flips, (long long)w->tokens,
                                moe_grade_name(w->grade));
    }
    if (used < n) used += (size_t)snprintf(buf + used, n - used, ". Rows: %d FAIL", s->n_grade[MOE_GRADE_FAIL]);
    if (used < n && s->n_broken) used += (size_t)snprintf(buf + used, n - used, " (%d with the contract broken)", s->n_broken);
    if (used < n)
        used += (size_t)snprintf(buf + used, n - used, ", %d MARGINAL, %d PASS", s->n_grade[MOE_GRADE_MARGINAL],
                                 s->n_grade[MOE_GRADE_PASS]);
    if (used < n && s->n_not_run) used += (size_t)snprintf(buf + used, n - used, ", %d not run", s->n_not_run);
    if (used < n) snprintf(buf + used, n - used, " (of %d)", nrows);
}

/* ------------------------------------------------------------------ text */

moe_status moe_audit_report_text(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n) {
    const moe_audit_row **s = sorted(rows, n);
    if (!s) return MOE_ERR_NOMEM;
    moe_audit_summary sum;
    moe_audit_summarize(rows, n, &sum);
    char head[768];
    headline(head, sizeof head, &sum, n);
    fprintf(f, "moeaudit audit: %s\n", m->model);
    fprintf(f, "%lld tokens per layer; reference: float64 on the checkpoint's weights; grades: PASS >= %.0f dB, "
            "MARGINAL >= %.0f dB SQNR, flips <= %.0f%% / %.0f%%\n", (long long)m->tokens, MOE_GRADE_PASS_SQNR_DB,
            MOE_GRADE_MARGINAL_SQNR_DB, 100 * MOE_GRADE_PASS_FLIPS, 100 * MOE_GRADE_MARGINAL_FLIPS);
    fprintf(f, "%s.\n", head);
    int last = -1;
    for (int i = 0; i < n; i++) {
        const moe_audit_row *r = s[i];
        if (r->layer != last) {
            last = r->layer;
            fprintf(f, "\nlayer %d (%s), sorted by harm\n", r->layer, kind_name(r->kind));
            fprintf(f, "  %-8s %-44s %9s %10s %9s %7s %8s\n", "grade", "path", "SQNR dB", "NMSE", "max rel", "flips",
                    "time s");
        }
        if (r->status != MOE_OK) {
            fprintf(f, "  %-8s %-44s  %s: %s\n", row_grade_name(r), r->path.name,
                    r->status == MOE_ERR_INVARIANT ? "broken" : "not run", r->note);
            continue;
        }
        fprintf(f, "  %-8s %-44s %9.1f %10.3g %9.3g %7lld %8.2f\n", moe_grade_name(r->grade), r->path.name,
                sqnr_db(r->nmse), r->nmse, r->max_rel, (long long)r->flips, r->seconds);
    }
    free(s);
    return ferror(f) ? MOE_ERR_IO : MOE_OK;
}

/* ------------------------------------------------------------------ JSON */

static const char *const qn[] = {"none", "fp8", "mxfp4", "nvfp4"};
static const char *const routern[] = {"path", "bf16-input", "bf16-logits"};

static int count_layers(const moe_audit_row *rows, int n) {
    int nl = 0;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int k = 0; k < i && !seen; k++) seen = rows[k].layer == rows[i].layer;
        nl += !seen;
    }
    return nl;
}

moe_status moe_audit_report_json(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return MOE_ERR_NOMEM;
    moe_audit_summary sum;
    moe_audit_summarize(rows, n, &sum);
    char head[768];
    headline(head, sizeof head, &sum, n);
    cJSON_AddNumberToObject(j, "schema_version", 1);
    cJSON_AddStringToObject(j, "tool", "moeaudit " MOEAUDIT_VERSION);
    cJSON_AddStringToObject(j, "report", "audit");
    cJSON_AddStringToObject(j, "model", m->model);
    cJSON_AddNumberToObject(j, "tokens", (double)m->tokens);
    cJSON_AddStringToObject(j, "isa", m->isa ? m->isa : "");
    cJSON_AddNumberToObject(j, "seconds", m->seconds);
    cJSON_AddStringToObject(j, "headline", head);
    cJSON *su = cJSON_AddObjectToObject(j, "summary");
    cJSON_AddNumberToObject(su, "rows", n);
    cJSON_AddNumberToObject(su, "layers", count_layers(rows, n));
    cJSON_AddNumberToObject(su, "pass", sum.n_grade[MOE_GRADE_PASS]);
    cJSON_AddNumberToObject(su, "marginal", sum.n_grade[MOE_GRADE_MARGINAL]);
    cJSON_AddNumberToObject(su, "fail", sum.n_grade[MOE_GRADE_FAIL]);
    cJSON_AddNumberToObject(su, "contract_broken", sum.n_broken);
    cJSON_AddNumberToObject(su, "not_run", sum.n_not_run);
    if (sum.worst) {
        cJSON *w = cJSON_AddObjectToObject(su, "worst");
        cJSON_AddNumberToObject(w, "layer", sum.worst->layer);
        cJSON_AddStringToObject(w, "id", sum.worst->path.id ? sum.worst->path.id : "");
        cJSON_AddStringToObject(w, "path", sum.worst->path.name);
        cJSON_AddStringToObject(w, "grade", row_grade_name(sum.worst));
    } else {
        cJSON_AddNullToObject(su, "worst");
    }
    cJSON *g = cJSON_AddObjectToObject(j, "grading");
    cJSON_AddNumberToObject(g, "pass_sqnr_db", MOE_GRADE_PASS_SQNR_DB);
    cJSON_AddNumberToObject(g, "marginal_sqnr_db", MOE_GRADE_MARGINAL_SQNR_DB);
    cJSON_AddNumberToObject(g, "pass_flip_fraction", MOE_GRADE_PASS_FLIPS);
    cJSON_AddNumberToObject(g, "marginal_flip_fraction", MOE_GRADE_MARGINAL_FLIPS);
    cJSON *arr = cJSON_AddArrayToObject(j, "rows");
    const moe_audit_row **s = sorted(rows, n);
    for (int i = 0; s && i < n; i++) {
        const moe_audit_row *r = s[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "layer", r->layer);
        cJSON_AddStringToObject(o, "layer_kind", kind_name(r->kind));
        cJSON_AddStringToObject(o, "id", r->path.id ? r->path.id : "");
        cJSON_AddStringToObject(o, "path", r->path.name);
        cJSON_AddStringToObject(o, "group", r->path.group ? r->path.group : "");
        cJSON_AddStringToObject(o, "patches", r->path.patches);
        cJSON_AddStringToObject(o, "precision", r->path.precision == MOE_PREC_REF ? "ref" : "f32");
        cJSON_AddStringToObject(o, "activations", moe_act_prec_name(r->path.act));
        cJSON_AddStringToObject(o, "router", routern[r->path.router]);
        cJSON_AddStringToObject(o, "weights", qn[r->path.weights]);
        cJSON_AddStringToObject(o, "shared_weights", qn[r->path.shared]);
        cJSON_AddStringToObject(o, "scale_owner", moe_scale_owner_name(r->path.owner));
        cJSON_AddBoolToObject(o, "fused_shared", r->path.fuse_shared);
        cJSON_AddStringToObject(o, "isa", r->path.isa != MOE_ISA_AUTO ? moe_isa_name(r->path.isa) : (m->isa ? m->isa : ""));
        cJSON_AddStringToObject(o, "grade", row_grade_name(r));
        if (r->status != MOE_OK) {
            cJSON_AddStringToObject(o, "error", r->note);
        } else {
            cJSON_AddNumberToObject(o, "max_abs", r->max_abs);
            cJSON_AddNumberToObject(o, "max_rel", r->max_rel);
            cJSON_AddNumberToObject(o, "nmse", r->nmse);
            double db = sqnr_db(r->nmse);
            if (isfinite(db)) cJSON_AddNumberToObject(o, "sqnr_db", db);
            else cJSON_AddNullToObject(o, "sqnr_db");
            cJSON_AddNumberToObject(o, "routing_flips", (double)r->flips);
            cJSON_AddNumberToObject(o, "tokens", (double)r->tokens);
            cJSON_AddNumberToObject(o, "seconds", r->seconds);
        }
        cJSON_AddItemToArray(arr, o);
    }
    free(s);
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    if (!text) return MOE_ERR_NOMEM;
    int ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    free(text);
    return ok ? MOE_OK : MOE_ERR_IO;
}

/* ------------------------------------------------------------------ HTML */


#define COL_PASS "#2e7d32"
#define COL_MARGINAL "#ef8f00"
#define COL_FAIL "#c62828"
#define COL_NOTRUN "#b0b0b0"

static const char *row_color(const moe_audit_row *r) {
    bool ran;
    moe_grade g = moe_audit_row_grade(r, &ran);
    if (!ran) return COL_NOTRUN;
    return g == MOE_GRADE_PASS ? COL_PASS : g == MOE_GRADE_MARGINAL ? COL_MARGINAL : COL_FAIL;
}

/* One path of the charts: its most harmful row over the layers. */
typedef struct path_worst {
    const char *name;
    const moe_audit_row *worst;  /* by harm */
    const moe_audit_row *flips;  /* the layer with the most routing flips */
} path_worst;

static int pw_cmp(const void *a, const void *b) {
    const path_worst *x = a, *y = b;
    int c = moe_audit_harm_cmp(x->worst, y->worst);
    return c ? c : strcmp(x->name, y->name);
}

static int int_cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static void bar_chart(FILE *f, const char *title, const path_worst *pw, int np, bool flips, int nl) {
    const double lo = 0, hi = flips ? 10 : 80;
    const double marks[2] = {flips ? 100 * MOE_GRADE_PASS_FLIPS : MOE_GRADE_MARGINAL_SQNR_DB,
                             flips ? 100 * MOE_GRADE_MARGINAL_FLIPS : MOE_GRADE_PASS_SQNR_DB};
    const char *unit = flips ? "%" : "dB";
    int bar = 14, gap = 4, label = 300, width = 900, plot = width - label - 150;
    int height = 34 + np * (bar + gap) + 8;
    fputs("<figure><figcaption>", f);
    moe_html_esc(f, title);
    fprintf(f, "</figcaption>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "font-family=\"sans-serif\" font-size=\"11\">\n", width, height);
    for (int k = 0; k < 2; k++) {
        double x = label + plot * (marks[k] - lo) / (hi - lo);
        fprintf(f, "<line x1=\"%.1f\" y1=\"26\" x2=\"%.1f\" y2=\"%d\" stroke=\"#999\" stroke-dasharray=\"4 3\"/>"
                   "<text x=\"%.1f\" y=\"20\" text-anchor=\"middle\" fill=\"#555\">%g %s</text>\n",
                x, x, height - 6, x, marks[k], unit);
    }
    for (int p = 0; p < np; p++) {
        const moe_audit_row *r = flips ? pw[p].flips : pw[p].worst;
        int y = 30 + p * (bar + gap);
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">", label - 6, y + bar - 3);
        moe_html_esc(f, pw[p].name);
        fputs("</text>\n", f);
        if (r->status != MOE_OK) {
            fprintf(f, "<text x=\"%d\" y=\"%d\" fill=\"%s\">%s (layer %d)</text>\n", label + 4, y + bar - 3,
                    row_color(r), r->status == MOE_ERR_INVARIANT ? "contract broken" : "not run (see the table)",
                    r->layer);
            continue;
        }
        double v = flips ? 100.0 * (double)r->flips / (double)(r->tokens ? r->tokens : 1) : sqnr_db(r->nmse);
        double c = fmin(fmax(isfinite(v) ? v : hi, lo), hi);
        double w = fmax(plot * (c - lo) / (hi - lo), 1.0);
        char val[64];
        if (flips && r->flips == 0) snprintf(val, sizeof val, "0");
        else if (flips) snprintf(val, sizeof val, "%.1f%% (%lld tokens)", v, (long long)r->flips);
        else if (isnan(v)) snprintf(val, sizeof val, "NaN");
        else if (!isfinite(v)) snprintf(val, sizeof val, "exact");
        else snprintf(val, sizeof val, "%.1f dB%s", v, v > hi ? " \xe2\x96\xb8" : ""); /* a clipped bar: a triangle */
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"><title>", label, y, w, bar,
                row_color(r));
        moe_html_esc(f, pw[p].name);
        fprintf(f, ", layer %d: %s, %s</title></rect><text x=\"%.1f\" y=\"%d\" fill=\"#333\">%s", r->layer, val,
                moe_grade_name(r->grade), label + w + 4, y + bar - 3, val);
        if (nl > 1) fprintf(f, " &middot; layer %d", r->layer);
        fputs("</text>\n", f);
    }
    fputs("</svg></figure>\n", f);
}

/* Path x layer: one cell per row, the grade's colour, the numbers in the
 * tooltip; paths in harm order, layers ascending. */
static void heatmap(FILE *f, const moe_audit_row *rows, int n, const path_worst *pw, int np, const int *layers, int nl) {
    int label = 300, right = 70;
    int cw = 720 / (nl > 0 ? nl : 1);
    cw = cw > 36 ? 36 : cw < 8 ? 8 : cw;
    int ch = 14, top = 34;
    int step = 1; /* label every step-th layer, at least 26 px apart */
    while (step * cw < 26) step++;
    int width = label + cw * nl + right, height = top + ch * np + 30;
    if (width < label + 4 * 90) width = label + 4 * 90; /* room for the legend */
    fprintf(f, "<figure><figcaption>Every path on every layer (%d layers; hover a cell for its numbers)</figcaption>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
               "font-size=\"11\">\n", nl, width, height);
    for (int l = 0; l < nl; l++)
        if (l % step == 0 || l == nl - 1)
            fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" fill=\"#555\">%d</text>\n",
                    label + cw * l + cw / 2, top - 8, layers[l]);
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\" fill=\"#555\">layer</text>\n", label - 6, top - 8);
    fprintf(f, "<text x=\"%d\" y=\"%d\" fill=\"#555\">worst dB</text>\n", label + cw * nl + 6, top - 8);
    for (int p = 0; p < np; p++) {
        int y = top + ch * p;
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">", label - 6, y + ch - 3);
        moe_html_esc(f, pw[p].name);
        fputs("</text>\n", f);
        for (int l = 0; l < nl; l++) {
            const moe_audit_row *r = NULL;
            for (int i = 0; i < n && !r; i++)
                if (rows[i].layer == layers[l] && !strcmp(rows[i].path.name, pw[p].name)) r = &rows[i];
            if (!r) continue;
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" stroke=\"#fff\"><title>", label + cw * l,
                    y, cw, ch, row_color(r));
            moe_html_esc(f, r->path.name);
            if (r->status == MOE_OK)
                fprintf(f, ", layer %d: %s, %.1f dB, %lld flips</title></rect>\n", r->layer, moe_grade_name(r->grade),
                        fmin(sqnr_db(r->nmse), 999.0), (long long)r->flips);
            else {
                fprintf(f, ", layer %d: %s: ", r->layer, r->status == MOE_ERR_INVARIANT ? "contract broken" : "not run");
                moe_html_esc(f, r->note);
                fputs("</title></rect>\n", f);
            }
        }
        const moe_audit_row *w = pw[p].worst;
        if (w->status == MOE_OK)
            fprintf(f, "<text x=\"%d\" y=\"%d\" fill=\"%s\">%.1f</text>\n", label + cw * nl + 6, y + ch - 3, row_color(w),
                    fmin(sqnr_db(w->nmse), 999.0));
    }
    int ly = top + ch * np + 18;
    static const char *const names[] = {"PASS", "MARGINAL", "FAIL", "not run"};
    static const char *const cols[] = {COL_PASS, COL_MARGINAL, COL_FAIL, COL_NOTRUN};
    for (int k = 0; k < 4; k++)
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"11\" height=\"11\" fill=\"%s\"/><text x=\"%d\" y=\"%d\">%s</text>\n",
                label + 90 * k, ly - 9, cols[k], label + 90 * k + 15, ly, names[k]);
    fputs("</svg></figure>\n", f);
}

moe_status moe_audit_report_html(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n) {
    const moe_audit_row **s = sorted(rows, n);
    int *layers = moe_malloc((size_t)n + 1, sizeof *layers);
    path_worst *pw = moe_malloc((size_t)n + 1, sizeof *pw);
    if (!s || !layers || !pw) { free(s); free(layers); free(pw); return MOE_ERR_NOMEM; }
    int nl = 0, np = 0;
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int k = 0; k < nl && !seen; k++) seen = layers[k] == rows[i].layer;
        if (!seen) layers[nl++] = rows[i].layer;
        int p = 0;
        while (p < np && strcmp(pw[p].name, rows[i].path.name)) p++;
        if (p == np) {
            pw[np++] = (path_worst){rows[i].path.name, &rows[i], &rows[i]};
            continue;
        }
        if (moe_audit_harm_cmp(&rows[i], pw[p].worst) < 0) pw[p].worst = &rows[i];
        const moe_audit_row *fl = pw[p].flips;
        if (fl->status != MOE_OK || (rows[i].status == MOE_OK && rows[i].flips > fl->flips)) pw[p].flips = &rows[i];
    }
    qsort(layers, (size_t)nl, sizeof *layers, int_cmp);
    qsort(pw, (size_t)np, sizeof *pw, pw_cmp);
    moe_audit_summary sum;
    moe_audit_summarize(rows, n, &sum);
    char head[768];
    headline(head, sizeof head, &sum, n);

    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>moeaudit audit</title>\n<style>\n"
          "body{font-family:sans-serif;max-width:1100px;margin:1.5em auto;color:#222;padding:0 1em}\n"
          ".headline{font-size:1.25em;font-weight:bold;padding:.6em .9em;border-left:8px solid;background:#f6f6f6}\n"
          "table{border-collapse:collapse;margin:.6em 0;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;"
          "text-align:right}td:nth-child(2),th:nth-child(2){text-align:left}\n"
          ".g{color:#fff;font-weight:bold;border-radius:3px;padding:1px 6px}figure{margin:1.5em 0}"
          "figcaption{font-weight:bold;margin-bottom:.4em}.muted{color:#666}summary{cursor:pointer;font-weight:bold;"
          "margin:.5em 0}\n</style></head><body>\n", f);
    fprintf(f, "<div class=\"headline\" style=\"border-color:%s\">", sum.worst ? row_color(sum.worst) : COL_NOTRUN);
    moe_html_esc(f, head);
    fputs(".</div>\n<h1>moeaudit audit</h1>\n<p>Model: <b>", f);
    moe_html_esc(f, m->model);
    fprintf(f, "</b>. %d layer%s, %lld tokens per layer. Reference: float64 on the checkpoint's own weights. "
               "Kernels: %s. Took %.1f s.</p>\n", nl, nl == 1 ? "" : "s", (long long)m->tokens, m->isa ? m->isa : "?",
            m->seconds);
    fprintf(f, "<p class=\"muted\">Grades: PASS at SQNR &ge; %.0f dB and &le; %.0f%% routing flips; MARGINAL at "
               "&ge; %.0f dB and &le; %.0f%%; FAIL otherwise, and whenever the scaling contract breaks. SQNR = "
               "&minus;10&middot;log<sub>10</sub>(NMSE) of the block output against float64. Paths are sorted by "
               "harm, most harmful first.</p>\n", MOE_GRADE_PASS_SQNR_DB, 100 * MOE_GRADE_PASS_FLIPS,
            MOE_GRADE_MARGINAL_SQNR_DB, 100 * MOE_GRADE_MARGINAL_FLIPS);
    bar_chart(f, nl > 1 ? "Output SQNR per path on its worst layer (dB, higher is better; bars end at 80 dB)"
                        : "Output SQNR per path (dB, higher is better; bars end at 80 dB)", pw, np, false, nl);
    bar_chart(f, nl > 1 ? "Routing flips per path on the layer where it flips most (% of tokens whose expert set "
                          "changes; bars end at 10%)"
                        : "Routing flips per path (% of tokens whose expert set changes; bars end at 10%)",
              pw, np, true, nl);
    heatmap(f, rows, n, pw, np, layers, nl);

    int last = -1;
    for (int i = 0; i < n; i++) {
        const moe_audit_row *r = s[i];
        if (r->layer != last) {
            if (last >= 0) fputs("</table></details>\n", f);
            last = r->layer;
            bool open = sum.worst && sum.worst->layer == r->layer;
            fprintf(f, "<details%s><summary>Layer %d (%s routing), sorted by harm</summary>\n<table><tr><th>grade</th>"
                       "<th>path</th><th>SQNR dB</th><th>NMSE</th><th>max rel</th><th>max abs</th><th>flips</th>"
                       "<th>time s</th></tr>\n", open ? " open" : "", r->layer, kind_name(r->kind));
        }
        fprintf(f, "<tr><td><span class=\"g\" style=\"background:%s\">%s</span></td><td>", row_color(r), row_grade_name(r));
        moe_html_esc(f, r->path.name);
        if (r->status != MOE_OK) {
            fputs(r->status == MOE_ERR_INVARIANT ? "</td><td colspan=\"6\">contract broken: "
                                                 : "</td><td colspan=\"6\" class=\"muted\">not run: ", f);
            moe_html_esc(f, r->note);
            fputs("</td></tr>\n", f);
            continue;
        }
        fprintf(f, "</td><td>%.1f</td><td>%.3g</td><td>%.3g</td><td>%.3g</td><td>%lld</td><td>%.2f</td></tr>\n",
                fmin(sqnr_db(r->nmse), 999.0), r->nmse, r->max_rel, r->max_abs, (long long)r->flips, r->seconds);
    }
    if (last >= 0) fputs("</table></details>\n", f);
    fputs("<p class=\"muted\">Made by moeaudit " MOEAUDIT_VERSION ". Self-contained: no scripts, no network. "
          "The same rows as JSON: moeaudit audit --json FILE (docs/schemas/audit.schema.json).</p>\n"
          "</body></html>\n", f);
    free(s);
    free(layers);
    free(pw);
    return ferror(f) ? MOE_ERR_IO : MOE_OK;
}
