// Device-side tensor tables, built once per parameter set (plain C++: the host self-test runs it).
//
// A fused launch reads its tensors' {address, numel, first_tile} rows from device memory. Writing
// them costs a host-to-device transfer, so the binding keeps the tables it built, keyed by the
// gradient list's fingerprint (launch_plan.h) or, for lists without one, by the table's content
// (the same gradients at the same addresses give the same key), and writes a new one only when
// the set changes. That also makes a training step capturable in a CUDA graph: a table in
// use by a captured graph is kept ("pinned") for as long as the process lives, since the graph's
// kernels read it at every replay.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <list>
#include <utility>
#include <vector>

namespace amp_graph {

// Least-recently-used cache of device tables. Buffer: whatever owns the device memory (a torch
// tensor in the binding, a fake in the host self-test). Not thread-safe: the caller locks.
template <class Buffer>
class TableCache {
 public:
  struct Entry {
    int device;
    std::vector<int64_t> key;
    Buffer buffer;
    bool pinned;  // read by a captured CUDA graph: never evicted
  };

  explicit TableCache(size_t capacity) : capacity_(capacity) {}

  // The entry of `key` on `device`, or nullptr; a hit becomes the most recently used entry.
  // Keys of other lengths are rejected without reading them; a key compared whole is read once
  // (no hash to compute first: the comparison is the fingerprint check).
  Entry* find(int device, const std::vector<int64_t>& key) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->device == device && it->key.size() == key.size() && it->key == key) {
        entries_.splice(entries_.begin(), entries_, it);
        return &entries_.front();
      }
    }
    return nullptr;
  }

  // Adds the table just built for `key` as the most recently used entry, then evicts the least
  // recently used unpinned entries while more than `capacity` unpinned entries remain.
  Entry& insert(int device, std::vector<int64_t> key, Buffer buffer, bool pinned) {
    entries_.push_front(Entry{device, std::move(key), std::move(buffer), pinned});
    size_t unpinned = 0;
    for (const Entry& e : entries_) unpinned += e.pinned ? 0 : 1;
    for (auto it = entries_.end(); unpinned > capacity_ && it != entries_.begin();) {
      --it;
      if (!it->pinned) {
        it = entries_.erase(it);
        --unpinned;
      }
    }
    return entries_.front();
  }

  size_t size() const { return entries_.size(); }

 private:
  size_t capacity_;
  std::list<Entry> entries_;  // most recently used first
};

// How a table of `count` int64 words is written by kernels that carry up to `per_launch` words in
// their parameters: (offset, count) of each launch, in order, covering [0, count) exactly once.
inline std::vector<std::pair<int64_t, int64_t>> write_chunks(int64_t count, int64_t per_launch) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t offset = 0; offset < count; offset += per_launch) {
    chunks.emplace_back(offset, count - offset < per_launch ? count - offset : per_launch);
  }
  return chunks;
}

}  // namespace amp_graph
