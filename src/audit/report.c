/*
 * Audit reports: a text table, JSON, and one self-contained HTML page with
 * inline SVG charts (no scripts, no network). Writers take a FILE * the
 * caller opened; they never print elsewhere.
 */
#include "audit/tolerances.h"
#include "core/core.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

static double sqnr_db(double nmse) { return nmse > 0 ? -10.0 * log10(nmse) : INFINITY; }

/* Harm order: FAIL before MARGINAL before PASS, then lower SQNR first, then
 * more flips; failed runs (status) first of all. */
static int harm_cmp(const void *a, const void *b) {
    const moe_audit_row *x = *(const moe_audit_row *const *)a, *y = *(const moe_audit_row *const *)b;
    if (x->layer != y->layer) return x->layer - y->layer;
    if ((x->status != MOE_OK) != (y->status != MOE_OK)) return x->status != MOE_OK ? 1 : -1;
    if (x->grade != y->grade) return (int)y->grade - (int)x->grade;
    double sx = sqnr_db(x->nmse), sy = sqnr_db(y->nmse);
    if (sx != sy) return sx < sy ? -1 : 1;
    return (int)(y->flips - x->flips);
}

static const moe_audit_row **sorted(const moe_audit_row *rows, int n) {
    const moe_audit_row **s = moe_malloc((size_t)n, sizeof *s);
    if (!s) return NULL;
    for (int i = 0; i < n; i++) s[i] = &rows[i];
    qsort(s, (size_t)n, sizeof *s, harm_cmp);
    return s;
}

static const char *kind_name(moe_layer_kind k) { return k == MOE_LAYER_HASH ? "hash" : k == MOE_LAYER_TOPK ? "top-k" : "dense"; }

moe_status moe_audit_report_text(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n) {
    const moe_audit_row **s = sorted(rows, n);
    if (!s) return MOE_ERR_NOMEM;
    fprintf(f, "moeaudit audit: %s\n", m->model);
    fprintf(f, "%lld tokens per layer; reference: float64 on the checkpoint's weights; grades: PASS >= %.0f dB, "
            "MARGINAL >= %.0f dB SQNR, flips <= %.0f%% / %.0f%%\n", (long long)m->tokens, MOE_GRADE_PASS_SQNR_DB,
            MOE_GRADE_MARGINAL_SQNR_DB, 100 * MOE_GRADE_PASS_FLIPS, 100 * MOE_GRADE_MARGINAL_FLIPS);
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
            fprintf(f, "  %-8s %-44s  %s: %s\n", r->status == MOE_ERR_INVARIANT ? "FAIL" : "n/a", r->path.name,
                    r->status == MOE_ERR_INVARIANT ? "broken" : "not run", r->note);
            continue;
        }
        fprintf(f, "  %-8s %-44s %9.1f %10.3g %9.3g %7lld %8.2f\n", moe_grade_name(r->grade), r->path.name,
                sqnr_db(r->nmse), r->nmse, r->max_rel, (long long)r->flips, r->seconds);
    }
    free(s);
    return MOE_OK;
}

static const char *const qn[] = {"none", "fp8", "mxfp4", "nvfp4"};
static const char *const actn[] = {"exact", "bf16", "fp8", "fp8-f32scale"};
static const char *const routern[] = {"path", "bf16-input", "bf16-logits"};

