/* The native kernel of tightpack/core/global_batches.py: the packs of a mixture dealt into global
 * batches so that every batch holds the target shares. That module's docstring says the rule; here,
 * how it runs.
 *
 * `deal_batches` works region by region (a region: `region_batches` consecutive batches' worth of
 * packs in their planned order; the last region takes the rest when fewer than half a region's batches
 * would be left). A region's samples (its "items", one per copy) are held sorted by length, each with
 * the pack it is in: a sample exchange between two packs then only trades the two items' packs (the
 * length order is unchanged), and the samples of about a given length lie next to each other.
 *
 *   1. greedy: the packs, largest first, each to the batch with room where it adds least to the
 *      squared share deviation plus `balance` times the squared distance from a mean batch; a batch
 *      holding a copy of one of its samples is passed over unless every batch with room does; then a
 *      pack put with a copy is exchanged with a pack of another batch where neither holds a copy
 *      (`part_copies`), and a sample still beside its copy with a sample of another batch
 *      (`part_samples`);
 *   2. exchanges (`exchange`, `improve`), until every full batch is within `aim` (a fraction) or none
 *      can be made better, at most `rounds_per_batch` per batch. Each round takes the worst full
 *      batch (when no exchange makes it better, the next worst above the aim, and so on) and makes
 *      the better of: the best sample exchange (a sample of it for one of the samples nearest its
 *      length in another batch, both packs within `pack_size`: NEIGHBOURS of each, fewer for a batch
 *      of many samples), taken at once when it closes half the batch's way to the aim; the best pack
 *      exchange with one of about PACK_CANDIDATES packs of the region; the best sample exchange among
 *      the WIDE nearest. The other batch must end closer than the worst was when it is full, and no
 *      further off than it was when it is the partial last one; no exchange brings a copy of a sample
 *      into a batch that holds one;
 *   3. the packs of each batch put in order (`order_batch`).
 *
 * At the end the slots of every pack (the caller's arrays, in plan order) are rewritten with the
 * samples the pack holds, and `order_out` lists the packs in the order a run reads them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Samples nearest in length looked at per sample of the worst batch; measured on the benchmark's
 * mixture at 8k: 16 leaves its batches of one long sample a point off, 64 takes longer, no closer. */
#define NEIGHBOURS 32
#define WIDE 1024 /* ... when none of those helps, before pack exchanges are tried */
/* Candidates one scan looks at, at most: a batch of many small samples looks at fewer neighbours of
 * each (no fewer than 4). */
#define SCAN_BUDGET (1 << 16)
#define WIDE_BUDGET (1 << 18)
#define PACK_CANDIDATES 1024 /* packs a pack exchange looks at as partners */
#define PART_NEIGHBOURS 4096 /* samples nearest in length looked at to part a sample from its copy */

typedef struct {
    Py_ssize_t sources, batch_packs;
    int64_t pack_size;
    const double *targets; /* [sources] */
    double *composition;   /* [packs * sources] */
    int64_t *batch;        /* [packs]: -1 before it is dealt */
} Deal;

typedef struct {
    double key;
    int64_t index;
} Keyed;

