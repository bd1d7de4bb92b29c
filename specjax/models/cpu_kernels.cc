// specjax's quantized products for XLA:CPU, called through XLA's FFI (models/cpu_kernels.py
// builds them with the machine's C++ compiler for the machine's own instruction set).
//
//   int8:  out[m, n] = sum_k a[m, k] w[n, k]                     a int8 [M, K], w int8 [N, K]
//                                                                 in the blocked layout below,
//                                                                 out int32 [M, N]
//   int4:  out[m, n] = sum_g s[n, g] sum_{k in group g} a[m, k] w[n, k]
//          a int8 [M, K]; w int4 in [-8, 7], packed uint8 [N, K / 2]; s float32 [N, K / 64];
//          out float32 [M, N]. Group g holds k = 64 g .. 64 g + 63 in 32 bytes: byte j has
//          w[64 g + j] + 8 in its low nibble and w[64 g + 32 + j] + 8 in its high one.
//
// A decoding step multiplies a few activation rows by a weight matrix that is read once from
// memory, so each weight row is streamed once and multiplied with every activation row while it
// is in registers. XLA's own s8 x s8 -> s32 product reads the weights at about a third of the
// memory bandwidth for these shapes, and a one-row product falls to a slow path. The int8 sums
// are exact int32 arithmetic (the same integers XLA's product gives, in any order); an int4
// group's sum is exact too, and the groups are added in float32 in one order that does not
// depend on M, so a row's result is the same bits in a product of any width.
//
// On a CPU with AMX (and Linux letting the process use it), a prompt's int8 product (more than 8
// rows) runs on AMX's tile multiply instead, reading the same blocked layout.
//
// Rows of w are split into chunks that the calling thread and tasks on XLA's intra-op thread
// pool take from one counter: the caller waits only for chunks a running thread has taken, so a
// task queued behind busy threads never blocks it (and finds nothing left when it runs).

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPECJAX_ISA "avx512-vnni"
#include <immintrin.h>
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define SPECJAX_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__AVX2__)
#define SPECJAX_ISA "avx2"
#include <immintrin.h>
#else
#define SPECJAX_ISA "generic"
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;  // activation rows multiplied per pass over the weights
constexpr int64_t kBlock = 16;  // weight rows per block of the blocked int8 layout
constexpr int64_t kL1Bytes = 16 << 10;  // activations up to this size are read from L1
constexpr int64_t kTileBytes = 256 << 10;   // a prompt product's weight tile, in L2

// The weights stream from memory once per pass, and a core's bandwidth is the cache misses it
// keeps in flight over the memory's latency. On some server cores (an Intel Xeon, for one) the
// hardware prefetchers alone keep too few in flight, and a verify pass's extra arithmetic per
// byte then slows the stream itself. So each loop that streams weights asks for the bytes kAhead
// ahead of where it reads, into L2, once per 64-byte line.
constexpr int64_t kAhead = 4 << 10;
inline void Ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kAhead, 0, 2);
}

// f(std::integral_constant<int, R>()) for R = rows (1 .. kMaxRows): the kernels' row count is a
// template argument, so that their accumulators stay in registers.
template <class F>
void WithRows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 8: f(std::integral_constant<int, 8>()); break;
  }
}

// The blocked int8 layout (avx512-vnni builds; models/quant.block_int8 writes it, and other
// builds read the plain [N, K] matrix): the N x K weights as N / 16
// blocks of 16 rows, then the last N % 16 rows as they are. A block is its rows' first
// K - K % 4 entries four at a time, [K / 4, 16, 4] (64 bytes: entries 4q .. 4q + 3 of each of
// the 16 rows), then their last K % 4 entries, [16, K % 4]; 16 K bytes in all, so the whole is
// N K bytes, the shape of the plain [N, K] matrix. One 64-byte load gives the next four entries
// of 16 rows, and one multiply-add per activation row (its four entries broadcast) adds them to
// 16 sums, one per weight row: no horizontal sums at the end of a row, and each activation read
// is 4 bytes, so a verify pass's 4-8 rows cost little more than a step's one.

// The activations as the inner loop reads them: as given, with 128 x each row's sum of the
// first K - K % 4 entries and those entries regrouped (avx512-vnni), or widened to int16 (avx2).
struct Activations {
  const int8_t* raw;            // [M, K]
  std::vector<int8_t> tiles;    // [ceil(M / 16), K / 64, 16, 64] (AMX): 16 rows' 64 entries a
                                // tile, zero past row M
  std::vector<int32_t> shift;   // [M] (avx512-vnni)
  std::vector<int32_t> quads;   // [ceil(M / 8), K / 4, 8] (avx512-vnni): 8 rows' entries four
                                // at a time side by side, zero past row M
  std::vector<int16_t> s16;     // [M, K] (avx2)
};

