// minigpt/gemm.h: a matrix product C = alpha * A B + beta * bias whose every entry has the
// same bits on every CPU, whatever its vector width, its thread count or the shape of the
// product around the entry. Plain C++17, header-only, no torch headers.
//
// The order. Every entry is one chain, the same in every path:
//
//   acc = +0.0
//   for p = 0 .. K-1, in order:  acc = fma(A[i,p], B[p,j], acc)    one rounding per step
//   if alpha != 1:               acc = acc * alpha
//   if a bias is given and beta != 0:
//                                acc = acc + (beta == 1 ? bias[i,j] : beta * bias[i,j])
//
// An IEEE fma rounds once, on every CPU that has one (x86-64 with FMA, every aarch64), so the
// chain's result is fixed by its inputs alone. The paths only lay the chains side by side:
// a vector holds the chains of neighbouring columns (never neighbouring p), a register tile
// holds rows x columns of them. So a 16-lane AVX-512 tile, an 8-lane AVX2 tile and the
// portable scalar tile (std::fma) compute the same bits, and so does any split of C into
// rectangles (threads split rows and columns, never p).
//
// Blocking over p (kc at a time, for the caches) continues the chain: the accumulator is
// stored in C exactly (same type), reloaded and carried on in order; alpha and the bias come
// after p = K-1 only. Beta == 0 ignores the bias, NaN included, as BLAS does. Tiles at the
// edges of C run the same chains (B's panels are padded with zeros, a tile of fewer rows has
// a kernel of its own), so an entry's bits never depend on where it falls in a tile.
//
// Build with -ffp-contract=off (and no -ffast-math): otherwise the compiler may fuse the
// epilogue's `acc * alpha` or `beta * bias` with the addition that follows, one rounding
// where the order has two (g++ does so on aarch64, where fma is a baseline instruction).
//
// Paths: `portable` (any CPU), and on x86-64 with GCC or Clang also `avx2` (AVX2 + FMA) and
// `avx512` (AVX-512F). The x86 kernels carry __attribute__((target(...))), so one
// translation unit built for baseline x86-64 holds all three; `best_path` picks by cpuid.
#pragma once

#ifdef __FAST_MATH__
#error "minigpt/gemm.h needs IEEE arithmetic: build without -ffast-math"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define MINIGPT_GEMM_X86 1
#include <immintrin.h>
#else
#define MINIGPT_GEMM_X86 0
#endif

