// Python bindings of agentkv's native core: the only NB_MODULE.
//
// Arrays cross the boundary as mlx.core.array (the extension is built against
// the installed MLX and nanobind's "mlx" domain, as MLX documents for custom
// extensions) so loaded KV blocks land in MLX-owned memory with one copy.
#include <mlx/mlx.h>
#include <mlx/version.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/attention.h"
#include "core/block_io.h"
#include "core/checksum.h"
#include "core/gemm.h"
#include "core/kvswap.h"
#include "core/mapping_cache.h"
#include "core/parallel.h"
#include "core/pool_io.h"
#include "core/qmm.h"
#include "core/rows.h"
#include "core/store_error.h"
#include "core/thread_pool.h"
#include "kernels_cpu.h"
#include "kvswap_ops.h"
#include "ops.h"

namespace nb = nanobind;
namespace mx = mlx::core;
using namespace nb::literals;

namespace {

// (heads, width, dtype name) of one component of a layer's cache.
using ComponentArg = std::tuple<uint32_t, uint32_t, std::string>;
using LayerComponents = std::vector<std::vector<ComponentArg>>;  // per layer
// (path, size, header checksum, layout): layout 0 = planes, 1 = groups (block_io.h).
using SegmentArg = std::tuple<std::string, uint64_t, uint32_t, uint32_t>;
using BlockArg = std::tuple<uint32_t, uint64_t, uint64_t, uint32_t, uint32_t>;
using SpanArg = std::tuple<uint64_t, uint64_t>;

mx::Dtype dtype_from_name(const std::string& name) {
  static const std::unordered_map<std::string, mx::Dtype> dtypes = {
      {"bool", mx::bool_},      {"uint8", mx::uint8},       {"uint16", mx::uint16},
      {"uint32", mx::uint32},   {"uint64", mx::uint64},     {"int8", mx::int8},
      {"int16", mx::int16},     {"int32", mx::int32},       {"int64", mx::int64},
      {"float16", mx::float16}, {"bfloat16", mx::bfloat16}, {"float32", mx::float32}};
  auto it = dtypes.find(name);
  if (it == dtypes.end()) {
    throw nb::value_error(("unsupported dtype " + name).c_str());
  }
  return it->second;
}

struct Layout {
  agentkv::Geometry geometry;
  std::vector<mx::Dtype> dtypes;  // [layer * per_layer + comp], as geometry.components
  std::vector<uint32_t> widths;
};

Layout make_layout(uint32_t layers, uint32_t block_tokens, const LayerComponents& comps) {
  if (comps.size() != layers || comps.empty()) {
    throw nb::value_error("need one component list per layer");
  }
  Layout out;
  out.geometry.layers = layers;
  out.geometry.block_tokens = block_tokens;
  out.geometry.per_layer = static_cast<uint32_t>(comps[0].size());
  for (const auto& layer : comps) {
    if (layer.size() != comps[0].size()) {
      throw nb::value_error("every layer needs the same number of components");
    }
    for (const auto& [heads, width, name] : layer) {
      const mx::Dtype dtype = dtype_from_name(name);
      out.dtypes.push_back(dtype);
      out.widths.push_back(width);
      out.geometry.components.push_back({heads, static_cast<uint32_t>(width * dtype.size())});
    }
  }
  out.geometry.validate();
  return out;
}

std::vector<agentkv::LayerSpan> make_spans(const std::vector<SpanArg>& spans) {
  std::vector<agentkv::LayerSpan> out;
  out.reserve(spans.size());
  for (const auto& [first, capacity] : spans) {
    out.push_back({first, capacity});
  }
  return out;
}

Py_buffer get_buffer(nb::handle obj) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
    throw nb::python_error();
  }
  return view;
}

uint32_t py_crc32c(nb::handle data, uint32_t value) {
  Py_buffer view = get_buffer(data);
  uint32_t crc;
  {
    nb::gil_scoped_release release;
    crc = agentkv::crc32c_extend(value, view.buf, static_cast<size_t>(view.len));
  }
  PyBuffer_Release(&view);
  return crc;
}

uint32_t py_block_checksum(nb::handle data) {
  Py_buffer view = get_buffer(data);
  uint32_t crc;
  {
    nb::gil_scoped_release release;
    crc = agentkv::block_checksum(view.buf, static_cast<size_t>(view.len));
  }
  PyBuffer_Release(&view);
  return crc;
}

agentkv::RegionLayout region_layout(uint32_t layout) {
  if (layout > static_cast<uint32_t>(agentkv::RegionLayout::kGroups)) {
    throw nb::value_error("a region layout is 0 (planes) or 1 (groups)");
  }
  return static_cast<agentkv::RegionLayout>(layout);
}

std::vector<agentkv::SegmentRef> segment_refs(const std::vector<SegmentArg>& files) {
  std::vector<agentkv::SegmentRef> refs;
  for (const auto& [path, size, crc, layout] : files) {
    refs.push_back({path, size, crc, region_layout(layout)});
  }
  return refs;
}

