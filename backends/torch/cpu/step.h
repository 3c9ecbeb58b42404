// The decode step in one call (backends/torch/cpu/kernels.cpp includes this file after its products,
// which the step's Linears use): norms, rotary, attention over the paged KV pool, activations.
// Kept apart from the products so each file keeps to one job; built as one unit with them.

#pragma once

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
  // rows stacked from matrices of different block types (Step::set_parts), in place of w
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> part_kinds;

  // rows from `prompt_from` on: a prompt piece's tokens (mm)
  torch::Tensor operator()(const torch::Tensor& x, int64_t prompt_from) const {
    torch::Tensor y;
    if (!parts.empty()) {
      std::vector<torch::Tensor> ys;
      for (size_t i = 0; i < parts.size(); i++) ys.push_back(mm(x, parts[i], part_kinds[i], in, prompt_from));
      y = torch::cat(ys, 1);
    } else {
      y = kind < 0 ? at::linear(x, w) : mm(x, w, kind, in, prompt_from);
    }
    if (b.defined()) y.add_(b);
    return y;
  }
};

struct Block {
  torch::Tensor norm1_w, norm1_b, norm2_w, norm2_b, q_norm, k_norm;
  torch::Tensor attention_out_norm, mlp_out_norm;  // Gemma 3: RMSNorms of each output before the residual
  Linear in, out, up, down;
  int64_t window = 0;  // 0: none
  int64_t rope = 0;    // which of forward's rotary tables turns q and k (Gemma 3: per layer kind); -1: none (NoPE)
};

template <typename F>
void rows_parallel(int64_t n, int64_t grain, const F& f) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) f(i);
  });
}

inline torch::Tensor maybe(const c10::optional<torch::Tensor>& t) { return t.has_value() ? *t : torch::Tensor(); }

}  // namespace

#if defined(__AVX512F__)
// -- attention's lanes: 16 (AVX-512) or 8 (AVX2) ------------------------------------------------
//
// What `attend` (below) needs of a register width: its operations, a sum across lanes (each
// lane's sum stays one key's) and the softmax with a polynomial exp (Cephes' expf, within 2 ulp).
// Every row takes the same steps whatever else is in the call.

inline __m512 sum_lanes16(__m512* a) {  // lane j: the sum of a[j]'s lanes
  __m512 b[8], c[4];
  for (int i = 0; i < 8; i++)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xee));
  const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, 0x88), _mm512_shuffle_f32x4(f01, f23, 0xdd));
}

inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The lane width's operations, for `attend` below.
struct Lanes16 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V sum_lanes(V* a) { return sum_lanes16(a); }
  // for `attend_run` (below): a lane mask, lanes kept where it is set, the rest zero or -inf
  using M = __mmask16;
  static constexpr int QV = 2, RB = 8;  // its tile: QV vectors of queries, RB columns (or dims) a pass
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V a) { return exp16(a); }
  static M within(V low, V c, V high) {
    return _mm512_cmp_ps_mask(low, c, _CMP_LE_OQ) & _mm512_cmp_ps_mask(c, high, _CMP_LE_OQ);
  }
  static V keep(M m, V a, V otherwise) { return _mm512_mask_blend_ps(m, otherwise, a); }

  // s[j] = exp(s[j] - max s) over n columns, in masked 16s; returns 1 / their sum
  static float softmax(float* s, int64_t n) {
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
      top16 = _mm512_mask_max_ps(top16, m, top16, _mm512_maskz_loadu_ps(m, s + j));
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(top16));
    __m512 total16 = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top));
      _mm512_mask_storeu_ps(s + j, m, e);
      total16 = _mm512_mask_add_ps(total16, m, total16, e);
    }
    return 1.f / _mm512_reduce_add_ps(total16);
  }
};
using Lanes = Lanes16;
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 without AVX-512: exp8 is exp16's polynomial, 2^n made in the exponent's bits.

