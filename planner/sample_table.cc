#include "planner/sample_table.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "contract/block_geometry.h"
#include "planner/det_math.h"
#include "planner/plan_threads.h"

namespace sparsebalance {

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
  const double per_block = model.coefficients().per_block;
  ParallelFor(threads, batch.size(), [&](size_t begin, size_t end) {
    // What the loop reads of the config and the recall model, copied to locals: it stores
    // doubles, and after each store the compiler would load theirs again (they might alias).
    const PlannerConfig cfg = config;
    const AllLayerExponents exponents = recall.AllLayers();
    const int block = cfg.shape.block_size;
    const double cost_per_block = per_block;
    const Memo none{std::numeric_limits<double>::quiet_NaN(), 0.0};
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
      // Each document's rows, tokens and bucket, and the triangle of query-block pairs.
      double triangle = 0.0;
      int d = t.doc_begin;
      auto add_doc = [&](int64_t length) {
        const int64_t rows = QueryBlocks(length, block);
        doc_rows_[d] = rows;
        doc_tokens_[d] = length;
        doc_buckets_[d] = exponents.Bucket(length);
        const double r = static_cast<double>(rows);
        triangle += 0.5 * r * (r + 1.0);
        ++d;
      };
      if (s.segments.empty()) {
        add_doc(s.length);
      } else {
        for (int64_t segment : s.segments) add_doc(segment);
      }
      // SampleExponent, a single document's from the bucket just found.
      const double exponent = s.segments.empty()
                                  ? exponents.InBucket(doc_buckets_[t.doc_begin], s.sensitivity)
                                  : exponents.SampleExponent(s);
      double floor = DensityFloor(s.sensitivity, cfg);
      double base = BaseDensity(s.sensitivity, cfg);
      if (cfg.document_recall_floor > 0) {
        const double keep =
            std::min(cfg.density_max, DensityForRecall(exponent, cfg.document_recall_floor));
        floor = std::max(floor, keep);
        base = std::max(base, keep);
      }
      if (floor != last_floor) {
        last_floor = floor;
        last_log_floor = LogOneMinus(floor);
      }
      double log_base = last_log_floor;
      if (base != floor) {
        if (base != last_base) {
          last_base = base;
          last_log_base = LogOneMinus(base);
        }
        log_base = last_log_base;
      }
      t.exponent = exponent;
      t.floor = floor;
      t.log_floor = last_log_floor;
      t.base = base;
      t.log_base = log_base;
      // RecallAt is 1 - e^(g log(1 - base)); below kAlmostDense its logarithm is LogOneMinus's,
      // so the base's kept logarithm gives the same bits without a DetLog per sample.
      t.base_recall = base >= 0.0 && base < kAlmostDense ? 1.0 - DetExp(exponent * log_base)
                                                         : RecallAt(exponent, base);
      // Seconds per unit of density, about.
      const double price = cost_per_block * triangle;
      t.price_offset = DetLog(std::max(price, 1e-300) / (static_cast<double>(s.length) * exponent));
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
