// CPU kernels of the engine's decoder step, registered as torch.ops.kvscope_<isa>.*.
//
// One source, three variants, each built by kernels/cpu_build.py into its own library and torch
// op namespace (KVSCOPE_ISA picks one): avx512 (16-wide, AVX512-BF16 dot products where the CPU
// has them), avx2 (8-wide AVX2 + FMA + F16C), generic (portable C++ the compiler vectorises for
// any CPU, arm64 included; no intrinsics). The kernels are written once over the small vector
// layer below (`vf`, W floats wide). Each op does in one
// pass what the torch path does in several, with the same arithmetic: every intermediate that
// the Hugging Face model rounds to the model's dtype is rounded here too (rnd<T>), so fp32
// runs stay token-identical to transformers and bf16 runs stay as close as torch's own ops.
//
//   decode_attention  one query token per sequence, K/V read straight from the blocks through
//                     the block table: no gather copy, no padding (replaces gather + SDPA)
//   prefill_attention causal attention of prompt chunks without a cached prefix, from the step's
//                     own new K/V rows (flash-attention style)
//   rope_store        rotary embedding of q and k in place (after their per-head norms where the
//                     model has them), then k and v into their cache slots
//   rms_norm          out = w * norm(x)
//   add_rms_norm      residual += x; x = w * norm(residual)   (the residual stream, in place;
//                     Gemma: x = pre * norm(x) first)
//   silu_and_mul      out = silu(gate) * up, gate and up the two halves of one [T, 2I] tensor
//   gelu_tanh_and_mul out = gelu_tanh(gate) * up (Gemma)
//   gemv              out = x W^T (+ b) for a few rows of x: the weights streamed once, at the
//                     memory's speed (decode at small batch reads every weight for one token)
//   gemv_pack         weights laid out for gemv to read in one sequential stream (its packed
//                     layout; rows and serial read them as they are)
//   argmax            each row's index of its largest logit (greedy sampling), the row split
//                     across the threads
//   decode_step       every decoder layer of a decode step of 1-4 rows (the ops above, in order) in one
//                     parallel region: its threads start once per step and meet at barriers
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if !defined(KVSCOPE_ISA_AVX512) && !defined(KVSCOPE_ISA_AVX2) && !defined(KVSCOPE_ISA_GENERIC)
#error "build with -DKVSCOPE_ISA_AVX512, -DKVSCOPE_ISA_AVX2 or -DKVSCOPE_ISA_GENERIC (kernels/cpu_build.py does)"
#endif
#if defined(KVSCOPE_ISA_AVX512) || defined(KVSCOPE_ISA_AVX2)
#include <immintrin.h>
#endif
#if defined(KVSCOPE_ISA_AVX512) && defined(__AVX512BF16__)
#define KVSCOPE_DPBF16 1  // bf16 pair dot products (the GEMV's bf16 weights)
#endif

#include <cmath>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <algorithm>
#include <array>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Below this many elements of work an op runs on one thread: a parallel region costs a few
// microseconds on an idle machine and far more when other processes hold the cores.
constexpr int64_t kParallelWork = 32768;
// torch's thread count (torch.set_num_threads), also on threads OpenMP did not start, such as
// the engine server's
inline int threads() { return at::get_num_threads(); }

// Each kernel's loop is an orphaned `omp for`: it splits its iterations over the team of whichever
// parallel region calls it. An op runs its kernel in a region of its own (`in_team`: threads() of
// them when there is enough work, else this thread alone); decode_step runs every kernel of a
// step in one region, so its threads meet at barriers instead of starting once per kernel.
template <typename F>
void in_team(bool parallel, F&& f) {
#pragma omp parallel num_threads(threads()) if (parallel)
  f();
}

// T -> float; float -> T (round to nearest even, as torch); float rounded to T and back.
// bf16 by bit operations, NaN as c10 makes it: c10's own conversion has a branch that keeps
// loops from vectorizing.
template <typename T> inline float f32(T x) { return static_cast<float>(x); }
template <typename T> inline T to(float x) { return static_cast<T>(x); }
template <> inline c10::BFloat16 to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint16_t bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}
template <typename T> inline float rnd(float x) { return f32(to<T>(x)); }

// exp(x) as Cephes' expf (within 2 ulp on [-87, 88]; the result is 2^n * exp(x - n ln 2)) in
// plain arithmetic, so that loops calling it vectorize; std::exp would stay scalar
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// ---------------------------------------------------------------------------- the vector layer
// vf: W floats in a register (two on AVX2: 8 lanes). load(T*) widens W elements of T to float
// (bf16 by a 16-bit shift, fp16 by F16C); sum_lanes(a) turns W vectors into one vector of their W
// horizontal sums; keep(a, n, fill) keeps lanes < n and puts fill in the others, keep_range(a, lo, hi,
// fill) lanes lo <= i < hi.
#if defined(KVSCOPE_ISA_AVX512)
constexpr int W = 16;
using vf = __m512;
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1u);
}
inline vf keep(vf a, int64_t n, float fill) { return _mm512_mask_blend_ps(lanes_below(n), set1(fill), a); }
inline vf keep_range(vf a, int64_t lo, int64_t hi, float fill) {
  return _mm512_mask_blend_ps(__mmask16(lanes_below(hi) & ~lanes_below(lo)), set1(fill), a);
}
inline void store_n(float* p, vf a, int64_t n) { _mm512_mask_storeu_ps(p, lanes_below(n), a); }
inline vf round_nearest(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf exp2_int(vf n) {  // 2^n for integral n in float range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// a transpose-and-add tree (45 operations, where 16 separate horizontal sums take about 130,
// most of them in long dependency chains)
inline vf sum_lanes(const vf* a) {
  __m512 s[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum of each of 4 inputs
    const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // add the 128-bit lanes pairwise, then again
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#elif defined(KVSCOPE_ISA_AVX2)
constexpr int W = 8;
using vf = __m256;
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline float reduce_add(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline __m256 lanes_below(int64_t n) {  // all ones in lanes < n
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(std::max<int64_t>(n, 0), 8))), idx));
}
inline vf keep(vf a, int64_t n, float fill) { return _mm256_blendv_ps(set1(fill), a, lanes_below(n)); }
inline vf keep_range(vf a, int64_t lo, int64_t hi, float fill) {
  return _mm256_blendv_ps(set1(fill), a, _mm256_andnot_ps(lanes_below(lo), lanes_below(hi)));
}
inline void store_n(float* p, vf a, int64_t n) { _mm256_maskstore_ps(p, _mm256_castps_si256(lanes_below(n)), a); }
inline vf round_nearest(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf exp2_int(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// 8 vectors -> their 8 sums: pairwise horizontal adds within 128-bit lanes, then the two lanes
inline vf sum_lanes(const vf* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#else
// portable: fixed-size loops the compiler turns into the target's vector instructions
constexpr int W = 8;
struct vf {
  float x[W];
};
template <typename F>
inline vf each(F&& f) {
  vf r;
#pragma omp simd
  for (int i = 0; i < W; ++i) r.x[i] = f(i);
  return r;
}
inline vf zero() { return each([](int) { return 0.f; }); }
inline vf set1(float v) { return each([=](int) { return v; }); }
template <typename T> inline vf load(const T* p) { return each([=](int i) { return f32(p[i]); }); }
inline void store(float* p, vf a) { std::memcpy(p, a.x, sizeof a.x); }
inline vf add(vf a, vf b) { return each([&](int i) { return a.x[i] + b.x[i]; }); }
inline vf sub(vf a, vf b) { return each([&](int i) { return a.x[i] - b.x[i]; }); }
inline vf mul(vf a, vf b) { return each([&](int i) { return a.x[i] * b.x[i]; }); }
inline vf div(vf a, vf b) { return each([&](int i) { return a.x[i] / b.x[i]; }); }
inline vf fma(vf a, vf b, vf c) { return each([&](int i) { return a.x[i] * b.x[i] + c.x[i]; }); }
inline vf vmax(vf a, vf b) { return each([&](int i) { return std::max(a.x[i], b.x[i]); }); }
inline vf vmin(vf a, vf b) { return each([&](int i) { return std::min(a.x[i], b.x[i]); }); }
inline float reduce_add(vf a) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += a.x[i];
  return s;
}
inline float reduce_max(vf a) {
  float m = a.x[0];
  for (int i = 1; i < W; ++i) m = std::max(m, a.x[i]);
  return m;
}
inline vf keep(vf a, int64_t n, float fill) { return each([&](int i) { return i < n ? a.x[i] : fill; }); }
inline vf keep_range(vf a, int64_t lo, int64_t hi, float fill) {
  return each([&](int i) { return i >= lo && i < hi ? a.x[i] : fill; });
}
inline void store_n(float* p, vf a, int64_t n) {
  for (int i = 0; i < W && i < n; ++i) p[i] = a.x[i];
}
inline vf round_nearest(vf a) { return each([&](int i) { return (a.x[i] + 12582912.f) - 12582912.f; }); }
inline vf exp2_int(vf n) {
  return each([&](int i) {
    const int32_t bits = (static_cast<int32_t>(n.x[i]) + 127) << 23;
    float r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
  });
}
inline vf sum_lanes(const vf* a) { return each([&](int i) { return reduce_add(a[i]); }); }
#endif

// fast_exp on W lanes (the same polynomial)
inline vf exp_lanes(vf x) {
  x = vmin(vmax(x, set1(-87.3f)), set1(88.7f));
  const vf n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vf r = sub(x, mul(n, set1(0.693359375f)));
  r = add(r, mul(n, set1(2.12194440e-4f)));
  vf p = set1(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = add(mul(p, r), set1(c));
  p = add(add(mul(mul(p, r), r), r), set1(1.f));
  return mul(p, exp2_int(n));
}

void check_cpu(const char* what, std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    TORCH_CHECK(t->device().is_cpu(), "kvscope: ", what, " must be CPU tensors");
    TORCH_CHECK(t->stride(-1) == 1, "kvscope: ", what, " must be contiguous in their last dimension");
  }
}

// f(T{}) for the tensor's dtype; the kernels are templates on T
template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "kvscope: ", op, " takes float32, bfloat16 or float16, not ", dtype);
  }
}

