/* Step 2 of the global-batch deal (_global_batches.c's opening comment): the exchanges that bring the
 * worst batches to the aim (`exchange_rounds`, a round's exchanges by `improve`); _batch_copies.c
 * parts copies of a sample before them. */
#include "_global_batches.h"

/* Samples nearest in length looked at per sample of the worst batch; measured on the benchmark's
 * mixture: 8 or 16 need more exchanges at 8k and take longer in all, 32 reaches the same batches. */
#define NEIGHBOURS 32
#define WIDE 1024 /* ... when neither those nor a pack exchange help */
/* Candidates one scan looks at, at most: a batch of many small samples looks at fewer neighbours of
 * each (no fewer than 4). */
#define SCAN_BUDGET (1 << 16)
#define WIDE_BUDGET (1 << 18)
#define PACK_CANDIDATES 1024 /* packs a pack exchange looks at as partners */
/* Searches past the nearest samples (of packs; of the WIDE nearest samples), each kind at most this
 * many per batch of a region: they are what a batch that cannot reach the aim costs. On 40 random
 * mixtures 2 takes 0.6x the time of 8 (a 2,146-pack one 0.57 s, not 1.12) for the same batches but
 * one (0.66 points off, not 0.48). */
#define SCANS_PER_BATCH 2
/* Sample exchanges one scan keeps, the best first, each made when it still helps once those before it
 * are: measured on the benchmark's mixture, 1 (a scan an exchange) takes 2.5x the time of 32 at 8k,
 * 64 no less than 32; the batches reach the aim alike. */
#define MULTIPLE 32
/* A round of sample exchanges that brings the batch less than 1/PROGRESS of its way to the aim has
 * stalled: the pack and wide searches follow, and when they find nothing the batch waits until
 * another batch's exchange changes it. On 40 random mixtures, batches of thousands of tiny samples
 * took 5 s for 3,763 packs, 2,000 rounds of 0.0005 points each; now 1.9 s, and the 40 worst batches
 * sum to 39.4 points, not 39.8. */
#define PROGRESS 256

/* 1 when `sums` + `shift` strays `bar` or further from a target in some source: no division, and it
 * stops at the first such source (most candidates of an exchange fail at once). */
static int strays(const double *sums, const double *shift, const double *targets, Py_ssize_t sources, double bar) {
    double total = 0.0;
    for (Py_ssize_t s = 0; s < sources; s++) total += sums[s] + shift[s];
    if (total <= 0.0) return 0;
    const double limit = bar * total;
    for (Py_ssize_t s = 0; s < sources; s++)
        if (fabs(sums[s] + shift[s] - targets[s] * total) >= limit) return 1;
    return 0;
}

/* `strays` for a sample exchange: `sums` (holding `total`) less measure `out` of source `from`, plus
 * `in` of source `to`; the source `first` checked first (the one furthest off: most candidates fail
 * there). */
static int exchange_strays(const double *sums, double total, const double *targets, Py_ssize_t sources,
                           Py_ssize_t from, double out, Py_ssize_t to, double in, Py_ssize_t first, double bar) {
    total += in - out;
    if (total <= 0.0) return 0;
    const double limit = bar * total;
    for (Py_ssize_t k = -1; k < sources; k++) {
        const Py_ssize_t s = k < 0 ? first : k;
        if (k == first) continue;
        const double x = sums[s] + (s == to ? in : 0.0) - (s == from ? out : 0.0) - targets[s] * total;
        if (fabs(x) >= limit) return 1;
    }
    return 0;
}

typedef struct {
    double value;
    int64_t mine, theirs; /* items (sample exchange) or packs (pack exchange) */
} Exchange;

/* How far off the other batch `b` of an exchange may end (not as far): closer than `bar` when it is
 * full, so the worst full batch never gets worse; no further off than it is when it is the partial
 * last one. */
static double partner_limit(const Deal *d, const Region *g, int64_t b, double bar) {
    return g->capacity[b] == d->batch_packs ? bar : fmax(bar, g->dev[b]);
}

/* Keeps `top` [most] sorted by value, the smallest first: `e` in its place when it is among the best
 * `most`; returns how many `top` holds. */
static Py_ssize_t keep_best(Exchange *top, Py_ssize_t held, Py_ssize_t most, Exchange e) {
    Py_ssize_t k = held < most ? held++ : most - 1;
    for (; k > 0 && top[k - 1].value > e.value; k--) top[k] = top[k - 1];
    top[k] = e;
    return held;
}

