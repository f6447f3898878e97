// The package's matrix products on the CPU: every float32 and float64 product PyTorch
// computes (mm, addmm, bmm, baddbmm, mv, addmv, dot; out=, in place and .dtype overloads)
// summed by the package's own kernels (gemm.h), each entry one fused multiply-add chain over
// the inner dimension in order: the same bits on every CPU, whatever its vector width, its
// thread count or the other rows of the product. minigpt/products.py says why; this file
// hands PyTorch's tensors to gemm.h and registers the kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/addmv_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <unistd.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gemm.h"

namespace {

// The census: every distinct product computed while one is open, as a line of JSON
// [kind, a's shape, a's strides, b's shape, b's strides, the bias's shape or null, its
// strides or null, dtype, torch threads, alpha, beta]. `MINIGPT_CENSUS`, a folder, appends
// each new line to <folder>/<pid>.jsonl as well (the build's record of the chapters).
std::mutex census_lock;
std::map<int64_t, std::set<std::string>> open_censuses;
int64_t next_census = 0;
std::set<std::string> journaled;
bool journal_checked = false;
std::string journal_path;

std::string json_list(at::IntArrayRef values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i ? "," : "") << values[i];
  out << "]";
  return out.str();
}

// Whether products are being recorded: a census is open, or MINIGPT_CENSUS journals them.
bool recording() {
  std::lock_guard<std::mutex> guard(census_lock);
  if (!journal_checked) {
    journal_checked = true;
    if (const char* folder = std::getenv("MINIGPT_CENSUS")) {
      journal_path = std::string(folder) + "/" + std::to_string(getpid()) + ".jsonl";
    }
  }
  return !open_censuses.empty() || !journal_path.empty();
}

// One product's census line, from its operands' shapes and strides.
void record_shapes(bool batched, at::IntArrayRef a_sizes, at::IntArrayRef a_strides,
                   at::IntArrayRef b_sizes, at::IntArrayRef b_strides,
                   const std::optional<at::Tensor>& bias, bool float64, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  if (!recording()) return;
  std::ostringstream line;
  line.precision(17);
  line << "[\"" << (batched ? "bmm" : "mm") << "\"," << json_list(a_sizes) << ","
       << json_list(a_strides) << "," << json_list(b_sizes) << "," << json_list(b_strides)
       << ",";
  if (bias.has_value()) {
    line << json_list(bias->sizes()) << "," << json_list(bias->strides());
  } else {
    line << "null,null";
  }
  line << ",\"" << (float64 ? "float64" : "float32") << "\"," << at::get_num_threads() << ","
       << alpha.toDouble() << "," << beta.toDouble() << "]";
  const std::string entry = line.str();
  std::lock_guard<std::mutex> guard(census_lock);
  for (auto& census : open_censuses) census.second.insert(entry);
  if (!journal_path.empty() && journaled.insert(entry).second) {
    std::ofstream(journal_path, std::ios::app) << entry << "\n";
  }
}

void record(bool batched, const at::Tensor& a, const at::Tensor& b,
            const std::optional<at::Tensor>& bias, const at::Scalar& beta,
            const at::Scalar& alpha) {
  record_shapes(batched, a.sizes(), a.strides(), b.sizes(), b.strides(), bias,
                a.scalar_type() == at::kDouble, beta, alpha);
}

// The path the kernels run (MINIGPT_GEMM_PATH forces one, for the tests), read once; a path
// this CPU cannot run is an error where a product is first computed.
minigpt::gemm::Path chosen_path() {
  static const minigpt::gemm::Path path = minigpt::gemm::path_from_env();
  return path;
}

// Products smaller than this many multiply-adds run on the calling thread alone: threads
// change how fast a product is computed, never its bits (each entry is one chain).
constexpr int64_t PARALLEL_WORK = 1 << 18;

// out (n, M, N) contiguous = alpha a b + beta bias, for a (n, M, K), b (n, K, N) and the
// bias (n, M, N, any strides, 0 for a broadcast, or undefined), all of type T: the batches'
// and rectangles' chains on PyTorch's threads (`minigpt::gemm::split`).
template <typename T>
void chains(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, at::Tensor& out,
            double alpha, double beta) {
  const int64_t n = a.size(0), m = a.size(1), k = a.size(2), cols = b.size(2);
  const T* pa = a.const_data_ptr<T>();
  const T* pb = b.const_data_ptr<T>();
  const T* pbias = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
  T* po = out.data_ptr<T>();
  const int threads = n * m * cols * k < PARALLEL_WORK ? 1 : at::get_num_threads();
  const auto rects = minigpt::gemm::split(m, cols, std::max<int64_t>(1, threads / n));
  const auto path = chosen_path();
  TORCH_CHECK(minigpt::gemm::supported(path), "MINIGPT_GEMM_PATH=",
              minigpt::gemm::path_name(path), ": this CPU cannot run that path");
  const int64_t parts = n * static_cast<int64_t>(rects.size());
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t s = q / static_cast<int64_t>(rects.size());
      minigpt::gemm::Product<T> pr;
      pr.M = m, pr.N = cols, pr.K = k;
      pr.a = pa + s * a.stride(0), pr.a_row = a.stride(1), pr.a_col = a.stride(2);
      pr.b = pb + s * b.stride(0), pr.b_row = b.stride(1), pr.b_col = b.stride(2);
      pr.c = po + s * m * cols, pr.ldc = cols;
      if (pbias) {
        pr.bias = pbias + s * bias.stride(0);
        pr.bias_row = bias.stride(1), pr.bias_col = bias.stride(2);
      }
      pr.alpha = static_cast<T>(alpha), pr.beta = static_cast<T>(beta);
      minigpt::gemm::compute(pr, rects[q % rects.size()], path);
    }
  };
  if (threads == 1 || parts == 1) {
    run(0, parts);
  } else {
    at::parallel_for(0, parts, 1, run);
  }
}