// ---------------------------------------------------------------------------- decode attention
// query/out [T, H, D] (rows strided), caches [num_blocks, block_size, KVH, D] contiguous,
// block_tables [B, W] int32, seq_lens [B] int32, rows [B] int64: query row of sequence b.
// One task per (sequence, KV head): its G = H / KVH query heads share every K and V row read.
// Scores, then softmax, then the weighted sum of V, all in float32, walking the block table.

// the scores of G query heads against one K row of D elements, times sc; qf: G x D float32
template <typename T>
inline void dot_rows(const float* qf, float sc, const T* k, int64_t G, int64_t D, float* s, int64_t s_stride) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qg[d] * f32(k[d]);
    s[g * s_stride] = dot * sc;
  }
}

// acc (D floats) += p * v (one V row)
template <typename T>
inline void axpy_row(float* acc, float p, const T* v, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] += p * f32(v[d]);
}

// scores of G heads against n <= W K rows (D = W * DC): s[g * s_stride + i] = sc * q_g . k_i
template <typename T, int DC>
inline void scores_tile(const float* qf, float sc, const T* rows, int64_t c_tok, int n, int64_t G, float* s,
                        int64_t s_stride) {
  vf acc[W];
  alignas(64) float buf[W * W * DC];  // rows in float32, converted once for all G heads
  const float* k = buf;
  int64_t stride = W * DC;
  if constexpr (std::is_same_v<T, float>) {
    k = rows;
    stride = c_tok;
  } else {
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < DC; ++c) store(buf + i * W * DC + W * c, load(rows + i * c_tok + W * c));
  }
  for (int64_t g = 0; g < G; ++g) {
    vf q[DC];
    for (int c = 0; c < DC; ++c) q[c] = load(qf + g * W * DC + W * c);
    for (int i = 0; i < W; ++i) {
      if (i >= n) {
        acc[i] = zero();
        continue;
      }
      acc[i] = mul(q[0], load(k + i * stride));
      for (int c = 1; c < DC; ++c) acc[i] = fma(q[c], load(k + i * stride + W * c), acc[i]);
    }
    store_n(s + g * s_stride, mul(sum_lanes(acc), set1(sc)), n);
  }
}

// the blocks of a table are scattered over the pool, so the hardware cannot guess the next one:
// ask for the next block's rows of this head while the current block is computed
template <typename T>
inline void prefetch_rows(const T* rows, int64_t n, int64_t c_tok, int64_t D) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows + i * c_tok) + b);
}

// The keys lo..L-1 of a sequence (lo > 0: a sliding window; the table's entries before lo's block
// are never read, they may name no block) as runs within one block each: f(first row, index of
// that key counted from lo, count). The next run's rows are prefetched while f runs when `ahead`.
template <typename T, typename F>
inline void for_each_run(const T* cache, const int32_t* table, int64_t lo, int64_t L, int64_t bs, int64_t c_blk,
                         int64_t c_tok, int64_t D, bool ahead, F&& f) {
  for (int64_t t0 = lo; t0 < L;) {
    const int64_t n = std::min(bs - t0 % bs, L - t0);
    if (ahead && t0 + n < L)
      prefetch_rows(cache + int64_t(table[(t0 + n) / bs]) * c_blk, std::min(bs, L - t0 - n), c_tok, D);
    f(cache + int64_t(table[t0 / bs]) * c_blk + (t0 % bs) * c_tok, t0 - lo, n);
    t0 += n;
  }
}

// acc[g] = inv[g] * sum_t s[g, t] V_t for G heads, whose output rows stay in (at most 16) registers
// while V streams: CS vector chunks of each row at a time for up to 16 / CS heads; each slice of a V
// row is loaded once for all those heads. Where G heads' whole rows do not fit (AVX2, D = 64, three
// heads per KV head: 24 vectors), the row is split into slices and V read once per slice (mostly
// from the cache), not once per head.
template <typename T, int CS>
void weighted_values(const T* vc, const int32_t* table, int64_t lo, int64_t L, int64_t bs, int64_t c_blk,
                     int64_t c_tok, int64_t G, int64_t DC, const float* s, const float* inv, float* acc) {
  if constexpr (CS > 1) {
    if (G * CS > 16) return weighted_values<T, CS / 2>(vc, table, lo, L, bs, c_blk, c_tok, G, DC, s, inv, acc);
  }
  constexpr int HM = 16 / CS;
  const int64_t D = DC * W, S = L - lo;
  for (int64_t g0 = 0; g0 < G; g0 += HM)
    for (int64_t c0 = 0; c0 < DC; c0 += CS) {
      vf av[HM][CS];
      for (int g = 0; g < HM; ++g)
        for (int c = 0; c < CS; ++c) av[g][c] = zero();
      for_each_run(vc, table, lo, L, bs, c_blk, c_tok, D, c0 == 0, [&](const T* rows, int64_t t, int64_t n) {
        const T* vb = rows + W * c0;
        for (int64_t i = 0; i < n; ++i) {
          vf v[CS];
          for (int c = 0; c < CS; ++c) v[c] = load(vb + i * c_tok + W * c);
          for (int g = 0; g < HM; ++g) {
            if (g0 + g >= G) break;
            const vf p = set1(s[(g0 + g) * S + t + i]);
            for (int c = 0; c < CS; ++c) av[g][c] = fma(p, v[c], av[g][c]);
          }
        }
      });
      for (int g = 0; g < HM && g0 + g < G; ++g)
        for (int c = 0; c < CS; ++c) store(acc + (g0 + g) * D + W * (c0 + c), mul(av[g][c], set1(inv[g0 + g])));
    }
}

// one (sequence, KV head): its G query heads against the keys lo..L-1
template <typename T, int DC>
void decode_task(const float* qf, float sc, const T* kc, const T* vc, const int32_t* table, int64_t lo, int64_t L,
                 int64_t bs, int64_t c_blk, int64_t c_tok, int64_t G, int64_t D, float* s, float* acc, float* inv) {
  const int64_t S = L - lo;
  // scores s[g * S + t], run by run (no division per token)
  for_each_run(kc, table, lo, L, bs, c_blk, c_tok, D, true, [&](const T* kb, int64_t t, int64_t n) {
    if constexpr (DC > 0) {
      for (int64_t i = 0; i < n; i += W)
        scores_tile<T, DC>(qf, sc, kb + i * c_tok, c_tok, int(std::min<int64_t>(W, n - i)), G, s + t + i, S);
    } else {
      for (int64_t i = 0; i < n; ++i) dot_rows<T>(qf, sc, kb + i * c_tok, G, D, s + t + i, S);
    }
  });
  for (int64_t g = 0; g < G; ++g) {  // softmax numerators; the sum divides at the end
    float* sg = s + g * S;
    float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t t = 0; t < S; ++t) m = std::max(m, sg[t]);
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < S; ++t) sum += (sg[t] = fast_exp(sg[t] - m));
    inv[g] = 1.f / sum;
  }
  if constexpr (DC > 0) return weighted_values<T, DC>(vc, table, lo, L, bs, c_blk, c_tok, G, DC, s, inv, acc);
  for (int64_t g = 0; g < G; ++g) {  // any number of heads: one head at a time
    float* a = acc + g * D;
    std::fill(a, a + D, 0.f);
    for_each_run(vc, table, lo, L, bs, c_blk, c_tok, D, false, [&](const T* vb, int64_t t, int64_t n) {
      for (int64_t i = 0; i < n; ++i) axpy_row<T>(a, s[g * S + t + i], vb + i * c_tok, D);
    });
    for (int64_t d = 0; d < D; ++d) a[d] *= inv[g];
  }
}