int32_t Dot(const int8_t* a, const int8_t* w, int64_t from, int64_t to) {
  int32_t s = 0;
  for (int64_t k = from; k < to; ++k) s += int32_t(a[k]) * int32_t(w[k]);
  return s;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// out[m, n .. n + 15] += the last K % 4 entries' products of block `block` (rows n .. n + 15).
void BlockTail(const int8_t* a, const int8_t* block, int32_t* out, int64_t K) {
  const int64_t k4 = K & ~int64_t(3), rest = K - k4;
  for (int64_t r = 0; r < kBlock; ++r)
    out[r] += Dot(a, block + k4 * kBlock + r * rest - k4, k4, K);
}

// acc += u8 x s8 (VNNI, in place). Written in assembly because GCC's intrinsic, in these
// unrolled loops, copied each accumulator to another register and back around every
// multiply-add, which halved a prompt's throughput.
inline __m512i Dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// acc[p][m] += block p's 16 rows' entries 4q .. 4q + 3 (at wq[p]) times row m's (aq[m]).
template <int MB, int P>
__attribute__((always_inline)) inline void AddQuad(__m512i (&acc)[P][MB],
                                                   const int8_t* const (&wq)[P],
                                                   const int32_t* aq) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512i wv[P];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) wv[p] = _mm512_xor_si512(_mm512_loadu_si512(wq[p]), flip);
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) {
    const __m512i av = _mm512_set1_epi32(aq[m]);
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) acc[p][m] = Dpbusd(acc[p][m], wv[p], av);
  }
}

// VNNI multiplies unsigned by signed bytes: the weights are made unsigned (w ^ 0x80 = w + 128)
// and the activations stay signed, so sum (w + 128) a = sum w a + 128 sum a, and the shift is
// removed with the activation row's sum, computed once per call. P blocks side by side (each
// activation entry loaded serves P blocks: where the rows' activations are read from L2), and U
// chains of sums per row (the quads q with q % U = u), so that few rows are not bound by the
// multiply-add's latency.
template <int MB, int U, int P>
void BlockRows(const Activations& act, int64_t m0, const int8_t* w, int32_t* out, int64_t N,
               int64_t K, int64_t n) {
  const int64_t quads = K / 4, whole = quads / U * U;
  // rows m0 .. m0 + 7's entries four at a time, side by side (m0 is a multiple of kMaxRows)
  const int32_t* aq = act.quads.data() + m0 * quads;
  const int8_t* wq[P];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) wq[p] = w + (n + p * kBlock) * K;
  __m512i acc[U][P][MB];
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) acc[u][p][m] = _mm512_setzero_si512();
  for (int64_t q = 0; q < whole; q += U) {
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) {
      AddQuad<MB, P>(acc[u], wq, aq + (q + u) * kMaxRows);
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        Ahead(wq[p]);
        wq[p] += 64;
      }
    }
  }
  for (int64_t q = whole; q < quads; ++q) {
    AddQuad<MB, P>(acc[0], wq, aq + q * kMaxRows);
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) wq[p] += 64;
  }
  // (constant indices only: one computed index would keep every accumulator in memory)
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      __m512i sum = acc[0][p][m];
#pragma GCC unroll 16
      for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, acc[u][p][m]);
      int32_t* o = out + (m0 + m) * N + n + p * kBlock;
      _mm512_storeu_si512(o, _mm512_sub_epi32(sum, _mm512_set1_epi32(act.shift[m0 + m])));
      if (K % 4) BlockTail(act.raw + (m0 + m) * K, w + (n + p * kBlock) * K, o, K);
    }
}

// Rows m0 .. m0 + MB - 1 times `blocks` (1 or 2) blocks from row n: two side by side where the
// rows' activations outgrow L1 (a verify pass's down projection: one activation load served
// two weight vectors, 0.8x the time for the 1.5B target's [4, 8960] x [1536, 8960] on an AMD
// EPYC with AVX-512), else one with more chains where fewer rows give fewer sums.
template <int MB>
void Block(const Activations& act, int64_t m0, const int8_t* w, int32_t* out, int64_t N,
           int64_t K, int64_t n, int blocks) {
  if (blocks == 2)
    BlockRows<MB, 1, 2>(act, m0, w, out, N, K, n);
  else
    BlockRows<MB, (MB <= 2 ? 4 : MB <= 4 ? 2 : 1), 1>(act, m0, w, out, N, K, n);
}

// How many blocks Columns gives Block at once (up to `left`).
// Columns' units of work: blocks of 16 weight rows (the rows after the last block one more),
// as many as the pool's threads take at least.
constexpr int64_t kUnit = kBlock, kLeastUnits = 1;

int BlocksAtOnce(int64_t rows, int64_t K, int64_t left) {
  return rows * K > kL1Bytes && left >= 2 ? 2 : 1;
}

// Rows m0 .. m0 + rows - 1 of out (rows <= kMaxRows) for `blocks` blocks from row n.
void BlockAny(const Activations& act, int64_t m0, int64_t rows, const int8_t* w, int32_t* out,
              int64_t N, int64_t K, int64_t n, int blocks) {
  WithRows(rows, [&](auto r) { Block<decltype(r)::value>(act, m0, w, out, N, K, n, blocks); });
}

