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
// where xd is the activation block's scale and xs = xd * sum(xq). Built by torch's cpp_extension
// for the machine it runs on (-march=native): AVX2, with AVX512-VNNI's dpbusd where the CPU has
// it, else plain C++ (backends/ggml_blocks.py loads it).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
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

// One row of x (in values) to int8 blocks: xq, the blocks' scales xd and xs = xd * sum(xq).
void quantize_row(const float* x, int64_t in, int8_t* xq, float* xd, float* xs) {
  const int64_t nb = in / QK;
  for (int64_t b = 0; b < nb; b++) {
    const float* v = x + b * QK;
    float amax = 0.f;
    for (int j = 0; j < QK; j++) amax = std::fmax(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
      const int q = (int)std::nearbyint(v[j] * id);
      xq[b * QK + j] = (int8_t)q;
      sum += q;
    }
    xd[b] = d;
    xs[b] = d * (float)sum;
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

// -- four rows interleaved ----------------------------------------------------------------------
//
// The same blocks, four output rows at a time (as llama.cpp's repacked types are): for each group
// of 4 rows and each block, one record of the 4 rows' values side by side, then their float16
// scales (and, for Q4, their minimums: Q4_0's is -8 d). One 512-bit register holds 4 rows' 16
// bytes, so a block's products for 4 rows take one dot-product instruction per 16 bytes, and
// its 4 scales are one vector: a third of the instructions of a row at a time.
//   Q4_0/Q4_1 record (80 bytes): 4 x 16 packed bytes | 4 d | 4 m
//   Q8_0 record (136 bytes): 4 x bytes 0-15 | 4 x bytes 16-31 | 4 d

inline int record_bytes(int kind) { return kind == Q8_0 ? 4 * QK + 8 : 4 * (QK / 2) + 16; }

template <int KIND, int R>
inline void dot_groups(const uint8_t* rec, int64_t nb, const int8_t* xq, const float* xd, const float* xs, int64_t in,
                       float* out /* [R][4] */) {
  const int rb = KIND == Q8_0 ? 4 * QK + 8 : 4 * (QK / 2) + 16;
  float extra[R][4];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) extra[r][i] = 0.f;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && defined(__F16C__)
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  __m128 more[R];
  for (int r = 0; r < R; r++) {
    acc[r] = _mm512_setzero_ps();
    more[r] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = rec + b * rb;
    __m512i a, c;
    __mmask64 na = 0, nc = 0;
    __m128 d4, m4 = _mm_setzero_ps();
    if (KIND == Q8_0) {
      const __m512i qa = _mm512_loadu_si512((const void*)record), qc = _mm512_loadu_si512((const void*)(record + 64));
      na = _mm512_movepi8_mask(qa);
      nc = _mm512_movepi8_mask(qc);
      a = _mm512_abs_epi8(qa);
      c = _mm512_abs_epi8(qc);
      d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(record + 128)));
    } else {
      const __m512i q = _mm512_loadu_si512((const void*)record);
      a = _mm512_and_si512(q, low);
      c = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
      const __m128i h = _mm_loadu_si128((const __m128i*)(record + 64));
      d4 = _mm_cvtph_ps(h);
      m4 = KIND == Q4_1 ? _mm_cvtph_ps(_mm_srli_si128(h, 8)) : _mm_mul_ps(d4, _mm_set1_ps(-8.f));
    }
    for (int r = 0; r < R; r++) {
      const int8_t* x = xq + r * in + b * QK;
      __m512i xa = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)x));
      __m512i xc = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(x + 16)));
      if (KIND == Q8_0) {
        xa = _mm512_mask_sub_epi8(xa, na, _mm512_setzero_si512(), xa);
        xc = _mm512_mask_sub_epi8(xc, nc, _mm512_setzero_si512(), xc);
      }
      const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, xa), c, xc);
      const __m128 s4 = _mm_mul_ps(d4, _mm_set1_ps(xd[r * nb + b]));
      const __m512 s16 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s16, acc[r]);
      if (KIND != Q8_0) more[r] = _mm_fmadd_ps(m4, _mm_set1_ps(xs[r * nb + b]), more[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    alignas(64) float lanes[16];
    alignas(16) float m[4];
    _mm512_store_ps(lanes, acc[r]);
    _mm_store_ps(m, more[r]);
    for (int i = 0; i < 4; i++)
      out[r * 4 + i] = (lanes[4 * i] + lanes[4 * i + 1]) + (lanes[4 * i + 2] + lanes[4 * i + 3]) + m[i];
  }
  (void)extra;
#elif defined(__AVX2__) && defined(__F16C__)
  // 256-bit: rows 0-1 in one register, rows 2-3 in another.
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i spread01 = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), spread23 = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
  __m256 acc0[R], acc1[R];
  __m128 more[R];
  for (int r = 0; r < R; r++) {
    acc0[r] = acc1[r] = _mm256_setzero_ps();
    more[r] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = rec + b * rb;
    __m256i qa0, qa1, qc0, qc1;  // rows 0-1 / 2-3, values 0-15 / 16-31
    __m128 d4, m4 = _mm_setzero_ps();
    if (KIND == Q8_0) {
      qa0 = _mm256_loadu_si256((const __m256i*)record);
      qa1 = _mm256_loadu_si256((const __m256i*)(record + 32));
      qc0 = _mm256_loadu_si256((const __m256i*)(record + 64));
      qc1 = _mm256_loadu_si256((const __m256i*)(record + 96));
      d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(record + 128)));
    } else {
      const __m256i q0 = _mm256_loadu_si256((const __m256i*)record), q1 = _mm256_loadu_si256((const __m256i*)(record + 32));
      qa0 = _mm256_and_si256(q0, low);
      qa1 = _mm256_and_si256(q1, low);
      qc0 = _mm256_and_si256(_mm256_srli_epi16(q0, 4), low);
      qc1 = _mm256_and_si256(_mm256_srli_epi16(q1, 4), low);
      const __m128i h = _mm_loadu_si128((const __m128i*)(record + 64));
      d4 = _mm_cvtph_ps(h);
      m4 = KIND == Q4_1 ? _mm_cvtph_ps(_mm_srli_si128(h, 8)) : _mm_mul_ps(d4, _mm_set1_ps(-8.f));
    }
    for (int r = 0; r < R; r++) {
      const int8_t* x = xq + r * in + b * QK;
      const __m256i xa = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)x));
      const __m256i xc = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(x + 16)));
      __m256i p0, p1;
      if (KIND == Q8_0) {
        p0 = _mm256_add_epi32(dot_u8s8(_mm256_sign_epi8(qa0, qa0), _mm256_sign_epi8(xa, qa0)),
                              dot_u8s8(_mm256_sign_epi8(qc0, qc0), _mm256_sign_epi8(xc, qc0)));
        p1 = _mm256_add_epi32(dot_u8s8(_mm256_sign_epi8(qa1, qa1), _mm256_sign_epi8(xa, qa1)),
                              dot_u8s8(_mm256_sign_epi8(qc1, qc1), _mm256_sign_epi8(xc, qc1)));
      } else {
        p0 = _mm256_add_epi32(dot_u8s8(qa0, xa), dot_u8s8(qc0, xc));
        p1 = _mm256_add_epi32(dot_u8s8(qa1, xa), dot_u8s8(qc1, xc));
      }
      const __m256 s8 = _mm256_castps128_ps256(_mm_mul_ps(d4, _mm_set1_ps(xd[r * nb + b])));
      acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_permutevar8x32_ps(s8, spread01), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_permutevar8x32_ps(s8, spread23), acc1[r]);
      if (KIND != Q8_0) more[r] = _mm_fmadd_ps(m4, _mm_set1_ps(xs[r * nb + b]), more[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    alignas(32) float l0[8], l1[8];
    alignas(16) float m[4];
    _mm256_store_ps(l0, acc0[r]);
    _mm256_store_ps(l1, acc1[r]);
    _mm_store_ps(m, more[r]);
    const float* lanes[2] = {l0, l1};
    for (int i = 0; i < 4; i++) {
      const float* l = lanes[i / 2] + 4 * (i % 2);
      out[r * 4 + i] = (l[0] + l[1]) + (l[2] + l[3]) + m[i];
    }
  }
  (void)extra;
#else
  float acc[R][4];
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) acc[r][i] = 0.f;
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = rec + b * rb;
    const uint8_t* halves = record + (KIND == Q8_0 ? 4 * QK : 4 * (QK / 2));
    for (int i = 0; i < 4; i++) {
      const float d = half_to_float(read_u16(halves + 2 * i));
      const float m = KIND == Q4_1 ? half_to_float(read_u16(halves + 8 + 2 * i)) : -8.f * d;
      for (int r = 0; r < R; r++) {
        const int8_t* x = xq + r * in + b * QK;
        int sum = 0;
        if (KIND == Q8_0) {
          const int8_t* qa = (const int8_t*)record + 16 * i;
          const int8_t* qc = (const int8_t*)record + 64 + 16 * i;
          for (int j = 0; j < 16; j++) sum += qa[j] * x[j] + qc[j] * x[j + 16];
        } else {
          const uint8_t* q = record + 16 * i;
          for (int j = 0; j < 16; j++) sum += (q[j] & 0x0f) * x[j] + (q[j] >> 4) * x[j + 16];
          extra[r][i] += m * xs[r * nb + b];
        }
        acc[r][i] += d * xd[r * nb + b] * (float)sum;
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int i = 0; i < 4; i++) out[r * 4 + i] = acc[r][i] + extra[r][i];
#endif
}

