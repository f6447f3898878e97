// The checker of minigpt/gemm.h (tests/test_gemm.py builds and runs it).
//
//   check MODE PATH [ARG] < products
//
// reads one product a line, "dtype M N K layouts bias alpha beta", e.g.
// "float32 300 384 128 nt row 1 1" ('#' starts a comment):
//   dtype    float32 | float64
//   layouts  two letters, A's then B's: n contiguous rows, t a transposed view (column
//            stride 1), p contiguous with padded rows (row stride cols + 3), q transposed with
//            padded columns (column stride rows + 3), s every other element of padded rows
//            (row stride 2 cols + 1, column stride 2: packed, never read in place), z every
//            row the same (row stride 0)
//   bias     none | row (an N-vector broadcast over rows, strides (0, 1)) | col (an M-vector,
//            strides (1, 0)) | full (M x N) | nan (M x N of NaN: beta 0 must ignore it) |
//            self (C itself, holding an M x N bias before the product: an in-place addmm)
// makes the inputs from the line alone (its own PRNG: full-mantissa values in [-1, 1), mixed
// signs, one in 61 an exact zero), computes the product by PATH (portable, avx2, avx512,
// auto, env = MINIGPT_GEMM_PATH, or avx512-tiles: see tiles_of_avx512), and prints one line
// per product:
//   hash      the line and a 64-bit FNV-1a hash of C's bits (row by row, little-endian)
//   check     "ok" or the first entry that differs from the reference (the order written as
//             a naive loop); exit status 1 if any differs
//   rects     rows alone, row ranges, column ranges and rectangles equal the full product's,
//             and nothing outside a rectangle is written
//   split     C cut by gemm::split into 1, 2 and 3 rectangles, computed last first, equals
//             the full product
//   bench     ARG repeats (default 5): the median seconds of one product, its GFLOP/s and
//             the best repeat's GFLOP/s
//   serve     for tools/gemm_bench.py: per line, runs the product for at least ARG seconds
//             (default 0.2) and prints the seconds of one product
//   paths     (no input) the paths this CPU runs
#include "minigpt/gemm.h"

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace g = minigpt::gemm;

