// The byte-pair merge loop shared by the tiktoken and HF BPE models: repeatedly merge the adjacent pair with the
// lowest rank (leftmost on ties) in O(n log n), so long words never cost quadratic time.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace titan::tokenizer {

struct Symbol {
  uint32_t start;  // offset of the symbol's first unit in the word
  uint32_t len;    // units covered; 0 once merged into its left neighbour
  int32_t id;
  int32_t prev, next;  // neighbours, -1 at the ends
};

inline std::vector<Symbol> make_symbols(const std::vector<std::pair<uint32_t, int32_t>>& starts_and_ids,
                                        uint32_t total_len) {
  std::vector<Symbol> s(starts_and_ids.size());
  for (size_t i = 0; i < s.size(); ++i) {
    uint32_t start = starts_and_ids[i].first;
    uint32_t end = i + 1 < s.size() ? starts_and_ids[i + 1].first : total_len;
    s[i] = Symbol{start, end - start, starts_and_ids[i].second, static_cast<int32_t>(i) - 1,
                  i + 1 < s.size() ? static_cast<int32_t>(i + 1) : -1};
  }
  return s;
}

// pair_rank(left, right) returns {rank, merged_id}; rank < 0 means the pair does not merge.
template <typename PairRank>
void bpe_merge(std::vector<Symbol>& s, PairRank&& pair_rank) {
  if (s.size() < 2) return;
  struct Candidate {
    int32_t rank;
    uint32_t start;
    int32_t left, right;
    uint32_t left_len, right_len;
    int32_t merged;
  };
  auto later = [](const Candidate& a, const Candidate& b) { return a.rank != b.rank ? a.rank > b.rank : a.start > b.start; };
  std::vector<Candidate> heap;
  heap.reserve(s.size() * 2);
  auto push = [&](int32_t l, int32_t r) {
    auto [rank, merged] = pair_rank(s[l], s[r]);
    if (rank < 0) return;
    heap.push_back(Candidate{rank, s[l].start, l, r, s[l].len, s[r].len, merged});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (size_t i = 0; i + 1 < s.size(); ++i) push(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = s[c.left];
    // Stale when either side has merged since the candidate was pushed (lengths only grow).
    if (left.len != c.left_len || left.next != c.right || s[c.right].len != c.right_len) continue;
    Symbol& right = s[c.right];
    left.len += right.len;
    left.id = c.merged;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) s[right.next].prev = c.left;
    if (left.prev >= 0) push(left.prev, c.left);
    if (left.next >= 0) push(c.left, left.next);
  }
}

// Visits the surviving symbols left to right.
template <typename Visit>
void for_each_symbol(const std::vector<Symbol>& s, Visit&& visit) {
  for (int32_t i = s.empty() ? -1 : 0; i >= 0; i = s[i].next) visit(s[i]);
}

}  // namespace titan::tokenizer
