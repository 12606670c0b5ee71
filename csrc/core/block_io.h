// KV blocks in segment files <-> one contiguous buffer per layer and component.
//
// A block holds `tokens` (<= block_tokens) consecutive tokens of every layer.
// Its region inside a segment file is laid out layer-major, so one block is
// one sequential read and one checksum:
//
//   block region = for layer in [0, L):
//                    for comp in the layer's components:  e.g. k.w k.s k.b v.w v.s v.b
//                      [heads, tokens, row_bytes]
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
  uint64_t token_bytes() const;  // one token, every layer and component
  uint64_t block_bytes(uint64_t tokens) const {
    return tokens * token_bytes();
  }
  void validate() const;  // throws std::invalid_argument
};

struct LayerSpan {
  uint64_t first_token;  // multiple of block_tokens
  uint64_t capacity;     // rows of the in-memory buffer
};

struct SegmentRef {
  std::string path;
  uint64_t size;             // expected file size
  uint32_t header_checksum;  // crc32c of the safetensors JSON header bytes
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