namespace {

// splitmix64: a small PRNG whose stream is the same on every machine.
struct Random {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

uint64_t fnv1a(const std::string& text, uint64_t hash = 0xCBF29CE484222325ull) {
  for (unsigned char ch : text) hash = (hash ^ ch) * 0x100000001B3ull;
  return hash;
}

// A value in [-1, 1) with every mantissa bit drawn (m / 2^24 for float, m / 2^53 for
// double: exact), a random sign, or an exact zero one time in 61.
template <typename T>
T draw(Random& random) {
  const uint64_t bits = random.next();
  if (bits % 61 == 0) return T(0);
  constexpr int digits = std::numeric_limits<T>::digits;
  const T scale = T(1) / T(uint64_t(1) << digits);  // 2^-digits: exact
  const T magnitude = T(int64_t(bits >> (64 - digits))) * scale;
  return (bits >> 7) & 1 ? -magnitude : magnitude;
}

// A matrix of rows x cols in its own storage, in one of the layouts.
template <typename T>
struct Matrix {
  std::vector<T> storage;
  int64_t row_stride = 0, col_stride = 0;
  const T* data() const { return storage.data(); }
  T at(int64_t i, int64_t j) const { return storage[i * row_stride + j * col_stride]; }
};

template <typename T>
Matrix<T> make_matrix(char layout, int64_t rows, int64_t cols, Random& random) {
  Matrix<T> m;
  int64_t count = rows * cols;
  switch (layout) {
    case 'n': m.row_stride = cols, m.col_stride = 1; break;
    case 't': m.row_stride = 1, m.col_stride = rows; break;
    case 'p': m.row_stride = cols + 3, m.col_stride = 1, count = rows * (cols + 3); break;
    case 'q': m.row_stride = 1, m.col_stride = rows + 3, count = (rows + 3) * cols; break;
    case 's': m.row_stride = 2 * cols + 1, m.col_stride = 2, count = rows * (2 * cols + 1); break;
    case 'z': m.row_stride = 0, m.col_stride = 1, count = cols; break;
    default: throw std::invalid_argument(std::string("unknown layout ") + layout);
  }
  m.storage.resize(std::max<int64_t>(count, 1));
  for (T& value : m.storage) value = draw<T>(random);
  return m;
}

struct Line {
  std::string text, dtype, layouts, bias;
  int64_t M = 0, N = 0, K = 0;
  double alpha = 1, beta = 1;
};

bool parse(const std::string& raw, Line& line) {
  std::string text = raw.substr(0, raw.find('#'));
  std::istringstream in(text);
  if (!(in >> line.dtype)) return false;
  if (!(in >> line.M >> line.N >> line.K >> line.layouts >> line.bias >> line.alpha >>
        line.beta) ||
      line.layouts.size() != 2 || (line.dtype != "float32" && line.dtype != "float64")) {
    throw std::invalid_argument("cannot read product line: " + raw);
  }
  std::ostringstream canonical;
  canonical << line.dtype << ' ' << line.M << ' ' << line.N << ' ' << line.K << ' '
            << line.layouts << ' ' << line.bias << ' ' << line.alpha << ' ' << line.beta;
  line.text = canonical.str();
  return true;
}

// The inputs of one product, made from its line alone.
template <typename T>
struct Problem {
  Matrix<T> a, b, bias;
  bool has_bias = false, in_c = false;  // in_c: the bias is C itself
  g::Product<T> product;  // c left null: each run brings its own
};

template <typename T>
Problem<T> make_problem(const Line& line) {
  Random random{fnv1a(line.text)};
  Problem<T> pb;
  pb.a = make_matrix<T>(line.layouts[0], line.M, line.K, random);
  pb.b = make_matrix<T>(line.layouts[1], line.K, line.N, random);
  if (line.bias == "row") {
    pb.bias = make_matrix<T>('z', line.M, line.N, random);
  } else if (line.bias == "col") {
    pb.bias = make_matrix<T>('t', line.M, 1, random);
    pb.bias.col_stride = 0;
  } else if (line.bias == "full" || line.bias == "self") {
    pb.bias = make_matrix<T>('n', line.M, line.N, random);
  } else if (line.bias == "nan") {
    pb.bias = make_matrix<T>('n', line.M, line.N, random);
    for (T& value : pb.bias.storage) value = std::numeric_limits<T>::quiet_NaN();
  } else if (line.bias != "none") {
    throw std::invalid_argument("unknown bias " + line.bias);
  }
  pb.has_bias = line.bias != "none";
  pb.in_c = line.bias == "self";
  g::Product<T>& p = pb.product;
  p.M = line.M, p.N = line.N, p.K = line.K;
  p.a = pb.a.data(), p.a_row = pb.a.row_stride, p.a_col = pb.a.col_stride;
  p.b = pb.b.data(), p.b_row = pb.b.row_stride, p.b_col = pb.b.col_stride;
  p.ldc = line.N;
  if (pb.has_bias) {
    p.bias = pb.bias.data(), p.bias_row = pb.bias.row_stride, p.bias_col = pb.bias.col_stride;
  }
  p.alpha = T(line.alpha), p.beta = T(line.beta);
  return pb;
}

// The reference: the order of gemm.h written as the naive loop, each rounding forced
// through a volatile so that no compiler flag can fuse the epilogue.
template <typename T>
std::vector<T> reference(const Problem<T>& pb) {
  const g::Product<T>& p = pb.product;
  std::vector<T> c(p.M * p.N);
  std::vector<T> column(p.K);
  for (int64_t j = 0; j < p.N; ++j) {
    for (int64_t q = 0; q < p.K; ++q) column[q] = pb.b.at(q, j);
    for (int64_t i = 0; i < p.M; ++i) {
      T acc = T(0);
      for (int64_t q = 0; q < p.K; ++q) acc = std::fma(pb.a.at(i, q), column[q], acc);
      if (p.alpha != T(1)) {
        volatile T scaled = acc * p.alpha;
        acc = scaled;
      }
      if (pb.has_bias && p.beta != T(0)) {
        T term = pb.bias.at(i, j);
        if (p.beta != T(1)) {
          volatile T product = p.beta * term;
          term = product;
        }
        volatile T sum = acc + term;
        acc = sum;
      }
      c[i * p.N + j] = acc;
    }
  }
  return c;
}

template <typename T>
uint64_t bits(T value) {
  if constexpr (sizeof(T) == 4) {
    uint32_t u;
    std::memcpy(&u, &value, 4);
    return u;
  } else {
    uint64_t u;
    std::memcpy(&u, &value, 8);
    return u;
  }
}

template <typename T>
uint64_t hash(const std::vector<T>& c) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (T value : c) {
    const uint64_t u = bits(value);
    for (size_t byte = 0; byte < sizeof(T); ++byte)
      h = (h ^ ((u >> (8 * byte)) & 0xFF)) * 0x100000001B3ull;
  }
  return h;
}

// C as it is before a product: the bias if C is its own bias, else a NaN with a payload no
// product writes in every entry.
template <typename T>
std::vector<T> initial(const Problem<T>& pb) {
  const g::Product<T>& p = pb.product;
  if (pb.in_c) return pb.bias.storage;
  std::vector<T> c(p.M * p.N);
  const uint64_t pattern = sizeof(T) == 4 ? 0x7FBADBADull : 0x7FF4BADBADBADBADull;
  for (T& value : c) std::memcpy(&value, &pattern, sizeof(T));
  return c;
}

// The path "avx512-tiles" (tiles_of_avx512): the AVX-512 path's plan, its tile shape and
// blocks, run by AVX2 instructions (4 vectors of 8 floats or 4 doubles a row of the tile):
// what the AVX-512 path does, but for its instructions, on a CPU without them.
bool tiles_of_avx512 = false;

#if MINIGPT_GEMM_X86
// gemm.h's kernel_avx512 with AVX2 instructions, its accumulators in memory (12 x 4 vectors
// do not fit 16 registers, and unrolled they take long to compile); then the epilogue.
template <typename S, int MR, int NV>
__attribute__((target("avx2,fma"))) void kernel_emulated(
    int64_t kc, const typename S::T* a, int64_t a_row, int64_t a_step, const typename S::T* b,
    typename S::T* c, int64_t ldc, bool first, const g::detail::Epilogue<typename S::T>* last) {
  constexpr int NR = NV * S::W;
  typename S::V acc[MR][NV];
#pragma GCC unroll 1
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? S::zero() : S::load(c + r * ldc + v * S::W);
  for (int64_t p = 0; p < kc; ++p) {
#pragma GCC unroll 1
    for (int r = 0; r < MR; ++r) {
      const typename S::V x = S::broadcast(a + r * a_row + p * a_step);
#pragma GCC unroll 1
      for (int v = 0; v < NV; ++v) acc[r][v] = S::fma(x, S::load(b + p * NR + v * S::W), acc[r][v]);
    }
  }
#pragma GCC unroll 1
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) S::store(c + r * ldc + v * S::W, acc[r][v]);
  if (!last) return;
  using T = typename S::T;
#pragma GCC unroll 1
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NR; ++q) {  // the epilogue, an entry at a time
      T value = c[r * ldc + q];
      if (last->scale) value = value * last->alpha;
      if (last->add) {
        T term = last->bias[r * last->bias_row + q * last->bias_col];
        if (last->beta != T(1)) term = last->beta * term;
        value = value + term;
      }
      c[r * ldc + q] = value;
    }
}