// beta bias + alpha A B for A (..., M, K) and B (..., K, N) (`batched`: one leading dimension).
at::Tensor product(bool batched, const at::Tensor& a, const at::Tensor& b,
                   const std::optional<at::Tensor>& bias, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  const int64_t dims = batched ? 3 : 2;
  const bool fits = a.dim() == dims && b.dim() == dims && a.size(-1) == b.size(-2) &&
                    (!batched || a.size(0) == b.size(0));
  const bool floating = a.scalar_type() == b.scalar_type() &&
                        (a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble);
  const bool same = a.scalar_type() == b.scalar_type() &&
                    (!bias.has_value() || bias->scalar_type() == a.scalar_type());
  TORCH_CHECK(!a.is_complex() && !b.is_complex(),
              "minigpt's matrix products sum real numbers in one order on every CPU; a complex "
              "product would take PyTorch's own kernel, in another order. Set "
              "MINIGPT_PRODUCTS=native before importing minigpt to use PyTorch's own products.");
  if (fits && same && a.is_floating_point() && !floating) {
    // bfloat16 or float16 (bf16 autocast): the operands widened to float32 (exactly), the
    // float32 product in the package's order, rounded once to the operands' type.
    std::optional<at::Tensor> wide_bias;
    if (bias.has_value()) wide_bias = bias->to(at::kFloat);
    return product(batched, a.to(at::kFloat), b.to(at::kFloat), wide_bias, beta, alpha)
        .to(a.scalar_type());
  }
  if (!fits || !floating || !same) {
    // Not a product of real floating operands of one type (integers: exact sums, in any
    // order), or not a product at all: PyTorch's own CPU kernel, and its own error.
    auto shape = a.sizes().vec();
    if (fits) shape.back() = b.size(-1);
    auto out = at::empty(fits ? at::IntArrayRef(shape) : at::IntArrayRef({0}), a.options());
    if (bias.has_value()) {
      if (batched) {
        at::cpu::baddbmm_out(out, *bias, a, b, beta, alpha);
      } else {
        at::cpu::addmm_out(out, *bias, a, b, beta, alpha);
      }
    } else if (batched) {
      at::cpu::bmm_out(out, a, b);
    } else {
      at::cpu::mm_out(out, a, b);
    }
    return out;
  }
  const int64_t m = a.size(-2), n = b.size(-1);
  auto shape = a.sizes().vec();
  shape.back() = n;
  auto out = at::empty(shape, a.options());
  at::Tensor wide_bias;
  if (bias.has_value() && beta.toDouble() != 0.0) {
    // The bias as (batches, M, N), broadcast where it is (stride 0); PyTorch's own error if
    // it does not broadcast. BLAS: beta 0 ignores the bias, NaN or not.
    wide_bias = batched ? bias->expand({a.size(0), m, n}) : bias->expand({m, n}).unsqueeze(0);
  }
  if (out.numel() == 0) return out;
  record(batched, a, b, bias, beta, alpha);
  auto a3 = batched ? a : a.unsqueeze(0), b3 = batched ? b : b.unsqueeze(0);
  auto out3 = batched ? out : out.unsqueeze(0);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "chains", [&] {
    chains<scalar_t>(a3, b3, wide_bias, out3, alpha.toDouble(), beta.toDouble());
  });
  return out;
}

at::Tensor mm_kernel(const at::Tensor& a, const at::Tensor& b) {
  return product(false, a, b, std::nullopt, 1, 1);
}

at::Tensor bmm_kernel(const at::Tensor& a, const at::Tensor& b) {
  return product(true, a, b, std::nullopt, 1, 1);
}

at::Tensor addmm_kernel(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  return product(false, a, b, bias, beta, alpha);
}

at::Tensor baddbmm_kernel(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                   const at::Scalar& beta, const at::Scalar& alpha) {
  return product(true, a, b, bias, beta, alpha);
}

at::Tensor mv_kernel(const at::Tensor& a, const at::Tensor& x) {
  if (a.dim() != 2 || x.dim() != 1) {  // not a matrix and a vector: PyTorch's own error
    auto out = at::empty({0}, a.options());
    return at::cpu::addmv_out(out, at::empty({0}, a.options()), a, x, 0, 1);
  }
  return mm_kernel(a, x.unsqueeze(1)).squeeze(1);
}

at::Tensor addmv_kernel(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& x,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  if (a.dim() != 2 || x.dim() != 1 || bias.dim() > 1) {  // PyTorch's own error, if any
    auto out = at::empty({0}, a.options());
    return at::cpu::addmv_out(out, bias, a, x, beta, alpha);
  }
  return product(false, a, x.unsqueeze(1), bias.unsqueeze(-1), beta, alpha).squeeze(1);
}

at::Tensor dot_kernel(const at::Tensor& x, const at::Tensor& y) {
  TORCH_CHECK(x.dim() == 1 && y.dim() == 1, "1D tensors expected, but got ", x.dim(),
              "D and ", y.dim(), "D tensors");
  TORCH_CHECK(x.numel() == y.numel(), "inconsistent tensor size, expected tensor [",
              x.numel(), "] and src [", y.numel(), "] to have the same number of elements, "
              "but got ", x.numel(), " and ", y.numel(), " elements respectively");
  return mm_kernel(x.unsqueeze(0), y.unsqueeze(1)).reshape({});
}

// The other roads to the same products: out= (what torch.compile's extern kernels and
// matmul(out=) call), in place (addmm_, baddbmm_, addmv_, and addbmm, which PyTorch's CPU
// kernel computes with addmm_), the float32 result of a narrower product (the .dtype
// overloads), and addmm fused with its activation: each computed by the kernels above, then
// written where it is asked for.
at::Tensor& written(at::Tensor& out, const at::Tensor& result) {
  TORCH_CHECK(out.scalar_type() == result.scalar_type(), "Expected out tensor to have dtype ",
              result.scalar_type(), ", but got ", out.scalar_type(), " instead");
  at::native::resize_output(out, result.sizes());
  out.copy_(result);
  return out;
}

at::Tensor& in_place(at::Tensor& self, const at::Tensor& result) {
  TORCH_CHECK(self.sizes() == result.sizes(), "the product's result of size ",
              result.sizes(), " cannot be written in place into a tensor of size ",
              self.sizes());
  self.copy_(result);
  return self;
}

at::Tensor& mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  return written(out, mm_kernel(a, b));
}

