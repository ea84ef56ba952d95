/*
 * The planner's native kernels. tightpack/core/planner.py owns their semantics and is their only caller:
 *
 *   - `first_fit`, called by `_first_fit_in_order` (algorithms ffd, first_fit, first_fit_shuffle):
 *     leftmost-bin first fit over a flat max segment tree. It takes the item lengths, the capacity,
 *     a buffer receiving each item's bin index and the most bins the caller allows (the tree is sized
 *     from it), and returns the number of bins opened. It is the one loop that cannot be vectorized:
 *     every item depends on the bins the previous items left behind.
 *   - `first_fit_apart` (_first_fit_apart.c), called by `first_fit_apart`: first fit that puts items
 *     of one key (copies of a sample) in different bins.
 *   - `group_by_bin`, called by `_stable_order` and `_plan_from_bins`: a stable counting sort of
 *     small non-negative keys (lengths, or bin indices) into CSR arrays.
 *   - `expand_groups`, called by `_expand_groups` (algorithm bfd): bfd's groups of identical bins
 *     written out as CSR arrays over sample indices, in one pass over the samples.
 *
 * First-fit semantics (identical to a linear scan over the open bins; Megatron-Bridge packing
 * contract, docs/contract.md §2.5):
 *   - an item goes to the lowest-index open bin whose remaining capacity is >= its length;
 *   - otherwise it opens a new bin whose remaining capacity is `capacity - length` (negative for an
 *     oversize item, so that bin never accepts another positive-length item);
 *   - a zero-length item joins the first open bin with remaining capacity >= 0.
 *
 * Arguments come through the buffer protocol (no numpy headers needed): int64 buffers, read-only for
 * inputs and writable for outputs, which the caller allocates at their final sizes.
 */
#include "_firstfit.h"

#if defined(__GNUC__) || defined(__clang__)
#define UNLIKELY(condition) __builtin_expect(!!(condition), 0)
#define PREFETCH_FOR_WRITE(address) __builtin_prefetch((address), 1, 1)
#else
#define UNLIKELY(condition) (condition)
#define PREFETCH_FOR_WRITE(address) ((void)0)
#endif

/* expand_groups writes each sample to a scattered position; it prefetches the position of the sample
 * this many steps ahead (measured: 10-15% faster at 10M samples, 8 to 32 alike). */
#define PREFETCH_AHEAD 16

static Py_ssize_t first_fit_kernel(const int64_t *lengths, Py_ssize_t n, int64_t capacity,
                                   int64_t *bins, int64_t *tree, Py_ssize_t leaves, Py_ssize_t max_bins) {
    Py_ssize_t opened = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t length = lengths[i];
        Py_ssize_t node = 1;
        Py_ssize_t bin;
        if (tree[1] >= length) {
            while (node < leaves) {
                node <<= 1;
                if (tree[node] < length) node |= 1;
            }
            bin = node - leaves;
            tree[node] -= length;
        } else {
            if (opened == max_bins) return -1;
            bin = opened++;
            node = bin + leaves;
            tree[node] = capacity - length;
        }
        bins[i] = bin;
        tree_update(tree, node);
    }
    return opened;
}

static PyObject *first_fit(PyObject *self, PyObject *args) {
    Py_buffer lengths, bins;
    long long capacity;
    Py_ssize_t max_bins;
    if (!PyArg_ParseTuple(args, "y*Lw*n", &lengths, &capacity, &bins, &max_bins)) return NULL;
    PyObject *result = NULL;
    if (lengths.len % sizeof(int64_t) != 0 || bins.len != lengths.len) {
        PyErr_SetString(PyExc_ValueError, "first_fit: expects int64 buffers of equal size");
        goto done;
    }
    const Py_ssize_t n = lengths.len / (Py_ssize_t)sizeof(int64_t);
    if (max_bins < 1) max_bins = 1;
    Py_ssize_t leaves = 1;
    while (leaves < max_bins) leaves <<= 1;
    int64_t *tree = malloc(sizeof(int64_t) * 2 * (size_t)leaves);
    if (tree == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < 2 * leaves; k++) tree[k] = UNOPENED;
    Py_ssize_t opened;
    Py_BEGIN_ALLOW_THREADS
    opened = first_fit_kernel((const int64_t *)lengths.buf, n, (int64_t)capacity, (int64_t *)bins.buf, tree,
                              leaves, max_bins);
    Py_END_ALLOW_THREADS
    free(tree);
    if (opened < 0) {
        PyErr_SetString(PyExc_RuntimeError, "first_fit: the bin bound was too small (internal error)");
        goto done;
    }
    result = PyLong_FromSsize_t(opened);
done:
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&bins);
    return result;
}

