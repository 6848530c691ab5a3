/*
 * Diagnoses as JSON (one layer, or many with a summary) and as a
 * self-contained HTML page (a table and an SVG chart of the fitted a / s and
 * b per layer), written atomically.
 *
 * Invariants:
 *  1. The HTML page loads nothing: no script, no stylesheet or font from
 *     elsewhere; every dump-derived string is escaped.
 *  2. The page reaches its path only whole (temp file, fsync, rename).
 */
#include "core/core.h"
#include "audit/diagnose_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static cJSON *num_or_null(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull(); }

static cJSON *diagnosis_obj(const moe_diagnosis *g) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    cJSON_AddStringToObject(j, "verdict", moe_verdict_name(g->verdict));
    cJSON_AddStringToObject(j, "confidence", moe_confidence_name(g->confidence));
    cJSON_AddStringToObject(j, "sentence", g->sentence);
    cJSON_AddNumberToObject(j, "layer", g->layer);
    cJSON_AddNumberToObject(j, "routed_scaling_factor", g->s);
    cJSON_AddNumberToObject(j, "tokens", (double)g->tokens);
    cJSON_AddNumberToObject(j, "tokens_fitted", (double)g->tokens_used);
    cJSON_AddNumberToObject(j, "selection_mismatch", (double)g->selection_mismatch);
    cJSON_AddNumberToObject(j, "near_tie_flips", (double)g->near_tie_flips);
    cJSON_AddNumberToObject(j, "flips_resolved", (double)g->flips_resolved);
    cJSON_AddNumberToObject(j, "tokens_unexplained", (double)g->tokens_unexplained);
    cJSON_AddItemToObject(j, "tie_tolerance", num_or_null(g->tie_tolerance));
    cJSON *fitj = cJSON_AddObjectToObject(j, "fit");
    cJSON_AddItemToObject(fitj, "a", num_or_null(g->fit_a));
    cJSON_AddItemToObject(fitj, "b", num_or_null(g->fit_b));
    cJSON_AddNumberToObject(fitj, "expected_a", g->s);
    cJSON_AddNumberToObject(fitj, "expected_b", 1.0);
    cJSON_AddItemToObject(fitj, "residual", num_or_null(g->residual));
    if (g->noise) cJSON_AddStringToObject(fitj, "noise", g->noise);
    else cJSON_AddNullToObject(fitj, "noise");
    cJSON_AddStringToObject(fitj, "noise_evidence", g->noise_evidence);
    cJSON_AddStringToObject(fitj, "routing_hypothesis", g->hypothesis);
    cJSON *stj = cJSON_AddObjectToObject(j, "stages");
    for (int s = 0; s < MOE_STAGE_COUNT; s++) {
        cJSON *o = cJSON_AddObjectToObject(stj, moe_diag_stage_name((moe_diag_stage)s));
        cJSON_AddBoolToObject(o, "checked", g->stages[s].checked);
        cJSON_AddStringToObject(o, "note", g->stages[s].note);
    }
    cJSON *fs = cJSON_AddArrayToObject(j, "findings");
    for (int i = 0; i < g->n_findings; i++) {
        const moe_finding *f = &g->findings[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "stage", f->stage_name);
        cJSON_AddStringToObject(o, "class", f->cls);
        cJSON_AddStringToObject(o, "confidence", moe_confidence_name(f->conf));
        cJSON_AddBoolToObject(o, "votes", f->votes);
        cJSON_AddNumberToObject(o, "tokens", (double)f->tokens);
        cJSON_AddStringToObject(o, "detail", f->detail);
        cJSON_AddStringToObject(o, "evidence", f->evidence);
        cJSON_AddItemToArray(fs, o);
    }
    return j;
}

char *moe_diagnosis_json(const moe_diagnosis *g) {
    cJSON *j = diagnosis_obj(g);
    char *s = j ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    return s;
}

