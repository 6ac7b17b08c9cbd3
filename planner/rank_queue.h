// The placement's ranks ordered by their predicted time (sample_assigner.cc): the least loaded
// few read off at once for each placement, every rank's time updated as units land on it, and the
// ranks visited in order when the first few do not take a unit.
//
//   RankQueueOf</*kLargestFirst=*/false, 4> queue;
//   queue.Reset(ranks, [&](int r) { return time[r]; });
//   std::array<int, 4> first;
//   const int n = queue.FirstRanks(&first);   // the 4 least (time, rank), in order
//   queue.Update(first[0], time_after);        // that rank's new time
#ifndef SPARSEBALANCE_PLANNER_RANK_QUEUE_H_
#define SPARSEBALANCE_PLANNER_RANK_QUEUE_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sparsebalance {

// Ranks ordered by (time, rank): the first kFirst of them in a sorted array, the others in a
// winner (tournament) tree, whose every node holds the least entry below it. Placing a unit on
// one of the first ranks makes it later than the tree's least rank (almost always): the two
// trade places, the rank taking the leaf of the one that joins the first, and that leaf and its
// ancestors are redone, one comparison a level on loads whose addresses the leaf alone gives
// and no early exit that mispredicts. The binary heap this replaces sifted down six to eight
// levels with a mispredicted choice of child at each (with the tree, placing 65,536 samples
// over 4,096 ranks takes 1.7-2.4 ms less on one thread, 1.0-1.1 ms less on two, and 7M fewer
// instructions); the first ranks are read off the array. Entries are keys that hold the time and
// the rank, so that comparisons do not look the time up per rank. Only the order is observable
// (First, FirstRanks, VisitInOrder), never the layout.
template <bool kLargestFirst, int kFirst>
class RankQueueOf {
 public:
  // Every rank r of [0, ranks) at time time_of(r), the tree built bottom up: O(ranks). Keeps the
  // arrays' capacity, so that a reused queue does not allocate.
  template <typename TimeOf>
  void Reset(int ranks, TimeOf time_of) {
    leaves_ = 1;
    while (leaves_ < ranks) leaves_ *= 2;
    tree_.resize(2 * leaves_);
    leaf_.resize(ranks);
    for (int r = 0; r < leaves_; ++r) {
      tree_[leaves_ + r] = r < ranks ? MakeKey(time_of(r), r) : kNone;
    }
    for (int r = 0; r < ranks; ++r) leaf_[r] = r;
    for (int i = leaves_ - 1; i >= 1; --i) tree_[i] = Least(tree_[2 * i], tree_[2 * i + 1]);
    size_ = std::min(ranks, kFirst);
    first_.fill(kNone);
    for (int k = 0; k < size_; ++k) {
      first_[k] = tree_[1];
      int& leaf = leaf_[RankOf(first_[k])];
      Replace(leaf, kNone);
      leaf = -1;
    }
  }

  void Update(int rank, double time) {
    const Key key = MakeKey(time, rank);
    const int leaf = leaf_[rank];
    if (leaf < 0) {  // one of the first
      int k = 0;
      while (RankOf(first_[k]) != rank) ++k;
      for (; k + 1 < size_; ++k) first_[k] = first_[k + 1];
      // The rank stays among the first, or it and the tree's least (after every other first)
      // trade places; the tree is empty (kNone) when every rank is among the first.
      const Key least = tree_[1];
      if (Before(least, key)) {
        Trade(rank, key, RankOf(least));
        first_[size_ - 1] = least;
      } else {
        Insert(key, size_ - 1);
      }
    } else if (Before(key, first_[size_ - 1])) {  // joins the first, the last of them leaves
      const Key last = first_[size_ - 1];
      Insert(key, size_ - 1);
      Trade(RankOf(last), last, rank);
    } else {
      Replace(leaf, key);
    }
  }
  int First() const { return RankOf(first_[0]); }

  // The first kFirst ranks in order, as VisitInOrder would visit them, into `first`;
  // returns how many there are (kFirst, or every rank when there are fewer).
  int FirstRanks(std::array<int, kFirst>* first) const {
#pragma GCC unroll 4
    for (int k = 0; k < kFirst; ++k) (*first)[k] = RankOf(first_[k]);
    return size_;
  }