namespace minigpt::gemm {

enum class Path { automatic, portable, avx2, avx512 };

inline const char* path_name(Path path) {
  switch (path) {
    case Path::portable: return "portable";
    case Path::avx2: return "avx2";
    case Path::avx512: return "avx512";
    default: return "automatic";
  }
}

// Whether this CPU (and this build) can run `path`.
inline bool supported(Path path) {
#if MINIGPT_GEMM_X86
  __builtin_cpu_init();  // cheap, and needed if called before constructors ran
#endif
  switch (path) {
    case Path::automatic:
    case Path::portable: return true;
#if MINIGPT_GEMM_X86
    case Path::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Path::avx512: return __builtin_cpu_supports("avx512f");
#endif
    default: return false;
  }
}

// The widest path this CPU runs.
inline Path best_path() {
  if (supported(Path::avx512)) return Path::avx512;
  if (supported(Path::avx2)) return Path::avx2;
  return Path::portable;
}

// `automatic` becomes the best path; a path this CPU cannot run is an error.
inline Path resolve(Path path) {
  if (path == Path::automatic) return best_path();
  if (!supported(path)) {
    throw std::invalid_argument(std::string("minigpt gemm: this CPU cannot run the ") +
                                path_name(path) + " path");
  }
  return path;
}

// A path by name: "avx512", "avx2", "portable", or "" / "auto" for automatic.
inline Path parse_path(const std::string& name) {
  if (name.empty() || name == "auto" || name == "automatic") return Path::automatic;
  if (name == "portable") return Path::portable;
  if (name == "avx2") return Path::avx2;
  if (name == "avx512") return Path::avx512;
  throw std::invalid_argument("minigpt gemm: unknown path '" + name +
                              "' (use avx512, avx2 or portable)");
}

// The path forced by MINIGPT_GEMM_PATH=avx512|avx2|portable (tests), else automatic.
inline Path path_from_env() {
  const char* value = std::getenv("MINIGPT_GEMM_PATH");
  return parse_path(value ? value : "");
}

// One product: A is (M, K), B is (K, N), each with a row and a column stride in elements
// (any strides: transposed views, padding, 0 for a broadcast); C is (M, N) with row stride
// ldc and column stride 1; the bias, if not null, is (M, N) with its own strides (a row
// vector broadcast over rows is (0, 1)).
template <typename T>
struct Product {
  int64_t M = 0, N = 0, K = 0;
  const T* a = nullptr;
  int64_t a_row = 0, a_col = 0;
  const T* b = nullptr;
  int64_t b_row = 0, b_col = 0;
  T* c = nullptr;
  int64_t ldc = 0;
  const T* bias = nullptr;
  int64_t bias_row = 0, bias_col = 0;
  T alpha = 1, beta = 1;
};

// A rectangle of C: rows [r0, r1), columns [c0, c1).
struct Rect {
  int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0;
};

namespace detail {

// Packed panels live in 64-byte aligned scratch memory, kept by each thread for its next
// call (it only grows, to at most (MC + NC) x KC entries: 1 MB for the book's products).
struct Scratch {
  void* data = nullptr;
  size_t bytes = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { ::operator delete(data, std::align_val_t{64}); }
  void* reserve(size_t want) {
    if (want > bytes) {
      ::operator delete(data, std::align_val_t{64});
      data = nullptr;
      data = ::operator new(want, std::align_val_t{64});
      bytes = want;
    }
    return data;
  }
};

template <typename T>
T* scratch(int which, size_t count) {
  thread_local Scratch buffers[2];
  return static_cast<T*>(buffers[which].reserve(std::max<size_t>(count, 1) * sizeof(T)));
}

// A's rows [0, mc) and p's [0, kc) (from `a`, already offset) into panels of MR rows: panel
// q holds rows q*MR .. q*MR+MR-1, element (r, p) at [p*MR + r]; rows past mc are zeros.
template <typename T>
void pack_a(const T* a, int64_t a_row, int64_t a_col, int64_t mc, int64_t kc, int MR, T* out) {
  for (int64_t i0 = 0; i0 < mc; i0 += MR) {
    const int64_t rows = std::min<int64_t>(MR, mc - i0);
    for (int64_t p = 0; p < kc; ++p) {
      const T* src = a + i0 * a_row + p * a_col;
      T* dst = out + p * MR;
      for (int64_t r = 0; r < rows; ++r) dst[r] = src[r * a_row];
      for (int64_t r = rows; r < MR; ++r) dst[r] = T(0);
    }
    out += kc * MR;
  }
}

// B's p's [0, kc) and columns [0, nc) into panels of NR columns: element (p, c) of panel q
// at [p*NR + c]; columns past nc are zeros.
template <typename T>
void pack_b(const T* b, int64_t b_row, int64_t b_col, int64_t kc, int64_t nc, int NR, T* out) {
  for (int64_t j0 = 0; j0 < nc; j0 += NR) {
    const int64_t cols = std::min<int64_t>(NR, nc - j0);
    int64_t p = 0;
#if MINIGPT_GEMM_X86
    if constexpr (std::is_same<T, float>::value) {
      // A transposed B (a linear layer's weight, B = W^T): 4 x 4 blocks turned by SSE
      // shuffles (baseline x86-64), four times as fast as one element at a time.
      if (b_row == 1 && cols % 4 == 0) {
        for (; p + 4 <= kc; p += 4) {
          for (int64_t c = 0; c < cols; c += 4) {
            const float* src = b + p + (j0 + c) * b_col;
            __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + b_col);
            __m128 r2 = _mm_loadu_ps(src + 2 * b_col), r3 = _mm_loadu_ps(src + 3 * b_col);
            _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
            float* dst = out + p * NR + c;
            _mm_storeu_ps(dst, r0);
            _mm_storeu_ps(dst + NR, r1);
            _mm_storeu_ps(dst + 2 * NR, r2);
            _mm_storeu_ps(dst + 3 * NR, r3);
          }
          for (int64_t q = p; q < p + 4; ++q)
            for (int64_t c = cols; c < NR; ++c) out[q * NR + c] = 0.0f;
        }
      }
    }
#endif
    for (; p < kc; ++p) {
      const T* src = b + p * b_row + j0 * b_col;
      T* dst = out + p * NR;
      if (b_col == 1) {
        std::memcpy(dst, src, cols * sizeof(T));
      } else {
        for (int64_t c = 0; c < cols; ++c) dst[c] = src[c * b_col];
      }
      for (int64_t c = cols; c < NR; ++c) dst[c] = T(0);
    }
    out += kc * NR;
  }
}

// The epilogue on `rows` x `cols` finished entries at c (a tile of the last columns, or all
// of C when K = 0; the kernels apply it to the other tiles): two roundings, never one (hence
// -ffp-contract=off).
template <typename T>
void finish(const Product<T>& pr, int64_t i, int64_t j, T* c, int64_t rows, int64_t cols) {
  const bool scale = pr.alpha != T(1);
  const bool add = pr.bias != nullptr && pr.beta != T(0);
  if (!scale && !add) return;
  for (int64_t r = 0; r < rows; ++r) {
    T* out = c + r * pr.ldc;
    if (scale) {
      for (int64_t q = 0; q < cols; ++q) out[q] = out[q] * pr.alpha;
    }
    if (add) {
      const T* bias = pr.bias + (i + r) * pr.bias_row + j * pr.bias_col;
      if (pr.beta == T(1) && pr.bias_col == 1) {  // the common case, vectorised by the compiler
        for (int64_t q = 0; q < cols; ++q) out[q] = out[q] + bias[q];
      } else if (pr.beta == T(1)) {
        for (int64_t q = 0; q < cols; ++q) out[q] = out[q] + bias[q * pr.bias_col];
      } else {
        for (int64_t q = 0; q < cols; ++q) {
          const T term = pr.beta * bias[q * pr.bias_col];
          out[q] = out[q] + term;
        }
      }
    }
  }
}

// A micro-kernel: the chains of an MR x NR tile carried on for kc steps, over A's element
// (r, p) at a[r*a_row + p*a_step] (a packed panel: a_row 1, a_step MR; A read in place: its
// own strides) and a B panel (b[p*NR + c]); the accumulators start at +0.0 if `first`, else
// from c (the partial sums a previous block stored), and end in c. With `last` (not null,
// after the block that ends at p = K-1) the kernel applies the epilogue before it stores.
template <typename T>
struct Epilogue {
  bool scale, add;  // alpha != 1; a bias with beta != 0
  T alpha, beta;
  const T* bias;  // the tile's first entry of the bias
  int64_t bias_row, bias_col;
};

template <typename T>
using Kernel = void (*)(int64_t kc, const T* a, int64_t a_row, int64_t a_step, const T* b, T* c,
                        int64_t ldc, bool first, const Epilogue<T>* last);

// A path's kernels and its blocking: MR x NR the register tile, kernel[r] the kernel of a
// tile of r rows (1 <= r <= MR: the last rows of C, and a single row, waste no fmas); KC the
// steps of p per block; MC the rows of A a block takes (a multiple of MR); NC the columns of
// B packed at a time (a multiple of NR).
template <typename T>
struct Plan {
  Kernel<T> kernel[17];
  int MR, NR;
  int64_t KC, MC, NC;
  // A product of at most THIN_ROWS rows against a transposed B (b_row 1: a linear layer's
  // weight, B = W^T), B read in place (`thin_avx2`), or null: packed like any other.
  void (*thin)(const Product<T>&) = nullptr;
};

// The most rows a thin product has: a token decoded alone, or a few side by side.
constexpr int64_t THIN_ROWS = 4;

// The plan whose kernel[r] is Tiles::kernel<r>() for r = 1 .. MR.
template <typename T, typename Tiles, int... R>
Plan<T> make_plan(std::integer_sequence<int, R...>, int NR, int64_t KC, int64_t MC,
                  int64_t NC) {
  static_assert(sizeof...(R) <= 16, "at most 16 rows a tile");
  Plan<T> plan{};
  ((plan.kernel[R + 1] = Tiles::template kernel<R + 1>()), ...);
  plan.MR = int(sizeof...(R)), plan.NR = NR, plan.KC = KC, plan.MC = MC, plan.NC = NC;
  return plan;
}

// ---- The portable path: plain C++, std::fma, a 4 x 4 tile of scalars. ----
// (On aarch64 std::fma is an instruction; on baseline x86-64 a call into libm, slow: there
// the path serves the tests.)

template <typename T, int MR>
void kernel_portable(int64_t kc, const T* a, int64_t a_row, int64_t a_step, const T* b, T* c,
                     int64_t ldc, bool first, const Epilogue<T>* last) {
  constexpr int NR = 4;
  T acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NR; ++q) acc[r][q] = first ? T(0) : c[r * ldc + q];
  for (int64_t p = 0; p < kc; ++p) {
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < NR; ++q)
        acc[r][q] = std::fma(a[r * a_row + p * a_step], b[p * NR + q], acc[r][q]);
  }
  if (last) {
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < NR; ++q) {
        if (last->scale) acc[r][q] = acc[r][q] * last->alpha;
        if (last->add) {
          T term = last->bias[r * last->bias_row + q * last->bias_col];
          if (last->beta != T(1)) term = last->beta * term;
          acc[r][q] = acc[r][q] + term;
        }
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NR; ++q) c[r * ldc + q] = acc[r][q];
}

