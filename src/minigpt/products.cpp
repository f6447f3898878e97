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
#include <cstdlib>
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

void record(bool batched, const at::Tensor& a, const at::Tensor& b,
            const std::optional<at::Tensor>& bias, const at::Scalar& beta,
            const at::Scalar& alpha) {
  std::lock_guard<std::mutex> guard(census_lock);
  if (!journal_checked) {
    journal_checked = true;
    if (const char* folder = std::getenv("MINIGPT_CENSUS")) {
      journal_path = std::string(folder) + "/" + std::to_string(getpid()) + ".jsonl";
    }
  }
  if (open_censuses.empty() && journal_path.empty()) return;
  std::ostringstream line;
  line.precision(17);
  line << "[\"" << (batched ? "bmm" : "mm") << "\"," << json_list(a.sizes()) << ","
       << json_list(a.strides()) << "," << json_list(b.sizes()) << "," << json_list(b.strides())
       << ",";
  if (bias.has_value()) {
    line << json_list(bias->sizes()) << "," << json_list(bias->strides());
  } else {
    line << "null,null";
  }
  line << ",\"" << (a.scalar_type() == at::kDouble ? "float64" : "float32") << "\","
       << at::get_num_threads() << "," << alpha.toDouble() << "," << beta.toDouble() << "]";
  const std::string entry = line.str();
  for (auto& census : open_censuses) census.second.insert(entry);
  if (!journal_path.empty() && journaled.insert(entry).second) {
    std::ofstream(journal_path, std::ios::app) << entry << "\n";
  }
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
}
