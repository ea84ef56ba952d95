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
 *      squared share deviation plus `balance` times the squared distance from a mean batch (the
 *      largest FULL_SCAN_SHARE of them weighed against every batch, the others against FEW_BATCHES,
 *      `cheapest`); a batch holding a copy of one of its samples is passed over unless every batch
 *      with room does; then (_batch_copies.c) a pack put with a copy is exchanged with a pack of
 *      another batch where neither holds a copy (`part_copies`), and a sample still beside its copy
 *      with a sample of another batch (`part_samples`);
 *   2. exchanges (_batch_exchanges.c: `exchange_rounds`, `improve`), until every full batch is within
 *      `aim` (a fraction) or none can be made better, at most `rounds_per_batch` rounds a batch. Each
 *      round takes the worst full batch (when no exchange makes it better, the next worst above the
 *      aim, and so on) and makes the first of these that makes it better: the best MULTIPLE sample
 *      exchanges (a sample of it for one of the samples nearest its length in another batch, both
 *      packs within `pack_size`: NEIGHBOURS of each, fewer for a batch of many samples), best first,
 *      each made while it still makes the batch better once those before it are made; when there
 *      is none or they stall (less than 1/PROGRESS of the way to the aim), the best pack
 *      exchange with one of about PACK_CANDIDATES packs of the region; the best sample exchange among
 *      the WIDE nearest (these two searches at most SCANS_PER_BATCH times each per batch). The other
 *      batch must end closer than the worst was when it is full, and no further off than it was when
 *      it is the partial last one; no exchange brings a copy of a sample into a batch that holds one;
 *   3. (_batch_order.c) the batches of the region put in the order that keeps the running deviation
 *      smallest, and the packs of each batch likewise (`order_region`).
 *
 * At the end the slots of every pack (the caller's arrays, in plan order) are rewritten with the
 * samples the pack holds, and `order_out` lists the packs in the order a run reads them.
 */
#include "_global_batches.h"

/* The largest packs of a region (this share of them, by their largest measure over a mean batch's)
 * are weighed against every batch of it; the others against FEW_BATCHES consecutive batches, from a
 * start that moves on with each pack. Measured on the benchmark's mixture: the deal takes 20-35% less
 * time than weighing every pack against every batch, and reaches the same batches. */
#define FULL_SCAN_SHARE 0.3
#define FEW_BATCHES 8
#define LAZY_LOOKS 4 /* batches `cheapest` checks for a copy one by one before marking every one */

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

static void place_in(const Deal *d, Region *g, int64_t p, Py_ssize_t b) {
    const Py_ssize_t S = d->sources;
    g->members[b * d->batch_packs + g->count[b]++] = p;
    d->batch[g->first + p] = g->first_batch + b;
    for (Py_ssize_t s = 0; s < S; s++) g->sums[b * S + s] += row(d, g, p)[s];
}

/* Marks `holds_copy[b] = mark` at every batch `b` of the region that holds a copy of one of pack `p`'s
 * samples (not `crowded`) in another pack (one pass over their copies, not one per batch weighed). */
static void mark_copies(const Deal *d, const Region *g, int64_t p, int64_t *holds_copy, int64_t mark) {
    for (int64_t e = g->held_from[p]; e < g->held_from[p + 1]; e++) {
        const int64_t i = g->held[e];
        if (crowded(g, i)) continue;
        for (int64_t k = g->copies_from[i]; k < g->copies_to[i]; k++) {
            const int64_t q = g->pack[g->copies[k]];
            if (q != p && batch_of(d, g, q) >= 0) holds_copy[batch_of(d, g, q) - g->first_batch] = mark;
        }
    }
}

/* The batch of the region `g` (of `B`, numbered from 0) where pack `p` costs least among `span`
 * batches from `start` (wrapping round), passing over full batches (`closed`: INFINITY) and those
 * holding a copy of one of its samples; when every one weighed is full or holds a copy, -1, or for a
 * span of every batch the cheapest with room. A batch's cost, less what is the same for every batch:
 * sum_s step_s off_sb + scaled_s rel_sb. The cheapest few are looked at one by one (most hold no
 * copy); past LAZY_LOOKS, the batches holding a copy are marked at once (`mark_copies`, `*marked`). */
static Py_ssize_t cheapest(const Deal *d, const Region *g, int64_t p, double *cost, const double *closed,
                           const double *step, const double *scaled, const double *off, const double *rel,
                           int64_t *holds_copy, int64_t mark, int *marked, Py_ssize_t start, Py_ssize_t span) {
    const Py_ssize_t S = d->sources, B = g->batches;
    const Py_ssize_t ranges[2][2] = {{start, start + span < B ? start + span : B},
                                     {0, start + span > B ? start + span - B : 0}};
    for (int r = 0; r < 2; r++) {
        const Py_ssize_t from = ranges[r][0], to = ranges[r][1];
        memcpy(cost + from, closed + from, sizeof(double) * (size_t)(to - from));
        for (Py_ssize_t s = 0; s < S; s++) {
            const double *o = off + s * B, *q = rel + s * B;
            for (Py_ssize_t b = from; b < to; b++) cost[b] += step[s] * o[b] + scaled[s] * q[b];
        }
    }
    Py_ssize_t fallback = -1; /* the cheapest of all, with or without a copy */
    for (int looks = 0; looks < LAZY_LOOKS; looks++) {
        Py_ssize_t pick = -1;
        for (int r = 0; r < 2; r++)
            for (Py_ssize_t b = ranges[r][0]; b < ranges[r][1]; b++)
                if (cost[b] < INFINITY && (pick < 0 || cost[b] < cost[pick])) pick = b;
        if (pick < 0) return span == B ? fallback : -1; /* each holds a copy: the cheapest, of all */
        if (fallback < 0) fallback = pick;
        if (!pack_meets_copy(d, g, p, g->first_batch + pick, -1)) return pick;
        cost[pick] = INFINITY;
    }
    if (!*marked) {
        mark_copies(d, g, p, holds_copy, mark);
        *marked = 1;
    }
    Py_ssize_t pick = -1;
    for (int r = 0; r < 2; r++)
        for (Py_ssize_t b = ranges[r][0]; b < ranges[r][1]; b++)
            if (cost[b] < INFINITY && holds_copy[b] != mark && (pick < 0 || cost[b] < cost[pick])) pick = b;
    if (pick >= 0) return pick;
    return span == B ? fallback : -1;
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
    double *step = malloc(sizeof(double) * (size_t)S), *scaled = malloc(sizeof(double) * (size_t)S);
    Keyed *keyed = malloc(sizeof(Keyed) * (size_t)n);
    int64_t *holds_copy = calloc((size_t)B, sizeof(int64_t)); /* k + 1: holds a copy of the k-th pack's */
    int status = -1;
    if (!mean || !off || !rel || !cost || !closed || !step || !scaled || !keyed || !holds_copy) goto done;
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
    const int64_t every = (int64_t)ceil(FULL_SCAN_SHARE * (double)n); /* packs weighed against every batch */
    for (int64_t k = 0; k < n; k++) {
        const int64_t p = keyed[k].index;
        const double *c = row(d, g, p);
        double weight = 0.0;
        for (Py_ssize_t s = 0; s < S; s++) weight += c[s];
        for (Py_ssize_t s = 0; s < S; s++) {
            step[s] = (c[s] - d->targets[s] * weight) / mean[s];
            scaled[s] = balance * c[s] / mean[s];
        }
        /* the batches weighed: from a start that moves on by the golden ratio of the batches each
         * pack (so ties, and the few batches a small pack is weighed against, spread over the
         * region), every batch for the largest packs, FEW_BATCHES for the others */
        const Py_ssize_t start = (Py_ssize_t)fmod((double)k * 0.6180339887498949 * (double)B, (double)B);
        Py_ssize_t chosen = -1;
        int marked = 0;
        if (k >= every && FEW_BATCHES < B)
            chosen = cheapest(d, g, p, cost, closed, step, scaled, off, rel, holds_copy, k + 1, &marked, start,
                              FEW_BATCHES);
        if (chosen < 0) /* a large pack, or every one of the few full or holding a copy */
            chosen = cheapest(d, g, p, cost, closed, step, scaled, off, rel, holds_copy, k + 1, &marked, start, B);
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
    free(step);
    free(scaled);
    free(keyed);
    free(holds_copy);
    return status;
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
    free(g->total);
    free(g->furthest);
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
    g.total = calloc(nb, sizeof(double));
    g.furthest = calloc(nb, sizeof(Py_ssize_t));
    g.count = calloc(nb, sizeof(Py_ssize_t));
    g.capacity = malloc(sizeof(Py_ssize_t) * nb);
    g.members = malloc(sizeof(Py_ssize_t) * nb * (size_t)K);
    int64_t *order = malloc(sizeof(int64_t) * ni);
    double *shift = malloc(sizeof(double) * (size_t)S);
    /* order_region's: rows and a permutation of a batch's packs, the batches' order, and scratch for
     * the packs of a batch or the batches of the region, whichever is more */
    const size_t most = (size_t)(K > batches ? K : batches);
    double *rows = malloc(sizeof(double) * (size_t)(K * S));
    double *scratch = malloc(sizeof(double) * 2 * most * (size_t)S);
    Py_ssize_t *ranks = malloc(sizeof(Py_ssize_t) * (size_t)K);
    Py_ssize_t *batch_order = malloc(sizeof(Py_ssize_t) * nb);
    double *shares = malloc(sizeof(double) * (size_t)S);
    Py_ssize_t made = -1;
    if (!g.length || !g.sample || !g.source || !g.copies_from || !g.copies_to || !g.measure || !g.copies ||
        !g.pack || !g.place || !g.held_from || !g.held || !g.used || !g.sums || !g.dev || !g.total ||
        !g.furthest || !g.count || !g.capacity || !g.members || !order || !shift || !rows || !scratch ||
        !ranks || !batch_order || !shares)
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
    for (Py_ssize_t b = 0; b < batches; b++) refresh(d, &g, b);
    if (part_copies(d, &g, shift) != 0 || part_samples(d, &g, aim, shift) != 0) goto done;
    made = exchange_rounds(d, &g, rounds_per_batch * batches, aim, shift);
    order_region(d, &g, t->order + first_batch * K, batch_order, rows, ranks, scratch, shift, shares);
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
    free(rows);
    free(scratch);
    free(ranks);
    free(batch_order);
    free(shares);
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