#if defined(SPECJAX_AMX)
// AMX (Intel Xeon since Sapphire Rapids) multiplies 16 activation rows by 16 weight rows over 64
// entries in one instruction, tdpbssd, whose second operand is 16 rows of 64 bytes holding four
// entries of 16 columns each: 16 quads of a block of the blocked layout, 1 KB read as it lies.
// A prompt's product is bound by VNNI's multiply-adds and runs 1.6-2.8x faster on AMX (128-160
// rows of the 1.5B target's [8960, 1536] matrix, two threads); a decoding step's or verify
// pass's few rows stream the weights from memory either way and keep VNNI (AMX gained nothing
// steady there, and lost on the down projection's long rows). The sums are exact int32, the
// integers VNNI gives. (int4's prompts stay on VNNI: each 64-entry group's sums need their own
// scale, so a tile's sums leave the tile registers after every multiply, which cost most of
// AMX's gain.)
constexpr int64_t kTileRows = 16, kTileK = 64;

// Whether this process may use AMX: Linux hands out the tile registers' state on request.
bool AmxPermitted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;   // ARCH_REQ_XCOMP_PERM, XTILEDATA
  static const bool permitted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return permitted;
}

bool UseAmx(int64_t M, int64_t K) { return M > kMaxRows && K % kTileK == 0 && AmxPermitted(); }

// Every tile 16 rows of 64 bytes: tmm0-3 the sums of 2 x 2 (row tile, block) pairs, tmm4-5 two
// row tiles of activations, tmm6-7 two blocks' quads.
void AmxConfigure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) {
    config.bytes[t] = kTileK;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}

// Rows m0 .. m0 + 31 (those below M) times blocks b, b + 1 (the second where `pair`): sums of
// each (row tile, block) in tmm0-3, stored through a tile-sized buffer to the rows that exist.
void AmxBlocks(const Activations& act, int64_t M, int64_t m0, const int8_t* w, int32_t* out,
               int64_t N, int64_t K, int64_t b, bool pair) {
  const bool two = m0 + kTileRows < M;
  const int8_t* a0 = act.tiles.data() + m0 * K;           // row tile m0 / 16, K / 64 tiles
  const int8_t* a1 = a0 + kTileRows * K;
  const int8_t* w0 = w + b * kBlock * K;
  const int8_t* w1 = w0 + kBlock * K;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += kTileK) {               // 1 KB of each operand per step
    _tile_loadd(4, a0 + k * kTileRows, kTileK);
    _tile_loadd(6, w0 + k * kBlock, kTileK);
    _tile_dpbssd(0, 4, 6);
    if (pair) {
      _tile_loadd(7, w1 + k * kBlock, kTileK);
      _tile_dpbssd(1, 4, 7);
    }
    if (two) {
      _tile_loadd(5, a1 + k * kTileRows, kTileK);
      _tile_dpbssd(2, 5, 6);
      if (pair) _tile_dpbssd(3, 5, 7);
    }
  }
  alignas(64) int32_t sums[kTileRows * kBlock];
  auto store = [&](int64_t rows_from, int64_t block) {
    for (int64_t r = 0; r < std::min(kTileRows, M - rows_from); ++r)
      std::memcpy(out + (rows_from + r) * N + block * kBlock, sums + r * kBlock, 4 * kBlock);
  };
  _tile_stored(0, sums, 4 * kBlock);
  store(m0, b);
  if (pair) {
    _tile_stored(1, sums, 4 * kBlock);
    store(m0, b + 1);
  }
  if (two) {
    _tile_stored(2, sums, 4 * kBlock);
    store(m0 + kTileRows, b);
    if (pair) {
      _tile_stored(3, sums, 4 * kBlock);
      store(m0 + kTileRows, b + 1);
    }
  }
}

// Blocks b0 .. b1 for every row, tiles of blocks staying in L2 while the row tiles pass over
// them, as the VNNI path does. The tile registers are this thread's for the call only.
void AmxColumns(const Activations& act, int64_t M, const int8_t* w, int32_t* out, int64_t N,
                int64_t K, int64_t b0, int64_t b1) {
  AmxConfigure();
  const int64_t tile = std::max<int64_t>(2, kTileBytes / (kBlock * K));
  for (int64_t t0 = b0; t0 < b1; t0 += tile) {
    const int64_t t1 = std::min(b1, t0 + tile);
    for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows)
      for (int64_t b = t0; b < t1; b += 2) AmxBlocks(act, M, m0, w, out, N, K, b, b + 1 < t1);
  }
  _tile_release();
}

// Activations a [M, K] as AMX tiles, [ceil(M / 16), K / 64, 16, 64], zero past row M.
std::vector<int8_t> AmxTiles(const int8_t* a, int64_t M, int64_t K) {
  std::vector<int8_t> tiles((M + kTileRows - 1) / kTileRows * kTileRows * K, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += kTileK)
      std::memcpy(tiles.data() + (m / kTileRows * K + k) * kTileRows + m % kTileRows * kTileK,
                  a + m * K + k, kTileK);
  return tiles;
}
#else
bool UseAmx(int64_t, int64_t) { return false; }
void AmxColumns(const Activations&, int64_t, const int8_t*, int32_t*, int64_t, int64_t, int64_t,
                int64_t) {}