template <int KIND>
void packed_product(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out_features, float* y) {
  const int64_t nb = in / QK, groups = out_features / 4, group_bytes = nb * record_bytes(KIND);
  std::vector<int8_t> xq(rows * in);
  std::vector<float> xd(rows * nb), xs(rows * nb);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) quantize_row(x + r * in, in, &xq[r * in], &xd[r * nb], &xs[r * nb]);
  });
  for (int64_t tile = 0; tile < rows; tile += X_TILE) {
    const int64_t tile_rows = std::min(X_TILE, rows - tile);
    const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(16, groups / (4 * at::get_num_threads())));
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      float part[ROW_TILE * 4];
      for (int64_t g = begin; g < end; g++) {
        const uint8_t* wg = w + g * group_bytes;
        int64_t r = tile;
        for (; r + ROW_TILE <= tile + tile_rows; r += ROW_TILE) {
          dot_groups<KIND, ROW_TILE>(wg, nb, &xq[r * in], &xd[r * nb], &xs[r * nb], in, part);
          for (int k = 0; k < ROW_TILE; k++) std::memcpy(y + (r + k) * out_features + 4 * g, part + 4 * k, 16);
        }
        for (; r < tile + tile_rows; r++) {
          dot_groups<KIND, 1>(wg, nb, &xq[r * in], &xd[r * nb], &xs[r * nb], in, part);
          std::memcpy(y + r * out_features + 4 * g, part, 16);
        }
      }
    });
  }
}

