// Matrix products over llama.cpp's block-quantized weights (Q8_0, Q4_0, Q4_1), on the CPU.
//
// A weight row is stored as in a GGUF file: blocks of 32 input channels, each a float16 scale
// (and, for Q4_1, a float16 minimum) followed by its values (Q8_0: 32 int8; Q4_0/Q4_1: 16 bytes,
// element j in byte j's low nibble, element j + 16 in its high nibble). Activations are
// quantized per block of 32 to int8 with a float scale, as llama.cpp's CPU dot products do (its
// Q8_0/Q8_1 activations): a block's dot product is then integer arithmetic, one float multiply.
//
//   Q8_0: w = d * q                      dot = d * xd * sum(q * xq)
//   Q4_0: w = d * (q - 8)                dot = d * xd * sum(q * xq) - 8 * d * xs
//   Q4_1: w = d * q + m                  dot = d * xd * sum(q * xq) + m * xs
//
// where xd is the activation block's scale and xs = xd * sum(xq). Built with g++ for the machine
// it runs on (-march=native; backends/torch/cpu/kernels.py): AVX2, with AVX512-VNNI's dpbusd where the
// CPU has it, AMX-INT8's tiles for 8 or more activation rows where Linux grants them, else plain
// C++. Every path computes each block's integer sum exactly and then the same float steps in the
// same order, so a row's result is the same bits whichever path, and whichever company, served it.
// The one exception is chosen by the caller, never by company: rows from `mm`'s `prompt_from` on
// (a long prompt's tokens) take AMX-BF16's tiles where the CPU has them (`bf16_product`).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <string>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int QK = 32;  // values per block
constexpr int Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;  // ggml's type ids

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      uint32_t m = mantissa;
      do {
        e++;
        m <<= 1;
      } while ((m & 0x400u) == 0);
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline int block_bytes(int kind) {
  switch (kind) {
    case Q8_0: return 2 + QK;
    case Q4_0: return 2 + QK / 2;
    case Q4_1: return 4 + QK / 2;
  }
  TORCH_CHECK(false, "unsupported block type ", kind);
}

// -- activations -----------------------------------------------------------------------------

// One row of x (in values) to int8 blocks: xq, the blocks' scales xd and xs = xd * sum(xq), and
// (where xi is given) the integer sums. Every path rounds to nearest even, as nearbyint does.
void quantize_row(const float* x, int64_t in, int8_t* xq, float* xd, float* xs, int32_t* xi = nullptr) {
  const int64_t nb = in / QK;
  for (int64_t b = 0; b < nb; b++) {
    const float* v = x + b * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i*)(xq + b * QK), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(xq + b * QK + 16), _mm512_cvtepi32_epi8(q1));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    float amax = 0.f;
    for (int j = 0; j < QK; j++) {
      const float a = std::fabs(v[j]);
      amax = a > amax ? a : amax;
    }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
      const int q = (int)std::nearbyint(v[j] * id);
      xq[b * QK + j] = (int8_t)q;
      sum += q;
    }
#endif
    xd[b] = d;
    xs[b] = d * (float)sum;
    if (xi) xi[b] = sum;
  }
}

// -- one weight row against R activation rows --------------------------------------------------

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum over pairs of u8 * s8, as 8 int32 lanes
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i unpack_q4(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128((const __m128i*)qs);
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(packed, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return _mm256_set_m128i(hi, lo);
}
#endif

template <int KIND, int R>
inline void dot_rows(const uint8_t* w, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t in,
                     float* out) {
  const int bb = KIND == Q8_0 ? 2 + QK : (KIND == Q4_0 ? 2 + QK / 2 : 4 + QK / 2);
  float extra[R];
  for (int r = 0; r < R; r++) extra[r] = 0.f;
#if defined(__AVX2__)
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
  // Two blocks a step in 512-bit registers (the tail block, if any, below in 256-bit ones).
  __m512 wide[R];
  for (int r = 0; r < R; r++) wide[r] = _mm512_setzero_ps();
  for (; b + 1 < nb; b += 2) {
    const uint8_t* b0 = w + b * bb;
    const uint8_t* b1 = b0 + bb;
    const float d0 = half_to_float(read_u16(b0)), d1 = half_to_float(read_u16(b1));
    if (KIND == Q8_0) {
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b0 + 2))),
                                           _mm256_loadu_si256((const __m256i*)(b1 + 2)), 1);
      const __mmask64 negative = _mm512_movepi8_mask(q);
      const __m512i aq = _mm512_abs_epi8(q);
      for (int r = 0; r < R; r++) {
        const __m512i x = _mm512_loadu_si512((const void*)(xq + r * in + b * QK));
        const __m512i sx = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aq, sx);
        const float* xr = xd + r * nb + b;
        const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(d0 * xr[0]), _mm256_set1_ps(d1 * xr[1]), 1);
        wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, wide[r]);
      }
    } else {
      const int off = KIND == Q4_1 ? 4 : 2;
      const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(unpack_q4(b0 + off)), unpack_q4(b1 + off), 1);
      const float m0 = KIND == Q4_1 ? half_to_float(read_u16(b0 + 2)) : -8.f * d0;
      const float m1 = KIND == Q4_1 ? half_to_float(read_u16(b1 + 2)) : -8.f * d1;
      for (int r = 0; r < R; r++) {
        const __m512i x = _mm512_loadu_si512((const void*)(xq + r * in + b * QK));
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
        const float* xr = xd + r * nb + b;
        const __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(d0 * xr[0]), _mm256_set1_ps(d1 * xr[1]), 1);
        wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, wide[r]);
        extra[r] += m0 * xs[r * nb + b] + m1 * xs[r * nb + b + 1];
      }
    }
  }
  for (int r = 0; r < R; r++) extra[r] += _mm512_reduce_add_ps(wide[r]);