template <typename S, int NV>
struct EmulatedTiles {
  template <int R>
  static g::detail::Kernel<typename S::T> kernel() { return kernel_emulated<S, R, NV>; }
};
#endif

template <typename T>
g::detail::Plan<T> avx512_tiles() {
#if MINIGPT_GEMM_X86
  namespace d = g::detail;
  const d::Plan<T> avx512 = d::plan(g::Path::avx512, T());
  if (avx512.MR != 12 || avx512.NR != 4 * 32 / int(sizeof(T))) {
    throw std::logic_error("the AVX-512 tile is no longer 12 x 2 vectors: update avx512_tiles");
  }
  using S = std::conditional_t<sizeof(T) == 4, d::Avx2F, d::Avx2D>;
  return d::make_plan<T, EmulatedTiles<S, 4>>(std::make_integer_sequence<int, 12>(), avx512.NR,
                                              avx512.KC, avx512.MC, avx512.NC);
#else
  throw std::invalid_argument("avx512-tiles runs on x86-64 only");
#endif
}

template <typename T>
std::vector<T> run(const Problem<T>& pb, g::Path path, g::Rect rect, std::vector<T> c) {
  g::Product<T> p = pb.product;
  p.c = c.data();
  if (pb.in_c) p.bias = c.data();
  if (tiles_of_avx512) {
    g::detail::compute_plan(p, rect, avx512_tiles<T>());
  } else {
    g::compute(p, rect, path);
  }
  return c;
}