/* Counting sort of items by bin, stable: order_out lists the items of bin 0, then bin 1, ...;
 * offsets_out (n_bins + 1 entries) delimits them. */
static PyObject *group_by_bin(PyObject *self, PyObject *args) {
    Py_buffer bins, order, offsets;
    if (!PyArg_ParseTuple(args, "y*w*w*", &bins, &order, &offsets)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = bins.len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t n_bins = offsets.len / (Py_ssize_t)sizeof(int64_t) - 1;
    if (bins.len % sizeof(int64_t) != 0 || order.len != bins.len || n_bins < 0) {
        PyErr_SetString(PyExc_ValueError, "group_by_bin: expects int64 buffers (bins, order of equal size, offsets)");
        goto done;
    }
    const int64_t *b = bins.buf;
    int64_t *o = order.buf, *off = offsets.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k <= n_bins; k++) off[k] = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        if (b[i] < 0 || b[i] >= n_bins) bad = 1;
        else off[b[i] + 1]++;
    }
    if (!bad) {
        for (Py_ssize_t k = 0; k < n_bins; k++) off[k + 1] += off[k];
        for (Py_ssize_t i = 0; i < n; i++) o[off[b[i]]++] = i;
        for (Py_ssize_t k = n_bins; k > 0; k--) off[k] = off[k - 1];
        off[0] = 0;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "group_by_bin: a bin index is out of range");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&bins);
    PyBuffer_Release(&order);
    PyBuffer_Release(&offsets);
    return result;
}

/* bfd's groups -> CSR plan, placing each sample straight at its final position (see `_expand_groups` in
 * planner.py for the layout, which this reproduces).
 *
 * Nodes form a tree in creation order (parent[k] < k; node 0, the empty bin, is the root). Node k
 * stands for node_count[k] samples of key node_key[k] (a distinct length), added to the composition
 * of parent[k]. node_bins[k] > 0 marks a group: that many bins hold the composition of node k.
 * Groups are laid out in node order, each bin by bin, each bin root to leaf. Sample i has key
 * table[values[i]]; the samples of one key, in input order, are handed out to the entries (a group's
 * node) of that key in group order, bins * count each, count per bin.
 *
 * Pass 1 walks the groups: output positions of every entry, pack offsets, and per key a linked list
 * of its entries. Pass 2 walks the samples once, each key keeping a cursor into its entries. */
typedef struct {
    int64_t next;   /* the next entry of the same key, -1 for none */
    int64_t base;   /* output position of its first sample (in the group's first bin) */
    int64_t count;  /* samples per bin (> 0) */
    int64_t bins;   /* bins of its group */
    int64_t stride; /* samples per bin of its group: from one bin's run to the next */
} Entry;

typedef struct {
    int64_t pos;       /* output position of the key's next sample */
    int64_t left;      /* samples still to place in the current run; 0: take the next entry */
    int64_t bins_left; /* bins of the current entry after the current one */
    int64_t count, gap; /* of the current entry: samples per bin, stride - count */
    int64_t next;      /* the entry after the current one */
} KeyCursor;

/* values[i] as int64, from int32 or int64 storage. */
static inline int64_t value_at(const void *values, int wide, Py_ssize_t i) {
    return wide ? ((const int64_t *)values)[i] : (int64_t)((const int32_t *)values)[i];
}