// Load tokens [0, tokens) of an agent's blocks into fresh MLX arrays,
// one [1, heads, capacity, width] array per layer and component.
std::vector<mx::array> gather_blocks(uint32_t layers, uint32_t block_tokens,
                                     const LayerComponents& components,
                                     const std::vector<SegmentArg>& segments,
                                     const std::vector<BlockArg>& blocks, uint64_t tokens,
                                     const std::vector<SpanArg>& spans, int threads) {
  const Layout layout = make_layout(layers, block_tokens, components);
  const auto layer_spans = make_spans(spans);
  if (layer_spans.size() != layers) {
    throw nb::value_error("need one span per layer");
  }
  const std::vector<agentkv::SegmentRef> segs = segment_refs(segments);
  std::vector<agentkv::BlockRef> refs;
  for (const auto& [segment, offset, length, checksum, count] : blocks) {
    refs.push_back({segment, offset, length, checksum, count});
  }
  const size_t ncomp = layout.geometry.per_layer;
  std::vector<mx::array> arrays;
  std::vector<uint8_t*> dst;
  arrays.reserve(layers * ncomp);
  for (uint32_t l = 0; l < layers; ++l) {
    for (size_t c = 0; c < ncomp; ++c) {
      const size_t i = l * ncomp + c;
      const auto& comp = layout.geometry.components[i];
      const uint64_t capacity = layer_spans[l].capacity;
      auto data = mx::allocator::malloc(comp.heads * capacity * comp.row_bytes);
      dst.push_back(static_cast<uint8_t*>(data.buffer().raw_ptr()));
      arrays.emplace_back(std::move(data),
                          mx::Shape{1, static_cast<int>(comp.heads), static_cast<int>(capacity),
                                    static_cast<int>(layout.widths[i])},
                          layout.dtypes[i]);
    }
  }
  {
    nb::gil_scoped_release release;
    agentkv::gather_blocks(layout.geometry, segs, refs, tokens, layer_spans, dst, threads);
  }
  return arrays;
}

// Tensors of any safetensors file into new MLX arrays, one copy each from the
// (cached) mmap of the file. A tensor of 2+ dims may get `capacity` rows on its
// second-to-last axis (>= its own; the extra rows are zero) so a cache loaded
// from it can grow without copying itself at the next step.
using TensorArg = std::tuple<uint64_t, uint64_t, std::vector<int>, std::string, int>;

std::vector<mx::array> load_tensors(const std::string& path, uint64_t data_start,
                                    const std::vector<TensorArg>& tensors, int threads) {
  auto file = agentkv::mapping_cache().open(path);
  std::vector<mx::array> arrays;
  std::vector<std::function<void()>> copies;
  for (const auto& [offset, nbytes, shape, dtype_name, capacity] : tensors) {
    const mx::Dtype dtype = dtype_from_name(dtype_name);
    uint64_t count = 1;
    for (int d : shape) {
      if (d < 0) {
        throw agentkv::StoreError(path, "negative tensor dimension");
      }
      count *= static_cast<uint64_t>(d);
    }
    if (count * dtype.size() != nbytes || data_start + offset < data_start ||
        data_start + offset + nbytes > file->size()) {
      throw agentkv::StoreError(path, "a tensor lies outside the file or has the wrong size");
    }
    mx::Shape out_shape(shape.begin(), shape.end());
    int rows = 0;
    if (shape.size() >= 2 && capacity > shape[shape.size() - 2]) {
      rows = shape[shape.size() - 2];
      out_shape[out_shape.size() - 2] = capacity;
    }
    uint64_t out_count = 1;
    for (int d : out_shape) {
      out_count *= static_cast<uint64_t>(d);
    }
    auto data = mx::allocator::malloc(std::max<uint64_t>(out_count * dtype.size(), 1));
    auto* dst = static_cast<uint8_t*>(data.buffer().raw_ptr());
    const uint8_t* src = file->data() + data_start + offset;
    arrays.emplace_back(std::move(data), out_shape, dtype);
    if (rows == 0) {
      copies.emplace_back([=] { std::memcpy(dst, src, nbytes); });
      continue;
    }
    const uint64_t row_bytes = static_cast<uint64_t>(shape.back()) * dtype.size();
    const uint64_t planes = count / (static_cast<uint64_t>(rows) * shape.back());
    const uint64_t plane_in = rows * row_bytes;
    const uint64_t plane_out = static_cast<uint64_t>(capacity) * row_bytes;
    copies.emplace_back([=] {
      for (uint64_t p = 0; p < planes; ++p) {
        std::memcpy(dst + p * plane_out, src + p * plane_in, plane_in);
        std::memset(dst + p * plane_out + plane_in, 0, plane_out - plane_in);
      }
    });
  }
  {
    nb::gil_scoped_release release;
    agentkv::parallel_for(copies.size(), threads, [&](size_t i) { copies[i](); });
  }
  return arrays;
}

// -- the block pool's arenas (csrc/core/pool_io.h) ------------------------------------------

using RegionArg = std::tuple<uint32_t, uint64_t, uint64_t, uint32_t, uint32_t, uint32_t>;

