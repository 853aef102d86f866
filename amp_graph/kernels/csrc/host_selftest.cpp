// Host self-test of tiling.h, built with g++ or nvcc on CPU-only CI (tests/test_kernel_host.py).
//
//   host_selftest tiling   simulate whole launches (every tile, thread, loop iteration and unroll
//                          slot of the kernel) over many sizes, misalignments, element sizes and
//                          tables; every element must be visited exactly once, every vector access
//                          16-byte aligned and inside its tensor
//   host_selftest finite   bit-level finiteness tests vs std::isfinite on every fp16 and bf16
//                          pattern and on fp32 specials and random patterns
//   host_selftest update G B I H MIN MAX INIT FLAGS
//                          run amp_graph::update_scale over FLAGS ("0110...": 1 = overflow) and
//                          print one line per step: scale bits (hex) and the four trackers
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

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

// Simulates one launch over `rows` (first_tile filled here) exactly as check_unscale_kernel walks
// it, counting visits per element. Returns the number of elements checked.
int64_t simulate_launch(std::vector<TensorDesc>& rows, int64_t elem_bytes, int grid) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t total = amp_graph::build_tile_table(rows.data(), n, elem_bytes);
  std::vector<std::vector<uint8_t>> visits(rows.size());
  for (int64_t i = 0; i < n; ++i) visits[i].assign(static_cast<size_t>(rows[i].numel), 0);
  std::vector<uint8_t> tile_seen(static_cast<size_t>(total), 0);

  for (int block = 0; block < grid; ++block) {
    for (int64_t tile = block; tile < total; tile += grid) {
      tile_seen[tile] += 1;
      const int64_t row = amp_graph::find_tensor(rows.data(), n, tile);
      const TensorDesc& d = rows[row];
      if (d.numel <= 0 || tile < d.first_tile) fail("tile mapped to a wrong row", tile, row, 0);
      const int64_t local = tile - d.first_tile;
      if (local >= amp_graph::num_tiles(d.addr, d.numel, elem_bytes)) {
        fail("local tile past the tensor's tiles", tile, row, local);
        continue;
      }
      const amp_graph::TileWork w = amp_graph::tile_work(d.addr, d.numel, elem_bytes, local);
      const int64_t lanes = amp_graph::kVecBytes / elem_bytes;
      const int64_t iterations = amp_graph::vec_iterations(w);
      for (int tid = 0; tid < amp_graph::kBlockThreads; ++tid) {
        for (int64_t it = 0; it < iterations; ++it) {
          for (int u = 0; u < amp_graph::kUnroll; ++u) {
            const int64_t v = amp_graph::vec_index(w, it, u, tid);
            if (v >= w.vec_end) continue;
            if (v < w.vec_begin) fail("vector below the tile", tile, v, 0);
            const int64_t first = w.body_start + v * lanes;
            const int64_t byte_addr = d.addr + first * elem_bytes;
            if (byte_addr % amp_graph::kVecBytes != 0) fail("misaligned vector", row, first, 0);
            if (first < 0 || first + lanes > d.numel) {
              fail("vector out of bounds", row, first, d.numel);
              continue;
            }
            for (int64_t l = 0; l < lanes; ++l) visits[row][first + l] += 1;
          }
        }
        for (int64_t i = tid; i < w.head_end; i += amp_graph::kBlockThreads) {
          if (i >= d.numel) fail("head out of bounds", row, i, d.numel);
          else visits[row][i] += 1;
        }
        for (int64_t i = w.tail_begin + tid; i < w.tail_end; i += amp_graph::kBlockThreads) {
          if (i < 0 || i >= d.numel) fail("tail out of bounds", row, i, d.numel);
          else visits[row][i] += 1;
        }
      }
    }
  }
  for (int64_t t = 0; t < total; ++t) {
    if (tile_seen[t] != 1) fail("tile not run exactly once", t, tile_seen[t], 0);
  }
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
          std::vector<TensorDesc> rows = {{4096 + off, size, 0}};
          elements += simulate_launch(rows, es, grid);
          ++cases;
        }
      }
    }
  }

  // Big tables: thousands of tensors (empties included), random sizes and offsets.
  std::mt19937_64 rng(1234);
  for (int64_t es : {4, 2}) {
    for (int trial = 0; trial < 4; ++trial) {
      std::vector<TensorDesc> rows;
      int64_t addr = 1 << 20;
      const int n = trial == 0 ? 5000 : 700;
      for (int i = 0; i < n; ++i) {
        const int64_t kind = static_cast<int64_t>(rng() % 10);
        int64_t numel = kind == 0 ? 0 : kind < 7 ? static_cast<int64_t>(rng() % 64)
                                                 : static_cast<int64_t>(rng() % 40000);
        const int64_t off = static_cast<int64_t>(rng() % (amp_graph::kVecBytes / es)) * es;
        rows.push_back({addr + off, numel, 0});
        addr += ((off + numel * es) / 256 + 1) * 256;
      }
      if (trial == 1) rows.back().numel = 0;  // trailing empty rows
      if (trial == 2) rows.front().numel = 0;
      elements += simulate_launch(rows, es, trial == 3 ? 1 : 132 * amp_graph::kBlocksPerSm);
      ++cases;
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

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "tiling") return run_tiling();
  if (mode == "finite") return run_finite();
  if (mode == "update") return run_update(argc, argv);
  std::fprintf(stderr, "usage: host_selftest tiling|finite|update ...\n");
  return 2;
}