moe_status moe_audit_report_json(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return MOE_ERR_NOMEM;
    cJSON_AddStringToObject(j, "model", m->model);
    cJSON_AddNumberToObject(j, "tokens", (double)m->tokens);
    cJSON_AddStringToObject(j, "isa", m->isa ? m->isa : "");
    cJSON_AddNumberToObject(j, "seconds", m->seconds);
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
        cJSON_AddStringToObject(o, "path", r->path.name);
        cJSON_AddStringToObject(o, "group", r->path.group ? r->path.group : "");
        cJSON_AddStringToObject(o, "patches", r->path.patches);
        cJSON_AddStringToObject(o, "precision", r->path.precision == MOE_PREC_REF ? "ref" : "f32");
        cJSON_AddStringToObject(o, "activations", actn[r->path.act]);
        cJSON_AddStringToObject(o, "router", routern[r->path.router]);
        cJSON_AddStringToObject(o, "weights", qn[r->path.weights]);
        cJSON_AddStringToObject(o, "shared_weights", qn[r->path.shared]);
        cJSON_AddStringToObject(o, "scale_owner", moe_scale_owner_name(r->path.owner));
        cJSON_AddBoolToObject(o, "fused_shared", r->path.fuse_shared);
        cJSON_AddStringToObject(o, "isa", r->path.isa != MOE_ISA_AUTO ? moe_isa_name(r->path.isa) : (m->isa ? m->isa : ""));
        if (r->status != MOE_OK) {
            cJSON_AddStringToObject(o, "grade", r->status == MOE_ERR_INVARIANT ? "FAIL" : "n/a");
            cJSON_AddStringToObject(o, "error", r->note);
        } else {
            cJSON_AddStringToObject(o, "grade", moe_grade_name(r->grade));
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

static void esc(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}

static const char *grade_color(moe_grade g) {
    return g == MOE_GRADE_PASS ? "#2e7d32" : g == MOE_GRADE_MARGINAL ? "#ef8f00" : "#c62828";
}

/* Horizontal bars of one metric per path, one bar per layer. */
static void svg_bars(FILE *f, const char *title, const char *unit, const moe_audit_row *rows, int n,
                     const int *layers, int nl, bool flips, double lo, double hi, const double *marks, int nmarks) {
    /* distinct paths in first-seen order */
    const char *names[64];
    int np = 0;
    for (int i = 0; i < n && np < 64; i++) {
        bool seen = false;
        for (int k = 0; k < np; k++) seen |= !strcmp(names[k], rows[i].path.name);
        if (!seen) names[np++] = rows[i].path.name;
    }
    int bar = 9, gap = 6, label = 290, width = 860, plot = width - label - 60;
    int height = 40 + np * (nl * bar + gap) + 30;
    static const char *const colors[] = {"#1565c0", "#8e24aa", "#00897b", "#6d4c41"};
    fprintf(f, "<figure><figcaption>");
    esc(f, title);
    fprintf(f, "</figcaption>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "font-family=\"sans-serif\" font-size=\"11\">\n", width, height);
    for (int k = 0; k < nmarks; k++) {
        double x = label + plot * (marks[k] - lo) / (hi - lo);
        fprintf(f, "<line x1=\"%.1f\" y1=\"30\" x2=\"%.1f\" y2=\"%d\" stroke=\"#999\" stroke-dasharray=\"4 3\"/>"
                   "<text x=\"%.1f\" y=\"24\" text-anchor=\"middle\" fill=\"#555\">%g %s</text>\n",
                x, x, height - 25, x, marks[k], unit);
    }
    for (int p = 0; p < np; p++) {
        int y0 = 36 + p * (nl * bar + gap);
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">", label - 6, y0 + nl * bar / 2 + 4);
        esc(f, names[p]);
        fprintf(f, "</text>\n");
        for (int l = 0; l < nl; l++) {
            const moe_audit_row *r = NULL;
            for (int i = 0; i < n; i++)
                if (rows[i].layer == layers[l] && !strcmp(rows[i].path.name, names[p])) r = &rows[i];
            if (!r) continue;
            if (r->status != MOE_OK) {
                if (l == 0)
                    fprintf(f, "<text x=\"%d\" y=\"%d\" fill=\"%s\">%s</text>\n", label + 4, y0 + l * bar + bar - 1,
                        r->status == MOE_ERR_INVARIANT ? "#c62828" : "#888",
                        r->status == MOE_ERR_INVARIANT ? "contract broken" : "not run (see table)");
                continue;
            }
            double v = flips ? 100.0 * (double)r->flips / (double)(r->tokens ? r->tokens : 1) : sqnr_db(r->nmse);
            double c = fmin(fmax(isfinite(v) ? v : hi, lo), hi);
            double w = plot * (c - lo) / (hi - lo);
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\"><title>layer %d: %.3g %s</title></rect>"
                       "<text x=\"%.1f\" y=\"%d\" fill=\"#333\">%s</text>\n",
                    label, y0 + l * bar, w < 1 ? 1 : w, bar - 1, colors[l % 4], layers[l], v, unit,
                    label + (w < 1 ? 1 : w) + 4, y0 + l * bar + bar - 1,
                    isfinite(v) ? "" : "exact");
        }
    }
    /* legend */
    for (int l = 0; l < nl; l++)
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"10\" height=\"10\" fill=\"%s\"/><text x=\"%d\" y=\"%d\">layer %d</text>\n",
                label + 90 * l, height - 18, colors[l % 4], label + 90 * l + 14, height - 9, layers[l]);
    fprintf(f, "</svg></figure>\n");
}