// window: keys of a query at position p are p - window + 1 .. p (0: all of 0 .. p)
inline int64_t first_key(const int32_t* lens, int64_t b, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, lens[b] - window) : int64_t(0);
}

// the elements of K the decode rows read: whether a region of its own pays
inline int64_t decode_work(const at::Tensor& seq_lens, int64_t heads, int64_t head_dim, int64_t window) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t work = 0;
  for (int64_t b = 0; b < seq_lens.size(0); ++b) work += (lens[b] - first_key(lens, b, window)) * heads * head_dim;
  return work;
}

template <typename T>
void decode_attention_team(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& rows, double scale, int64_t window) {
  const int64_t B = seq_lens.size(0), H = query.size(1), D = query.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  const int64_t c_blk = k_cache.stride(0), c_tok = k_cache.stride(1), c_head = k_cache.stride(2);
  const int64_t bt_row = block_tables.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const T* q = query.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  // a (sequence, KV head) per task, its G query heads cut in `parts` where there are fewer such
  // pairs than the team has threads (Gemma 3 at batch 1: one pair of four heads, which left a thread
  // idle for 9% of its decode step): each head's arithmetic is its own, so how heads are grouped
  // changes no bit. The team's size, which every thread of it sees alike (torch's thread count need
  // not be: a worker thread's may differ, and the threads would split different loops)
  const int64_t pairs = B * KVH, parts = std::min<int64_t>(G, (omp_get_num_threads() + pairs - 1) / pairs);
  const int64_t per_part = (G + parts - 1) / parts, tasks = pairs * parts;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, lens[b] - first_key(lens, b, window));
  auto task_fn = D == 64 ? decode_task<T, 64 / W> : D == 128 ? decode_task<T, 128 / W>
               : D == 256 ? decode_task<T, 256 / W> : decode_task<T, 0>;
  std::vector<float> qf(G * D), acc(G * D), s(G * longest), inv(G);  // per thread, not per task
  // dynamic: sequences differ in length, so equal halves of the task list are not equal work
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / parts / KVH, h = task / parts % KVH, g0 = task % parts * per_part;
    const int64_t n = std::min(per_part, G - g0);  // query heads h * G + g0 ...
    for (int64_t g = 0; g < n; ++g) {
      const T* qg = q + row_of[b] * q_row + (h * G + g0 + g) * q_head;
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] = f32(qg[d]);  // scaled after the dot, as SDPA does
    }
    task_fn(qf.data(), sc, kc + h * c_head, vc + h * c_head, tables + b * bt_row, first_key(lens, b, window),
            lens[b], bs, c_blk, c_tok, n, D, s.data(), acc.data(), inv.data());
    for (int64_t g = 0; g < n; ++g) {
      T* og = o + row_of[b] * o_row + (h * G + g0 + g) * o_head;
      for (int64_t d = 0; d < D; ++d) og[d] = to<T>(acc[g * D + d]);
    }
  }
}

void check_decode_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& rows) {
  check_cpu("query, out and the caches", {&out, &query, &k_cache, &v_cache});
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.strides() == v_cache.strides(),
              "kvscope: the caches must be contiguous [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  rows.scalar_type() == at::kLong && block_tables.stride(1) == 1,
              "kvscope: block_tables and seq_lens must be int32, rows int64");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "kvscope: query, out and the caches must share a dtype");
}

void decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                      const at::Tensor& rows, double scale, int64_t window) {
  check_decode_attention(out, query, k_cache, v_cache, block_tables, seq_lens, rows);
  const bool parallel = seq_lens.size(0) * query.size(1) > 1 &&
                        decode_work(seq_lens, query.size(1), query.size(2), window) > kParallelWork;
  dispatch(query.scalar_type(), "decode_attention", [&](auto tag) {
    in_team(parallel, [&] {
      decode_attention_team<decltype(tag)>(out, query, k_cache, v_cache, block_tables, seq_lens, rows, scale, window);
    });
  });
}

// ---------------------------------------------------------------------------- prefill attention
// Causal attention of prompt chunks that have no cached prefix, straight from the step's new
// q/k/v rows ([T, H, D] and [T, KVH, D], rows strided): chunk c is rows spans[c][0]..spans[c][1].
// Flash-attention style, in float32: one task per (chunk, KV head, tile of 16 positions); keys
// come W at a time, transposed once per tile and used by the G query heads of the KV head, so
// both products are register-blocked FMAs with no horizontal sums; softmax runs online. window > 0:
// position i sees keys i - window + 1 .. i only, and key tiles wholly before that are skipped.
constexpr int64_t kQueryTile = 16;  // query positions per task

