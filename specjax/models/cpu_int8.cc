// specjax's int8 product for XLA:CPU, called through XLA's FFI (models/cpu_kernels.py builds it
// with the machine's C++ compiler for the machine's own instruction set).
//
//   out[m, n] = sum_k a[m, k] * w[n, k]      a int8 [M, K], w int8 [N, K], out int32 [M, N]
//
// A decoding step multiplies a few activation rows by a weight matrix that is read once from
// memory, so the kernel streams each weight row once and multiplies it with every activation
// row while it is in registers. XLA's own s8 x s8 -> s32 product reads the weights at about a
// third of the memory bandwidth for these shapes, and a one-row product falls to a slow path.
// The sums are exact int32 arithmetic (the same integers XLA's product gives, in any order).
//
// Rows of w are split into chunks that the calling thread and tasks on XLA's intra-op thread
// pool take from one counter: the caller waits only for chunks a running thread has taken, so a
// task queued behind busy threads never blocks it (and finds nothing left when it runs).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPECJAX_INT8_ISA "avx512-vnni"
#include <immintrin.h>
#elif defined(__AVX2__)
#define SPECJAX_INT8_ISA "avx2"
#include <immintrin.h>
#else
#define SPECJAX_INT8_ISA "generic"
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;  // activation rows multiplied per pass over a weight row
constexpr int64_t kL1Bytes = 16 << 10;  // activations up to this size are read from L1

// The activations as the inner loop reads them: as given, with 128 x each row's sum of the
// first K - K % 64 entries (avx512-vnni), or widened to int16 (avx2).
struct Activations {
  const int8_t* raw;            // [M, K]
  std::vector<int32_t> shift;   // [M] (avx512-vnni)
  std::vector<int16_t> s16;     // [M, K] (avx2)
};

int32_t Dot(const int8_t* a, const int8_t* w, int64_t from, int64_t to) {
  int32_t s = 0;
  for (int64_t k = from; k < to; ++k) s += int32_t(a[k]) * int32_t(w[k]);
  return s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// [a, b, c, d]: the sums of four vectors' 16 lanes, with 13 instructions instead of 4 x 9.
__m128i Sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd =
      _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half =
      _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// VNNI multiplies unsigned by signed bytes: the weights are made unsigned (w ^ 0x80 = w + 128)
// and the activations stay signed, so sum (w + 128) a = sum w a + 128 sum a, and the shift is
// removed with the activation row's sum, computed once per call. G weight rows are summed
// before their sums are reduced together: one after the other (one linear stream, as the rows
// lie in memory) when the activations fit in the L1 cache, else side by side (`interleave`), so
// that each activation vector loaded from L2 serves G rows.
template <int MB, int G, bool interleave>
void WeightRowGroups(const Activations& act, int64_t m0, const int8_t* w, int32_t* out,
                     int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int64_t k64 = K & ~int64_t(63);
  const int8_t* a = act.raw + m0 * K;
  for (int64_t n = n0; n < n1; n += G) {
    __m512i acc[G][MB];
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MB; ++m) acc[g][m] = _mm512_setzero_si512();
    if (interleave) {
      for (int64_t k = 0; k < k64; k += 64) {
        __m512i wu[G];
        for (int g = 0; g < G; ++g)
          wu[g] = _mm512_xor_si512(_mm512_loadu_si512(w + (n + g) * K + k), flip);
        for (int m = 0; m < MB; ++m) {
          const __m512i av = _mm512_loadu_si512(a + m * K + k);
          for (int g = 0; g < G; ++g) acc[g][m] = _mm512_dpbusd_epi32(acc[g][m], wu[g], av);
        }
      }
    } else {
      for (int g = 0; g < G; ++g) {
        const int8_t* wr = w + (n + g) * K;
        for (int64_t k = 0; k < k64; k += 64) {
          const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(wr + k), flip);
          for (int m = 0; m < MB; ++m)
            acc[g][m] = _mm512_dpbusd_epi32(acc[g][m], wu, _mm512_loadu_si512(a + m * K + k));
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      auto row = [&](int g) { return g < G ? acc[g % G][m] : _mm512_setzero_si512(); };
      alignas(16) int32_t sums[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(sums), Sum4(row(0), row(1), row(2), row(3)));
      for (int g = 0; g < G; ++g)
        out[(m0 + m) * N + n + g] = sums[g] - act.shift[m0 + m] +
                                    Dot(a + m * K, w + (n + g) * K, k64, K);
    }
  }
}

template <int MB>
void WeightRows(const Activations& act, int64_t m0, const int8_t* w, int32_t* out, int64_t N,
                int64_t K, int64_t n0, int64_t n1) {
  constexpr int G = MB <= 4 ? 4 : MB == 5 ? 3 : 2;   // G x MB accumulators stay in registers
  const int64_t whole = n0 + (n1 - n0) / G * G;
  if (MB * K > kL1Bytes)
    WeightRowGroups<MB, G, true>(act, m0, w, out, N, K, n0, whole);
  else
    WeightRowGroups<MB, G, false>(act, m0, w, out, N, K, n0, whole);
  WeightRowGroups<MB, 1, false>(act, m0, w, out, N, K, whole, n1);
}
#elif defined(__AVX2__)
int32_t Sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// G weight rows at a time, side by side, so that each activation vector (int16, twice the
// int8 bytes) loaded from L2 serves G rows; G = 1 reads one row after the other.
template <int MB, int G>
void WeightRowGroups(const Activations& act, int64_t m0, const int8_t* w, int32_t* out,
                     int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t k16 = K & ~int64_t(15);
  const int16_t* a16 = act.s16.data() + m0 * K;
  for (int64_t n = n0; n < n1; n += G) {
    __m256i acc[G][MB];
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MB; ++m) acc[g][m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < k16; k += 16) {
      __m256i wv[G];
      for (int g = 0; g < G; ++g)
        wv[g] = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + g) * K + k)));
      for (int m = 0; m < MB; ++m) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a16 + m * K + k));
        for (int g = 0; g < G; ++g)
          acc[g][m] = _mm256_add_epi32(acc[g][m], _mm256_madd_epi16(av, wv[g]));
      }
    }
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MB; ++m)
        out[(m0 + m) * N + n + g] =
            Sum8(acc[g][m]) + Dot(act.raw + (m0 + m) * K, w + (n + g) * K, k16, K);
  }
}