#if MINIGPT_GEMM_X86

// ---- The AVX2 + FMA path: a tile of MR rows x NV vectors of 8 floats (4 doubles). ----
// Each step broadcasts A[i,p] and fuses it with the row of B[p, j..] into the row's
// accumulators: lane l of accumulator (r, v) is the chain of C[i+r, j+v*W+l].

#define MINIGPT_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline

struct Avx2F {
  using T = float;
  using V = __m256;
  static constexpr int W = 8;
  static MINIGPT_AVX2 V zero() { return _mm256_setzero_ps(); }
  static MINIGPT_AVX2 V load(const T* p) { return _mm256_loadu_ps(p); }
  static MINIGPT_AVX2 void store(T* p, V v) { _mm256_storeu_ps(p, v); }
  static MINIGPT_AVX2 V broadcast(const T* p) { return _mm256_broadcast_ss(p); }
  static MINIGPT_AVX2 V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static MINIGPT_AVX2 V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static MINIGPT_AVX2 V add(V a, V b) { return _mm256_add_ps(a, b); }
  static MINIGPT_AVX2 V set1(T x) { return _mm256_set1_ps(x); }
};

struct Avx2D {
  using T = double;
  using V = __m256d;
  static constexpr int W = 4;
  static MINIGPT_AVX2 V zero() { return _mm256_setzero_pd(); }
  static MINIGPT_AVX2 V load(const T* p) { return _mm256_loadu_pd(p); }
  static MINIGPT_AVX2 void store(T* p, V v) { _mm256_storeu_pd(p, v); }
  static MINIGPT_AVX2 V broadcast(const T* p) { return _mm256_broadcast_sd(p); }
  static MINIGPT_AVX2 V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  static MINIGPT_AVX2 V mul(V a, V b) { return _mm256_mul_pd(a, b); }
  static MINIGPT_AVX2 V add(V a, V b) { return _mm256_add_pd(a, b); }
  static MINIGPT_AVX2 V set1(T x) { return _mm256_set1_pd(x); }
};