std::vector<int8_t> AmxTiles(const int8_t*, int64_t, int64_t) { return {}; }
#endif

// Blocks b0 .. b1 for every activation row on VNNI. A decoding step's or verify pass's rows
// (M <= 8) pass over each block once; a prompt's take tiles of blocks that stay in L2 while
// every 8 activation rows pass over them.
void VnniColumns(const Activations& act, int64_t M, const int8_t* w, int32_t* out, int64_t N,
                 int64_t K, int64_t b0, int64_t b1) {
  const int64_t tile = M > kMaxRows ? std::max<int64_t>(1, kTileBytes / (kBlock * K)) : b1 - b0;
  for (int64_t t0 = b0; t0 < b1; t0 += tile) {
    const int64_t t1 = std::min(b1, t0 + tile);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
      for (int64_t b = t0, at; b < t1; b += at) {
        at = BlocksAtOnce(rows, K, t1 - b);
        BlockAny(act, m0, rows, w, out, N, K, b * kBlock, int(at));
      }
    }
  }
}

// out[:, 16 b0 : 16 b1] (the last N % 16 rows where b1 passes the blocks) for every activation
// row: a prompt's on AMX where the CPU has it, else on VNNI.
void Columns(const Activations& act, int64_t M, const int8_t* w, int32_t* out, int64_t N,
             int64_t K, int64_t b0, int64_t b1) {
  const int64_t blocks = N / kBlock, last = std::min(b1, blocks);
  if (b0 < last)
    (UseAmx(M, K) ? AmxColumns : VnniColumns)(act, M, w, out, N, K, b0, last);
  if (b1 > blocks)                      // the rows after the last block, stored as they are
    for (int64_t n = blocks * kBlock; n < N; ++n)
      for (int64_t m = 0; m < M; ++m) out[m * N + n] = Dot(act.raw + m * K, w + n * K, 0, K);
}
#else   // the plain layout
// Columns' units of work: weight rows, at least 16 to a chunk (tiny products stay on one thread)
constexpr int64_t kUnit = 1, kLeastUnits = 16;

#if defined(__AVX2__)
// Without VNNI the weights keep the plain [N, K] layout: AVX2's widening multiply-adds over the
// blocked one (a broadcast of four int16 entries per product, where the plain layout loads
// sixteen) measured slower at 4 rows, compiled for AVX2 on the AVX-512 machine where the
// blocked layout was made. Rows are read one after another, or G side by side where the
// activations outgrow L1.
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
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) acc[g][m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < k16; k += 16) {
      __m256i wv[G];
      if (k % 64 == 0) {
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) Ahead(w + (n + g) * K + k);
      }
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g)
        wv[g] = _mm256_cvtepi8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + g) * K + k)));
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a16 + m * K + k));
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g)
          acc[g][m] = _mm256_add_epi32(acc[g][m], _mm256_madd_epi16(av, wv[g]));
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
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
#else   // plain C++, the plain layout
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
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
    WithRows(std::min<int64_t>(kMaxRows, M - m0), [&](auto r) {
      WeightRows<decltype(r)::value>(act, m0, w, out, N, K, n0, n1);
    });
}
#endif

// ---- int4 weights (W4A8) -------------------------------------------------------------------

constexpr int64_t kGroup = 64;  // int4 values per scale, along K

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int4 weights in the blocked layout of int8 (quant.block_int4): the packed bytes [N, K / 2]
// blocked like int8 weights, four bytes a row at a time, so a block's 64-byte vector q holds 16
// rows' bytes 4q .. 4q + 3: in group g = q / 8, j = q % 8, their low nibbles are the weights
// 64 g + 4 j .. + 3 and their high nibbles 64 g + 32 + 4 j .. + 3; the scales [N, K / 64]
// blocked one entry at a time, [K / 64, 16] a block. The weights are unsigned (w + 8), so a
// group's sum starts from -8 x the activations' sum over the group (`shift`); it is exact in
// int32, converted to float32 and added times its 16 scales, group after group, in one order
// whatever the row count, so a row's result is the same bits in a product of any width.
struct Int4Activations {
  const int8_t* raw;             // [M, K]
  std::vector<int32_t> quads;    // [ceil(M / 8), K / 4, 8]: as int8's Activations::quads
  std::vector<int32_t> shift;    // [M, K / 64]: -8 x each group's sum
};

Int4Activations Int4Prepare(const int8_t* a, int64_t M, int64_t K) {
  const int64_t quads = K / 4, groups = K / kGroup;
  Int4Activations act{a, {}, {}};
  act.quads.assign((M + kMaxRows - 1) / kMaxRows * quads * kMaxRows, 0);
  act.shift.assign(M * groups, 0);
  for (int64_t m = 0; m < M; ++m) {
    int32_t* row = act.quads.data() + (m / kMaxRows * quads) * kMaxRows + m % kMaxRows;
    for (int64_t q = 0; q < quads; ++q) std::memcpy(row + q * kMaxRows, a + m * K + 4 * q, 4);
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t k = 0; k < kGroup; ++k) sum += a[m * K + g * kGroup + k];
      act.shift[m * groups + g] = -8 * sum;
    }
  }
  return act;
}