inline __m256 sum_lanes8(const __m256* a) {  // lane j: the sum of a[j]'s lanes
  const __m256 c0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 c1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // n in [-126, 128]: 2^n as a float's exponent bits (128 gives infinity, as exp overflows)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

struct Lanes8 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V sum_lanes(V* a) { return sum_lanes8(a); }
  using M = __m256;  // as Lanes16's, a mask of all-ones lanes
  static constexpr int QV = 2, RB = 4;  // 16 registers: RB x QV sums, QV queries, a broadcast
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V a) { return exp8(a); }
  static M within(V low, V c, V high) {
    return _mm256_and_ps(_mm256_cmp_ps(low, c, _CMP_LE_OQ), _mm256_cmp_ps(c, high, _CMP_LE_OQ));
  }
  static V keep(M m, V a, V otherwise) { return _mm256_blendv_ps(otherwise, a, m); }

  // as Lanes16's, in whole 8s and then the last columns through exp8 too
  static float softmax(float* s, int64_t n) {
    alignas(32) float lane[8];
    const int64_t whole = n - n % 8;
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < whole; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
    _mm256_store_ps(lane, top8);
    float top = lane[0];
    for (int j = 1; j < 8; j++) top = std::fmax(top, lane[j]);
    for (int64_t j = whole; j < n; j++) top = std::fmax(top, s[j]);
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < whole; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
      _mm256_storeu_ps(s + j, e);
      total8 = _mm256_add_ps(total8, e);
    }
    _mm256_store_ps(lane, total8);
    float total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    if (whole < n) {
      for (int j = 0; j < 8; j++) lane[j] = whole + j < n ? s[whole + j] - top : -87.3f;
      _mm256_store_ps(lane, exp8(_mm256_load_ps(lane)));
      for (int64_t j = whole; j < n; j++) total += s[j] = lane[j - whole];
    }
    return 1.f / total;
  }
};
using Lanes = Lanes8;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PHI2_LANES 1
// One query row's heads of a key-value group over its columns [first, last], for head dims of
// CH x W: W keys' dot products at a time in W registers, summed across lanes together; the
// softmax (Lanes::softmax); the values summed into registers in column order. scores
// [group][n]; pages: the row's page ids; keys(page) / values(page): a page's first column.
template <typename L, int CH, typename Keys, typename Values>
inline void attend(const float* q0, int64_t group, int64_t first, int64_t last, const int64_t* pages, float scale,
                   float* scores, float* out, const Keys& keys, const Values& values) {
  constexpr int W = L::W;
  constexpr int64_t HD = CH * W, P = 16;
  const int64_t n = last - first + 1;
  alignas(64) float lane[W];
  for (int64_t start = first - first % P; start <= last; start += P) {  // every page the row covers
    const float* page = keys(pages[start / P]);
    for (int64_t part = start; part < start + P && part <= last; part += W) {  // W keys at a time
      if (part + W - 1 < first) continue;
      const float* column = page + (part - start) * HD;
      for (int64_t g = 0; g < group; g++) {
        const float* q = q0 + g * HD;
        typename L::V acc[W];
        for (int j = 0; j < W; j++) acc[j] = L::zero();
        for (int c = 0; c < CH; c++) {
          const typename L::V qc = L::load(q + W * c);
          for (int j = 0; j < W; j++) acc[j] = L::fmadd(qc, L::load(column + j * HD + W * c), acc[j]);
        }
        L::store(lane, L::mul(L::sum_lanes(acc), L::set1(scale)));
        const int64_t from = std::max(part, first), to = std::min(part + W - 1, last);
        for (int64_t col = from; col <= to; col++) scores[g * n + (col - first)] = lane[col - part];
      }
    }
  }
  for (int64_t g = 0; g < group; g++) {
    float* s = scores + g * n;
    const typename L::V inverse = L::set1(L::softmax(s, n));
    typename L::V o[CH];
    for (int c = 0; c < CH; c++) o[c] = L::zero();
    for (int64_t start = first - first % P; start <= last; start += P) {
      const float* page = values(pages[start / P]);
      const int64_t from = std::max(start, first), to = std::min(start + P - 1, last);
      for (int64_t col = from; col <= to; col++) {
        const typename L::V p = L::set1(s[col - first]);
        const float* v = page + (col - start) * HD;
        for (int c = 0; c < CH; c++) o[c] = L::fmadd(p, L::load(v + W * c), o[c]);
      }
    }
    for (int c = 0; c < CH; c++) L::store(out + g * HD + W * c, L::mul(o[c], inverse));
  }
}

// attend for the head dims served (multiples of 16, up to 128); false for another
template <typename L, typename Keys, typename Values>
inline bool attend_dims(int64_t head_dim, const float* q0, int64_t group, int64_t first, int64_t last,
                        const int64_t* pages, float scale, float* scores, float* out, const Keys& keys,
                        const Values& values) {
  switch (head_dim) {
    case 16: attend<L, 16 / L::W>(q0, group, first, last, pages, scale, scores, out, keys, values); return true;
    case 32: attend<L, 32 / L::W>(q0, group, first, last, pages, scale, scores, out, keys, values); return true;
    case 64: attend<L, 64 / L::W>(q0, group, first, last, pages, scale, scores, out, keys, values); return true;
    case 80: attend<L, 80 / L::W>(q0, group, first, last, pages, scale, scores, out, keys, values); return true;
    case 96: attend<L, 96 / L::W>(q0, group, first, last, pages, scale, scores, out, keys, values); return true;
    case 128: attend<L, 128 / L::W>(q0, group, first, last, pages, scale, scores, out, keys, values); return true;
  }
  return false;
}