// raw GGUF rows <-> four-row records (out_features a multiple of 4)
void pack_group(const uint8_t* raw, int64_t row_bytes, int kind, int64_t nb, uint8_t* out) {
  const int bb = block_bytes(kind), rb = record_bytes(kind);
  for (int64_t b = 0; b < nb; b++) {
    uint8_t* record = out + b * rb;
    for (int i = 0; i < 4; i++) {
      const uint8_t* block = raw + i * row_bytes + b * bb;
      if (kind == Q8_0) {
        std::memcpy(record + 16 * i, block + 2, 16);
        std::memcpy(record + 64 + 16 * i, block + 18, 16);
        std::memcpy(record + 128 + 2 * i, block, 2);
      } else {
        std::memcpy(record + 16 * i, block + (kind == Q4_1 ? 4 : 2), 16);
        std::memcpy(record + 64 + 2 * i, block, 2);
        if (kind == Q4_1) {
          std::memcpy(record + 72 + 2 * i, block + 2, 2);
        } else {  // Q4_0: no minimum stored (the kernels take -8 d)
          std::memset(record + 72 + 2 * i, 0, 2);
        }
      }
    }
  }
}

void unpack_group(const uint8_t* packed, int kind, int64_t nb, int64_t row_bytes, uint8_t* raw) {
  const int bb = block_bytes(kind), rb = record_bytes(kind);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* record = packed + b * rb;
    for (int i = 0; i < 4; i++) {
      uint8_t* block = raw + i * row_bytes + b * bb;
      if (kind == Q8_0) {
        std::memcpy(block, record + 128 + 2 * i, 2);
        std::memcpy(block + 2, record + 16 * i, 16);
        std::memcpy(block + 18, record + 64 + 16 * i, 16);
      } else {
        std::memcpy(block, record + 64 + 2 * i, 2);
        if (kind == Q4_1) std::memcpy(block + 2, record + 72 + 2 * i, 2);
        std::memcpy(block + (kind == Q4_1 ? 4 : 2), record + 16 * i, 16);
      }
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

// x [rows, in] float32 times the transpose of w (out_features rows of `kind` blocks): [rows, out].
constexpr int64_t PACKED = 100;  // a kind + PACKED: the four-row records

torch::Tensor pack(torch::Tensor raw, int64_t kind, int64_t in_features) {
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous() && raw.size(0) % 4 == 0);
  const int64_t nb = in_features / QK, groups = raw.size(0) / 4, row_bytes = raw.size(1);
  TORCH_CHECK(row_bytes == nb * block_bytes(kind), "raw's row size");
  auto out = torch::empty({groups, nb * record_bytes(kind)}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) pack_group(rp + 4 * g * row_bytes, row_bytes, (int)kind, nb, op + g * out.size(1));
  });
  return out;
}