// Rows m0 .. m0 + MB - 1 (m0 a multiple of kMaxRows) times the block of weight rows n .. n + 15.
// The low and high nibbles keep their own sums (two chains per row, so that one row is not
// bound by the multiply-add's latency), added at the group's end.
template <int MB>
void Int4BlockRows(const Int4Activations& act, int64_t m0, const uint8_t* w, const float* s,
                   float* out, int64_t N, int64_t K, int64_t n) {
  const int64_t groups = K / kGroup, quads = K / 4;
  const __m512i low = _mm512_set1_epi8(0x0f);
  const uint8_t* block = w + n * (K / 2);
  const float* scales = s + n * groups;
  const int32_t* aq = act.quads.data() + m0 * quads;
  __m512 acc[MB];
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i lo[MB], hi[MB];
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      lo[m] = _mm512_set1_epi32(act.shift[(m0 + m) * groups + g]);
      hi[m] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) {
      const __m512i v = _mm512_loadu_si512(block + (8 * g + j) * 64);
      Ahead(block + (8 * g + j) * 64);
      const __m512i wl = _mm512_and_si512(v, low);
      const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const int32_t* al = aq + (16 * g + j) * kMaxRows;       // entries 64 g + 4 j .. + 3
      const int32_t* ah = al + 8 * kMaxRows;                 // entries 64 g + 32 + 4 j .. + 3
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        lo[m] = Dpbusd(lo[m], wl, _mm512_set1_epi32(al[m]));
        hi[m] = Dpbusd(hi[m], wh, _mm512_set1_epi32(ah[m]));
      }
    }
    const __m512 scale = _mm512_loadu_ps(scales + g * kBlock);
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo[m], hi[m])), scale, acc[m]);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + (m0 + m) * N + n, acc[m]);
}

// One weight row after the last block (stored as it is), every activation row: the same
// arithmetic as a block's lane (the exact group sums, then float32 fused multiply-adds in group
// order), so that its result is the bits a block would give.
void Int4Row(const Int4Activations& act, int64_t M, const uint8_t* w, const float* s,
             float* out, int64_t N, int64_t K, int64_t n) {
  const int64_t groups = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t j = 0; j < 32; ++j) {
        const uint8_t byte = w[n * (K / 2) + g * 32 + j];
        sum += act.raw[m * K + g * kGroup + j] * ((byte & 15) - 8) +
               act.raw[m * K + g * kGroup + 32 + j] * ((byte >> 4) - 8);
      }
      acc = std::fma(float(sum), s[n * groups + g], acc);
    }
    out[m * N + n] = acc;
  }
}

// out[:, 16 b0 : 16 b1] (the rows after the last block where b1 passes the blocks): as the
// int8 Columns, tiles of blocks in L2 for a prompt's rows.
void Int4Columns(const Int4Activations& act, int64_t M, const uint8_t* w, const float* s,
                 float* out, int64_t N, int64_t K, int64_t b0, int64_t b1) {
  const int64_t blocks = N / kBlock;
  const int64_t tile = M > kMaxRows ? std::max<int64_t>(1, kTileBytes / (kBlock * K / 2))
                                    : b1 - b0;
  for (int64_t t0 = b0; t0 < std::min(b1, blocks); t0 += tile) {
    const int64_t t1 = std::min({b1, blocks, t0 + tile});
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
      for (int64_t b = t0; b < t1; ++b)
        WithRows(std::min<int64_t>(kMaxRows, M - m0), [&](auto r) {
          Int4BlockRows<decltype(r)::value>(act, m0, w, s, out, N, K, b * kBlock);
        });
  }
  if (b1 > blocks)
    for (int64_t n = blocks * kBlock; n < N; ++n) Int4Row(act, M, w, s, out, N, K, n);
}
#else
// The activations of an int4 product as its inner loop reads them (the plain layout): the
// weights are unsigned (w + 8) and the activations signed, so a lane's sum carries 8 x the sum
// of the activations it multiplied: `shift` holds -8 x that sum per lane, the accumulator's
// starting value; lane l < 8 of block b covers a[128 b + 4 l .. +4) and a[128 b + 32 + 4 l ..
// +4), lane 8 + l the same of group 2b + 1. avx2 reads one group per 256-bit vector with those
// lanes, from `raw`.
struct Int4Activations {
  const int8_t* raw;             // [M, K]
  int64_t blocks;                // ceil(K / 128)
  std::vector<int32_t> shift;    // [M, blocks * 16]
};

Int4Activations Int4Prepare(const int8_t* a, int64_t M, int64_t K) {
  Int4Activations act{a, (K + 127) / 128, {}};
  const int64_t B = act.blocks;
  act.shift.assign(M * B * 16, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += kGroup) {      // group g = k / 64: block g / 2, half g % 2
      const int8_t* x = a + m * K + k;
      int32_t* shift = act.shift.data() + ((m * B + k / 128) * 64 + (k / kGroup % 2) * 32) / 4;
      for (int l = 0; l < 8; ++l)
        shift[l] = -8 * (x[4 * l] + x[4 * l + 1] + x[4 * l + 2] + x[4 * l + 3] +
                         x[32 + 4 * l] + x[33 + 4 * l] + x[34 + 4 * l] + x[35 + 4 * l]);
    }
  return act;
}