template <int MB>
void WeightRows(const Activations& act, int64_t m0, const int8_t* w, int32_t* out, int64_t N,
                int64_t K, int64_t n0, int64_t n1) {
  constexpr int G = MB <= 2 ? 4 : MB <= 5 ? 2 : 1;   // G x MB accumulators in 16 registers
  if (G == 1 || 2 * MB * K <= kL1Bytes) {
    WeightRowGroups<MB, 1>(act, m0, w, out, N, K, n0, n1);
    return;
  }
  const int64_t whole = n0 + (n1 - n0) / G * G;
  WeightRowGroups<MB, G>(act, m0, w, out, N, K, n0, whole);
  WeightRowGroups<MB, 1>(act, m0, w, out, N, K, whole, n1);
}
#else
template <int MB>
void WeightRows(const Activations& act, int64_t m0, const int8_t* w, int32_t* out, int64_t N,
                int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < MB; ++m)
      out[(m0 + m) * N + n] = Dot(act.raw + (m0 + m) * K, w + n * K, 0, K);
}
#endif

// out[:, n0:n1] for every activation row, kMaxRows rows per pass over the weights.
void Columns(const Activations& act, int64_t M, const int8_t* w, int32_t* out, int64_t N,
             int64_t K, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, M - m0)) {
#define SPECJAX_ROWS(R) \
  case R:               \
    WeightRows<R>(act, m0, w, out, N, K, n0, n1); \
    break;
      SPECJAX_ROWS(1) SPECJAX_ROWS(2) SPECJAX_ROWS(3) SPECJAX_ROWS(4)
      SPECJAX_ROWS(5) SPECJAX_ROWS(6) SPECJAX_ROWS(7) SPECJAX_ROWS(8)
#undef SPECJAX_ROWS
    }
  }
}

// One call's work, shared with the pool's tasks (which may outlive the call when they run late).
struct Work {
  Activations act;
  int64_t M, N, K, chunk, chunks;
  const int8_t* w;
  int32_t* out;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Columns(act, M, w, out, N, K, c * chunk, std::min(N, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

using Int8Matrix = ffi::Buffer<ffi::S8, 2>;
using Int32Matrix = ffi::Buffer<ffi::S32, 2>;

ffi::Error Int8DotImpl(ffi::ThreadPool pool, Int8Matrix a, Int8Matrix w,
                       ffi::Result<Int32Matrix> out) {
  const int64_t M = a.dimensions()[0], K = a.dimensions()[1], N = w.dimensions()[0];
  if (w.dimensions()[1] != K) return ffi::Error::InvalidArgument("int8 dot: K differs");
  auto work = std::make_shared<Work>();
  work->act.raw = a.typed_data();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  work->act.shift.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    int32_t sum = 0;
    for (int64_t k = 0; k < (K & ~int64_t(63)); ++k) sum += a.typed_data()[m * K + k];
    work->act.shift[m] = 128 * sum;
  }
#elif defined(__AVX2__)
  work->act.s16.assign(a.typed_data(), a.typed_data() + M * K);
#endif
  work->M = M, work->N = N, work->K = K, work->w = w.typed_data(), work->out = out->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // about four chunks per thread, each a multiple of 4 and at least 16 weight rows (so tiny
  // products stay on one thread)
  work->chunk = std::max<int64_t>(16, ((N + 4 * threads - 1) / (4 * threads) + 3) / 4 * 4);
  work->chunks = (N + work->chunk - 1) / work->chunk;
  for (int64_t t = 1; t < std::min(threads, work->chunks); ++t)
    pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxInt8Dot, Int8DotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8Matrix>()
                                  .Arg<Int8Matrix>()
                                  .Ret<Int32Matrix>());

// Which instruction set the build selected (models/cpu_kernels.py logs it).
extern "C" const char* SpecjaxInt8Isa() { return SPECJAX_INT8_ISA; }