#endif
  for (; b < nb; b++) {
    const uint8_t* block = w + b * bb;
    const float d = half_to_float(read_u16(block));
    if (KIND == Q8_0) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(block + 2));
      const __m256i aq = _mm256_sign_epi8(q, q);
      for (int r = 0; r < R; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + r * in + b * QK));
        const __m256i p = dot_u8s8(aq, _mm256_sign_epi8(x, q));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[r * nb + b]), acc[r]);
      }
    } else {
      const __m256i q = unpack_q4(block + (KIND == Q4_1 ? 4 : 2));
      const float m = KIND == Q4_1 ? half_to_float(read_u16(block + 2)) : -8.f * d;
      for (int r = 0; r < R; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq + r * in + b * QK));
        const __m256i p = dot_u8s8(q, x);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xd[r * nb + b]), acc[r]);
        extra[r] += m * xs[r * nb + b];
      }
    }
  }
  for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + extra[r];
#else
  float acc[R];
  for (int r = 0; r < R; r++) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* block = w + b * bb;
    const float d = half_to_float(read_u16(block));
    for (int r = 0; r < R; r++) {
      const int8_t* x = xq + r * in + b * QK;
      int sum = 0;
      if (KIND == Q8_0) {
        const int8_t* q = (const int8_t*)(block + 2);
        for (int j = 0; j < QK; j++) sum += q[j] * x[j];
      } else {
        const uint8_t* q = block + (KIND == Q4_1 ? 4 : 2);
        for (int j = 0; j < QK / 2; j++) sum += (q[j] & 0x0f) * x[j] + (q[j] >> 4) * x[j + QK / 2];
        const float m = KIND == Q4_1 ? half_to_float(read_u16(block + 2)) : -8.f * d;
        extra[r] += m * xs[r * nb + b];
      }
      acc[r] += d * xd[r * nb + b] * (float)sum;
    }
  }
  for (int r = 0; r < R; r++) out[r] = acc[r] + extra[r];
#endif
}

constexpr int ROW_TILE = 4;     // activation rows a weight row's blocks are unpacked for
constexpr int64_t X_TILE = 64;  // activation rows whose quantized blocks stay in cache over the weight

template <int KIND>
void product(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out_features, float* y) {
  const int64_t nb = in / QK, row_bytes = nb * block_bytes(KIND);
  std::vector<int8_t> xq(rows * in);
  std::vector<float> xd(rows * nb), xs(rows * nb);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) quantize_row(x + r * in, in, &xq[r * in], &xd[r * nb], &xs[r * nb]);
  });
  for (int64_t tile = 0; tile < rows; tile += X_TILE) {
    const int64_t tile_rows = std::min(X_TILE, rows - tile);
    // Each thread takes whole weight rows: a weight byte is read once per tile of activations.
    const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, out_features / (4 * at::get_num_threads())));
    at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
      float part[ROW_TILE];
      for (int64_t o = begin; o < end; o++) {
        const uint8_t* wo = w + o * row_bytes;
        int64_t r = tile;
        for (; r + ROW_TILE <= tile + tile_rows; r += ROW_TILE) {
          dot_rows<KIND, ROW_TILE>(wo, nb, &xq[r * in], &xd[r * nb], &xs[r * nb], in, part);
          for (int k = 0; k < ROW_TILE; k++) y[(r + k) * out_features + o] = part[k];
        }
        for (; r < tile + tile_rows; r++) {
          dot_rows<KIND, 1>(wo, nb, &xq[r * in], &xd[r * nb], &xs[r * nb], in, part);
          y[r * out_features + o] = part[0];
        }
      }
    });
  }
}

// -- sixteen rows interleaved -------------------------------------------------------------------
//
// The same blocks, sixteen output rows at a time (as llama.cpp's repacked types are): for each
// group of 16 rows and each block, one record whose 32-bit lane i holds 4 consecutive values of
// row i, so one dot-product instruction against 4 activation bytes broadcast does 64 products
// for 16 rows, and a block's 16 sums land one to a lane, ready for the 16 rows' scales.
//   Q8_0 record (544 bytes): for k = 0..7, 16 x 4 bytes (row i's values 4k..4k+3, each + 128
//                            as unsigned, the form VNNI's dpbusd takes) | 16 d
//   Q4_0/Q4_1 record (320 bytes): for k = 0..3, 16 x 4 bytes (row i's GGUF bytes 4k..4k+3: values
//                            4k.. in the low nibbles, 16 + 4k.. in the high) | 16 d | 16 m
// A block's sum is exact integer arithmetic: sum(q * xq) less the weights' offset times sum(xq)
// (Q8_0's 128, Q4_0's 8); then one multiply-add by d * xd (and, for Q4_1, m * xs) per block.

