#include "server/step_pack.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/planner.h"
#include "planner/recall_model.h"
#include "planner/sparsity_tuner.h"

namespace sparsebalance {
namespace {

// Doubles that are integers, or multiples of 2^-16, below 2^50 in magnitude are written as
// varints of their (scaled) value; the low two bits of the varint say which (kInteger,
// kSixteenths) or that 8 raw bytes follow (kRaw).
constexpr uint64_t kInteger = 0;
constexpr uint64_t kSixteenths = 1;
constexpr uint64_t kRaw = 2;
constexpr double kSixteenthsScale = 65536.0;
constexpr double kMaxScaled = 1125899906842624.0;  // 2^50

// PlannedSample's optional parts, flagged in one byte.
constexpr uint8_t kHasSegments = 1;
constexpr uint8_t kHasLayerDensities = 2;
constexpr uint8_t kSharded = 4;
// With kHasLayerDensities: only their count is written; UnpackStep computes them again from a
// LayerDensityRecipe.
constexpr uint8_t kLayerDensitiesLeftOut = 8;

// A hash of the left-out layer densities, bit for bit and in plan order, that UnpackStep checks
// the ones it computes against.
constexpr uint64_t kLayerHashSeed = 0xcbf29ce484222325ULL;
uint64_t HashLayerDensities(const std::vector<double>& densities, uint64_t hash) {
  for (double d : densities) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof(bits));
    hash = (hash ^ bits) * 0x100000001b3ULL;
    hash ^= hash >> 29;
  }
  return hash;
}

uint64_t ZigZag(int64_t v) {
  return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
}
int64_t UnZigZag(uint64_t v) { return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1); }

// An integer-valued double whose value is below 2^50 in magnitude, as an int64 (false for
// -0.0, fractions, NaN and infinities).
bool SmallInteger(double v, int64_t* out) {
  if (!(std::fabs(v) < kMaxScaled) || v != std::trunc(v) || std::signbit(v) != (v < 0)) {
    return false;
  }
  *out = static_cast<int64_t>(v);
  return true;
}

