// Launch plans of the fused kernel, found by a fingerprint of the gradient list (plain C++: the
// host self-test runs it with fake tensors).
//
// A Graph's gradients, and a loop's with zero_grad(set_to_none=False), are the same tensors at
// the same addresses every step. A call's fingerprint -- the list's length, then each tensor's
// address, element count and dtype, in order -- fixes everything a launch needs: which tensors
// each dtype's kernel takes, their tiles, and the device table. The binding therefore looks the
// fingerprint up in its table cache (table_cache.h) and builds a plan only on a miss; a hit costs
// one pass that reads three facts per tensor, and one comparison of the words.
//
// A list the fingerprint cannot stand for (a non-dense tensor, processed through a temporary
// copy whose address changes; a dtype the kernel lacks) is not fingerprinted: the binding builds
// its plan on every call and keys the table by the table's content, as before plans existed.
#pragma once

#include <stdint.h>

#include <array>
#include <vector>

#include "tiling.h"

namespace amp_graph {

constexpr int kKernelDtypes = 3;         // AMP_GRAPH_FP32, AMP_GRAPH_FP16, AMP_GRAPH_BF16
constexpr int64_t kFingerprintTag = -1;  // word 0 of a fingerprint key; a content key's is >= 0
constexpr int64_t kTableHeaderWords = kKernelDtypes;  // a table starts with its rows per dtype

// What a fingerprint records of one tensor. code: the kernel's dtype code (0 fp32, 1 fp16,
// 2 bf16) or -1 for a dtype torch's ops handle; dense: one span of memory starting at addr.
struct TensorFacts {
  int64_t addr;
  int64_t numel;
  int code;
  bool dense;
};

inline int64_t code_elem_bytes(int code) { return code == 0 ? 4 : 2; }

// Writes the fingerprint of the n tensors facts_at(0), ..., facts_at(n - 1) into key:
// [kFingerprintTag, n, then addr, numel, code of each tensor]. Returns false, leaving key
// unspecified, when the list needs a plan per call (see the top of this file); an empty tensor
// never does. facts_at may throw (the binding validates each tensor there).
template <class FactsAt>
bool fingerprint(int64_t n, FactsAt&& facts_at, std::vector<int64_t>& key) {
  key.resize(static_cast<size_t>(2 + 3 * n));
  int64_t* word = key.data();
  *word++ = kFingerprintTag;
  *word++ = n;
  for (int64_t i = 0; i < n; ++i) {
    const TensorFacts f = facts_at(i);
    if (f.numel > 0 && (f.code < 0 || !f.dense)) return false;
    *word++ = f.addr;
    *word++ = f.numel;
    *word++ = f.code;
  }
  return true;
}

// Everything a call launches: per dtype code, the rows and tiles of its kernel, and the device
// table (kTableHeaderWords words of row counts, then each dtype's rows, 3 words each).
struct LaunchPlan {
  std::array<int64_t, kKernelDtypes> rows{};
  std::array<int64_t, kKernelDtypes> tiles{};
  std::vector<int64_t> table;
};

// The plan of rows already sorted by dtype code (their first_tile is filled in here).
inline LaunchPlan plan_from_rows(std::array<std::vector<TensorDesc>, kKernelDtypes>& rows) {
  LaunchPlan plan;
  plan.table.assign(kTableHeaderWords, 0);
  for (int code = 0; code < kKernelDtypes; ++code) {
    std::vector<TensorDesc>& group = rows[code];
    const int64_t n = static_cast<int64_t>(group.size());
    plan.rows[code] = n;
    plan.tiles[code] = build_tile_table(group.data(), n, code_elem_bytes(code));
    plan.table[code] = n;
    for (const TensorDesc& row : group) plan.table.insert(plan.table.end(), {row.addr, row.numel,
                                                                              row.first_tile});
  }
  return plan;
}

// The plan of a fingerprint key (fingerprint() returned true): its non-empty tensors, in list
// order within each dtype.
inline LaunchPlan plan_from_fingerprint(const std::vector<int64_t>& key) {
  std::array<std::vector<TensorDesc>, kKernelDtypes> rows;
  const int64_t n = key[1];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* facts = key.data() + 2 + 3 * i;
    if (facts[1] > 0) rows[facts[2]].push_back({facts[0], facts[1], 0});
  }
  return plan_from_rows(rows);
}

}  // namespace amp_graph