// A tile of a prompt piece's query vectors (T = QV x W of them: its rows' heads of one key-value
// group, a query a lane) over columns [lo, hi], flash attention's way: blocks of TB columns from
// a multiple of TB, each block's keys and values read once for the whole tile (per-row attention
// read every column again for each query: a long prompt's cost went with the columns' bytes,
// not its products). Scores come out a column by T queries (RB columns a pass, a key's dims
// broadcast against the queries' transposed, qt [HD][T]), the softmax runs online a query a
// lane over its own columns [firsts, lasts] (others take p = 0 and leave its sums as they were:
// a block's running max does not move, exp(0) is exactly 1), and p times the values sums into
// ot [HD][T], RB dims a pass, the columns in order. So a query's output depends on its own row
// and its owner's columns only, never on the tile's company or where a piece was cut. keys(c),
// values(c): column c's first element (a page's columns follow it: RB divides PAGE).
template <typename L, typename Keys, typename Values>
inline void attend_tile(int64_t HD, const float* qt, const float* firsts, const float* lasts, int64_t lo, int64_t hi,
                        float scale, float* work, const Keys& keys, const Values& values) {
  using V = typename L::V;
  constexpr int W = L::W, QV = L::QV, RB = L::RB, T = QV * W;
  constexpr int64_t TB = 64;
  float* S = work;         // [TB][T]: a block's scores, then its p
  float* ot = S + TB * T;  // [HD][T]
  std::fill(ot, ot + HD * T, 0.f);
  V m[QV], l[QV], first[QV], last[QV];
  for (int v = 0; v < QV; v++) {
    m[v] = L::set1(-INFINITY), l[v] = L::zero();
    first[v] = L::load(firsts + v * W), last[v] = L::load(lasts + v * W);
  }
  const V vscale = L::set1(scale);
  const float* rows[TB];
  for (int64_t bs = lo / TB * TB; bs <= hi; bs += TB) {
    const int64_t be = std::min(bs + TB - 1, hi);
    for (int64_t c0 = bs; c0 <= be; c0 += RB) {  // RB columns' scores at a time, from one page
      const float* k = keys(c0);
      V acc[RB][QV];
      for (int r = 0; r < RB; r++)
        for (int v = 0; v < QV; v++) acc[r][v] = L::zero();
      for (int64_t d = 0; d < HD; d++) {
        V q[QV];
        for (int v = 0; v < QV; v++) q[v] = L::load(qt + d * T + v * W);
        for (int r = 0; r < RB; r++) {
          const V kb = L::set1(k[r * HD + d]);  // (columns past be: masked below)
          for (int v = 0; v < QV; v++) acc[r][v] = L::fmadd(kb, q[v], acc[r][v]);
        }
      }
      for (int r = 0; r < RB; r++)
        for (int v = 0; v < QV; v++) L::store(S + (c0 - bs + r) * T + v * W, L::mul(acc[r][v], vscale));
    }
    V top[QV], alpha[QV], sum[QV];
    for (int v = 0; v < QV; v++) top[v] = m[v], sum[v] = L::zero();
    for (int64_t c = bs; c <= be; c++) {
      const V cv = L::set1((float)c);
      for (int v = 0; v < QV; v++) {
        const V s = L::keep(L::within(first[v], cv, last[v]), L::load(S + (c - bs) * T + v * W), L::set1(-INFINITY));
        top[v] = L::max(top[v], s);
      }
    }
    for (int64_t c = bs; c <= be; c++) {
      const V cv = L::set1((float)c);
      for (int v = 0; v < QV; v++) {
        float* at = S + (c - bs) * T + v * W;
        const V p = L::keep(L::within(first[v], cv, last[v]), L::exp(L::sub(L::load(at), top[v])), L::zero());
        L::store(at, p);
        sum[v] = L::add(sum[v], p);
      }
      rows[c - bs] = values(c);
    }
    for (int v = 0; v < QV; v++) {
      alpha[v] = L::exp(L::sub(m[v], top[v]));  // 1 where the max stays; o and l are 0 before any column
      l[v] = L::add(L::mul(l[v], alpha[v]), sum[v]);
      m[v] = top[v];
    }
    for (int64_t d0 = 0; d0 < HD; d0 += RB) {  // p v, RB dims at a time
      V acc[RB][QV];
      for (int r = 0; r < RB; r++)
        for (int v = 0; v < QV; v++) acc[r][v] = L::mul(L::load(ot + (d0 + r) * T + v * W), alpha[v]);
      for (int64_t c = bs; c <= be; c++) {
        V p[QV];
        for (int v = 0; v < QV; v++) p[v] = L::load(S + (c - bs) * T + v * W);
        const float* value = rows[c - bs] + d0;
        for (int r = 0; r < RB; r++) {
          const V vb = L::set1(value[r]);
          for (int v = 0; v < QV; v++) acc[r][v] = L::fmadd(vb, p[v], acc[r][v]);
        }
      }
      for (int r = 0; r < RB; r++)
        for (int v = 0; v < QV; v++) L::store(ot + (d0 + r) * T + v * W, acc[r][v]);
    }
  }
  for (int v = 0; v < QV; v++) L::store(S + v * W, l[v]);  // the sums, for the caller's division
}
#endif


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
                 c10::optional<torch::Tensor> k_norm, int64_t window, int64_t rope,
                 c10::optional<torch::Tensor> attention_out_norm, c10::optional<torch::Tensor> mlp_out_norm) {
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
    b.rope = rope;
    b.attention_out_norm = maybe(attention_out_norm);
    b.mlp_out_norm = maybe(mlp_out_norm);
    blocks_.push_back(b);
  }

  // Block `layer`'s matrix `which` (0 in, 1 out, 2 up, 3 down) as rows of matrices in different
  // block types, stacked (torch/quant/blocks.py: StackedBlocks): a product each, side by side.
  void set_parts(int64_t layer, int64_t which, std::vector<torch::Tensor> ws, std::vector<int64_t> kinds) {
    TORCH_CHECK(layer < (int64_t)blocks_.size() && which >= 0 && which < 4 && ws.size() == kinds.size());
    Block& b = blocks_[layer];
    Linear& l = which == 0 ? b.in : which == 1 ? b.out : which == 2 ? b.up : b.down;
    l.parts = ws;
    l.part_kinds = kinds;
  }

  // x [n, hidden] float32: the embeddings of n tokens, through every block. Token i sits at
  // positions[i] of the sequence whose pages are row owners[i] of table ([rows, width] int64 page
  // ids); with advance[i] 0 it idles (nothing written, its output undefined). Every token's key
  // and value are written before any attends, so the tokens of a prompt piece (one owner,
  // consecutive positions) attend causally, as decode rows do; each token's output depends on
  // its own row and its owner's columns only, never on the others in the call.
  // kv [2, layers, kv_heads, pages, PAGE, head_dim]; cos, sin [tables, positions, rotary_dim] (sin
  // sign-folded, as backends/torch_model.rope_; a block's `rope` picks its table).
  // Rows from `prompt_from` on are a prompt's tokens: their products may take AMX-BF16's tiles
  // (cpu_kernels.cpp's `mm`); the rows before it (decode rows, a draft's) the exact ones.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor owners, torch::Tensor advance,
                        torch::Tensor table, torch::Tensor kv, torch::Tensor cos, torch::Tensor sin,
                        int64_t prompt_from) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && kv.dtype() == torch::kFloat32 && kv.is_contiguous());
    TORCH_CHECK(table.dtype() == torch::kInt64 && table.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
    TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(2) == rotary_dim_);
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
      auto y = b.in(h, prompt_from);  // [batch, q + 2 kv (+ inner)]
      place(y, b, layer, batch, pos, own, adv, table, kv, cos, sin);
      attend(y, b, layer, batch, pos, own, adv, table, kv, attention, prompt_from);
      if (parallel_) {
        auto mixed = torch::empty({batch, q_size + inner_}, x.options());
        mixed.narrow(1, 0, q_size).copy_(attention);
        auto act = mixed.narrow(1, q_size, inner_);
        act.copy_(y.narrow(1, q_size + 2 * kv_size, inner_));
        activate(act);
        x.add_(b.out(mixed, prompt_from));
      } else {
        auto o = b.out(attention, prompt_from);
        x.add_(b.attention_out_norm.defined() ? norm(o, b.attention_out_norm, {}) : o);
        auto u = b.up(norm(x, b.norm2_w, b.norm2_b), prompt_from);
        torch::Tensor g;
        if (gated_) {
          g = u.narrow(1, 0, inner_).contiguous();
          activate(g);
          g.mul_(u.narrow(1, inner_, inner_));
        } else {
          g = u;
          activate(g);
        }
        auto d = b.down(g, prompt_from);
        x.add_(b.mlp_out_norm.defined() ? norm(d, b.mlp_out_norm, {}) : d);
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

  // The first column a token at `position` attends to: its window's, or the sequence's first.
  static int64_t first_column(const Block& b, int64_t position) {
    return b.window > 0 ? std::max<int64_t>(0, position - b.window + 1) : 0;
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
      const int64_t at = (std::max<int64_t>(b.rope, 0) * cos.size(1) + pos[r]) * rotary_dim_;
      const float* c = cos.data_ptr<float>() + at;
      const float* s = sin.data_ptr<float>() + at;
      for (int64_t head = 0; head < heads_; head++) {
        if (b.q_norm.defined()) head_norm(q + head * head_dim_, b.q_norm.data_ptr<float>());
        if (b.rope >= 0) rope(q + head * head_dim_, c, s);
      }
      const int64_t page = table.data_ptr<int64_t>()[own[r] * table_width + pos[r] / PAGE], offset = pos[r] % PAGE;
      for (int64_t head = 0; head < kv_heads_; head++) {
        if (b.k_norm.defined()) head_norm(k + head * head_dim_, b.k_norm.data_ptr<float>());
        if (b.rope >= 0) rope(k + head * head_dim_, c, s);
        std::memcpy(column(kv, 0, layer, head, page, offset), k + head * head_dim_, head_dim_ * sizeof(float));
        std::memcpy(column(kv, 1, layer, head, page, offset), v + head * head_dim_, head_dim_ * sizeof(float));
      }
    }
  }

