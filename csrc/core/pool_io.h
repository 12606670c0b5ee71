// KV block regions (see block_io.h) <-> the block pool's arenas.
//
// The pool keeps one arena per (layer, component): token rows of every block, per head,
// `block_tokens` rows apart:
//
//   arena[layer * components + comp] row ((slot * heads) + head) * block_tokens + t
//
// so one block of one (layer, component, head) is `block_tokens` consecutive rows, the same
// bytes a region holds for it (`tokens` rows). Everything here works on evaluated arenas
// between forward passes; nothing here allocates arenas or knows about MLX.
#pragma once

#include <cstdint>
#include <vector>

#include "block_io.h"

namespace agentkv {

struct RegionRef {
  uint32_t file;  // index into the files
  uint64_t offset;
  uint64_t length;
  uint32_t checksum;  // block_checksum of the region
  uint32_t tokens;    // 1..block_tokens
  uint32_t slot;      // pool block to copy it into
};

// Verifies every file (size, header length, header checksum) and every region (bounds,
// length for its tokens, checksum), copying each into rows [0, tokens) of its slot in every
// (layer, component, head). Throws StoreError naming the file on any mismatch; the slots'
// contents are then unspecified. `slots` bounds every slot index.
void read_regions(const Geometry& geometry, const std::vector<SegmentRef>& files,
                  const std::vector<RegionRef>& regions, const std::vector<uint8_t*>& arenas,
                  uint64_t slots, int threads);

// Lays rows [0, tokens[i]) of slots[i] out as consecutive regions in `out` (the sum of their
// block_bytes), each in layouts[i], returning where each went and its checksum.
std::vector<PackedBlock> pack_regions(const Geometry& geometry, const std::vector<uint32_t>& slots,
                                      const std::vector<uint32_t>& tokens,
                                      const std::vector<RegionLayout>& layouts,
                                      const std::vector<const uint8_t*>& arenas, uint8_t* out,
                                      int threads);

// Copies rows [0, tokens) of slot `src` to slot `dst` in every (layer, component, head).
void copy_slot_rows(const Geometry& geometry, const std::vector<uint8_t*>& arenas, uint32_t src,
                    uint32_t dst, uint32_t tokens);

// Hands the pages that lie wholly inside slot `slot` of the chosen layers back to the OS
// (madvise MADV_DONTNEED: they read as zeros and are committed again when written). Returns
// the bytes released.
uint64_t release_slot(const Geometry& geometry, const std::vector<uint8_t*>& arenas, uint32_t slot,
                      const std::vector<uint8_t>& layers);

}  // namespace agentkv