template <typename T>
std::vector<T> full(const Problem<T>& pb, g::Path path) {
  const g::Product<T>& p = pb.product;
  return run(pb, path, g::Rect{0, p.M, 0, p.N}, initial(pb));
}

// "" if c equals want at every entry (in the rectangle, if given; outside it, c must still
// be as it was, `before`).
template <typename T>
std::string compare(const std::vector<T>& c, const std::vector<T>& want, int64_t N,
                    const g::Rect* rect = nullptr, const std::vector<T>* before = nullptr) {
  for (size_t k = 0; k < c.size(); ++k) {
    const int64_t width = std::max<int64_t>(N, 1), i = int64_t(k) / width, j = int64_t(k) % width;
    const bool inside = !rect || (i >= rect->r0 && i < rect->r1 && j >= rect->c0 && j < rect->c1);
    const T expected = inside ? want[k] : (*before)[k];
    if (bits(c[k]) != bits(expected)) {
      char text[200];
      std::snprintf(text, sizeof text, "differs at [%" PRId64 ", %" PRId64 "]: %.17g (0x%" PRIx64
                    ") where %.17g (0x%" PRIx64 ")%s",
                    i, j, double(c[k]), bits(c[k]), double(expected), bits(expected),
                    inside ? "" : " (outside the rectangle)");
      return text;
    }
  }
  return "";
}

