// Host self-test of the kernel's host-side logic, built with g++ or nvcc on CPU-only CI
// (tests/test_kernel_host.py).
//
//   host_selftest tiling   simulate whole launches (every tile, block or warp, thread, loop
//                          iteration and unroll slot of the kernel) over many sizes,
//                          misalignments, element sizes and tables; every element must be visited
//                          exactly once, every vector access 16-byte aligned and inside its
//                          tensor; shared tiles hold only small rows within the cost budget
//   host_selftest packing  tables of many small tensors need few tiles (prints the counts)
//   host_selftest finite   bit-level finiteness tests vs std::isfinite on every fp16 and bf16
//                          pattern and on fp32 specials and random patterns
//   host_selftest cache    the device-table cache (table_cache.h) with a fake buffer: hits,
//                          misses, per-device keys, LRU eviction, pinned (captured) entries, and
//                          the chunks the table writer launches
//   host_selftest launch   the grid-limit cache (launch_cache.h) with a counting fake query
//   host_selftest plan     launch plans found by fingerprint (launch_plan.h) with fake tensors:
//                          a hit, a miss on each kind of change (count, address, dtype, size),
//                          lists the fingerprint cannot stand for, plans equal to per-call
//                          plans, and lists longer than one launch (three dtype groups, a
//                          table of several write launches)
//   host_selftest update G B I H MIN MAX INIT FLAGS
//                          run amp_graph::update_scale over FLAGS ("0110...": 1 = overflow) and
//                          print one line per step: scale bits (hex) and the four trackers
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "launch_cache.h"
#include "launch_plan.h"
#include "table_cache.h"
#include "tiling.h"

namespace {

using amp_graph::TensorDesc;

int g_failures = 0;

void fail(const char* what, int64_t a, int64_t b, int64_t c) {
  if (g_failures < 20) {
    std::fprintf(stderr, "FAIL %s (%lld, %lld, %lld)\n", what, static_cast<long long>(a),
                 static_cast<long long>(b), static_cast<long long>(c));
  }
  ++g_failures;
}

// Visits of the elements of one row by `threads` threads working on its tile `local`, exactly as
// check_unscale_kernel's process_row walks it.
void simulate_row(const TensorDesc& d, int64_t row, int64_t local, int64_t elem_bytes, int threads,
                  std::vector<uint8_t>& visits) {
  if (d.numel <= 0) return;
  if (local < 0 || local >= amp_graph::num_tiles(d.addr, d.numel, elem_bytes)) {
    fail("local tile outside the tensor's tiles", row, local, 0);
    return;
  }
  const amp_graph::TileWork w = amp_graph::tile_work(d.addr, d.numel, elem_bytes, local);
  const int64_t lanes = amp_graph::kVecBytes / elem_bytes;
  const int64_t iterations = amp_graph::vec_iterations(w, threads);
  for (int tid = 0; tid < threads; ++tid) {
    for (int64_t it = 0; it < iterations; ++it) {
      for (int u = 0; u < amp_graph::kUnroll; ++u) {
        const int64_t v = amp_graph::vec_index(w, it, u, tid, threads);
        if (v >= w.vec_end) continue;
        if (v < w.vec_begin) fail("vector below the tile", row, v, 0);
        const int64_t first = w.body_start + v * lanes;
        const int64_t byte_addr = d.addr + first * elem_bytes;
        if (byte_addr % amp_graph::kVecBytes != 0) fail("misaligned vector", row, first, 0);
        if (first < 0 || first + lanes > d.numel) {
          fail("vector out of bounds", row, first, d.numel);
          continue;
        }
        for (int64_t l = 0; l < lanes; ++l) visits[first + l] += 1;
      }
    }
    for (int64_t i = tid; i < w.head_end; i += threads) {
      if (i >= d.numel) fail("head out of bounds", row, i, d.numel);
      else visits[i] += 1;
    }
    for (int64_t i = w.tail_begin + tid; i < w.tail_end; i += threads) {
      if (i < 0 || i >= d.numel) fail("tail out of bounds", row, i, d.numel);
      else visits[i] += 1;
    }
  }
}

// Simulates one launch over `rows` (first_tile filled here) exactly as check_unscale_kernel walks
// it, its blocks' tiles in either order (block_tiles), counting visits per element. Returns the
// number of elements checked.
int64_t simulate_launch(std::vector<TensorDesc>& rows, int64_t elem_bytes, int grid,
                        bool contiguous) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t total = amp_graph::build_tile_table(rows.data(), n, elem_bytes);
  std::vector<std::vector<uint8_t>> visits(rows.size());
  for (int64_t i = 0; i < n; ++i) visits[i].assign(static_cast<size_t>(rows[i].numel), 0);
  std::vector<uint8_t> tile_seen(static_cast<size_t>(total), 0);
  for (int64_t i = 1; i < n; ++i) {
    if (rows[i].first_tile < rows[i - 1].first_tile) fail("first_tile decreases", i, 0, 0);
  }