template <typename T, int DC>
void prefill_task(const T* q, int64_t q_row, int64_t q_head, const T* k, int64_t k_row, const T* v, int64_t v_row,
                  int64_t kv_head, T* o, int64_t o_row, int64_t o_head, int64_t start, int64_t len, int64_t i0,
                  int64_t h, int64_t G, float sc, int64_t window) {
  constexpr int D = W * DC, R = 8, QT = kQueryTile;  // R query rows at a time: R independent FMA chains
  const int64_t n = std::min<int64_t>(QT, len - i0);  // query positions i0..i0+n-1 of the chunk
  constexpr float kInf = std::numeric_limits<float>::infinity();
  alignas(64) float kt[D * W], vt[W * D], p[QT * W];
  std::vector<float> qf(G * QT * D), acc(G * QT * D, 0.f), m(G * QT, -kInf), l(G * QT, 0.f);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < QT; ++i)
      for (int c = 0; c < DC; ++c)
        store(qf.data() + (g * QT + i) * D + W * c,
              i < n ? mul(load(q + (start + i0 + i) * q_row + (h * G + g) * q_head + W * c), set1(sc)) : zero());
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, i0 - window + 1) : 0;
  for (int64_t j0 = first_key / W * W; j0 < i0 + n; j0 += W) {
    const int64_t nk = std::min<int64_t>(W, len - j0);
    // this tile's W keys transposed [D][W] and values [W][D], float32, zeros past the chunk
    for (int64_t j = 0; j < W; ++j) {
      const T* kr = k + (start + j0 + j) * k_row + h * kv_head;
      const T* vr = v + (start + j0 + j) * v_row + h * kv_head;
      for (int d = 0; d < D; ++d) kt[d * W + j] = j < nk ? f32(kr[d]) : 0.f;
      for (int c = 0; c < DC; ++c) store(vt + j * D + W * c, j < nk ? load(vr + W * c) : zero());
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf.data() + g * QT * D;
      float* ag = acc.data() + g * QT * D;
      for (int64_t r0 = 0; r0 < n; r0 += R) {
        vf srow[R];
        for (int r = 0; r < R; ++r) srow[r] = zero();
        for (int d = 0; d < D; ++d) {
          const vf kd = load(kt + d * W);
          for (int r = 0; r < R; ++r) srow[r] = fma(set1(qg[(r0 + r) * D + d]), kd, srow[r]);
        }
        for (int r = 0; r < R && r0 + r < n; ++r) {
          const int64_t i = r0 + r;
          // causal: keys up to position i0 + i; in a window, from i0 + i - window + 1
          const int64_t hi = std::min<int64_t>(nk, i0 + i - j0 + 1);
          const int64_t lo = window > 0 ? std::max<int64_t>(0, i0 + i - window + 1 - j0) : 0;
          if (lo >= hi) {  // no key of this tile in the window: nothing to add
            store(p + i * W, zero());
            continue;
          }
          const vf s = keep_range(srow[r], lo, hi, -kInf);
          float& mi = m[g * QT + i];
          const float m_new = std::max(mi, reduce_max(s));
          const vf e = keep_range(exp_lanes(sub(s, set1(m_new))), lo, hi, 0.f);
          const float alpha = std::isinf(mi) ? 0.f : fast_exp(mi - m_new);
          l[g * QT + i] = l[g * QT + i] * alpha + reduce_add(e);
          mi = m_new;
          store(p + i * W, e);
          float* arow = ag + i * D;
          for (int c = 0; c < DC; ++c) store(arow + W * c, mul(load(arow + W * c), set1(alpha)));
        }
      }
      for (int64_t i = 0; i < n; i += 2) {  // P V, two rows at a time: 2 * DC chains
        const bool two = i + 1 < n;
        vf a0[DC], a1[DC];
        for (int c = 0; c < DC; ++c) {
          a0[c] = load(ag + i * D + W * c);
          a1[c] = two ? load(ag + (i + 1) * D + W * c) : zero();
        }
        for (int64_t j = 0; j < nk; ++j) {
          const vf p0 = set1(p[i * W + j]), p1 = set1(two ? p[(i + 1) * W + j] : 0.f);
          for (int c = 0; c < DC; ++c) {
            const vf vj = load(vt + j * D + W * c);
            a0[c] = fma(p0, vj, a0[c]);
            a1[c] = fma(p1, vj, a1[c]);
          }
        }
        for (int c = 0; c < DC; ++c) {
          store(ag + i * D + W * c, a0[c]);
          if (two) store(ag + (i + 1) * D + W * c, a1[c]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < n; ++i) {
      T* orow = o + (start + i0 + i) * o_row + (h * G + g) * o_head;
      const float inv = 1.f / l[g * QT + i];
      for (int d = 0; d < D; ++d) orow[d] = to<T>(acc[(g * QT + i) * D + d] * inv);
    }
}

void prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& spans, double scale, int64_t window) {
  check_cpu("out, query, key and value", {&out, &query, &key, &value});
  const int64_t H = query.size(1), D = query.size(2), KVH = key.size(1);
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 2 && spans.is_contiguous(),
              "kvscope: spans must be int64 [chunks, 2] (first row, end row)");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && value.scalar_type() == key.scalar_type() &&
                  out.scalar_type() == query.scalar_type() && H % KVH == 0,
              "kvscope: query, key, value and out must share a dtype; heads a multiple of KV heads");
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "kvscope: prefill_attention takes head_dim 64, 128 or 256");
  TORCH_CHECK(key.stride(1) == value.stride(1), "kvscope: key and value must share their head stride");
  const int64_t* sp = spans.data_ptr<int64_t>();
  const int64_t chunks = spans.size(0), G = H / KVH;
  std::vector<std::array<int64_t, 3>> tasks;  // (chunk, kv head, first position of the tile)
  int64_t work = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t len = sp[2 * c + 1] - sp[2 * c];
    work += len * std::min(len, window > 0 ? window : len) * H * D / 2;
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t i0 = 0; i0 < len; i0 += kQueryTile) tasks.push_back({c, h, i0});
  }
  const int64_t ntasks = int64_t(tasks.size());
  const float sc = float(scale);
  dispatch(query.scalar_type(), "prefill_attention", [&](auto tag) {
    using T = decltype(tag);
    auto fn = D == 64 ? prefill_task<T, 64 / W> : D == 128 ? prefill_task<T, 128 / W> : prefill_task<T, 256 / W>;
    const T* q = query.data_ptr<T>();
    const T* k = key.data_ptr<T>();
    const T* v = value.data_ptr<T>();
    T* o = out.data_ptr<T>();
#pragma omp parallel for num_threads(threads()) schedule(dynamic, 1) if (ntasks > 1 && work > kParallelWork)
    for (int64_t t = 0; t < ntasks; ++t) {
      const auto [c, h, i0] = tasks[t];
      fn(q, query.stride(0), query.stride(1), k, key.stride(0), v, value.stride(0), key.stride(1), o, out.stride(0),
         out.stride(1), sp[2 * c], sp[2 * c + 1] - sp[2 * c], i0, h, G, sc, window);
    }
  });
}

// ---------------------------------------------------------------------------- RMSNorm
// In float32, x * rsqrt(mean(x^2) + eps), times the weight. A weight of T (HF's LlamaRMSNorm):
// the normalised x rounded to T first, then w * it; a float32 weight under a narrower T
// (Gemma3RMSNorm, its weight 1 + w in float32): the product in float32, rounded once.
template <typename T, typename WT>
inline void norm_row(const T* x, const WT* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += f32(x[i]) * f32(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  if constexpr (std::is_same_v<WT, T>) {
    for (int64_t i = 0; i < n; ++i) out[i] = to<T>(f32(w[i]) * rnd<T>(f32(x[i]) * r));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = to<T>(f32(x[i]) * r * w[i]);
  }
}

// f(T{}, WT{}): x's dtype T, the weight's WT (T, or float32 under any T)
template <typename F>
void dispatch_norm(const at::Tensor& x, const at::Tensor& weight, const char* op, F&& f) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "kvscope: ", op, " wants a weight in x's dtype or in float32");
  dispatch(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    if (weight.scalar_type() == x.scalar_type()) return f(T{}, T{});
    return f(T{}, float{});
  });
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu("out and x", {&out, &x});
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "kvscope: rms_norm wants out and x [T, hidden] and a weight [hidden]");
  dispatch_norm(x, weight, "rms_norm", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    const int64_t T_ = x.size(0), n = x.size(1);
    const WT* w = weight.data_ptr<WT>();
    in_team(T_ * n > kParallelWork, [&] {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T_; ++t)
        norm_row<T, WT>(x.data_ptr<T>() + t * x.stride(0), w, out.data_ptr<T>() + t * out.stride(0), n, float(eps));
    });
  });
}

// x = pre * norm(x) first where pre is given (Gemma's norm of the attention's or MLP's output);
// residual = residual + x (rounded to the dtype, as HF's `h = h + out`); x = w * norm(residual)
template <typename T, typename WT>
void add_rms_norm_team(const at::Tensor& x, const at::Tensor& residual, const WT* w, const WT* pre, float eps) {
  const int64_t n = x.size(1);
#pragma omp for schedule(static)
  for (int64_t t = 0; t < x.size(0); ++t) {
    T* xr = x.data_ptr<T>() + t * x.stride(0);
    T* rr = residual.data_ptr<T>() + t * residual.stride(0);
    if (pre) norm_row<T, WT>(xr, pre, xr, n, eps);
    for (int64_t i = 0; i < n; ++i) rr[i] = to<T>(f32(rr[i]) + f32(xr[i]));
    norm_row<T, WT>(rr, w, xr, n, eps);
  }
}

void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps,
                  const c10::optional<at::Tensor>& pre) {
  check_cpu("x and residual", {&x, &residual});
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1) &&
                  (!pre || (pre->is_contiguous() && pre->scalar_type() == weight.scalar_type() &&
                            pre->numel() == x.size(1))),
              "kvscope: add_rms_norm wants x and residual [T, hidden] and weights [hidden] of one dtype");
  dispatch_norm(x, weight, "add_rms_norm", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    in_team(x.size(0) * x.size(1) > kParallelWork, [&] {
      add_rms_norm_team<T, WT>(x, residual, weight.data_ptr<WT>(), pre ? pre->data_ptr<WT>() : nullptr, float(eps));
    });
  });
}

