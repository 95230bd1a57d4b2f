/* pdspark CPU kernels, decode_index.c: every index of a small step of short chunks, straight from the page tables
 * (`decode_index`), so that a step and its layers (`decode_layers`) run without Python in between. */
#include "kernels.h"

/* Page-scoped CSA state row of a position (`StateRings.c4_rows`): its SWA page's ring, the dummy row where the
 * page was released. */
static long c4_state_row(const long *L, long full, long pos) {
    const long page = ((const long *)L[L_F2S])[full / L[L_PAGE]];
    return page == L[L_SWA_DUMMY_PAGE] ? L[L_C4_STATE_DUMMY] : page * L[L_CSA_RING] + pos % L[L_CSA_RING];
}

/* One compressor kind's plan (`engine.forward_batch._csa_plan` / `_hca_plan`): the closing groups of the step's
 * tokens with their source columns, and the token rows whose state must persist. Writes the plan's seven arrays
 * (slots p0 .. p0+6 of sp) and returns the group count in *groups, the write count in *writes. */
static void plan(const long *L, const long *sp, int p0, int csa, int T, const long *tslot, const long *pos,
                 const long *tstart, const long *tend, int *groups, int *writes) {
    const long *rtt = (const long *)L[L_RTT], rs = L[L_RTT_STRIDE], P = L[L_PAGE];
    const long R = csa ? L[L_CSA_RATIO] : L[L_HCA_RATIO], span = csa ? 2 * R : R;
    long *out_rows = (long *)sp[p0], *gpos = (long *)sp[p0 + 1], *cur = (long *)sp[p0 + 3];
    long *hist = (long *)sp[p0 + 4], *wtok = (long *)sp[p0 + 5], *wrow = (long *)sp[p0 + 6];
    unsigned char *use = (unsigned char *)sp[p0 + 2];
    int G = 0, N = 0;
    for (int t = 0; t < T; t++) {
        const long p = pos[t], s = tslot[t];
        if ((p + 1) % R != 0) continue;
        const long gs = (p / R) * R, first = csa ? gs - R : gs;
        if (csa) {
            out_rows[G] = rtt[s * rs + gs] / R;
        } else {
            const long g = gs / R, cps = L[L_C128_PAGE];
            out_rows[G] = ((const long *)L[L_RTC])[s * L[L_RTC_STRIDE] + g / cps] * cps + g % cps;
        }
        gpos[G] = gs;
        for (long j = 0; j < span; j++) {
            const long q = first + j, k = G * span + j;
            const int u = q >= tstart[t];
            use[k] = (unsigned char)u;
            cur[k] = u ? t - (p - q) : 0;
            if (csa)
                hist[k] = q >= 0 && !u ? c4_state_row(L, rtt[s * rs + q], q) : L[L_C4_STATE_DUMMY];
            else
                hist[k] = !u ? s * L[L_HCA_RING] + q % L[L_HCA_RING] : L[L_C128_STATE_DUMMY];
        }
        G++;
    }
    for (int t = 0; t < T; t++) {
        const long p = pos[t], s = tslot[t];
        long keep;
        int w;
        if (csa) { /* the overlap group before the chunk's start, and every page's last group */
            keep = (tstart[t] / R) * R - R;
            if (tend[t] - L[L_CSA_RING] > keep) keep = tend[t] - L[L_CSA_RING];
            w = p >= keep || p % P >= P - R;
        } else {
            keep = (tstart[t] / R) * R;
            if (tend[t] - L[L_HCA_RING] > keep) keep = tend[t] - L[L_HCA_RING];
            w = p >= keep;
        }
        if (!w) continue;
        wtok[N] = t;
        wrow[N] = csa ? c4_state_row(L, rtt[s * rs + p], p) : s * L[L_HCA_RING] + p % L[L_HCA_RING];
        N++;
    }
    *groups = G, *writes = N;
}

/* Every index of a small step of short chunks (`engine.forward_batch.build_forward_batch` without dense segments)
 * straight from the page tables, into the arrays the step table sp points to (`kernels.DECODE_STEP`), plus the
 * step's rotary rows; si receives the step sizes (`kernels.DECODE_STEP_SIZES`).
 * req: [n, then (slot, start, length) per chunk, then every chunk's token ids]. L: `kernels.DECODE_LAYOUT`.
 * Returns the token count, or -1 past INDEX_MAX_TOKENS. */