  int64_t fewest = total;
  int64_t most = 0;
  for (int block = 0; block < grid; ++block) {
    const amp_graph::TileSpan span = amp_graph::block_tiles(block, grid, total, contiguous);
    int64_t tiles_of_block = 0;
    for (int64_t tile = span.begin; tile < span.end; tile += span.stride) ++tiles_of_block;
    fewest = std::min(fewest, tiles_of_block);
    most = std::max(most, tiles_of_block);
    for (int64_t tile = span.begin; tile < span.end; tile += span.stride) {
      if (tile < 0 || tile >= total) fail("tile out of range", block, tile, total);
      tile_seen[tile] += 1;
      const amp_graph::TileRows tr = amp_graph::tile_rows(rows.data(), n, tile);
      if (tr.first > tr.last || rows[tr.last].first_tile > tile) fail("bad rows", tile, 0, 0);
      if (tr.first == tr.last) {  // one row: the whole block
        const TensorDesc& d = rows[tr.last];
        if (d.numel <= 0) fail("a tile of an empty row only", tile, tr.last, 0);
        simulate_row(d, tr.last, tile - d.first_tile, elem_bytes, amp_graph::kBlockThreads,
                     visits[tr.last]);
        continue;
      }
      int64_t cost = 0;  // several rows: large ones by the block, small ones one per warp
      int64_t large = 0;
      int64_t nonempty = 0;
      for (int64_t r = tr.first; r <= tr.last; ++r) {
        const TensorDesc& d = rows[r];
        if (d.first_tile != tile) fail("row of a shared tile starts elsewhere", tile, r, 0);
        if (d.numel <= 0) continue;
        ++nonempty;
        if (amp_graph::packable(d.addr, d.numel, elem_bytes)) {
          cost += amp_graph::pack_cost(d.addr, d.numel, elem_bytes);
        } else {
          ++large;
          simulate_row(d, r, 0, elem_bytes, amp_graph::kBlockThreads, visits[r]);
        }
      }
      if (cost > amp_graph::kTileVecs) fail("shared tile over budget", tile, cost, 0);
      if (large > 0 && nonempty > 1) fail("large row shares its tile", tile, large, nonempty);
      for (int warp = 0; warp < amp_graph::kWarps; ++warp) {
        for (int64_t r = tr.first + warp; r <= tr.last; r += amp_graph::kWarps) {
          const TensorDesc& d = rows[r];
          if (amp_graph::packable(d.addr, d.numel, elem_bytes)) {
            simulate_row(d, r, 0, elem_bytes, amp_graph::kWarpThreads, visits[r]);
          }
        }
      }
    }
  }
  for (int64_t t = 0; t < total; ++t) {
    if (tile_seen[t] != 1) fail("tile not run exactly once", t, tile_seen[t], 0);
  }
  if (most - fewest > 1) fail("blocks' runs differ by more than one tile", grid, fewest, most);
  int64_t checked = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t e = 0; e < rows[i].numel; ++e) {
      if (visits[i][e] != 1) fail("element not visited exactly once", i, e, visits[i][e]);
    }
    checked += rows[i].numel;
  }
  return checked;
}

