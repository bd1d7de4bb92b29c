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

// The activations as the inner loop reads them: int8 shifted to uint8 (VNNI multiplies
// unsigned by signed bytes; the shift is removed with the weight row's sum) or widened to int16.
struct Activations {
  const int8_t* raw;          // [M, K]
  std::vector<uint8_t> u8;    // [M, K], raw + 128 (avx512-vnni)
  std::vector<int16_t> s16;   // [M, K] (avx2)
};

int32_t Dot(const int8_t* a, const int8_t* w, int64_t from, int64_t to) {
  int32_t s = 0;
  for (int64_t k = from; k < to; ++k) s += int32_t(a[k]) * int32_t(w[k]);
  return s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int MB>
void WeightRows(const Activations& act, int64_t m0, const int8_t* w, int32_t* out, int64_t N,
                int64_t K, int64_t n0, int64_t n1) {
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t k64 = K & ~int64_t(63);
  const uint8_t* au = act.u8.data() + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    __m512i acc[MB];
    __m512i wsum = _mm512_setzero_si512();
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < k64; k += 64) {
      const __m512i wv = _mm512_loadu_si512(wr + k);
      wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(au + m * K + k), wv);
    }
    const int32_t shift = 128 * _mm512_reduce_add_epi32(wsum);  // sum (a + 128) w - 128 sum w
    for (int m = 0; m < MB; ++m)
      out[(m0 + m) * N + n] = _mm512_reduce_add_epi32(acc[m]) - shift +
                              Dot(act.raw + (m0 + m) * K, wr, k64, K);
  }
}
#elif defined(__AVX2__)
int32_t Sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <int MB>
void WeightRows(const Activations& act, int64_t m0, const int8_t* w, int32_t* out, int64_t N,
                int64_t K, int64_t n0, int64_t n1) {
  const int64_t k16 = K & ~int64_t(15);
  const int16_t* a16 = act.s16.data() + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    __m256i acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < k16; k += 16) {
      const __m256i wv =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k)));
      for (int m = 0; m < MB; ++m) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a16 + m * K + k));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(av, wv));
      }
    }
    for (int m = 0; m < MB; ++m)
      out[(m0 + m) * N + n] = Sum8(acc[m]) + Dot(act.raw + (m0 + m) * K, wr, k16, K);
  }
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
  work->act.u8.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) work->act.u8[i] = uint8_t(int32_t(a.typed_data()[i]) + 128);
#elif defined(__AVX2__)
  work->act.s16.assign(a.typed_data(), a.typed_data() + M * K);
#endif
  work->M = M, work->N = N, work->K = K, work->w = w.typed_data(), work->out = out->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // about four chunks per thread, each at least 16 weight rows (so tiny products stay on one)
  work->chunk = std::max<int64_t>(16, (N + 4 * threads - 1) / (4 * threads));
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