at::Tensor& bmm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  return written(out, bmm_kernel(a, b));
}

at::Tensor& addmm_out(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  return written(out, addmm_kernel(bias, a, b, beta, alpha));
}

at::Tensor& addmm_in_place(at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                           const at::Scalar& beta, const at::Scalar& alpha) {
  return in_place(self, addmm_kernel(self, a, b, beta, alpha));
}

at::Tensor& baddbmm_out(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                        const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  return written(out, baddbmm_kernel(bias, a, b, beta, alpha));
}

at::Tensor& baddbmm_in_place(at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                             const at::Scalar& beta, const at::Scalar& alpha) {
  return in_place(self, baddbmm_kernel(self, a, b, beta, alpha));
}

at::Tensor& mv_out(const at::Tensor& a, const at::Tensor& x, at::Tensor& out) {
  return written(out, mv_kernel(a, x));
}

at::Tensor& addmv_out(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& x,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  return written(out, addmv_kernel(bias, a, x, beta, alpha));
}

at::Tensor& addmv_in_place(at::Tensor& self, const at::Tensor& a, const at::Tensor& x,
                           const at::Scalar& beta, const at::Scalar& alpha) {
  return in_place(self, addmv_kernel(self, a, x, beta, alpha));
}

at::Tensor& dot_out(const at::Tensor& x, const at::Tensor& y, at::Tensor& out) {
  return written(out, dot_kernel(x, y));
}

// A product of ``a``'s type whose result is ``out_dtype`` (float32 from bfloat16 operands):
// computed in float32 (or float64) in the package's order, then given that type.
at::Tensor widened(const at::Tensor& a, at::ScalarType out_dtype) {
  return a.scalar_type() == out_dtype ? a : a.to(out_dtype);
}

at::Tensor mm_dtype(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  return mm_kernel(widened(a, out_dtype), widened(b, out_dtype));
}

at::Tensor bmm_dtype(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype) {
  return bmm_kernel(widened(a, out_dtype), widened(b, out_dtype));
}

at::Tensor addmm_dtype(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                       at::ScalarType out_dtype, const at::Scalar& beta,
                       const at::Scalar& alpha) {
  return addmm_kernel(widened(bias, out_dtype), widened(a, out_dtype), widened(b, out_dtype),
                      beta, alpha);
}

at::Tensor baddbmm_dtype(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                         at::ScalarType out_dtype, const at::Scalar& beta,
                         const at::Scalar& alpha) {
  return baddbmm_kernel(widened(bias, out_dtype), widened(a, out_dtype),
                        widened(b, out_dtype), beta, alpha);
}

at::Tensor& mm_dtype_out(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype,
                         at::Tensor& out) {
  return written(out, mm_dtype(a, b, out_dtype));
}

at::Tensor& bmm_dtype_out(const at::Tensor& a, const at::Tensor& b, at::ScalarType out_dtype,
                          at::Tensor& out) {
  return written(out, bmm_dtype(a, b, out_dtype));
}

at::Tensor& addmm_dtype_out(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                            at::ScalarType out_dtype, const at::Scalar& beta,
                            const at::Scalar& alpha, at::Tensor& out) {
  return written(out, addmm_dtype(bias, a, b, out_dtype, beta, alpha));
}

at::Tensor& baddbmm_dtype_out(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                              at::ScalarType out_dtype, const at::Scalar& beta,
                              const at::Scalar& alpha, at::Tensor& out) {
  return written(out, baddbmm_dtype(bias, a, b, out_dtype, beta, alpha));
}

at::Tensor addmm_activation(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b,
                            const at::Scalar& beta, const at::Scalar& alpha, bool use_gelu) {
  auto out = addmm_kernel(bias, a, b, beta, alpha);
  return use_gelu ? at::gelu(out, "tanh") : at::relu(out);
}

// ---- Attention's softmax over keys: one pass a row, the same bits on every CPU ----
//
// A row of scores s_0 .. s_{n-1} becomes weights, in this order (a masked key, where the
// mask is false, counts nowhere and gets weight 0, as a score of -inf would):
//   m = the maximum of the allowed scores (exact);  e_j = exp(s_j - m), `exp_floor` below;
//   z = e_0 + e_1 + ... + e_{n-1}, added left to right;  w_j = e_j / z.
// A masked key adds an exact zero to z, so a row's weights do not depend on how many masked
// keys follow the allowed ones: a query decoded alone with a key-value cache (P + 1 keys)
// gets the bits of the same query in a training forward (T keys, the later ones masked).
// The backward of the row: d = g_0 w_0 + ... + g_{n-1} w_{n-1}, one fused multiply-add chain
// left to right; then ds_j = w_j (g_j - d). Rows are independent, so threads (which split
// rows) never change a bit. Vectors hold neighbouring entries only where each entry's
// arithmetic is its own (the exp, the division, the backward's last line): the AVX-512, the
// AVX2 and the portable code compute the same operations, each rounded once, so the same bits.
namespace softmax {

// exp(x) for x <= 0: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a degree-7 polynomial
// (Cephes' expf coefficients), times 2^n. Below -87 (where 2^n would leave the normal
// floats) it is 0, which a weight e^-87 / z < 2e-38 rounds to anyway. NaN stays NaN.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;      // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in 9 bits
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kFloor = -87.0f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_floor(float x) {
  if (std::isnan(x)) return x;
  if (x < kFloor) return 0.0f;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kP[i]);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// The two chains of a row, for R rows side by side (so the CPU overlaps their latencies; each
// row's chain is its own, in order): z = the sum of w left to right, d = the fma chain of
// g w. Written once, compiled into the portable code and the AVX2 code alike (where
// std::fma is one instruction, and elsewhere a call of the C library's fmaf: the same
// rounding).
template <int R>
__attribute__((always_inline)) inline void sum_rows(float* const* w, int64_t n, float* z) {
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    for (int r = 0; r < R; ++r) acc[r] = acc[r] + w[r][j];
  }
  for (int r = 0; r < R; ++r) z[r] = acc[r];
}