int run_tiling() {
  const int64_t tile_elems_fp32 = amp_graph::kTileVecs * 4;
  std::vector<int64_t> sizes;
  for (int64_t s = 0; s <= 40; ++s) sizes.push_back(s);
  for (int64_t base : {tile_elems_fp32 / 2, tile_elems_fp32, 2 * tile_elems_fp32,
                       4 * tile_elems_fp32}) {
    for (int64_t delta = -9; delta <= 9; ++delta) sizes.push_back(base + delta);
  }
  sizes.push_back(1000003);
  const int64_t elem_sizes[] = {4, 2, 1, 8, 3};
  int64_t cases = 0;
  int64_t elements = 0;

  // One tensor per launch: every size x every element offset from a 16-byte boundary (plus a
  // byte offset that is not element-aligned), three grid sizes.
  for (int64_t es : elem_sizes) {
    for (int64_t size : sizes) {
      for (int64_t off = 0; off <= amp_graph::kVecBytes; ++off) {
        if (off % es != 0 && off != 1) continue;
        for (int grid : {1, 3, 64}) {
          for (bool contiguous : {false, true}) {
            std::vector<TensorDesc> rows = {{4096 + off, size, 0}};
            elements += simulate_launch(rows, es, grid, contiguous);
            ++cases;
          }
        }
      }
    }
  }

  // Big tables: thousands of tensors (empties included), random sizes and offsets, with small
  // tensors in runs (shared tiles) between large ones.
  std::mt19937_64 rng(1234);
  for (int64_t es : {4, 2}) {
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<TensorDesc> rows;
      int64_t addr = 1 << 20;
      const int n = trial == 0 ? 5000 : 700;
      for (int i = 0; i < n; ++i) {
        const int64_t kind = static_cast<int64_t>(rng() % 10);
        int64_t numel = kind == 0   ? 0
                        : kind < 5  ? static_cast<int64_t>(rng() % 64)
                        : kind < 7  ? static_cast<int64_t>(rng() % 4000)
                        : trial == 4 ? static_cast<int64_t>(rng() % 2000)
                                     : static_cast<int64_t>(rng() % 40000);
        const int64_t off = static_cast<int64_t>(rng() % (amp_graph::kVecBytes / es)) * es;
        rows.push_back({addr + off, numel, 0});
        addr += ((off + numel * es) / 256 + 1) * 256;
      }
      if (trial == 1) rows.back().numel = 0;  // trailing empty rows
      if (trial == 2) rows.front().numel = 0;
      for (bool contiguous : {false, true}) {
        elements += simulate_launch(rows, es, trial == 3 ? 1 : 132 * 6, contiguous);
        ++cases;
      }
    }
  }
  if (g_failures != 0) {
    std::fprintf(stderr, "tiling: %d failures\n", g_failures);
    return 1;
  }
  std::printf("OK tiling cases=%lld elements=%lld\n", static_cast<long long>(cases),
              static_cast<long long>(elements));
  return 0;
}

// Many small tensors share tiles: far fewer tiles (block visits) than tensors.
int run_packing() {
  struct Case {
    int64_t count, numel, elem_bytes;
  };
  const Case cases[] = {{10000, 100, 4}, {10000, 1000, 2}, {10000, 1, 4}, {148, 768, 4}};
  for (const Case& c : cases) {
    std::vector<TensorDesc> rows;
    int64_t addr = 1 << 20;
    int64_t cost = 0;
    for (int64_t i = 0; i < c.count; ++i) {
      rows.push_back({addr, c.numel, 0});
      cost += amp_graph::pack_cost(addr, c.numel, c.elem_bytes);
      addr += (c.numel * c.elem_bytes / 256 + 1) * 256;
    }
    const int64_t tiles = amp_graph::build_tile_table(rows.data(), c.count, c.elem_bytes);
    // Greedy packing of equal rows wastes less than one row per tile.
    const int64_t per_tile = amp_graph::kTileVecs / (cost / c.count);
    const int64_t expected = (c.count + per_tile - 1) / per_tile;
    if (tiles != expected) fail("packing", c.count, tiles, expected);
    std::printf("packing %lld x %lld (%lld-byte): %lld tiles\n", static_cast<long long>(c.count),
                static_cast<long long>(c.numel), static_cast<long long>(c.elem_bytes),
                static_cast<long long>(tiles));
  }
  if (g_failures != 0) return 1;
  std::printf("OK packing\n");
  return 0;
}

// A buffer that counts how many of its kind are alive (the cache must free what it evicts).
struct FakeBuffer {
  static int alive;
  int id;
  explicit FakeBuffer(int i) : id(i) { ++alive; }
  FakeBuffer(const FakeBuffer& o) : id(o.id) { ++alive; }
  FakeBuffer(FakeBuffer&& o) noexcept : id(o.id) { ++alive; }
  ~FakeBuffer() { --alive; }
};
int FakeBuffer::alive = 0;

void expect(bool ok, const char* what) {
  if (!ok) fail(what, 0, 0, 0);
}

