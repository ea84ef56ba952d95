/* First fit in which items of the same key never share a bin (copies of one sample, called by
 * tightpack/core/planner.py's `first_fit_apart`): an item of key -1 goes to the lowest-index open bin
 * with room for it, as plain first fit (_firstfit.c) places it; an item of a key goes to the
 * lowest-index bin with room after the bin of the key's previous item, else it opens a new bin.
 *
 * For copies of one length that is exactly first fit that passes over the bins holding the key: the
 * bins before the previous copy's had no room for it (rooms only shrink) or held the key, and the
 * copies' bins rise one after another. The open bins' rooms sit in a max segment tree as in
 * _firstfit.c; a keyed item costs one more walk up the tree. */
#include "_firstfit.h"

/* The leftmost leaf at or after `from` whose room is at least `length`, or -1. */
static Py_ssize_t leftmost_with_room(const int64_t *tree, Py_ssize_t leaves, Py_ssize_t from, int64_t length) {
    Py_ssize_t node = from + leaves;
    if (tree[node] >= length) return from;
    if (from == 0) { /* every bin: down from the root */
        if (tree[1] < length) return -1;
        node = 1;
    } else { /* up until a right sibling of the path holds room, then down to its leftmost such leaf */
        for (;;) {
            if (node == 1) return -1;
            if ((node & 1) == 0 && tree[node + 1] >= length) {
                node += 1;
                break;
            }
            node >>= 1;
        }
    }
    while (node < leaves) {
        node <<= 1;
        if (tree[node] < length) node |= 1;
    }
    return node - leaves;
}

/* Returns the bins opened. `keys` [n]: -1 or a key in 0..n-1; `last` [n]: the bin of each key's
 * latest item, -1 before it has one. */
static Py_ssize_t apart_kernel(const int64_t *lengths, const int64_t *keys, Py_ssize_t n, int64_t capacity,
                               int64_t *bins, int64_t *tree, Py_ssize_t leaves, int64_t *last) {
    Py_ssize_t opened = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t length = lengths[i], key = keys[i];
        const Py_ssize_t from = key < 0 ? 0 : last[key] + 1;
        Py_ssize_t bin = from < opened ? leftmost_with_room(tree, leaves, from, length) : -1;
        if (bin < 0) {
            bin = opened++;
            tree[bin + leaves] = capacity;
        }
        tree[bin + leaves] -= length;
        tree_update(tree, bin + leaves);
        bins[i] = bin;
        if (key >= 0) last[key] = bin;
    }
    return opened;
}

PyObject *first_fit_apart(PyObject *self, PyObject *args) {
    Py_buffer lengths, keys, bins;
    long long capacity;
    if (!PyArg_ParseTuple(args, "y*y*Lw*", &lengths, &keys, &capacity, &bins)) return NULL;
    PyObject *result = NULL;
    int64_t *tree = NULL, *last = NULL;
    if (lengths.len % sizeof(int64_t) != 0 || keys.len != lengths.len || bins.len != lengths.len) {
        PyErr_SetString(PyExc_ValueError, "first_fit_apart: expects int64 buffers of equal size");
        goto done;
    }
    const Py_ssize_t n = lengths.len / (Py_ssize_t)sizeof(int64_t);
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t key = ((const int64_t *)keys.buf)[i];
        if (key < -1 || key >= n) {
            PyErr_SetString(PyExc_ValueError, "first_fit_apart: keys must be -1 or in 0..n-1");
            goto done;
        }
    }
    Py_ssize_t leaves = 1; /* at most one bin an item */
    while (leaves < n) leaves <<= 1;
    tree = malloc(sizeof(int64_t) * 2 * (size_t)leaves);
    last = malloc(sizeof(int64_t) * ((size_t)n + 1));
    if (tree == NULL || last == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < 2 * leaves; k++) tree[k] = UNOPENED;
    for (Py_ssize_t k = 0; k < n; k++) last[k] = -1;
    Py_ssize_t opened;
    Py_BEGIN_ALLOW_THREADS
    opened = apart_kernel((const int64_t *)lengths.buf, (const int64_t *)keys.buf, n, (int64_t)capacity,
                          (int64_t *)bins.buf, tree, leaves, last);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(opened);
done:
    free(tree);
    free(last);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&bins);
    return result;
}
