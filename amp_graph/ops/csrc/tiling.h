// Index math and scale-update rule shared by the CUDA kernels (device), the torch binding (host)
// and the host self-test (tests/test_kernel_host.py builds host_selftest.cpp with g++ or nvcc).
//
// Everything here is plain integer / floating-point C++ marked __host__ __device__, so the part of
// the kernel that usually breaks (which thread touches which element) runs on every CI machine.
//
// Layout of one fused launch:
//   * every gradient of one dtype gets a row in a device-side table: {address, numel, first_tile};
//   * a tensor is split into a scalar head (elements before the first 16-byte boundary), a body of
//     16-byte vectors, and a scalar tail (fewer than one vector of elements);
//   * a large tensor's body is cut into tiles of kTileVecs vectors that it owns alone (the head
//     belongs to its first tile, the tail to its last), processed by a whole block;
//   * small tensors (one tile, cost <= kPackMaxCost) are packed, in table order, into shared tiles
//     whose total cost stays within kTileVecs; a block processes a shared tile one tensor per warp;
//   * blocks walk the tiles grid-stride (or, built with AMP_GRAPH_CONTIGUOUS_TILES=1, each block
//     a contiguous run of them: block_tiles); a block finds a tile's rows by binary search over
//     the table's first_tile column (non-decreasing; no per-launch limit on the number of tensors).
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define AG_HD __host__ __device__ __forceinline__
#else
#define AG_HD inline
#endif