  // Calls visit(rank) for ranks in order until it returns false or all were visited: the first
  // ranks, then the tree's by a best-first walk. Its frontier (a binary heap of its own) holds
  // the roots of the subtrees not visited yet; visiting a subtree's least rank replaces its root
  // by the siblings of the rank's leaf and of its ancestors below that root.
  template <typename Visit>
  void VisitInOrder(Visit visit) {
    for (int k = 0; k < size_; ++k) {
      if (!visit(RankOf(first_[k]))) return;
    }
    frontier_.clear();
    if (tree_[1] != kNone) frontier_.push_back({tree_[1], 1});
    while (!frontier_.empty()) {
      const Node node = frontier_.front();
      if (!visit(RankOf(node.key))) return;
      const Node last = frontier_.back();
      frontier_.pop_back();
      if (!frontier_.empty()) SiftFrontierDown(last);
      for (int i = leaves_ + leaf_[RankOf(node.key)]; i > node.at; i /= 2) {
        if (tree_[i ^ 1] != kNone) PushFrontier({tree_[i ^ 1], i ^ 1});
      }
    }
  }

 private:
  // (time, rank) as one unsigned integer, the time's bits made to order like the time (as
  // CostKey's) above the rank: one comparison where there were two of doubles and one of ints.
  // Times are never NaN. The compilers' own type: absl::uint128's conversions cost more.
  using Key = unsigned __int128;
  // After every key (the bits of no time): a leaf that holds no rank.
  static constexpr Key kNone = kLargestFirst ? Key{0} : ~Key{0};
  // A tree node's entry and its index in tree_.
  struct Node {
    Key key;
    int at;
  };

  static Key MakeKey(double time, int rank) {
    if (time == 0.0) time = 0.0;  // -0.0 as 0.0, which it equals
    uint64_t bits;
    std::memcpy(&bits, &time, sizeof(bits));
    // Negative times (all bits flipped) below positive ones (sign bit set).
    bits ^= static_cast<uint64_t>(static_cast<int64_t>(bits) >> 63) | (uint64_t{1} << 63);
    return (Key{bits} << 64) | static_cast<uint32_t>(rank);
  }
  static int RankOf(Key key) { return static_cast<int>(static_cast<uint32_t>(key)); }
  static bool Before(Key a, Key b) { return kLargestFirst ? b < a : a < b; }
  static Key Least(Key a, Key b) { return Before(b, a) ? b : a; }
  // `rank`, one of the first, at `key` takes the leaf of `other`, which joins the first.
  void Trade(int rank, Key key, int other) {
    const int leaf = leaf_[other];
    leaf_[other] = -1;
    leaf_[rank] = leaf;
    Replace(leaf, key);
  }
  // Sets the leaf to `key` and each of its ancestors to the least of its children. Nodes are
  // addressed by their offsets in bytes: a sibling's and a parent's take one and two
  // instructions, where indices took three.
  void Replace(int leaf, Key key) {
    size_t at = (leaves_ + leaf) * sizeof(Key);
    At(at) = key;
    for (; at > sizeof(Key); at = at / 2 & ~(sizeof(Key) - 1)) {
      key = Least(key, At(at ^ sizeof(Key)));
      At(at / 2 & ~(sizeof(Key) - 1)) = key;
    }
  }
  Key& At(size_t at) { return *reinterpret_cast<Key*>(reinterpret_cast<char*>(tree_.data()) + at); }
  // Puts `key` into first_[0, end], whose entries from its place on move one up.
  void Insert(Key key, int end) {
    for (; end > 0 && Before(key, first_[end - 1]); --end) first_[end] = first_[end - 1];
    first_[end] = key;
  }
  // The frontier's: `node` goes to its root (replacing it) or below; `node` added.
  void SiftFrontierDown(const Node& node) {
    const int n = static_cast<int>(frontier_.size());
    int i = 0;
    for (int child = 1; child < n; child = 2 * i + 1) {
      if (child + 1 < n && Before(frontier_[child + 1].key, frontier_[child].key)) ++child;
      if (!Before(frontier_[child].key, node.key)) break;
      frontier_[i] = frontier_[child];
      i = child;
    }
    frontier_[i] = node;
  }
  void PushFrontier(const Node& node) {
    int i = static_cast<int>(frontier_.size());
    frontier_.push_back(node);
    while (i > 0 && Before(node.key, frontier_[(i - 1) / 2].key)) {
      frontier_[i] = frontier_[(i - 1) / 2];
      i = (i - 1) / 2;
    }
    frontier_[i] = node;
  }

  // The first min(ranks, kFirst) ranks' keys in order (size_ of them), the others kNone.
  std::array<Key, kFirst> first_{};
  int size_ = 0;
  // The tree: node i's children are 2 i and 2 i + 1, the root 1, the leaves from leaves_ (a power
  // of two at least the ranks) on. Each rank not among the first holds one leaf (leaf_, per rank;
  // -1 for the first), where the others hold kNone.
  int leaves_ = 1;
  std::vector<Key> tree_;
  std::vector<int> leaf_;
  std::vector<Node> frontier_;  // VisitInOrder's, least first
};

}  // namespace sparsebalance

#endif  // SPARSEBALANCE_PLANNER_RANK_QUEUE_H_