template <int R>
__attribute__((always_inline)) inline void dot_rows(const float* const* g, float* const* w,
                                                    int64_t n, float* d) {
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    for (int r = 0; r < R; ++r) acc[r] = std::fma(g[r][j], w[r][j], acc[r]);
  }
  for (int r = 0; r < R; ++r) d[r] = acc[r];
}

// One row's weights without their division (the portable code): e_j, 0 where masked; and
// its maximum, over the allowed keys. `keep` as `Rows` says.
inline void exps_portable(const float* s, const bool* keep, int64_t keep_stride, float* w,
                          int64_t n) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if ((keep == nullptr || keep[j * keep_stride]) && s[j] > m) m = s[j];
  }
  for (int64_t j = 0; j < n; ++j) {
    w[j] = keep == nullptr || keep[j * keep_stride] ? exp_floor(s[j] - m) : 0.0f;
  }
}

// R rows of attention: their scores, weights, mask rows (null: none masked; else the row's
// keys at keep[j * keep_stride]), how many keys each row's mask can allow (`seen`: every key
// from there on is masked, as a causal row's future is), and, for the backward, the gradients.
template <int R>
struct Rows {
  const float* s[R];
  float* w[R];
  const bool* keep[R];
  int64_t keep_stride;
  int64_t seen[R];
  const float* g[R];
  float* ds[R];
};

// The forward's last two steps, z and w_j = e_j / z, for rows whose e_j (`exps`, 0 where
// masked) are written up to `seen` and 0 after it: those zeros add exact zeros to z (so the
// sum stops at the longest row's `seen`) and stay 0 when divided, unless z is NaN, which
// makes every weight of its row NaN. `divide(w, zr, count)` divides count weights by z.
template <int R, typename Divide>
__attribute__((always_inline)) inline void normalise(const Rows<R>& rows, int64_t n,
                                                     Divide&& divide) {
  int64_t longest = 0;
  for (int r = 0; r < R; ++r) {
    std::fill(rows.w[r] + rows.seen[r], rows.w[r] + n, 0.0f);
    longest = std::max(longest, rows.seen[r]);
  }
  float z[R];
  sum_rows<R>(rows.w, longest, z);
  for (int r = 0; r < R; ++r) {
    divide(rows.w[r], z[r], std::isnan(z[r]) ? n : rows.seen[r]);
  }
}

template <int R>
void forward_portable(const Rows<R>& rows, int64_t n) {
  for (int r = 0; r < R; ++r) {
    exps_portable(rows.s[r], rows.keep[r], rows.keep_stride, rows.w[r], rows.seen[r]);
  }
  normalise<R>(rows, n, [](float* w, float z, int64_t count) {
    for (int64_t j = 0; j < count; ++j) w[j] = w[j] / z;
  });
}

template <int R>
void backward_portable(const Rows<R>& rows, int64_t n) {
  float d[R];
  dot_rows<R>(rows.g, rows.w, n, d);
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < n; ++j) rows.ds[r][j] = rows.w[r][j] * (rows.g[r][j] - d[r]);
  }
}

#if MINIGPT_GEMM_X86
#define MINIGPT_SOFTMAX_AVX2 __attribute__((target("avx2,fma")))

MINIGPT_SOFTMAX_AVX2 inline __m256 exp_floor8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
                                 _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  // Below the floor: 0 (a NaN compares false and stays the NaN the arithmetic made).
  const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(kFloor), _CMP_LT_OQ);
  return _mm256_andnot_ps(below, e);
}

// All ones in the lanes of the 8 keys from keep[0] that are allowed (booleans, one byte each).
MINIGPT_SOFTMAX_AVX2 inline __m256 allowed8(const bool* keep) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(keep));
  return _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256()));
}

// exps_portable's e_j, 8 keys at a time (the mask's keys adjacent, keep_stride 1, or none).
// The maximum is exact in any order, so it is taken 8 lanes at a time too.
// All ones in the first `count` (0 to 8) of 8 lanes.
MINIGPT_SOFTMAX_AVX2 inline __m256i lanes8(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

MINIGPT_SOFTMAX_AVX2 void exps_avx2(const float* s, const bool* keep, float* w, int64_t n) {
  const __m256 none = _mm256_set1_ps(-INFINITY);
  __m256 most = none;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 x = _mm256_loadu_ps(s + j);
    if (keep != nullptr) x = _mm256_blendv_ps(none, x, allowed8(keep + j));
    most = _mm256_max_ps(most, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  float m = -INFINITY;
  for (float lane : lanes) m = lane > m ? lane : m;
  for (int64_t t = j; t < n; ++t) {
    if ((keep == nullptr || keep[t]) && s[t] > m) m = s[t];
  }
  j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp_floor8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
    if (keep != nullptr) e = _mm256_and_ps(e, allowed8(keep + j));
    _mm256_storeu_ps(w + j, e);
  }
  if (keep == nullptr && j < n) {  // the last keys (fewer than 8) in one more vector's lanes
    const __m256i tail = lanes8(n - j);
    const __m256 x = _mm256_sub_ps(_mm256_maskload_ps(s + j, tail), _mm256_set1_ps(m));
    _mm256_maskstore_ps(w + j, tail, exp_floor8(x));
    return;
  }
  for (; j < n; ++j) w[j] = keep == nullptr || keep[j] ? exp_floor(s[j] - m) : 0.0f;
}

template <int R>
MINIGPT_SOFTMAX_AVX2 void forward_avx2(const Rows<R>& rows, int64_t n) {
  for (int r = 0; r < R; ++r) {
    if (rows.keep[r] == nullptr || rows.keep_stride == 1) {
      exps_avx2(rows.s[r], rows.keep[r], rows.w[r], rows.seen[r]);
    } else {
      exps_portable(rows.s[r], rows.keep[r], rows.keep_stride, rows.w[r], rows.seen[r]);
    }
  }
  normalise<R>(rows, n, [](float* w, float z, int64_t count) MINIGPT_SOFTMAX_AVX2 {
    const __m256 zr = _mm256_set1_ps(z);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
      _mm256_storeu_ps(w + j, _mm256_div_ps(_mm256_loadu_ps(w + j), zr));
    }
    if (j < count) {
      const __m256i tail = lanes8(count - j);
      _mm256_maskstore_ps(w + j, tail, _mm256_div_ps(_mm256_maskload_ps(w + j, tail), zr));
    }
  });
}