torch::Tensor unpack(torch::Tensor packed, int64_t kind, int64_t in_features) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous());
  const int64_t nb = in_features / QK, groups = packed.size(0), row_bytes = nb * block_bytes(kind);
  auto raw = torch::empty({4 * groups, row_bytes}, packed.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  uint8_t* rp = raw.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g++) unpack_group(pp + g * packed.size(1), (int)kind, nb, row_bytes, rp + 4 * g * row_bytes);
  });
  return raw;
}

torch::Tensor mm(torch::Tensor x, torch::Tensor w, int64_t kind, int64_t in_features) {
  const bool packed = kind >= PACKED;  // four-row records [out / 4, records], else rows [out, blocks]
  if (packed) kind -= PACKED;
  TORCH_CHECK(kind == Q8_0 || kind == Q4_0 || kind == Q4_1, "unsupported block type ", kind);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == in_features, "x: float32 [rows, in]");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 blocks or records");
  const int64_t unit = packed ? record_bytes(kind) : block_bytes(kind);
  TORCH_CHECK(in_features % QK == 0 && w.size(1) == in_features / QK * unit, "w's row size");
  x = x.contiguous();
  const int64_t rows = x.size(0), out_features = (packed ? 4 : 1) * w.size(0);
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  using Product = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*);
  const Product product_of = kind == Q8_0 ? (packed ? packed_product<Q8_0> : product<Q8_0>)
                             : kind == Q4_0 ? (packed ? packed_product<Q4_0> : product<Q4_0>)
                                            : (packed ? packed_product<Q4_1> : product<Q4_1>);
  product_of(x.data_ptr<float>(), rows, in_features, w.data_ptr<uint8_t>(), out_features, y.data_ptr<float>());
  return y;
}

