// KV blocks in segment files <-> one contiguous buffer per layer and component.
//
// A block holds `tokens` (<= block_tokens) consecutive tokens of every layer.
// Its region inside a file is laid out layer-major, so one block is one
// sequential read and one checksum (over its bytes as stored), in one of two
// layouts (RegionLayout; the file's name says which):
//
//   planes (segments; block files of store versions 1-2):
//     for layer in [0, L):
//       for comp in the layer's components:        e.g. k.w k.s k.b v.w v.s v.b
//         [heads, tokens, row_bytes]
//   groups (block files of store version 3):
//     for layer in [0, L):
//       for group of kGroupTokens tokens:          one extent per (layer, group):
//         for comp: [heads, group rows, row_bytes]  what KVSwap reads with one pread
//
// gather_blocks loads them into one buffer per (layer, component) [heads, capacity,
// row_bytes] (the layout of an mlx-lm cache array [1, heads, capacity, width]) whose row 0
// holds token `first_token` of that layer: 0, or where a sliding window starts. The block
// pool reads and packs regions through pool_io.h instead.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace agentkv {

// How a region lays out its (layer, component, head) rows; see the top of this file.
enum class RegionLayout : uint32_t { kPlanes = 0, kGroups = 1 };

// Tokens per extent of the groups layout: format 2's channel group, KVSwap's unit.
constexpr uint32_t kGroupTokens = 64;

struct ComponentSpec {
  uint32_t heads;
  uint32_t row_bytes;  // bytes per token per head
};

// Every layer has the same number of components (`per_layer`, in region order); their
// widths may differ by layer (8-bit keys in a format's wide layers).
struct Geometry {
  uint32_t layers;
  uint32_t block_tokens;
  uint32_t per_layer;
  std::vector<ComponentSpec> components;  // [layer * per_layer + comp]

  const ComponentSpec& component(uint32_t layer, size_t comp) const {
    return components[layer * per_layer + comp];
  }
  uint64_t token_bytes() const;                      // one token, every layer and component
  uint64_t layer_token_bytes(uint32_t layer) const;  // one token of one layer
  uint64_t block_bytes(uint64_t tokens) const {
    return tokens * token_bytes();
  }
  void validate() const;  // throws std::invalid_argument
};

// Calls fn(layer, comp, head, first_row, rows) for each run of rows of a region of `tokens`
// tokens, in file order: the runs are consecutive in the file, each rows * row_bytes long.
template <typename Fn>
void for_each_run(const Geometry& g, uint64_t tokens, RegionLayout layout, Fn&& fn) {
  const uint64_t span = layout == RegionLayout::kGroups ? kGroupTokens : tokens;
  for (uint32_t l = 0; l < g.layers; ++l) {
    for (uint64_t first = 0; first < tokens; first += span) {
      const uint64_t rows = tokens - first < span ? tokens - first : span;
      for (uint32_t c = 0; c < g.per_layer; ++c) {
        for (uint32_t h = 0; h < g.component(l, c).heads; ++h) {
          fn(l, c, h, first, rows);
        }
      }
    }
  }
}

struct LayerSpan {
  uint64_t first_token;  // multiple of block_tokens
  uint64_t capacity;     // rows of the in-memory buffer
};

struct SegmentRef {
  std::string path;
  uint64_t size;                                // expected file size
  uint32_t header_checksum;                     // crc32c of the safetensors JSON header bytes
  RegionLayout layout = RegionLayout::kPlanes;  // of every region in the file
};

class MappedFile;

// Checks a mapped segment against its reference (size, header length, header checksum) and
// returns the first byte after its JSON header; throws StoreError naming the file.
uint64_t verify_segment(const MappedFile& file, const SegmentRef& ref);

struct BlockRef {
  uint32_t segment;
  uint64_t offset;  // of the region in the file
  uint64_t length;
  uint32_t checksum;  // block_checksum of the region
  uint32_t tokens;
};

// Verifies every segment (size, header length, header checksum) and every block
// it reads (bounds, length, checksum), then copies tokens [span.first_token,
// tokens) of each layer into dst[layer * components + comp]. Throws StoreError
// naming the file on any mismatch; dst contents are then unspecified.
void gather_blocks(const Geometry& geometry, const std::vector<SegmentRef>& segments,
                   const std::vector<BlockRef>& blocks, uint64_t tokens,
                   const std::vector<LayerSpan>& spans, const std::vector<uint8_t*>& dst,
                   int threads);

struct PackedBlock {
  uint64_t offset;  // within the packed buffer
  uint64_t length;
  uint32_t checksum;
  uint32_t tokens;
};

}  // namespace agentkv
