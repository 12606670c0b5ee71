#include "kernels_cpu.h"

#include <mlx/mlx.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "core/thread_pool.h"
#include "kernels/shim.h"

namespace agentkv::kernels {
namespace {

// One grid point of each kernel: the kernel body, verbatim, as a function body.
// The chunk is the whole span (grid x = 1): each call copies whole planes.

template <typename T>
void gather_point(const T* blocks, const int* table, const int* meta, T* out,
                  uint3 thread_position_in_grid) {
#include "kernels/gather.metal"
}

template <typename T>
void merge_point(const T* const* srcs, const int* rows, const int* dims, T* out,
                 uint3 thread_position_in_grid) {
#include "kernels/merge.metal"
}

template <typename T>
void extract_point(const T* batch, const int* meta, const int* dims, T* out,
                   uint3 thread_position_in_grid) {
#include "kernels/extract.metal"
}

constexpr int kWholeSpan = 1 << 30;

void check_units(const mx::array& a, const char* what) {
  if (a.dtype() != mx::uint16 && a.dtype() != mx::uint32) {
    throw std::invalid_argument(std::string(what) + " must be viewed as uint16 or uint32 units");
  }
}

mx::array new_array(mx::Shape shape, mx::Dtype dtype) {
  size_t n = 1;
  for (int d : shape) {
    n *= static_cast<size_t>(d);
  }
  return mx::array(mx::allocator::malloc(n * dtype.size()), std::move(shape), dtype);
}

// Run the grid columns on the shared pool (persistent threads: these kernels run
// once per layer of every batch change, too often to spawn threads each time).
void run_columns(size_t n, int threads, const std::function<void(size_t)>& f) {
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) {
      f(i);
    }
    return;
  }
  ThreadPool::shared().run(n, f);
}

// A unit of work: one (output, y, z) grid column.
struct Column {
  int output;
  unsigned int y;
  unsigned int z;
};

}  // namespace

std::vector<mx::array> gather(const mx::array& blocks_in, const mx::array& table_in,
                              const std::vector<std::array<int, 7>>& metas, int threads) {
  check_units(blocks_in, "blocks");
  mx::array blocks = mx::contiguous(blocks_in);
  mx::array table = mx::contiguous(mx::astype(table_in, mx::int32));
  mx::eval({blocks, table});
  std::vector<mx::array> outputs;
  std::vector<std::array<int, 7>> params = metas;
  std::vector<Column> columns;
  for (size_t k = 0; k < metas.size(); ++k) {
    auto& m = params[k];
    m[5] = kWholeSpan;
    outputs.push_back(new_array({1, m[1], m[4], m[2]}, blocks.dtype()));
    const int row_blocks = (m[4] + 255) / 256;
    for (int b = 0; b < row_blocks; ++b) {
      for (int h = 0; h < m[1]; ++h) {
        columns.push_back(
            {static_cast<int>(k), static_cast<unsigned>(b), static_cast<unsigned>(h)});
      }
    }
  }
  const int* tbl = table.data<int>();
  const int64_t table_rows = table.size() / 2;
  for (const auto& m : params) {
    if (m[6] > table_rows || static_cast<int64_t>(m[6]) * 256 < m[3] || m[3] > m[4]) {
      throw std::invalid_argument("gather: the block table does not cover the length");
    }
    for (int b = 0; b < m[6]; ++b) {
      const int64_t end = static_cast<int64_t>(tbl[2 * b]) +
                          static_cast<int64_t>(tbl[2 * b + 1]) * (m[0] + m[1] * m[2]);
      if (tbl[2 * b] < 0 || tbl[2 * b + 1] < 0 || tbl[2 * b + 1] > 256 ||
          end > static_cast<int64_t>(blocks.size())) {
        throw std::invalid_argument("gather: block " + std::to_string(b) + " lies outside blocks");
      }
    }
  }
  run_columns(columns.size(), threads, [&](size_t i) {
    const Column& c = columns[i];
    const uint3 point{0, c.y, c.z};
    if (blocks.dtype() == mx::uint16) {
      gather_point(blocks.data<uint16_t>(), tbl, params[c.output].data(),
                   outputs[c.output].data<uint16_t>(), point);
    } else {
      gather_point(blocks.data<uint32_t>(), tbl, params[c.output].data(),
                   outputs[c.output].data<uint32_t>(), point);
    }
  });
  return outputs;
}