constexpr int GROUP = 16;
constexpr int values_bytes(int kind) { return kind == Q8_0 ? GROUP * QK : GROUP * (QK / 2); }  // then the scales
constexpr int record_bytes(int kind) { return values_bytes(kind) + (kind == Q8_0 ? 2 : 4) * GROUP; }
constexpr int weight_offset(int kind) { return kind == Q8_0 ? 128 : kind == Q4_0 ? 8 : 0; }  // taken out of the sums

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && defined(__F16C__)
// A block's 16 exact integer sums p (offset not yet taken out) into one activation row's 16
// outputs: the float steps every AVX-512 path takes, in this order, so their rows agree bit for bit.
template <int KIND>
inline __m512 add_block(__m512 acc, __m512i p, __m512 d16, __m512 m16, int32_t xi, float xd, float xs) {
  if (weight_offset(KIND)) p = _mm512_add_epi32(_mm512_set1_epi32(-weight_offset(KIND) * xi), p);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(d16, _mm512_set1_ps(xd)), acc);
  if (KIND == Q4_1) acc = _mm512_fmadd_ps(m16, _mm512_set1_ps(xs), acc);
  return acc;
}
#endif

// One group's 16 outputs for R activation rows: out [R][16].
template <int KIND, int R>
inline void dot_group(const uint8_t* rec, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
                      const int32_t* xi, int64_t in, float* out) {
  constexpr int RB = record_bytes(KIND), WB = values_bytes(KIND), OFF = weight_offset(KIND);
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && defined(__F16C__)
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = rec + b * RB;
    __m512i w[8];
    if (KIND == Q8_0) {
      for (int k = 0; k < 8; k++) w[k] = _mm512_loadu_si512((const void*)(record + 64 * k));
    } else {
      for (int k = 0; k < 4; k++) {
        const __m512i q = _mm512_loadu_si512((const void*)(record + 64 * k));
        w[k] = _mm512_and_si512(q, low);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
      }
    }
    const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(record + WB)));
    __m512 m16 = _mm512_setzero_ps();
    if (KIND == Q4_1) m16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(record + WB + 2 * GROUP)));
    for (int r = 0; r < R; r++) {
      const int8_t* x = xq + r * in + b * QK;
      __m512i p = _mm512_setzero_si512();
      for (int k = 0; k < 8; k++) {
        int32_t four;
        std::memcpy(&four, x + 4 * k, 4);
        p = _mm512_dpbusd_epi32(p, w[k], _mm512_set1_epi32(four));
      }
      acc[r] = add_block<KIND>(acc[r], p, d16, m16, xi[r * nb + b], xd[r * nb + b], xs[r * nb + b]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * GROUP, acc[r]);
#elif defined(__AVX2__) && defined(__F16C__)
  // 256-bit: rows 0-7 and rows 8-15 of each 64-byte piece in turn.
  const __m256i low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
  for (int half = 0; half < 2; half++) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* record = rec + b * RB + 32 * half;
      __m256i w[8];
      if (KIND == Q8_0) {  // back to signed: |w| times x's sign keeps maddubs' pairs from saturating
        for (int k = 0; k < 8; k++) w[k] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(record + 64 * k)), flip);
      } else {
        for (int k = 0; k < 4; k++) {
          const __m256i q = _mm256_loadu_si256((const __m256i*)(record + 64 * k));
          w[k] = _mm256_and_si256(q, low);
          w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        }
      }
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(record - 32 * half + WB + 16 * half)));
      __m256 m8 = _mm256_setzero_ps();
      if (KIND == Q4_1) m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(record - 32 * half + WB + 2 * GROUP + 16 * half)));
      for (int r = 0; r < R; r++) {
        const int8_t* x = xq + r * in + b * QK;
        __m256i p = KIND == Q4_0 ? _mm256_set1_epi32(-OFF * xi[r * nb + b]) : _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
          int32_t four;
          std::memcpy(&four, x + 4 * k, 4);
          const __m256i xb = _mm256_set1_epi32(four);
          if (KIND == Q8_0) {
            p = _mm256_add_epi32(p, dot_u8s8(_mm256_sign_epi8(w[k], w[k]), _mm256_sign_epi8(xb, w[k])));
          } else {
            p = _mm256_add_epi32(p, dot_u8s8(w[k], xb));
          }
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d8, _mm256_set1_ps(xd[r * nb + b])), acc[r]);
        if (KIND == Q4_1) acc[r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xs[r * nb + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * GROUP + 8 * half, acc[r]);
  }
#else
  float acc[R][GROUP];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < GROUP; i++) acc[r][i] = 0.f;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = rec + b * RB;
    for (int i = 0; i < GROUP; i++) {
      const float d = half_to_float(read_u16(record + WB + 2 * i));
      const float m = KIND == Q4_1 ? half_to_float(read_u16(record + WB + 2 * GROUP + 2 * i)) : 0.f;
      for (int r = 0; r < R; r++) {
        const int8_t* x = xq + r * in + b * QK;
        int32_t sum = -OFF * xi[r * nb + b];
        for (int k = 0; k < 8; k++)
          for (int t = 0; t < 4; t++) {
            int q;
            if (KIND == Q8_0) {
              q = record[64 * k + 4 * i + t];
            } else {
              const uint8_t byte = record[64 * (k % 4) + 4 * i + t];
              q = k < 4 ? byte & 0x0f : byte >> 4;
            }
            sum += q * x[4 * k + t];
          }
        acc[r][i] = std::fma((float)sum, d * xd[r * nb + b], acc[r][i]);
        if (KIND == Q4_1) acc[r][i] = std::fma(m, xs[r * nb + b], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < GROUP; i++) out[r * GROUP + i] = acc[r][i];
#endif
}

// -- AMX: sixteen activation rows at a time -------------------------------------------------------
//
// Where the CPU has AMX-INT8 and Linux grants its tile state, a group's block for 16 activation
// rows is one tile product: tile A the rows' 32 int8 values (signed), tile B the record's values as
// it stands (Q8_0's are unsigned, + 128; Q4's nibbles are unpacked to bytes first), C[m][n] the
// exact integer sum over the block. The sums then take the same float steps, in the same order,
// as dot_group's (the offset, d * xd, Q4_1's m * xs), so a row comes out bit for bit as it does
// alone through dot_group: which path served a row never shows.

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__F16C__) && defined(__linux__)
#define PHI2_AMX 1