// ---------------------------------------------------------------------------- rotary + store
// q [T, H, D], k/v [T, KVH, D] (rows may be strided: views of one fused qkv output);
// cos/sin [T, D] in the model dtype (the HF rotary module's output); slots [T] int64, -1 = skip.
// Each head of q and k RMS-normalised first where q_norm / k_norm [D] are given (Qwen3, Gemma 3),
// rounded to the dtype as HF's module returns it; then as HF: x * cos + rotate_half(x) * sin, each
// product and the sum rounded to the dtype.
template <typename T, typename WT>
void rope_store_team(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, const WT* q_norm, const WT* k_norm, float eps) {
  const int64_t T_ = q.size(0), H = q.size(1), KVH = k.size(1), D = q.size(2), half = D / 2;
  const int64_t c_slot = k_cache.stride(1), c_head = k_cache.stride(2), bs = k_cache.size(1),
                c_blk = k_cache.stride(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T_; ++t) {
    const T* c = cos.data_ptr<T>() + t * cos.stride(0);
    const T* s = sin.data_ptr<T>() + t * sin.stride(0);
    float x[512];
    auto rotate = [&](T* row, const WT* norm) {
      if (norm) norm_row<T, WT>(row, norm, row, D, eps);
      for (int64_t d = 0; d < D; ++d) x[d] = f32(row[d]);
      for (int64_t d = 0; d < D; ++d) {
        const float r = d < half ? -x[d + half] : x[d - half];
        row[d] = to<T>(rnd<T>(x[d] * f32(c[d])) + rnd<T>(r * f32(s[d])));
      }
    };
    for (int64_t h = 0; h < H; ++h) rotate(q.data_ptr<T>() + t * q.stride(0) + h * q.stride(1), q_norm);
    const int64_t dst = slot[t] < 0 ? -1 : (slot[t] / bs) * c_blk + (slot[t] % bs) * c_slot;
    for (int64_t h = 0; h < KVH; ++h) {
      T* kr = k.data_ptr<T>() + t * k.stride(0) + h * k.stride(1);
      rotate(kr, k_norm);
      if (dst < 0) continue;
      const T* vr = v.data_ptr<T>() + t * v.stride(0) + h * v.stride(1);
      for (int64_t d = 0; d < D; ++d) {
        kc[dst + h * c_head + d] = kr[d];
        vc[dst + h * c_head + d] = vr[d];
      }
    }
  }
}

void rope_store(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps) {
  check_cpu("q, k, v, cos, sin and the caches", {&q, &k, &v, &cos, &sin, &k_cache, &v_cache});
  TORCH_CHECK(q.size(2) <= 512 && q.size(2) % 2 == 0, "kvscope: head_dim must be even and at most 512");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.scalar_type() == at::kLong,
              "kvscope: contiguous caches and int64 slots expected");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == q.scalar_type(),
              "kvscope: q, k, v, cos, sin and the caches must share a dtype");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value() &&
                  (!q_norm || (q_norm->is_contiguous() && k_norm->is_contiguous() &&
                               q_norm->numel() == q.size(2) && k_norm->numel() == q.size(2) &&
                               q_norm->scalar_type() == k_norm->scalar_type())),
              "kvscope: rope_store wants both q_norm and k_norm [head_dim] of one dtype, or neither");
  const at::Tensor& norm_like = q_norm ? *q_norm : q;
  dispatch_norm(q, norm_like, "rope_store", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    in_team(q.size(0) * (q.size(1) + k.size(1)) * q.size(2) > kParallelWork, [&] {
      rope_store_team<T, WT>(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm ? q_norm->data_ptr<WT>() : nullptr,
                             k_norm ? k_norm->data_ptr<WT>() : nullptr, float(eps));
    });
  });
}

// ---------------------------------------------------------------------------- activation and multiply
// out [T, I] = act(gate) * up for gu = [gate | up], act rounded to the dtype first (HF: act(gate) *
// up). Both activations are x * sigmoid(a x'): SiLU with x' = x; GELU-tanh (Gemma) with
// 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3). By the vector layer
// (exp_lanes is fast_exp lane by lane, the same bits): g++ left the scalar loop unvectorized in
// the AVX2 variant (7x slower than by the vector layer).
constexpr float kGeluA = -1.5957691216057308f;  // -2 sqrt(2 / pi)
constexpr float kGeluB = 0.044715f;
struct Silu {
  static vf lanes(vf x) { return div(x, add(set1(1.f), exp_lanes(sub(zero(), x)))); }
  static float one(float x) { return x / (1.f + fast_exp(-x)); }
};
struct GeluTanh {
  static vf lanes(vf x) {
    const vf inner = add(x, mul(set1(kGeluB), mul(mul(x, x), x)));
    return div(x, add(set1(1.f), exp_lanes(mul(set1(kGeluA), inner))));
  }
  static float one(float x) { return x / (1.f + fast_exp(kGeluA * (x + kGeluB * (x * x * x)))); }
};

template <typename T, typename Act>
void act_and_mul_team(const at::Tensor& out, const at::Tensor& gate_up) {
  const int64_t T_ = gate_up.size(0), I = gate_up.size(1) / 2;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < T_; ++t) {
    const T* g = gate_up.data_ptr<T>() + t * gate_up.stride(0);
    T* o = out.data_ptr<T>() + t * out.stride(0);
    int64_t i = 0;
#if !defined(KVSCOPE_ISA_GENERIC)  // the portable variant keeps the loop below: its compiler vectorizes it
    for (; i + W <= I; i += W) {
      const vf act = Act::lanes(load(g + i));
      if constexpr (std::is_same_v<T, float>) {
        store(o + i, mul(act, load(g + I + i)));
      } else {
        alignas(64) float a[W];
        store(a, act);
        for (int j = 0; j < W; ++j) o[i + j] = to<T>(rnd<T>(a[j]) * f32(g[I + i + j]));
      }
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < I; ++j) o[j] = to<T>(rnd<T>(Act::one(f32(g[j]))) * f32(g[I + j]));
  }
}