#ifdef PHI2_AMX_BF16
  // A prompt piece's tokens in AMX-BF16 tiles (rows from `from` on: runs of one owner's
  // consecutive positions), 16 query rows at a time (a token's heads of the group, token by
  // token). For each run and key-value head, its keys (row-major) and values (transposed) up to
  // the run's last position are rounded to bfloat16 once. Scores come out column by row (tile A
  // the keys, B the queries), so the softmax runs with a row in each lane, in float32 over the
  // row's own columns (its window's); p, rounded to bfloat16, is then B of the value product
  // (A the values transposed), over the columns in blocks of 32. Every row's output depends on
  // its own query and its owner's columns only: a score is one tile element, its lane's sums run
  // over the columns in order, and a column a row may not see takes p = 0, which adds nothing,
  // so the piece's size and company never change it, as with the products' tiles.
  void attend_tiles(const torch::Tensor& y, const Block& b, size_t layer, int64_t from, int64_t batch,
                    const int64_t* pos, const int64_t* own, const int64_t* adv, const torch::Tensor& table,
                    const torch::Tensor& kv, torch::Tensor& attention) const {
    const int64_t HD = head_dim_, width = y.size(1), group = heads_ / kv_heads_, table_width = table.size(1);
    // q and k padded with zeros to whole 32s of head dims (Phi-2's 80: 96), which add nothing
    const int64_t steps = (HD + 31) / 32, padded = 32 * steps, chunks = HD / 16;
    auto halves = [HD](const float* x, int64_t d) {  // x[d..d+31] in bfloat16, zeros past HD
      const __mmask16 low = HD - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (HD - d)) - 1);
      const __mmask16 high = HD - d >= 32 ? (__mmask16)0xffff : HD - d > 16 ? (__mmask16)((1u << (HD - d - 16)) - 1) : 0;
      return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, x + d + 16), _mm512_maskz_loadu_ps(low, x + d));
    };
    const float scale = 1.f / std::sqrt((float)HD);
    const float* yp = y.data_ptr<float>();
    float* ap = attention.data_ptr<float>();
    const int64_t* tp = table.data_ptr<int64_t>();
    struct Run {
      int64_t start, end, lo, n;  // rows [start, end); columns lo (a multiple of 32) .. lo + n - 1 (n: 32s)
    };
    std::vector<Run> runs;
    for (int64_t r = from; r < batch;) {
      int64_t e = r + 1;
      while (adv[r] && e < batch && adv[e] && own[e] == own[r] && pos[e] == pos[e - 1] + 1) e++;
      const int64_t lo = first_column(b, pos[r]) / 32 * 32;
      runs.push_back({r, e, lo, (pos[e - 1] + 32) / 32 * 32 - lo});
      r = e;
    }
    const int64_t nr = (int64_t)runs.size();
    // keys[run * kv_heads + head]: [n][padded]; values: [HD][n]; bfloat16, zeros past the run's last column
    std::vector<std::vector<uint16_t>> keys(nr * kv_heads_), values(nr * kv_heads_);
    rows_parallel(nr * kv_heads_, 1, [&](int64_t item) {
      const Run& run = runs[item / kv_heads_];
      const int64_t head = item % kv_heads_, last = pos[run.end - 1];
      if (!adv[run.start]) return;
      const int64_t* pages = tp + own[run.start] * table_width;
      std::vector<uint16_t>& k = keys[item];
      std::vector<uint16_t>& v = values[item];
      k.assign(run.n * padded, 0);
      v.assign(HD * run.n, 0);
      for (int64_t c = run.lo; c <= last; c++) {
        const float* key = column(kv, 0, layer, head, pages[c / PAGE], c % PAGE);
        const float* value = column(kv, 1, layer, head, pages[c / PAGE], c % PAGE);
        const int64_t j = c - run.lo;
        for (int64_t d = 0; d < HD; d += 32) {
          _mm512_storeu_si512((void*)(k.data() + j * padded + d), halves(key, d));
          alignas(64) uint16_t w[32];
          _mm512_store_si512((void*)w, halves(value, d));
          for (int64_t i = 0; i < std::min<int64_t>(32, HD - d); i++) v[(d + i) * run.n + j] = w[i];
        }
      }
    });
    std::vector<std::array<int64_t, 3>> items;  // run, head, first query row (of the run's rows x group)
    for (int64_t i = 0; i < nr; i++)
      for (int64_t head = 0; head < kv_heads_; head++)
        for (int64_t t = 0; t < (runs[i].end - runs[i].start) * group; t += 16) items.push_back({i, head, t});
    // [e0 of rows 0-15 | e1 of rows 0-15] -> pairs (e0, e1) row by row: B's layout for p
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t begin, int64_t end) {
      configure_bf16_tiles();
      thread_local std::vector<float> scores;     // [n][16 rows]
      thread_local std::vector<uint16_t> probabilities;  // [n / 2][16 rows][2]
      alignas(64) uint16_t q[4][16 * 32];  // B: per 32 head dims, [16 dim pairs][16 rows][2]
      alignas(64) float c[16 * 16];
      alignas(64) int32_t firsts[16], lasts[16];
      for (int64_t it = begin; it < end; it++) {
        const Run& run = runs[items[it][0]];
        const int64_t head = items[it][1], t0 = items[it][2], n = run.n;
        const int64_t rows = std::min<int64_t>(16, (run.end - run.start) * group - t0);
        auto out_of = [&](int64_t i) {
          const int64_t r = run.start + (t0 + i) / group, g = (t0 + i) % group;
          return ap + r * heads_ * HD + (head * group + g) * HD;
        };
        if (!adv[run.start]) {
          for (int64_t i = 0; i < rows; i++) std::memset(out_of(i), 0, HD * sizeof(float));
          continue;
        }
        const uint16_t* k = keys[items[it][0] * kv_heads_ + head].data();
        const uint16_t* v = values[items[it][0] * kv_heads_ + head].data();
        if ((int64_t)scores.size() < 16 * n) scores.resize(16 * n);
        if ((int64_t)probabilities.size() < 16 * n) probabilities.resize(16 * n);
        std::memset(q, 0, sizeof(q));
        for (int64_t i = 0; i < 16; i++) {
          firsts[i] = 1, lasts[i] = 0;  // rows past the run's: no column
          if (i >= rows) continue;
          const int64_t r = run.start + (t0 + i) / group, g = (t0 + i) % group;
          firsts[i] = (int32_t)(first_column(b, pos[r]) - run.lo);
          lasts[i] = (int32_t)(pos[r] - run.lo);
          const float* qr = yp + r * width + (head * group + g) * HD;
          for (int64_t d = 0; d < HD; d += 32) {
            alignas(64) uint16_t w[32];
            _mm512_store_si512((void*)w, halves(qr, d));
            for (int pair = 0; pair < 16; pair++) {
              q[d / 32][pair * 32 + 2 * i] = w[2 * pair];
              q[d / 32][pair * 32 + 2 * i + 1] = w[2 * pair + 1];
            }
          }
        }
        for (int64_t chunk = 0; chunk < n / 16; chunk++) {  // scores [16 columns][16 rows] a tile
          _tile_zero(0);
          for (int64_t step = 0; step < steps; step++) {
            _tile_loadd(4, k + chunk * 16 * padded + 32 * step, padded * 2);
            _tile_loadd(6, q[step], 64);
            _tile_dpbf16ps(0, 4, 6);
          }
          _tile_stored(0, scores.data() + chunk * 256, 64);
        }
        // the softmax, a row in each lane
        const __m512i first = _mm512_load_si512((const void*)firsts), last = _mm512_load_si512((const void*)lasts);
        const __m512 vscale = _mm512_set1_ps(scale);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j++) {
          const __m512i jj = _mm512_set1_epi32((int32_t)j);
          const __mmask16 valid = _mm512_cmple_epi32_mask(first, jj) & _mm512_cmpge_epi32_mask(last, jj);
          top = _mm512_mask_max_ps(top, valid, top, _mm512_mul_ps(_mm512_load_ps(scores.data() + 16 * j), vscale));
        }
        __m512 total = _mm512_setzero_ps();
        uint16_t* p = probabilities.data();
        for (int64_t j = 0; j < n; j += 2) {
          __m512 e[2];
          for (int u = 0; u < 2; u++) {
            const __m512i jj = _mm512_set1_epi32((int32_t)(j + u));
            const __mmask16 valid = _mm512_cmple_epi32_mask(first, jj) & _mm512_cmpge_epi32_mask(last, jj);
            const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_load_ps(scores.data() + 16 * (j + u)), vscale), top);
            e[u] = _mm512_maskz_mov_ps(valid, exp16(_mm512_maskz_mov_ps(valid, x)));
          }
          const __m512bh h = _mm512_cvtne2ps_pbh(e[1], e[0]);  // rounded as the tiles will take them
          total = _mm512_add_ps(total, _mm512_cvtpbh_ps((__m256bh)_mm512_castsi512_si256((__m512i)h)));
          total = _mm512_add_ps(total, _mm512_cvtpbh_ps((__m256bh)_mm512_extracti64x4_epi64((__m512i)h, 1)));
          _mm512_storeu_si512((void*)(p + 16 * j), _mm512_permutexvar_epi16(pairs, (__m512i)h));
        }
        alignas(64) float inverse[16];
        _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.f), total));
        for (int64_t chunk = 0; chunk < chunks; chunk++) {  // p v: [16 outputs][16 rows] a tile
          _tile_zero(0);
          for (int64_t block = 0; block < n / 32; block++) {
            _tile_loadd(4, v + chunk * 16 * n + 32 * block, n * 2);
            _tile_loadd(6, p + 16 * 32 * block, 64);
            _tile_dpbf16ps(0, 4, 6);
          }
          _tile_stored(0, c, 64);
          for (int64_t i = 0; i < rows; i++) {
            float* out = out_of(i) + 16 * chunk;
            for (int64_t o = 0; o < 16; o++) out[o] = c[16 * o + i] * inverse[i];
          }
        }
      }
      _tile_release();
    });
  }