bool amx_granted() {
  static const bool granted = [] {
    const char* off = std::getenv("PHI2_CPU_AMX");  // "0": the VNNI path only (the same results)
    if (off && std::string(off) == "0") return false;
    constexpr long GET_PERM = 0x1022, REQ_PERM = 0x1023, XTILEDATA = 18;
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, GET_PERM, &features) == 0 && (features & (1ul << XTILEDATA))) return true;
    if (syscall(SYS_arch_prctl, REQ_PERM, XTILEDATA) != 0) return false;
    return syscall(SYS_arch_prctl, GET_PERM, &features) == 0 && (features & (1ul << XTILEDATA));
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 x 16 int32) for four blocks in flight; 4-5: A (16 rows x 32 bytes); 6-7: B (8 rows x 64 bytes).
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = t >= 6 ? QK / 4 : 16;
    config.colsb[t] = t == 4 || t == 5 ? QK : 64;
  }
  _tile_loadconfig(&config);
}

// out [16][16]: 16 activation rows (xq padded to 16 rows) against one group.
template <int KIND>
inline void tile_group(const uint8_t* rec, int64_t nb, const int8_t* xq, const float* xd, const float* xs,
                       const int32_t* xi, int64_t in, float* out) {
  constexpr int RB = record_bytes(KIND), WB = values_bytes(KIND);
  alignas(64) int32_t sums[4][16 * 16];
  alignas(64) uint8_t values[4][8 * 64];
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int m = 0; m < 16; m++) _mm512_storeu_ps(out + m * GROUP, _mm512_setzero_ps());
  auto weights = [&](int64_t b, int slot) -> const void* {
    const uint8_t* record = rec + b * RB;
    if (KIND == Q8_0) return record;
    for (int k = 0; k < 4; k++) {
      const __m512i q = _mm512_loadu_si512((const void*)(record + 64 * k));
      _mm512_store_si512((void*)(values[slot] + 64 * k), _mm512_and_si512(q, low));
      _mm512_store_si512((void*)(values[slot] + 64 * (k + 4)), _mm512_and_si512(_mm512_srli_epi16(q, 4), low));
    }
    return values[slot];
  };
  for (int64_t b = 0; b < nb; b += 4) {
    const int n = (int)std::min<int64_t>(4, nb - b);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, xq + b * QK, in);
    _tile_loadd(6, weights(b, 0), 64);
    _tile_dpbsud(0, 4, 6);
    if (n > 1) {
      _tile_loadd(5, xq + (b + 1) * QK, in);
      _tile_loadd(7, weights(b + 1, 1), 64);
      _tile_dpbsud(1, 5, 7);
    }
    if (n > 2) {
      _tile_loadd(4, xq + (b + 2) * QK, in);
      _tile_loadd(6, weights(b + 2, 2), 64);
      _tile_dpbsud(2, 4, 6);
    }
    if (n > 3) {
      _tile_loadd(5, xq + (b + 3) * QK, in);
      _tile_loadd(7, weights(b + 3, 3), 64);
      _tile_dpbsud(3, 5, 7);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    __m512 d16[4], m16[4];
    for (int j = 0; j < n; j++) {
      const uint8_t* record = rec + (b + j) * RB;
      d16[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(record + WB)));
      m16[j] = KIND == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(record + WB + 2 * GROUP)))
                            : _mm512_setzero_ps();
    }
    for (int m = 0; m < 16; m++) {
      __m512 acc = _mm512_loadu_ps(out + m * GROUP);
      for (int j = 0; j < n; j++) {  // the blocks in order, as dot_group takes them
        const int64_t at = m * nb + b + j;
        acc = add_block<KIND>(acc, _mm512_load_si512((const void*)(sums[j] + 16 * m)), d16[j], m16[j], xi[at], xd[at], xs[at]);
      }
      _mm512_storeu_ps(out + m * GROUP, acc);
    }
  }
}
// -- AMX-BF16: prompt tokens -------------------------------------------------------------------
//
// A prompt piece's tokens are many rows at once, where the int8 tiles above are bound by each
// block's float steps (16 x 16 sums converted, scaled and added per 32 inputs), not by the tiles.
// For those rows, where the CPU has AMX-BF16, a pair of groups' records is dequantized once per
// call into bfloat16 tiles (d * q, or d * q + m, rounded to bfloat16), and the activations are
// rounded to bfloat16: the products are then whole tile products over every input, summed in
// float32, with no step per block, as the bfloat16 default's own GEMMs are (oneDNN's AMX). Decode
// rows and a draft's keep the exact int8 path above; a prompt token's row still depends on its
// own inputs only, whatever the piece's size or company (each output is one thread's tile sum,
// over the inputs in order).
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PHI2_AMX_BF16 1