// Raw pointers of evaluated, row-contiguous arenas that match the layout.
template <typename Ptr>
std::vector<Ptr> arena_pointers(std::vector<mx::array>& arenas, const Layout& layout,
                                uint64_t rows) {
  if (arenas.size() != layout.dtypes.size()) {
    throw nb::value_error("need one arena per layer and component");
  }
  mx::eval(arenas);
  std::vector<Ptr> out;
  for (size_t i = 0; i < arenas.size(); ++i) {
    const mx::array& a = arenas[i];
    if (a.ndim() != 2 || static_cast<uint64_t>(a.shape(0)) != rows ||
        a.shape(1) != static_cast<int>(layout.widths[i]) || a.dtype() != layout.dtypes[i] ||
        !a.flags().row_contiguous) {
      throw nb::value_error(("arena " + std::to_string(i) + " does not match the layout").c_str());
    }
    out.push_back(const_cast<Ptr>(a.data<uint8_t>()));
  }
  return out;
}

uint64_t arena_rows(const Layout& layout, uint64_t blocks) {
  return blocks * layout.geometry.components[0].heads * layout.geometry.block_tokens;
}

// An arena of `rows` rows whose memory is not touched: pages are committed as they are
// written (MLX's allocator, no fill).
mx::array uninitialized(uint64_t rows, uint32_t width, const std::string& dtype_name) {
  const mx::Dtype dtype = dtype_from_name(dtype_name);
  auto data = mx::allocator::malloc(std::max<uint64_t>(rows * width * dtype.size(), 1));
  return mx::array(std::move(data), mx::Shape{static_cast<int>(rows), static_cast<int>(width)},
                   dtype);
}

void read_regions(std::vector<mx::array> arenas, uint32_t layers, uint32_t block_tokens,
                  const LayerComponents& components, uint64_t blocks,
                  const std::vector<SegmentArg>& files, const std::vector<RegionArg>& regions,
                  int threads) {
  const Layout layout = make_layout(layers, block_tokens, components);
  auto dst = arena_pointers<uint8_t*>(arenas, layout, arena_rows(layout, blocks));
  const std::vector<agentkv::SegmentRef> refs = segment_refs(files);
  std::vector<agentkv::RegionRef> regs;
  for (const auto& [file, offset, length, checksum, tokens, slot] : regions) {
    regs.push_back({file, offset, length, checksum, tokens, slot});
  }
  nb::gil_scoped_release release;
  agentkv::read_regions(layout.geometry, refs, regs, dst, blocks, threads);
}

std::tuple<nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>, std::vector<BlockArg>> pack_regions(
    std::vector<mx::array> arenas, uint32_t layers, uint32_t block_tokens,
    const LayerComponents& components, uint64_t blocks, const std::vector<uint32_t>& slots,
    const std::vector<uint32_t>& tokens, const std::vector<uint32_t>& layouts, int threads) {
  const Layout layout = make_layout(layers, block_tokens, components);
  auto src = arena_pointers<const uint8_t*>(arenas, layout, arena_rows(layout, blocks));
  std::vector<agentkv::RegionLayout> region_layouts;
  for (uint32_t l : layouts) {
    region_layouts.push_back(region_layout(l));
  }
  uint64_t size = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= blocks) {
      throw nb::value_error("a slot lies outside the arenas");
    }
    size += layout.geometry.block_bytes(i < tokens.size() ? tokens[i] : 0);
  }
  auto* out = new uint8_t[size ? size : 1];
  nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<uint8_t*>(p); });
  std::vector<agentkv::PackedBlock> packed;
  {
    nb::gil_scoped_release release;
    packed =
        agentkv::pack_regions(layout.geometry, slots, tokens, region_layouts, src, out, threads);
  }
  std::vector<BlockArg> records;
  for (const auto& p : packed) {
    records.emplace_back(0u, p.offset, p.length, p.checksum, p.tokens);
  }
  size_t shape[1] = {static_cast<size_t>(size)};
  return {nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(out, 1, shape, owner), records};
}

void copy_slot_rows(std::vector<mx::array> arenas, uint32_t layers, uint32_t block_tokens,
                    const LayerComponents& components, uint64_t blocks, uint32_t src, uint32_t dst,
                    uint32_t tokens) {
  const Layout layout = make_layout(layers, block_tokens, components);
  if (src >= blocks || dst >= blocks) {
    throw nb::value_error("a slot lies outside the arenas");
  }
  auto ptrs = arena_pointers<uint8_t*>(arenas, layout, arena_rows(layout, blocks));
  agentkv::copy_slot_rows(layout.geometry, ptrs, src, dst, tokens);
}

uint64_t release_slot(std::vector<mx::array> arenas, uint32_t layers, uint32_t block_tokens,
                      const LayerComponents& components, uint64_t blocks, uint32_t slot,
                      const std::vector<uint8_t>& layer_mask) {
  const Layout layout = make_layout(layers, block_tokens, components);
  if (slot >= blocks) {
    throw nb::value_error("the slot lies outside the arenas");
  }
  auto ptrs = arena_pointers<uint8_t*>(arenas, layout, arena_rows(layout, blocks));
  return agentkv::release_slot(layout.geometry, ptrs, slot, layer_mask);
}

// Test hooks for the KV writes of decoder_layer (csrc/core/rows.h), run at once.
mx::array float32_rows(const mx::array& x, int64_t& dim) {
  if (x.dtype() != mx::float32 || x.ndim() < 1) {
    throw std::invalid_argument("expected a float32 array [..., dim]");
  }
  mx::array c = mx::contiguous(x);
  mx::eval(c);
  dim = x.shape(-1);
  return c;
}