#if defined(__AVX2__)
template <int MB>
void Int4Rows(const Int4Activations& act, int64_t m0, const uint8_t* w, const float* s,
              float* out, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const int64_t G = K / kGroup, B = act.blocks;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * (K / 2);
    __m256 acc[MB];
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (g % 2 == 0) Ahead(wr + g * 32);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + g * 32));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const __m256 scale = _mm256_set1_ps(s[n * G + g]);
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const int8_t* a = act.raw + (m0 + m) * K + g * kGroup;
        // u8 x s8 pairs: at most 2 x 15 x 128 per int16 lane, twice that summed: no saturation
        const __m256i pairs = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32))));
        const __m256i shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            act.shift.data() + ((m0 + m) * B + g / 2) * 16 + (g % 2) * 8));
        const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), shift);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, acc[m]);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[(m0 + m) * N + n] = _mm_cvtss_f32(h);
    }
  }
}
#else
template <int MB>
void Int4Rows(const Int4Activations& act, int64_t m0, const uint8_t* w, const float* s,
              float* out, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < MB; ++m) {
      const int8_t* a = act.raw + (m0 + m) * K;
      float total = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t sum = 0;
        for (int64_t j = 0; j < kGroup; ++j) {
          const uint8_t byte = w[n * (K / 2) + g * 32 + j % 32];
          sum += a[g * kGroup + j] * ((j < 32 ? byte & 15 : byte >> 4) - 8);
        }
        total += s[n * G + g] * float(sum);
      }
      out[(m0 + m) * N + n] = total;
    }
}
#endif

void Int4Columns(const Int4Activations& act, int64_t M, const uint8_t* w, const float* s,
                 float* out, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows)
    WithRows(std::min<int64_t>(kMaxRows, M - m0), [&](auto r) {
      Int4Rows<decltype(r)::value>(act, m0, w, s, out, N, K, n0, n1);
    });
}
#endif

// ---- attention, one query position at a time -----------------------------------------------

// sum_d x[d] y[d] in one fixed order (16 or 8 lanes, then the lanes in a fixed tree, then the
// tail), whichever query or pass it serves.
float DotF(const float* x, const float* y, int64_t n) {
  int64_t d = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= n; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  sum = _mm_cvtss_f32(h);
#endif
  for (; d < n; ++d) sum += x[d] * y[d];
  return sum;
}

// The G query heads that share key/value head `kvh`, of query position t of batch row b: each
// attends to the slots first .. pos (pos = its own slot), scores scaled, a softmax and the
// weighted sum of the values, every sum in slot order. Slots below lengths[b] are the cache's
// (kc, vc [B, Hkv, S, Dh], read only), the block's T entries (kn, vn [B, T, Hkv, Dh], as the
// projections give them) come next, so no copy of the cache with the block written is made.
// The same code for any pass width T and cache capacity S, so a position's output is the same
// bits in any pass.
void AttendGroup(const float* q, const float* kc, const float* vc, const float* kn,
                 const float* vn, const int32_t* positions, const int32_t* lengths, float* out,
                 int64_t T, int64_t H, int64_t Hkv, int64_t S, int64_t D, int64_t window,
                 float scale, int64_t b, int64_t t, int64_t kvh) {
  const int64_t G = H / Hkv;
  const int64_t start = std::clamp<int64_t>(lengths[b], 0, S);
  const int64_t pos = std::min<int64_t>(positions[b * T + t], start + T - 1);
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  const int64_t n = std::max<int64_t>(0, pos - first + 1);
  auto slot = [&](const float* cache, const float* block, int64_t s) {
    return s < start ? cache + ((b * Hkv + kvh) * S + s) * D
                     : block + ((b * T + s - start) * Hkv + kvh) * D;
  };
  const float* queries = q + ((b * T + t) * H + kvh * G) * D;
  float* outs = out + ((b * T + t) * H + kvh * G) * D;
  thread_local std::vector<float> scores;
  scores.assign(G * n, 0.f);
  for (int64_t s = 0; s < n; ++s) {
    const float* key = slot(kc, kn, first + s);
    for (int64_t g = 0; g < G; ++g) scores[g * n + s] = DotF(queries + g * D, key, D) * scale;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores.data() + g * n;
    float top = -INFINITY, total = 0.f;
    for (int64_t s = 0; s < n; ++s) top = std::max(top, sc[s]);
    for (int64_t s = 0; s < n; ++s) total += (sc[s] = std::exp(sc[s] - top));
    const float inv = n > 0 ? 1.f / total : 0.f;
    for (int64_t s = 0; s < n; ++s) sc[s] *= inv;
  }
  std::fill(outs, outs + G * D, 0.f);
  for (int64_t s = 0; s < n; ++s) {
    const float* vs = slot(vc, vn, first + s);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + s];
      float* o = outs + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p * vs[d];
    }
  }
}

