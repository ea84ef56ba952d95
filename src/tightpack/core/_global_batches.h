/* What the four parts of the global-batch deal share: the deal and a region's state, and the helpers
 * they use. _global_batches.c sets a region up and deals its packs (step 1); _batch_copies.c parts
 * copies and _batch_exchanges.c makes the exchanges (step 2); _batch_order.c puts the batches and
 * their packs in order (step 3). The rule is in tightpack/core/global_batches.py; how it runs, in _global_batches.c's
 * opening comment. */
#ifndef TIGHTPACK_GLOBAL_BATCHES_H
#define TIGHTPACK_GLOBAL_BATCHES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_ssize_t sources, batch_packs;
    int64_t pack_size;
    const double *targets; /* [sources] */
    double *composition;   /* [packs * sources] */
    int64_t *batch;        /* [packs]: -1 before it is dealt */
} Deal;

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
    double *sums, *dev, *total; /* sums: [batches * sources]; dev: the largest |share - target|; total: measure */
    Py_ssize_t *furthest;       /* the source furthest from its share (an exchange's first check) */
    Py_ssize_t *count, *capacity, *members; /* members: [batches * batch_packs] packs */
} Region;

static inline int64_t batch_of(const Deal *d, const Region *g, int64_t pack) { return d->batch[g->first + pack]; }

static inline const double *row(const Deal *d, const Region *g, int64_t pack) {
    return d->composition + (g->first + pack) * d->sources;
}

/* 1 when a sample of pack `p` (not `crowded`) has a copy in a pack other than `p` and `skip` of batch
 * `b`. */
/* 1 when item `i`'s sample has more copies in the region than it has batches: some batch must hold
 * two, and the deal does not keep its copies apart (they would only stop exchanges that help). */
static inline int crowded(const Region *g, int64_t i) { return g->copies_to[i] - g->copies_from[i] > g->batches; }

static inline int pack_meets_copy(const Deal *d, const Region *g, int64_t p, int64_t b, int64_t skip) {
    for (int64_t e = g->held_from[p]; e < g->held_from[p + 1]; e++) {
        const int64_t i = g->held[e];
        if (crowded(g, i)) continue;
        for (int64_t k = g->copies_from[i]; k < g->copies_to[i]; k++) {
            const int64_t q = g->pack[g->copies[k]];
            if (q != p && q != skip && batch_of(d, g, q) == b) return 1;
        }
    }
    return 0;
}

/* The largest |share - target| of `sums` + `shift` (shift may be NULL); 0 when they hold nothing. */
static inline double deviation(const double *sums, const double *shift, const double *targets, Py_ssize_t sources) {
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

/* Batch `b`'s deviation, measure and furthest source, from its sums (after they change). */
static inline void refresh(const Deal *d, Region *g, Py_ssize_t b) {
    const Py_ssize_t S = d->sources;
    const double *sums = g->sums + b * S;
    double total = 0.0;
    for (Py_ssize_t s = 0; s < S; s++) total += sums[s];
    Py_ssize_t worst = 0;
    for (Py_ssize_t s = 1; s < S; s++)
        if (fabs(sums[s] - d->targets[s] * total) > fabs(sums[worst] - d->targets[worst] * total)) worst = s;
    g->dev[b] = deviation(sums, NULL, d->targets, S);
    g->total[b] = total;
    g->furthest[b] = worst;
}

/* 1 when item `i`, moved into pack `p` of batch `b`, would meet a copy of its sample: in `p`, or (the
 * sample not `crowded`) in another pack of `b`. A crowded sample's copies are many: the pack's few
 * items are looked at instead. */
static inline int meets_copy(const Deal *d, const Region *g, int64_t i, int64_t b, int64_t p) {
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

/* The next sample nearest item `i`'s length `li` (the nearer of the next longer, `*up`, and the next
 * shorter, `*down`); -1 for a longer one past `longest` (it would overfill the pack of `i`), after
 * which no longer one is looked at. */
static inline int64_t next_nearest(const Region *g, int64_t *up, int64_t *down, int64_t li, int64_t longest) {
    if (*up < g->items && (*down < 0 || g->length[*up] - li <= li - g->length[*down])) {
        const int64_t j = (*up)++;
        if (g->length[j] <= longest) return j;
        *up = g->items;
        return -1;
    }
    return (*down)--;
}

/* 1 when item `j`'s pack has room for a sample of `li` tokens in place of `j`. */
static inline int room_for(const Deal *d, const Region *g, int64_t j, int64_t li) {
    return li <= g->length[j] + d->pack_size - g->used[g->pack[j]];
}

/* Step 2: copies parted (_batch_copies.c; -1 when out of memory), then the exchanges
 * (_batch_exchanges.c, which also makes the moves both use). */
int part_copies(Deal *d, Region *g, double *shift);
int part_samples(Deal *d, Region *g, double aim, double *shift);
Py_ssize_t exchange_rounds(Deal *d, Region *g, Py_ssize_t rounds, double aim, double *shift);
void exchange_samples(Deal *d, Region *g, int64_t i, int64_t j); /* items i and j trade packs */
void exchange_packs(Deal *d, Region *g, Py_ssize_t w, int64_t p, int64_t q); /* packs p (of w) and q trade batches */

/* Step 3 (_batch_order.c): the region's packs into `out` [batches * batch_packs] in the order a run
 * reads them: its batches (a partial last one last), then each batch's packs, each in the order that
 * keeps the running deviation smallest. The rest are work arrays: `batch_order` [batches], `rows`
 * [batch_packs * sources], `ranks` [batch_packs], `scratch` [2 * max(batch_packs, batches) * sources],
 * `running` and `shares` [sources]. */
void order_region(const Deal *d, Region *g, int64_t *out, Py_ssize_t *batch_order, double *rows,
                  Py_ssize_t *ranks, double *scratch, double *running, double *shares);

#endif
