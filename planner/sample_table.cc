#include "planner/sample_table.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <vector>

#include "contract/block_geometry.h"
#include "planner/det_math.h"
#include "planner/plan_threads.h"

namespace sparsebalance {

double LogOneMinus(double rho) { return DetLog(1.0 - std::min(rho, kAlmostDense)); }

SampleTable::SampleTable(const std::vector<Sample>& batch, const PlannerConfig& config,
                         const LatencyModel& model, const RecallModel& recall, PlanThreads* threads)
    : storage_(ThreadStorage().in_use ? &own_ : &ThreadStorage()), size_(batch.size()) {
  storage_->in_use = true;
  if (storage_->terms.size() < size_) {
    storage_->terms.resize(size_);
    storage_->recalls.resize(size_);
    storage_->blocks.resize(size_);
  }
  terms_ = storage_->terms.data();
  recalls_ = storage_->recalls.data();
  blocks_ = storage_->blocks.data();
  // Each sample's place in the document arrays, a running count.
  size_t documents = 0;
  for (size_t i = 0; i < size_; ++i) {
    terms_[i].doc_begin = static_cast<int>(documents);
    documents += std::max<size_t>(batch[i].segments.size(), 1);
    terms_[i].doc_end = static_cast<int>(documents);
  }
  if (storage_->doc_rows.size() < documents) {
    storage_->doc_rows.resize(documents);
    storage_->doc_tokens.resize(documents);
    storage_->doc_buckets.resize(documents);
  }
  doc_rows_ = storage_->doc_rows.data();
  doc_tokens_ = storage_->doc_tokens.data();
  doc_buckets_ = storage_->doc_buckets.data();
  block_size_ = config.shape.block_size;
  local_blocks_ = config.shape.local_blocks;
  const Memo none{std::numeric_limits<double>::quiet_NaN(), 0.0};
  const double per_block = model.coefficients().per_block;
  const int block = config.shape.block_size;
  // RecallBucket's edges, compared as it compares them, inline: a call per document was a tenth
  // of the table.
  std::array<int64_t, kRecallBuckets> edges{};
  for (int k = 1; k < kRecallBuckets; ++k) {
    edges[k] = RecallBucketRange(k, config.micro_batch_capacity).min;
  }
  ParallelFor(threads, batch.size(), [&](size_t begin, size_t end) {
    // Floors and bases take few values over a batch without a document recall floor (the
    // default density, or one floor per sensitivity), so their logarithms keep the last one; a
    // base at its floor takes the floor's.
    double last_floor = -1.0;
    double last_log_floor = 0.0;
    double last_base = -1.0;
    double last_log_base = 0.0;
    for (size_t i = begin; i < end; ++i) {
      const Sample& s = batch[i];
      SampleTerms& t = terms_[i];
      recalls_[i] = none;
      blocks_[i] = none;
      t.exponent = recall.SampleExponent(s);
      t.floor = DensityFloor(s.sensitivity, config);
      t.base = BaseDensity(s.sensitivity, config);
      if (config.document_recall_floor > 0) {
        const double keep = std::min(config.density_max,
                                     DensityForRecall(t.exponent, config.document_recall_floor));
        t.floor = std::max(t.floor, keep);
        t.base = std::max(t.base, keep);
      }
      if (t.floor != last_floor) {
        last_floor = t.floor;
        last_log_floor = LogOneMinus(t.floor);
      }
      t.log_floor = last_log_floor;
      if (t.base == t.floor) {
        t.log_base = t.log_floor;
      } else {
        if (t.base != last_base) {
          last_base = t.base;
          last_log_base = LogOneMinus(t.base);
        }
        t.log_base = last_log_base;
      }
      // RecallAt is 1 - e^(g log(1 - base)); below kAlmostDense its logarithm is LogOneMinus's,
      // so the base's kept logarithm gives the same bits without a DetLog per sample.
      if (t.base >= 0.0 && t.base < kAlmostDense) {
        t.base_recall = 1.0 - DetExp(t.exponent * t.log_base);
      } else {
        t.base_recall = RecallAt(t.exponent, t.base);
      }
      double triangle = 0.0;
      int d = t.doc_begin;
      auto add_doc = [&](int64_t length) {
        doc_rows_[d] = QueryBlocks(length, block);
        doc_tokens_[d] = length;
        int bucket = 0;
        for (int k = 1; k < kRecallBuckets; ++k) {
          if (length >= edges[k]) bucket = k;
        }
        doc_buckets_[d] = bucket;
        const double rows = static_cast<double>(doc_rows_[d]);
        triangle += 0.5 * rows * (rows + 1.0);
        ++d;
      };
      if (s.segments.empty()) {
        add_doc(s.length);
      } else {
        for (int64_t segment : s.segments) add_doc(segment);
      }
      // Seconds per unit of density, about.
      const double price = per_block * triangle;
      t.price_offset =
          DetLog(std::max(price, 1e-300) / (static_cast<double>(s.length) * t.exponent));
    }
  });
}

SampleTable::~SampleTable() {
  if (storage_->terms.size() > kKeptScratchSamples) *storage_ = Storage{};  // frees them
  storage_->in_use = false;
}

SampleTable::Storage& SampleTable::ThreadStorage() {
  thread_local Storage storage;
  return storage;
}

void SampleTable::WarmRecalls(const std::vector<double>& densities, PlanThreads* threads) const {
  ParallelFor(threads, size_, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) Recall(i, densities[i]);
  });
}

double SampleTable::CountActiveBlocks(const Sample& sample, size_t i, double rho) const {
  // As LatencyModel::SampleFeatures counts them (whole-number sums: exact in any order).
  double blocks = 0.0;
  if (sample.segments.empty()) {
    blocks = static_cast<double>(ActiveBlocks(sample.length, rho, block_size_, local_blocks_));
  } else {
    for (int64_t segment : sample.segments) {
      blocks += static_cast<double>(ActiveBlocks(segment, rho, block_size_, local_blocks_));
    }
  }
  blocks_[i] = {rho, blocks};
  return blocks;
}

std::vector<int> PlacedOrder(const std::vector<std::vector<std::vector<int>>>& ranks) {
  std::vector<int> order;
  for (const auto& micro_batches : ranks) {
    for (const std::vector<int>& members : micro_batches) {
      order.insert(order.end(), members.begin(), members.end());
    }
  }
  return order;
}

std::vector<double> SampleTable::BaseDensities() const {
  std::vector<double> out(size_);
  for (size_t i = 0; i < size_; ++i) out[i] = terms_[i].base;
  return out;
}

}  // namespace sparsebalance