// ---- the calls ----------------------------------------------------------------------------------

// One call's work: the columns n0 .. n1 of `columns` for chunks of weight rows, shared with the
// pool's tasks (which may outlive the call when they run late, hence shared ownership).
struct Work {
  std::function<void(int64_t, int64_t)> columns;
  int64_t N, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      columns(c * chunk, std::min(N, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs columns(n0, n1) over N units (int4 weight rows, blocks of 16 int8 weight rows, or
// attention's query groups) on the calling thread and the pool, in chunks of at least `least`.
void Parallel(ffi::ThreadPool& pool, int64_t N, std::function<void(int64_t, int64_t)> columns,
              int64_t least = 16) {
  auto work = std::make_shared<Work>();
  work->columns = std::move(columns);
  work->N = N;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // about four chunks per thread, each at least `least` units (so tiny products stay on one
  // thread); no coarser, or the last chunks of a product of few blocks load one thread more
  work->chunk = std::max<int64_t>(least, (N + 4 * threads - 1) / (4 * threads));
  work->chunks = (N + work->chunk - 1) / work->chunk;
  for (int64_t t = 1; t < std::min(threads, work->chunks); ++t)
    pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) std::this_thread::yield();
}

using Int8Matrix = ffi::Buffer<ffi::S8, 2>;
using Int32Matrix = ffi::Buffer<ffi::S32, 2>;
using FloatMatrix = ffi::Buffer<ffi::F32, 2>;
using Int8Stack = ffi::Buffer<ffi::S8, 3>;          // [L, N, K]: every layer's weights
using PackedInt4Stack = ffi::Buffer<ffi::U8, 3>;    // [L, N, K / 2]
using FloatStack = ffi::Buffer<ffi::F32, 3>;        // [L, N, K / 64]
using Index = ffi::Buffer<ffi::S32, 0>;             // the layer to read

// The layer `index` of a stack [L, ...] of `per_layer` elements, or nullptr where the index is
// outside [0, L): the weights and caches of every layer come whole, read in place (a slice
// passed to a custom call is a copy in XLA).
template <class T>
const T* Layer(const T* stack, int64_t layers, int64_t per_layer, int32_t index) {
  if (index < 0 || index >= layers) return nullptr;
  return stack + index * per_layer;
}

ffi::Error Int8DotImpl(ffi::ThreadPool pool, Int8Matrix a, Int8Stack ws, Index index,
                       ffi::Result<Int32Matrix> out) {
  const int64_t M = a.dimensions()[0], K = a.dimensions()[1], N = ws.dimensions()[1];
  if (ws.dimensions()[2] != K) return ffi::Error::InvalidArgument("int8 dot: K differs");
  const int8_t* wd = Layer(ws.typed_data(), ws.dimensions()[0], N * K, *index.typed_data());
  if (wd == nullptr) return ffi::Error::InvalidArgument("int8 dot: layer index out of range");
  auto act = std::make_shared<Activations>();
  act->raw = a.typed_data();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t quads = K / 4;
  act->shift.resize(M);
  act->quads.assign((M + kMaxRows - 1) / kMaxRows * quads * kMaxRows, 0);
  if (UseAmx(M, K)) act->tiles = AmxTiles(act->raw, M, K);
  for (int64_t m = 0; m < M; ++m) {
    int32_t sum = 0;
    for (int64_t k = 0; k < 4 * quads; ++k) sum += a.typed_data()[m * K + k];
    act->shift[m] = 128 * sum;
    int32_t* row = act->quads.data() + (m / kMaxRows * quads) * kMaxRows + m % kMaxRows;
    for (int64_t q = 0; q < quads; ++q)
      std::memcpy(row + q * kMaxRows, a.typed_data() + m * K + 4 * q, 4);
  }
#elif defined(__AVX2__)
  act->s16.assign(a.typed_data(), a.typed_data() + M * K);
#endif
  int32_t* od = out->typed_data();
  Parallel(pool, (N + kUnit - 1) / kUnit, [act, M, wd, od, N, K](int64_t u0, int64_t u1) {
    Columns(*act, M, wd, od, N, K, u0, u1);
  }, kLeastUnits);
  return ffi::Error::Success();
}

ffi::Error Int4DotImpl(ffi::ThreadPool pool, Int8Matrix a, PackedInt4Stack ws, FloatStack ss,
                       Index index, ffi::Result<FloatMatrix> out) {
  const int64_t M = a.dimensions()[0], K = a.dimensions()[1], N = ws.dimensions()[1],
                L = ws.dimensions()[0];
  if (K % kGroup != 0 || ws.dimensions()[2] != K / 2 || ss.dimensions()[0] != L ||
      ss.dimensions()[1] != N || ss.dimensions()[2] != K / kGroup)
    return ffi::Error::InvalidArgument("int4 dot: a [M, K], w [L, N, K / 2], s [L, N, K / 64] "
                                       "with K a multiple of 64");
  const uint8_t* wd = Layer(ws.typed_data(), L, N * K / 2, *index.typed_data());
  const float* sd = Layer(ss.typed_data(), L, N * K / kGroup, *index.typed_data());
  if (wd == nullptr) return ffi::Error::InvalidArgument("int4 dot: layer index out of range");
  auto act = std::make_shared<Int4Activations>(Int4Prepare(a.typed_data(), M, K));
  float* od = out->typed_data();
  Parallel(pool, (N + kUnit - 1) / kUnit, [act, M, wd, sd, od, N, K](int64_t u0, int64_t u1) {
    Int4Columns(*act, M, wd, sd, od, N, K, u0, u1);
  }, kLeastUnits);
  return ffi::Error::Success();
}

using FloatArray4 = ffi::Buffer<ffi::F32, 4>;
using Int32Matrix2 = ffi::Buffer<ffi::S32, 2>;

using Int32Vector = ffi::Buffer<ffi::S32, 1>;

// The cache comes as one layer's [B, Hkv, S, Dh] or the whole stack [L, B, Hkv, S, Dh] with the
// layer's index (one layer's: what a sharded caller gathers, where XLA cannot split this call).
ffi::Error AttendImpl(ffi::ThreadPool pool, FloatArray4 q, ffi::AnyBuffer kc, ffi::AnyBuffer vc,
                      Index index, FloatArray4 kn, FloatArray4 vn, Int32Matrix2 positions,
                      Int32Vector lengths, int64_t window, float scale,
                      ffi::Result<FloatArray4> out) {
  const int64_t B = q.dimensions()[0], T = q.dimensions()[1], H = q.dimensions()[2],
                D = q.dimensions()[3];
  const auto cache = kc.dimensions();
  const bool stacked = cache.size() == 5;
  const int64_t L = stacked ? cache[0] : 1, Hkv = cache.size() >= 4 ? cache[stacked + 1] : 0,
                S = cache.size() >= 4 ? cache[stacked + 2] : 0;
  auto dims = [](auto dimensions, auto... want) {
    const int64_t w[] = {want...};
    return dimensions.size() == sizeof...(want) &&
           std::equal(std::begin(w), std::end(w), dimensions.begin());
  };
  auto cache_dims = [&](const ffi::AnyBuffer& x) {
    return x.element_type() == ffi::F32 && (stacked ? dims(x.dimensions(), L, B, Hkv, S, D)
                                                    : dims(x.dimensions(), B, Hkv, S, D));
  };
  if (Hkv == 0 || H % Hkv != 0 || !cache_dims(kc) || !cache_dims(vc) ||
      !dims(kn.dimensions(), B, T, Hkv, D) || !dims(vn.dimensions(), B, T, Hkv, D) ||
      positions.dimensions()[0] != B || positions.dimensions()[1] != T ||
      lengths.dimensions()[0] != B)
    return ffi::Error::InvalidArgument("attention: q [B, T, H, Dh], the cache's k and v float32 "
                                       "[B, Hkv, S, Dh] or [L, B, Hkv, S, Dh], the block's [B, "
                                       "T, Hkv, Dh], positions [B, T], lengths [B], H a "
                                       "multiple of Hkv");
  const float *kcd = Layer(static_cast<const float*>(kc.untyped_data()), L, B * Hkv * S * D,
                           *index.typed_data()),
              *vcd = Layer(static_cast<const float*>(vc.untyped_data()), L, B * Hkv * S * D,
                           *index.typed_data());
  if (kcd == nullptr) return ffi::Error::InvalidArgument("attention: layer index out of range");
  const float *qd = q.typed_data(), *knd = kn.typed_data(), *vnd = vn.typed_data();
  const int32_t *pd = positions.typed_data(), *ld = lengths.typed_data();
  float* od = out->typed_data();
  Parallel(pool, B * T * Hkv, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      AttendGroup(qd, kcd, vcd, knd, vnd, pd, ld, od, T, H, Hkv, S, D, window, scale,
                  i / (T * Hkv), i / Hkv % T, i % Hkv);
  }, 1);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxInt8Dot, Int8DotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8Matrix>()
                                  .Arg<Int8Stack>()
                                  .Arg<Index>()
                                  .Ret<Int32Matrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxInt4Dot, Int4DotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Int8Matrix>()
                                  .Arg<PackedInt4Stack>()
                                  .Arg<FloatStack>()
                                  .Arg<Index>()
                                  .Ret<FloatMatrix>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttend, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<FloatArray4>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Index>()
                                  .Arg<FloatArray4>()
                                  .Arg<FloatArray4>()
                                  .Arg<Int32Matrix2>()
                                  .Arg<Int32Vector>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Ret<FloatArray4>());

// Which instruction set the build selected (models/cpu_kernels.py logs it).
extern "C" const char* SpecjaxIsa() { return SPECJAX_ISA; }

// Whether int8 products of more than 8 rows (a prompt's) run on AMX: built for a CPU with it,
// and the operating system lets this process use it.
extern "C" int SpecjaxAmx() {
#if defined(SPECJAX_AMX)
  return AmxPermitted();
#else
  return 0;
#endif
}