// The epilogue on a tile's accumulators: two roundings each, as `finish` (explicit
// multiplies and adds, never fused: -ffp-contract=off).
template <typename S, int MR, int NV>
__attribute__((target("avx2,fma"), always_inline)) inline void epilogue(
    typename S::V (&acc)[MR][NV], const Epilogue<typename S::T>& e) {
  using T = typename S::T;
  if (e.scale) {
    const typename S::V alpha = S::set1(e.alpha);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = S::mul(acc[r][v], alpha);
  }
  if (e.add) {
    const typename S::V beta = S::set1(e.beta);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const T* src = e.bias + r * e.bias_row + v * S::W * e.bias_col;
        typename S::V term;
        if (e.bias_col == 1) {
          term = S::load(src);
        } else {
          alignas(64) T lanes[S::W];
          for (int l = 0; l < S::W; ++l) lanes[l] = src[l * e.bias_col];
          term = S::load(lanes);
        }
        if (e.beta != T(1)) term = S::mul(beta, term);
        acc[r][v] = S::add(acc[r][v], term);
      }
  }
}

template <typename S, int MR, int NV>
__attribute__((target("avx2,fma"))) void kernel_avx2(int64_t kc, const typename S::T* a,
                                                     int64_t a_row, int64_t a_step,
                                                     const typename S::T* b, typename S::T* c,
                                                     int64_t ldc, bool first,
                                                     const Epilogue<typename S::T>* last) {
  constexpr int NR = NV * S::W;
  typename S::V acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? S::zero() : S::load(c + r * ldc + v * S::W);
  for (int64_t p = 0; p < kc; ++p) {
    typename S::V row[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) row[v] = S::load(b + p * NR + v * S::W);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const typename S::V x = S::broadcast(a + r * a_row + p * a_step);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = S::fma(x, row[v], acc[r][v]);
    }
  }
  if (last) epilogue<S, MR, NV>(acc, *last);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) S::store(c + r * ldc + v * S::W, acc[r][v]);
}