template <int R>
MINIGPT_SOFTMAX_AVX2 void backward_avx2(const Rows<R>& rows, int64_t n) {
  float d[R];
  dot_rows<R>(rows.g, rows.w, n, d);
  for (int r = 0; r < R; ++r) {
    const float *w = rows.w[r], *g = rows.g[r];
    float* ds = rows.ds[r];
    const __m256 dr = _mm256_set1_ps(d[r]);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const __m256 gap = _mm256_sub_ps(_mm256_loadu_ps(g + j), dr);
      _mm256_storeu_ps(ds + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), gap));
    }
    for (; j < n; ++j) ds[j] = w[j] * (g[j] - d[r]);
  }
}

// The same, 16 keys at a time, for CPUs with AVX-512: each lane computes exp_floor8's
// operations on its own key, so the same bits.
#define MINIGPT_SOFTMAX_AVX512 __attribute__((target("avx512f")))

MINIGPT_SOFTMAX_AVX512 inline __m512 exp_floor16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
                                 _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kFloor), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~below), e);
}

// The lanes of the 16 keys from keep[0] that are allowed.
MINIGPT_SOFTMAX_AVX512 inline __mmask16 allowed16(const bool* keep) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keep));
  return _mm512_cmpneq_epi32_mask(_mm512_cvtepu8_epi32(bytes), _mm512_setzero_si512());
}

MINIGPT_SOFTMAX_AVX512 void exps_avx512(const float* s, const bool* keep, float* w,
                                        int64_t n) {
  const __m512 none = _mm512_set1_ps(-INFINITY);
  __m512 most = none;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 x = _mm512_loadu_ps(s + j);
    if (keep != nullptr) x = _mm512_mask_blend_ps(allowed16(keep + j), none, x);
    most = _mm512_max_ps(most, x);
  }
  // Without a mask, the last keys (fewer than 16) in the lanes of one more vector.
  const auto tail = static_cast<__mmask16>((1u << (n - j)) - 1u);
  if (keep == nullptr && j < n) most = _mm512_mask_max_ps(most, tail, most,
                                                          _mm512_maskz_loadu_ps(tail, s + j));
  float m = _mm512_reduce_max_ps(most);
  for (int64_t t = keep == nullptr ? n : j; t < n; ++t) {
    if (keep[t] && s[t] > m) m = s[t];
  }
  const __m512 shift = _mm512_set1_ps(m);
  j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_floor16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
    _mm512_storeu_ps(w + j, keep != nullptr ? _mm512_maskz_mov_ps(allowed16(keep + j), e) : e);
  }
  if (keep == nullptr && j < n) {
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), shift);
    _mm512_mask_storeu_ps(w + j, tail, exp_floor16(x));
    return;
  }
  for (; j < n; ++j) w[j] = keep == nullptr || keep[j] ? exp_floor(s[j] - m) : 0.0f;
}

template <int R>
MINIGPT_SOFTMAX_AVX512 void forward_avx512(const Rows<R>& rows, int64_t n) {
  for (int r = 0; r < R; ++r) {
    if (rows.keep[r] == nullptr || rows.keep_stride == 1) {
      exps_avx512(rows.s[r], rows.keep[r], rows.w[r], rows.seen[r]);
    } else {
      exps_portable(rows.s[r], rows.keep[r], rows.keep_stride, rows.w[r], rows.seen[r]);
    }
  }
  normalise<R>(rows, n, [](float* w, float z, int64_t count) MINIGPT_SOFTMAX_AVX512 {
    const __m512 zr = _mm512_set1_ps(z);
    int64_t j = 0;
    for (; j + 16 <= count; j += 16) {
      _mm512_storeu_ps(w + j, _mm512_div_ps(_mm512_loadu_ps(w + j), zr));
    }
    if (j < count) {
      const auto tail = static_cast<__mmask16>((1u << (count - j)) - 1u);
      _mm512_mask_storeu_ps(w + j, tail, _mm512_div_ps(_mm512_maskz_loadu_ps(tail, w + j), zr));
    }
  });
}

template <int R>
MINIGPT_SOFTMAX_AVX512 void backward_avx512(const Rows<R>& rows, int64_t n) {
  float d[R];
  dot_rows<R>(rows.g, rows.w, n, d);
  for (int r = 0; r < R; ++r) {
    const float *w = rows.w[r], *g = rows.g[r];
    float* ds = rows.ds[r];
    const __m512 dr = _mm512_set1_ps(d[r]);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 gap = _mm512_sub_ps(_mm512_loadu_ps(g + j), dr);
      _mm512_storeu_ps(ds + j, _mm512_mul_ps(_mm512_loadu_ps(w + j), gap));
    }
    for (; j < n; ++j) ds[j] = w[j] * (g[j] - d[r]);
  }
}
#endif

// Rows on PyTorch's threads, at least this many entries a task; within a task, `kGroup` rows
// at a time (their chains side by side: enough to keep the CPU's adders busy while each chain
// waits on its previous add). `rows_at(r, rows)` fills row r of a group; `run(group)`
// computes it.
constexpr int64_t ROW_WORK = 1 << 15;
constexpr int kGroup = 8;

template <typename Fill>
void over_rows(int64_t count, int64_t n, bool backward, Fill&& rows_at) {
  const auto path = chosen_path();
  TORCH_CHECK(minigpt::gemm::supported(path), "MINIGPT_GEMM_PATH=",
              minigpt::gemm::path_name(path), ": this CPU cannot run that path");
  const auto resolved = minigpt::gemm::resolve(path);
  const bool vector = resolved != minigpt::gemm::Path::portable;
  auto run = [&](auto& group) {
#if MINIGPT_GEMM_X86
    if (resolved == minigpt::gemm::Path::avx512) {
      backward ? backward_avx512(group, n) : forward_avx512(group, n);
      return;
    }
    if (vector) {
      backward ? backward_avx2(group, n) : forward_avx2(group, n);
      return;
    }
#endif
    backward ? backward_portable(group, n) : forward_portable(group, n);
  };
  const int64_t grain = std::max<int64_t>(kGroup, ROW_WORK / n);
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    int64_t r = begin;
    for (; r + kGroup <= end; r += kGroup) {
      Rows<kGroup> group{};
      for (int i = 0; i < kGroup; ++i) rows_at(r + i, group, i);
      run(group);
    }
    for (; r < end; ++r) {
      Rows<1> one{};
      rows_at(r, one, 0);
      run(one);
    }
  });
}