// Tiles 0-3: C (16 x 16 float32) for two row tiles by two groups; 4-5: A (16 rows x 32
// bfloat16); 6-7: B (16 input pairs x 16 outputs x 2 bfloat16), one group's block each.
inline void configure_bf16_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; t++) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// A group's blocks in B's layout: panel [nb][16 input pairs][16 outputs][2] bfloat16 (1 KB a
// block). A record's 64-byte piece k holds values 4k..4k+3 of each of its 16 rows: input pairs
// 2k and 2k + 1.
template <int KIND>
inline void dequantize_group_bf16(const uint8_t* rec, int64_t nb, uint16_t* panel) {
  constexpr int RB = record_bytes(KIND), WB = values_bytes(KIND);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512i spread[4];  // lane l of a 16-value quarter of a piece: row 4c + l / 4
  for (int c = 0; c < 4; c++)
    spread[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 2,
                                  4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3);
  const __m512i low = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = rec + b * RB;
    const __m512 d16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(record + WB)));
    const __m512 m16 = KIND == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(record + WB + 2 * GROUP)))
                       : KIND == Q4_0 ? _mm512_mul_ps(d16, _mm512_set1_ps(-8.f))
                                      : _mm512_setzero_ps();
    __m512 d[4], m[4];
    for (int c = 0; c < 4; c++) {
      d[c] = _mm512_permutexvar_ps(spread[c], d16);
      m[c] = _mm512_permutexvar_ps(spread[c], m16);
    }
    uint16_t* out = panel + b * 512;
    auto emit = [&](int k, __m512i values) {  // values: bytes as signed (Q8_0) or unsigned nibbles
      __m512 f[4];
      for (int c = 0; c < 4; c++) {
        const __m128i quarter = _mm512_extracti32x4_epi32(values, c);
        const __m512i ints = KIND == Q8_0 ? _mm512_cvtepi8_epi32(quarter) : _mm512_cvtepu8_epi32(quarter);
        f[c] = KIND == Q8_0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(ints), d[c])
                            : _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), d[c], m[c]);
      }
      // 32-bit unit 2i + p of `lo` (rows 0-7) and `hi` (rows 8-15): row i's values 4k + 2p, 4k + 2p + 1
      const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]), hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
      _mm512_store_si512((void*)(out + 64 * k), _mm512_permutex2var_epi32(lo, even, hi));
      _mm512_store_si512((void*)(out + 64 * k + 32), _mm512_permutex2var_epi32(lo, odd, hi));
    };
    if (KIND == Q8_0) {
      for (int k = 0; k < 8; k++) emit(k, _mm512_xor_si512(_mm512_loadu_si512((const void*)(record + 64 * k)), flip));
    } else {
      for (int k = 0; k < 4; k++) {
        const __m512i q = _mm512_loadu_si512((const void*)(record + 64 * k));
        emit(k, _mm512_and_si512(q, low));
        emit(k + 4, _mm512_and_si512(_mm512_srli_epi16(q, 4), low));
      }
    }
  }
}

// y [rows][out] for x [rows][in] against sixteen-row records, in bfloat16 tiles (see above).
template <int KIND>
void bf16_product(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out_features, float* y) {
  const int64_t nb = in / QK, groups = out_features / GROUP, group_bytes = nb * record_bytes(KIND);
  const int64_t padded = (rows + 31) / 32 * 32;  // two row tiles at a time; the padding is zeros
  std::vector<uint16_t> a(padded * in, 0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++)
      for (int64_t i = 0; i < in; i += 32) {
        const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * in + i + 16), _mm512_loadu_ps(x + r * in + i));
        _mm512_storeu_si512((void*)(&a[r * in + i]), (__m512i)h);
      }
  });
  const int64_t stride = in * 2, pairs = (groups + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    configure_bf16_tiles();
    std::vector<uint16_t> buffer(2 * nb * 512 + 32);  // two groups' panels, 64-byte aligned
    uint16_t* panel = buffer.data() + (32 - ((uintptr_t)buffer.data() % 64) / 2) % 32;
    alignas(64) float c[4][16 * 16];
    for (int64_t p = begin; p < end; p++) {
      const int64_t g = 2 * p;
      const bool two = g + 1 < groups;
      const uint16_t* b0 = panel;
      const uint16_t* b1 = panel + nb * 512;
      dequantize_group_bf16<KIND>(w + g * group_bytes, nb, panel);
      if (two) dequantize_group_bf16<KIND>(w + (g + 1) * group_bytes, nb, panel + nb * 512);
      for (int64_t r = 0; r < padded; r += 32) {
        const uint16_t* a0 = &a[r * in];
        const uint16_t* a1 = &a[(r + 16) * in];
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (two) {
          for (int64_t b = 0; b < nb; b++) {
            _tile_loadd(4, a0 + b * QK, stride);
            _tile_loadd(5, a1 + b * QK, stride);
            _tile_loadd(6, b0 + b * 512, 64);
            _tile_loadd(7, b1 + b * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        } else {
          for (int64_t b = 0; b < nb; b++) {
            _tile_loadd(4, a0 + b * QK, stride);
            _tile_loadd(5, a1 + b * QK, stride);
            _tile_loadd(6, b0 + b * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        for (int half = 0; half < 2; half++)
          for (int64_t k = 0; k < 16 && r + 16 * half + k < rows; k++) {
            float* row = y + (r + 16 * half + k) * out_features + GROUP * g;
            std::memcpy(row, c[2 * half] + 16 * k, GROUP * sizeof(float));
            if (two) std::memcpy(row + GROUP, c[2 * half + 1] + 16 * k, GROUP * sizeof(float));
          }
      }
    }
    _tile_release();
  });
}
#endif
#else
bool amx_granted() { return false; }
#endif

constexpr int GROUP_ROWS = 4;  // activation rows a group's block values are loaded for

constexpr int64_t TILE_MIN_ROWS = 8;  // from this many activation rows, AMX's tiles where granted

template <int KIND>
void packed_product(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out_features, float* y) {
  const int64_t nb = in / QK, groups = out_features / GROUP, group_bytes = nb * record_bytes(KIND);
#ifdef PHI2_AMX
  const bool tiles = rows >= TILE_MIN_ROWS && amx_granted();
#else
  const bool tiles = false;
#endif
  const int64_t padded = tiles ? (rows + 15) / 16 * 16 : rows;  // tile loads read 16 rows
  std::vector<int8_t> xq(padded * in, 0);
  std::vector<float> xd(padded * nb, 0.f), xs(padded * nb, 0.f);
  std::vector<int32_t> xi(padded * nb, 0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      quantize_row(x + r * in, in, &xq[r * in], &xd[r * nb], &xs[r * nb], &xi[r * nb]);
    }
  });
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(8, groups / (4 * at::get_num_threads())));
#ifdef PHI2_AMX
  if (tiles) {
    // a group's blocks stay in L1 over up to 1 MB of activations (from L2)
    const int64_t span = std::max<int64_t>(16, (1 << 20) / in / 16 * 16);
    for (int64_t tile = 0; tile < padded; tile += span) {
      const int64_t tile_rows = std::min(span, padded - tile);
      at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
        configure_tiles();
        alignas(64) float part[16 * GROUP];
        for (int64_t g = begin; g < end; g++) {
          for (int64_t r = tile; r < tile + tile_rows; r += 16) {
            tile_group<KIND>(w + g * group_bytes, nb, &xq[r * in], &xd[r * nb], &xs[r * nb], &xi[r * nb], in, part);
            for (int64_t k = 0; k < 16 && r + k < rows; k++)
              std::memcpy(y + (r + k) * out_features + GROUP * g, part + GROUP * k, GROUP * sizeof(float));
          }
        }
        _tile_release();
      });
    }
    return;
  }