/* The value of exchanging items `i` (of batch `w`) and `j` (of batch `bb`) as the batches stand: the
 * larger of the two batches' deviations after it (the other batch's only when it is full); INFINITY
 * when it leaves `w` no closer than `bar`, or the other batch past `partner_limit`. */
static double exchange_value(const Deal *d, const Region *g, Py_ssize_t w, int64_t bb, int64_t i, int64_t j,
                             double bar, double *shift) {
    const Py_ssize_t S = d->sources;
    for (Py_ssize_t s = 0; s < S; s++) shift[s] = 0.0;
    shift[g->source[j]] += g->measure[j];
    shift[g->source[i]] -= g->measure[i];
    const double value = deviation(g->sums + w * S, shift, d->targets, S);
    if (value >= bar) return INFINITY;
    for (Py_ssize_t s = 0; s < S; s++) shift[s] = -shift[s];
    const double new_b = deviation(g->sums + bb * S, shift, d->targets, S);
    if (new_b >= partner_limit(d, g, bb, bar)) return INFINITY;
    return g->capacity[bb] == d->batch_packs && new_b > value ? new_b : value;
}

/* The best `most` sample exchanges for the worst batch `w` into `top` (sorted, the best first), each
 * of one of its samples for one of the `neighbours` samples nearest its length in another batch;
 * returns how many (0 when none makes `w` better). */
static Py_ssize_t sample_exchanges(const Deal *d, const Region *g, Py_ssize_t w, Py_ssize_t neighbours,
                                   Exchange *top, Py_ssize_t most, double *shift) {
    const Py_ssize_t S = d->sources, K = d->batch_packs;
    const int64_t bw = g->first_batch + w;
    Py_ssize_t held = 0;
    const double limit = g->dev[w];
    for (Py_ssize_t m = 0; m < g->count[w]; m++) {
        const int64_t a = g->members[w * K + m];
        const int64_t free_a = d->pack_size - g->used[a];
        for (int64_t e = g->held_from[a]; e < g->held_from[a + 1]; e++) {
            const int64_t i = g->held[e], li = g->length[i];
            int64_t up = i + 1, down = i - 1;
            for (Py_ssize_t looked = 0; looked < neighbours && (up < g->items || down >= 0); looked++) {
                const int64_t j = next_nearest(g, &up, &down, li, li + free_a);
                if (j < 0) continue;
                /* what `w` would become first: most candidates fail there, before their pack is looked up */
                const double bar = held < most ? limit : top[most - 1].value;
                if (exchange_strays(g->sums + w * S, g->total[w], d->targets, S, g->source[i], g->measure[i],
                                    g->source[j], g->measure[j], g->furthest[w], bar))
                    continue;
                const int64_t bb = batch_of(d, g, g->pack[j]) - g->first_batch;
                if (bb == w || g->sample[j] == g->sample[i] || !room_for(d, g, j, li)) continue;
                const double other = partner_limit(d, g, bb, limit);
                if (exchange_strays(g->sums + bb * S, g->total[bb], d->targets, S, g->source[j], g->measure[j],
                                    g->source[i], g->measure[i], g->furthest[bb], other))
                    continue;
                const double value = exchange_value(d, g, w, bb, i, j, limit, shift);
                if (value >= bar) continue;
                if (meets_copy(d, g, j, bw, g->pack[i]) || meets_copy(d, g, i, g->first_batch + bb, g->pack[j]))
                    continue;
                held = keep_best(top, held, most, (Exchange){value, i, j});
            }
        }
    }
    return held;
}

/* The best pack exchange for the worst batch `w` into `best`, its partner among about PACK_CANDIDATES
 * packs of the region (another set for another `offset`); returns 0 when none makes it better. */