int decode_index(const long *req, const long *L, const long *sp, int *si) {
    const long n = req[0], *ids = req + 1 + 3 * n;
    const long *rtt = (const long *)L[L_RTT], rs = L[L_RTT_STRIDE], *f2s = (const long *)L[L_F2S];
    const long P = L[L_PAGE], W = L[L_WINDOW];
    const int r = (int)L[L_ROPE_DIM];
    long tslot[INDEX_MAX_TOKENS], tstart[INDEX_MAX_TOKENS], tend[INDEX_MAX_TOKENS];
    long *pos = (long *)sp[S_POS], *tid = (long *)sp[S_IDS], *slots = (long *)sp[S_SLOTS];
    int T = 0;
    for (long c = 0; c < n; c++) {
        const long slot = req[1 + 3 * c], start = req[2 + 3 * c], len = req[3 + 3 * c];
        if (T + len > INDEX_MAX_TOKENS) return -1;
        for (long j = 0; j < len; j++, T++) {
            tslot[T] = slot, tstart[T] = start, tend[T] = start + len;
            pos[T] = start + j;
            tid[T] = ids[T];
        }
    }
    long *wrows = (long *)sp[S_WIN_ROWS];
    unsigned char *wvalid = (unsigned char *)sp[S_WIN_VALID];
    for (int t = 0; t < T; t++) {
        const long s = tslot[t], p = pos[t], full = rtt[s * rs + p];
        slots[t] = f2s[full / P] * P + full % P;
        for (long j = 0; j < W; j++) { /* positions p-W+1 .. p, oldest first */
            const long q = p - (W - 1) + j;
            const long f = q >= 0 ? rtt[s * rs + q] : 0;
            wvalid[t * W + j] = (unsigned char)(q >= 0);
            wrows[t * W + j] = q >= 0 ? f2s[f / P] * P + f % P : L[L_SWA_DUMMY_SLOT];
        }
        const float *tabs[4] = {(const float *)L[L_COS_MAIN], (const float *)L[L_SIN_MAIN],
                                (const float *)L[L_COS_COMP], (const float *)L[L_SIN_COMP]};
        const int outs[4] = {S_COS_MAIN, S_SIN_MAIN, S_COS_COMP, S_SIN_COMP};
        for (int k = 0; k < 4; k++)
            for (int d = 0; d < r; d++) ((float *)sp[outs[k]])[(long)t * r + d] = tabs[k][p * r + d];
    }
    for (int k = 0; k < SI_COUNT; k++) si[k] = 0;
    si[SI_T] = T, si[SI_W] = (int)W, si[SI_R] = r;
    for (int csa = 1; csa >= 0; csa--) {
        const long R = csa ? L[L_CSA_RATIO] : L[L_HCA_RATIO];
        if (R == 0) continue; /* no layer of this kind */
        long V = 0;
        for (int t = 0; t < T; t++)
            if ((pos[t] + 1) / R > V) V = (pos[t] + 1) / R;
        long *rows = (long *)sp[csa ? S_CSA_ROWS : S_HCA_ROWS];
        unsigned char *valid = (unsigned char *)sp[csa ? S_CSA_VALID : S_HCA_VALID];
        const long cps = L[L_C128_PAGE];
        for (int t = 0; t < T; t++) {
            const long visible = (pos[t] + 1) / R, s = tslot[t];
            for (long g = 0; g < V; g++) {
                const int v = g < visible;
                valid[t * V + g] = (unsigned char)v;
                if (csa) /* pages are multiples of R: the group's first position gives its C4 row */
                    rows[t * V + g] = v ? rtt[s * rs + g * R] / R : L[L_C4_DUMMY];
                else
                    rows[t * V + g] = v ? ((const long *)L[L_RTC])[s * L[L_RTC_STRIDE] + g / cps] * cps + g % cps
                                        : L[L_C128_DUMMY];
            }
        }
        si[csa ? SI_V_CSA : SI_V_HCA] = (int)V;
        plan(L, sp, csa ? S_CP_OUT : S_HP_OUT, csa, T, tslot, pos, tstart, tend, &si[csa ? SI_G_CSA : SI_G_HCA],
             &si[csa ? SI_N_CSA : SI_N_HCA]);
    }
    return T;
}