// The weight's rows in float32 [out, in].
torch::Tensor dequantize(torch::Tensor w, int64_t kind, int64_t in_features) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: uint8 blocks [out, bytes]");
  TORCH_CHECK(in_features % QK == 0 && w.size(1) == in_features / QK * block_bytes(kind), "w's row size");
  const int64_t out_features = w.size(0), row_bytes = w.size(1);
  auto y = torch::empty({out_features, in_features}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out_features, 64, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; o++) dequantize_row(wp + o * row_bytes, (int)kind, in_features, yp + o * in_features);
  });
  return y;
}

// -- the decode step ---------------------------------------------------------------------------
//
// One token for each of a batch's rows through every block, in one call: what the Python step
// (backends/torch_model.decode_block) does in ~200 operator calls a block. Float32 activations;
// each matrix float32 or block-quantized. Keys and values go to the paged pool
// (backends/kv_pages: [2, layers, kv_heads, pages, PAGE, head_dim]) at the pages the table names.

namespace {

constexpr int64_t PAGE = 16;

struct Linear {
  torch::Tensor w, b;  // b undefined: no bias
  int64_t kind = -1;   // -1: float32 [out, in]; else a block type
  int64_t in = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y = kind < 0 ? at::linear(x, w) : mm(x, w, kind, in);
    if (b.defined()) y.add_(b);
    return y;
  }
};

struct Block {
  torch::Tensor norm1_w, norm1_b, norm2_w, norm2_b, q_norm, k_norm;
  Linear in, out, up, down;
  int64_t window = 0;  // 0: none
};

template <typename F>
void rows_parallel(int64_t n, int64_t grain, const F& f) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) f(i);
  });
}

inline torch::Tensor maybe(const c10::optional<torch::Tensor>& t) { return t.has_value() ? *t : torch::Tensor(); }

}  // namespace