int run_cache() {
  {
    amp_graph::TableCache<FakeBuffer> cache(2);
    const std::vector<int64_t> a = {1, 4096, 10, 0}, b = {1, 8192, 10, 0}, c = {2, 4096, 7, 0};
    expect(cache.find(0, a) == nullptr, "empty cache hits");
    cache.insert(0, a, FakeBuffer(1), false);
    expect(cache.find(0, a) != nullptr && cache.find(0, a)->buffer.id == 1, "same rows: a hit");
    expect(cache.find(1, a) == nullptr, "another device: a miss");
    expect(cache.find(0, b) == nullptr, "another address: a miss");
    cache.insert(0, b, FakeBuffer(2), false);
    expect(cache.find(0, a)->buffer.id == 1, "a still cached");  // a is now most recent
    cache.insert(0, c, FakeBuffer(3), false);                     // evicts b, the LRU entry
    expect(cache.find(0, b) == nullptr, "LRU entry evicted");
    expect(cache.find(0, a) != nullptr && cache.find(0, c) != nullptr, "recent entries kept");
    expect(FakeBuffer::alive == 2 && cache.size() == 2, "evicted buffer freed");

    // Pinned entries (read by captured graphs) survive any number of later tables.
    cache.insert(5, {9, 9}, FakeBuffer(4), true);
    for (int i = 0; i < 10; ++i) cache.insert(0, {100 + i}, FakeBuffer(10 + i), false);
    expect(cache.find(5, {9, 9}) != nullptr, "pinned entry evicted");
    expect(cache.size() == 3 && FakeBuffer::alive == 3, "capacity of unpinned entries");
    expect(cache.find(0, {109})->buffer.id == 19, "newest entry kept");
    expect(cache.find(0, a) == nullptr, "old entries evicted");
  }
  expect(FakeBuffer::alive == 0, "buffers freed with the cache");

  // The table writer's chunks cover every word once, in order, each within the launch limit.
  for (int64_t count : {0, 1, 3999, 4000, 4001, 30000, 123457}) {
    for (int64_t per_launch : {500, 4000}) {
      int64_t next = 0;
      for (const auto& chunk : amp_graph::write_chunks(count, per_launch)) {
        expect(chunk.first == next && chunk.second > 0 && chunk.second <= per_launch, "chunk");
        next += chunk.second;
      }
      expect(next == count, "chunks cover the table");
    }
  }
  if (g_failures != 0) return 1;
  std::printf("OK cache\n");
  return 0;
}

struct CountingQuery {
  int* sm_calls;
  int* occupancy_calls;
  int sm_count(int device) {
    ++*sm_calls;
    return 100 + device;
  }
  int blocks_per_sm(int device, int dtype, int mode) {
    ++*occupancy_calls;
    return 1 + (device + dtype + mode) % 6;
  }
};