#endif

#ifdef PHI2_LANES
  // A prompt piece's tokens (rows from `from` on: runs of one owner's consecutive positions) in
  // float32 tiles (`attend_tile`): per run and key-value head, its rows' query heads, T at a time.
  void attend_runs(const torch::Tensor& y, const Block& b, size_t layer, int64_t from, int64_t batch,
                   const int64_t* pos, const int64_t* own, const int64_t* adv, const torch::Tensor& table,
                   const torch::Tensor& kv, torch::Tensor& attention) const {
    constexpr int64_t T = Lanes::QV * Lanes::W, TB = 64;
    const int64_t HD = head_dim_, width = y.size(1), group = heads_ / kv_heads_, table_width = table.size(1);
    const float scale = 1.f / std::sqrt((float)HD);
    const float* yp = y.data_ptr<float>();
    float* ap = attention.data_ptr<float>();
    const int64_t* tp = table.data_ptr<int64_t>();
    std::vector<std::array<int64_t, 2>> runs;  // rows [start, end)
    for (int64_t r = from; r < batch;) {
      int64_t e = r + 1;
      while (adv[r] && e < batch && adv[e] && own[e] == own[r] && pos[e] == pos[e - 1] + 1) e++;
      runs.push_back({r, e});
      r = e;
    }
    std::vector<std::array<int64_t, 3>> items;  // head, run, first query (of the run's rows x group)
    for (int64_t head = 0; head < kv_heads_; head++)  // head by head: a thread's items share its columns
      for (int64_t i = 0; i < (int64_t)runs.size(); i++)
        for (int64_t t = 0; t < (runs[i][1] - runs[i][0]) * group; t += T) items.push_back({head, i, t});
    at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> buffer;
      if ((int64_t)buffer.size() < (TB + 2 * HD) * T) buffer.resize((TB + 2 * HD) * T);
      float* qt = buffer.data();  // [HD][T]
      float* work = qt + HD * T;  // attend_tile's
      alignas(64) float firsts[T], lasts[T];
      for (int64_t it = begin; it < end; it++) {
        const int64_t head = items[it][0], start = runs[items[it][1]][0], stop = runs[items[it][1]][1];
        const int64_t t0 = items[it][2], count = std::min<int64_t>(T, (stop - start) * group - t0);
        auto row_of = [&](int64_t i) { return start + (t0 + i) / group; };
        auto offset_of = [&](int64_t i) { return (head * group + (t0 + i) % group) * HD; };
        if (!adv[start]) {
          for (int64_t i = 0; i < count; i++) std::memset(ap + row_of(i) * heads_ * HD + offset_of(i), 0, HD * sizeof(float));
          continue;
        }
        int64_t lo = INT64_MAX, hi = 0;
        for (int64_t i = 0; i < T; i++) {
          firsts[i] = 1.f, lasts[i] = 0.f;  // lanes past the run's: no column
          if (i >= count) {
            for (int64_t d = 0; d < HD; d++) qt[d * T + i] = 0.f;
            continue;
          }
          const int64_t r = row_of(i), first = first_column(b, pos[r]);
          firsts[i] = (float)first, lasts[i] = (float)pos[r];
          lo = std::min(lo, first), hi = std::max(hi, pos[r]);
          const float* q = yp + r * width + offset_of(i);
          for (int64_t d = 0; d < HD; d++) qt[d * T + i] = q[d];
        }
        const int64_t* pages = tp + own[start] * table_width;
        const auto keys = [&](int64_t c) { return column(kv, 0, layer, head, pages[c / PAGE], c % PAGE); };
        const auto values = [&](int64_t c) { return column(kv, 1, layer, head, pages[c / PAGE], c % PAGE); };
        attend_tile<Lanes>(HD, qt, firsts, lasts, lo, hi, scale, work, keys, values);
        const float* ot = work + TB * T;
        for (int64_t i = 0; i < count; i++) {
          const float inverse = 1.f / work[i];
          float* out = ap + row_of(i) * heads_ * HD + offset_of(i);
          for (int64_t d = 0; d < HD; d++) out[d] = ot[d * T + i] * inverse;
        }
      }
    });
  }