namespace amp_graph {

// Tuning knobs, fixed at build time. The library builds with the defaults; only
// benchmarks/kernel_sweep.py compiles other values (into a harness of its own, never into the
// extension), to measure them.
#ifndef AMP_GRAPH_UNROLL
#define AMP_GRAPH_UNROLL 4
#endif
#ifndef AMP_GRAPH_TILE_VECS
#define AMP_GRAPH_TILE_VECS 2048
#endif
#ifndef AMP_GRAPH_CONTIGUOUS_TILES
#define AMP_GRAPH_CONTIGUOUS_TILES 0
#endif

constexpr int64_t kVecBytes = 16;        // one vectorized load or store
constexpr int kBlockThreads = 256;       // threads per block
constexpr int kWarpThreads = 32;         // threads per warp: one small tensor of a shared tile
constexpr int kWarps = kBlockThreads / kWarpThreads;
constexpr int kUnroll = AMP_GRAPH_UNROLL;  // vectors in flight per thread per loop iteration
constexpr int64_t kTileVecs = AMP_GRAPH_TILE_VECS;  // 16-byte vectors per tile (32 KiB)
constexpr int64_t kRowCost = 32;         // packing cost of a row beyond its vectors (its scalars,
                                         // its loop set-up), in vectors
constexpr int64_t kPackMaxCost = kTileVecs / 4;  // rows at most this costly share tiles
constexpr bool kContiguousTiles = AMP_GRAPH_CONTIGUOUS_TILES != 0;  // block_tiles' order

// One row of the device-side tensor table (three int64, 24 bytes).
struct TensorDesc {
  int64_t addr;        // address of element 0 (a dense tensor's lowest address)
  int64_t numel;
  int64_t first_tile;  // prefix sum of the tile counts of the rows before this one
};

// A tensor cut into scalar head, 16-byte vector body and scalar tail (all counts, in order).
struct Split {
  int64_t head;       // elements before the first 16-byte boundary
  int64_t body_vecs;  // whole 16-byte vectors after the head
  int64_t tail;       // elements after the body
};

// Work of one tile. Element indices are relative to the tensor's element 0; vector indices are
// relative to the body's first vector.
struct TileWork {
  int64_t vec_begin;   // body vectors [vec_begin, vec_end)
  int64_t vec_end;
  int64_t body_start;  // element index of the body's first element (== head)
  int64_t head_end;    // scalar elements [0, head_end): the head, on the first tile only
  int64_t tail_begin;  // scalar elements [tail_begin, tail_end): the tail, on the last tile only
  int64_t tail_end;
};

AG_HD Split split_tensor(int64_t addr, int64_t numel, int64_t elem_bytes) {
  Split s = {numel > 0 ? numel : 0, 0, 0};
  // Unvectorizable (odd element size or an address that is not element-aligned): all scalars.
  if (numel <= 0 || elem_bytes <= 0 || kVecBytes % elem_bytes != 0 || addr % elem_bytes != 0) {
    return s;
  }
  const int64_t misalign = addr % kVecBytes;
  const int64_t head = misalign == 0 ? 0 : (kVecBytes - misalign) / elem_bytes;
  if (head >= numel) return s;  // the tensor ends before the first 16-byte boundary
  const int64_t per_vec = kVecBytes / elem_bytes;
  s.head = head;
  s.body_vecs = (numel - head) / per_vec;
  s.tail = numel - head - s.body_vecs * per_vec;
  return s;
}

// Tiles owned by a tensor: 0 when empty, else max(1, ceil(body_vecs / kTileVecs)).
AG_HD int64_t num_tiles(int64_t addr, int64_t numel, int64_t elem_bytes) {
  if (numel <= 0) return 0;
  const Split s = split_tensor(addr, numel, elem_bytes);
  const int64_t tiles = (s.body_vecs + kTileVecs - 1) / kTileVecs;
  return tiles > 0 ? tiles : 1;
}

// Packing cost of a tensor (body vectors + kRowCost); packable: non-empty, cost <= kPackMaxCost.
AG_HD int64_t pack_cost(int64_t addr, int64_t numel, int64_t elem_bytes) {
  return split_tensor(addr, numel, elem_bytes).body_vecs + kRowCost;
}

AG_HD bool packable(int64_t addr, int64_t numel, int64_t elem_bytes) {
  return numel > 0 && pack_cost(addr, numel, elem_bytes) <= kPackMaxCost;  // hence one tile
}

// Fills rows[i].first_tile from rows[i].addr/numel and returns the total number of tiles.
// Large rows own num_tiles() tiles; consecutive packable rows share a tile while the sum of their
// costs stays within kTileVecs. first_tile never decreases along the table: an empty row takes the
// open shared tile (or the next tile when none is open) and owns no work.
AG_HD int64_t build_tile_table(TensorDesc* rows, int64_t n, int64_t elem_bytes) {
  int64_t total = 0;
  int64_t room = 0;  // cost still free in the open shared tile (tile total - 1); 0: none open
  for (int64_t i = 0; i < n; ++i) {
    const int64_t addr = rows[i].addr;
    const int64_t numel = rows[i].numel;
    if (numel <= 0) {
      rows[i].first_tile = room > 0 ? total - 1 : total;
      continue;
    }
    if (!packable(addr, numel, elem_bytes)) {
      rows[i].first_tile = total;
      total += num_tiles(addr, numel, elem_bytes);
      room = 0;
      continue;
    }
    const int64_t cost = pack_cost(addr, numel, elem_bytes);
    if (cost <= room) {
      rows[i].first_tile = total - 1;
      room -= cost;
    } else {
      rows[i].first_tile = total;
      total += 1;
      room = kTileVecs - cost;
    }
  }
  return total;
}

// Last row whose first_tile <= tile (the row owning `tile`, or the last row of a shared tile).
// Trailing empty rows with first_tile == total are never hit.
// Precondition: n >= 1 and 0 <= tile < total tiles.
AG_HD int64_t find_tensor(const TensorDesc* rows, int64_t n, int64_t tile) {
  int64_t lo = 0;
  int64_t hi = n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (rows[mid].first_tile <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// First row whose first_tile >= tile, searching rows [0, last]. With last = find_tensor(...):
// the first row of the tile when rows[last].first_tile == tile.
AG_HD int64_t first_row_at(const TensorDesc* rows, int64_t last, int64_t tile) {
  int64_t lo = 0;
  int64_t hi = last;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (rows[mid].first_tile < tile) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The rows a block processes for `tile`: [first, last]. One row (first == last): the whole block
// works on tile (tile - first_tile) of it. Several rows (all starting at `tile`): the whole block
// takes each row that is not packable (a large row after empty ones), and warp w takes the
// packable rows among first + w, first + w + kWarps, ..., each whole (local tile 0).
struct TileRows {
  int64_t first;
  int64_t last;
};

AG_HD TileRows tile_rows(const TensorDesc* rows, int64_t n, int64_t tile) {
  const int64_t last = find_tensor(rows, n, tile);
  if (rows[last].first_tile < tile) return {last, last};  // a later tile of a large row
  return {first_row_at(rows, last, tile), last};
}

// What tile `local_tile` (0-based, within its tensor) of a tensor processes.
AG_HD TileWork tile_work(int64_t addr, int64_t numel, int64_t elem_bytes, int64_t local_tile) {
  const Split s = split_tensor(addr, numel, elem_bytes);
  const int64_t tiles = num_tiles(addr, numel, elem_bytes);
  const int64_t per_vec = s.body_vecs > 0 ? kVecBytes / elem_bytes : 0;
  TileWork w;
  w.vec_begin = local_tile * kTileVecs;
  w.vec_end = w.vec_begin + kTileVecs < s.body_vecs ? w.vec_begin + kTileVecs : s.body_vecs;
  w.body_start = s.head;
  w.head_end = local_tile == 0 ? s.head : 0;
  w.tail_begin = s.head + s.body_vecs * per_vec;
  w.tail_end = local_tile == tiles - 1 ? w.tail_begin + s.tail : w.tail_begin;
  return w;
}

// Loop shape of `threads` threads (a block, or a warp) over a tile's body: iteration `it` of
// thread `tid` loads vectors vec_index(w, it, u, tid, threads) for u in [0, kUnroll) -- the ones
// below w.vec_end exist. Scalars: thread tid takes elements tid, tid + threads, ...
AG_HD int64_t vec_iterations(const TileWork& w, int threads) {
  const int64_t per_iter = static_cast<int64_t>(threads) * kUnroll;
  return (w.vec_end - w.vec_begin + per_iter - 1) / per_iter;
}

AG_HD int64_t vec_index(const TileWork& w, int64_t it, int u, int tid, int threads) {
  return w.vec_begin + (it * kUnroll + u) * threads + tid;
}

// Grid of a launch over total_tiles tiles when at most max_grid blocks fit on the device at once
// (multiprocessors x resident blocks per multiprocessor, from the occupancy calculator).
AG_HD int64_t grid_size(int64_t total_tiles, int64_t max_grid) {
  const int64_t cap = max_grid > 0 ? max_grid : 1;
  const int64_t grid = total_tiles < cap ? total_tiles : cap;
  return grid > 0 ? grid : 1;
}

// The tiles one block of a launch walks: tiles begin, begin + stride, ... below end.
//   grid-stride (contiguous == false): block, block + grid, ... -- neighbouring blocks read
//     neighbouring 32 KiB tiles at the same moment;
//   contiguous: the block's own run of floor-divided length, [block * total / grid,
//     (block + 1) * total / grid) -- each block streams one region of memory, and runs differ
//     by at most one tile.
// Either way the blocks of one launch cover every tile of [0, total) exactly once.
struct TileSpan {
  int64_t begin;
  int64_t end;
  int64_t stride;
};

AG_HD TileSpan block_tiles(int64_t block, int64_t grid, int64_t total, bool contiguous) {
  if (!contiguous) return {block, total, grid};
  return {block * total / grid, (block + 1) * total / grid, 1};
}

// Finiteness straight from the bits (immune to fast-math flags): all-ones exponent = inf or nan.
AG_HD bool fp32_bits_finite(uint32_t bits) { return (bits & 0x7f800000u) != 0x7f800000u; }
AG_HD bool fp16_bits_finite(uint16_t bits) { return (bits & 0x7c00u) != 0x7c00u; }
AG_HD bool bf16_bits_finite(uint16_t bits) { return (bits & 0x7f80u) != 0x7f80u; }

AG_HD uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

// Scaler state next to the scale: one int64 tensor with these slots.
enum Tracker : int {
  kGrowthTracker = 0,      // consecutive finite steps since the last growth or overflow
  kHysteresisTracker = 1,  // overflows still tolerated before backing off
  kSkippedSteps = 2,       // iterations with an overflow, ever
  kConsecutiveSkips = 3,   // iterations with an overflow, in a row
  kNumTrackers = 4,
};

struct ScaleParams {
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int64_t hysteresis;
  double min_scale;  // 0 for "no clamp"
  double max_scale;  // +inf for "no clamp"
};

// One update of the dynamic loss scale (amp_graph::update_scale_). With hysteresis == 1,
// min_scale == 0 and max_scale == inf this is torch._amp_update_scale_.
//   overflow: growth tracker = 0; hysteresis tracker -= 1 (floor 0); when it reaches 0 the scale
//             backs off to max(scale * backoff, min_scale), never above the old scale;
//   finite:   hysteresis tracker = hysteresis; growth tracker += 1; at growth_interval it resets
//             and the scale grows to min(scale * growth, max_scale), never below the old scale,
//             kept only if finite.
AG_HD void update_scale(float* scale, int64_t* trackers, bool found_inf, const ScaleParams& p) {
  const double s = static_cast<double>(*scale);
  if (found_inf) {
    trackers[kGrowthTracker] = 0;
    int64_t h = trackers[kHysteresisTracker] - 1;
    if (h < 0) h = 0;
    trackers[kHysteresisTracker] = h;
    if (h <= 0) {
      double b = s * p.backoff_factor;
      if (b < p.min_scale) b = p.min_scale;
      if (b > s) b = s;
      *scale = static_cast<float>(b);
    }
    trackers[kSkippedSteps] += 1;
    trackers[kConsecutiveSkips] += 1;
  } else {
    trackers[kHysteresisTracker] = p.hysteresis;
    int64_t g = trackers[kGrowthTracker] + 1;
    if (g >= p.growth_interval) {
      g = 0;
      double n = s * p.growth_factor;
      if (n > p.max_scale) n = p.max_scale;
      if (n < s) n = s;
      const float grown = static_cast<float>(n);
      if (fp32_bits_finite(float_to_bits(grown))) *scale = grown;
    }
    trackers[kGrowthTracker] = g;
    trackers[kConsecutiveSkips] = 0;
  }
}

}  // namespace amp_graph
