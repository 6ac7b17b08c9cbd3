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

SampleTable::SampleTable(const std::vector<Sample>& batch, const PlannerConfig& config,
                         const LatencyModel& model, const RecallModel& recall, PlanThreads* threads)
    : storage_(batch.size()), size_(batch.size()) {
  if (storage_->terms.size() < size_) {
    storage_->terms.resize(size_);
    storage_->bases.resize(size_);
    storage_->base_recalls.resize(size_);
    storage_->exponents.resize(size_);
    storage_->recalls.resize(size_);
    storage_->blocks.resize(size_);
  }
  terms_ = storage_->terms.data();
  bases_ = storage_->bases.data();
  base_recalls_ = storage_->base_recalls.data();
  exponents_ = storage_->exponents.data();
  recalls_ = storage_->recalls.data();
  blocks_ = storage_->blocks.data();
  // Each range's documents first, on the threads, for its first place in the document arrays
  // (a running count over the ranges). Counted serially, with each sample's place stored in its
  // terms before they were written, it was a quarter of the table's time on one thread.
  const size_t chunks = ChunkCount(threads, size_);
  std::vector<size_t> first_doc(chunks + 1, 0);
  ParallelChunks(threads, size_, [&](size_t chunk, size_t begin, size_t end) {
    size_t documents = 0;
    for (size_t i = begin; i < end; ++i) documents += std::max<size_t>(batch[i].segments.size(), 1);
    first_doc[chunk + 1] = documents;
  });
  for (size_t c = 0; c < chunks; ++c) first_doc[c + 1] += first_doc[c];
  const size_t documents = first_doc[chunks];
  one_document_each_ = documents == size_;
  if (storage_->doc_rows.size() < documents) {
    storage_->doc_rows.resize(documents);
    storage_->doc_tokens.resize(documents);
    storage_->doc_buckets.resize(documents);
  }
  doc_rows_ = storage_->doc_rows.data();
  doc_tokens_ = storage_->doc_tokens.data();
  doc_buckets_ = storage_->doc_buckets.data();
  local_blocks_ = config.shape.local_blocks;
  const double per_block = model.coefficients().per_block;
  ParallelChunks(threads, batch.size(), [&](size_t chunk, size_t begin, size_t end) {
    // What the loop reads of the config and the recall model, copied to locals: it stores
    // doubles, and after each store the compiler would load theirs again (they might alias).
    const PlannerConfig cfg = config;
    const AllLayerExponents exponents = recall.AllLayers();
    const int block = cfg.shape.block_size;
    const double cost_per_block = per_block;
    const Memo none{std::numeric_limits<double>::quiet_NaN(), 0.0};
    // The logarithms and exponentials of kBatch samples at a time go through DetLogAll and
    // DetExpAll (SIMD, the same bits as DetLog and DetExp): LogOneMinus of the floor and the
    // base, the price offset, and the base recall.
    constexpr size_t kBatch = 256;
    std::array<double, kBatch> log_floor;
    std::array<double, kBatch> log_base;
    std::array<double, kBatch> price_offset;
    std::array<double, kBatch> at_base;          // e^(g log(1 - base)), where RecallAt takes it
    int d = static_cast<int>(first_doc[chunk]);  // the next document's place
    for (size_t first = begin; first < end; first += kBatch) {
      const size_t m = std::min(kBatch, end - first);
      for (size_t j = 0; j < m; ++j) {
        const size_t i = first + j;
        const Sample& s = batch[i];
        SampleTerms& t = terms_[i];
        recalls_[i] = none;
        blocks_[i] = none;
        // Each document's rows, tokens and bucket, and the triangle of query-block pairs.
        double triangle = 0.0;
        t.doc_begin = d;
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
        t.doc_end = d;
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
        t.exponent = exponent;
        t.floor = floor;
        t.base = base;
        // LogOneMinus's arguments (a base at its floor takes the floor's logarithm).
        log_floor[j] = 1.0 - std::min(floor, kAlmostDense);
        log_base[j] = base != floor ? 1.0 - std::min(base, kAlmostDense) : 1.0;
        // Seconds per unit of density, about: the offset is the log of price / (tokens g).
        const double price = cost_per_block * triangle;
        price_offset[j] = std::max(price, 1e-300) / (static_cast<double>(s.length) * exponent);
      }
      DetLogAll(log_floor.data(), log_floor.data(), m);
      DetLogAll(log_base.data(), log_base.data(), m);
      DetLogAll(price_offset.data(), price_offset.data(), m);
      for (size_t j = 0; j < m; ++j) {
        SampleTerms& t = terms_[first + j];
        t.log_floor = log_floor[j];
        t.log_base = t.base != t.floor ? log_base[j] : log_floor[j];
        t.price_offset = price_offset[j];
        // RecallAt is 1 - e^(g log(1 - base)); below kAlmostDense its logarithm is
        // LogOneMinus's, so the base's logarithm gives the same bits without a DetLog.
        at_base[j] = t.base >= 0.0 && t.base < kAlmostDense ? t.exponent * t.log_base : 0.0;
      }
      DetExpAll(at_base.data(), at_base.data(), m);
      for (size_t j = 0; j < m; ++j) {
        SampleTerms& t = terms_[first + j];
        t.base_recall = t.base >= 0.0 && t.base < kAlmostDense ? 1.0 - at_base[j]
                                                               : RecallAt(t.exponent, t.base);
        bases_[first + j] = t.base;
        base_recalls_[first + j] = t.base_recall;
        exponents_[first + j] = t.exponent;
      }
    }
  });
}