int run_launch() {
  int sm_calls = 0;
  int occupancy_calls = 0;
  amp_graph::LaunchCache<CountingQuery> cache(CountingQuery{&sm_calls, &occupancy_calls});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache] {
      for (int round = 0; round < 1000; ++round) {
        for (int device = 0; device < 2; ++device) {
          for (int dtype = 0; dtype < 3; ++dtype) {
            for (int mode = 0; mode < 3; ++mode) {
              const int64_t want = (100 + device) * (1 + (device + dtype + mode) % 6);
              if (cache.max_grid(device, dtype, mode) != want) fail("grid", device, dtype, mode);
            }
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  expect(sm_calls == 2, "multiprocessor count asked once per device");
  expect(occupancy_calls == 18, "occupancy asked once per (device, dtype, mode)");
  expect(amp_graph::grid_size(5, 264) == 5 && amp_graph::grid_size(100000, 264) == 264 &&
             amp_graph::grid_size(0, 264) == 1,
         "grid_size");
  if (g_failures != 0) return 1;
  std::printf("OK launch\n");
  return 0;
}

// Reference decoder for IEEE half (independent of the bit test under test).
float half_to_float_ref(uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1f;
  const int man = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man == 0 ? INFINITY : NAN;
  } else {
    v = std::ldexp(static_cast<float>(man + 1024), exp - 25);
  }
  return sign ? -v : v;
}

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

int run_finite() {
  int64_t checked = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<uint16_t>(b);
    if (amp_graph::fp16_bits_finite(h) != static_cast<bool>(std::isfinite(half_to_float_ref(h)))) {
      fail("fp16 finiteness", b, 0, 0);
    }
    if (amp_graph::bf16_bits_finite(h) != static_cast<bool>(std::isfinite(bits_to_float(b << 16)))) {
      fail("bf16 finiteness", b, 0, 0);
    }
    checked += 2;
  }
  std::mt19937 rng(99);
  std::vector<uint32_t> patterns = {0u,          0x80000000u, 0x7f800000u, 0xff800000u,
                                    0x7fc00000u, 0xffc00000u, 0x7f800001u, 0x7f7fffffu,
                                    0xff7fffffu, 0x00000001u, 0x807fffffu};
  for (int i = 0; i < 1000000; ++i) patterns.push_back(rng());
  for (uint32_t b : patterns) {
    if (amp_graph::fp32_bits_finite(b) != static_cast<bool>(std::isfinite(bits_to_float(b)))) {
      fail("fp32 finiteness", b, 0, 0);
    }
    if (amp_graph::float_to_bits(bits_to_float(b)) != b) fail("float_to_bits", b, 0, 0);
    ++checked;
  }
  if (g_failures != 0) return 1;
  std::printf("OK finite patterns=%lld\n", static_cast<long long>(checked));
  return 0;
}

int run_update(int argc, char** argv) {
  if (argc != 10) {
    std::fprintf(stderr, "usage: update G B INTERVAL HYSTERESIS MIN MAX INIT FLAGS\n");
    return 2;
  }
  const amp_graph::ScaleParams p = {std::strtod(argv[2], nullptr),
                                    std::strtod(argv[3], nullptr),
                                    std::strtoll(argv[4], nullptr, 10),
                                    std::strtoll(argv[5], nullptr, 10),
                                    std::strtod(argv[6], nullptr),
                                    std::strtod(argv[7], nullptr)};
  float scale = static_cast<float>(std::strtod(argv[8], nullptr));
  int64_t trackers[amp_graph::kNumTrackers] = {0, p.hysteresis, 0, 0};
  for (const char* c = argv[9]; *c != '\0'; ++c) {
    amp_graph::update_scale(&scale, trackers, *c == '1', p);
    std::printf("%08x %lld %lld %lld %lld\n", amp_graph::float_to_bits(scale),
                static_cast<long long>(trackers[0]), static_cast<long long>(trackers[1]),
                static_cast<long long>(trackers[2]), static_cast<long long>(trackers[3]));
  }
  return 0;
}

}  // namespace

// A fake gradient list: the facts the binding reads of each tensor.
using FakeList = std::vector<amp_graph::TensorFacts>;

std::vector<int64_t> key_of(const FakeList& list, bool* fingerprinted) {
  std::vector<int64_t> key = {123};  // stale contents: fingerprint() must overwrite them
  *fingerprinted = amp_graph::fingerprint(
      static_cast<int64_t>(list.size()), [&list](int64_t i) { return list[i]; }, key);
  return key;
}

// The plan the binding builds per call for a list (rows by dtype in list order, empties skipped).
amp_graph::LaunchPlan per_call_plan(const FakeList& list) {
  std::array<std::vector<TensorDesc>, amp_graph::kKernelDtypes> rows;
  for (const auto& f : list) {
    if (f.numel > 0) rows[f.code].push_back({f.addr, f.numel, 0});
  }
  return amp_graph::plan_from_rows(rows);
}

