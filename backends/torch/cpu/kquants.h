// Products over llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) and its 5-bit blocks (Q5_0, Q5_1), as a
// GGUF file stores them: backends/torch/cpu/kernels.cpp includes this file and sends those types here.
//
// Each type's values are small unsigned integers q (4, 5 or 6 bits) with integer scales:
//   Q4_K, Q5_K: 256 values a super-block, 8 sub-blocks of 32:  w = d * sc[j] * q - dmin * m[j]
//               (sc, m: 6-bit; d, dmin: float16)
//   Q6_K:       256 values, 16 scales of 16 values:             w = d * sc[s] * (q - 32)  (sc: int8)
//   Q5_0, Q5_1: 32 values:                                      w = d * (q - 16),  w = d * q + m
// Activations are int8 blocks of 32 (kernels.cpp's quantize_row; Q6_K also takes their sums
// over 16), so a sub-block's sum over q * xq is exact integer arithmetic, scaled once by its
// integer scale and once by d * xd:
//   Q4_K, Q5_K: d * sum_j xd_j * sc_j * sum(q * xq)  -  dmin * sum_j m_j * xs_j
//   Q6_K:       d * sum_j xd_j * sum_s sc_s * (sum(q * xq) - 32 * sum(xq))
//
// Sixteen rows a record (as kernels.cpp's own records), one per super-block: a 32-bit lane a
// row, so one dot-product instruction against 4 activation bytes broadcast covers 16 rows.
//   nibble pieces (64 bytes, lane i = row i): a pair of sub-blocks c (K: sub-blocks 2c, 2c + 1;
//     Q5_0/Q5_1: the block's values 0-15 and 16-31), piece k: byte t's low nibble = value 4k + t
//     of the pair's first, its high nibble = value 4k + t of the second
//   high-bit pieces (Q5: 1 bit a value, a piece for 4 nibble pieces; Q6_K: 2 bits, one for 2):
//     byte t, for the nibble piece k = 4 / hb * (its index) + j: bits [2 j hb, +hb) the first's
//     high bits, [2 j hb + hb, +hb) the second's
//   integer scales (K), a pair's: Q4_K/Q5_K sc[2][16] m[2][16] (uint8); Q6_K sc[4][16] (int8)
//   A record is its pairs in order, each pair's nibble pieces, then its high-bit pieces, then its
//   scales, so a record is read front to back; then d[16] (float16) and Q4_K/Q5_K's dmin[16] or
//   Q5_1's m[16]. (Q6_K's high bits and scales in regions of their own behind the nibbles read at
//   about half Q4_K's rate from memory on a Zen 4, 2026-12-08; in cache, three quarters.)
// Sizes: Q5_0, Q5_1 as the file's; Q4_K 148 and Q5_K 180 bytes a row's super-block against the
// file's 144 and 176 (the 6-bit scales kept a byte each: no unpacking in the loop); Q6_K 212
// against 210 (a record padded to whole 64-byte lines: no load straddles two).

#pragma once

#include <utility>
#include <vector>