void SampleTable::WarmRecalls(const std::vector<double>& densities, PlanThreads* threads) const {
  ParallelFor(threads, size_,
              [&](size_t begin, size_t end) { WarmRecalls(densities, begin, end); });
}

void SampleTable::WarmRecalls(const std::vector<double>& densities, size_t begin,
                              size_t end) const {
  {
    // The samples whose answer is not kept yet, kBatch at a time: RecallAt's power,
    // e^(g log(1 - rho)), through DetLogAll and DetExpAll (the same bits as DetPow), except
    // where DetPow answers without them (a density of 1 or more, an exponent of 0).
    constexpr size_t kBatch = 256;
    std::array<double, kBatch> power;
    std::array<size_t, kBatch> sample;
    for (size_t first = begin; first < end; first += kBatch) {
      const size_t last = std::min(first + kBatch, end);
      size_t count = 0;
      // From the compact copies of the terms (RecallInOrder).
      for (size_t i = first; i < last; ++i) {
        const double rho = densities[i];
        if (rho == bases_[i] || recalls_[i].density == rho) continue;  // Recall needs no work
        const double one_minus = 1.0 - std::clamp(rho, 0.0, 1.0);
        if (one_minus == 0.0 || exponents_[i] == 0.0) {
          KeptRecall(i, rho, exponents_[i]);
          continue;
        }
        sample[count] = i;
        power[count++] = one_minus;
      }
      DetLogAll(power.data(), power.data(), count);
      for (size_t k = 0; k < count; ++k) power[k] *= exponents_[sample[k]];
      DetExpAll(power.data(), power.data(), count);
      for (size_t k = 0; k < count; ++k) {
        const size_t i = sample[k];
        recalls_[i] = {densities[i], 1.0 - power[k]};
      }
    }
  }
}

double SampleTable::CountActiveBlocks(size_t i, double rho) const {
  // As LatencyModel::SampleFeatures counts them (whole-number sums: exact in any order), from
  // each document's query blocks.
  double blocks = 0.0;
  const auto [first, last] = Documents(i);
  for (int d = first; d < last; ++d) {
    blocks += static_cast<double>(ActiveBlocksOfQueryBlocks(doc_rows_[d], rho, local_blocks_));
  }
  blocks_[i] = {rho, blocks};
  return blocks;
}

std::vector<double> SampleTable::BaseDensities() const {
  return std::vector<double>(bases_, bases_ + size_);
}

}  // namespace sparsebalance
