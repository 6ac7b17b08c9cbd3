// Test helpers for tests/kernels: deterministic inputs and a naive O(L^2) attention in double
// precision with an optional block mask (the kernels' definition, written the slow way).
#ifndef SPARSEBALANCE_TESTS_KERNELS_REFERENCE_H_
#define SPARSEBALANCE_TESTS_KERNELS_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/block_index.h"

namespace sparsebalance {
namespace kernels {
namespace testing {

inline std::vector<float> RandomTensor(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

inline std::vector<int32_t> CuSeqlens(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> cu(1, 0);
  for (int32_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

// Varlen attention inputs: documents of the given lengths, `heads` x `head_dim` per token, and
// random q, k, v and dout (seeds seed, seed + 1, seed + 2, seed + 3).
struct Problem {
  std::vector<int32_t> cu;
  int heads = 0;
  int head_dim = 0;
  std::vector<float> q, k, v, dout;
};

inline Problem MakeProblem(const std::vector<int32_t>& lengths, int heads, int head_dim,
                           uint32_t seed) {
  Problem p;
  p.cu = CuSeqlens(lengths);
  p.heads = heads;
  p.head_dim = head_dim;
  const size_t n = static_cast<size_t>(p.cu.back()) * heads * head_dim;
  p.q = RandomTensor(n, seed);
  p.k = RandomTensor(n, seed + 1);
  p.v = RandomTensor(n, seed + 2);
  p.dout = RandomTensor(n, seed + 3);
  return p;
}

// kept[s][h][i][j]: whether query block i of (sequence s, head h) keeps key block j.
struct BlockMask {
  std::vector<std::vector<std::vector<std::vector<char>>>> kept;

  static BlockMask FromIndex(const BlockIndex& index) {
    BlockMask mask;
    mask.kept.resize(index.sequences());
    for (int s = 0; s < index.sequences(); ++s) {
      const int32_t n = index.blocks(s);
      mask.kept[s].assign(index.heads, std::vector<std::vector<char>>(n, std::vector<char>(n, 0)));
      for (int h = 0; h < index.heads; ++h) {
        for (int32_t i = 0; i < n; ++i) {
          const int64_t r = index.RowId(s, h, i);
          for (int64_t e = index.row_ptr[r]; e < index.row_ptr[r + 1]; ++e) {
            mask.kept[s][h][i][index.col_idx[e]] = 1;
          }
        }
      }
    }
    return mask;
  }
};

struct DenseResult {
  std::vector<double> out, lse, dq, dk, dv;
};

// Causal attention per document in double; keys outside the mask are dropped. With `dout`
// non-empty also the gradients of sum(out * dout).
inline DenseResult DenseAttention(const std::vector<int32_t>& cu_seqlens, int heads, int head_dim,
                                  int block_size, const BlockMask& mask,
                                  const std::vector<float>& q, const std::vector<float>& k,
                                  const std::vector<float>& v, const std::vector<float>& dout,
                                  double scale) {
  const int64_t total = cu_seqlens.back();
  const int64_t stride = int64_t{heads} * head_dim;
  DenseResult r;
  r.out.assign(total * stride, 0.0);
  r.lse.assign(total * heads, -INFINITY);
  const bool backward = !dout.empty();
  if (backward) {
    r.dq.assign(total * stride, 0.0);
    r.dk.assign(total * stride, 0.0);
    r.dv.assign(total * stride, 0.0);
  }
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t start = cu_seqlens[s];
    const int64_t length = cu_seqlens[s + 1] - start;
    for (int h = 0; h < heads; ++h) {
      auto at = [&](int64_t token, int d) { return (start + token) * stride + h * head_dim + d; };
      for (int64_t t = 0; t < length; ++t) {
        std::vector<double> p(t + 1, 0.0);
        std::vector<char> visible(t + 1, 0);
        double max_logit = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {
          visible[u] = mask.kept.empty() || mask.kept[s][h][t / block_size][u / block_size];
          if (!visible[u]) continue;
          double dot = 0.0;
          for (int d = 0; d < head_dim; ++d) dot += double{q[at(t, d)]} * k[at(u, d)];
          p[u] = dot * scale;
          max_logit = std::max(max_logit, p[u]);
        }
        if (max_logit == -INFINITY) continue;  // nothing kept: out 0
        double sum = 0.0;
        for (int64_t u = 0; u <= t; ++u) {
          p[u] = visible[u] ? std::exp(p[u] - max_logit) : 0.0;
          sum += p[u];
        }
        for (int64_t u = 0; u <= t; ++u) p[u] /= sum;
        r.lse[h * total + start + t] = max_logit + std::log(sum);
        for (int64_t u = 0; u <= t; ++u) {
          for (int d = 0; d < head_dim; ++d) r.out[at(t, d)] += p[u] * v[at(u, d)];
        }
        if (!backward) continue;
        double delta = 0.0;
        for (int d = 0; d < head_dim; ++d) delta += double{dout[at(t, d)]} * r.out[at(t, d)];
        for (int64_t u = 0; u <= t; ++u) {
          if (p[u] == 0.0) continue;
          double dp = 0.0;
          for (int d = 0; d < head_dim; ++d) dp += double{dout[at(t, d)]} * v[at(u, d)];
          const double ds = p[u] * (dp - delta) * scale;
          for (int d = 0; d < head_dim; ++d) {
            r.dq[at(t, d)] += ds * k[at(u, d)];
            r.dk[at(u, d)] += ds * q[at(t, d)];
            r.dv[at(u, d)] += p[u] * dout[at(t, d)];
          }
        }
      }
    }
  }
  return r;
}

template <typename A, typename B>
double MaxAbsDiff(const A& a, const B& b) {
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(double{a[i]} - double{b[i]}));
  }
  return worst;
}

template <typename A, typename B>
double RelativeL2(const A& a, const B& b) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double{a[i]} - double{b[i]}) * (double{a[i]} - double{b[i]});
    norm += double{b[i]} * double{b[i]};
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

}  // namespace testing
}  // namespace kernels
}  // namespace sparsebalance

#endif  // SPARSEBALANCE_TESTS_KERNELS_REFERENCE_H_