class Step {
 public:
  Step(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int64_t inner,
       double eps, bool rms, bool parallel, bool gated, int64_t activation)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), rotary_dim_(rotary_dim),
        inner_(inner), eps_((float)eps), rms_(rms), parallel_(parallel), gated_(gated), activation_(activation) {
    TORCH_CHECK(rotary_dim <= 512 && heads % kv_heads == 0, "unsupported attention shape");
  }

  void add_block(torch::Tensor norm1_w, c10::optional<torch::Tensor> norm1_b, torch::Tensor w_in, int64_t kind_in,
                 c10::optional<torch::Tensor> b_in, torch::Tensor w_out, int64_t kind_out,
                 c10::optional<torch::Tensor> b_out, c10::optional<torch::Tensor> norm2_w,
                 c10::optional<torch::Tensor> norm2_b, c10::optional<torch::Tensor> w_up, int64_t kind_up,
                 c10::optional<torch::Tensor> b_up, c10::optional<torch::Tensor> w_down, int64_t kind_down,
                 c10::optional<torch::Tensor> b_down, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, int64_t window) {
    Block b;
    b.norm1_w = norm1_w;
    b.norm1_b = maybe(norm1_b);
    b.in = {w_in, maybe(b_in), kind_in, hidden_};
    b.out = {w_out, maybe(b_out), kind_out, parallel_ ? heads_ * head_dim_ + inner_ : heads_ * head_dim_};
    b.norm2_w = maybe(norm2_w);
    b.norm2_b = maybe(norm2_b);
    if (w_up.has_value()) b.up = {*w_up, maybe(b_up), kind_up, hidden_};
    if (w_down.has_value()) b.down = {*w_down, maybe(b_down), kind_down, inner_};
    b.q_norm = maybe(q_norm);
    b.k_norm = maybe(k_norm);
    b.window = window;
    blocks_.push_back(b);
  }

  // x [n, hidden] float32: the embeddings of n tokens, through every block. Token i sits at
  // positions[i] of the sequence whose pages are row owners[i] of table ([rows, width] int64 page
  // ids); with advance[i] 0 it idles (nothing written, its output undefined). Every token's key
  // and value are written before any attends, so the tokens of a prompt piece (one owner,
  // consecutive positions) attend causally, as decode rows do; each token's output depends on
  // its own row and its owner's columns only, never on the others in the call.
  // kv [2, layers, kv_heads, pages, PAGE, head_dim]; cos, sin [positions, rotary_dim] (sin
  // sign-folded, as backends/torch_model.rope_).
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor owners, torch::Tensor advance,
                        torch::Tensor table, torch::Tensor kv, torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && kv.dtype() == torch::kFloat32 && kv.is_contiguous());
    TORCH_CHECK(table.dtype() == torch::kInt64 && table.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
    x = x.contiguous();
    const int64_t batch = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t* pos = positions.contiguous().data_ptr<int64_t>();
    const int64_t* adv = advance.contiguous().data_ptr<int64_t>();
    owners = owners.contiguous();
    const int64_t* own = owners.data_ptr<int64_t>();
    TORCH_CHECK(positions.numel() == batch && owners.numel() == batch && advance.numel() == batch);
    auto attention = torch::zeros({batch, q_size}, x.options());
    for (size_t layer = 0; layer < blocks_.size(); layer++) {
      const Block& b = blocks_[layer];
      auto h = norm(x, b.norm1_w, b.norm1_b);
      auto y = b.in(h);  // [batch, q + 2 kv (+ inner)]
      place(y, b, layer, batch, pos, own, adv, table, kv, cos, sin);
      attend(y, b, layer, batch, pos, own, adv, table, kv, attention);
      if (parallel_) {
        auto mixed = torch::empty({batch, q_size + inner_}, x.options());
        mixed.narrow(1, 0, q_size).copy_(attention);
        auto act = mixed.narrow(1, q_size, inner_);
        act.copy_(y.narrow(1, q_size + 2 * kv_size, inner_));
        activate(act);
        x.add_(b.out(mixed));
      } else {
        x.add_(b.out(attention));
        auto u = b.up(norm(x, b.norm2_w, b.norm2_b));
        torch::Tensor g;
        if (gated_) {
          g = u.narrow(1, 0, inner_).contiguous();
          activate(g);
          g.mul_(u.narrow(1, inner_, inner_));
        } else {
          g = u;
          activate(g);
        }
        x.add_(b.down(g));
      }
    }
    return x;
  }

 private:
  int64_t hidden_, heads_, kv_heads_, head_dim_, rotary_dim_, inner_;
  float eps_;
  bool rms_, parallel_, gated_;
  int64_t activation_;  // 0 silu, 1 gelu (tanh), 2 gelu (erf)
  std::vector<Block> blocks_;

  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) const {
    const int64_t batch = x.size(0), n = x.size(1);
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < batch; r++) {
      const float* v = xp + r * n;
      float* o = op + r * n;
      if (rms_) {
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < n; i++) sq += v[i] * v[i];
        const float scale = 1.f / std::sqrt(sq / (float)n + eps_);
        for (int64_t i = 0; i < n; i++) o[i] = wp[i] * (v[i] * scale);
      } else {
        float mean = 0.f;
#pragma omp simd reduction(+ : mean)
        for (int64_t i = 0; i < n; i++) mean += v[i];
        mean /= (float)n;
        float var = 0.f;
#pragma omp simd reduction(+ : var)
        for (int64_t i = 0; i < n; i++) var += (v[i] - mean) * (v[i] - mean);
        const float scale = 1.f / std::sqrt(var / (float)n + eps_);
        for (int64_t i = 0; i < n; i++) o[i] = (v[i] - mean) * scale * wp[i] + (bp ? bp[i] : 0.f);
      }
    }
    return out;
  }

  void head_norm(float* v, const float* w) const {
    float sq = 0.f;
#pragma omp simd reduction(+ : sq)
    for (int64_t i = 0; i < head_dim_; i++) sq += v[i] * v[i];
    const float scale = 1.f / std::sqrt(sq / (float)head_dim_ + eps_);
    for (int64_t i = 0; i < head_dim_; i++) v[i] = w[i] * (v[i] * scale);
  }

  void rope(float* v, const float* c, const float* s) const {
    const int64_t half = rotary_dim_ / 2;
    float rot[512];
    for (int64_t i = 0; i < rotary_dim_; i++) rot[i] = v[i];
    for (int64_t i = 0; i < rotary_dim_; i++) {
      const float rolled = i < half ? rot[i + half] : rot[i - half];
      v[i] = rot[i] * c[i] + rolled * s[i];
    }
  }

  float* column(const torch::Tensor& kv, int64_t which, size_t layer, int64_t head, int64_t page, int64_t offset) const {
    const int64_t pages = kv.size(3), layers = kv.size(1);
    return kv.data_ptr<float>() + ((((which * layers + (int64_t)layer) * kv_heads_ + head) * pages + page) * PAGE + offset) * head_dim_;
  }

  // q and k normalized (Qwen3) and turned, k and v written to the pool: each decoding row.
  void place(torch::Tensor& y, const Block& b, size_t layer, int64_t batch, const int64_t* pos, const int64_t* own,
             const int64_t* adv, const torch::Tensor& table, const torch::Tensor& kv, const torch::Tensor& cos,
             const torch::Tensor& sin) const {
    const int64_t width = y.size(1), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t table_width = table.size(1);
    float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < batch; r++) {
      if (!adv[r]) continue;
      float* q = yp + r * width;
      float* k = q + q_size;
      float* v = k + kv_size;
      const float* c = cos.data_ptr<float>() + pos[r] * rotary_dim_;
      const float* s = sin.data_ptr<float>() + pos[r] * rotary_dim_;
      for (int64_t head = 0; head < heads_; head++) {
        if (b.q_norm.defined()) head_norm(q + head * head_dim_, b.q_norm.data_ptr<float>());
        rope(q + head * head_dim_, c, s);
      }
      const int64_t page = table.data_ptr<int64_t>()[own[r] * table_width + pos[r] / PAGE], offset = pos[r] % PAGE;
      for (int64_t head = 0; head < kv_heads_; head++) {
        if (b.k_norm.defined()) head_norm(k + head * head_dim_, b.k_norm.data_ptr<float>());
        rope(k + head * head_dim_, c, s);
        std::memcpy(column(kv, 0, layer, head, page, offset), k + head * head_dim_, head_dim_ * sizeof(float));
        std::memcpy(column(kv, 1, layer, head, page, offset), v + head * head_dim_, head_dim_ * sizeof(float));
      }
    }
  }

  // Each decoding row's query heads over its columns (its window's), a key-value head's group at a time.
  void attend(const torch::Tensor& y, const Block& b, size_t layer, int64_t batch, const int64_t* pos,
              const int64_t* own, const int64_t* adv, const torch::Tensor& table, const torch::Tensor& kv,
              torch::Tensor& attention) const {
    const int64_t width = y.size(1), group = heads_ / kv_heads_, table_width = table.size(1);
    const float scale = 1.f / std::sqrt((float)head_dim_);
    const float* yp = y.data_ptr<float>();
    float* ap = attention.data_ptr<float>();
    const int64_t* tp = table.data_ptr<int64_t>();
    // Rows in zigzag order (first, last, second, second last, ...): a prompt piece's later rows
    // attend to more columns, and each thread takes a contiguous run of items.
    rows_parallel(batch * kv_heads_, 1, [&](int64_t item) {
      const int64_t i = item / kv_heads_, head = item % kv_heads_;
      const int64_t r = i % 2 == 0 ? i / 2 : batch - 1 - i / 2;
      float* out = ap + r * heads_ * head_dim_ + head * group * head_dim_;
      if (!adv[r]) {
        std::memset(out, 0, group * head_dim_ * sizeof(float));
        return;
      }
      const int64_t last = pos[r], first = b.window > 0 ? std::max<int64_t>(0, last - b.window + 1) : 0;
      const int64_t n = last - first + 1;
      thread_local std::vector<float> buffer;
      if ((int64_t)buffer.size() < group * n) buffer.resize(group * n);
      float* scores = buffer.data();
      const int64_t* pages = tp + own[r] * table_width;
      const float* q0 = yp + r * width + head * group * head_dim_;
      for (int64_t c = first; c <= last;) {  // a page's columns at a time
        const int64_t offset = c % PAGE, count = std::min(PAGE - offset, last + 1 - c);
        const float* keys = column(kv, 0, layer, head, pages[c / PAGE], offset);
        for (int64_t j = 0; j < count; j++) {
          const float* key = keys + j * head_dim_;
          for (int64_t g = 0; g < group; g++) {
            const float* q = q0 + g * head_dim_;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim_; d++) dot += q[d] * key[d];
            scores[g * n + (c + j - first)] = dot * scale;
          }
        }
        c += count;
      }
      for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * n;
        float top = sg[0];
        for (int64_t j = 1; j < n; j++) top = std::fmax(top, sg[j]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n; j++) {
          sg[j] = expf(sg[j] - top);
          total += sg[j];
        }
        const float inverse = 1.f / total;
#pragma omp simd
        for (int64_t j = 0; j < n; j++) sg[j] *= inverse;
        std::memset(out + g * head_dim_, 0, head_dim_ * sizeof(float));
      }
      for (int64_t c = first; c <= last;) {
        const int64_t offset = c % PAGE, count = std::min(PAGE - offset, last + 1 - c);
        const float* values = column(kv, 1, layer, head, pages[c / PAGE], offset);
        for (int64_t j = 0; j < count; j++) {
          const float* value = values + j * head_dim_;
          for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * n + (c + j - first)];
            float* o = out + g * head_dim_;
#pragma omp simd
            for (int64_t d = 0; d < head_dim_; d++) o[d] += p * value[d];
          }
        }
        c += count;
      }
    });
  }

  void activate(torch::Tensor& t) const {
    // t may be a strided view of rows: walk its rows
    const int64_t rows = t.size(0), n = t.size(1), stride = t.stride(0);
    float* base = t.data_ptr<float>();
    const int64_t chunk = 1024;
    const int64_t pieces = (n + chunk - 1) / chunk;
    rows_parallel(rows * pieces, 4, [&](int64_t item) {
      float* v = base + (item / pieces) * stride;
      const int64_t start = (item % pieces) * chunk, end = std::min(n, start + chunk);
      for (int64_t i = start; i < end; i++) {
        const float z = v[i];
        if (activation_ == 0) {
          v[i] = z / (1.f + std::exp(-z));
        } else if (activation_ == 1) {
          v[i] = 0.5f * z * (1.f + std::tanh(0.7978845608028654f * (z + 0.044715f * z * z * z)));
        } else {
          v[i] = 0.5f * z * (1.f + std::erf(z * 0.7071067811865476f));
        }
      }
    });
  }
};

// Which SIMD path this build took, for /model/info and the logs.
std::string simd() {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx2+avx512vnni";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "avx2+avxvnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm", &mm, "x @ w.T for block-quantized w");
  m.def("pack", &pack, "raw GGUF rows to four-row records");
  m.def("unpack", &unpack, "four-row records to raw GGUF rows");
  m.def("dequantize", &dequantize, "block-quantized rows to float32");
  m.def("simd", &simd, "the SIMD path compiled");
  pybind11::class_<Step>(m, "Step", pybind11::module_local())  // builds for other targets load beside it (tests)
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, bool, bool, int64_t>())
      .def("add_block", &Step::add_block)
      .def("forward", &Step::forward);
}