template <typename Act>
void act_and_mul(at::Tensor& out, const at::Tensor& gate_up, const char* op) {
  check_cpu("out and gate_up", {&out, &gate_up});
  TORCH_CHECK(out.size(0) == gate_up.size(0) && 2 * out.size(1) == gate_up.size(1) &&
                  out.scalar_type() == gate_up.scalar_type(),
              "kvscope: ", op, " wants out [T, I] for gate_up [T, 2I], one dtype");
  dispatch(out.scalar_type(), op, [&](auto tag) {
    in_team(out.numel() > kParallelWork, [&] { act_and_mul_team<decltype(tag), Act>(out, gate_up); });
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) { act_and_mul<Silu>(out, gate_up, "silu_and_mul"); }
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  act_and_mul<GeluTanh>(out, gate_up, "gelu_tanh_and_mul");
}

// ---------------------------------------------------------------------------- GEMV
// out [M, N] = x [M, K] . w [N, K]^T (+ bias [N]) for M <= 4, accumulated in float32. At small M
// a linear layer is a stream of its weights: every weight row is read once, from memory, and
// dotted with the M rows of x, which stay in L1. Output rows come in blocks of 16, each block a
// contiguous run of weights; R weight rows are dotted at a time (R * M independent FMA chains),
// and the W sums of each x row reduce to one vector with sum_lanes. At one row of x all 16 rows of
// a block stream at once: 16 read streams keep more cache misses in flight than 4, and one core
// then reads the weights at about the speed of a plain sum over them (bench/gemv.py, AVX2: 1.4x
// the 4-row kernel); at more rows of x, 8 rows at a time (1.2-1.3x). bf16 weights: AVX512-BF16's dot
// product of bf16 pairs where the CPU has it (as oneDNN does on such CPUs); elsewhere they are
// widened to float32 as they stream in and multiplied with x converted once to float32: half the
// bytes of fp32 weights, the same fp32 arithmetic. That also serves float32 x with a bf16 copy of
// the weights (the engine's default on CPUs without bf16 products: kernels/linear.py).
template <typename T, typename O = T> struct Gemv {  // weights of T widened to float32, x in float32
  static constexpr int64_t kChunk = W;
  using XT = float;  // x's element type inside the kernel
  using X = vf;
  static X load_w(const T* p) { return load(p); }
  static X load_x(const XT* p) { return load(p); }
  static vf dot(vf acc, X w, X x) { return fma(w, x, acc); }
};

#if defined(KVSCOPE_DPBF16)
template <> struct Gemv<c10::BFloat16, c10::BFloat16> {  // bf16 x too (fp32 x keeps fp32 arithmetic)
  static constexpr int64_t kChunk = 32;
  using XT = c10::BFloat16;
  using X = __m512bh;
  static X load_w(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static X load_x(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static vf dot(vf acc, X w, X x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

constexpr int64_t kAhead = 16;  // rows
constexpr int kBlock = 16;      // output rows per task
constexpr int kPackedRows = 8;  // weight rows dotted at once in the packed layout (gemv_pack)
// elements of one weight row side by side in the packed layout: 64 bytes of bf16, one cache line,
// a whole AVX512-BF16 dot-product chunk; the float32-x kernels read it in W-wide pieces
constexpr int64_t kPackChunk = 32;
// weight rows dotted at once for M rows of x of T (measured with bench/gemv.py): at one row of
// fp32 the whole block on AVX2 and AVX-512, otherwise 8 (more accumulators than registers, yet
// faster than 4; bf16 weights at one row: 16 at once were 1.5x slower than 4, each load widened
// in registers); the portable variant's arrays of floats stay in registers only up to 8 rows
#if defined(KVSCOPE_ISA_GENERIC)
template <typename T> constexpr int rows_at_once(int) { return 8; }
#else
template <typename T> constexpr int rows_at_once(int M) { return M == 1 && std::is_same_v<T, float> ? kBlock : 8; }
#endif
// how gemv reads its weights: rows (rows_at_once side by side, the next rows prefetched), packed
// (gemv_pack's layout, one stream), or serial: at one row of x the weight rows as they are, one
// after another, one sequential stream that the hardware prefetcher follows unasked, with the
// same sums in the same order as rows (AMD EPYC, 2 threads, bench/gemv.py: 0.92-1.13x the rows at
// fp32 by shape, 1.04-2.04x at bf16, as fast as packed without its copy; a software prefetch 16
// rows ahead slowed it to 0.80-0.98x); at more rows of x, rows (x's 2-4 rows of a long K, 16-32
// KB, no longer stay in L1 when every weight row re-reads them: 0.47-0.8x). Which is fastest
// depends on the CPU and the shape: kernels/linear.py's choose_gemv times them where a model loads
enum GemvLayout : int64_t { kRows = 0, kPacked = 1, kSerial = 2 };

// weights of T; x, bias and out of O (T, or float32 with bf16 weights: fp32 arithmetic on weights
// stored in half the bytes). Packed: w in gemv_pack's layout, read in one sequential stream.
// weight row j (of R side by side), element k, in gemv_pack's layout from a group's start r
template <typename T>
inline const T* packed_at(const T* r, int64_t k, int j, int R) {
  return r + (k / kPackChunk) * kPackChunk * R + j * kPackChunk + k % kPackChunk;
}

template <typename T, typename O, int M, GemvLayout Layout>
void gemv_block(const typename Gemv<T, O>::XT* x, int64_t x_row, const T* w, int64_t K, const O* bias, O* out,
                int64_t o_row) {
  using G = Gemv<T, O>;
  constexpr bool Packed = Layout == kPacked;
  constexpr bool Serial = Layout == kSerial;  // (M == 1: gemv_impl)
  constexpr int R = Packed ? kPackedRows : Serial ? 1 : rows_at_once<T>(M);
  vf part[M][kBlock];
  for (int i = 0; i < kBlock; i += R) {
    const T* r = w + i * K;
    vf acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < R; ++j) acc[m][j] = zero();
    for (int64_t k = 0; k < K; k += G::kChunk) {
      typename G::X xs[M];
      for (int m = 0; m < M; ++m) xs[m] = G::load_x(x + m * x_row + k);
      for (int j = 0; j < R; ++j) {
        // a few streams: ask for the next block ahead; 16 streams fetch enough (a prefetch slowed them).
        // Serial or packed, one stream: the hardware follows it at one row; packed at 2-4 rows,
        // the next block's same place is asked for too (0.66-0.96x without it, bench/gemv.py)
        if constexpr (Packed) {
          if constexpr (M > 1) __builtin_prefetch(reinterpret_cast<const char*>(packed_at(r, k, j, R) + kBlock * K));
        } else if constexpr (R < kBlock && !Serial) {
          __builtin_prefetch(reinterpret_cast<const char*>(r + j * K + k + kAhead * K));
        }
        const typename G::X wv = G::load_w(Packed ? packed_at(r, k, j, R) : r + j * K + k);
        for (int m = 0; m < M; ++m) acc[m][j] = G::dot(acc[m][j], wv, xs[m]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < R; ++j) part[m][i + j] = acc[m][j];
  }
  for (int b0 = 0; b0 < kBlock; b0 += W) {
    const vf b = bias ? load(bias + b0) : zero();
    for (int m = 0; m < M; ++m) {
      alignas(64) float sums[W];
      store(sums, add(sum_lanes(part[m] + b0), b));
      for (int i = 0; i < W; ++i) out[m * o_row + b0 + i] = to<O>(sums[i]);
    }
  }
}

template <typename T, typename O, int M, GemvLayout Layout>
void gemv_rows(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const O* bias) {
  using G = Gemv<T, O>;
  using XT = typename G::XT;
  const int64_t N = w.size(0), K = w.size(1), o_row = out.stride(0);
  const O* xp = x.data_ptr<O>();
  int64_t x_row = x.stride(0);
  std::vector<float> xf;  // x in float32, once per thread, when the weights are widened to it
  if constexpr (!std::is_same_v<XT, O>) {
    xf.resize(M * K);
    for (int m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xf[m * K + k] = f32(xp[m * x_row + k]);
    x_row = K;
  }
  const XT* xk = reinterpret_cast<const XT*>(std::is_same_v<XT, O> ? static_cast<const void*>(xp) : xf.data());
  const T* wp = w.data_ptr<T>();
  O* op = out.data_ptr<O>();
#pragma omp for schedule(static)
  for (int64_t n = 0; n < N; n += kBlock)
    gemv_block<T, O, M, Layout>(xk, x_row, wp + n * K, K, bias ? bias + n : nullptr, op + n, o_row);
}

template <typename T, typename O, GemvLayout Layout>
void gemv_impl(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const O* b = bias ? bias->data_ptr<O>() : nullptr;
  constexpr GemvLayout Many = Layout == kSerial ? kRows : Layout;  // serial is a way of one row of x
  switch (x.size(0)) {
    case 1: return gemv_rows<T, O, 1, Layout>(out, x, w, b);
    case 2: return gemv_rows<T, O, 2, Many>(out, x, w, b);
    case 3: return gemv_rows<T, O, 3, Many>(out, x, w, b);
    default: return gemv_rows<T, O, 4, Many>(out, x, w, b);
  }
}

// w [N, K] laid out for gemv(..., layout=kPacked): per block of 16 output rows, per group of
// kPackedRows, the chunks of kPackChunk elements of K in order, each chunk's rows side by side. The
// kernel then reads the weights in one sequential stream, which the hardware prefetcher follows at
// full speed (bf16 on AVX2, 2 threads, bench/gemv.py: 1.3-1.7x the row-major layout, whose rows of
// ~1 KB end before a stream's prefetch ramps up; bf16 x and weights with AVX512-BF16, one thread:
// 1.1-1.3x, Gemma 3's lm_head 640->262144 12.5 GB/s against 9.7, a plain read 17).
at::Tensor gemv_pack(const at::Tensor& w) {
  check_cpu("w", {&w});
  const int64_t N = w.size(0), K = w.size(1), C = kPackChunk;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && N % kBlock == 0 && K % C == 0,
              "kvscope: gemv_pack wants w [N, K] contiguous, N a multiple of 16, K of ", C);
  return w.view({N / kBlock, kBlock / kPackedRows, kPackedRows, K / C, C}).permute({0, 1, 3, 2, 4}).contiguous().view({N, K});
}

// x, out and bias in one dtype; w in it too, or bf16 under float32 x (see gemv_block); layout a
// GemvLayout, kPacked with w as gemv_pack returns it (float32 x, or bf16 x and weights)
void check_gemv(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                int64_t layout) {
  check_cpu("out, x and w", {&out, &x, &w});
  TORCH_CHECK(layout == kRows || layout == kPacked || layout == kSerial,
              "kvscope: gemv's layout is 0 (rows), 1 (packed) or 2 (serial), not ", layout);
  const bool packed = layout == kPacked;
  const auto xt = x.scalar_type(), wt = w.scalar_type();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4 &&
                  x.size(1) == w.size(1) && out.size(0) == x.size(0) && out.size(1) == w.size(0) &&
                  w.is_contiguous() && w.size(0) % 16 == 0 && (xt == wt || (xt == at::kFloat && wt == at::kBFloat16)) &&
                  out.scalar_type() == xt && (!bias || (bias->is_contiguous() &&
                  bias->numel() == w.size(0) && bias->scalar_type() == xt)),
              "kvscope: gemv wants x [M <= 4, K], w [N, K] contiguous with N a multiple of 16, out [M, N], "
              "x, out and bias in one dtype, w in it or in bfloat16 under float32");
  const int64_t K = w.size(1);
  TORCH_CHECK(!packed || ((xt == at::kFloat || wt == at::kBFloat16) && K % kPackChunk == 0),
              "kvscope: gemv takes packed weights under float32 x or bf16 x and weights, K a multiple of ", kPackChunk);
  using BF = c10::BFloat16;
  const int64_t chunk = wt == at::kFloat ? Gemv<float>::kChunk : xt == at::kFloat ? Gemv<BF, float>::kChunk
                                                                                  : Gemv<BF>::kChunk;
  TORCH_CHECK((wt == at::kFloat || wt == at::kBFloat16) && (packed || K % chunk == 0),
              "kvscope: gemv has no kernel for ", wt, " weights with K = ", K,
              " (it takes float32 and bfloat16, K a multiple of ", Gemv<BF>::kChunk, ")");
}

template <GemvLayout Layout>
void gemv_of_dtypes(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                    const c10::optional<at::Tensor>& bias) {
  using BF = c10::BFloat16;
  if (w.scalar_type() == at::kFloat) return gemv_impl<float, float, Layout>(out, x, w, bias);
  return x.scalar_type() == at::kFloat ? gemv_impl<BF, float, Layout>(out, x, w, bias)
                                       : gemv_impl<BF, BF, Layout>(out, x, w, bias);
}

// the kernel for check_gemv's arguments, on the calling team
void gemv_team(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
               int64_t layout) {
  if (layout == kPacked) return gemv_of_dtypes<kPacked>(out, x, w, bias);
  if (layout == kSerial) return gemv_of_dtypes<kSerial>(out, x, w, bias);
  return gemv_of_dtypes<kRows>(out, x, w, bias);
}

void gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
          int64_t layout) {
  check_gemv(out, x, w, bias, layout);
  in_team(w.numel() > kParallelWork, [&] { gemv_team(out, x, w, bias, layout); });
}

// ---------------------------------------------------------------------------- argmax
// out [M] = per row of float32 logits [M, V] the index of its largest value, the first of equals,
// NaN above all (torch.argmax's answer). Greedy sampling reads nothing else of a step's logits, and
// torch's argmax scans a row on one thread, one element at a time (a row of Gemma 3's 262,144
// logits in the cache: 0.35 ms, 0.03 ms here; in the engine, after the lm_head's weights pushed it
// out: 0.86 ms, 0.22 ms). The threads take the maxima of fixed spans of each row; the row's winner
// is then the first index holding the largest, found in the first span that has it.
constexpr int64_t kArgmaxSpan = 16384;

struct SpanMax {
  float top;
  bool odd;  // holds a NaN or an infinity: x - x is then NaN
};

SpanMax span_max(const float* x, int64_t n) {
  vf top = set1(-std::numeric_limits<float>::infinity()), probe = zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(x + i);
    top = vmax(top, v);
    probe = add(probe, sub(v, v));
  }
  float t = reduce_max(top), p = reduce_add(probe);
  for (; i < n; ++i) t = std::max(t, x[i]), p += x[i] - x[i];
  return {t, std::isnan(p)};
}

// the rare row with a NaN or an infinity, element by element as torch decides
int64_t argmax_exact(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n && !std::isnan(x[best]); ++i)
    if (std::isnan(x[i]) || x[i] > x[best]) best = i;
  return best;
}

at::Tensor argmax(const at::Tensor& logits) {
  check_cpu("logits", {&logits});
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "kvscope: argmax wants float32 logits [rows, vocab]");
  const int64_t M = logits.size(0), V = logits.size(1), spans = (V + kArgmaxSpan - 1) / kArgmaxSpan;
  const float* x = logits.data_ptr<float>();
  const int64_t row = logits.stride(0);
  std::vector<SpanMax> maxima(M * spans);
  in_team(M * V > kParallelWork, [&] {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M * spans; ++t) {
      const int64_t lo = (t % spans) * kArgmaxSpan;
      maxima[t] = span_max(x + (t / spans) * row + lo, std::min(V - lo, kArgmaxSpan));
    }
  });
  at::Tensor out = logits.new_empty({M}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    const SpanMax* s = maxima.data() + m * spans;
    const float* r = x + m * row;
    if (std::any_of(s, s + spans, [](const SpanMax& a) { return a.odd; })) {
      o[m] = argmax_exact(r, V);
      continue;
    }
    int64_t first = 0;
    for (int64_t j = 1; j < spans; ++j)
      if (s[j].top > s[first].top) first = j;
    int64_t i = first * kArgmaxSpan;
    while (r[i] != s[first].top) ++i;
    o[m] = i;
  }
  return out;
}

