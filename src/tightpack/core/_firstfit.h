/* What the translation units of the _firstfit extension share: _firstfit.c holds the module and the
 * plain kernels, _first_fit_apart.c the first fit that keeps copies of a sample apart. */
#ifndef TIGHTPACK_FIRSTFIT_H
#define TIGHTPACK_FIRSTFIT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#define UNOPENED INT64_MIN

/* After leaf `node` of the max segment tree `tree` changed: the nodes above it, up to the first that
 * holds what it held (the nodes above that do too). */
static inline void tree_update(int64_t *tree, Py_ssize_t node) {
    for (node >>= 1; node >= 1; node >>= 1) {
        const int64_t left = tree[2 * node], right = tree[2 * node + 1];
        const int64_t best = left >= right ? left : right;
        if (tree[node] == best) break;
        tree[node] = best;
    }
}

/* first_fit_apart(lengths: int64 buffer, keys: int64 buffer, capacity: int, bins_out: int64 buffer)
 * -> bins opened (_first_fit_apart.c). */
PyObject *first_fit_apart(PyObject *self, PyObject *args);

#endif