namespace {

template <class F, int... ks>
__attribute__((always_inline)) inline void static_for_impl(F& f, std::integer_sequence<int, ks...>) {
  (f(std::integral_constant<int, ks>{}), ...);
}
template <int N, class F>
__attribute__((always_inline)) inline void static_for(F& f) {  // f(0), f(1), ... f(N - 1), each index a constant
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

constexpr int Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14;  // ggml's type ids

constexpr bool is_kquant(int64_t kind) { return kind == Q5_0 || kind == Q5_1 || kind == Q4_K || kind == Q5_K || kind == Q6_K; }

template <int KIND>
struct KLayout {
  static constexpr bool K = KIND == Q4_K || KIND == Q5_K || KIND == Q6_K;
  static constexpr int S = K ? 256 : 32;             // values a super-block
  static constexpr int NP = K ? 4 : 1;               // pairs of sub-blocks
  static constexpr int P = K ? 8 : 4;                // nibble pieces a pair
  static constexpr int HB = KIND == Q6_K ? 2 : KIND == Q4_K ? 0 : 1;  // high bits a value
  // a pair's bytes, read in order: its nibble pieces, its high-bit pieces, (K) its integer scales
  static constexpr int PB = P * 64 + P * HB * 16 + (K ? 64 : 0);
  static constexpr int nib(int c, int k) { return c * PB + k * 64; }
  static constexpr int hi(int c, int k) { return c * PB + P * 64 + (HB ? k / (4 / HB) : 0) * 64; }
  static constexpr int sc(int c) { return c * PB + P * 64 + P * HB * 16; }
  static constexpr int D = NP * PB;  // d[16] (float16), then dmin[16] or Q5_1's m[16]
  static constexpr int RB = D + (KIND == Q5_0 ? 32 : 64);  // Q6_K: 32 bytes unused, so records stay 64-byte lines
  static constexpr int FB = KIND == Q4_K ? 144 : KIND == Q5_K ? 176 : KIND == Q6_K ? 210 : KIND == Q5_0 ? 22 : 24;
  // the first value of pair c's first (a) and second (b) sub-block at piece k
  static constexpr int va(int c, int k) { return K ? 64 * c + 4 * k : 4 * k; }
  static constexpr int vb(int c, int k) { return K ? 64 * c + 32 + 4 * k : 16 + 4 * k; }
};

inline int kq_values(int64_t kind) { return kind == Q5_0 || kind == Q5_1 ? 32 : 256; }
inline int kq_file_bytes(int64_t kind) {
  switch (kind) {
    case Q5_0: return KLayout<Q5_0>::FB;
    case Q5_1: return KLayout<Q5_1>::FB;
    case Q4_K: return KLayout<Q4_K>::FB;
    case Q5_K: return KLayout<Q5_K>::FB;
    case Q6_K: return KLayout<Q6_K>::FB;
  }
  TORCH_CHECK(false, "unsupported block type ", kind);
}
inline int kq_record_bytes(int64_t kind) {
  switch (kind) {
    case Q5_0: return KLayout<Q5_0>::RB;
    case Q5_1: return KLayout<Q5_1>::RB;
    case Q4_K: return KLayout<Q4_K>::RB;
    case Q5_K: return KLayout<Q5_K>::RB;
    case Q6_K: return KLayout<Q6_K>::RB;
  }
  TORCH_CHECK(false, "unsupported block type ", kind);
}

// One row's super-block as integers: the file's layout decoded, and encoded back.
struct KInts {
  uint8_t q[256];     // unsigned values
  int16_t sc[16];     // Q4_K/Q5_K: 8 6-bit scales; Q6_K: 16 int8
  uint8_t m[8];       // Q4_K/Q5_K: 8 6-bit minimums
  uint16_t d, dmin;   // float16 bits (Q5_1: dmin holds m)
};

inline void k4_scales_decode(const uint8_t* s, KInts& v) {
  for (int j = 0; j < 4; j++) {
    v.sc[j] = s[j] & 63;
    v.m[j] = s[j + 4] & 63;
    v.sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 6) << 4);
    v.m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

inline void k4_scales_encode(const KInts& v, uint8_t* s) {
  for (int j = 0; j < 4; j++) {
    s[j] = (uint8_t)((v.sc[j] & 63) | ((v.sc[j + 4] >> 4) << 6));
    s[j + 4] = (uint8_t)((v.m[j] & 63) | ((v.m[j + 4] >> 4) << 6));
    s[j + 8] = (uint8_t)((v.sc[j + 4] & 0xf) | ((v.m[j + 4] & 0xf) << 4));
  }
}

template <int KIND>
inline void file_decode(const uint8_t* f, KInts& v) {
  if (KIND == Q5_0 || KIND == Q5_1) {
    const int lead = KIND == Q5_1 ? 4 : 2;
    v.d = read_u16(f);
    v.dmin = KIND == Q5_1 ? read_u16(f + 2) : 0;
    uint32_t qh;
    std::memcpy(&qh, f + lead, 4);
    for (int j = 0; j < 32; j++) v.q[j] = ((f[lead + 4 + j % 16] >> (4 * (j / 16))) & 0xf) | (((qh >> j) & 1) << 4);
  } else if (KIND == Q4_K || KIND == Q5_K) {
    v.d = read_u16(f);
    v.dmin = read_u16(f + 2);
    k4_scales_decode(f + 4, v);
    const uint8_t* qh = f + 16;
    const uint8_t* qs = f + (KIND == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++)
      for (int l = 0; l < 32; l++) {
        const int low = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf;
        v.q[32 * j + l] = (uint8_t)(KIND == Q5_K ? low | (((qh[l] >> j) & 1) << 4) : low);
      }
  } else {  // Q6_K: ql[128] qh[64] scales[16] d
    const uint8_t* ql = f;
    const uint8_t* qh = f + 128;
    for (int s = 0; s < 16; s++) v.sc[s] = (int8_t)f[192 + s];
    v.d = read_u16(f + 208);
    v.dmin = 0;
    for (int n = 0; n < 2; n++)
      for (int w = 0; w < 128; w++) {
        const int s = w / 32, l = w % 32;
        const int low = (ql[64 * n + l + 32 * (s & 1)] >> (4 * (s >> 1))) & 0xf;
        v.q[128 * n + w] = (uint8_t)(low | (((qh[32 * n + l] >> (2 * s)) & 3) << 4));
      }
  }
}

template <int KIND>
inline void file_encode(const KInts& v, uint8_t* f) {
  std::memset(f, 0, KLayout<KIND>::FB);
  if (KIND == Q5_0 || KIND == Q5_1) {
    const int lead = KIND == Q5_1 ? 4 : 2;
    std::memcpy(f, &v.d, 2);
    if (KIND == Q5_1) std::memcpy(f + 2, &v.dmin, 2);
    uint32_t qh = 0;
    for (int j = 0; j < 32; j++) {
      qh |= (uint32_t)(v.q[j] >> 4) << j;
      f[lead + 4 + j % 16] |= (uint8_t)((v.q[j] & 0xf) << (4 * (j / 16)));
    }
    std::memcpy(f + lead, &qh, 4);
  } else if (KIND == Q4_K || KIND == Q5_K) {
    std::memcpy(f, &v.d, 2);
    std::memcpy(f + 2, &v.dmin, 2);
    k4_scales_encode(v, f + 4);
    uint8_t* qh = f + 16;
    uint8_t* qs = f + (KIND == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++)
      for (int l = 0; l < 32; l++) {
        const int q = v.q[32 * j + l];
        qs[32 * (j / 2) + l] |= (uint8_t)((q & 0xf) << (4 * (j % 2)));
        if (KIND == Q5_K) qh[l] |= (uint8_t)((q >> 4) << j);
      }
  } else {
    for (int s = 0; s < 16; s++) f[192 + s] = (uint8_t)(int8_t)v.sc[s];
    std::memcpy(f + 208, &v.d, 2);
    for (int n = 0; n < 2; n++)
      for (int w = 0; w < 128; w++) {
        const int s = w / 32, l = w % 32, q = v.q[128 * n + w];
        f[64 * n + l + 32 * (s & 1)] |= (uint8_t)((q & 0xf) << (4 * (s >> 1)));
        f[128 + 32 * n + l] |= (uint8_t)((q >> 4) << (2 * s));
      }
  }
}

// Row i's super-block in a record, from integers and back.
template <int KIND>
inline void record_put(const KInts& v, int i, uint8_t* rec) {
  using L = KLayout<KIND>;
  for (int c = 0; c < L::NP; c++)
    for (int k = 0; k < L::P; k++)
      for (int t = 0; t < 4; t++) {
        const int a = v.q[L::va(c, k) + t], b = v.q[L::vb(c, k) + t];
        rec[L::nib(c, k) + 4 * i + t] = (uint8_t)((a & 0xf) | ((b & 0xf) << 4));
        if (L::HB) {
          const int per = 4 / L::HB, j = k % per;
          uint8_t& h = rec[L::hi(c, k) + 4 * i + t];
          if (j == 0) h = 0;
          h |= (uint8_t)(((a >> 4) << (2 * j * L::HB)) | ((b >> 4) << (2 * j * L::HB + L::HB)));
        }
      }
  if (KIND == Q4_K || KIND == Q5_K) {
    for (int j = 0; j < 8; j++) {
      rec[L::sc(j / 2) + 16 * (j % 2) + i] = (uint8_t)v.sc[j];
      rec[L::sc(j / 2) + 32 + 16 * (j % 2) + i] = v.m[j];
    }
  } else if (KIND == Q6_K) {
    for (int j = 0; j < 16; j++) rec[L::sc(j / 4) + 16 * (j % 4) + i] = (uint8_t)(int8_t)v.sc[j];
  }
  std::memcpy(rec + L::D + 2 * i, &v.d, 2);
  if (KIND == Q4_K || KIND == Q5_K || KIND == Q5_1) std::memcpy(rec + L::D + 32 + 2 * i, &v.dmin, 2);
}

template <int KIND>
inline void record_get(const uint8_t* rec, int i, KInts& v) {
  using L = KLayout<KIND>;
  for (int c = 0; c < L::NP; c++)
    for (int k = 0; k < L::P; k++)
      for (int t = 0; t < 4; t++) {
        const int byte = rec[L::nib(c, k) + 4 * i + t];
        int a = byte & 0xf, b = byte >> 4;
        if (L::HB) {
          const int per = 4 / L::HB, j = k % per, mask = (1 << L::HB) - 1;
          const int h = rec[L::hi(c, k) + 4 * i + t];
          a |= ((h >> (2 * j * L::HB)) & mask) << 4;
          b |= ((h >> (2 * j * L::HB + L::HB)) & mask) << 4;
        }
        v.q[L::va(c, k) + t] = (uint8_t)a;
        v.q[L::vb(c, k) + t] = (uint8_t)b;
      }
  if (KIND == Q4_K || KIND == Q5_K) {
    for (int j = 0; j < 8; j++) {
      v.sc[j] = rec[L::sc(j / 2) + 16 * (j % 2) + i];
      v.m[j] = rec[L::sc(j / 2) + 32 + 16 * (j % 2) + i];
    }
  } else if (KIND == Q6_K) {
    for (int j = 0; j < 16; j++) v.sc[j] = (int8_t)rec[L::sc(j / 4) + 16 * (j % 4) + i];
  }
  v.d = read_u16(rec + L::D + 2 * i);
  v.dmin = KIND == Q4_K || KIND == Q5_K || KIND == Q5_1 ? read_u16(rec + L::D + 32 + 2 * i) : 0;
}

// One super-block's values in float32, as the format (and gguf-py) computes them.
template <int KIND>
inline void ints_dequantize(const KInts& v, float* o) {
  const float d = half_to_float(v.d);
  if (KIND == Q5_0) {
    for (int j = 0; j < 32; j++) o[j] = d * (float)((int)v.q[j] - 16);
  } else if (KIND == Q5_1) {
    const float m = half_to_float(v.dmin);
    for (int j = 0; j < 32; j++) o[j] = d * (float)v.q[j] + m;
  } else if (KIND == Q6_K) {
    for (int j = 0; j < 256; j++) o[j] = (d * (float)v.sc[j / 16]) * (float)((int)v.q[j] - 32);
  } else {
    const float dmin = half_to_float(v.dmin);
    for (int j = 0; j < 256; j++) o[j] = (d * (float)v.sc[j / 32]) * (float)v.q[j] - dmin * (float)v.m[j / 32];
  }
}

// -- the products over records: 16 rows (AVX-512) or 8 (AVX2) a register ------------------------

#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__) && defined(__F16C__)
struct KV512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int ROWS = 16;
  static I load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
  static I bytes(int v) { return _mm512_set1_epi8((char)v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  template <int S>
  static I shift(I a) {  // 16-bit lanes: left by S (right where negative)
    if constexpr (S > 0) return _mm512_slli_epi16(a, S);
    else if constexpr (S < 0) return _mm512_srli_epi16(a, -S);
    else return a;
  }
  static I four(const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
  }
  static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static I zero_i() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I set1_i(int32_t v) { return _mm512_set1_epi32(v); }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
#define PHI2_KVEC KV512
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
struct KV256 {
  using I = __m256i;
  using F = __m256;
  static constexpr int ROWS = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I bytes(int v) { return _mm256_set1_epi8((char)v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  template <int S>
  static I shift(I a) {
    if constexpr (S > 0) return _mm256_slli_epi16(a, S);
    else if constexpr (S < 0) return _mm256_srli_epi16(a, -S);
    else return a;
  }
  static I four(const int8_t* x) {
    int32_t v;
    std::memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
  }
  // weights are at most 63: maddubs' pairs (<= 2 * 63 * 127) never saturate
  static I dot(I acc, I w, I x) { return _mm256_add_epi32(acc, dot_u8s8(w, x)); }
  static I zero_i() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I set1_i(int32_t v) { return _mm256_set1_epi32(v); }
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static F half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
};
#define PHI2_KVEC KV256
#endif

// Activations for the products: kernels.cpp's int8 blocks, and (Q6_K) their sums over 16.
struct KActs {
  int64_t in, nb;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> i, h;
  KActs(const float* x, int64_t rows, int64_t in_, bool sixteens) : in(in_), nb(in_ / QK) {
    q.resize(rows * in);
    d.resize(rows * nb);
    s.resize(rows * nb);
    i.resize(rows * nb);
    if (sixteens) h.resize(rows * nb * 2);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; r++) {
        quantize_row(x + r * in, in, &q[r * in], &d[r * nb], &s[r * nb], &i[r * nb]);
        if (sixteens)
          for (int64_t u = 0; u < 2 * nb; u++) {
            int32_t sum = 0;
            for (int t = 0; t < 16; t++) sum += q[r * in + 16 * u + t];
            h[r * 2 * nb + u] = sum;
          }
      }
    });
  }
};

#ifdef PHI2_KVEC
// R activation rows (from `row`) against one group's records, for the register's rows from
// `lane0` (AVX-512: all 16; AVX2: 0-7, then 8-15): out [R][16].
template <int KIND, int R, class V>
inline void kdot(const uint8_t* rec, int64_t nsb, const KActs& a, int64_t row, int lane0, float* out) {
  using L = KLayout<KIND>;
  using I = typename V::I;
  using F = typename V::F;
  const int64_t in = a.in, nb = a.nb;
  const int8_t* xq = &a.q[row * in];
  const float* xd = &a.d[row * nb];
  const float* xs = &a.s[row * nb];
  const int32_t* xi = &a.i[row * nb];
  const int32_t* xh = KIND == Q6_K ? &a.h[row * 2 * nb] : nullptr;
  const I low = V::bytes(0x0f), high = V::bytes(L::HB == 2 ? 0x30 : 0x10);
  F acc[R];
  for (int r = 0; r < R; r++) acc[r] = V::zero();
  for (int64_t sb = 0; sb < nsb; sb++) {
    const uint8_t* re = rec + sb * L::RB;
    const int8_t* x0 = xq + sb * L::S;
    const int64_t blk = sb * L::S / QK;  // the super-block's first activation block
    F part[R], mins[R];
    for (int r = 0; r < R; r++) part[r] = mins[r] = V::zero();
    for (int c = 0; c < L::NP; c++) {
      I pa[R], pb[R], ta[R], tb[R];
      for (int r = 0; r < R; r++) pa[r] = pb[r] = ta[r] = tb[r] = V::zero_i();
      const int64_t A = blk + (L::K ? 2 * c : 0), B = A + (L::K ? 1 : 0);
      auto piece = [&](auto kc) __attribute__((always_inline)) {
        constexpr int k = decltype(kc)::value;
        const I nib = V::load(re + L::nib(c, k) + 4 * lane0);
        I wa = V::and_(nib, low), wb = V::and_(V::template shift<-4>(nib), low);
        if constexpr (L::HB > 0) {
          constexpr int per = 4 / L::HB, j = k % per;
          const I h = V::load(re + L::hi(c, k) + 4 * lane0);
          wa = V::or_(wa, V::and_(V::template shift<4 - 2 * j * L::HB>(h), high));
          wb = V::or_(wb, V::and_(V::template shift<4 - 2 * j * L::HB - L::HB>(h), high));
        }
        for (int r = 0; r < R; r++) {
          pa[r] = V::dot(pa[r], wa, V::four(x0 + r * in + L::va(c, k)));
          pb[r] = V::dot(pb[r], wb, V::four(x0 + r * in + L::vb(c, k)));
        }
        if constexpr (KIND == Q6_K && k % 4 == 3) {  // a scale's 16 values done: into ta, tb
          constexpr int seg = k / 4;
          const I sa = V::s8(re + L::sc(c) + seg * 16 + lane0);
          const I sb2 = V::s8(re + L::sc(c) + (2 + seg) * 16 + lane0);
          for (int r = 0; r < R; r++) {
            const int32_t* hr = xh + r * 2 * nb;
            const I ha = V::set1_i(-32 * hr[2 * A + seg]), hb = V::set1_i(-32 * hr[2 * B + seg]);
            ta[r] = V::add(ta[r], V::mullo(sa, V::add(pa[r], ha)));
            tb[r] = V::add(tb[r], V::mullo(sb2, V::add(pb[r], hb)));
            pa[r] = pb[r] = V::zero_i();
          }
        }
      };
      static_for<L::P>(piece);
      if constexpr (KIND == Q4_K || KIND == Q5_K) {
        const I sa = V::u8(re + L::sc(c) + lane0), sb2 = V::u8(re + L::sc(c) + 16 + lane0);
        const F ma = V::cvt(V::u8(re + L::sc(c) + 32 + lane0)), mb = V::cvt(V::u8(re + L::sc(c) + 48 + lane0));
        for (int r = 0; r < R; r++) {
          part[r] = V::fma(V::cvt(V::mullo(sa, pa[r])), V::set1(xd[r * nb + A]), part[r]);
          part[r] = V::fma(V::cvt(V::mullo(sb2, pb[r])), V::set1(xd[r * nb + B]), part[r]);
          mins[r] = V::fma(ma, V::set1(xs[r * nb + A]), mins[r]);
          mins[r] = V::fma(mb, V::set1(xs[r * nb + B]), mins[r]);
        }
      } else if constexpr (KIND == Q6_K) {
        for (int r = 0; r < R; r++) {
          part[r] = V::fma(V::cvt(ta[r]), V::set1(xd[r * nb + A]), part[r]);
          part[r] = V::fma(V::cvt(tb[r]), V::set1(xd[r * nb + B]), part[r]);
        }
      } else {
        const F d = V::half(re + L::D + 2 * lane0);
        for (int r = 0; r < R; r++) {
          I p = V::add(pa[r], pb[r]);
          if (KIND == Q5_0) p = V::add(p, V::set1_i(-16 * xi[r * nb + A]));
          acc[r] = V::fma(V::cvt(p), V::mul(d, V::set1(xd[r * nb + A])), acc[r]);
          if (KIND == Q5_1) acc[r] = V::fma(V::half(re + L::D + 32 + 2 * lane0), V::set1(xs[r * nb + A]), acc[r]);
        }
      }
    }
    if constexpr (L::K) {
      const F d = V::half(re + L::D + 2 * lane0);
      for (int r = 0; r < R; r++) acc[r] = V::fma(d, part[r], acc[r]);
      if constexpr (KIND != Q6_K) {
        const F dmin = V::half(re + L::D + 32 + 2 * lane0);
        for (int r = 0; r < R; r++) acc[r] = V::fnma(dmin, mins[r], acc[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) V::store(out + r * GROUP + lane0, acc[r]);
}
#endif

// The same sums in plain C++ (the same integer sums and float steps, a row at a time).
template <int KIND>
inline void kdot_plain(const uint8_t* rec, int64_t nsb, const KActs& a, int64_t row, float* out) {
  using L = KLayout<KIND>;
  const int64_t in = a.in, nb = a.nb;
  KInts v;
  for (int i = 0; i < GROUP; i++) {
    float acc = 0.f;
    for (int64_t sb = 0; sb < nsb; sb++) {
      record_get<KIND>(rec + sb * L::RB, i, v);
      const int8_t* x = &a.q[row * in + sb * L::S];
      const int64_t blk = row * nb + sb * L::S / QK;
      float part = 0.f, mins = 0.f;
      for (int u = 0; u < L::S / QK; u++) {
        int32_t sums[2] = {0, 0};
        for (int t = 0; t < QK; t++) sums[t / 16] += v.q[QK * u + t] * x[QK * u + t];
        if (KIND == Q4_K || KIND == Q5_K) {
          part = std::fma((float)(v.sc[u] * (sums[0] + sums[1])), a.d[blk + u], part);
          mins = std::fma((float)v.m[u], a.s[blk + u], mins);
        } else if (KIND == Q6_K) {
          const int32_t* h = &a.h[2 * (blk + u)];
          const int32_t t = v.sc[2 * u] * (sums[0] - 32 * h[0]) + v.sc[2 * u + 1] * (sums[1] - 32 * h[1]);
          part = std::fma((float)t, a.d[blk + u], part);
        } else {
          int32_t p = sums[0] + sums[1];
          if (KIND == Q5_0) p -= 16 * a.i[blk];
          acc = std::fma((float)p, half_to_float(v.d) * a.d[blk], acc);
          if (KIND == Q5_1) acc = std::fma(half_to_float(v.dmin), a.s[blk], acc);
        }
      }
      if (L::K) {
        acc = std::fma(half_to_float(v.d), part, acc);
        if (KIND != Q6_K) acc = std::fma(-half_to_float(v.dmin), mins, acc);
      }
    }
    out[i] = acc;
  }
}

constexpr int KGROUP_ROWS = 4;  // activation rows a group's records are unpacked for

template <int KIND, int R>
inline void kgroup(const uint8_t* rec, int64_t nsb, const KActs& a, int64_t row, float* out) {
#ifdef PHI2_KVEC
  for (int lane0 = 0; lane0 < GROUP; lane0 += PHI2_KVEC::ROWS) kdot<KIND, R, PHI2_KVEC>(rec, nsb, a, row, lane0, out);
#else
  for (int r = 0; r < R; r++) kdot_plain<KIND>(rec, nsb, a, row + r, out + r * GROUP);
#endif
}

// y [rows][out] for x [rows][in] against sixteen-row records. Every row takes the same steps
// whatever its company. A prompt's rows take these products too: AMX's tiles (kernels.cpp)
// are for the Q8_0/Q4 records only, and this machine has none to check K-quant tiles on.
template <int KIND>
void kpacked_product(const float* x, int64_t rows, int64_t in, const uint8_t* w, int64_t out_features, float* y) {
  using L = KLayout<KIND>;
  const int64_t nsb = in / L::S, groups = out_features / GROUP, group_bytes = nsb * L::RB;
  const KActs a(x, rows, in, KIND == Q6_K);
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(8, groups / (4 * at::get_num_threads())));
  // a group's records are read once per span of rows whose activations stay in L2 (1 MB)
  const int64_t span = std::max<int64_t>(64, (1 << 20) / in / KGROUP_ROWS * KGROUP_ROWS);
  for (int64_t tile = 0; tile < rows; tile += span) {
    const int64_t tile_rows = std::min(span, rows - tile);
    at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      float part[KGROUP_ROWS * GROUP];
      for (int64_t g = begin; g < end; g++) {
        const uint8_t* wg = w + g * group_bytes;
        int64_t r = tile;
        for (; r + KGROUP_ROWS <= tile + tile_rows; r += KGROUP_ROWS) {
          kgroup<KIND, KGROUP_ROWS>(wg, nsb, a, r, part);
          for (int k = 0; k < KGROUP_ROWS; k++)
            std::memcpy(y + (r + k) * out_features + GROUP * g, part + GROUP * k, GROUP * sizeof(float));
        }
        for (; r < tile + tile_rows; r++) {
          kgroup<KIND, 1>(wg, nsb, a, r, part);
          std::memcpy(y + r * out_features + GROUP * g, part, GROUP * sizeof(float));
        }
      }
    });
  }
}

template <int KIND>
void kpack_group(const uint8_t* raw, int64_t row_bytes, int64_t nsb, uint8_t* out) {
  using L = KLayout<KIND>;
  KInts v;
  for (int64_t sb = 0; sb < nsb; sb++)
    for (int i = 0; i < GROUP; i++) {
      file_decode<KIND>(raw + i * row_bytes + sb * L::FB, v);
      record_put<KIND>(v, i, out + sb * L::RB);
    }
}

template <int KIND>
void kunpack_group(const uint8_t* packed, int64_t nsb, int64_t row_bytes, uint8_t* raw) {
  using L = KLayout<KIND>;
  KInts v;
  for (int64_t sb = 0; sb < nsb; sb++)
    for (int i = 0; i < GROUP; i++) {
      record_get<KIND>(packed + sb * L::RB, i, v);
      file_encode<KIND>(v, raw + i * row_bytes + sb * L::FB);
    }
}

template <int KIND>
void kdequantize_row(const uint8_t* w, int64_t in, float* out) {
  using L = KLayout<KIND>;
  KInts v;
  for (int64_t sb = 0; sb < in / L::S; sb++) {
    file_decode<KIND>(w + sb * L::FB, v);
    ints_dequantize<KIND>(v, out + sb * L::S);
  }
}

// The five types' functions by kind.
struct KFunctions {
  void (*product)(const float*, int64_t, int64_t, const uint8_t*, int64_t, float*);
  void (*pack)(const uint8_t*, int64_t, int64_t, uint8_t*);
  void (*unpack)(const uint8_t*, int64_t, int64_t, uint8_t*);
  void (*dequantize)(const uint8_t*, int64_t, float*);
};

template <int KIND>
constexpr KFunctions kfunctions_of() {
  return {kpacked_product<KIND>, kpack_group<KIND>, kunpack_group<KIND>, kdequantize_row<KIND>};
}

inline KFunctions kfunctions(int64_t kind) {
  switch (kind) {
    case Q5_0: return kfunctions_of<Q5_0>();
    case Q5_1: return kfunctions_of<Q5_1>();
    case Q4_K: return kfunctions_of<Q4_K>();
    case Q5_K: return kfunctions_of<Q5_K>();
    case Q6_K: return kfunctions_of<Q6_K>();
  }
  TORCH_CHECK(false, "unsupported block type ", kind);
}

}  // namespace