char *moe_diagnoses_json(const moe_diagnosis *g, int n, const char *dump_path, const char *model_dir) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    if (dump_path) cJSON_AddStringToObject(j, "dump", dump_path);
    if (model_dir) cJSON_AddStringToObject(j, "model", model_dir);
    cJSON *ls = cJSON_AddArrayToObject(j, "layers");
    int counts[MOE_VERDICT_UNEXPLAINED + 1] = {0};
    for (int i = 0; i < n; i++) {
        cJSON_AddItemToArray(ls, diagnosis_obj(&g[i]));
        counts[g[i].verdict]++;
    }
    cJSON *sum = cJSON_AddObjectToObject(j, "summary");
    cJSON_AddNumberToObject(sum, "layers", n);
    cJSON_AddNumberToObject(sum, "ok", counts[MOE_VERDICT_OK]);
    cJSON *by = cJSON_AddObjectToObject(sum, "verdicts");
    for (int v = 0; v <= MOE_VERDICT_UNEXPLAINED; v++)
        if (counts[v]) cJSON_AddNumberToObject(by, moe_verdict_name((moe_verdict)v), counts[v]);
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    return s;
}

static const char *verdict_color(moe_verdict v) { return v == MOE_VERDICT_OK ? "#2e7d32" : v == MOE_VERDICT_UNEXPLAINED ? "#6d4c41" : "#c62828"; }

/* Two bars per layer: a / s and b (1 is the contract), on a 0..2.5 axis. */
static void svg_chart(FILE *f, const moe_diagnosis *g, int n) {
    const int bw = 14, gap = 10, h = 180, left = 40;
    int width = left + n * (2 * bw + gap) + 20;
    double top = 2.5;
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" role=\"img\" "
            "aria-label=\"fitted a/s and b per layer\">\n", width, h + 40);
    for (int k = 0; k <= 5; k++) {
        double v = top * k / 5;
        int y = 10 + h - (int)(h * v / top);
        fprintf(f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ddd\"/><text x=\"4\" y=\"%d\" font-size=\"10\">%.1f</text>\n",
                left, y, width - 10, y, y + 3, v);
    }
    int y1 = 10 + h - (int)(h * 1.0 / top);
    fprintf(f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#000\" stroke-dasharray=\"4 3\"/>\n", left, y1, width - 10, y1);
    for (int i = 0; i < n; i++) {
        double vals[2] = {g[i].s != 0 ? g[i].fit_a / g[i].s : 0, g[i].fit_b};
        const char *col[2] = {"#1565c0", "#ef6c00"};
        for (int k = 0; k < 2; k++) {
            double v = isfinite(vals[k]) ? fmax(0, fmin(vals[k], top)) : 0;
            int x = left + i * (2 * bw + gap) + k * bw, bh = (int)(h * v / top);
            fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\"><title>layer %d %s = %.4g</title></rect>\n",
                    x, 10 + h - bh, bw - 2, bh, col[k], g[i].layer, k ? "b" : "a/s", vals[k]);
        }
        fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"10\">%d</text>\n", left + i * (2 * bw + gap) + 4, h + 24, g[i].layer);
    }
    fprintf(f, "<text x=\"%d\" y=\"%d\" font-size=\"11\" fill=\"#1565c0\">a / s</text><text x=\"%d\" y=\"%d\" "
            "font-size=\"11\" fill=\"#ef6c00\">b</text>\n</svg>\n", left, h + 38, left + 50, h + 38);
}