#endif
  // a group's blocks are read once per span of rows: as many rows as keep their activations
  // within 1 MB (in L2), so a big matrix streams from memory a few times a prompt piece, not once
  // every 64 rows
  const int64_t span = std::max<int64_t>(X_TILE, (1 << 20) / in / GROUP_ROWS * GROUP_ROWS);
  for (int64_t tile = 0; tile < rows; tile += span) {
    const int64_t tile_rows = std::min(span, rows - tile);
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      float part[GROUP_ROWS * GROUP];
      for (int64_t g = begin; g < end; g++) {
        const uint8_t* wg = w + g * group_bytes;
        int64_t r = tile;
        for (; r + GROUP_ROWS <= tile + tile_rows; r += GROUP_ROWS) {
          dot_group<KIND, GROUP_ROWS>(wg, nb, &xq[r * in], &xd[r * nb], &xs[r * nb], &xi[r * nb], in, part);
          for (int k = 0; k < GROUP_ROWS; k++)
            std::memcpy(y + (r + k) * out_features + GROUP * g, part + GROUP * k, GROUP * sizeof(float));
        }
        for (; r < tile + tile_rows; r++) {
          dot_group<KIND, 1>(wg, nb, &xq[r * in], &xd[r * nb], &xs[r * nb], &xi[r * nb], in, part);
          std::memcpy(y + r * out_features + GROUP * g, part, GROUP * sizeof(float));
        }
      }
    });
  }
}

// raw GGUF rows <-> sixteen-row records (out_features a multiple of 16)
void pack_group(const uint8_t* raw, int64_t row_bytes, int kind, int64_t nb, uint8_t* out) {
  const int bb = block_bytes(kind), rb = record_bytes(kind);
  const int wb = values_bytes(kind), lead = kind == Q4_1 ? 4 : 2;
  for (int64_t b = 0; b < nb; b++) {
    uint8_t* record = out + b * rb;
    for (int i = 0; i < GROUP; i++) {
      const uint8_t* block = raw + i * row_bytes + b * bb;
      const int pieces = kind == Q8_0 ? 8 : 4;
      for (int k = 0; k < pieces; k++)
        for (int t = 0; t < 4; t++)
          record[64 * k + 4 * i + t] = kind == Q8_0 ? (uint8_t)(block[lead + 4 * k + t] ^ 0x80) : block[lead + 4 * k + t];
      std::memcpy(record + wb + 2 * i, block, 2);
      if (kind != Q8_0) {
        if (kind == Q4_1) {
          std::memcpy(record + wb + 2 * GROUP + 2 * i, block + 2, 2);
        } else {  // Q4_0: no minimum stored (its offset of 8 is taken in the integer sums)
          std::memset(record + wb + 2 * GROUP + 2 * i, 0, 2);
        }
      }
    }
  }
}

void unpack_group(const uint8_t* packed, int kind, int64_t nb, int64_t row_bytes, uint8_t* raw) {
  const int bb = block_bytes(kind), rb = record_bytes(kind);
  const int wb = values_bytes(kind), lead = kind == Q4_1 ? 4 : 2;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = packed + b * rb;
    for (int i = 0; i < GROUP; i++) {
      uint8_t* block = raw + i * row_bytes + b * bb;
      const int pieces = kind == Q8_0 ? 8 : 4;
      for (int k = 0; k < pieces; k++)
        for (int t = 0; t < 4; t++)
          block[lead + 4 * k + t] = kind == Q8_0 ? (uint8_t)(record[64 * k + 4 * i + t] ^ 0x80) : record[64 * k + 4 * i + t];
      std::memcpy(block, record + wb + 2 * i, 2);
      if (kind == Q4_1) std::memcpy(block + 2, record + wb + 2 * GROUP + 2 * i, 2);
    }
  }
}