std::tuple<mx::array, mx::array, mx::array> quantize_rows_op(const mx::array& x, int bits,
                                                             int group) {
  int64_t dim = 0;
  mx::array c = float32_rows(x, dim);
  if ((bits != 2 && bits != 4 && bits != 8) || group < 32 || dim % group || group % 32) {
    throw std::invalid_argument("quantize_rows: bits 2, 4 or 8 and groups dividing the rows");
  }
  const int64_t rows = static_cast<int64_t>(c.size()) / dim;
  std::vector<uint32_t> words(rows * dim * bits / 32);
  std::vector<uint16_t> scales(rows * dim / group), biases(rows * dim / group);
  agentkv::quantize_rows(c.data<float>(), rows, dim, bits, group, words.data(), scales.data(),
                         biases.data());
  mx::Shape shape = x.shape();
  shape.back() = static_cast<int>(dim * bits / 32);
  mx::array w(words.data(), shape, mx::uint32);
  shape.back() = static_cast<int>(dim / group);
  auto halves = [&](std::vector<uint16_t>& v) {
    return mx::view(mx::array(v.data(), shape, mx::uint16), mx::float16);
  };
  return {w, halves(scales), halves(biases)};
}

std::tuple<mx::array, mx::array, mx::array> quantize_channels_op(const mx::array& x, int bits) {
  if (x.dtype() != mx::float16 || x.ndim() != 2 || (bits != 2 && bits != 4 && bits != 8) ||
      x.shape(1) % x.shape(0) || x.shape(1) * bits % 32) {
    throw std::invalid_argument(
        "quantize_channels: float16 [tokens, dim] (dim a multiple of tokens), bits 2, 4 or 8");
  }
  mx::array c = mx::contiguous(x);
  mx::eval(c);
  const int tokens = x.shape(0);
  const int64_t dim = x.shape(1);
  std::vector<uint32_t> words(tokens * dim * bits / 32);
  std::vector<uint16_t> scales(dim), biases(dim);
  agentkv::quantize_channels(c.data<uint16_t>(), tokens, dim, bits, words.data(), scales.data(),
                             biases.data());
  const mx::Shape spread = {tokens, static_cast<int>(dim / tokens)};
  auto halves = [&](std::vector<uint16_t>& v) {
    return mx::view(mx::array(v.data(), spread, mx::uint16), mx::float16);
  };
  return {mx::array(words.data(), {tokens, static_cast<int>(dim * bits / 32)}, mx::uint32),
          halves(scales), halves(biases)};
}

nb::dict build_info() {
  nb::dict info;
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
  info["cxx_standard"] = static_cast<long>(__cplusplus);
  info["mlx_version"] = mx::version();
  info["nanobind_version"] = std::to_string(NB_VERSION_MAJOR) + "." +
                             std::to_string(NB_VERSION_MINOR) + "." +
                             std::to_string(NB_VERSION_PATCH);
  info["crc32c"] = agentkv::crc32c_implementation();
  info["gemm"] = agentkv::gemm_implementation();
  info["qmm"] = agentkv::qmm_implementation();
  info["attention"] = agentkv::attention_implementation();
  info["threads"] = static_cast<long>(agentkv::ThreadPool::shared().size());
#ifdef NDEBUG
  info["build_type"] = "release";
#else
  info["build_type"] = "debug";
#endif
  return info;
}

}  // namespace

// KVSwap (csrc/core/kvswap.h): each group's CRC-32C as the pool holds it, per evicted block,
// layer and group: the group's rows of every component (in order), head by head.
std::vector<uint32_t> kvswap_group_crcs(std::vector<mx::array> arenas, uint32_t layers,
                                        uint32_t kv_heads, uint32_t block_tokens, uint32_t group,
                                        const std::vector<int32_t>& blocks) {
  if (layers == 0 || arenas.size() % layers || group == 0 || block_tokens % group) {
    throw nb::value_error("kvswap_group_crcs: bad geometry");
  }
  mx::eval(arenas);
  const size_t comps = arenas.size() / layers;
  const uint32_t groups = block_tokens / group;
  std::vector<uint32_t> crcs;
  crcs.reserve(blocks.size() * layers * groups);
  for (int32_t block : blocks) {
    for (uint32_t l = 0; l < layers; ++l) {
      for (uint32_t g = 0; g < groups; ++g) {
        uint32_t crc = 0;
        for (size_t c = 0; c < comps; ++c) {
          const mx::array& a = arenas[l * comps + c];
          const int64_t rb = static_cast<int64_t>(a.shape(1)) * a.itemsize();
          for (uint32_t h = 0; h < kv_heads; ++h) {
            const int64_t row = (static_cast<int64_t>(block) * kv_heads + h) * block_tokens +
                                static_cast<int64_t>(g) * group;
            if (block < 0 || row + group > a.shape(0)) {
              throw nb::value_error("kvswap_group_crcs: a block outside the arena");
            }
            crc = agentkv::crc32c_extend(crc, a.data<uint8_t>() + row * rb, group * rb);
          }
        }
        crcs.push_back(crc);
      }
    }
  }
  return crcs;
}

