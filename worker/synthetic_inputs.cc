#include "worker/synthetic_inputs.h"

#include <algorithm>
#include <cmath>

#include "planner/random.h"

namespace sparsebalance {
namespace {

// A unit vector of `dim` Gaussian components.
std::vector<float> UnitVector(Rng& rng, int dim) {
  std::vector<float> out(dim);
  double norm = 0.0;
  for (float& x : out) {
    x = static_cast<float>(rng.Normal());
    norm += double{x} * x;
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(std::max(norm, 1e-12)));
  for (float& x : out) x *= scale;
  return out;
}

void AddScaled(float* dst, const std::vector<float>& direction, float scale) {
  for (size_t d = 0; d < direction.size(); ++d) dst[d] += scale * direction[d];
}

}  // namespace

DocumentTensors MakeDocument(uint64_t id, int64_t length, int heads, int head_dim) {
  DocumentTensors doc;
  const size_t size = static_cast<size_t>(length) * heads * head_dim;
  doc.q.resize(size);
  doc.k.resize(size);
  doc.v.resize(size);
  // Scores are q.k / sqrt(head_dim): strengths are in units of sqrt(head_dim).
  const float unit = std::sqrt(static_cast<float>(head_dim));
  const float noise = 0.5f;
  for (int h = 0; h < heads; ++h) {
    Rng rng(id * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(h) * 0xBF58476D1CE4E5B9ULL + 1);
    const std::vector<float> sink = UnitVector(rng, head_dim);
    std::vector<float> drift = UnitVector(rng, head_dim);
    struct Needle {
      int64_t key;
      int64_t query;
      std::vector<float> direction;
    };
    std::vector<Needle> needles;
    if (length >= 4) {
      const int64_t half = length / 2;  // needle keys in the first half, queries in the second
      for (int r = 0; r < kRetrievalsPerHead; ++r) {
        const int64_t key = 1 + static_cast<int64_t>(rng.Uniform() * static_cast<double>(half - 1));
        const int64_t query =
            half + static_cast<int64_t>(rng.Uniform() * static_cast<double>(half - 1));
        needles.push_back({key, query, UnitVector(rng, head_dim)});
        doc.needle_queries.push_back(query);
      }
    }
    for (int64_t t = 0; t < length; ++t) {
      // The locality direction drifts a little each token (a random walk, renormalised).
      if (t % 16 == 0) {
        const std::vector<float> step = UnitVector(rng, head_dim);
        double norm = 0.0;
        for (int d = 0; d < head_dim; ++d) {
          drift[d] = 0.9f * drift[d] + 0.44f * step[d];
          norm += double{drift[d]} * drift[d];
        }
        const float scale = static_cast<float>(1.0 / std::sqrt(norm));
        for (float& x : drift) x *= scale;
      }
      const size_t at = (static_cast<size_t>(t) * heads + h) * head_dim;
      for (int d = 0; d < head_dim; ++d) {
        doc.q[at + d] = noise * static_cast<float>(rng.Normal());
        doc.k[at + d] = noise * static_cast<float>(rng.Normal());
        doc.v[at + d] = static_cast<float>(rng.Normal());
      }
      AddScaled(&doc.q[at], drift, 1.2f * std::sqrt(unit));
      AddScaled(&doc.k[at], drift, 1.2f * std::sqrt(unit));
      AddScaled(&doc.q[at], sink, 0.8f * std::sqrt(unit));
      if (t == 0) AddScaled(&doc.k[at], sink, 3.0f * std::sqrt(unit));
    }
    for (const Needle& n : needles) {
      AddScaled(&doc.k[(static_cast<size_t>(n.key) * heads + h) * head_dim], n.direction,
                4.0f * std::sqrt(unit));
      AddScaled(&doc.q[(static_cast<size_t>(n.query) * heads + h) * head_dim], n.direction,
                4.0f * std::sqrt(unit));
    }
  }
  return doc;
}

void VarlenBatch::Append(const DocumentTensors& doc, int64_t length) {
  cu_seqlens.push_back(cu_seqlens.back() + static_cast<int32_t>(length));
  q.insert(q.end(), doc.q.begin(), doc.q.end());
  k.insert(k.end(), doc.k.begin(), doc.k.end());
  v.insert(v.end(), doc.v.begin(), doc.v.end());
}

}  // namespace sparsebalance