// ---- Thin products on AVX2 + FMA: R <= THIN_ROWS rows of A against a transposed B. ----
// Packing B costs as much as a product of one row with it, so a decoded token's products
// read B in place: column j of B is row j of the weight W, contiguous over p. Eight columns
// at a time, eight steps of p at a time: the 8 x 8 block of W is turned in registers, so
// that vector q holds B[p+q, j..j+7], and each row's chains take the steps q = 0..7 in order
// (lane l is the chain of C[i, j+l], as in a tile). The last p's are gathered one at a time;
// the last columns (fewer than 8) are chains of scalars (std::fma: one instruction here).
// Then `finish`'s epilogue: the same bits as the tiles'.

__attribute__((target("avx2,fma"), always_inline)) inline void turn8(__m256* v) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  v[0] = _mm256_permute2f128_ps(u0, u4, 0x20), v[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  v[1] = _mm256_permute2f128_ps(u1, u5, 0x20), v[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  v[2] = _mm256_permute2f128_ps(u2, u6, 0x20), v[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  v[3] = _mm256_permute2f128_ps(u3, u7, 0x20), v[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

template <int R>
__attribute__((target("avx2,fma"))) void thin_rows_avx2(const Product<float>& pr) {
  const int64_t N = pr.N, K = pr.K, ldw = pr.b_col;
  auto a = [&](int r, int64_t p) { return pr.a[r * pr.a_row + p * pr.a_col]; };
  int64_t j = 0;
  for (; j + 8 <= N; j += 8) {
    const float* w = pr.b + j * ldw;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= K; p += 8) {
      __m256 v[8];
      for (int l = 0; l < 8; ++l) v[l] = _mm256_loadu_ps(w + l * ldw + p);
      turn8(v);
      for (int q = 0; q < 8; ++q) {
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a(r, p + q)), v[q], acc[r]);
        }
      }
    }
    for (; p < K; ++p) {
      const __m256 v = _mm256_setr_ps(w[p], w[ldw + p], w[2 * ldw + p], w[3 * ldw + p],
                                      w[4 * ldw + p], w[5 * ldw + p], w[6 * ldw + p],
                                      w[7 * ldw + p]);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a(r, p)), v, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(pr.c + r * pr.ldc + j, acc[r]);
  }
  for (; j < N; ++j) {
    const float* w = pr.b + j * ldw;
    for (int r = 0; r < R; ++r) {
      float acc = 0.0f;
      for (int64_t p = 0; p < K; ++p) acc = std::fma(a(r, p), w[p], acc);
      pr.c[r * pr.ldc + j] = acc;
    }
  }
  finish(pr, 0, 0, pr.c, R, N);
}

inline void thin_avx2(const Product<float>& pr) {
  switch (pr.M) {
    case 1: return thin_rows_avx2<1>(pr);
    case 2: return thin_rows_avx2<2>(pr);
    case 3: return thin_rows_avx2<3>(pr);
    default: return thin_rows_avx2<4>(pr);
  }
}

// ---- The AVX-512F path: the same tile with vectors of 16 floats (8 doubles). ----

#define MINIGPT_AVX512 __attribute__((target("avx512f"), always_inline)) inline

struct Avx512F {
  using T = float;
  using V = __m512;
  static constexpr int W = 16;
  static MINIGPT_AVX512 V zero() { return _mm512_setzero_ps(); }
  static MINIGPT_AVX512 V load(const T* p) { return _mm512_loadu_ps(p); }
  static MINIGPT_AVX512 void store(T* p, V v) { _mm512_storeu_ps(p, v); }
  static MINIGPT_AVX512 V broadcast(const T* p) { return _mm512_set1_ps(*p); }
  static MINIGPT_AVX512 V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static MINIGPT_AVX512 V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static MINIGPT_AVX512 V add(V a, V b) { return _mm512_add_ps(a, b); }
  static MINIGPT_AVX512 V set1(T x) { return _mm512_set1_ps(x); }
};

struct Avx512D {
  using T = double;
  using V = __m512d;
  static constexpr int W = 8;
  static MINIGPT_AVX512 V zero() { return _mm512_setzero_pd(); }
  static MINIGPT_AVX512 V load(const T* p) { return _mm512_loadu_pd(p); }
  static MINIGPT_AVX512 void store(T* p, V v) { _mm512_storeu_pd(p, v); }
  static MINIGPT_AVX512 V broadcast(const T* p) { return _mm512_set1_pd(*p); }
  static MINIGPT_AVX512 V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  static MINIGPT_AVX512 V mul(V a, V b) { return _mm512_mul_pd(a, b); }
  static MINIGPT_AVX512 V add(V a, V b) { return _mm512_add_pd(a, b); }
  static MINIGPT_AVX512 V set1(T x) { return _mm512_set1_pd(x); }
};

