// merge: rows of several caches -> one left-padded batch [rows, heads, capacity, width]
// for one component, in units of T. Each output row takes `length` token rows of
// one source (an agent's [1, heads, cap, width] cache, or a row of a batch) and
// right-aligns them to `used`; everything else is zero. The same kernel extends a
// batch with new agents and filters rows out of it.
//
// A per-backend preamble declares `srcs`, the source pointers in input order
// (see agentkv/kernels/gpu.py `_pointers` and csrc/kernels_cpu.cpp).
//
// inputs:  srcs    T*[n_sources]
//          rows    int[5 * n_rows] per output row: source, source row, source
//                  first token row, length, source capacity
//          dims    int[5]          heads, width, used, capacity, chunk
// output:  out     T[n_rows * heads * capacity * width]
// grid:    (ceil(capacity * width / chunk), n_rows, heads)
const int heads = dims[0];
const int width = dims[1];
const int used = dims[2];
const int capacity = dims[3];
const int chunk = dims[4];
const int r = (int)thread_position_in_grid.y;
const int h = (int)thread_position_in_grid.z;
if (h >= heads) {
  return;
}
const int u0 = (int)thread_position_in_grid.x * chunk;
const int u_end = capacity * width;
if (u0 >= u_end) {
  return;
}
const int u1 = (u0 + chunk < u_end) ? u0 + chunk : u_end;
const int source = rows[5 * r];
const int source_row = rows[5 * r + 1];
const int first = rows[5 * r + 2];
const int length = rows[5 * r + 3];
const int source_capacity = rows[5 * r + 4];
const int c0 = (used - length) * width;
const int c1 = used * width;
const unsigned int dst = (unsigned int)(r * heads + h) * (unsigned int)(capacity * width);
// Unsigned arithmetic wraps, so src + u is right for every u in [c0, c1).
const unsigned int src =
    ((unsigned int)(source_row * heads + h) * (unsigned int)source_capacity + (unsigned int)first) *
        (unsigned int)width -
    (unsigned int)c0;
int u = u0;
for (; u < u1 && u < c0; ++u) {
  out[dst + u] = T(0);
}
for (; u < u1 && u < c1; ++u) {
  out[dst + u] = srcs[source][src + u];
}
for (; u < u1; ++u) {
  out[dst + u] = T(0);
}
