/* Step 2 of the global-batch deal (_global_batches.c's opening comment), before the exchanges: the
 * copies of a sample the greedy had to put in one batch parted, by pack exchanges (`part_copies`) and
 * then sample exchanges (`part_samples`). */
#include "_global_batches.h"

#define PART_NEIGHBOURS 4096 /* samples nearest in length looked at to part a sample from its copy */

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