// The same epilogue for AVX-512 tiles.
template <typename S, int MR, int NV>
__attribute__((target("avx512f"), always_inline)) inline void epilogue512(
    typename S::V (&acc)[MR][NV], const Epilogue<typename S::T>& e) {
  using T = typename S::T;
  if (e.scale) {
    const typename S::V alpha = S::set1(e.alpha);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = S::mul(acc[r][v], alpha);
  }
  if (e.add) {
    const typename S::V beta = S::set1(e.beta);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const T* src = e.bias + r * e.bias_row + v * S::W * e.bias_col;
        typename S::V term;
        if (e.bias_col == 1) {
          term = S::load(src);
        } else {
          alignas(64) T lanes[S::W];
          for (int l = 0; l < S::W; ++l) lanes[l] = src[l * e.bias_col];
          term = S::load(lanes);
        }
        if (e.beta != T(1)) term = S::mul(beta, term);
        acc[r][v] = S::add(acc[r][v], term);
      }
  }
}

template <typename S, int MR, int NV>
__attribute__((target("avx512f"))) void kernel_avx512(int64_t kc, const typename S::T* a,
                                                      int64_t a_row, int64_t a_step,
                                                      const typename S::T* b, typename S::T* c,
                                                      int64_t ldc, bool first,
                                                      const Epilogue<typename S::T>* last) {
  constexpr int NR = NV * S::W;
  typename S::V acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = first ? S::zero() : S::load(c + r * ldc + v * S::W);
  for (int64_t p = 0; p < kc; ++p) {
    typename S::V row[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) row[v] = S::load(b + p * NR + v * S::W);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const typename S::V x = S::broadcast(a + r * a_row + p * a_step);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = S::fma(x, row[v], acc[r][v]);
    }
  }
  if (last) epilogue512<S, MR, NV>(acc, *last);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) S::store(c + r * ldc + v * S::W, acc[r][v]);
}

#undef MINIGPT_AVX2
#undef MINIGPT_AVX512

#endif  // MINIGPT_GEMM_X86

// Each path's tile and blocks (chosen by measuring on the project's machine). The tile's
// accumulators fill most vector registers (AVX2: 6 x 16 floats in 12 of 16, AVX-512: 12 x 32
// in 24 of 32); a B panel of KC steps stays in L1, an A block of MC x KC in L2, a B block of
// KC x NC in L3.
template <typename T>
struct PortableTiles {
  template <int R>
  static Kernel<T> kernel() { return kernel_portable<T, R>; }
};

#if MINIGPT_GEMM_X86
template <typename S, int NV>
struct Avx2Tiles {
  template <int R>
  static Kernel<typename S::T> kernel() { return kernel_avx2<S, R, NV>; }
};

template <typename S, int NV>
struct Avx512Tiles {
  template <int R>
  static Kernel<typename S::T> kernel() { return kernel_avx512<S, R, NV>; }
};
#endif

inline Plan<float> plan_float(Path path) {
  switch (path) {
#if MINIGPT_GEMM_X86
    case Path::avx2: {
      auto plan = make_plan<float, Avx2Tiles<Avx2F, 2>>(std::make_integer_sequence<int, 6>(),
                                                        16, 256, 144, 4080);
      plan.thin = thin_avx2;
      return plan;
    }
    case Path::avx512: {  // every CPU with AVX-512F has AVX2 and FMA: the same thin kernel
      auto plan = make_plan<float, Avx512Tiles<Avx512F, 2>>(
          std::make_integer_sequence<int, 12>(), 32, 384, 240, 3072);
      plan.thin = thin_avx2;
      return plan;
    }
#endif
    default:
      return make_plan<float, PortableTiles<float>>(std::make_integer_sequence<int, 4>(), 4,
                                                    256, 64, 1024);
  }
}

inline Plan<double> plan_double(Path path) {
  switch (path) {
#if MINIGPT_GEMM_X86
    case Path::avx2:
      return make_plan<double, Avx2Tiles<Avx2D, 2>>(std::make_integer_sequence<int, 6>(), 8,
                                                    256, 72, 4080);
    case Path::avx512:
      return make_plan<double, Avx512Tiles<Avx512D, 2>>(std::make_integer_sequence<int, 12>(),
                                                        16, 384, 120, 3072);
#endif
    default:
      return make_plan<double, PortableTiles<double>>(std::make_integer_sequence<int, 4>(), 4,
                                                      256, 64, 1024);
  }
}