void dequantize_row(const uint8_t* w, int kind, int64_t in, float* out) {
  const int64_t nb = in / QK;
  const int bb = block_bytes(kind);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* block = w + b * bb;
    const float d = half_to_float(read_u16(block));
    float* o = out + b * QK;
    if (kind == Q8_0) {
      const int8_t* q = (const int8_t*)(block + 2);
      for (int j = 0; j < QK; j++) o[j] = d * (float)q[j];
    } else {
      const uint8_t* q = block + (kind == Q4_1 ? 4 : 2);
      const float m = kind == Q4_1 ? half_to_float(read_u16(block + 2)) : -8.f * d;
      for (int j = 0; j < QK / 2; j++) {
        o[j] = d * (float)(q[j] & 0x0f) + m;
        o[j + QK / 2] = d * (float)(q[j] >> 4) + m;
      }
    }
  }
}

}  // namespace

#include "kquants.h"

// x [rows, in] float32 times the transpose of w (out_features rows of `kind` blocks): [rows, out].
constexpr int64_t PACKED = 100;  // a kind + PACKED: the sixteen-row records

// A row's bytes as stored, and its values a block (K-quants: 256), for every type served.
inline int64_t row_bytes_of(int64_t kind, int64_t in_features) {
  if (is_kquant(kind)) {
    TORCH_CHECK(in_features % kq_values(kind) == 0, "rows of ", in_features, " values are not whole blocks");
    return in_features / kq_values(kind) * kq_file_bytes(kind);
  }
  return in_features / QK * block_bytes((int)kind);
}
inline int64_t group_bytes_of(int64_t kind, int64_t in_features) {
  return is_kquant(kind) ? in_features / kq_values(kind) * kq_record_bytes(kind) : in_features / QK * record_bytes((int)kind);
}

torch::Tensor pack(torch::Tensor raw, int64_t kind, int64_t in_features) {
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous() && raw.size(0) % GROUP == 0);
  const int64_t nb = in_features / QK, groups = raw.size(0) / GROUP, row_bytes = raw.size(1);
  TORCH_CHECK(row_bytes == row_bytes_of(kind, in_features), "raw's row size");
  auto out = torch::empty({groups, group_bytes_of(kind, in_features)}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const bool k = is_kquant(kind);
  const auto kpack = k ? kfunctions(kind).pack : nullptr;
  const int64_t nsb = k ? in_features / kq_values(kind) : 0;
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) {
      if (k) kpack(rp + GROUP * g * row_bytes, row_bytes, nsb, op + g * out.size(1));
      else pack_group(rp + GROUP * g * row_bytes, row_bytes, (int)kind, nb, op + g * out.size(1));
    }
  });
  return out;
}

torch::Tensor unpack(torch::Tensor packed, int64_t kind, int64_t in_features) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous());
  const int64_t nb = in_features / QK, groups = packed.size(0), row_bytes = row_bytes_of(kind, in_features);
  TORCH_CHECK(packed.size(1) == group_bytes_of(kind, in_features), "packed's record size");
  auto raw = torch::empty({GROUP * groups, row_bytes}, packed.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  uint8_t* rp = raw.data_ptr<uint8_t>();
  const bool k = is_kquant(kind);
  const auto kunpack = k ? kfunctions(kind).unpack : nullptr;
  const int64_t nsb = k ? in_features / kq_values(kind) : 0;
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) {
      if (k) kunpack(pp + g * packed.size(1), nsb, row_bytes, rp + GROUP * g * row_bytes);
      else unpack_group(pp + g * packed.size(1), (int)kind, nb, row_bytes, rp + GROUP * g * row_bytes);
    }
  });
  return raw;
}

// Where the CPU has AMX-BF16 tiles (and Linux grants them), the rows from `prompt_from` on (a
// prompt piece's tokens) take them; the rows before it, the exact int8 products.
bool prompt_tiles() {
#ifdef PHI2_AMX_BF16
  return amx_granted();
#else
  return false;
#endif
}

torch::Tensor kmm(torch::Tensor x, torch::Tensor w, int64_t kind, bool packed, int64_t in_features);

torch::Tensor mm(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t in_features, int64_t prompt_from) {
  const bool packed = kind >= PACKED;  // sixteen-row records [out / 16, records], else rows [out, blocks]
  if (packed) kind -= PACKED;
  if (is_kquant(kind)) return kmm(x, w, kind, packed, in_features);
  TORCH_CHECK(kind == Q8_0 || kind == Q4_0 || kind == Q4_1, "unsupported block type ", kind);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == in_features, "x: float32 [rows, in]");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 blocks or records");
  const int64_t unit = packed ? record_bytes(kind) : block_bytes(kind);
  TORCH_CHECK(in_features % QK == 0 && w.size(1) == in_features / QK * unit, "w's row size");
  x = x.contiguous();
  const int64_t rows = x.size(0), out_features = (packed ? GROUP : 1) * w.size(0);
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  using Product = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*);
  const Product product_of = kind == Q8_0 ? (packed ? packed_product<Q8_0> : product<Q8_0>)
                             : kind == Q4_0 ? (packed ? packed_product<Q4_0> : product<Q4_0>)
                                            : (packed ? packed_product<Q4_1> : product<Q4_1>);
  const int64_t exact = packed && prompt_tiles() ? std::clamp<int64_t>(prompt_from, 0, rows) : rows;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (exact) product_of(xp, exact, in_features, w.data_ptr<uint8_t>(), out_features, yp);