template <typename T>
std::vector<T> evaluated_vector(const mx::array& a, mx::Dtype dtype, const char* what) {
  if (a.dtype() != dtype) {
    throw nb::type_error(what);
  }
  mx::array c = mx::contiguous(a);
  mx::eval(c);
  return std::vector<T>(c.data<T>(), c.data<T>() + c.size());
}

nb::dict kvswap_stats(const agentkv::KVSwapSet& s) {
  const auto& st = s.stats();
  nb::dict d;
  d["steps"] = st.steps;
  d["hits"] = st.hits;
  d["misses"] = st.misses;
  d["fills"] = st.fills;
  d["bytes_read"] = st.bytes_read;
  d["read_ns"] = st.read_ns;
  d["wait_ns"] = st.wait_ns;
  d["select_ns"] = st.select_ns;
  d["predicted"] = st.predicted;
  d["read_ahead"] = st.read_ahead;
  d["ahead_used"] = st.ahead_used;
  d["disk_reads"] = st.disk_reads;
  return d;
}

void bind_kvswap(nb::module_& m) {
  using agentkv::KVSwapSet;
  nb::class_<KVSwapSet>(m, "KVSwapSet",
                        "One agent's evicted KV blocks for KVSwap (csrc/core/kvswap.h).")
      .def(nb::init<int, int, int, int, int, int, int, int, int, float,
                    const std::vector<std::string>&, std::vector<int64_t>, std::vector<int64_t>,
                    int, std::vector<uint32_t>>(),
           "layers"_a, "kv_heads"_a, "q_heads"_a, "head_dim"_a, "block_tokens"_a, "group"_a,
           "rank"_a, "slots"_a, "demand"_a, "attention_scale"_a, "paths"_a, "offsets"_a,
           "row_bytes"_a, "comps"_a, "crcs"_a)
      .def(
          "set_layer",
          [](KVSwapSet& s, int layer, const mx::array& query_projection, const mx::array& keys,
             const mx::array& scales) {
            const auto qp =
                evaluated_vector<float>(query_projection, mx::float32, "projection: float32");
            const auto k = evaluated_vector<int8_t>(keys, mx::int8, "keys: int8");
            const auto sc = evaluated_vector<float>(scales, mx::float32, "scales: float32");
            if (!s.layer_sizes_ok(qp.size(), k.size(), sc.size())) {
              throw nb::value_error(
                  "set_layer: projection [kv_heads, head_dim, rank], keys [kv_heads, rank, "
                  "tokens] and scales [kv_heads, groups]");
            }
            s.set_layer(layer, qp.data(), k.data(), sc.data());
          },
          "layer"_a, "query_projection"_a, "keys"_a, "scales"_a)
      .def(
          "add_block",
          [](KVSwapSet& s, const std::string& path, const std::vector<int64_t>& offsets,
             const std::vector<uint32_t>& crcs, const std::vector<mx::array>& keys,
             const std::vector<mx::array>& scales) {
            std::vector<std::vector<int8_t>> k;
            std::vector<std::vector<float>> sc;
            std::vector<const int8_t*> kp;
            std::vector<const float*> sp;
            for (size_t i = 0; i < keys.size() && i < scales.size(); ++i) {
              k.push_back(evaluated_vector<int8_t>(keys[i], mx::int8, "keys: int8"));
              sc.push_back(evaluated_vector<float>(scales[i], mx::float32, "scales: float32"));
              if (!s.block_sizes_ok(k.back().size(), sc.back().size())) {
                throw nb::value_error(
                    "add_block: keys [kv_heads, rank, block_tokens] and scales [kv_heads, "
                    "groups per block] per layer");
              }
              kp.push_back(k.back().data());
              sp.push_back(sc.back().data());
            }
            s.add_block(path, offsets, crcs, kp, sp);
          },
          "path"_a, "offsets"_a, "crcs"_a, "keys"_a, "scales"_a)
      .def(
          "set_bounds",
          [](KVSwapSet& s, int layer, const mx::array& lo, const mx::array& hi) {
            const auto l = evaluated_vector<float>(lo, mx::float32, "lo: float32");
            const auto h = evaluated_vector<float>(hi, mx::float32, "hi: float32");
            if (!s.bounds_size_ok(l.size()) || h.size() != l.size()) {
              throw nb::value_error("set_bounds: lo and hi [kv_heads, groups, head_dim]");
            }
            s.set_bounds(layer, l.data(), h.data());
          },
          "layer"_a, "lo"_a, "hi"_a)
      .def("slot_groups", &KVSwapSet::slot_groups, "layer"_a)
      .def(
          "ranked",
          [](const KVSwapSet& s, int layer, const mx::array& q) {
            const auto v = evaluated_vector<float>(q, mx::float32, "q: float32 [Hq, D]");
            if (!s.query_size_ok(v.size())) {
              throw nb::value_error("q must be float32 [Hq, D]");
            }
            return s.ranked(layer, v.data());
          },
          "layer"_a, "q"_a)
      .def(
          "predict",
          [](KVSwapSet& s, int layer, const mx::array& q) {
            const auto v = evaluated_vector<float>(q, mx::float32, "q: float32 [Hq, D]");
            if (!s.query_size_ok(v.size())) {
              throw nb::value_error("q must be float32 [Hq, D]");
            }
            return s.predict(layer, v.data());
          },
          "layer"_a, "q"_a,
          "Read ahead for the layer: choose its groups from a predicted query q [Hq, D] and "
          "start reading the missing ones (the I/O thread reads those not in the page "
          "cache); the next stage of that layer, still choosing from its own query, takes "
          "those it chose. False where nothing started (below predict_from, or failed).")
      .def_prop_rw(
          "predict_from", &KVSwapSet::predict_from,
          [](KVSwapSet& s, int layer) {
            if (layer < 1) {
              throw nb::value_error("predict_from: layer 0 cannot be predicted (>= 1)");
            }
            s.set_predict_from(layer);
          },
          "The first layer read ahead from a query predicted in the layer before (the "
          "number of layers: none); steps read ahead only while reads go to disk.")
      .def_prop_rw("read_ahead_always", &KVSwapSet::read_ahead_always,
                   &KVSwapSet::set_read_ahead_always,
                   "Read ahead from predict_from on whether or not reads go to disk (off: only "
                   "while they do; RWF_NOWAIT decides, and storage that serves a dropped page "
                   "within the call counts as cached).")
      .def_prop_ro(
          "reading_ahead", [](const KVSwapSet& s) { return s.predicts(s.predict_from()); },
          "Whether the next steps should read ahead (predict_from is set and a read went to "
          "disk lately).")
      .def("keys_to_file", &KVSwapSet::keys_to_file, "dir"_a, "capacity"_a,
           "Keep the low-rank keys in an unlinked temporary file in dir (the page cache's "
           "memory, not the process's), room for capacity evicted blocks; before set_layer.")
      .def_prop_ro("keys_in_file", &KVSwapSet::keys_in_file)
      .def_prop_rw("staging", &KVSwapSet::staging, &KVSwapSet::set_staging,
                   "The staging blocks' ids (a decoding row's table starts with them).")
      .def_prop_ro("stats", &kvswap_stats)
      .def_prop_ro("error", &KVSwapSet::error)
      .def_prop_ro("failed_block", &KVSwapSet::failed_block)
      .def_prop_ro("blocks", &KVSwapSet::blocks)
      .def_prop_ro("slots", &KVSwapSet::slots)
      .def_prop_rw("demand", &KVSwapSet::demand, &KVSwapSet::set_demand)
      .def_prop_ro("resident_bytes", &KVSwapSet::resident_bytes);
  m.def("kvswap_group_crcs", &kvswap_group_crcs, "arenas"_a, "layers"_a, "kv_heads"_a,
        "block_tokens"_a, "group"_a, "blocks"_a,
        "CRC-32C of each (block, layer, group) of the pool, as KVSwapSet checks its reads.");
  m.def("kvswap_stage", &agentkv::ops::kvswap_stage, "queries"_a, "keys"_a, "values"_a, "tables"_a,
        "swaps"_a, "rows"_a, "layer"_a,
        "Stage each swapped row's groups for this layer; returns the queries (NaN for a row "
        "whose reads failed), to feed the paged attention after it.");
}