inline Plan<float> plan(Path path, float) { return plan_float(path); }
inline Plan<double> plan(Path path, double) { return plan_double(path); }

// Whether the M x N entries of x (strides x_row, x_col) and of y share memory, by the ranges
// of addresses each spans.
template <typename T>
bool overlaps(const T* x, int64_t x_row, int64_t x_col, const T* y, int64_t y_row, int64_t y_col,
              int64_t M, int64_t N) {
  auto span = [&](const T* base, int64_t row, int64_t col, const T*& lo, const T*& hi) {
    const int64_t r = (M - 1) * row, c = (N - 1) * col;
    lo = base + std::min<int64_t>(r, 0) + std::min<int64_t>(c, 0);
    hi = base + std::max<int64_t>(r, 0) + std::max<int64_t>(c, 0);
  };
  const T *x_lo, *x_hi, *y_lo, *y_hi;
  span(x, x_row, x_col, x_lo, x_hi);
  span(y, y_row, y_col, y_lo, y_hi);
  return !(x_hi < y_lo || y_hi < x_lo);
}

// The whole product `pr` (already cut to a rectangle) with one plan.
template <typename T>
void run(const Product<T>& pr, const Plan<T>& plan) {
  const int64_t M = pr.M, N = pr.N, K = pr.K;
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // no steps: every chain is +0.0, then the epilogue
    for (int64_t i = 0; i < M; ++i) std::fill(pr.c + i * pr.ldc, pr.c + i * pr.ldc + N, T(0));
    finish(pr, 0, 0, pr.c, M, N);
    return;
  }
  if (plan.thin != nullptr && M <= THIN_ROWS && pr.b_row == 1) {
    plan.thin(pr);
    return;
  }
  const int MR = plan.MR, NR = plan.NR;
  const int64_t kc_max = std::min(plan.KC, K);
  const int64_t mc_max = std::min<int64_t>(plan.MC, (M + MR - 1) / MR * MR);
  const int64_t nc_max = std::min<int64_t>(plan.NC, (N + NR - 1) / NR * NR);
  T* const a_panels = scratch<T>(0, mc_max * kc_max);
  T* const b_panels = scratch<T>(1, kc_max * nc_max);
  alignas(64) T edge[16 * 64] = {};  // an edge tile's chains (MR * NR <= 16 * 64)
  // An A whose rows or columns are contiguous (a matrix or its transposed view) is read in
  // place: the same elements, in the same order, without the copy.
  const bool a_in_place = pr.a_col == 1 || pr.a_row == 1;
  Epilogue<T> ep{pr.alpha != T(1), pr.bias != nullptr && pr.beta != T(0), pr.alpha, pr.beta,
                 nullptr, pr.bias_row, pr.bias_col};

  for (int64_t jc = 0; jc < N; jc += plan.NC) {
    const int64_t nc = std::min(plan.NC, N - jc);
    for (int64_t pc = 0; pc < K; pc += plan.KC) {
      const int64_t kc = std::min(plan.KC, K - pc);
      const bool first = pc == 0, last = pc + kc == K;
      pack_b(pr.b + pc * pr.b_row + jc * pr.b_col, pr.b_row, pr.b_col, kc, nc, NR, b_panels);
      for (int64_t ic = 0; ic < M; ic += plan.MC) {
        const int64_t mc = std::min(plan.MC, M - ic);
        const T* const a_block = pr.a + ic * pr.a_row + pc * pr.a_col;
        if (!a_in_place) pack_a(a_block, pr.a_row, pr.a_col, mc, kc, MR, a_panels);
        for (int64_t jr = 0; jr < nc; jr += NR) {
          const int64_t cols = std::min<int64_t>(NR, nc - jr);
          const T* b = b_panels + jr * kc;
          for (int64_t ir = 0; ir < mc; ir += MR) {
            const int64_t rows = std::min<int64_t>(MR, mc - ir);
            const T* a = a_in_place ? a_block + ir * pr.a_row : a_panels + ir * kc;
            const int64_t a_row = a_in_place ? pr.a_row : 1;
            const int64_t a_step = a_in_place ? pr.a_col : MR;
            const Kernel<T> kernel = plan.kernel[rows];
            const int64_t i = ic + ir, j = jc + jr;
            T* c = pr.c + i * pr.ldc + j;
            if (cols == NR) {
              const Epilogue<T>* ending = nullptr;
              if (last && (ep.scale || ep.add)) {
                ep.bias = ep.add ? pr.bias + i * pr.bias_row + j * pr.bias_col : nullptr;
                ending = &ep;
              }
              kernel(kc, a, a_row, a_step, b, c, pr.ldc, first, ending);
            } else {
              // The last columns: the same chains, in a full-width tile whose columns past
              // the edge are zeros (the packed B's) and are never stored.
              if (!first) {
                for (int64_t r = 0; r < rows; ++r)
                  std::memcpy(edge + r * NR, c + r * pr.ldc, cols * sizeof(T));
              }
              kernel(kc, a, a_row, a_step, b, edge, NR, first, nullptr);
              for (int64_t r = 0; r < rows; ++r)
                std::memcpy(c + r * pr.ldc, edge + r * NR, cols * sizeof(T));
              if (last) finish(pr, i, j, c, rows, cols);
            }
          }
        }
      }
    }
  }
}

}  // namespace detail

