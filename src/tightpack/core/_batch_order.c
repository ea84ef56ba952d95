/* Step 3 of the global-batch deal (_global_batches.c's opening comment): the batches of a region, and
 * the packs of each batch, in the order a run reads them. */
#include "_global_batches.h"

/* `order` [n]: the rows 0 .. n-1 (`rows` [n * S]: each one's measure from each source) in the order
 * that keeps smallest, each step, the largest running deviation of any source, `sum(measure_s) -
 * target_s * sum(measure)` over the rows so far; the earliest on a tie. `scratch`: [2 * n * S]. */
static void running_order(const double *rows, Py_ssize_t n, Py_ssize_t S, const double *targets,
                          Py_ssize_t *order, double *running, double *scratch) {
    double *measures = scratch, *parts = scratch + n * S; /* each row's measures and target part */
    for (Py_ssize_t m = 0; m < n; m++) {
        double weight = 0.0;
        for (Py_ssize_t s = 0; s < S; s++) weight += rows[m * S + s];
        for (Py_ssize_t s = 0; s < S; s++) {
            measures[m * S + s] = rows[m * S + s];
            parts[m * S + s] = targets[s] * weight;
        }
        order[m] = m;
    }
    for (Py_ssize_t s = 0; s < S; s++) running[s] = 0.0;
    for (Py_ssize_t step = 0; step < n; step++) { /* order[step:] (and their rows) are the ones left */
        Py_ssize_t best = step;
        double best_value = INFINITY;
        for (Py_ssize_t m = step; m < n; m++) {
            double value = 0.0;
            for (Py_ssize_t s = 0; s < S && value < best_value; s++) {
                const double x = fabs(running[s] + measures[m * S + s] - parts[m * S + s]);
                if (x > value) value = x;
            }
            if (value < best_value) {
                best_value = value;
                best = m;
            }
        }
        const Py_ssize_t chosen = order[best];
        for (Py_ssize_t s = 0; s < S; s++) running[s] += measures[best * S + s] - parts[best * S + s];
        /* the rest keep their order */
        memmove(order + step + 1, order + step, sizeof(Py_ssize_t) * (size_t)(best - step));
        memmove(measures + (step + 1) * S, measures + step * S, sizeof(double) * (size_t)((best - step) * S));
        memmove(parts + (step + 1) * S, parts + step * S, sizeof(double) * (size_t)((best - step) * S));
        order[step] = chosen;
    }
}

/* The packs of batch `b` in the order a run reads them, into `out`: `running_order` over them in
 * planned order (the earliest planned wins a tie); so a stretch of packs that straddles two batches,
 * the end of one and the start of the next, stays near the targets too. `rows`: [K * S], `order`: [K]. */
static void order_batch(const Deal *d, const Region *g, Py_ssize_t b, int64_t *out, double *running,
                        double *rows, Py_ssize_t *order, double *scratch) {
    const Py_ssize_t S = d->sources, K = d->batch_packs, n = g->count[b];
    Py_ssize_t *members = g->members + b * K;
    for (Py_ssize_t m = 1; m < n; m++) /* planned order first */
        for (Py_ssize_t k = m; k > 0 && members[k - 1] > members[k]; k--) {
            const Py_ssize_t swap = members[k];
            members[k] = members[k - 1];
            members[k - 1] = swap;
        }
    for (Py_ssize_t m = 0; m < n; m++) memcpy(rows + m * S, row(d, g, members[m]), sizeof(double) * (size_t)S);
    running_order(rows, n, S, d->targets, order, running, scratch);
    for (Py_ssize_t step = 0; step < n; step++) out[step] = g->first + members[order[step]];
}

void order_region(const Deal *d, Region *g, int64_t *out, Py_ssize_t *batch_order, double *rows,
                  Py_ssize_t *ranks, double *scratch, double *running, double *shares) {
    const Py_ssize_t S = d->sources, K = d->batch_packs, B = g->batches;
    /* the full batches by `running_order` (a batch that holds much of a source comes among ones that
     * hold little of it, not beside another like it); a partial last batch stays last */
    const Py_ssize_t full = g->capacity[B - 1] == K ? B : B - 1;
    /* against the full batches' own shares, not the targets: where no batch can hold the targets,
     * the run keeps near the mixture the region does hold, each source spread over it */
    double total = 0.0;
    for (Py_ssize_t s = 0; s < S; s++) running[s] = 0.0;
    for (Py_ssize_t b = 0; b < full; b++)
        for (Py_ssize_t s = 0; s < S; s++) running[s] += g->sums[b * S + s];
    for (Py_ssize_t s = 0; s < S; s++) total += running[s];
    for (Py_ssize_t s = 0; s < S; s++) shares[s] = total > 0.0 ? running[s] / total : d->targets[s];
    running_order(g->sums, full, S, shares, batch_order, running, scratch);
    for (Py_ssize_t b = full; b < B; b++) batch_order[b] = b;
    for (Py_ssize_t q = 0; q < B; q++) order_batch(d, g, batch_order[q], out + q * K, running, rows, ranks, scratch);
}