void check_scores(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() >= 1 &&
                  t.size(-1) >= 1,
              "minigpt_products::softmax_over_keys: ", what,
              " must be a float32 CPU tensor with at least one key, got ", t.scalar_type(),
              " of shape ", t.sizes());
}

}  // namespace softmax

// Attention's weights: the softmax of every row of `scores` over its last dimension, the
// keys where `mask` (boolean, broadcast to the scores' shape) is false masked.
at::Tensor softmax_over_keys(const at::Tensor& scores, const std::optional<at::Tensor>& mask) {
  softmax::check_scores(scores, "scores");
  const auto s = scores.contiguous();
  auto w = at::empty_like(s, at::MemoryFormat::Contiguous);
  const int64_t n = s.size(-1), rows = s.numel() / n;
  const float* ps = s.const_data_ptr<float>();
  float* pw = w.data_ptr<float>();
  at::Tensor keep;
  std::vector<int64_t> sizes, strides;  // the rows' leading dimensions, in the mask
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->device().is_cpu(),
                "minigpt_products::softmax_over_keys: the mask must be a boolean CPU tensor, "
                "got ", mask->scalar_type());
    keep = mask->expand(s.sizes());  // PyTorch's own error if it does not broadcast
    sizes = s.sizes().vec(), strides = keep.strides().vec();
  }
  const bool* pk = keep.defined() ? keep.const_data_ptr<bool>() : nullptr;
  const int64_t keep_stride = pk ? strides.back() : 0;
  softmax::over_rows(rows, n, false, [&](int64_t r, auto& group, int i) {
    group.s[i] = ps + r * n, group.w[i] = pw + r * n, group.keep_stride = keep_stride;
    group.keep[i] = nullptr, group.seen[i] = n;
    if (pk != nullptr) {
      int64_t offset = 0;
      for (int64_t d = static_cast<int64_t>(sizes.size()) - 2, rest = r; d >= 0; --d) {
        offset += (rest % sizes[d]) * strides[d];
        rest /= sizes[d];
      }
      group.keep[i] = pk + offset;
    }
  });
  return w;
}

// The gradient of the scores, from the weights `softmax_over_keys` returned and theirs.
at::Tensor softmax_over_keys_backward(const at::Tensor& weights, const at::Tensor& grad) {
  softmax::check_scores(weights, "weights");
  softmax::check_scores(grad, "their gradient");
  TORCH_CHECK(weights.sizes() == grad.sizes(), "minigpt_products::softmax_over_keys_backward: "
              "the weights ", weights.sizes(), " and their gradient ", grad.sizes(),
              " differ in shape");
  const auto w = weights.contiguous(), g = grad.contiguous();
  auto ds = at::empty_like(w, at::MemoryFormat::Contiguous);
  const int64_t n = w.size(-1), rows = w.numel() / n;
  const float* pw = w.const_data_ptr<float>();
  const float* pg = g.const_data_ptr<float>();
  float* pd = ds.data_ptr<float>();
  softmax::over_rows(rows, n, true, [&](int64_t r, auto& group, int i) {
    // the backward only reads the weights (Rows holds them writable, for the forward)
    group.w[i] = const_cast<float*>(pw + r * n), group.g[i] = pg + r * n;
    group.ds[i] = pd + r * n;
  });
  return ds;
}