static int pack_exchange(const Deal *d, const Region *g, Py_ssize_t w, int64_t offset, Exchange *best,
                         double *shift) {
    const Py_ssize_t S = d->sources, K = d->batch_packs;
    int found = 0;
    double bar = g->dev[w];
    /* every stride-th pack of the region from `offset`: about PACK_CANDIDATES of them */
    const int64_t stride = g->packs > PACK_CANDIDATES ? g->packs / PACK_CANDIDATES : 1;
    for (int64_t q = offset % stride; q < g->packs; q += stride) {
        const int64_t bq = batch_of(d, g, q) - g->first_batch;
        if (bq == w) continue;
        const double *cq = row(d, g, q);
        for (Py_ssize_t m = 0; m < K; m++) {
            const int64_t p = g->members[w * K + m];
            const double *cp = row(d, g, p);
            for (Py_ssize_t s = 0; s < S; s++) shift[s] = cq[s] - cp[s];
            if (strays(g->sums + w * S, shift, d->targets, S, bar)) continue;
            double value = deviation(g->sums + w * S, shift, d->targets, S);
            if (value >= bar) continue;
            const int full = g->capacity[bq] == K;
            const double limit = partner_limit(d, g, bq, bar);
            for (Py_ssize_t s = 0; s < S; s++) shift[s] = -shift[s];
            if (strays(g->sums + bq * S, shift, d->targets, S, limit)) continue;
            const double new_b = deviation(g->sums + bq * S, shift, d->targets, S);
            if (new_b >= limit) continue;
            if (full && new_b > value) value = new_b;
            if (pack_meets_copy(d, g, p, g->first_batch + bq, q) || pack_meets_copy(d, g, q, g->first_batch + w, p))
                continue;
            bar = value;
            *best = (Exchange){value, p, q};
            found = 1;
        }
    }
    return found;
}

static void move_measure(Deal *d, Region *g, int64_t pack, Py_ssize_t s, double amount) {
    const int64_t b = batch_of(d, g, pack) - g->first_batch;
    d->composition[(g->first + pack) * d->sources + s] += amount;
    g->sums[b * d->sources + s] += amount;
}

/* Items i and j trade packs. */
void exchange_samples(Deal *d, Region *g, int64_t i, int64_t j) {
    const int64_t a = g->pack[i], b = g->pack[j];
    move_measure(d, g, a, g->source[i], -g->measure[i]);
    move_measure(d, g, a, g->source[j], g->measure[j]);
    move_measure(d, g, b, g->source[j], -g->measure[j]);
    move_measure(d, g, b, g->source[i], g->measure[i]);
    g->used[a] += g->length[j] - g->length[i];
    g->used[b] += g->length[i] - g->length[j];
    g->pack[i] = b;
    g->pack[j] = a;
    g->held[g->place[i]] = j;
    g->held[g->place[j]] = i;
    const int64_t place = g->place[i];
    g->place[i] = g->place[j];
    g->place[j] = place;
    const int64_t ba = batch_of(d, g, a) - g->first_batch, bb = batch_of(d, g, b) - g->first_batch;
    refresh(d, g, ba);
    refresh(d, g, bb);
}

/* Packs p (of batch w) and q trade batches. */
void exchange_packs(Deal *d, Region *g, Py_ssize_t w, int64_t p, int64_t q) {
    const Py_ssize_t S = d->sources, K = d->batch_packs;
    const int64_t bq = batch_of(d, g, q) - g->first_batch;
    for (Py_ssize_t m = 0; m < g->count[w]; m++)
        if (g->members[w * K + m] == p) g->members[w * K + m] = q;
    for (Py_ssize_t m = 0; m < g->count[bq]; m++)
        if (g->members[bq * K + m] == q) g->members[bq * K + m] = p;
    d->batch[g->first + p] = g->first_batch + bq;
    d->batch[g->first + q] = g->first_batch + w;
    for (Py_ssize_t s = 0; s < S; s++) {
        const double delta = row(d, g, q)[s] - row(d, g, p)[s];
        g->sums[w * S + s] += delta;
        g->sums[bq * S + s] -= delta;
    }
    refresh(d, g, w);
    refresh(d, g, bq);
}

/* The samples of batch `b`'s packs. */
static int64_t items_of(const Region *g, Py_ssize_t b, Py_ssize_t K) {
    int64_t items = 0;
    for (Py_ssize_t m = 0; m < g->count[b]; m++) {
        const int64_t p = g->members[b * K + m];
        items += g->held_from[p + 1] - g->held_from[p];
    }
    return items;
}

/* Exchanges that make batch `w` better (_global_batches.c's opening comment): of the best MULTIPLE
 * sample exchanges among the nearest in length, each that still makes it better once those before it
 * are made; when there is none, or they stall (PROGRESS), the best pack exchange; when there is none
 * either, the best sample exchange among the WIDE nearest. Returns the exchanges made, `*stuck` set
 * when the batch stalled and neither search helped; `tried` of every other batch they change is
 * cleared. */