int run_plan() {
  // A model's gradients: three dtypes, one empty tensor, misaligned and large ones.
  FakeList base;
  int64_t addr = 1 << 20;
  for (int i = 0; i < 40; ++i) {
    const int code = i % 3;
    const int64_t numel = i == 7 ? 0 : (i == 11 ? 3000000 : 17 + 31 * i);
    base.push_back({addr + (i == 5 ? 2 : 0), numel, code, true});
    addr += 4 * (numel + 64);
  }
  bool fp = false;
  const std::vector<int64_t> key = key_of(base, &fp);
  expect(fp, "a dense list of kernel dtypes is fingerprinted");
  expect(key.size() == 2 + 3 * base.size() && key[0] == amp_graph::kFingerprintTag &&
             key[1] == static_cast<int64_t>(base.size()),
         "fingerprint layout");

  // The plan found by fingerprint is the plan a per-call build gives.
  const amp_graph::LaunchPlan plan = amp_graph::plan_from_fingerprint(key);
  const amp_graph::LaunchPlan direct = per_call_plan(base);
  expect(plan.table == direct.table && plan.rows == direct.rows && plan.tiles == direct.tiles,
         "fingerprint plan equals the per-call plan");
  // 40 tensors by i % 3: 14 fp32, 13 fp16 less the empty one (i == 7), 13 bf16
  expect(plan.rows[0] == 14 && plan.rows[1] == 12 && plan.rows[2] == 13, "rows per dtype");
  expect(plan.table[0] == 14 && plan.table[1] == 12 && plan.table.size() == 3 + 3 * 39,
         "table header and rows");

  amp_graph::TableCache<FakeBuffer> cache(8);
  cache.insert(0, key, FakeBuffer(1), false);
  expect(cache.find(0, key_of(base, &fp)) != nullptr, "the same list: a hit");

  // Every kind of change misses; changing it back hits again.
  struct Change {
    const char* what;
    void (*apply)(FakeList&);
  };
  const Change changes[] = {
      {"count: one more tensor", [](FakeList& l) { l.push_back({1 << 30, 5, 0, true}); }},
      {"count: one fewer tensor", [](FakeList& l) { l.pop_back(); }},
      {"address", [](FakeList& l) { l[20].addr += 16; }},
      {"address of a tensor whose size stays", [](FakeList& l) { l[0].addr += 4096; }},
      {"dtype", [](FakeList& l) { l[3].code = 2; }},
      {"size", [](FakeList& l) { l[9].numel += 1; }},
      {"an empty tensor filled", [](FakeList& l) { l[7].numel = 8; }},
      {"order", [](FakeList& l) { std::swap(l[1], l[2]); }},
  };
  for (const Change& change : changes) {
    FakeList changed = base;
    change.apply(changed);
    const std::vector<int64_t> other = key_of(changed, &fp);
    if (!fp || cache.find(0, other) != nullptr) fail(change.what, 0, 0, 0);
    const amp_graph::LaunchPlan rebuilt = amp_graph::plan_from_fingerprint(other);
    if (rebuilt.table != per_call_plan(changed).table) fail(change.what, 1, 0, 0);
  }
  expect(cache.find(0, key_of(base, &fp)) != nullptr, "the original list still hits");
  expect(cache.find(1, key) == nullptr, "another device misses");

  // Lists the fingerprint cannot stand for: a non-dense tensor, a dtype the kernel lacks.
  FakeList strided = base;
  strided[4].dense = false;
  key_of(strided, &fp);
  expect(!fp, "a non-dense tensor is not fingerprinted");
  FakeList float64 = base;
  float64[6].code = -1;
  key_of(float64, &fp);
  expect(!fp, "another dtype is not fingerprinted");
  FakeList empty_strided = base;
  empty_strided[7].dense = false;  // empty: nothing to copy, still fingerprinted
  key_of(empty_strided, &fp);
  expect(fp, "an empty non-dense tensor is fingerprinted");
  key_of(FakeList{}, &fp);
  expect(fp, "an empty list is fingerprinted");

  // A list longer than one launch: 3000 tensors in three dtype groups (three kernel launches)
  // whose table takes several write launches.
  FakeList many;
  for (int i = 0; i < 3000; ++i) many.push_back({(1 << 24) + 4096 * i, 1 + i % 700, i % 3, true});
  const std::vector<int64_t> many_key = key_of(many, &fp);
  const amp_graph::LaunchPlan many_plan = amp_graph::plan_from_fingerprint(many_key);
  expect(fp && many_plan.table == per_call_plan(many).table, "long list: same plan");
  expect(many_plan.rows[0] == 1000 && many_plan.rows[1] == 1000 && many_plan.rows[2] == 1000,
         "long list: three launches of 1000 rows");
  expect(amp_graph::write_chunks(static_cast<int64_t>(many_plan.table.size()), 4000).size() == 3,
         "long list: its table takes three write launches");
  cache.insert(0, many_key, FakeBuffer(2), false);
  FakeList many_changed = many;
  many_changed[2999].numel += 1;  // the last tensor of the last launch
  expect(cache.find(0, key_of(many, &fp)) != nullptr, "long list: a hit");
  expect(cache.find(0, key_of(many_changed, &fp)) == nullptr, "long list: its last tensor");
  if (g_failures != 0) return 1;
  std::printf("OK plan\n");
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "tiling") return run_tiling();
  if (mode == "packing") return run_packing();
  if (mode == "finite") return run_finite();
  if (mode == "cache") return run_cache();
  if (mode == "launch") return run_launch();
  if (mode == "plan") return run_plan();
  if (mode == "update") return run_update(argc, argv);
  std::fprintf(stderr,
               "usage: host_selftest tiling|packing|finite|cache|launch|plan|update ...\n");
  return 2;
}