// Attention over every head at once: weights = the softmax over the keys of (q / sqrt(d_k))
// k^T, context = weights v, for q (..., T, d_k), k (..., P + T, d_k) and v (..., P + T, d_v),
// float32, their leading dimensions (batch, heads) equal. With `causal`, query i sits at
// position P + i and sees keys 0 .. P + i; otherwise it sees every key. The bits are those of
// the calls one after another (`minigpt.attention.scaled_dot_product_attention` with its
// causal mask): PyTorch's division by sqrt(d_k), `bmm`'s two products and
// `softmax_over_keys`. One call saves their dispatch, the mask, the copies of q, k and v
// (each head's matrices are read where they lie) and the scores the mask throws away: each
// score is one chain, the same bits computed alone, and a masked one is never read. (The
// context's product still takes every key: a masked key's weight is +0, and fma(+0, v_j, acc)
// is acc except where acc is a signed zero or v_j is not finite, so its terms can be skipped
// only with checks that cost more, at the book's lengths, than the terms.)
namespace attention_kernel {

// The offset of each of the `count` matrices of `t` (its leading dimensions flattened in
// order), in elements.
std::vector<int64_t> offsets(const at::Tensor& t, int64_t count) {
  std::vector<int64_t> out(count, 0);
  const int64_t lead = t.dim() - 2;
  for (int64_t s = 0; s < count; ++s) {
    int64_t rest = s, offset = 0;
    for (int64_t d = lead - 1; d >= 0; --d) {
      offset += rest % t.size(d) * t.stride(d);
      rest /= t.size(d);
    }
    out[s] = offset;
  }
  return out;
}

}  // namespace attention_kernel

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, int64_t past, bool causal) {
  const int64_t dims = q.dim();
  TORCH_CHECK(dims >= 3 && k.dim() == dims && v.dim() == dims &&
                  q.sizes().slice(0, dims - 2) == k.sizes().slice(0, dims - 2) &&
                  k.sizes().slice(0, dims - 2) == v.sizes().slice(0, dims - 2) &&
                  q.size(-1) == k.size(-1) && k.size(-2) == v.size(-2),
              "minigpt_products::attention: q (..., T, d_k), k (..., P + T, d_k) and v (..., "
              "P + T, d_v) with the same leading dimensions, got ", q.sizes(), ", ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && q.device().is_cpu() && k.device().is_cpu() &&
                  v.device().is_cpu(),
              "minigpt_products::attention: float32 CPU operands, got ", q.scalar_type(), ", ",
              k.scalar_type(), " and ", v.scalar_type());
  const int64_t t = q.size(-2), n = k.size(-2), dk = q.size(-1), dv = v.size(-1);
  TORCH_CHECK(!causal || (past >= 0 && past + t == n), "minigpt_products::attention: ", t,
              " causal queries after ", past, " cached positions see ", past + t, " keys, not ",
              n);
  TORCH_CHECK(n >= 1, "minigpt_products::attention: at least one key (a softmax over none "
              "is undefined), got k of shape ", k.sizes());
  auto lead = q.sizes().slice(0, dims - 2).vec();
  auto weights_shape = lead, context_shape = lead;
  weights_shape.insert(weights_shape.end(), {t, n});
  context_shape.insert(context_shape.end(), {t, dv});
  auto w = at::empty(weights_shape, q.options());
  auto context = at::empty(context_shape, q.options());
  const int64_t heads = c10::multiply_integers(lead);
  if (heads == 0 || t == 0) return {context, w};
  const auto path = chosen_path();
  TORCH_CHECK(minigpt::gemm::supported(path), "MINIGPT_GEMM_PATH=",
              minigpt::gemm::path_name(path), ": this CPU cannot run that path");
  const auto plan = minigpt::gemm::detail::plan(minigpt::gemm::resolve(path), float());
  // The products as the census knows them: each head's scores (T, d_k) x (d_k, P + T), its
  // query scaled into a buffer of its own, and its context (T, P + T) x (P + T, d_v).
  record_shapes(false, {t, dk}, {dk, 1}, {dk, n}, {k.stride(-1), k.stride(-2)}, std::nullopt,
                false, 1, 1);
  record_shapes(false, {t, n}, {n, 1}, {n, dv}, {v.stride(-2), v.stride(-1)}, std::nullopt,
                false, 1, 1);
  const auto q_at = attention_kernel::offsets(q, heads);
  const auto k_at = attention_kernel::offsets(k, heads);
  const auto v_at = attention_kernel::offsets(v, heads);
  const float* pq = q.const_data_ptr<float>();
  const float* pk = k.const_data_ptr<float>();
  const float* pv = v.const_data_ptr<float>();
  float* pw = w.data_ptr<float>();
  float* pc = context.data_ptr<float>();
  // at::div(q, sqrt(d_k)): the double rounded to the operands' float32, then a true division.
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(dk)));
  // Causal scores in bands of a tile's width of rows, each up to the last key its last row
  // sees: the tiles wholly after the diagonal are skipped.
  const int64_t band = causal ? plan.NR : t;
  const int64_t q_row = q.stride(-2), q_col = q.stride(-1), k_row = k.stride(-2),
                k_col = k.stride(-1), v_row = v.stride(-2), v_col = v.stride(-1);
  const int64_t work = t * n * (dk + dv);
  const int64_t grain = std::max<int64_t>(1, PARALLEL_WORK / std::max<int64_t>(work, 1));
  at::parallel_for(0, heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(t * dk), scores(t * n);
    for (int64_t h = begin; h < end; ++h) {
      const float* qh = pq + q_at[h];
      float* wh = pw + h * t * n;
      for (int64_t i = 0; i < t; ++i) {
        float* to = scaled.data() + i * dk;
        const float* from = qh + i * q_row;
        if (q_col == 1) {  // (a loop the compiler turns into vector divisions)
          for (int64_t p = 0; p < dk; ++p) to[p] = from[p] / scale;
        } else {
          for (int64_t p = 0; p < dk; ++p) to[p] = from[p * q_col] / scale;
        }
      }
      minigpt::gemm::Product<float> sc;  // scores = scaled q k^T, B = k^T read in place
      sc.M = t, sc.N = n, sc.K = dk;
      sc.a = scaled.data(), sc.a_row = dk, sc.a_col = 1;
      sc.b = pk + k_at[h], sc.b_row = k_col, sc.b_col = k_row;
      sc.c = scores.data(), sc.ldc = n;
      for (int64_t r0 = 0; r0 < t; r0 += band) {
        const int64_t r1 = std::min(t, r0 + band);
        minigpt::gemm::detail::compute_plan(
            sc, minigpt::gemm::Rect{r0, r1, 0, causal ? past + r1 : n}, plan);
      }
      // The weights: row r reads its scores up to the last key it sees, no further.
      const float* ps = scores.data();
      softmax::over_rows(t, n, false, [&](int64_t r, auto& group, int i) {
        group.s[i] = ps + r * n, group.w[i] = wh + r * n, group.keep_stride = 0;
        group.keep[i] = nullptr, group.seen[i] = causal ? past + r + 1 : n;
      });
      minigpt::gemm::Product<float> cx;  // context = weights v, over every key in order
      cx.M = t, cx.N = dv, cx.K = n;
      cx.a = wh, cx.a_row = n, cx.a_col = 1;
      cx.b = pv + v_at[h], cx.b_row = v_row, cx.b_col = v_col;
      cx.c = pc + h * t * dv, cx.ldc = dv;
      minigpt::gemm::detail::compute_plan(cx, minigpt::gemm::Rect{0, t, 0, dv}, plan);
    }
  });
  return {context, w};
}

// PyTorch's own CPU product (MKL), past the package's kernels: the control that shows what
// the package's order saves (tools/same_bits.py: emulated Intel and AMD CPUs part here).
at::Tensor native_mm(const at::Tensor& a, const at::Tensor& b) {
  auto out = at::empty({a.size(0), b.size(1)}, a.options());
  return at::cpu::mm_out(out, a, b);
}

int64_t census_open() {
  std::lock_guard<std::mutex> guard(census_lock);
  open_censuses[next_census];
  return next_census++;
}

std::vector<std::string> census_close(int64_t id) {
  std::lock_guard<std::mutex> guard(census_lock);
  auto found = open_censuses.find(id);
  TORCH_CHECK(found != open_censuses.end(), "no open census ", id);
  std::vector<std::string> entries(found->second.begin(), found->second.end());
  open_censuses.erase(found);
  return entries;
}


