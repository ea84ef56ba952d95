/* Step 2 of the global-batch deal (_global_batches.c's opening comment): copies of a sample parted
 * (`part_copies`, `part_samples`) and the exchanges that bring the worst batches to the aim
 * (`exchange_rounds`, a round's exchanges by `improve`). */
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
#define PART_NEIGHBOURS 4096 /* samples nearest in length looked at to part a sample from its copy */

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

/* 1 when item `i`, moved into pack `p` of batch `b`, would meet a copy of its sample: in `p`, or (the
 * sample not `crowded`) in another pack of `b`. A crowded sample's copies are many: the pack's few
 * items are looked at instead. */
static int meets_copy(const Deal *d, const Region *g, int64_t i, int64_t b, int64_t p) {
    if (crowded(g, i)) {
        for (int64_t e = g->held_from[p]; e < g->held_from[p + 1]; e++)
            if (g->held[e] != i && g->sample[g->held[e]] == g->sample[i]) return 1;
        return 0;
    }
    for (int64_t k = g->copies_from[i]; k < g->copies_to[i]; k++) {
        const int64_t o = g->copies[k];
        if (o != i && batch_of(d, g, g->pack[o]) == b) return 1;
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

/* The next sample nearest item `i`'s length `li` (the nearer of the next longer, `*up`, and the next
 * shorter, `*down`); -1 for a longer one past `longest` (it would overfill the pack of `i`), after
 * which no longer one is looked at. */
static int64_t next_nearest(const Region *g, int64_t *up, int64_t *down, int64_t li, int64_t longest) {
    if (*up < g->items && (*down < 0 || g->length[*up] - li <= li - g->length[*down])) {
        const int64_t j = (*up)++;
        if (g->length[j] <= longest) return j;
        *up = g->items;
        return -1;
    }
    return (*down)--;
}

/* 1 when item `j`'s pack has room for a sample of `li` tokens in place of `j`. */
static int room_for(const Deal *d, const Region *g, int64_t j, int64_t li) {
    return li <= g->length[j] + d->pack_size - g->used[g->pack[j]];
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
static void exchange_samples(Deal *d, Region *g, int64_t i, int64_t j) {
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
static void exchange_packs(Deal *d, Region *g, Py_ssize_t w, int64_t p, int64_t q) {
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

/* Marks `seen[b] = i + 1` at every batch `b` of the region holding a copy of item `i`'s sample
 * other than `i`. */
static void mark_copy_batches(const Deal *d, const Region *g, int64_t i, int64_t *seen) {
    for (int64_t k = g->copies_from[i]; k < g->copies_to[i]; k++) {
        const int64_t o = g->copies[k];
        if (o != i) seen[batch_of(d, g, g->pack[o]) - g->first_batch] = i + 1;
    }
}

/* Samples still beside a copy of themselves in their batch (where the greedy had to put a pack with a
 * copy and no pack exchange parted them), each exchanged with a sample of the same source and about
 * its length in another batch (both packs within the pack size) that holds no copy of it and whose
 * own sample has none in this batch: one of the same measure when there is one (the shares do not
 * move), else one that leaves neither batch further off than it was or than `aim`. Returns -1 when
 * out of memory. */
int part_samples(Deal *d, Region *g, double aim, double *shift) {
    const Py_ssize_t S = d->sources;
    int64_t *seen = calloc((size_t)g->batches, sizeof(int64_t));
    if (seen == NULL) return -1;
    for (int64_t i = 0; i < g->items; i++) {
        const int64_t bi = batch_of(d, g, g->pack[i]);
        if (crowded(g, i) || !meets_copy(d, g, i, bi, g->pack[i])) continue; /* crowded: copies are not parted */
        mark_copy_batches(d, g, i, seen);
        const int64_t a = g->pack[i], free_a = d->pack_size - g->used[a], li = g->length[i];
        int64_t chosen = -1;
        for (int same_measure = 1; same_measure >= 0 && chosen < 0; same_measure--) {
            int64_t up = i + 1, down = i - 1;
            for (Py_ssize_t looked = 0; looked < PART_NEIGHBOURS && (up < g->items || down >= 0) && chosen < 0;
                 looked++) {
                const int64_t j = next_nearest(g, &up, &down, li, li + free_a);
                if (j < 0) continue;
                const int64_t bj = batch_of(d, g, g->pack[j]);
                /* `bi` and every other batch holding a copy of i's sample are `seen` */
                if (seen[bj - g->first_batch] == i + 1 || g->source[j] != g->source[i] || g->sample[j] == g->sample[i] ||
                    !room_for(d, g, j, li))
                    continue;
                if (same_measure ? g->measure[j] != g->measure[i] : g->measure[j] == g->measure[i]) continue;
                if (!same_measure) {
                    const Py_ssize_t s = g->source[i], ri = bi - g->first_batch, rj = bj - g->first_batch;
                    for (Py_ssize_t k = 0; k < S; k++) shift[k] = 0.0;
                    shift[s] = g->measure[j] - g->measure[i];
                    if (deviation(g->sums + ri * S, shift, d->targets, S) > fmax(g->dev[ri], aim)) continue;
                    shift[s] = -shift[s];
                    if (deviation(g->sums + rj * S, shift, d->targets, S) > fmax(g->dev[rj], aim)) continue;
                }
                if (meets_copy(d, g, j, bi, a)) continue;
                chosen = j;
            }
        }
        if (chosen >= 0) exchange_samples(d, g, i, chosen);
    }
    free(seen);
    return 0;
}

/* Adds `step` to `in_batch[b]` and `in_pack[q]` for every copy of one of pack `p`'s samples (not
 * `crowded`) in another pack `q` of batch `b`. */
static void count_copies(const Deal *d, const Region *g, int64_t p, int64_t *in_batch, int64_t *in_pack,
                         int64_t step) {
    for (int64_t e = g->held_from[p]; e < g->held_from[p + 1]; e++) {
        const int64_t i = g->held[e];
        if (crowded(g, i)) continue;
        for (int64_t k = g->copies_from[i]; k < g->copies_to[i]; k++) {
            const int64_t q = g->pack[g->copies[k]];
            if (q == p) continue;
            in_batch[batch_of(d, g, q) - g->first_batch] += step;
            in_pack[q] += step;
        }
    }
}

/* Packs the greedy put with a copy of one of their samples, each exchanged with the pack of another
 * batch that leaves neither batch holding a sample twice and the larger deviation of the two smallest
 * (none: it stays). Returns -1 when out of memory. */
int part_copies(Deal *d, Region *g, double *shift) {
    const Py_ssize_t S = d->sources, K = d->batch_packs;
    /* the copies of the parted pack's samples in each batch and each pack (outside it): pack `q` of
     * batch `b` may take its place when all those of `b` are in `q` */
    int64_t *in_batch = calloc((size_t)g->batches, sizeof(int64_t));
    int64_t *in_pack = calloc((size_t)g->packs, sizeof(int64_t));
    if (in_batch == NULL || in_pack == NULL) {
        free(in_batch);
        free(in_pack);
        return -1;
    }
    for (int64_t p = 0; p < g->packs; p++) {
        const int64_t bp = batch_of(d, g, p) - g->first_batch;
        if (!pack_meets_copy(d, g, p, g->first_batch + bp, -1)) continue;
        count_copies(d, g, p, in_batch, in_pack, 1);
        double best = INFINITY;
        int64_t partner = -1;
        for (int64_t q = 0; q < g->packs; q++) {
            const int64_t bq = batch_of(d, g, q) - g->first_batch;
            if (bq == bp || in_batch[bq] > in_pack[q]) continue;
            for (Py_ssize_t s = 0; s < S; s++) shift[s] = row(d, g, q)[s] - row(d, g, p)[s];
            double value = g->capacity[bp] == K ? deviation(g->sums + bp * S, shift, d->targets, S) : 0.0;
            if (value >= best) continue;
            for (Py_ssize_t s = 0; s < S; s++) shift[s] = -shift[s];
            const double other = g->capacity[bq] == K ? deviation(g->sums + bq * S, shift, d->targets, S) : 0.0;
            if (other > value) value = other;
            if (value >= best || pack_meets_copy(d, g, q, g->first_batch + bp, p)) continue;
            best = value;
            partner = q;
        }
        count_copies(d, g, p, in_batch, in_pack, -1); /* before the exchange moves the batches */
        if (partner >= 0) exchange_packs(d, g, bp, p, partner);
    }
    free(in_batch);
    free(in_pack);
    return 0;
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