namespace detail {

// `compute` with a given plan (the checker also runs the AVX-512 blocks with AVX2 tiles).
template <typename T>
void compute_plan(const Product<T>& pr, Rect rect, const Plan<T>& plan) {
  rect.r0 = std::max<int64_t>(rect.r0, 0);
  rect.c0 = std::max<int64_t>(rect.c0, 0);
  rect.r1 = std::min(rect.r1, pr.M);
  rect.c1 = std::min(rect.c1, pr.N);
  if (rect.r1 <= rect.r0 || rect.c1 <= rect.c0) return;
  Product<T> part = pr;
  part.M = rect.r1 - rect.r0;
  part.N = rect.c1 - rect.c0;
  part.a = pr.a + rect.r0 * pr.a_row;
  part.b = pr.b + rect.c0 * pr.b_col;
  part.c = pr.c + rect.r0 * pr.ldc + rect.c0;
  std::vector<T> bias_copy;
  if (pr.bias) {
    part.bias = pr.bias + rect.r0 * pr.bias_row + rect.c0 * pr.bias_col;
    // A bias in C's own memory (an in-place addmm passes C as its bias) would be read after
    // the partial sums overwrote it: such a bias is read from a copy of its rectangle.
    if (overlaps(part.bias, part.bias_row, part.bias_col, part.c, part.ldc, 1, part.M, part.N)) {
      bias_copy.resize(part.M * part.N);
      for (int64_t i = 0; i < part.M; ++i)
        for (int64_t j = 0; j < part.N; ++j)
          bias_copy[i * part.N + j] = part.bias[i * part.bias_row + j * part.bias_col];
      part.bias = bias_copy.data(), part.bias_row = part.N, part.bias_col = 1;
    }
  }
  run(part, plan);
}

}  // namespace detail

// The entries of C in `rect` (rows r0..r1-1, columns c0..c1-1) of the product `pr`, by
// `path` (automatic: the best this CPU runs). Each entry is its own chain, so any rectangles
// that cover C, computed in any order or on any threads, write the same bits as one call.
// Spawns no threads. Throws std::invalid_argument for a path this CPU cannot run. C must not
// share memory with A or B; the bias may be C itself (each rectangle reads only its own
// entries of it first), or else must not share memory with C either.
template <typename T>
void compute(const Product<T>& pr, Rect rect, Path path = Path::automatic) {
  static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value,
                "minigpt gemm: float32 or float64");
  detail::compute_plan(pr, rect, detail::plan(resolve(path), T()));
}

// The whole of C.
template <typename T>
void compute(const Product<T>& pr, Path path = Path::automatic) {
  compute(pr, Rect{0, pr.M, 0, pr.N}, path);
}

// C (M x N) cut into at most `parts` rectangles of nearly equal size for as many threads:
// bands of rows if there are enough rows (edges at multiples of 48, which every path's tile
// height divides), else bands of columns (at multiples of 32). Every entry in exactly one.
inline std::vector<Rect> split(int64_t M, int64_t N, int parts) {
  std::vector<Rect> rects;
  if (M <= 0 || N <= 0) return rects;
  parts = std::max(parts, 1);
  const bool by_rows = M >= 48 * int64_t(parts) || M * 4 >= N;
  const int64_t length = by_rows ? M : N, unit = by_rows ? 48 : 32;
  const int64_t units = (length + unit - 1) / unit;
  const int64_t count = std::min<int64_t>(parts, units);
  int64_t start = 0;
  for (int64_t q = 0; q < count; ++q) {
    const int64_t end = std::min(length, (units * (q + 1) / count) * unit);
    if (end > start) {
      rects.push_back(by_rows ? Rect{start, end, 0, N} : Rect{0, M, start, end});
    }
    start = end;
  }
  return rects;
}

}  // namespace minigpt::gemm