std::vector<mx::array> merge(const std::vector<std::vector<mx::array>>& sources_in,
                             const mx::array& rows_in, const std::vector<std::array<int, 5>>& dims,
                             int threads) {
  if (sources_in.size() != dims.size()) {
    throw std::invalid_argument("need one dims entry per output");
  }
  mx::array rows = mx::contiguous(mx::astype(rows_in, mx::int32));
  std::vector<std::vector<mx::array>> sources;
  std::vector<mx::array> to_eval{rows};
  for (const auto& list : sources_in) {
    std::vector<mx::array> contiguous;
    for (const auto& a : list) {
      check_units(a, "merge sources");
      contiguous.push_back(mx::contiguous(a));
      to_eval.push_back(contiguous.back());
    }
    sources.push_back(std::move(contiguous));
  }
  mx::eval(to_eval);
  if (rows.ndim() != 2 || rows.shape(1) != 5) {
    throw std::invalid_argument("rows must be int32 [n_rows, 5]");
  }
  const int n_rows = rows.shape(0);
  const int* row_data = rows.data<int>();
  std::vector<std::array<int, 5>> params = dims;
  std::vector<mx::array> outputs;
  std::vector<std::vector<const void*>> pointers(sources.size());
  std::vector<Column> columns;
  for (size_t k = 0; k < sources.size(); ++k) {
    auto& d = params[k];
    d[4] = kWholeSpan;
    if (sources[k].empty()) {
      throw std::invalid_argument("merge needs at least one source per output");
    }
    const mx::Dtype dtype = sources[k][0].dtype();
    for (const auto& a : sources[k]) {
      if (a.dtype() != dtype) {
        throw std::invalid_argument("merge sources of one output must share a dtype");
      }
      pointers[k].push_back(a.data<void>());
    }
    for (int r = 0; r < n_rows; ++r) {
      const int* row = row_data + 5 * r;
      const int source = row[0];
      const bool known = source >= 0 && source < static_cast<int>(sources[k].size());
      const mx::array* a = known ? &sources[k][source] : nullptr;
      const bool fits = known && a->ndim() == 4 && a->shape(1) == d[0] && a->shape(3) == d[1] &&
                        a->shape(2) == row[4] && row[1] >= 0 && row[1] < a->shape(0) &&
                        row[2] >= 0 && row[3] >= 0 && row[2] + row[3] <= row[4] && row[3] <= d[2] &&
                        d[2] <= d[3];
      if (!fits) {
        throw std::invalid_argument("merge row " + std::to_string(r) + " does not fit its source");
      }
    }
    outputs.push_back(new_array({n_rows, d[0], d[3], d[1]}, dtype));
    for (int r = 0; r < n_rows; ++r) {
      for (int h = 0; h < d[0]; ++h) {
        columns.push_back(
            {static_cast<int>(k), static_cast<unsigned>(r), static_cast<unsigned>(h)});
      }
    }
  }
  run_columns(columns.size(), threads, [&](size_t i) {
    const Column& c = columns[i];
    const uint3 point{0, c.y, c.z};
    const auto& ptrs = pointers[c.output];
    if (outputs[c.output].dtype() == mx::uint16) {
      merge_point(reinterpret_cast<const uint16_t* const*>(ptrs.data()), row_data,
                  params[c.output].data(), outputs[c.output].data<uint16_t>(), point);
    } else {
      merge_point(reinterpret_cast<const uint32_t* const*>(ptrs.data()), row_data,
                  params[c.output].data(), outputs[c.output].data<uint32_t>(), point);
    }
  });
  return outputs;
}

std::vector<mx::array> extract(const std::vector<mx::array>& batches_in,
                               const std::vector<std::array<int, 7>>& metas, int threads) {
  if (batches_in.size() != metas.size()) {
    throw std::invalid_argument("need one meta entry per batch array");
  }
  std::vector<mx::array> batches;
  for (const auto& a : batches_in) {
    check_units(a, "batch");
    batches.push_back(mx::contiguous(a));
  }
  mx::eval(batches);
  std::vector<mx::array> outputs;
  std::vector<Column> columns;
  const int chunk[1] = {kWholeSpan};
  for (size_t k = 0; k < metas.size(); ++k) {
    const auto& m = metas[k];
    const auto& b = batches[k];
    if (b.ndim() != 4 || m[0] < 0 || m[0] >= b.shape(0) || m[3] != b.shape(1) ||
        m[4] != b.shape(3) || m[5] != b.shape(2) || m[1] + m[2] > m[5] || m[2] > m[6]) {
      throw std::invalid_argument("extract " + std::to_string(k) + " does not fit its batch");
    }
    outputs.push_back(new_array({1, m[3], m[6], m[4]}, b.dtype()));
    for (int h = 0; h < m[3]; ++h) {
      columns.push_back({static_cast<int>(k), 0, static_cast<unsigned>(h)});
    }
  }
  run_columns(columns.size(), threads, [&](size_t i) {
    const Column& c = columns[i];
    const uint3 point{0, 0, c.z};
    if (outputs[c.output].dtype() == mx::uint16) {
      extract_point(batches[c.output].data<uint16_t>(), metas[c.output].data(), chunk,
                    outputs[c.output].data<uint16_t>(), point);
    } else {
      extract_point(batches[c.output].data<uint32_t>(), metas[c.output].data(), chunk,
                    outputs[c.output].data<uint32_t>(), point);
    }
  });
  return outputs;
}

}  // namespace agentkv::kernels
