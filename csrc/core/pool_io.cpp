#include "pool_io.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "checksum.h"
#include "mapped_file.h"
#include "mapping_cache.h"
#include "parallel.h"
#include "store_error.h"

namespace agentkv {
namespace {

// Byte offset of row 0 of (slot, head) in an arena of this component.
uint64_t slot_offset(const Geometry& g, const ComponentSpec& comp, uint64_t slot, uint32_t head) {
  return ((slot * comp.heads) + head) * g.block_tokens * comp.row_bytes;
}

void check_arenas(const Geometry& g, size_t arenas) {
  g.validate();
  if (arenas != static_cast<size_t>(g.layers) * g.per_layer) {
    throw std::invalid_argument("need one arena per layer and component");
  }
}

}  // namespace

void read_regions(const Geometry& g, const std::vector<SegmentRef>& files,
                  const std::vector<RegionRef>& regions, const std::vector<uint8_t*>& arenas,
                  uint64_t slots, int threads) {
  check_arenas(g, arenas.size());
  std::vector<char> used(files.size(), 0);
  for (const RegionRef& r : regions) {
    if (r.file >= files.size() || r.slot >= slots) {
      throw std::invalid_argument("a region names a file or slot that does not exist");
    }
    used[r.file] = 1;
  }
  std::vector<std::shared_ptr<const MappedFile>> mapped(files.size());
  std::vector<uint64_t> data_start(files.size(), 0);
  for (size_t f = 0; f < files.size(); ++f) {
    if (used[f]) {
      mapped[f] = mapping_cache().open(files[f].path);
      data_start[f] = verify_segment(*mapped[f], files[f]);
    }
  }
  const size_t ncomp = g.per_layer;
  parallel_for(regions.size(), threads, [&](size_t i) {
    const RegionRef& r = regions[i];
    const MappedFile& file = *mapped[r.file];
    const std::string& path = files[r.file].path;
    if (r.tokens == 0 || r.tokens > g.block_tokens || r.length != g.block_bytes(r.tokens)) {
      throw StoreError(path, "block region " + std::to_string(i) + " has a bad size");
    }
    if (r.offset < data_start[r.file] || r.offset > file.size() ||
        r.length > file.size() - r.offset) {
      throw StoreError(path, "block region " + std::to_string(i) + " lies outside the file");
    }
    // Copy each run of rows, checksumming it while it is in L1: the runs are the region in
    // order, so this is the region's checksum.
    const uint8_t* src = file.data() + r.offset;
    BlockChecksum sum;
    for_each_run(g, r.tokens, files[r.file].layout,
                 [&](uint32_t l, uint32_t c, uint32_t h, uint64_t first, uint64_t rows) {
                   const ComponentSpec& comp = g.component(l, c);
                   const uint64_t bytes = rows * comp.row_bytes;
                   std::memcpy(arenas[l * ncomp + c] + slot_offset(g, comp, r.slot, h) +
                                   first * comp.row_bytes,
                               src, bytes);
                   sum.update(src, bytes);
                   src += bytes;
                 });
    if (sum.finish() != r.checksum) {
      throw StoreError(path, "block region " + std::to_string(i) + " checksum mismatch");
    }
  });
}

std::vector<PackedBlock> pack_regions(const Geometry& g, const std::vector<uint32_t>& slots,
                                      const std::vector<uint32_t>& tokens,
                                      const std::vector<RegionLayout>& layouts,
                                      const std::vector<const uint8_t*>& arenas, uint8_t* out,
                                      int threads) {
  check_arenas(g, arenas.size());
  if (slots.size() != tokens.size() || slots.size() != layouts.size()) {
    throw std::invalid_argument("need a token count and a layout per slot");
  }
  std::vector<PackedBlock> packed(slots.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (tokens[i] == 0 || tokens[i] > g.block_tokens) {
      throw std::invalid_argument("a packed block holds 1..block_tokens tokens");
    }
    packed[i] = PackedBlock{offset, g.block_bytes(tokens[i]), 0, tokens[i]};
    offset += packed[i].length;
  }
  const size_t ncomp = g.per_layer;
  parallel_for(slots.size(), threads, [&](size_t i) {
    PackedBlock& p = packed[i];
    uint8_t* dst = out + p.offset;
    for_each_run(g, p.tokens, layouts[i],
                 [&](uint32_t l, uint32_t c, uint32_t h, uint64_t first, uint64_t rows) {
                   const ComponentSpec& comp = g.component(l, c);
                   const uint64_t bytes = rows * comp.row_bytes;
                   std::memcpy(dst,
                               arenas[l * ncomp + c] + slot_offset(g, comp, slots[i], h) +
                                   first * comp.row_bytes,
                               bytes);
                   dst += bytes;
                 });
    p.checksum = block_checksum(out + p.offset, p.length);
  });
  return packed;
}

void copy_slot_rows(const Geometry& g, const std::vector<uint8_t*>& arenas, uint32_t src,
                    uint32_t dst, uint32_t tokens) {
  check_arenas(g, arenas.size());
  if (tokens > g.block_tokens) {
    throw std::invalid_argument("cannot copy more rows than a block holds");
  }
  if (src == dst || tokens == 0) {
    return;
  }
  const size_t ncomp = g.per_layer;
  for (uint32_t l = 0; l < g.layers; ++l) {
    for (size_t c = 0; c < ncomp; ++c) {
      const ComponentSpec& comp = g.component(l, c);
      uint8_t* arena = arenas[l * ncomp + c];
      for (uint32_t h = 0; h < comp.heads; ++h) {
        std::memcpy(arena + slot_offset(g, comp, dst, h), arena + slot_offset(g, comp, src, h),
                    static_cast<uint64_t>(tokens) * comp.row_bytes);
      }
    }
  }
}

uint64_t release_slot(const Geometry& g, const std::vector<uint8_t*>& arenas, uint32_t slot,
                      const std::vector<uint8_t>& layers) {
  check_arenas(g, arenas.size());
  if (layers.size() != g.layers) {
    throw std::invalid_argument("need one flag per layer");
  }
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const size_t ncomp = g.per_layer;
  uint64_t released = 0;
  for (uint32_t l = 0; l < g.layers; ++l) {
    if (!layers[l]) {
      continue;
    }
    for (size_t c = 0; c < ncomp; ++c) {
      const ComponentSpec& comp = g.component(l, c);
      const auto base = reinterpret_cast<uintptr_t>(arenas[l * ncomp + c]);
      const uint64_t begin = base + slot_offset(g, comp, slot, 0);
      const uint64_t end =
          begin + static_cast<uint64_t>(comp.heads) * g.block_tokens * comp.row_bytes;
      const uint64_t first = (begin + page - 1) / page * page;
      const uint64_t last = end / page * page;
      if (last > first &&
          madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) == 0) {
        released += last - first;
      }
    }
  }
  return released;
}

}  // namespace agentkv