static int larger_first(const void *a, const void *b) {
    const Keyed *x = a, *y = b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* `order` [n]: 0 .. n-1 stably sorted by `keys` (a counting sort over the keys' span); -1 when out of
 * memory. */
static int counting_order(const int64_t *keys, int64_t n, int64_t *order) {
    int64_t low = 0, high = -1;
    for (int64_t k = 0; k < n; k++) {
        if (k == 0 || keys[k] < low) low = keys[k];
        if (k == 0 || keys[k] > high) high = keys[k];
    }
    int64_t *starts = calloc((size_t)(high - low + 2), sizeof(int64_t));
    if (starts == NULL) return -1;
    for (int64_t k = 0; k < n; k++) starts[keys[k] - low + 1]++;
    for (int64_t v = 1; v <= high - low + 1; v++) starts[v] += starts[v - 1];
    for (int64_t k = 0; k < n; k++) order[starts[keys[k] - low]++] = k;
    free(starts);
    return 0;
}

/* One region: its packs [first, stop) and batches [first_batch, first_batch + batches); its items
 * (copies of samples) sorted by length. Packs and items are numbered within the region. */
typedef struct {
    Py_ssize_t first, stop, packs, batches, items;
    int64_t first_batch;
    /* items, shortest first: fixed */
    int64_t *length, *sample, *source, *copies_from, *copies_to; /* copies: a range of `copies` */
    double *measure;
    int64_t *copies; /* every item's copies (items of the same sample), grouped by sample */
    /* items: mutable */
    int64_t *pack; /* the pack an item is in */
    int64_t *place; /* its place in `held` */
    /* packs */
    int64_t *held_from; /* [packs + 1]: the range of `held` listing a pack's items */
    int64_t *held;      /* the items of each pack (mutable) */
    int64_t *used;      /* tokens */
    /* batches */
    double *sums, *dev;
    Py_ssize_t *count, *capacity, *members; /* members: [batches * batch_packs] packs */
} Region;

static int64_t batch_of(const Deal *d, const Region *g, int64_t pack) { return d->batch[g->first + pack]; }

static const double *row(const Deal *d, const Region *g, int64_t pack) {
    return d->composition + (g->first + pack) * d->sources;
}

/* 1 when item `i`'s sample has a copy other than `skip` in a pack of batch `b`. */
static int copy_in_batch(const Deal *d, const Region *g, int64_t i, int64_t b, int64_t skip) {
    for (int64_t k = g->copies_from[i]; k < g->copies_to[i]; k++) {
        const int64_t o = g->copies[k];
        if (o != i && o != skip && batch_of(d, g, g->pack[o]) == b) return 1;
    }
    return 0;
}

/* 1 when a sample of pack `p` has a copy in a pack other than `p` and `skip` of batch `b`. */
static int pack_meets_copy(const Deal *d, const Region *g, int64_t p, int64_t b, int64_t skip) {
    for (int64_t e = g->held_from[p]; e < g->held_from[p + 1]; e++) {
        const int64_t i = g->held[e];
        for (int64_t k = g->copies_from[i]; k < g->copies_to[i]; k++) {
            const int64_t q = g->pack[g->copies[k]];
            if (q != p && q != skip && batch_of(d, g, q) == b) return 1;
        }
    }
    return 0;
}

/* The largest |share - target| of `sums` + `shift` (shift may be NULL); 0 when they hold nothing. */
static double deviation(const double *sums, const double *shift, const double *targets, Py_ssize_t sources) {
    double total = 0.0;
    for (Py_ssize_t s = 0; s < sources; s++) total += sums[s] + (shift ? shift[s] : 0.0);
    if (total <= 0.0) return 0.0;
    double worst = 0.0;
    for (Py_ssize_t s = 0; s < sources; s++) {
        const double x = fabs((sums[s] + (shift ? shift[s] : 0.0)) / total - targets[s]);
        if (x > worst) worst = x;
    }
    return worst;
}

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

/* The source of `sums` furthest from its target share, and their total. */
static Py_ssize_t furthest(const double *sums, const double *targets, Py_ssize_t sources, double *total) {
    *total = 0.0;
    for (Py_ssize_t s = 0; s < sources; s++) *total += sums[s];
    Py_ssize_t worst = 0;
    for (Py_ssize_t s = 1; s < sources; s++)
        if (fabs(sums[s] - targets[s] * *total) > fabs(sums[worst] - targets[worst] * *total)) worst = s;
    return worst;
}

static void place_in(const Deal *d, Region *g, int64_t p, Py_ssize_t b) {
    const Py_ssize_t S = d->sources;
    g->members[b * d->batch_packs + g->count[b]++] = p;
    d->batch[g->first + p] = g->first_batch + b;
    for (Py_ssize_t s = 0; s < S; s++) g->sums[b * S + s] += row(d, g, p)[s];
}

/* Step 1: returns -1 when out of memory. */
static int greedy(Deal *d, Region *g, double balance) {
    const Py_ssize_t S = d->sources, K = d->batch_packs, n = g->packs, B = g->batches;
    double *mean = calloc((size_t)S, sizeof(double));
    /* per source, every batch (source-major, so the cost loop runs over contiguous batches): its
     * share deviation and its measure over a mean batch's less its packs' part, in mean-batch units */
    double *off = calloc((size_t)(S * B), sizeof(double));
    double *rel = calloc((size_t)(S * B), sizeof(double));
    double *cost = malloc(sizeof(double) * (size_t)B);
    double *closed = calloc((size_t)B, sizeof(double)); /* INFINITY once a batch is full */
    Keyed *keyed = malloc(sizeof(Keyed) * (size_t)n);
    int status = -1;
    if (!mean || !off || !rel || !cost || !closed || !keyed) goto done;
    for (int64_t p = 0; p < n; p++)
        for (Py_ssize_t s = 0; s < S; s++) mean[s] += row(d, g, p)[s];
    double total = 0.0;
    for (Py_ssize_t s = 0; s < S; s++) total += mean[s];
    for (Py_ssize_t s = 0; s < S; s++) {
        mean[s] = d->targets[s] * total * (double)K / (double)n;
        if (mean[s] <= 0.0) mean[s] = 1.0; /* a source with no share, or a region with no measure */
    }
    for (int64_t p = 0; p < n; p++) {
        double key = 0.0;
        for (Py_ssize_t s = 0; s < S; s++)
            if (row(d, g, p)[s] / mean[s] > key) key = row(d, g, p)[s] / mean[s];
        keyed[p] = (Keyed){key, p};
    }
    qsort(keyed, (size_t)n, sizeof(Keyed), larger_first);
    for (int64_t k = 0; k < n; k++) {
        const int64_t p = keyed[k].index;
        const double *c = row(d, g, p);
        double weight = 0.0;
        for (Py_ssize_t s = 0; s < S; s++) weight += c[s];
        /* a batch's cost, less what is the same for every batch: sum_s step_s off_sb + balance x_s rel_sb */
        memcpy(cost, closed, sizeof(double) * (size_t)B);
        for (Py_ssize_t s = 0; s < S; s++) {
            const double step = (c[s] - d->targets[s] * weight) / mean[s], scaled = balance * c[s] / mean[s];
            const double *o = off + s * B, *r = rel + s * B;
            for (Py_ssize_t b = 0; b < B; b++) cost[b] += step * o[b] + scaled * r[b];
        }
        Py_ssize_t chosen = -1, fallback = -1;
        for (;;) { /* the cheapest open batch that holds no copy of the pack's samples */
            Py_ssize_t pick = -1;
            for (Py_ssize_t b = 0; b < B; b++)
                if (cost[b] < INFINITY && (pick < 0 || cost[b] < cost[pick])) pick = b;
            if (pick < 0) break;
            if (fallback < 0) fallback = pick;
            if (!pack_meets_copy(d, g, p, g->first_batch + pick, -1)) {
                chosen = pick;
                break;
            }
            cost[pick] = INFINITY;
        }
        if (chosen < 0) chosen = fallback; /* every batch with room holds a copy: the cheapest */
        place_in(d, g, p, chosen);
        if (g->count[chosen] == g->capacity[chosen]) closed[chosen] = INFINITY;
        const double *sum = g->sums + chosen * S;
        double held = 0.0;
        for (Py_ssize_t s = 0; s < S; s++) held += sum[s];
        for (Py_ssize_t s = 0; s < S; s++) {
            off[s * B + chosen] = (sum[s] - d->targets[s] * held) / mean[s];
            rel[s * B + chosen] = sum[s] / mean[s] - (double)g->count[chosen] / (double)K;
        }
    }
    status = 0;
done:
    free(mean);
    free(off);
    free(rel);
    free(cost);
    free(closed);
    free(keyed);
    return status;
}

typedef struct {
    double value;
    int64_t mine, theirs; /* items (sample exchange) or packs (pack exchange) */
} Exchange;

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

/* The best sample exchange for the worst batch `w` into `best`; returns 0 when none makes it better. */
static int sample_exchange(const Deal *d, const Region *g, Py_ssize_t w, Py_ssize_t neighbours, Exchange *best,
                           double *shift) {
    const Py_ssize_t S = d->sources, K = d->batch_packs;
    const int64_t bw = g->first_batch + w;
    int found = 0;
    double bar = g->dev[w], total_w;
    const Py_ssize_t first = furthest(g->sums + w * S, d->targets, S, &total_w);
    for (Py_ssize_t m = 0; m < g->count[w]; m++) {
        const int64_t a = g->members[w * K + m];
        const int64_t free_a = d->pack_size - g->used[a];
        for (int64_t e = g->held_from[a]; e < g->held_from[a + 1]; e++) {
            const int64_t i = g->held[e], li = g->length[i];
            int64_t up = i + 1, down = i - 1;
            for (Py_ssize_t looked = 0; looked < neighbours && (up < g->items || down >= 0); looked++) {
                const int64_t j = next_nearest(g, &up, &down, li, li + free_a);
                if (j < 0) continue;
                const int64_t bb = batch_of(d, g, g->pack[j]) - g->first_batch;
                if (bb == w || g->sample[j] == g->sample[i] || !room_for(d, g, j, li)) continue;
                const Py_ssize_t from = g->source[i], to = g->source[j];
                const double out = g->measure[i], in = g->measure[j];
                if (exchange_strays(g->sums + w * S, total_w, d->targets, S, from, out, to, in, first, bar)) continue;
                for (Py_ssize_t s = 0; s < S; s++) shift[s] = 0.0;
                shift[to] += in;
                shift[from] -= out;
                double value = deviation(g->sums + w * S, shift, d->targets, S);
                if (value >= bar) continue; /* `strays` and the exact figure may differ in the last bit */
                const int full = g->capacity[bb] == K;
                const double limit = full ? bar : fmax(bar, g->dev[bb]); /* a partial batch: no worse */
                double total_b;
                const Py_ssize_t first_b = furthest(g->sums + bb * S, d->targets, S, &total_b);
                if (exchange_strays(g->sums + bb * S, total_b, d->targets, S, to, in, from, out, first_b, limit))
                    continue;
                for (Py_ssize_t s = 0; s < S; s++) shift[s] = -shift[s];
                const double new_b = deviation(g->sums + bb * S, shift, d->targets, S);
                if (new_b >= limit) continue;
                if (full && new_b > value) value = new_b;
                if (copy_in_batch(d, g, j, bw, -1) || copy_in_batch(d, g, i, g->first_batch + bb, -1)) continue;
                bar = value;
                *best = (Exchange){value, i, j};
                found = 1;
            }
        }
    }
    return found;
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
            const double limit = full ? bar : fmax(bar, g->dev[bq]); /* a partial batch: no worse */
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
    g->dev[ba] = deviation(g->sums + ba * d->sources, NULL, d->targets, d->sources);
    g->dev[bb] = deviation(g->sums + bb * d->sources, NULL, d->targets, d->sources);
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
    g->dev[w] = deviation(g->sums + w * S, NULL, d->targets, S);
    g->dev[bq] = deviation(g->sums + bq * S, NULL, d->targets, S);
}

/* Samples still beside a copy of themselves in their batch (where the greedy had to put a pack with a
 * copy and no pack exchange parted them), each exchanged with a sample of the same source and about
 * its length in another batch (both packs within the pack size) that holds no copy of it and whose
 * own sample has none in this batch: one of the same measure when there is one (the shares do not
 * move), else one that leaves neither batch further off than it was or than `aim`. */
static void part_samples(Deal *d, Region *g, double aim, double *shift) {
    const Py_ssize_t S = d->sources;
    for (int64_t i = 0; i < g->items; i++) {
        const int64_t bi = batch_of(d, g, g->pack[i]);
        if (!copy_in_batch(d, g, i, bi, -1)) continue;
        const int64_t a = g->pack[i], free_a = d->pack_size - g->used[a], li = g->length[i];
        int64_t chosen = -1;
        for (int same_measure = 1; same_measure >= 0 && chosen < 0; same_measure--) {
            int64_t up = i + 1, down = i - 1;
            for (Py_ssize_t looked = 0; looked < PART_NEIGHBOURS && (up < g->items || down >= 0) && chosen < 0;
                 looked++) {
                const int64_t j = next_nearest(g, &up, &down, li, li + free_a);
                if (j < 0) continue;
                const int64_t bj = batch_of(d, g, g->pack[j]);
                if (bj == bi || g->source[j] != g->source[i] || g->sample[j] == g->sample[i] || !room_for(d, g, j, li))
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
                if (copy_in_batch(d, g, j, bi, -1) || copy_in_batch(d, g, i, bj, -1)) continue;
                chosen = j;
            }
        }
        if (chosen >= 0) exchange_samples(d, g, i, chosen);
    }
}

/* Packs the greedy put with a copy of one of their samples, each exchanged with the pack of another
 * batch that leaves neither batch holding a sample twice and the larger deviation of the two smallest
 * (none: it stays). */
static void part_copies(Deal *d, Region *g, double *shift) {
    const Py_ssize_t S = d->sources, K = d->batch_packs;
    for (int64_t p = 0; p < g->packs; p++) {
        const int64_t bp = batch_of(d, g, p) - g->first_batch;
        if (!pack_meets_copy(d, g, p, g->first_batch + bp, -1)) continue;
        double best = INFINITY;
        int64_t partner = -1;
        for (int64_t q = 0; q < g->packs; q++) {
            const int64_t bq = batch_of(d, g, q) - g->first_batch;
            if (bq == bp) continue;
            for (Py_ssize_t s = 0; s < S; s++) shift[s] = row(d, g, q)[s] - row(d, g, p)[s];
            double value = g->capacity[bp] == K ? deviation(g->sums + bp * S, shift, d->targets, S) : 0.0;
            if (value >= best) continue;
            for (Py_ssize_t s = 0; s < S; s++) shift[s] = -shift[s];
            const double other = g->capacity[bq] == K ? deviation(g->sums + bq * S, shift, d->targets, S) : 0.0;
            if (other > value) value = other;
            if (value >= best) continue;
            if (pack_meets_copy(d, g, p, g->first_batch + bq, q) || pack_meets_copy(d, g, q, g->first_batch + bp, p))
                continue;
            best = value;
            partner = q;
        }
        if (partner >= 0) exchange_packs(d, g, bp, p, partner);
    }
}

/* Step 2: returns the exchanges made. */
/* The samples of batch `b`'s packs. */
static int64_t items_of(const Region *g, Py_ssize_t b, Py_ssize_t K) {
    int64_t items = 0;
    for (Py_ssize_t m = 0; m < g->count[b]; m++) {
        const int64_t p = g->members[b * K + m];
        items += g->held_from[p + 1] - g->held_from[p];
    }
    return items;
}

/* One exchange that makes batch `w` better (module comment); returns the other batch, -1 when none does. */
static Py_ssize_t improve(Deal *d, Region *g, Py_ssize_t w, double aim, Py_ssize_t *pack_scans, double *shift) {
    const Py_ssize_t K = d->batch_packs;
    const int64_t items = items_of(g, w, K) + 1;
    const Py_ssize_t near = NEIGHBOURS < SCAN_BUDGET / items ? NEIGHBOURS : (SCAN_BUDGET / items > 4 ? SCAN_BUDGET / items : 4);
    const Py_ssize_t wide = WIDE < WIDE_BUDGET / items ? WIDE : (WIDE_BUDGET / items > near ? WIDE_BUDGET / items : near);
    Exchange sample, pack;
    const int by_sample = sample_exchange(d, g, w, near, &sample, shift);
    if (by_sample && g->dev[w] - sample.value >= 0.5 * (g->dev[w] - aim)) { /* half the way: no pack scan */
        const Py_ssize_t partner = batch_of(d, g, g->pack[sample.theirs]) - g->first_batch;
        exchange_samples(d, g, sample.mine, sample.theirs);
        return partner;
    }
    const int by_pack = *pack_scans > 0 && pack_exchange(d, g, w, *pack_scans, &pack, shift);
    if (by_pack) --*pack_scans;
    if (by_pack && (!by_sample || pack.value < sample.value)) {
        const Py_ssize_t partner = batch_of(d, g, pack.theirs) - g->first_batch;
        exchange_packs(d, g, w, pack.mine, pack.theirs);
        return partner;
    }
    if (by_sample || (wide > near && sample_exchange(d, g, w, wide, &sample, shift))) {
        const Py_ssize_t partner = batch_of(d, g, g->pack[sample.theirs]) - g->first_batch;
        exchange_samples(d, g, sample.mine, sample.theirs);
        return partner;
    }
    return -1;
}

/* Step 2: returns the exchanges made. Each round works on the worst full batch; when no exchange
 * makes it better, on the next worst above the aim, and so on; it stops when none of them can be made
 * better. A batch no exchange could make better is tried again only once an exchange changes it (so
 * batches that cannot be fixed cost one scan each, not one per exchange elsewhere). */
static Py_ssize_t exchange(Deal *d, Region *g, Py_ssize_t rounds, double aim, double *shift) {
    const Py_ssize_t K = d->batch_packs;
    Py_ssize_t pack_scans = 8 * g->batches; /* a pack exchange scans the region: at most 8 per batch */
    char *tried = calloc((size_t)g->batches, 1);
    if (tried == NULL) return 0; /* out of memory: the deal as the greedy left it */
    Py_ssize_t made = 0;
    while (made < rounds) {
        Py_ssize_t w = -1;
        for (Py_ssize_t b = 0; b < g->batches; b++)
            if (g->capacity[b] == K && !tried[b] && g->dev[b] > aim && (w < 0 || g->dev[b] > g->dev[w])) w = b;
        if (w < 0) break; /* every batch within the aim, or none that single exchanges make better */
        const Py_ssize_t partner = improve(d, g, w, aim, &pack_scans, shift);
        if (partner >= 0) {
            made++;
            tried[partner] = 0;
        } else {
            tried[w] = 1;
        }
    }
    free(tried);
    return made;
}

/* The packs of batch `b` in the order a run reads them, into `out`: each step the one (earliest in
 * planned order on a tie) that keeps smallest the largest running deviation of any source,
 * `sum(measure_s) - target_s * sum(measure)` over the batch's packs so far; so a stretch of packs that
 * straddles two batches, the end of one and the start of the next, stays near the targets too. */
static void order_batch(const Deal *d, const Region *g, Py_ssize_t b, int64_t *out, double *running) {
    const Py_ssize_t S = d->sources, K = d->batch_packs, n = g->count[b];
    Py_ssize_t *members = g->members + b * K;
    for (Py_ssize_t m = 1; m < n; m++) /* planned order first: the earliest wins a tie */
        for (Py_ssize_t k = m; k > 0 && members[k - 1] > members[k]; k--) {
            const Py_ssize_t swap = members[k];
            members[k] = members[k - 1];
            members[k - 1] = swap;
        }
    for (Py_ssize_t s = 0; s < S; s++) running[s] = 0.0;
    for (Py_ssize_t step = 0; step < n; step++) {
        Py_ssize_t best = step;
        double best_value = INFINITY;
        for (Py_ssize_t m = step; m < n; m++) { /* members[step:] are the packs left */
            const double *c = row(d, g, members[m]);
            double weight = 0.0, value = 0.0;
            for (Py_ssize_t s = 0; s < S; s++) weight += c[s];
            for (Py_ssize_t s = 0; s < S; s++) {
                const double x = fabs(running[s] + c[s] - d->targets[s] * weight);
                if (x > value) value = x;
            }
            if (value < best_value) {
                best_value = value;
                best = m;
            }
        }
        const Py_ssize_t chosen = members[best];
        for (Py_ssize_t m = best; m > step; m--) members[m] = members[m - 1]; /* the rest keep their order */
        members[step] = chosen;
        const double *c = row(d, g, chosen);
        double weight = 0.0;
        for (Py_ssize_t s = 0; s < S; s++) weight += c[s];
        for (Py_ssize_t s = 0; s < S; s++) running[s] += c[s] - d->targets[s] * weight;
        out[step] = g->first + chosen;
    }
}

typedef struct {
    const int64_t *pack_offsets;
    int64_t *slot_sample, *slot_length, *slot_source;
    double *slot_measure;
    int64_t *order; /* [packs]: the packs in the order a run reads them */
} Slots;

static void free_region(Region *g) {
    free(g->length);
    free(g->sample);
    free(g->source);
    free(g->copies_from);
    free(g->copies_to);
    free(g->measure);
    free(g->copies);
    free(g->pack);
    free(g->place);
    free(g->held_from);
    free(g->held);
    free(g->used);
    free(g->sums);
    free(g->dev);
    free(g->count);
    free(g->capacity);
    free(g->members);
}

/* Deal one region; returns the exchanges made, or -1 when out of memory. */
static Py_ssize_t deal_region(Deal *d, Slots *t, Py_ssize_t first, Py_ssize_t stop, int64_t first_batch,
                              Py_ssize_t batches, double balance, Py_ssize_t rounds_per_batch, double aim) {
    const Py_ssize_t S = d->sources, K = d->batch_packs, n = stop - first;
    const int64_t first_slot = t->pack_offsets[first], items = t->pack_offsets[stop] - first_slot;
    Region g = {first, stop, n, batches, items, first_batch};
    const size_t ni = (size_t)items + 1, np = (size_t)n + 1, nb = (size_t)batches;
    g.length = malloc(sizeof(int64_t) * ni);
    g.sample = malloc(sizeof(int64_t) * ni);
    g.source = malloc(sizeof(int64_t) * ni);
    g.copies_from = malloc(sizeof(int64_t) * ni);
    g.copies_to = malloc(sizeof(int64_t) * ni);
    g.measure = malloc(sizeof(double) * ni);
    g.copies = malloc(sizeof(int64_t) * ni);
    g.pack = malloc(sizeof(int64_t) * ni);
    g.place = malloc(sizeof(int64_t) * ni);
    g.held_from = malloc(sizeof(int64_t) * np);
    g.held = malloc(sizeof(int64_t) * ni);
    g.used = calloc(np, sizeof(int64_t));
    g.sums = calloc(nb * (size_t)S, sizeof(double));
    g.dev = calloc(nb, sizeof(double));
    g.count = calloc(nb, sizeof(Py_ssize_t));
    g.capacity = malloc(sizeof(Py_ssize_t) * nb);
    g.members = malloc(sizeof(Py_ssize_t) * nb * (size_t)K);
    int64_t *order = malloc(sizeof(int64_t) * ni);
    double *shift = malloc(sizeof(double) * (size_t)S);
    Py_ssize_t made = -1;
    if (!g.length || !g.sample || !g.source || !g.copies_from || !g.copies_to || !g.measure || !g.copies ||
        !g.pack || !g.place || !g.held_from || !g.held || !g.used || !g.sums || !g.dev || !g.count ||
        !g.capacity || !g.members || !order || !shift)
        goto done;
    for (Py_ssize_t b = 0; b < batches; b++) g.capacity[b] = n - b * K < K ? n - b * K : K;
    /* the items, shortest first; each slot's item is its place in that order */
    if (counting_order(t->slot_length + first_slot, items, order) != 0) goto done;
    for (int64_t i = 0; i < items; i++) {
        const int64_t slot = first_slot + order[i];
        g.length[i] = t->slot_length[slot];
        g.sample[i] = t->slot_sample[slot];
        g.source[i] = t->slot_source[slot];
        g.measure[i] = t->slot_measure[slot];
        g.place[i] = order[i];
        g.held[order[i]] = i;
    }
    for (int64_t p = 0; p <= n; p++) g.held_from[p] = t->pack_offsets[first + p] - first_slot;
    for (int64_t p = 0; p < n; p++)
        for (int64_t e = g.held_from[p]; e < g.held_from[p + 1]; e++) {
            g.pack[g.held[e]] = p;
            g.used[p] += g.length[g.held[e]];
        }
    /* every item's copies: the items grouped by sample */
    if (counting_order(g.sample, items, g.copies) != 0) goto done;
    for (int64_t k = 0; k < items;) {
        int64_t end = k + 1;
        while (end < items && g.sample[g.copies[end]] == g.sample[g.copies[k]]) end++;
        for (int64_t c = k; c < end; c++) {
            g.copies_from[g.copies[c]] = k;
            g.copies_to[g.copies[c]] = end;
        }
        k = end;
    }
    if (greedy(d, &g, balance) != 0) goto done;
    for (Py_ssize_t b = 0; b < batches; b++) g.dev[b] = deviation(g.sums + b * S, NULL, d->targets, S);
    part_copies(d, &g, shift);
    part_samples(d, &g, aim, shift);
    made = exchange(d, &g, rounds_per_batch * batches, aim, shift);
    for (Py_ssize_t b = 0; b < batches; b++) order_batch(d, &g, b, t->order + (first_batch + b) * K, shift);
    for (int64_t k = 0; k < items; k++) { /* every slot: the item its pack holds there */
        const int64_t i = g.held[k], slot = first_slot + k;
        t->slot_sample[slot] = g.sample[i];
        t->slot_length[slot] = g.length[i];
        t->slot_source[slot] = g.source[i];
        t->slot_measure[slot] = g.measure[i];
    }
done:
    free_region(&g);
    free(order);
    free(shift);
    return made;
}

/* deal_batches(targets: float64 [sources], batch_packs, region_batches, balance, rounds_per_batch, aim,
 * pack_size, pack_offsets: int64 [packs + 1], composition: float64 [packs * sources], slot_sample,
 * slot_length, slot_source: int64 [slots], slot_measure: float64 [slots], order_out: int64 [packs])
 * -> the exchanges made. The composition and the slots are updated in place. */
static PyObject *deal_batches(PyObject *self, PyObject *args) {
    Py_buffer targets, pack_offsets, composition, slot_sample, slot_length, slot_source, slot_measure, order;
    Py_ssize_t batch_packs, region_batches, rounds_per_batch;
    long long pack_size;
    double balance, aim;
    if (!PyArg_ParseTuple(args, "y*nndndLy*w*w*w*w*w*w*", &targets, &batch_packs, &region_batches, &balance,
                          &rounds_per_batch, &aim, &pack_size, &pack_offsets, &composition, &slot_sample,
                          &slot_length, &slot_source, &slot_measure, &order))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t packs = order.len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t sources = targets.len / (Py_ssize_t)sizeof(double);
    const Py_ssize_t slots = slot_sample.len / (Py_ssize_t)sizeof(int64_t);
    if (sources < 1 || batch_packs < 1 || region_batches < 1 || rounds_per_batch < 0 ||
        composition.len != packs * sources * (Py_ssize_t)sizeof(double) ||
        pack_offsets.len != (packs + 1) * (Py_ssize_t)sizeof(int64_t) || slot_length.len != slot_sample.len ||
        slot_source.len != slot_sample.len || slot_measure.len != slots * (Py_ssize_t)sizeof(double) ||
        ((const int64_t *)pack_offsets.buf)[packs] != slots) {
        PyErr_SetString(PyExc_ValueError, "deal_batches: buffers of mismatched sizes");
        goto done;
    }
    int64_t *batch = malloc(sizeof(int64_t) * (size_t)(packs + 1));
    if (batch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Deal d = {sources, batch_packs, (int64_t)pack_size, targets.buf, composition.buf, batch};
    Slots t = {pack_offsets.buf, slot_sample.buf, slot_length.buf, slot_source.buf, slot_measure.buf, order.buf};
    for (Py_ssize_t p = 0; p < packs; p++) d.batch[p] = -1;
    const Py_ssize_t batches = (packs + batch_packs - 1) / batch_packs;
    Py_ssize_t made = 0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t b = 0; b < batches && !failed;) {
        Py_ssize_t count = region_batches;
        if (batches - b - count < (region_batches + 1) / 2) count = batches - b;
        const Py_ssize_t first = b * batch_packs;
        const Py_ssize_t stop = (b + count) * batch_packs < packs ? (b + count) * batch_packs : packs;
        const Py_ssize_t region_made = deal_region(&d, &t, first, stop, b, count, balance, rounds_per_batch, aim);
        failed = region_made < 0;
        made += region_made;
        b += count;
    }
    Py_END_ALLOW_THREADS
    free(batch);
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyLong_FromSsize_t(made);
done:
    PyBuffer_Release(&targets);
    PyBuffer_Release(&pack_offsets);
    PyBuffer_Release(&composition);
    PyBuffer_Release(&slot_sample);
    PyBuffer_Release(&slot_length);
    PyBuffer_Release(&slot_source);
    PyBuffer_Release(&slot_measure);
    PyBuffer_Release(&order);
    return result;
}

static PyMethodDef methods[] = {
    {"deal_batches", deal_batches, METH_VARARGS,
     "deal_batches(targets, batch_packs, region_batches, balance, rounds_per_batch, aim, pack_size, "
     "pack_offsets, composition, slot_sample, slot_length, slot_source, slot_measure, order_out) -> exchanges"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_global_batches",
                                    "The mixture's native kernel: packs dealt into global batches.", -1, methods};

PyMODINIT_FUNC PyInit__global_batches(void) { return PyModule_Create(&module); }