static Py_ssize_t improve(Deal *d, Region *g, Py_ssize_t w, double aim, Py_ssize_t *pack_scans,
                          Py_ssize_t *wide_scans, char *tried, Exchange *top, double *shift, int *stuck) {
    const Py_ssize_t K = d->batch_packs;
    const int64_t items = items_of(g, w, K) + 1;
    const Py_ssize_t near = NEIGHBOURS < SCAN_BUDGET / items ? NEIGHBOURS : (SCAN_BUDGET / items > 4 ? SCAN_BUDGET / items : 4);
    const Py_ssize_t wide = WIDE < WIDE_BUDGET / items ? WIDE : (WIDE_BUDGET / items > near ? WIDE_BUDGET / items : near);
    const double before = g->dev[w];
    *stuck = 0;
    Py_ssize_t found = sample_exchanges(d, g, w, near, top, MULTIPLE, shift), made = 0;
    for (Py_ssize_t k = 0; k < found && g->dev[w] > aim; k++) {
        const int64_t i = top[k].mine, j = top[k].theirs;
        const int64_t bb = batch_of(d, g, g->pack[j]) - g->first_batch;
        if (k > 0) { /* an exchange before it may have moved either sample or changed the batches */
            if (batch_of(d, g, g->pack[i]) - g->first_batch != w || bb == w) continue;
            if (!room_for(d, g, j, g->length[i]) || !room_for(d, g, i, g->length[j])) continue;
            if (exchange_value(d, g, w, bb, i, j, g->dev[w], shift) == INFINITY) continue;
            if (meets_copy(d, g, j, g->first_batch + w, g->pack[i]) ||
                meets_copy(d, g, i, g->first_batch + bb, g->pack[j]))
                continue;
        }
        exchange_samples(d, g, i, j);
        tried[bb] = 0;
        made++;
    }
    if (made && (before - g->dev[w]) * PROGRESS >= before - aim) return made;
    if (*pack_scans > 0) {
        Exchange best;
        --*pack_scans;
        if (pack_exchange(d, g, w, *pack_scans, &best, shift)) {
            tried[batch_of(d, g, best.theirs) - g->first_batch] = 0;
            exchange_packs(d, g, w, best.mine, best.theirs);
            return made + 1;
        }
    }
    if (wide > near && *wide_scans > 0) {
        --*wide_scans;
        if (sample_exchanges(d, g, w, wide, top, 1, shift)) {
            tried[batch_of(d, g, g->pack[top[0].theirs]) - g->first_batch] = 0;
            exchange_samples(d, g, top[0].mine, top[0].theirs);
            return made + 1;
        }
    }
    *stuck = 1;
    return made;
}

/* Step 2: returns the exchanges made. Each round works on the worst full batch; when no exchange
 * makes it better, on the next worst above the aim, and so on; it stops when none of them can be made
 * better. A batch no exchange could make better is tried again only once an exchange changes it (so
 * batches that cannot be fixed cost one scan each, not one per exchange elsewhere). */
Py_ssize_t exchange_rounds(Deal *d, Region *g, Py_ssize_t rounds, double aim, double *shift) {
    const Py_ssize_t K = d->batch_packs;
    Py_ssize_t pack_scans = SCANS_PER_BATCH * g->batches, wide_scans = SCANS_PER_BATCH * g->batches;
    char *tried = calloc((size_t)g->batches, 1);
    Exchange top[MULTIPLE];
    if (tried == NULL) return 0; /* out of memory: the deal as the greedy left it */
    Py_ssize_t made = 0;
    for (Py_ssize_t round = 0; round < rounds;) {
        Py_ssize_t w = -1;
        for (Py_ssize_t b = 0; b < g->batches; b++)
            if (g->capacity[b] == K && !tried[b] && g->dev[b] > aim && (w < 0 || g->dev[b] > g->dev[w])) w = b;
        if (w < 0) break; /* every batch within the aim, or none that single exchanges make better */
        int stuck;
        const Py_ssize_t exchanges = improve(d, g, w, aim, &pack_scans, &wide_scans, tried, top, shift, &stuck);
        made += exchanges;
        round += exchanges > 0;
        if (stuck) tried[w] = 1;
    }
    free(tried);
    return made;
}