#endif


  // Each decoding row's query heads over its columns (its window's), a key-value head's group at a time.
  void attend(const torch::Tensor& y, const Block& b, size_t layer, int64_t batch, const int64_t* pos,
              const int64_t* own, const int64_t* adv, const torch::Tensor& table, const torch::Tensor& kv,
              torch::Tensor& attention, int64_t prompt_from) const {
    const int64_t width = y.size(1), group = heads_ / kv_heads_, table_width = table.size(1);
#ifdef PHI2_AMX_BF16
    // A prompt's tokens (rows from prompt_from on) take AMX-BF16 tiles where the products do
    // (block weights, packed: mm's prompt_from).
    const bool tiles = b.in.kind >= PACKED && prompt_tiles() && head_dim_ % 16 == 0 && head_dim_ <= 128;
    const int64_t exact = tiles ? std::clamp<int64_t>(prompt_from, 0, batch) : batch;
    if (exact < batch) attend_tiles(y, b, layer, exact, batch, pos, own, adv, table, kv, attention);
    batch = exact;
#endif
#ifdef PHI2_LANES
    // A prompt's tokens otherwise take float32 tiles (`attend_runs`), head dims of whole RBs.
    const int64_t runs_from = head_dim_ % Lanes::RB == 0 ? std::clamp<int64_t>(prompt_from, 0, batch) : batch;
    if (runs_from < batch) attend_runs(y, b, layer, runs_from, batch, pos, own, adv, table, kv, attention);
    batch = runs_from;
#endif
    const float scale = 1.f / std::sqrt((float)head_dim_);
    const float* yp = y.data_ptr<float>();
    float* ap = attention.data_ptr<float>();
    const int64_t* tp = table.data_ptr<int64_t>();
    // Head by head, so a thread's run of items reads one key-value head's columns over and over
    // (a prompt piece's rows share them: in L2, where row by row every head's went through
    // memory again for each row, 8x slower for a Phi-2 prompt); within a head, rows in zigzag
    // order (first, last, second, second last, ...): a piece's later rows attend to more
    // columns, and each thread takes a contiguous run of items.
    rows_parallel(batch * kv_heads_, 1, [&](int64_t item) {
      const int64_t i = item % batch, head = item / batch;
      const int64_t r = i % 2 == 0 ? i / 2 : batch - 1 - i / 2;
      float* out = ap + r * heads_ * head_dim_ + head * group * head_dim_;
      if (!adv[r]) {
        std::memset(out, 0, group * head_dim_ * sizeof(float));
        return;
      }
      const int64_t last = pos[r], first = first_column(b, last);
      const int64_t n = last - first + 1;
      thread_local std::vector<float> buffer;
      if ((int64_t)buffer.size() < group * n) buffer.resize(group * n);
      float* scores = buffer.data();
      const int64_t* pages = tp + own[r] * table_width;
      const float* q0 = yp + r * width + head * group * head_dim_;
#ifdef PHI2_LANES
      const auto keys = [&](int64_t page) { return column(kv, 0, layer, head, page, 0); };
      const auto values = [&](int64_t page) { return column(kv, 1, layer, head, page, 0); };
      if (attend_dims<Lanes>(head_dim_, q0, group, first, last, pages, scale, scores, out, keys, values)) return;
#endif
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
      int64_t i = start;
#if defined(__AVX512F__)
      // SiLU z * sigmoid(z) and tanh's GELU z * sigmoid(2u) (0.5 (1 + tanh(u)) = sigmoid(2u)), with
      // the attention's vector exp: libm's tanhf is scalar, and took a sixth of a Phi-2 prompt's time.
      if (activation_ != 2) {
        for (; i < end; i += 16) {
          const __mmask16 m = end - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (end - i)) - 1);
          const __m512 z = _mm512_maskz_loadu_ps(m, v + i);
          __m512 t = z;
          if (activation_ == 1) {
            const __m512 z3 = _mm512_mul_ps(_mm512_mul_ps(z, z), z);
            t = _mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), z3, z));
          }
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), t));
          _mm512_mask_storeu_ps(v + i, m, _mm512_div_ps(z, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if (activation_ != 2) {  // the same in 8 lanes (exp8); the last few below
        for (; i + 8 <= end; i += 8) {
          const __m256 z = _mm256_loadu_ps(v + i);
          __m256 t = z;
          if (activation_ == 1) {
            const __m256 z3 = _mm256_mul_ps(_mm256_mul_ps(z, z), z);
            t = _mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), z3, z));
          }
          const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), t));
          _mm256_storeu_ps(v + i, _mm256_div_ps(z, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
        }
      }
#endif
      for (; i < end; i++) {
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