class Writer {
 public:
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>(v | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  void Signed(int64_t v) { Varint(ZigZag(v)); }
  void Byte(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void Double(double v) {
    int64_t i = 0;
    if (SmallInteger(v, &i)) return Varint((ZigZag(i) << 2) | kInteger);
    if (SmallInteger(v * kSixteenthsScale, &i) && static_cast<double>(i) / kSixteenthsScale == v) {
      return Varint((ZigZag(i) << 2) | kSixteenths);
    }
    Varint(kRaw);
    char bytes[sizeof(double)];
    std::memcpy(bytes, &v, sizeof(double));
    out_.append(bytes, sizeof(double));
  }
  // An id as its difference from the previous one written through the same `last`.
  void Id(uint64_t id, uint64_t* last) {
    Signed(static_cast<int64_t>(id - *last));
    *last = id;
  }
  void String(const std::string& s) {
    Varint(s.size());
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

// Reads what Writer wrote; every read returns false (and the reader stays failed) once the
// bytes run out or do not decode.
class Reader {
 public:
  explicit Reader(absl::string_view in) : in_(in) {}
  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && pos_ < in_.size(); shift += 7) {
      const auto byte = static_cast<unsigned char>(in_[pos_++]);
      *v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return Fail();
  }
  bool Signed(int64_t* v) {
    uint64_t u = 0;
    if (!Varint(&u)) return false;
    *v = UnZigZag(u);
    return true;
  }
  template <typename Int>
  bool SignedAs(Int* v) {
    int64_t wide = 0;
    if (!Signed(&wide)) return false;
    *v = static_cast<Int>(wide);
    return static_cast<int64_t>(*v) == wide || Fail();
  }
  bool Byte(uint8_t* v) {
    if (pos_ >= in_.size()) return Fail();
    *v = static_cast<uint8_t>(in_[pos_++]);
    return true;
  }
  bool Double(double* v) {
    uint64_t tagged = 0;
    if (!Varint(&tagged)) return false;
    switch (tagged & 3) {
      case kInteger:
        *v = static_cast<double>(UnZigZag(tagged >> 2));
        return true;
      case kSixteenths:
        *v = static_cast<double>(UnZigZag(tagged >> 2)) / kSixteenthsScale;
        return true;
      case kRaw:
        if (tagged != kRaw || in_.size() - pos_ < sizeof(double)) return Fail();
        std::memcpy(v, in_.data() + pos_, sizeof(double));
        pos_ += sizeof(double);
        return true;
      default:
        return Fail();
    }
  }
  bool Id(uint64_t* id, uint64_t* last) {
    int64_t delta = 0;
    if (!Signed(&delta)) return false;
    *id = *last + static_cast<uint64_t>(delta);
    *last = *id;
    return true;
  }
  // A count of items that take at least one byte each: never more than the bytes left.
  bool Count(size_t* n) {
    uint64_t v = 0;
    if (!Varint(&v) || v > in_.size() - pos_) return Fail();
    *n = static_cast<size_t>(v);
    return true;
  }
  bool String(std::string* s) {
    size_t n = 0;
    if (!Count(&n)) return false;
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }
  size_t pos() const { return pos_; }

 private:
  bool Fail() {
    pos_ = in_.size() + 1;  // past the end: every later read fails too
    return false;
  }
  absl::string_view in_;
  size_t pos_ = 0;
};

void PutBatch(const std::vector<Sample>& batch, Writer& w) {
  w.Varint(batch.size());
  uint64_t last = 0;
  for (const Sample& s : batch) {
    w.Id(s.id, &last);
    w.Signed(s.length);
    w.Double(s.sensitivity);
    w.Varint(s.group);
    w.Varint(s.segments.size());
    for (int64_t segment : s.segments) w.Signed(segment);
  }
}

bool GetBatch(Reader& r, std::vector<Sample>* batch) {
  size_t n = 0;
  if (!r.Count(&n)) return false;
  batch->resize(n);
  uint64_t last = 0;
  for (Sample& s : *batch) {
    size_t segments = 0;
    if (!r.Id(&s.id, &last) || !r.Signed(&s.length) || !r.Double(&s.sensitivity) ||
        !r.Varint(&s.group) || !r.Count(&segments)) {
      return false;
    }
    s.segments.resize(segments);
    for (int64_t& segment : s.segments) {
      if (!r.Signed(&segment)) return false;
    }
  }
  return true;
}

// With `layer_hash`, a sample's layer densities are left out (their count written) and hashed.
void PutSample(const PlannedSample& s, uint64_t* last_id, Writer& w, uint64_t* layer_hash) {
  const bool left_out = layer_hash != nullptr && !s.layer_densities.empty();
  const uint8_t flags =
      (s.segments.empty() ? 0 : kHasSegments) |
      (s.layer_densities.empty() ? 0 : kHasLayerDensities) |
      (left_out ? kLayerDensitiesLeftOut : 0) |
      (s.shard_group.empty() && s.shard_begin == 0 && s.shard_end == 0 && s.shard_index == 0
           ? 0
           : kSharded);
  w.Byte(flags);
  w.Id(s.id, last_id);
  w.Signed(s.length);
  w.Double(s.density);
  if (flags & kHasSegments) {
    w.Varint(s.segments.size());
    for (int64_t segment : s.segments) w.Signed(segment);
  }
  if (flags & kHasLayerDensities) {
    w.Varint(s.layer_densities.size());
    if (left_out) {
      *layer_hash = HashLayerDensities(s.layer_densities, *layer_hash);
    } else {
      for (double d : s.layer_densities) w.Double(d);
    }
  }
  if (flags & kSharded) {
    w.Signed(s.shard_begin);
    w.Signed(s.shard_end);
    w.Signed(s.shard_index);
    w.Varint(s.shard_group.size());
    for (int rank : s.shard_group) w.Signed(rank);
  }
}

// A sample whose layer densities were left out gets that many zeros and goes to `left_out`.
bool GetSample(Reader& r, uint64_t* last_id, PlannedSample* s,
               std::vector<PlannedSample*>* left_out) {
  uint8_t flags = 0;
  if (!r.Byte(&flags) || !r.Id(&s->id, last_id) || !r.Signed(&s->length) ||
      !r.Double(&s->density)) {
    return false;
  }
  size_t n = 0;
  if (flags & kHasSegments) {
    if (!r.Count(&n)) return false;
    s->segments.resize(n);
    for (int64_t& segment : s->segments) {
      if (!r.Signed(&segment)) return false;
    }
  }
  if (flags & kHasLayerDensities) {
    if (!r.Count(&n)) return false;
    s->layer_densities.resize(n);
    if (flags & kLayerDensitiesLeftOut) {
      left_out->push_back(s);
    } else {
      for (double& d : s->layer_densities) {
        if (!r.Double(&d)) return false;
      }
    }
  }
  if (flags & kSharded) {
    if (!r.Signed(&s->shard_begin) || !r.Signed(&s->shard_end) || !r.SignedAs(&s->shard_index) ||
        !r.Count(&n)) {
      return false;
    }
    s->shard_group.resize(n);
    for (int& rank : s->shard_group) {
      if (!r.SignedAs(&rank)) return false;
    }
  }
  return true;
}

void PutPlan(const StepPlan& plan, Writer& w, uint64_t* layer_hash) {
  w.Varint(static_cast<uint64_t>(plan.policy));
  w.Byte(plan.planned_locally ? 1 : 0);
  for (double v : {plan.makespan_seconds, plan.lower_bound_seconds, plan.gap, plan.imbalance_ratio,
                   plan.bubble_ratio, plan.mean_density, plan.predicted_recall}) {
    w.Double(v);
  }
  w.Varint(plan.deferred_ids.size());
  uint64_t last_id = 0;
  for (uint64_t id : plan.deferred_ids) w.Id(id, &last_id);
  w.Varint(plan.buckets.size());
  for (const BucketRecallFigures& b : plan.buckets) {
    w.Signed(b.bucket);
    w.String(b.label);
    w.Signed(b.length_min);
    w.Signed(b.length_max);
    w.Signed(b.tokens);
    w.Double(b.predicted_recall);
    w.Double(b.default_recall);
  }
  w.Varint(plan.ranks.size());
  last_id = 0;
  for (const RankPlan& rank : plan.ranks) {
    w.Double(rank.predicted_seconds);
    w.Varint(rank.micro_batches.size());
    for (const MicroBatchPlan& mb : rank.micro_batches) {
      w.Double(mb.default_density);
      w.Signed(mb.tokens);
      w.Double(mb.predicted_seconds);
      w.Byte(mb.features_known ? 1 : 0);
      for (double v : {mb.features.active_blocks, mb.features.tokens, mb.features.documents,
                       mb.features.exchange_bytes}) {
        w.Double(v);
      }
      w.Varint(mb.samples.size());
      for (const PlannedSample& s : mb.samples) PutSample(s, &last_id, w, layer_hash);
    }
  }
}

// The samples' vectors are sized before their samples are read and never after, so the pointers
// in `left_out` stay valid.
bool GetPlan(Reader& r, StepPlan* plan, std::vector<PlannedSample*>* left_out) {
  uint64_t policy = 0;
  uint8_t locally = 0;
  if (!r.Varint(&policy) || !r.Byte(&locally)) return false;
  plan->policy = static_cast<Policy>(policy);
  plan->planned_locally = locally != 0;
  for (double* v :
       {&plan->makespan_seconds, &plan->lower_bound_seconds, &plan->gap, &plan->imbalance_ratio,
        &plan->bubble_ratio, &plan->mean_density, &plan->predicted_recall}) {
    if (!r.Double(v)) return false;
  }
  size_t n = 0;
  if (!r.Count(&n)) return false;
  plan->deferred_ids.resize(n);
  uint64_t last_id = 0;
  for (uint64_t& id : plan->deferred_ids) {
    if (!r.Id(&id, &last_id)) return false;
  }
  if (!r.Count(&n)) return false;
  plan->buckets.resize(n);
  for (BucketRecallFigures& b : plan->buckets) {
    if (!r.SignedAs(&b.bucket) || !r.String(&b.label) || !r.Signed(&b.length_min) ||
        !r.Signed(&b.length_max) || !r.Signed(&b.tokens) || !r.Double(&b.predicted_recall) ||
        !r.Double(&b.default_recall)) {
      return false;
    }
  }
  if (!r.Count(&n)) return false;
  plan->ranks.resize(n);
  last_id = 0;
  for (RankPlan& rank : plan->ranks) {
    if (!r.Double(&rank.predicted_seconds) || !r.Count(&n)) return false;
    rank.micro_batches.resize(n);
    for (MicroBatchPlan& mb : rank.micro_batches) {
      uint8_t known = 0;
      if (!r.Double(&mb.default_density) || !r.Signed(&mb.tokens) ||
          !r.Double(&mb.predicted_seconds) || !r.Byte(&known) ||
          !r.Double(&mb.features.active_blocks) || !r.Double(&mb.features.tokens) ||
          !r.Double(&mb.features.documents) || !r.Double(&mb.features.exchange_bytes) ||
          !r.Count(&n)) {
        return false;
      }
      mb.features_known = known != 0;
      mb.samples.resize(n);
      for (PlannedSample& s : mb.samples) {
        if (!GetSample(r, &last_id, &s, left_out)) return false;
      }
    }
  }
  return true;
}

// The ranks that reported, in rank order: each with its timings and its wait.
void PutReports(const StepReports& reports, Writer& w) {
  w.Varint(static_cast<uint64_t>(reports.count()));
  uint64_t last_id = 0;
  for (int rank = 0; rank < reports.slots(); ++rank) {
    if (!reports.has(rank)) continue;
    const std::vector<MicroBatchTiming>& timings = reports.timings(rank);
    w.Signed(rank);
    w.Double(reports.wait_seconds(rank));
    w.Varint(timings.size());
    for (const MicroBatchTiming& m : timings) {
      w.Signed(m.micro_batch);
      for (double v : {m.compute_seconds, m.attention_seconds, m.achieved_density, m.recall,
                       m.recall_seconds, m.exchange_seconds}) {
        w.Double(v);
      }
      w.Signed(m.tokens);
      w.Varint(m.documents.size());
      for (const DocumentRecallMeasurement& d : m.documents) {
        w.Id(d.sample_id, &last_id);
        w.Signed(d.document);
        w.Double(d.recall);
        w.Signed(d.rows);
        w.Varint(d.layer_recall.size());
        for (double v : d.layer_recall) w.Double(v);
      }
    }
  }
}

// Ranks ascend and none is negative or repeated: what PutReports writes.
bool GetReports(Reader& r, StepReports* reports) {
  size_t ranks = 0;
  if (!r.Count(&ranks)) return false;
  uint64_t last_id = 0;
  int last_rank = -1;
  for (size_t i = 0; i < ranks; ++i) {
    int rank = 0;
    double wait_seconds = 0.0;
    size_t n = 0;
    if (!r.SignedAs(&rank) || rank <= last_rank || !r.Double(&wait_seconds) || !r.Count(&n)) {
      return false;
    }
    last_rank = rank;
    std::vector<MicroBatchTiming> timings(n);
    for (MicroBatchTiming& m : timings) {
      if (!r.SignedAs(&m.micro_batch) || !r.Double(&m.compute_seconds) ||
          !r.Double(&m.attention_seconds) || !r.Double(&m.achieved_density) ||
          !r.Double(&m.recall) || !r.Double(&m.recall_seconds) || !r.Double(&m.exchange_seconds) ||
          !r.Signed(&m.tokens) || !r.Count(&n)) {
        return false;
      }
      m.documents.resize(n);
      for (DocumentRecallMeasurement& d : m.documents) {
        if (!r.Id(&d.sample_id, &last_id) || !r.SignedAs(&d.document) || !r.Double(&d.recall) ||
            !r.SignedAs(&d.rows) || !r.Count(&n)) {
          return false;
        }
        d.layer_recall.resize(n);
        for (double& v : d.layer_recall) {
          if (!r.Double(&v)) return false;
        }
      }
    }
    reports->Put(rank, std::move(timings), wait_seconds);
  }
  return true;
}

}  // namespace

bool RecipeGivesLayerDensities(const std::vector<Sample>& batch, const StepPlan& plan,
                               const LayerDensityRecipe& recipe) {
  const SamplesById index = IndexSamplesById(batch);
  std::vector<double> again;
  bool any = false;
  for (const RankPlan& rank : plan.ranks) {
    for (const MicroBatchPlan& mb : rank.micro_batches) {
      for (const PlannedSample& p : mb.samples) {
        if (p.layer_densities.empty()) continue;
        const auto s = index.find(p.id);
        if (s == index.end()) return false;
        PlannedLayerDensities(*s->second, p.density, recipe.config, recipe.recall, &again);
        // Bit for bit (-0.0 and NaN payloads included), as the packed step's hash compares.
        if (again.size() != p.layer_densities.size() ||
            std::memcmp(again.data(), p.layer_densities.data(), again.size() * sizeof(double)) !=
                0) {
          return false;
        }
        any = true;
      }
    }
  }
  return any;
}

std::string PackStep(const std::vector<Sample>& batch, const StepPlan& plan,
                     const StepReports& reports, const LayerDensityRecipe* layers) {
  Writer w;
  PutBatch(batch, w);
  uint64_t layer_hash = kLayerHashSeed;
  PutPlan(plan, w, layers != nullptr ? &layer_hash : nullptr);
  w.Varint(layers != nullptr ? layer_hash : 0);
  PutReports(reports, w);
  std::string bytes = w.Take();
  bytes.shrink_to_fit();
  return bytes;
}

absl::StatusOr<PackedStepContents> UnpackStep(absl::string_view bytes,
                                              const LayerDensityRecipe* layers) {
  PackedStepContents step;
  Reader r(bytes);
  std::vector<PlannedSample*> left_out;
  uint64_t layer_hash = 0;
  if (!GetBatch(r, &step.batch) || !GetPlan(r, &step.plan, &left_out) || !r.Varint(&layer_hash) ||
      !GetReports(r, &step.reports) || !r.done()) {
    return absl::InternalError(absl::StrCat("a packed step of ", bytes.size(),
                                            " bytes does not unpack (at byte ",
                                            std::min(r.pos(), bytes.size()), ")"));
  }
  if (left_out.empty()) return step;
  if (layers == nullptr) {
    return absl::InternalError(
        "a packed step's per-layer densities were left out and no recipe was given to compute "
        "them");
  }
  // Each left-out sample's densities as BuildPlan made them.
  const SamplesById index = IndexSamplesById(step.batch);
  uint64_t hash = kLayerHashSeed;
  for (PlannedSample* p : left_out) {
    const auto found = index.find(p->id);
    if (found == index.end()) {
      return absl::InternalError(
          absl::StrCat("a packed step's planned sample id ", p->id, " is not in its batch"));
    }
    const Sample& s = *found->second;
    const size_t count = p->layer_densities.size();
    PlannedLayerDensities(s, p->density, layers->config, layers->recall, &p->layer_densities);
    if (p->layer_densities.size() != count) {
      return absl::InternalError(absl::StrCat("sample id ", p->id, " had ", count,
                                              " layer densities and its recipe gives ",
                                              p->layer_densities.size()));
    }
    hash = HashLayerDensities(p->layer_densities, hash);
  }
  if (hash != layer_hash) {
    return absl::InternalError(
        "a packed step's per-layer densities computed again differ from the ones it was planned "
        "with (the recipe is not the step's)");
  }
  return step;
}

}  // namespace sparsebalance