static int write_page(FILE *f, const moe_diagnosis *g, int n, const char *dump_path, const char *model_dir) {
    int ok = 0;
    for (int i = 0; i < n; i++) ok += g[i].verdict == MOE_VERDICT_OK;
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>moeaudit diagnose</title>\n<style>\n"
          "body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:1em 0}"
          "td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;vertical-align:top}th{background:#f4f4f4}"
          "td.v{font-weight:bold;color:#fff}.small{font-size:12px;color:#555}\n</style></head><body>\n", f);
    fputs("<h1>moeaudit diagnose</h1>\n<p>dump <code>", f);
    moe_html_esc(f, dump_path ? dump_path : "?");
    fputs("</code>, checkpoint <code>", f);
    moe_html_esc(f, model_dir ? model_dir : "?");
    fprintf(f, "</code></p>\n<p id=\"summary\"><b>%d of %d layers OK</b>", ok, n);
    int counts[MOE_VERDICT_UNEXPLAINED + 1] = {0};
    for (int i = 0; i < n; i++) counts[g[i].verdict]++;
    for (int v = 1; v <= MOE_VERDICT_UNEXPLAINED; v++)
        if (counts[v]) fprintf(f, "; %s: %d", moe_verdict_name((moe_verdict)v), counts[v]);
    fputs("</p>\n<h2>Fitted scales (moe_out ~ a routed + b shared; the contract is a = s, b = 1)</h2>\n", f);
    svg_chart(f, g, n);
    fputs("<h2>Per layer</h2>\n<table><tr><th>layer</th><th>verdict</th><th>confidence</th><th>a</th><th>s</th>"
          "<th>b</th><th>residual</th><th>noise</th><th>flips</th><th>stages checked</th><th>sentence</th></tr>\n", f);
    for (int i = 0; i < n; i++) {
        const moe_diagnosis *d = &g[i];
        fprintf(f, "<tr id=\"layer-%d\"><td>%d</td><td class=\"v\" style=\"background:%s\">%s</td><td>%s</td>"
                "<td>%.5g</td><td>%g</td><td>%.5g</td><td>%.3g</td><td>%s</td><td>%lld</td><td>",
                d->layer, d->layer, verdict_color(d->verdict), moe_verdict_name(d->verdict),
                moe_confidence_name(d->confidence), d->fit_a, d->s, d->fit_b, d->residual, d->noise ? d->noise : "-",
                (long long)(d->near_tie_flips + d->flips_resolved));
        int first = 1;
        for (int s = 0; s < MOE_STAGE_COUNT; s++)
            if (d->stages[s].checked) { fprintf(f, "%s%s", first ? "" : ", ", moe_diag_stage_name((moe_diag_stage)s)); first = 0; }
        fputs("</td><td>", f);
        moe_html_esc(f, d->sentence);
        fputs("<div class=\"small\">", f);
        for (int k = 0; k < d->n_findings; k++) {
            const moe_finding *fd = &d->findings[k];
            fprintf(f, "%s%s %s (%s%s): ", k ? "<br>" : "", fd->stage_name, fd->cls, moe_confidence_name(fd->conf),
                    fd->votes ? ", votes" : "");
            moe_html_esc(f, fd->detail);
            if (fd->evidence[0]) { fputs("; ", f); moe_html_esc(f, fd->evidence); }
        }
        fputs("</div></td></tr>\n", f);
    }
    fputs("</table>\n<p class=\"small\">Decision rule: docs/diagnose.md. Confidence: exact (reproduced to the dump's "
          "storage precision), strong (beyond the noise over enough tokens), weak (noise level: reported, never "
          "decides).</p>\n</body></html>\n", f);
    return ferror(f) ? -1 : 0;
}

moe_status moe_diagnoses_html(const char *path, const moe_diagnosis *g, int n, const char *dump_path,
                              const char *model_dir, moe_error *err) {
    /* the atomic writer (moe_out_*): an exclusive random temporary beside
     * path, renamed over it; on failure the old page stays and nothing is
     * left behind (#12 item 8: the old '<path>.tmp.<pid>' was predictable) */
    moe_out_file *o = NULL;
    moe_status st = moe_out_open(path, &o, err);
    if (st != MOE_OK) return st;
    FILE *f = moe_out_stream(o);
    if (!f || write_page(f, g, n, dump_path, model_dir) != 0) {
        moe_out_abort(o);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory while writing the HTML report", path);
    }
    return moe_out_commit(o, err);
}
