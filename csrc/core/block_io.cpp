#include "block_io.h"

#include <cstring>
#include <memory>
#include <stdexcept>

#include "checksum.h"
#include "mapped_file.h"
#include "mapping_cache.h"
#include "parallel.h"
#include "store_error.h"

namespace agentkv {
namespace {

uint64_t ceil_div(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}

void check_spans(const Geometry& g, const std::vector<LayerSpan>& spans, uint64_t end_token,
                 size_t buffers) {
  if (spans.size() != g.layers) {
    throw std::invalid_argument("need one LayerSpan per layer");
  }
  if (buffers != g.components.size()) {
    throw std::invalid_argument("need one buffer per layer and component");
  }
  for (uint32_t l = 0; l < g.layers; ++l) {
    const auto& s = spans[l];
    if (s.first_token % g.block_tokens != 0) {
      throw std::invalid_argument("a layer's first token must start a block");
    }
    if (end_token > s.first_token && end_token - s.first_token > s.capacity) {
      throw std::invalid_argument("layer " + std::to_string(l) + " needs " +
                                  std::to_string(end_token - s.first_token) +
                                  " rows but has capacity " + std::to_string(s.capacity));
    }
  }
}

}  // namespace

// A safetensors header longer than this is not one agentkv wrote.
constexpr uint64_t kMaxHeaderBytes = 64ull << 20;

uint64_t verify_segment(const MappedFile& file, const SegmentRef& ref) {
  if (file.size() != ref.size) {
    throw StoreError(ref.path, "file is " + std::to_string(file.size()) +
                                   " bytes, the manifest says " + std::to_string(ref.size) +
                                   " (truncated or replaced)");
  }
  if (file.size() < 8) {
    throw StoreError(ref.path, "file is shorter than a safetensors header");
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, file.data(), 8);
  if (header_len < 2 || header_len > kMaxHeaderBytes || header_len > file.size() - 8) {
    throw StoreError(ref.path, "header length " + std::to_string(header_len) + " is not sane");
  }
  if (crc32c(file.data() + 8, header_len) != ref.header_checksum) {
    throw StoreError(ref.path, "header checksum mismatch");
  }
  return 8 + header_len;
}

uint64_t Geometry::token_bytes() const {
  uint64_t total = 0;
  for (const auto& c : components) {
    total += static_cast<uint64_t>(c.heads) * c.row_bytes;
  }
  return total;
}

uint64_t Geometry::layer_token_bytes(uint32_t layer) const {
  uint64_t total = 0;
  for (uint32_t c = 0; c < per_layer; ++c) {
    total += static_cast<uint64_t>(component(layer, c).heads) * component(layer, c).row_bytes;
  }
  return total;
}

void Geometry::validate() const {
  if (layers == 0 || block_tokens == 0 || per_layer == 0 ||
      components.size() != static_cast<size_t>(layers) * per_layer) {
    throw std::invalid_argument("geometry needs layers, block tokens and components per layer");
  }
  for (const auto& c : components) {
    if (c.heads == 0 || c.row_bytes == 0) {
      throw std::invalid_argument("every component needs heads and row bytes");
    }
  }
}

void gather_blocks(const Geometry& g, const std::vector<SegmentRef>& segments,
                   const std::vector<BlockRef>& blocks, uint64_t tokens,
                   const std::vector<LayerSpan>& spans, const std::vector<uint8_t*>& dst,
                   int threads) {
  g.validate();
  check_spans(g, spans, tokens, dst.size());
  const uint64_t needed = ceil_div(tokens, g.block_tokens);
  if (needed == 0) {
    return;
  }
  if (needed > blocks.size()) {
    throw std::invalid_argument("the block list covers fewer tokens than requested");
  }
  std::vector<char> used(segments.size(), 0);
  for (uint64_t i = 0; i < needed; ++i) {
    if (blocks[i].segment >= segments.size()) {
      throw std::invalid_argument("block refers to a segment that does not exist");
    }
    used[blocks[i].segment] = 1;
  }
  const BlockRef& tail = blocks[needed - 1];
  if ((needed - 1) * g.block_tokens + tail.tokens < tokens) {
    throw std::invalid_argument("the blocks hold fewer tokens than requested");
  }
  std::vector<std::shared_ptr<const MappedFile>> files(segments.size());
  std::vector<uint64_t> data_start(segments.size(), 0);
  for (size_t s = 0; s < segments.size(); ++s) {
    if (used[s]) {
      files[s] = mapping_cache().open(segments[s].path);
      data_start[s] = verify_segment(*files[s], segments[s]);
    }
  }

  const size_t ncomp = g.per_layer;
  parallel_for(needed, threads, [&](size_t i) {
    const BlockRef& b = blocks[i];
    const MappedFile& file = *files[b.segment];
    const std::string& path = segments[b.segment].path;
    const uint64_t t0 = i * g.block_tokens;
    const bool last = i + 1 == blocks.size();
    if (b.tokens == 0 || b.tokens > g.block_tokens || (!last && b.tokens != g.block_tokens)) {
      throw StoreError(path, "block " + std::to_string(i) + " has a bad token count");
    }
    if (b.length != g.block_bytes(b.tokens)) {
      throw StoreError(path, "block " + std::to_string(i) + " has the wrong length");
    }
    if (b.offset < data_start[b.segment] || b.offset > file.size() ||
        b.length > file.size() - b.offset) {
      throw StoreError(path, "block " + std::to_string(i) + " lies outside the file");
    }
    // Copy each run of rows, then checksum it while it is in L1: the runs are the region in
    // order, so this is the region's checksum.
    const uint8_t* src = file.data() + b.offset;
    const uint64_t n = std::min<uint64_t>(b.tokens, tokens - t0);
    const RegionLayout layout = segments[b.segment].layout;
    BlockChecksum sum;
    for_each_run(g, b.tokens, layout,
                 [&](uint32_t l, uint32_t c, uint32_t h, uint64_t first, uint64_t rows) {
                   const LayerSpan& span = spans[l];
                   const ComponentSpec& comp = g.component(l, c);
                   const uint64_t bytes = rows * comp.row_bytes;
                   if (t0 >= span.first_token && first < n) {
                     uint8_t* out = dst[l * ncomp + c];
                     const uint64_t take = std::min(rows, n - first);
                     std::memcpy(out + (h * span.capacity + (t0 - span.first_token) + first) *
                                           comp.row_bytes,
                                 src, take * comp.row_bytes);
                   }
                   sum.update(src, bytes);
                   src += bytes;
                 });
    if (sum.finish() != b.checksum) {
      throw StoreError(path, "block " + std::to_string(i) + " checksum mismatch");
    }
  });
}

}  // namespace agentkv