#ifdef PHI2_AMX_BF16
  if (exact < rows) {
    const Product tiles_of = kind == Q8_0 ? bf16_product<Q8_0> : kind == Q4_0 ? bf16_product<Q4_0> : bf16_product<Q4_1>;
    tiles_of(xp + exact * in_features, rows - exact, in_features, w.data_ptr<uint8_t>(), out_features,
             yp + exact * out_features);
  }
#endif
  return y;
}

// The K-quants' and Q5's products (kquants.h): rows as stored are packed for the call (a
// matrix whose rows are not a multiple of 16 stays as stored; the last group is padded with
// zero rows, which are zero weights in every type).
torch::Tensor kmm(torch::Tensor x, torch::Tensor w, int64_t kind, bool packed, int64_t in_features) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == in_features, "x: float32 [rows, in]");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 blocks or records");
  TORCH_CHECK(w.size(1) == (packed ? group_bytes_of(kind, in_features) : row_bytes_of(kind, in_features)), "w's row size");
  x = x.contiguous();
  int64_t out_features = (packed ? GROUP : 1) * w.size(0);
  torch::Tensor records = w;
  if (!packed) {
    const int64_t padded = (out_features + GROUP - 1) / GROUP * GROUP;
    torch::Tensor rows = padded == out_features ? w : torch::cat({w, torch::zeros({padded - out_features, w.size(1)}, w.options())});
    records = pack(rows, kind, in_features);
  }
  const int64_t rows = x.size(0), computed = GROUP * records.size(0);
  auto y = torch::empty({rows, computed}, x.options());
  if (rows) kfunctions(kind).product(x.data_ptr<float>(), rows, in_features, records.data_ptr<uint8_t>(), computed, y.data_ptr<float>());
  return computed == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

// The weight's rows in float32 [out, in].
torch::Tensor dequantize(torch::Tensor w, int64_t kind, int64_t in_features) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 blocks [out, bytes]");
  TORCH_CHECK(w.size(1) == row_bytes_of(kind, in_features), "w's row size");
  const int64_t out_features = w.size(0), row_bytes = w.size(1);
  auto y = torch::empty({out_features, in_features}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto kdeq = is_kquant(kind) ? kfunctions(kind).dequantize : nullptr;
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; o++) {
      if (kdeq) kdeq(wp + o * row_bytes, in_features, yp + o * in_features);
      else dequantize_row(wp + o * row_bytes, (int)kind, in_features, yp + o * in_features);
    }
  });
  return y;
}

// Rows `ids` of w (as stored, or sixteen-row records: kind + PACKED) in float32 [n, in]: a
// quantized token embedding's lookup, with no float copy of the vocabulary.
torch::Tensor embed(torch::Tensor w, int64_t kind, int64_t in_features, torch::Tensor ids) {
  const bool packed = kind >= PACKED;
  if (packed) kind -= PACKED;
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 blocks or records");
  ids = ids.to(torch::kLong).contiguous().view(-1);
  const int64_t n = ids.size(0), row_bytes = row_bytes_of(kind, in_features);
  const int64_t vocab = packed ? GROUP * w.size(0) : w.size(0);
  auto y = torch::empty({n, in_features}, torch::kFloat32);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; r++) TORCH_CHECK(ip[r] >= 0 && ip[r] < vocab, "token id ", ip[r], " out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto kdeq = is_kquant(kind) ? kfunctions(kind).dequantize : nullptr;
  const auto kunpack = is_kquant(kind) ? kfunctions(kind).unpack : nullptr;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> group(packed ? GROUP * row_bytes : 0);
    for (int64_t r = begin; r < end; r++) {
      const int64_t id = ip[r];
      const uint8_t* row = wp + id * row_bytes;
      if (packed) {  // the id's group back to rows as stored
        const uint8_t* rec = wp + id / GROUP * w.size(1);
        if (kunpack) kunpack(rec, in_features / kq_values(kind), row_bytes, group.data());
        else unpack_group(rec, (int)kind, in_features / QK, row_bytes, group.data());
        row = group.data() + id % GROUP * row_bytes;
      }
      if (kdeq) kdeq(row, in_features, yp + r * in_features);
      else dequantize_row(row, (int)kind, in_features, yp + r * in_features);
    }
  });
  return y;
}

#include "step.h"

// Which SIMD path this build took, for /model/info and the logs.
std::string simd() {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return amx_granted() ? "avx2+avx512vnni+amx" : "avx2+avx512vnni";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "avx2+avxvnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm", &mm, "x @ w.T for block-quantized w (rows from prompt_from on: a prompt's, in AMX-BF16 tiles where granted)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("kind"), pybind11::arg("in_features"),
        pybind11::arg("prompt_from") = INT64_MAX);
  m.def("prompt_tiles", &prompt_tiles, "whether prompt rows take AMX-BF16 tiles here");
  m.def("pack", &pack, "raw GGUF rows to sixteen-row records");
  m.def("unpack", &unpack, "sixteen-row records to raw GGUF rows");
  m.def("dequantize", &dequantize, "block-quantized rows to float32");
  m.def("embed", &embed, "rows of a block-quantized matrix (as stored or packed) in float32");
  m.def("simd", &simd, "the SIMD path compiled");
  pybind11::class_<Step>(m, "Step", pybind11::module_local())  // builds for other targets load beside it (tests)
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, bool, bool, int64_t>())
      .def("add_block", &Step::add_block)
      .def("set_parts", &Step::set_parts)
      .def("forward", &Step::forward);
}