moe_status moe_audit_report_html(FILE *f, const moe_audit_meta *m, const moe_audit_row *rows, int n) {
    int layers[16], nl = 0;
    for (int i = 0; i < n && nl < 16; i++) {
        bool seen = false;
        for (int k = 0; k < nl; k++) seen |= layers[k] == rows[i].layer;
        if (!seen) layers[nl++] = rows[i].layer;
    }
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>moeaudit audit</title>\n<style>\n"
          "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222;padding:0 1em}\n"
          "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;"
          "text-align:right}td:nth-child(2),th:nth-child(2){text-align:left}\n"
          ".g{color:#fff;font-weight:bold;border-radius:3px;padding:1px 6px}figure{margin:1.5em 0}"
          "figcaption{font-weight:bold;margin-bottom:.4em}.muted{color:#666}\n</style></head><body>\n", f);
    fputs("<h1>moeaudit audit</h1>\n<p>Model: <b>", f);
    esc(f, m->model);
    fprintf(f, "</b>. %lld tokens per layer. Reference: float64 on the checkpoint's own weights. Kernels: %s. "
               "Took %.1f s.</p>\n", (long long)m->tokens, m->isa ? m->isa : "?", m->seconds);
    fprintf(f, "<p class=\"muted\">Grades: PASS at SQNR &ge; %.0f dB and &le; %.0f%% routing flips; MARGINAL at "
               "&ge; %.0f dB and &le; %.0f%%; FAIL otherwise. SQNR = &minus;10&middot;log<sub>10</sub>(NMSE) of the "
               "block output against float64.</p>\n", MOE_GRADE_PASS_SQNR_DB, 100 * MOE_GRADE_PASS_FLIPS,
            MOE_GRADE_MARGINAL_SQNR_DB, 100 * MOE_GRADE_MARGINAL_FLIPS);
    double marks[] = {MOE_GRADE_MARGINAL_SQNR_DB, MOE_GRADE_PASS_SQNR_DB};
    svg_bars(f, "Output SQNR per path (dB, higher is better; beyond 80 dB drawn at 80)", "dB", rows, n, layers, nl,
             false, 0, 80, marks, 2);
    double fmarks[] = {100 * MOE_GRADE_PASS_FLIPS, 100 * MOE_GRADE_MARGINAL_FLIPS};
    svg_bars(f, "Routing flips per path (% of tokens whose expert set changes)", "%", rows, n, layers, nl, true, 0, 10,
             fmarks, 2);
    /* per-layer summary bars: counts of each grade */
    fprintf(f, "<figure><figcaption>Grades per layer</figcaption>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
               "width=\"860\" height=\"%d\" font-family=\"sans-serif\" font-size=\"12\">\n", 30 + 26 * nl);
    for (int l = 0; l < nl; l++) {
        int cnt[3] = {0, 0, 0}, total = 0;
        for (int i = 0; i < n; i++)
            if (rows[i].layer == layers[l] && rows[i].status == MOE_OK) { cnt[rows[i].grade]++; total++; }
        double x = 120;
        fprintf(f, "<text x=\"110\" y=\"%d\" text-anchor=\"end\">layer %d</text>\n", 22 + 26 * l, layers[l]);
        for (int g = 0; g < 3; g++) {
            double w = total ? 600.0 * cnt[g] / total : 0;
            if (w > 0 && w < 70)
                fprintf(f, "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"18\" fill=\"%s\"><title>%d %s</title></rect>\n",
                        x, 8 + 26 * l, w, grade_color((moe_grade)g), cnt[g], moe_grade_name((moe_grade)g));
            else if (w > 0)
                fprintf(f, "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"18\" fill=\"%s\"/><text x=\"%.1f\" "
                           "y=\"%d\" fill=\"#fff\">%d %s</text>\n", x, 8 + 26 * l, w, grade_color((moe_grade)g),
                        x + 4, 22 + 26 * l, cnt[g], moe_grade_name((moe_grade)g));
            x += w;
        }
    }
    fputs("</svg></figure>\n", f);
    const moe_audit_row **s = sorted(rows, n);
    int last = -1;
    for (int i = 0; s && i < n; i++) {
        const moe_audit_row *r = s[i];
        if (r->layer != last) {
            if (last >= 0) fputs("</table>\n", f);
            last = r->layer;
            fprintf(f, "<h2>Layer %d (%s routing), sorted by harm</h2>\n<table><tr><th>grade</th><th>path</th>"
                       "<th>SQNR dB</th><th>NMSE</th><th>max rel</th><th>max abs</th><th>flips</th><th>time s</th></tr>\n",
                    r->layer, kind_name(r->kind));
        }
        if (r->status != MOE_OK) {
            if (r->status == MOE_ERR_INVARIANT)
                fprintf(f, "<tr><td><span class=\"g\" style=\"background:%s\">FAIL</span></td><td>", grade_color(MOE_GRADE_FAIL));
            else
                fputs("<tr><td>n/a</td><td>", f);
            esc(f, r->path.name);
            fputs(r->status == MOE_ERR_INVARIANT ? "</td><td colspan=\"6\">" : "</td><td colspan=\"6\" class=\"muted\">not run: ", f);
            esc(f, r->note);
            fputs("</td></tr>\n", f);
            continue;
        }
        fprintf(f, "<tr><td><span class=\"g\" style=\"background:%s\">%s</span></td><td>", grade_color(r->grade),
                moe_grade_name(r->grade));
        esc(f, r->path.name);
        fprintf(f, "</td><td>%.1f</td><td>%.3g</td><td>%.3g</td><td>%.3g</td><td>%lld</td><td>%.2f</td></tr>\n",
                fmin(sqnr_db(r->nmse), 999.0), r->nmse, r->max_rel, r->max_abs, (long long)r->flips, r->seconds);
    }
    if (last >= 0) fputs("</table>\n", f);
    free(s);
    fputs("<p class=\"muted\">Made by moeaudit " MOEAUDIT_VERSION ". Self-contained: no scripts, no network.</p>\n"
          "</body></html>\n", f);
    return ferror(f) ? MOE_ERR_IO : MOE_OK;
}
