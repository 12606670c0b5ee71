// extract: one row of a batch -> that agent's [1, heads, capacity, width] cache
// for one component, in units of T, without the padding; rows >= length are zero.
//
// inputs:  batch   T[batch_rows * heads * batch_capacity * width]
//          meta    int[7]   row, first token row, length, heads, width,
//                           batch_capacity, capacity
//          dims    int[1]   chunk
// output:  out     T[heads * capacity * width]
// grid:    (ceil(capacity * width / chunk), 1, heads)
const int row = meta[0];
const int first = meta[1];
const int length = meta[2];
const int heads = meta[3];
const int width = meta[4];
const int batch_capacity = meta[5];
const int capacity = meta[6];
const int chunk = dims[0];
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
const int copy_end = (length * width < u1) ? length * width : u1;
const unsigned int dst = (unsigned int)h * (unsigned int)(capacity * width);
const unsigned int src =
    ((unsigned int)(row * heads + h) * (unsigned int)batch_capacity + (unsigned int)first) *
    (unsigned int)width;
int u = u0;
for (; u < copy_end; ++u) {
  out[dst + u] = batch[src + u];
}
for (; u < u1; ++u) {
  out[dst + u] = T(0);
}