static int expand_groups_kernel(const int64_t *node_bins, const int64_t *parent, const int64_t *node_key,
                                const int64_t *node_count, Py_ssize_t n_nodes, const int64_t *table,
                                Py_ssize_t table_len, const void *values, int wide, Py_ssize_t n_values,
                                Py_ssize_t n, Py_ssize_t n_keys, int64_t *order, int64_t *offsets,
                                Py_ssize_t n_packs) {
    if (node_bins[0] != 0) return -1; /* the empty bin is never a group */
    Py_ssize_t n_entries = 0;         /* entries that claim samples: at most n, each claims one or more */
    for (Py_ssize_t k = 1; k < n_nodes; k++) {
        if (parent[k] < 0 || parent[k] >= k || node_key[k] < 0 || node_key[k] >= n_keys || node_count[k] < 0 ||
            node_bins[k] < 0)
            return -1;
    }
    int64_t *depth = malloc(sizeof(int64_t) * (size_t)n_nodes); /* nodes of count > 0 from the root */
    int64_t *chain = malloc(sizeof(int64_t) * (size_t)n_nodes);
    int64_t *tail = malloc(sizeof(int64_t) * (size_t)(n_keys + 1));
    KeyCursor *cursor = malloc(sizeof(KeyCursor) * (size_t)(n_keys + 1));
    Entry *entries = NULL;
    int status = -1;
    if (depth == NULL || chain == NULL || tail == NULL || cursor == NULL) {
        status = -2;
        goto done;
    }
    depth[0] = 0;
    for (Py_ssize_t k = 1; k < n_nodes; k++) {
        depth[k] = depth[parent[k]] + (node_count[k] > 0);
        if (node_bins[k] > 0) {
            if (depth[k] > n - n_entries) goto done; /* more entries than samples */
            n_entries += depth[k];
        }
    }
    entries = malloc(sizeof(Entry) * (size_t)(n_entries + 1));
    if (entries == NULL) {
        status = -2;
        goto done;
    }
    for (Py_ssize_t key = 0; key < n_keys; key++) {
        tail[key] = -1;
        cursor[key] = (KeyCursor){0, 0, 0, 0, 0, -1};
    }

    /* Pass 1: the layout. */
    Py_ssize_t entry = 0, pack = 0;
    int64_t written = 0;
    offsets[0] = 0;
    for (Py_ssize_t group = 1; group < n_nodes; group++) {
        const int64_t bins = node_bins[group];
        if (bins == 0) continue;
        Py_ssize_t length = 0;
        int64_t per_bin = 0;
        for (int64_t node = group; node != 0; node = parent[node]) {
            if (node_count[node] > 0) chain[length++] = node;
        }
        for (Py_ssize_t e = length - 1; e >= 0; e--) {
            const int64_t count = node_count[chain[e]];
            if (count > (n - written) / bins - per_bin) goto done; /* (per_bin + count) * bins > n - written */
            per_bin += count;
        }
        if (bins > n_packs - pack) goto done;
        int64_t within = 0;
        for (Py_ssize_t e = length - 1; e >= 0; e--) {
            const int64_t node = chain[e], key = node_key[node];
            entries[entry] = (Entry){-1, written + within, node_count[node], bins, per_bin};
            if (tail[key] < 0) cursor[key].next = entry;
            else entries[tail[key]].next = entry;
            tail[key] = entry++;
            within += node_count[node];
        }
        for (int64_t b = 0; b < bins; b++) {
            written += per_bin;
            offsets[++pack] = written;
        }
    }
    if (written != n || pack != n_packs) goto done;

    /* Pass 2: every sample to its position, in input order; a negative value is a sample not packed. */
    for (Py_ssize_t i = 0; i < n_values; i++) {
        const int64_t value = value_at(values, wide, i);
        if (value < 0) continue;
        if (value >= table_len) goto done;
        const int64_t key = table[value];
        if (key < 0 || key >= n_keys) goto done;
        if (i + PREFETCH_AHEAD < n_values) { /* where that sample's key writes now: usually where it will */
            const int64_t ahead = value_at(values, wide, i + PREFETCH_AHEAD);
            if (ahead >= 0 && ahead < table_len && table[ahead] >= 0 && table[ahead] < n_keys)
                PREFETCH_FOR_WRITE(order + cursor[table[ahead]].pos);
        }
        KeyCursor *c = &cursor[key];
        if (UNLIKELY(c->left == 0)) { /* the current entry is used up (or none yet): the next one */
            if (c->next < 0) goto done; /* more samples of this key than the groups hold */
            const Entry *next = &entries[c->next];
            c->pos = next->base;
            c->left = next->count;
            c->bins_left = next->bins - 1;
            c->count = next->count;
            c->gap = next->stride - next->count;
            c->next = next->next;
        }
        order[c->pos] = i;
        /* Advance without branches (run ends are unpredictable): within the run, else to the same
         * entry in the next bin, else used up. */
        const int64_t run_ends = c->left == 1, next_bin = run_ends & (c->bins_left > 0);
        c->pos += 1 + (next_bin ? c->gap : 0);
        c->left = run_ends ? (next_bin ? c->count : 0) : c->left - 1;
        c->bins_left -= next_bin;
    }
    for (Py_ssize_t key = 0; key < n_keys; key++) {
        if (cursor[key].left || cursor[key].bins_left || cursor[key].next >= 0) goto done; /* fewer */
    }
    status = 0;
done:
    free(depth);
    free(chain);
    free(tail);
    free(cursor);
    free(entries);
    return status;
}