// ReLU squared, max(0, x)^2, in one pass, and its gradient in one more: the bits of
// F.relu(x).square() and of the gradient autograd takes through it (r * r with r = max(0, x),
// a NaN kept; then g * (2 r) where r > 0, else 0), which take two passes forward and four
// back, each writing a tensor of its own. Elementwise, so any split over threads gives the
// same bits.
namespace relu_squared_kernel {

void check(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              "minigpt_products::relu_squared: ", what, " must be a float32 CPU tensor, got ",
              t.scalar_type(), " on ", t.device());
}

// A float's bits and back.
inline uint32_t bits(float x) { return __builtin_bit_cast(uint32_t, x); }
inline float from_bits(uint32_t b) { return __builtin_bit_cast(float, b); }

// max(0, x) as F.relu computes it (a NaN stays NaN, -0 becomes +0), on the bits alone: x is
// kept if it is a NaN or above +0, else it is +0. A float comparison would do, but with
// IEEE exceptions kept (-fno-fast-math) the compiler then neither vectorises the loops nor
// avoids a branch on the sign, mispredicted half the time on random values (40 times slower).
inline float relu(float x) {
  const uint32_t b = bits(x);
  const bool keep = (b & 0x7fffffffu) > 0x7f800000u || static_cast<int32_t>(b) > 0;
  return from_bits(b & (0u - static_cast<uint32_t>(keep)));
}

// On pointers that do not overlap, so that the compiler vectorises the loops.
void forward(const float* __restrict x, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float r = relu(x[i]);
    out[i] = r * r;
  }
}

// g (2 r) where r > 0 (or is a NaN), else +0: r is +0 exactly where it is not.
void backward(const float* __restrict x, const float* __restrict grad, float* __restrict out,
              int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float r = relu(x[i]);
    const uint32_t slope = bits(grad[i] * (2.0f * r));
    out[i] = from_bits(slope & (0u - static_cast<uint32_t>(bits(r) != 0u)));
  }
}

constexpr int64_t kGrain = 1 << 16;  // elements a thread takes at least

}  // namespace relu_squared_kernel

at::Tensor relu_squared(const at::Tensor& x) {
  relu_squared_kernel::check(x, "its input");
  const auto in = x.contiguous();
  auto out = at::empty_like(in, at::MemoryFormat::Contiguous);
  const float* px = in.const_data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, in.numel(), relu_squared_kernel::kGrain, [&](int64_t begin, int64_t end) {
    relu_squared_kernel::forward(px + begin, po + begin, end - begin);
  });
  return out;
}

// The gradient of x from its own gradient `grad` and the input x.
at::Tensor relu_squared_backward(const at::Tensor& x, const at::Tensor& grad) {
  relu_squared_kernel::check(x, "its input");
  relu_squared_kernel::check(grad, "the gradient");
  TORCH_CHECK(x.sizes() == grad.sizes(), "minigpt_products::relu_squared_backward: the input ",
              x.sizes(), " and the gradient ", grad.sizes(), " differ in shape");
  const auto in = x.contiguous(), g = grad.contiguous();
  auto out = at::empty_like(in, at::MemoryFormat::Contiguous);
  const float* px = in.const_data_ptr<float>();
  const float* pg = g.const_data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, in.numel(), relu_squared_kernel::kGrain, [&](int64_t begin, int64_t end) {
    relu_squared_kernel::backward(px + begin, pg + begin, po + begin, end - begin);
  });
  return out;
}

// Registers the kernels above as PyTorch's CPU kernels of the matrix-product operators (each
// overload: plain, out=, in place, .dtype), once: called
// by minigpt.products.install, without PyTorch's warning that a kernel is replaced (meant).
void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct Quiet : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    static torch::Library aten(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__,
                               __LINE__);
    aten.impl("mm", mm_kernel);
    aten.impl("bmm", bmm_kernel);
    aten.impl("addmm", addmm_kernel);
    aten.impl("baddbmm", baddbmm_kernel);
    aten.impl("mv", mv_kernel);
    aten.impl("addmv", addmv_kernel);
    aten.impl("dot", dot_kernel);
    aten.impl("mm.out", mm_out);
    aten.impl("bmm.out", bmm_out);
    aten.impl("addmm.out", addmm_out);
    aten.impl("addmm_", addmm_in_place);
    aten.impl("baddbmm.out", baddbmm_out);
    aten.impl("baddbmm_", baddbmm_in_place);
    aten.impl("mv.out", mv_out);
    aten.impl("addmv.out", addmv_out);
    aten.impl("addmv_", addmv_in_place);
    aten.impl("dot.out", dot_out);
    aten.impl("mm.dtype", mm_dtype);
    aten.impl("bmm.dtype", bmm_dtype);
    aten.impl("addmm.dtype", addmm_dtype);
    aten.impl("baddbmm.dtype", baddbmm_dtype);
    aten.impl("mm.dtype_out", mm_dtype_out);
    aten.impl("bmm.dtype_out", bmm_dtype_out);
    aten.impl("addmm.dtype_out", addmm_dtype_out);
    aten.impl("baddbmm.dtype_out", baddbmm_dtype_out);
    aten.impl("_addmm_activation", addmm_activation);
  });
}

}  // namespace

TORCH_LIBRARY(minigpt_products, m) {
  m.def("install() -> ()", install);
  m.def("census_open() -> int", census_open);
  m.def("native_mm(Tensor a, Tensor b) -> Tensor", native_mm);
  m.def("census_close(int id) -> str[]", census_close);
  m.def("softmax_over_keys(Tensor scores, Tensor? mask) -> Tensor");
  m.def("softmax_over_keys_backward(Tensor weights, Tensor grad) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, int past, bool causal) -> (Tensor, Tensor)");
  m.def("relu_squared(Tensor x) -> Tensor");
  m.def("relu_squared_backward(Tensor x, Tensor grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(minigpt_products, CPU, m) {
  m.impl("softmax_over_keys", softmax_over_keys);
  m.impl("softmax_over_keys_backward", softmax_over_keys_backward);
  m.impl("attention", attention);
  m.impl("relu_squared", relu_squared);
  m.impl("relu_squared_backward", relu_squared_backward);
}