// ---------------------------------------------------------------------------- a decode step
// Every decoder layer of a decode step (each row one new token, M <= 4 rows) in one parallel
// region: the same kernels as the ops above, in the same order on the same values, so the step
// computes the same bits as the ops one by one; but its threads start once per step and meet at a
// barrier after each kernel, where the ops start a region each, about 270 a step, and its
// threads, asleep between two ops the host took long to issue, were woken each time (llama.cpp
// runs its graph the same way: docs/benchmarks.md, "Why llama.cpp still decodes faster").
//   x, residual [M, hidden]: x = layer 0's input norm of residual (the embeddings); on return x
//     is the last layer's MLP output, residual its stream before it (as after the op loop)
//   weights, kStepWeights per layer (None where the model has none): input norm, its pre-norm
//     (Gemma), q|k|v, its bias, q_norm, k_norm, o, its bias, post-attention norm, the attention
//     output's norm (Gemma), gate|up, its bias, down, its bias; layouts: per layer q|k|v's, o's,
//     gate|up's and down's GemvLayout
//   caches: per layer its K cache, V cache; ropes: cos, sin per rotary embedding, layer_rope the
//     one each layer takes; metas: slot mapping, block tables, seq lens, query rows and window per
//     attention metadata, layer_meta the one each layer reads; scales: per layer the attention's
//     scale and the norms' eps
constexpr int64_t kStepWeights = 14;
enum StepWeight { kInNorm, kInPre, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kPostNorm, kOutNorm, kGateUp,
                  kGateUpBias, kDown, kDownBias };

struct StepLayer {  // one layer's arguments, unpacked and checked before the region starts
  std::array<c10::optional<at::Tensor>, kStepWeights> w;
  std::array<int64_t, 4> layouts;
  at::Tensor q, k, v, k_cache, v_cache, cos, sin, slots, tables, seq_lens, rows;
  double scale, eps;
  int64_t window;
};

template <typename T, typename WT, typename Act>
void decode_step_team(const at::Tensor& x, const at::Tensor& residual, const std::vector<StepLayer>& layers,
                      const at::Tensor& qkv, const at::Tensor& attn, const at::Tensor& attn_rows,
                      const at::Tensor& gate_up, const at::Tensor& act) {
  auto ptr = [](const c10::optional<at::Tensor>& t) { return t ? t->data_ptr<WT>() : nullptr; };
  for (size_t i = 0; i < layers.size(); ++i) {
    const StepLayer& l = layers[i];
    const float eps = float(l.eps);
    if (i) add_rms_norm_team<T, WT>(x, residual, ptr(l.w[kInNorm]), ptr(l.w[kInPre]), eps);
    gemv_team(qkv, x, *l.w[kQkv], l.w[kQkvBias], l.layouts[0]);
    rope_store_team<T, WT>(l.q, l.k, l.v, l.cos, l.sin, l.k_cache, l.v_cache, l.slots, ptr(l.w[kQNorm]),
                           ptr(l.w[kKNorm]), eps);
    decode_attention_team<T>(attn, l.q, l.k_cache, l.v_cache, l.tables, l.seq_lens, l.rows, l.scale, l.window);
    gemv_team(x, attn_rows, *l.w[kO], l.w[kOBias], l.layouts[1]);
    add_rms_norm_team<T, WT>(x, residual, ptr(l.w[kPostNorm]), ptr(l.w[kOutNorm]), eps);
    gemv_team(gate_up, x, *l.w[kGateUp], l.w[kGateUpBias], l.layouts[2]);
    act_and_mul_team<T, Act>(act, gate_up);
    gemv_team(x, act, *l.w[kDown], l.w[kDownBias], l.layouts[3]);
  }
}