static PyObject *expand_groups(PyObject *self, PyObject *args) {
    Py_buffer node_bins, parent, node_key, node_count, table, values, order, offsets;
    Py_ssize_t n_keys, value_size;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*nnw*w*", &node_bins, &parent, &node_key, &node_count, &table,
                          &values, &value_size, &n_keys, &order, &offsets))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t size = (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t n_nodes = node_bins.len / size, n = order.len / size, n_packs = offsets.len / size - 1;
    const int wide = value_size == 8;
    if (node_bins.len % size || parent.len != node_bins.len || node_key.len != node_bins.len ||
        node_count.len != node_bins.len || n_nodes < 1 || table.len % size || (value_size != 4 && !wide) ||
        values.len % value_size || order.len % size || n > values.len / value_size || offsets.len % size ||
        n_packs < 0 || n_keys < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "expand_groups: expects int64 buffers (node_bins, parent, node_key, node_count of equal "
                        "size >= 1; table; order, at most one entry per value; offsets), values of int32 or "
                        "int64 (value_size 4 or 8) and n_keys >= 0");
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = expand_groups_kernel(node_bins.buf, parent.buf, node_key.buf, node_count.buf, n_nodes, table.buf,
                                  table.len / size, values.buf, wide, values.len / value_size, n, n_keys,
                                  order.buf, offsets.buf, n_packs);
    Py_END_ALLOW_THREADS
    if (status == -2) {
        PyErr_NoMemory();
        goto done;
    }
    if (status != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "expand_groups: the groups do not hold exactly the samples of each key in "
                        "len(offsets) - 1 packs (internal error)");
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&node_bins);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&node_key);
    PyBuffer_Release(&node_count);
    PyBuffer_Release(&table);
    PyBuffer_Release(&values);
    PyBuffer_Release(&order);
    PyBuffer_Release(&offsets);
    return result;
}

static PyMethodDef methods[] = {
    {"first_fit", first_fit, METH_VARARGS,
     "first_fit(lengths: int64 buffer, capacity: int, bins_out: int64 buffer, max_bins: int) -> bins opened"},
    {"first_fit_apart", first_fit_apart, METH_VARARGS,
     "first_fit_apart(lengths: int64 buffer, keys: int64 buffer (-1: none), capacity: int, bins_out: int64 "
     "buffer) -> bins opened"},
    {"group_by_bin", group_by_bin, METH_VARARGS,
     "group_by_bin(bins: int64 buffer, order_out: int64 buffer, offsets_out: int64 buffer) -> None"},
    {"expand_groups", expand_groups, METH_VARARGS,
     "expand_groups(node_bins, parent, node_key, node_count, table: int64 buffers, values: int32 or int64 "
     "buffer (negative: not packed), value_size: 4 or 8, n_keys: int, order_out: int64 buffer, "
     "offsets_out: int64 buffer) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_firstfit", "The planner's native kernels: first fit, counting sort, bfd expansion.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__firstfit(void) { return PyModule_Create(&module); }