// The rectangles `rects` checks for an M x N product.
std::vector<g::Rect> test_rects(int64_t M, int64_t N) {
  std::vector<g::Rect> rects;
  for (int64_t i : {int64_t(0), M / 2, M - 1, std::min<int64_t>(M - 1, 13)})
    rects.push_back({i, i + 1, 0, N});                 // one row alone
  rects.push_back({1, std::min<int64_t>(M, 8), 0, N});  // a few rows, off the tile edge
  rects.push_back({M / 3, M - M / 5, 0, N});            // a band
  rects.push_back({0, M, N - 1, N});                    // the last column alone
  rects.push_back({0, M, std::min<int64_t>(N - 1, 5), N - N / 4});
  rects.push_back({M / 4, std::max<int64_t>(M / 4 + 1, M - 2),  // a rectangle inside
                   N / 3, std::max<int64_t>(N / 3 + 1, N - 3)});
  rects.push_back({M - 1, M, N - 1, N});                // one entry
  std::vector<g::Rect> valid;
  for (const g::Rect& r : rects) {
    if (r.r0 >= 0 && r.r0 < r.r1 && r.r1 <= M && r.c0 >= 0 && r.c0 < r.c1 && r.c1 <= N)
      valid.push_back(r);
  }
  return valid;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <typename T>
bool handle(const std::string& mode, const Line& line, g::Path path, double arg) {
  const Problem<T> pb = make_problem<T>(line);
  const g::Product<T>& p = pb.product;
  if (mode == "hash") {
    std::printf("%s %016" PRIx64 "\n", line.text.c_str(), hash(full(pb, path)));
    return true;
  }
  if (mode == "check") {
    const std::string diff = compare(full(pb, path), reference(pb), p.N);
    std::printf("%s %s%s\n", line.text.c_str(), diff.empty() ? "ok" : "FAIL ", diff.c_str());
    return diff.empty();
  }
  if (mode == "rects" || mode == "split") {
    const std::vector<T> whole = full(pb, path);
    std::string failure;
    int count = 0;
    if (mode == "rects") {
      for (const g::Rect& r : test_rects(p.M, p.N)) {
        const std::vector<T> before = initial(pb);
        const std::string diff = compare(run(pb, path, r, before), whole, p.N, &r, &before);
        ++count;
        if (!diff.empty() && failure.empty()) {
          failure = "rows " + std::to_string(r.r0) + ".." + std::to_string(r.r1) + " cols " +
                    std::to_string(r.c0) + ".." + std::to_string(r.c1) + ": " + diff;
        }
      }
    } else {
      for (int parts : {1, 2, 3}) {
        std::vector<T> c = initial(pb);
        const std::vector<g::Rect> rects = g::split(p.M, p.N, parts);
        for (auto r = rects.rbegin(); r != rects.rend(); ++r) c = run(pb, path, *r, std::move(c));
        const std::string diff = compare(c, whole, p.N);
        ++count;
        if (!diff.empty() && failure.empty()) {
          failure = std::to_string(parts) + " parts (" + std::to_string(rects.size()) +
                    " rectangles): " + diff;
        }
      }
    }
    std::printf("%s %s %d%s%s\n", line.text.c_str(), failure.empty() ? "ok" : "FAIL", count,
                failure.empty() ? "" : " ", failure.c_str());
    return failure.empty();
  }
  if (mode == "bench" || mode == "serve") {
    std::vector<T> c(p.M * p.N);
    g::Product<T> q = p;
    q.c = c.data();
    const double flops = 2.0 * double(p.M) * double(p.N) * double(p.K);
    if (mode == "serve") {
      const double least = arg > 0 ? arg : 0.2;
      g::compute(q, path);  // warm
      int64_t runs = 0;
      const auto start = std::chrono::steady_clock::now();
      do {
        g::compute(q, path);
        ++runs;
      } while (seconds_since(start) < least);
      std::printf("%.9g\n", seconds_since(start) / double(runs));
      std::fflush(stdout);
      return true;
    }
    const int repeats = arg > 0 ? int(arg) : 5;
    std::vector<double> times;
    g::compute(q, path);
    for (int r = 0; r < repeats; ++r) {
      const auto start = std::chrono::steady_clock::now();
      g::compute(q, path);
      times.push_back(seconds_since(start));
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    std::printf("%s %.6f s median %.2f GFLOP/s best %.2f GFLOP/s\n", line.text.c_str(), median,
                flops / median * 1e-9, flops / times[0] * 1e-9);
    return true;
  }
  throw std::invalid_argument("unknown mode " + mode);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc >= 2 && std::string(argv[1]) == "paths") {
      for (g::Path path : {g::Path::portable, g::Path::avx2, g::Path::avx512}) {
        if (g::supported(path)) std::printf("%s\n", g::path_name(path));
      }
      return 0;
    }
    if (argc < 3) {
      std::fprintf(stderr, "usage: check hash|check|rects|split|bench|serve|paths PATH [ARG] "
                           "< products\n");
      return 2;
    }
    const std::string mode = argv[1], path_arg = argv[2];
    tiles_of_avx512 = path_arg == "avx512-tiles";
    const g::Path path = g::resolve(tiles_of_avx512    ? g::Path::avx2
                                    : path_arg == "env" ? g::path_from_env()
                                                        : g::parse_path(path_arg));
    const double arg = argc > 3 ? std::atof(argv[3]) : 0;
    bool all_ok = true;
    std::string raw;
    Line line;
    while (std::getline(std::cin, raw)) {
      if (!parse(raw, line)) continue;
      const bool ok = line.dtype == "float32" ? handle<float>(mode, line, path, arg)
                                              : handle<double>(mode, line, path, arg);
      all_ok = all_ok && ok;
      std::fflush(stdout);
    }
    return all_ok ? 0 : 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "check: %s\n", error.what());
    return 2;
  }
}