void decode_step(at::Tensor x, at::Tensor residual, const c10::List<c10::optional<at::Tensor>>& weights,
                 const std::vector<int64_t>& layouts, at::TensorList caches, at::TensorList ropes,
                 at::TensorList metas, const std::vector<int64_t>& windows, const std::vector<int64_t>& layer_rope,
                 const std::vector<int64_t>& layer_meta, const std::vector<double>& scales, int64_t num_heads,
                 bool gelu) {
  check_cpu("x and residual", {&x, &residual});
  const int64_t L = int64_t(layer_meta.size()), M = x.size(0);
  TORCH_CHECK(L > 0 && int64_t(weights.size()) == L * kStepWeights && int64_t(layouts.size()) == 4 * L &&
                  int64_t(caches.size()) == 2 * L && int64_t(layer_rope.size()) == L &&
                  int64_t(scales.size()) == 2 * L && metas.size() == 4 * windows.size(),
              "kvscope: decode_step wants per layer ", kStepWeights, " weights, 4 layouts, 2 caches, a rotary "
              "embedding, a metadata and 2 scales; 4 tensors and a window per metadata");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type() && M >= 1 && M <= 4,
              "kvscope: decode_step wants x and residual [M <= 4, hidden], contiguous, of one dtype");
  std::vector<StepLayer> layers(L);
  const at::Tensor w0 = *weights.get(kQkv);  // a copy: get() returns a temporary
  const int64_t D = caches[0].size(-1), KVH = caches[0].size(-2), H = num_heads;
  TORCH_CHECK(H > 0 && w0.size(0) == (H + 2 * KVH) * D, "kvscope: decode_step: q|k|v has ", w0.size(0),
              " rows, not (", H, " + 2 x ", KVH, ") x ", D);
  const at::Tensor qkv = x.new_empty({M, w0.size(0)}), attn = x.new_empty({M, H, D}), attn_rows = attn.view({M, H * D});
  const at::Tensor qkv3 = qkv.view({M, H + 2 * KVH, D});
  const at::Tensor q = qkv3.narrow(1, 0, H), k = qkv3.narrow(1, H, KVH), v = qkv3.narrow(1, H + KVH, KVH);
  const int64_t I2 = weights.get(kGateUp)->size(0);
  const at::Tensor gate_up = x.new_empty({M, I2}), act = x.new_empty({M, I2 / 2});
  for (int64_t i = 0; i < L; ++i) {
    StepLayer& l = layers[i];
    for (int64_t j = 0; j < kStepWeights; ++j) l.w[j] = weights.get(i * kStepWeights + j);
    for (int j = 0; j < 4; ++j) l.layouts[j] = layouts[4 * i + j];
    for (int64_t j : {kInNorm, kQkv, kO, kPostNorm, kGateUp, kDown})
      TORCH_CHECK(l.w[j].has_value(), "kvscope: decode_step: layer ", i, " lacks weight ", j);
    TORCH_CHECK(l.w[kQkv]->sizes() == w0.sizes() && l.w[kGateUp]->size(0) == I2 &&
                    l.w[kO]->size(0) == x.size(1) && l.w[kDown]->size(0) == x.size(1),
                "kvscope: decode_step: layer ", i, "'s linear layers differ in shape from layer 0's");
    check_gemv(qkv, x, *l.w[kQkv], l.w[kQkvBias], l.layouts[0]);
    check_gemv(x, attn_rows, *l.w[kO], l.w[kOBias], l.layouts[1]);
    check_gemv(gate_up, x, *l.w[kGateUp], l.w[kGateUpBias], l.layouts[2]);
    check_gemv(x, act, *l.w[kDown], l.w[kDownBias], l.layouts[3]);
    const at::Tensor& norm = *l.w[kInNorm];
    for (int64_t j : {kInNorm, kInPre, kPostNorm, kOutNorm})
      TORCH_CHECK(!l.w[j] || (l.w[j]->scalar_type() == norm.scalar_type() && l.w[j]->is_contiguous() &&
                              l.w[j]->numel() == x.size(1)),
                  "kvscope: decode_step: layer ", i, "'s norms must be [hidden], contiguous, of one dtype");
    TORCH_CHECK(l.w[kQNorm].has_value() == l.w[kKNorm].has_value() &&
                    (!l.w[kQNorm] || (l.w[kQNorm]->numel() == D && l.w[kKNorm]->numel() == D &&
                                      l.w[kQNorm]->is_contiguous() && l.w[kKNorm]->is_contiguous() &&
                                      l.w[kQNorm]->scalar_type() == norm.scalar_type() &&
                                      l.w[kKNorm]->scalar_type() == norm.scalar_type())),
                "kvscope: decode_step: layer ", i, " wants both q_norm and k_norm [head_dim] or neither");
    TORCH_CHECK(layer_rope[i] >= 0 && 2 * layer_rope[i] + 1 < int64_t(ropes.size()) && layer_meta[i] >= 0 &&
                    layer_meta[i] < int64_t(windows.size()),
                "kvscope: decode_step: layer ", i, " names a rotary embedding or metadata not given");
    const int64_t m = layer_meta[i];
    l.q = q, l.k = k, l.v = v, l.k_cache = caches[2 * i], l.v_cache = caches[2 * i + 1];
    l.cos = ropes[2 * layer_rope[i]], l.sin = ropes[2 * layer_rope[i] + 1];
    l.slots = metas[4 * m], l.tables = metas[4 * m + 1], l.seq_lens = metas[4 * m + 2], l.rows = metas[4 * m + 3];
    l.window = windows[m], l.scale = scales[2 * i], l.eps = scales[2 * i + 1];
    check_cpu("the caches, cos and sin", {&l.k_cache, &l.v_cache, &l.cos, &l.sin});
    TORCH_CHECK(l.k_cache.is_contiguous() && l.v_cache.is_contiguous() && l.k_cache.size(-1) == D &&
                    l.k_cache.size(-2) == KVH && l.v_cache.scalar_type() == x.scalar_type() && l.cos.size(0) == M && l.cos.size(1) == D &&
                    l.sin.sizes() == l.cos.sizes() && l.cos.scalar_type() == x.scalar_type() &&
                    l.sin.scalar_type() == x.scalar_type() && l.slots.scalar_type() == at::kLong &&
                    l.slots.numel() == M && l.rows.numel() == M,
                "kvscope: decode_step: layer ", i, ": contiguous caches [blocks, block_size, ", KVH, ", ", D,
                "], cos/sin [M, head_dim] in x's dtype, M slots and M query rows (one token per sequence)");
    check_decode_attention(attn, q, l.k_cache, l.v_cache, l.tables, l.seq_lens, l.rows);
  }
  TORCH_CHECK(D <= 512 && D % 2 == 0, "kvscope: head_dim must be even and at most 512");
  dispatch_norm(x, *layers[0].w[kInNorm], "decode_step", [&](auto tag, auto wtag) {
    using T = decltype(tag);
    using WT = decltype(wtag);
    TORCH_CHECK((!std::is_same_v<T, c10::Half>), "kvscope: decode_step takes float32 and bfloat16");
    if constexpr (!std::is_same_v<T, c10::Half>) {
      in_team(true, [&] {
        if (gelu) decode_step_team<T, WT, GeluTanh>(x, residual, layers, qkv, attn, attn_rows, gate_up, act);
        else decode_step_team<T, WT, Silu>(x, residual, layers, qkv, attn, attn_rows, gate_up, act);
      });
    }
  });
}

}  // namespace

// one namespace per variant (torch.ops.kvscope_avx512, ...), so that several load in one process
#if defined(KVSCOPE_ISA_AVX512)
#define KVSCOPE_NS kvscope_avx512
#elif defined(KVSCOPE_ISA_AVX2)
#define KVSCOPE_NS kvscope_avx2
#else
#define KVSCOPE_NS kvscope_generic
#endif
// a level of indirection, so KVSCOPE_NS expands before TORCH_LIBRARY pastes it into names
#define KVSCOPE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define KVSCOPE_LIBRARY_IMPL(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)

KVSCOPE_LIBRARY(KVSCOPE_NS, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor rows, float scale, int window=0) -> ()");
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor spans, float scale, "
        "int window=0) -> ()");
  m.def("rope_store(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor slots, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, Tensor? pre=None) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("gemv(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias, int layout=0) -> ()");
  m.def("gemv_pack(Tensor w) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
  m.def("decode_step(Tensor(a!) x, Tensor(b!) residual, Tensor?[] weights, int[] layouts, Tensor(c!)[] caches, "
        "Tensor[] ropes, Tensor[] metas, int[] windows, int[] layer_rope, int[] layer_meta, float[] scales, "
        "int num_heads, bool gelu) -> ()");
}

KVSCOPE_LIBRARY_IMPL(KVSCOPE_NS, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("rope_store", &rope_store);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("gemv", &gemv);
  m.impl("gemv_pack", &gemv_pack);
  m.impl("argmax", &argmax);
  m.impl("decode_step", &decode_step);
}