NB_MODULE(_ext, m) {
  bind_kvswap(m);
  m.doc() =
      "agentkv native core: checksums, the mmap KV block loader, the block pool's I/O and "
      "fused attention.";

  // Held for the life of the process (never released at interpreter exit).
  static PyObject* cache_format_error =
      nb::object(nb::module_::import_("agentkv.errors").attr("CacheFormatError")).release().ptr();
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const agentkv::StoreError& e) {
      nb::object exc = nb::borrow(cache_format_error)(e.path(), e.reason());
      PyErr_SetObject(cache_format_error, exc.ptr());
    }
  });

  m.def(
      "forget_mappings",
      [](const std::vector<std::string>& paths) {
        for (const auto& path : paths) {
          agentkv::mapping_cache().forget(path);
        }
      },
      "paths"_a, "Drop cached mappings of segment files about to be deleted.");
  m.def(
      "clear_mappings", [] { agentkv::mapping_cache().clear(); },
      "Drop every cached segment mapping (the next loads map their files again).");
  m.def("kernel_paged_attention", &agentkv::kernels::paged_attention, "q"_a, "keys"_a, "values"_a,
        "tables"_a, "lengths"_a, "dims"_a, "sinks"_a = nb::none(), "scale"_a = 1.0f,
        "threads"_a = 2, "tail"_a = nb::none(), "tail_slots"_a = nb::none(), "vectors"_a = 4,
        "lanes_per_key"_a = 8, "done"_a = nb::none(), "done_first"_a = nb::none(),
        "softcap"_a = 0.0f, "keys_in_flight"_a = 1,
        "kernels/paged_attention.metal (then paged_attention_merge.metal) on CPU, each "
        "threadgroup's lanes as a loop (for tests against the others).");
  m.def("kernel_store_rows", &agentkv::kernels::store_rows, "keys"_a, "values"_a, "queries"_a,
        "dims"_a, "starts"_a, "rope"_a, "norm"_a, "eps"_a = 0.0f, "threads"_a = 2,
        "kernels/store_rows.metal on CPU with the kernel's inputs, each threadgroup's lanes as "
        "a loop: (H k float16, H v's words, scales, biases, the roped queries float32), as "
        "KV format 2 stores a step on a GPU (for tests).");
  m.def("kernel_dense_rows", &agentkv::kernels::dense_rows, "keys"_a, "values"_a, "tail"_a,
        "done"_a, "src"_a, "dims"_a, "scale"_a = 1.0f, "threads"_a = 2,
        "kernels/dense_rows.metal on CPU: the keys and values (float32) a prefill chunk's row "
        "sees, gathered from the arenas and dequantized as a GPU does it (for tests).");
  m.def("kernel_quantize_groups", &agentkv::kernels::quantize_groups, "x"_a, "bits"_a,
        "channel_tokens"_a,
        "kernels/quantize_groups.metal on CPU: whole channel groups of keys [..., G * ct, D] "
        "-> (words, scales, biases) as KV format 2 stores them (for tests).");
  m.def("kernel_merge", &agentkv::kernels::merge, "sources"_a, "rows"_a, "dims"_a, "threads"_a = 2,
        "kernels/merge.metal on CPU, for many outputs at once.");
  m.def("kernel_extract", &agentkv::kernels::extract, "batches"_a, "metas"_a, "threads"_a = 2,
        "kernels/extract.metal on CPU, for many outputs at once.");
  m.def("pack_quantized", &agentkv::ops::pack_quantized, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "MLX's affine weights (uint32 [N, K * bits / 32], scales and biases [N, K / group]) "
        "packed for quantized_matmul, losslessly: (codes uint8 [ceil(N / 16), K * 2 * bits], "
        "scales, biases [ceil(N / 16), K / group, 16]); padded columns are zeros.");
  m.def("pack_super_scales", &agentkv::ops::pack_super_scales, "packed"_a, "super"_a,
        "Packed float32 scales or biases (pack_quantized, groups of 32: [ceil(N / 16), K / 32, "
        "16]) and one float16 factor d a row and 256 K (super [N, K / 256]) -> two-level ones "
        "for quantized_matmul (uint8 [ceil(N / 16), K / 256, 160]: each value d * m, m an "
        "integer in 0 .. 255, bit for bit the same floats; llama.cpp's K-quant super-blocks). "
        "Raises ValueError where some value is not.");
  m.def("quantized_matmul", &agentkv::ops::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a,
        "x @ dequantize(w).T for MLX's affine 4/5/8-bit weights packed by agentkv.mlx_adapter "
        "(pack_quantized: 16 columns side by side; scales and biases as packed, or two-level "
        "from pack_super_scales) on CPU: int16 activations per 32, exact integer "
        "dot products "
        "(AVX-512 VNNI, AVX2, NEON or portable), every output reduced in one fixed order whatever "
        "the batch. Returns [..., N] with N = 16 * w.shape[0] (padded columns come out zero).");
  m.def("decoder_layer", &agentkv::ops::decoder_layer, "x"_a, "norms"_a, "eps"_a, "linears"_a,
        "bits"_a, "groups"_a, nb::kw_only(), "heads"_a, "kv_heads"_a, "attention_scale"_a,
        "rope_dims"_a, "rope_traditional"_a, "rope_base"_a, "rope_scale"_a, "rope_freqs"_a,
        "keys"_a, "values"_a, "tail"_a, "tables"_a, "lengths"_a, "tail_slots"_a, "rows"_a,
        "tail_rows"_a, "key_bits"_a, "value_bits"_a, "group"_a, "channel_tokens"_a,
        "block_tokens"_a, "window"_a, "rotate"_a, "linear_biases"_a, "qk_norms"_a, "qk_eps"_a,
        "positions"_a = nb::none(), "swaps"_a = std::vector<std::shared_ptr<agentkv::KVSwapSet>>{},
        "swap_rows"_a = std::vector<int>{}, "layer"_a = -1,
        "predict"_a = std::vector<std::optional<mx::array>>{}, "predict_bits"_a = 0,
        "predict_group"_a = 0, "key_plan"_a = nb::none(), "key_counts"_a = std::vector<int64_t>{},
        "prevs"_a = nb::none(), "swap_stream"_a = false,
        "One Llama-family decoder layer over the block pool as one CPU operation (the same "
        "bits as its separate operations); writes the step's keys and values in place. See "
        "csrc/ops.h. swap_stream: the one swapped row's prefill chunk, its attention exact "
        "over its evicted blocks read back chunk by chunk (docs/kvswap.md).");
  m.def("hadamard_rows", &agentkv::ops::hadamard, "x"_a, "scale"_a,
        "mx.hadamard_transform(x, scale)'s bits as one CPU operation, its rows over agentkv's "
        "thread pool: x float32 [..., n], n a power of two.");
  m.def("quantize_channels", &quantize_channels_op, "x"_a, "bits"_a,
        "Format 2's per-channel key quantization of one channel group from agentkv's CPU "
        "code (for tests): x float16 [tokens, dim] -> (words, scales, biases).");
  m.def("quantize_rows", &quantize_rows_op, "x"_a, "bits"_a, "group"_a,
        "mx.quantize's codes with float16 scales and biases from agentkv's CPU code (for "
        "tests): x float32 [..., dim] -> (words, scales, biases).");
  m.def("rms_norm", &agentkv::ops::rms_norm, "x"_a, "weight"_a, "eps"_a,
        "mx.fast.rms_norm's result as one CPU operation (float32), each row alone.");
  m.def("silu_mul", &agentkv::ops::silu_mul, "gate"_a, "up"_a,
        "silu(gate) * up (mlx-lm's swiglu) as one CPU operation (float32).");
  m.def("rope", &agentkv::ops::rope, "x"_a, "dims"_a, nb::kw_only(), "traditional"_a, "base"_a,
        "scale"_a, "offset"_a, "freqs"_a = nb::none(),
        "mx.fast.rope's rotary embedding as one CPU operation (float32); offset an int or an "
        "array of one start per batch row.");
  m.def("invariant_linear", &agentkv::ops::invariant_linear, "x"_a, "w"_a, "bias"_a = nb::none(),
        "x @ w.T (+ bias), float32 on CPU, with results independent of the batch.");
  m.def(
      "load_tensors", &load_tensors, "path"_a, "data_start"_a, "tensors"_a, "threads"_a = 2,
      "Tensors (offset, nbytes, shape, dtype, capacity rows) of a safetensors file as MLX arrays.");
  m.def("quantized_attention", &agentkv::ops::quantized_attention, "queries"_a, "keys"_a,
        "values"_a, "scale"_a, "key_bits"_a, "value_bits"_a, "group"_a, "window"_a = 0,
        "left_padding"_a = nb::none(), "sinks"_a = nb::none(), "channel_tokens"_a = 0,
        "tail"_a = nb::none(), "softcap"_a = 0.0f,
        "Fused attention over a quantized KV cache (CPU); see csrc/core/attention.h. "
        "channel_tokens > 0: per-channel keys (format 2), each row's group still filling in "
        "tail [B, Hkv, channel_tokens, D].");
  m.def("paged_attention", &agentkv::ops::paged_attention, "queries"_a, "keys"_a, "values"_a,
        "tables"_a, "lengths"_a, "kv_heads"_a, "block_tokens"_a, "scale"_a, "key_bits"_a,
        "value_bits"_a, "group"_a, "window"_a = 0, "sinks"_a = nb::none(), "channel_tokens"_a = 0,
        "tail"_a = nb::none(), "tail_slots"_a = nb::none(), "done"_a = nb::none(),
        "done_first"_a = nb::none(), "softcap"_a = 0.0f,
        "Fused attention over paged block arenas for a jagged batch (CPU); see "
        "csrc/core/attention.h. channel_tokens > 0: per-channel keys (format 2), the groups "
        "still filling in the float16 tail, slot tail_slots[b] per row; done: the groups the "
        "step completed, in float16, row b's from entry done_first[b] (-1: none).");
  m.def("uninitialized", &uninitialized, "rows"_a, "width"_a, "dtype"_a,
        "An arena [rows, width] whose pages are committed only as they are written.");
  m.def("read_regions", &read_regions, "arenas"_a, "layers"_a, "block_tokens"_a, "components"_a,
        "blocks"_a, "files"_a, "regions"_a, "threads"_a = 2,
        "Verify stored block regions (file, offset, length, checksum, tokens, slot) of files "
        "(path, size, header checksum, layout) and copy each into its pool slot.");
  m.def("pack_regions", &pack_regions, "arenas"_a, "layers"_a, "block_tokens"_a, "components"_a,
        "blocks"_a, "slots"_a, "tokens"_a, "layouts"_a, "threads"_a = 2,
        "Lay pool slots out as checksummed block regions for a block or segment file, each "
        "in its layout (0: planes, 1: groups of 64 tokens).");
  m.def("copy_slot_rows", &copy_slot_rows, "arenas"_a, "layers"_a, "block_tokens"_a, "components"_a,
        "blocks"_a, "src"_a, "dst"_a, "tokens"_a,
        "Copy the first tokens rows of one pool slot into another (every layer and head).");
  m.def("release_slot", &release_slot, "arenas"_a, "layers"_a, "block_tokens"_a, "components"_a,
        "blocks"_a, "slot"_a, "layer_mask"_a,
        "Hand a pool slot's pages back to the OS for the flagged layers; returns the bytes.");
  m.def(
      "data_address",
      [](mx::array a) {
        mx::eval(a);
        return reinterpret_cast<uintptr_t>(a.data<uint8_t>());
      },
      "array"_a, "Where an evaluated array's data lives (to notice buffers that moved).");
  m.def("build_info", &build_info,
        "Compiler, MLX and nanobind versions this extension was built with.");
  m.def("crc32c", &py_crc32c, "data"_a, "value"_a = 0,
        "CRC-32C of a bytes-like object (continue from value).");
  m.def("block_checksum", &py_block_checksum, "data"_a,
        "The striped CRC-32C agentkv stores per KV block.");
  m.def("gather_blocks", &gather_blocks, "layers"_a, "block_tokens"_a, "components"_a, "segments"_a,
        "blocks"_a, "tokens"_a, "spans"_a, "threads"_a = 2,
        "Load tokens [0, tokens) of stored KV blocks into new MLX arrays, verifying every read.");
}
