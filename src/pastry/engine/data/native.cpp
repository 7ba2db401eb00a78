// Pastry's native CPU kernels (built and loaded by pastry/engine/native.py).
//
// 1. A bfloat16 product for few rows (decode) that reads oneDNN's packed weight in place.
//    For a bf16 Linear prepacked for one row (mkldnn._reorder_linear_weight(w, 1)) on a CPU
//    with AVX512_BF16, oneDNN lays the weight out as [ceil(N/64)][Kp/2][64][2]: blocks of
//    64 output rows, and within a block, for each pair of inputs, the 64 rows' two weights
//    (pastry/engine/native.py checks this layout byte for byte before using it). Each
//    block is then one contiguous stream, and one vdpbf16ps multiplies 16 rows by a pair of
//    inputs: the product streams the weight at memory bandwidth with a few microseconds of
//    fixed cost, where oneDNN's M=1 path costs ~11 us a call and streams at ~2/3 of it on
//    the 2-core Zen 4 (benchmarks/RESULTS.md). Sums run in float32 over the inputs in order,
//    the result is rounded to bfloat16 once, as oneDNN does (the order of the float32 sums
//    differs, so results differ from oneDNN's in the last bit of a few outputs).
//
// 2. A float32 product over Pastry's own layout (panels), at every row count.
//
// 3. The CPU kernel of pastry::linear, the compiled decode step's opaque projection call
//    (pastry/engine/compiled.py). Inductor's C++ wrapper reaches it through the dispatcher;
//    in C++ the call never enters Python. The projections of the model being run are a
//    Projections object (a TorchScript custom class built once per engine); use() makes it
//    the calling thread's for one step and release() clears it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>
#ifndef PASTRY_AHEAD
#define PASTRY_AHEAD 64
#endif

namespace {

// ------------------------------------------------------------------ the blocked product

constexpr int64_t kBlock = 64;  // output rows per block of the packed layout

bool cpu_has_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

// The raw bytes of an mkldnn (oneDNN) tensor.
const uint16_t* mkldnn_data(const at::Tensor& t) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::data_ptr", "")
                       .typed<int64_t(const at::Tensor&)>();
  return reinterpret_cast<const uint16_t*>(op.call(t));
}

// oneDNN's product over its packed weight (what Linear.forward runs from SMALL_M rows).
at::Tensor packed_linear(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(
              const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
              std::string_view, c10::List<std::optional<at::Scalar>>,
              std::optional<std::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// Rows [m0, m0 + MT) of y = x W^T (+ bias) for blocks [b0, b1) of the packed weight.
template <int MT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void blocked_rows(
    const uint16_t* w, int64_t pairs, int64_t block_elems, const uint16_t* x, int64_t xs,
    const uint16_t* bias, uint16_t* y, int64_t ys, int64_t n, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; b++) {
    const uint16_t* wb = w + b * block_elems;
    __m512 acc[MT][4];
    for (int m = 0; m < MT; m++) {
      for (int j = 0; j < 4; j++) {
        acc[m][j] = _mm512_setzero_ps();
      }
    }
    for (int64_t p = 0; p < pairs; p++) {
      const uint16_t* wp = wb + p * 2 * kBlock;
      __m512i w0 = _mm512_loadu_si512(wp);
      __m512i w1 = _mm512_loadu_si512(wp + 32);
      __m512i w2 = _mm512_loadu_si512(wp + 64);
      __m512i w3 = _mm512_loadu_si512(wp + 96);
      for (int m = 0; m < MT; m++) {
        int32_t pair;
        std::memcpy(&pair, x + m * xs + 2 * p, sizeof(pair));
        __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, xb);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, xb);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], (__m512bh)w2, xb);
        acc[m][3] = _mm512_dpbf16_ps(acc[m][3], (__m512bh)w3, xb);
      }
    }
    for (int j = 0; j < 4; j++) {
      int64_t row = b * kBlock + j * 16;
      if (row >= n) {
        break;
      }
      __mmask16 mask = row + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - row)) - 1);
      __m512 bv = _mm512_setzero_ps();
      if (bias != nullptr) {
        __m256i braw = _mm256_maskz_loadu_epi16(mask, bias + row);
        bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(braw), 16));
      }
      for (int m = 0; m < MT; m++) {
        __m512 v = bias != nullptr ? _mm512_add_ps(acc[m][j], bv) : acc[m][j];
        __m256i o = (__m256i)_mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(y + m * ys + row, mask, o);
      }
    }
  }
}

// Rows per pass over the weight: each pass streams it once.
constexpr int64_t kMaxRows = 4;

void blocked_pass(
    int64_t rows, const uint16_t* w, int64_t pairs, int64_t block_elems, const uint16_t* x,
    int64_t xs, const uint16_t* bias, uint16_t* y, int64_t ys, int64_t n, int64_t b0,
    int64_t b1) {
  switch (rows) {
    case 1:
      return blocked_rows<1>(w, pairs, block_elems, x, xs, bias, y, ys, n, b0, b1);
    case 2:
      return blocked_rows<2>(w, pairs, block_elems, x, xs, bias, y, ys, n, b0, b1);
    case 3:
      return blocked_rows<3>(w, pairs, block_elems, x, xs, bias, y, ys, n, b0, b1);
    default:
      return blocked_rows<4>(w, pairs, block_elems, x, xs, bias, y, ys, n, b0, b1);
  }
}

// y [M, N] = x [M, K] W^T (+ bias), W the packed weight at `w` (N x Kp, Kp >= K, K even).
at::Tensor blocked_product(
    const at::Tensor& x_in, const uint16_t* w, int64_t n, int64_t kp,
    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be 2-D bfloat16");
  at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 2 == 0 && k <= kp, "x has ", k, " columns, the weight ", kp);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) {
    return y;
  }
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  const uint16_t* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == n, "bias must be bf16 [N]");
    bp = reinterpret_cast<const uint16_t*>(b.const_data_ptr());
  }
  int64_t blocks = (n + kBlock - 1) / kBlock, pairs = k / 2, block_elems = kp * kBlock;
  int64_t xs = x.stride(0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t r = 0; r < m; r += kMaxRows) {
      int64_t rows = std::min(kMaxRows, m - r);
      blocked_pass(rows, w, pairs, block_elems, xp + r * xs, xs, bp, yp + r * n, n, n, b0, b1);
    }
  });
  return y;
}

// pastry_native::blocked_linear: the product over a packed weight (Linear.forward's path).
at::Tensor blocked_linear(
    const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
    int64_t n, int64_t kp) {
  TORCH_CHECK(cpu_has_bf16(), "this CPU lacks AVX512_BF16");
  return blocked_product(x, mkldnn_data(packed), n, kp, bias);
}

bool supported() { return cpu_has_bf16(); }

// ------------------------------------------------------------------ int4, many rows

// int4 weights as _convert_weight_to_int4pack_for_cpu packs them on this CPU (checked per
// weight by pastry/engine/native.py): [N/64][K][32] bytes, byte i of (block, k) holding
// the codes of rows i (low nibble) and i + 32 (high nibble) of the block; scale and zero
// per 32 inputs as scale_zeros [K/32][N][2], w = (q - 8) * scale + zero.
//
// PyTorch's int4 kernel is fast for a few rows but its cost grows ~3x faster per row than
// a dense bf16 product's: at a prefill chunk it is ~5x slower than bf16. From some rows on
// it pays to expand the weight to bf16 (into a per-thread scratch buffer, which stays in
// the last-level cache for the product that follows) and multiply densely.

constexpr int64_t kGroup = 32;  // inputs per scale and zero
constexpr int64_t kChunkRows = 4096;  // rows expanded at a time (bounds the scratch)

// Weight rows [b0 * 64, b1 * 64) (64-row blocks b of the packed int4 weight), expanded to
// bf16 in oneDNN's packed layout (the one blocked_product reads): block b - b0 of `out`
// holds, for each pair of inputs, the 64 rows' two weights. `kp` is the layout's padded K.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void int4_expand_blocked(
    const uint8_t* w, const uint16_t* sz, int64_t n, int64_t k, int64_t kp, uint16_t* out,
    int64_t b0, int64_t b1) {
  const __m512i low = _mm512_set1_epi32(0x0F);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 eight = _mm512_set1_ps(8.0f);
  // interleaves the two halves' words: [a0, b0, a1, b1, ...]
  alignas(64) static const uint16_t kZip[32] = {
      0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i zip = _mm512_load_si512(kZip);
  for (int64_t b = b0; b < b1; b++) {
    uint16_t* ob = out + (b - b0) * kp * kBlock;
    for (int64_t g = 0; g < k / kGroup; g++) {
      __m512 scale[4], zero[4];
      for (int j = 0; j < 4; j++) {
        __m512i raw = _mm512_loadu_si512(sz + (g * n + b * 64 + 16 * j) * 2);
        scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        zero[j] = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
      }
      for (int64_t kk = g * kGroup; kk < (g + 1) * kGroup; kk += 2) {
        __m512 v[2][4];  // [input kk, kk + 1][rows 16j .. 16j + 15]
        for (int t = 0; t < 2; t++) {
          const uint8_t* src = w + (b * k + kk + t) * 32;
          __m512i lo16 =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
          __m512i hi16 =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)));
          // rows 0-15, 16-31 (low nibbles), 32-47, 48-63 (high nibbles)
          __m512i q[4] = {
              _mm512_and_si512(lo16, low), _mm512_and_si512(hi16, low),
              _mm512_srli_epi32(lo16, 4), _mm512_srli_epi32(hi16, 4)};
          for (int j = 0; j < 4; j++) {
            __m512 c = _mm512_sub_ps(_mm512_cvtepi32_ps(q[j]), eight);  // exact
            v[t][j] = _mm512_fmadd_ps(c, scale[j], zero[j]);
          }
        }
        uint16_t* dst = ob + kk * kBlock;  // the pair kk / 2: 64 rows x 2
        for (int j = 0; j < 4; j++) {
          __m512i both = (__m512i)_mm512_cvtne2ps_pbh(v[1][j], v[0][j]);
          _mm512_storeu_si512(dst + 32 * j, _mm512_permutexvar_epi16(zip, both));
        }
      }
    }
  }
}

// A oneDNN-packed bf16 weight of `rows` x `k`, the calling thread's, whose bytes the
// expansion overwrites: created once per shape, its layout checked against the one the
// expansion writes (nullopt if oneDNN packs this shape otherwise).
struct Scratch {
  at::Tensor packed;
  uint16_t* data;
  int64_t kp;
};

std::optional<Scratch> scratch(int64_t rows, int64_t k) {
  thread_local std::vector<std::pair<std::pair<int64_t, int64_t>, std::optional<Scratch>>> cache;
  for (auto& entry : cache) {
    if (entry.first == std::make_pair(rows, k)) {
      return entry.second;
    }
  }
  static auto reorder = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                            .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  static auto nbytes = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("mkldnn::_nbytes", "")
                           .typed<int64_t(const at::Tensor&)>();
  // a weight whose every element says where it is
  at::Tensor probe = (at::arange(rows * k, at::TensorOptions().dtype(at::kFloat)) % 251)
                         .view({rows, k})
                         .to(at::kBFloat16);
  at::Tensor packed = reorder.call(probe, 1);
  std::optional<Scratch> found;
  int64_t bytes = nbytes.call(packed);
  if (bytes % (rows * 2 * 2) == 0) {
    int64_t kp = bytes / (rows * 2);
    uint16_t* data = const_cast<uint16_t*>(mkldnn_data(packed));
    const uint16_t* want = reinterpret_cast<const uint16_t*>(probe.const_data_ptr());
    bool same = kp >= k && kp % 2 == 0;
    for (int64_t r = 0; same && r < rows; r++) {
      for (int64_t c = 0; c < k; c++) {
        int64_t at = ((r / kBlock) * (kp / 2) + c / 2) * 2 * kBlock + (r % kBlock) * 2 + c % 2;
        if (data[at] != want[r * k + c]) {
          same = false;
          break;
        }
      }
    }
    if (same) {
      found = Scratch{packed, data, kp};
    }
  }
  cache.emplace_back(std::make_pair(rows, k), found);
  return found;
}

// y [M, N] = x [M, K] W^T (+ bias) for an int4 weight (packed [N, K/2] uint8, scale_zeros
// [K/32, N, 2] bf16; N a multiple of 64, K of 32), through W expanded to bf16 and oneDNN's
// packed product, at most kChunkRows rows at a time. Each chunk is expanded into a scratch
// that stays in the last-level cache for the product that follows.
at::Tensor int4_expanded(
    const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_zeros,
    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(cpu_has_bf16(), "this CPU lacks AVX512_BF16");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be 2-D bfloat16");
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.is_contiguous());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous());
  at::Tensor x = x_in.contiguous();
  int64_t m = x.size(0), k = x.size(1), n = scale_zeros.size(1);
  TORCH_CHECK(n % 64 == 0 && k % kGroup == 0 && packed.numel() == n * k / 2);
  TORCH_CHECK(scale_zeros.size(0) == k / kGroup && scale_zeros.size(2) == 2);
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scale_zeros.const_data_ptr());
  at::Tensor y;
  for (int64_t r0 = 0; r0 < n; r0 += kChunkRows) {
    int64_t rows = std::min(kChunkRows, n - r0);
    std::optional<Scratch> s = scratch(rows, k);
    TORCH_CHECK(s.has_value(), "oneDNN packs a ", rows, "x", k, " weight in another layout");
    at::parallel_for(r0 / 64, (r0 + rows) / 64, 1, [&](int64_t b0, int64_t b1) {
      int4_expand_blocked(wp, szp, n, k, s->kp, s->data + (b0 - r0 / 64) * s->kp * kBlock, b0, b1);
    });
    std::optional<at::Tensor> b;
    if (bias.has_value()) {
      b = rows == n ? *bias : bias->narrow(0, r0, rows).contiguous();
    }
    at::Tensor part = packed_linear(x, s->packed, b);
    if (rows == n) {
      y = part;
    } else {
      if (!y.defined()) {
        y = at::empty({m, n}, x.options());
      }
      y.narrow(1, r0, rows).copy_(part);
    }
  }
  return y;
}

// Whether int4_expanded runs for weights of `k` inputs (oneDNN's layout, checked).
bool int4_expandable(int64_t k) {
  return cpu_has_bf16() && scratch(std::min<int64_t>(kChunkRows, 64), k).has_value();
}

// The expanded weight itself, [N, K] (tests compare it with Int4Weight.dequantize()).
at::Tensor int4_expand(const at::Tensor& packed, const at::Tensor& scale_zeros) {
  TORCH_CHECK(cpu_has_bf16(), "this CPU lacks AVX512_BF16");
  int64_t n = scale_zeros.size(1), k = scale_zeros.size(0) * kGroup;
  TORCH_CHECK(n % 64 == 0 && packed.numel() == n * k / 2);
  // blocked [N/64][K/2][64][2] -> [N, K]
  at::Tensor out = at::empty({n / 64, k / 2, 64, 2}, at::TensorOptions().dtype(at::kBFloat16));
  int4_expand_blocked(
      packed.const_data_ptr<uint8_t>(),
      reinterpret_cast<const uint16_t*>(scale_zeros.const_data_ptr()), n, k, k,
      reinterpret_cast<uint16_t*>(out.mutable_data_ptr()), 0, n / 64);
  return out.permute({0, 2, 1, 3}).reshape({n, k});
}

// ------------------------------------------------------------------ decode attention

// exp of x <= 0 (Cephes' expf: ~1 ulp), 16 at a time
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The lane sums of 16 vectors: lane j of the result is the sum of v[j]'s 16 lanes. A
// transposing tree (four levels of shuffles and adds, then one permutation): 46
// instructions for 16 sums, against some 9 for each _mm512_reduce_add_ps.
__attribute__((target("avx512f"))) inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; k++) {  // 128-bit lanes 0-1: v[2k]'s halves summed; 2-3: v[2k+1]'s
    a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; k++) {  // 128-bit lane m: 4 partial sums of v[4k + m]
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
  }
  for (int k = 0; k < 2; k++) {  // in lane m: 2 partials of v[8k + m], 2 of v[8k + 4 + m]
    c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
  }
  // element 4m + k holds the sum of v[4k + m]
  __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// R query heads that share one KV head, of one item: o = softmax(q K^T * scale, over the
// allowed keys) V, in float32, over the K/V rows `rows[0..length)` of the pool layers
// `kc` / `vc` ([rows, D]). One pass over the keys in blocks of 16 (an online softmax):
// each K and V row is read once for the R heads, and the next block's rows are
// prefetched while this one computes.
template <typename T, int D16, int R>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void attend_heads(
    const T* q, const T* kc, const T* vc, const int64_t* rows, const bool* allow,
    int64_t length, float scale, T* out) {
  constexpr int64_t d = D16 * 16;
  constexpr int64_t AHEAD = PASTRY_AHEAD;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 qv[R][D16], o[R][D16];
  float top[R], total[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    #pragma GCC unroll 16
    for (int i = 0; i < D16; i++) {
      qv[r][i] = _mm512_mul_ps(load16(q + r * d + 16 * i), _mm512_set1_ps(scale));
      o[r][i] = _mm512_setzero_ps();
    }
    top[r] = neg_inf;
    total[r] = 0.0f;
  }
  __m512 dots[R][16];
  alignas(64) float probs[R][16];
  for (int64_t j0 = 0; j0 < length; j0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, length - j0));
    for (int t = 0; j0 + AHEAD + t < length && t < 16; t++) {  // rows AHEAD keys on, to L2
      const char* kn = reinterpret_cast<const char*>(kc + rows[j0 + AHEAD + t] * d);
      const char* vn = reinterpret_cast<const char*>(vc + rows[j0 + AHEAD + t] * d);
      for (int64_t line = 0; line < d * static_cast<int64_t>(sizeof(T)); line += 64) {
        _mm_prefetch(kn + line, _MM_HINT_T1);
        _mm_prefetch(vn + line, _MM_HINT_T1);
      }
    }
    uint32_t bits = 0;
    for (int t = 0; t < n; t++) {
      bits |= static_cast<uint32_t>(allow[j0 + t]) << t;
    }
    if (bits == 0) {
      continue;
    }
    for (int t = 0; t < 16; t++) {
      if (!((bits >> t) & 1u)) {
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          dots[r][t] = _mm512_setzero_ps();
        }
        continue;
      }
      const T* kr = kc + rows[j0 + t] * d;
      __m512 k0 = load16(kr);
      #pragma GCC unroll 16
      for (int r = 0; r < R; r++) {
        dots[r][t] = _mm512_mul_ps(qv[r][0], k0);
      }
      #pragma GCC unroll 16
      for (int i = 1; i < D16; i++) {
        __m512 ki = load16(kr + 16 * i);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          dots[r][t] = _mm512_fmadd_ps(qv[r][i], ki, dots[r][t]);
        }
      }
    }
    const __mmask16 live = static_cast<__mmask16>(bits);
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(neg_inf), lane_sums16(dots[r]));
      const float best = std::max(top[r], _mm512_reduce_max_ps(sc));  // finite: bits != 0
      const float rescale = std::exp(top[r] - best);  // 0 while nothing was allowed
      __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(best))));
      total[r] = total[r] * rescale + _mm512_reduce_add_ps(e);
      if (rescale != 1.0f) {
        #pragma GCC unroll 16
        for (int i = 0; i < D16; i++) {
          o[r][i] = _mm512_mul_ps(o[r][i], _mm512_set1_ps(rescale));
        }
      }
      top[r] = best;
      _mm512_store_ps(probs[r], e);
    }
    for (int t = 0; t < n; t++) {
      if (!((bits >> t) & 1u)) {
        continue;
      }
      const T* vr = vc + rows[j0 + t] * d;
      #pragma GCC unroll 16
      for (int i = 0; i < D16; i++) {
        __m512 vi = load16(vr + 16 * i);
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
          o[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(probs[r][t]), vi, o[r][i]);
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; r++) {
    alignas(64) float res[d];
    const __m512 inv = _mm512_set1_ps(1.0f / total[r]);
    #pragma GCC unroll 16
    for (int i = 0; i < D16; i++) {
      _mm512_store_ps(res + 16 * i, _mm512_mul_ps(o[r][i], inv));
    }
    for (int64_t c = 0; c < d; c++) {
      out[r * d + c] = static_cast<T>(res[c]);
    }
  }
}

// pastry_native::decode_attention: one new token per item. q [B, Hq, D] (after RoPE);
// pool [2 * layers, Hkv, S, D] (the KV pool, new K/V already stored); K of layer
// `k_layer`, V of `v_layer`; kv [Hkv, B, L] the rows of each item's keys in a layer viewed
// as [Hkv * S, D]; allow [B, L]. Returns o [B, Hq, D] in q's dtype: what the compiled
// step's gather, masked float32 softmax and products compute, without materialising the
// gathered K/V (one pass over them, one parallel region instead of a dozen kernels).
// Work items are (KV head, item), KV head first: a thread takes consecutive items of one
// KV head, so the rows of a prefix the items share (one prompt's cached pages) stay in
// its cache from one item to the next.
template <typename T, int D16>
void decode_attention_impl(
    const at::Tensor& q, const at::Tensor& pool, int64_t k_layer, int64_t v_layer,
    const at::Tensor& kv, const at::Tensor& allow, double scale, at::Tensor& out) {
  int64_t b = q.size(0), hq = q.size(1), hkv = pool.size(1), slots = pool.size(2);
  int64_t length = kv.size(2), rep = hq / hkv, d = D16 * 16;
  const T* qp = q.const_data_ptr<T>();
  const T* base = pool.const_data_ptr<T>();
  const T* kc = base + k_layer * hkv * slots * d;
  const T* vc = base + v_layer * hkv * slots * d;
  const int64_t* rows = kv.const_data_ptr<int64_t>();
  const bool* mask = allow.const_data_ptr<bool>();
  T* op = out.mutable_data_ptr<T>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, hkv * b, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      const int64_t g = t / b, i = t % b;
      const int64_t* r = rows + (g * b + i) * length;
      const bool* m = mask + i * length;
      for (int64_t h = g * rep; h < (g + 1) * rep;) {  // the KV head's query heads, 4 at a time
        const int64_t at = (i * hq + h) * d;
        switch (std::min<int64_t>(4, (g + 1) * rep - h)) {
          case 4:
            attend_heads<T, D16, 4>(qp + at, kc, vc, r, m, length, sc, op + at);
            h += 4;
            break;
          case 3:
            attend_heads<T, D16, 3>(qp + at, kc, vc, r, m, length, sc, op + at);
            h += 3;
            break;
          case 2:
            attend_heads<T, D16, 2>(qp + at, kc, vc, r, m, length, sc, op + at);
            h += 2;
            break;
          default:
            attend_heads<T, D16, 1>(qp + at, kc, vc, r, m, length, sc, op + at);
            h += 1;
        }
      }
    }
  });
}

at::Tensor decode_attention(
    const at::Tensor& q_in, const at::Tensor& pool, int64_t k_layer, int64_t v_layer,
    const at::Tensor& kv_in, const at::Tensor& allow_in, double scale) {
  TORCH_CHECK(cpu_has_bf16(), "this CPU lacks AVX512_BF16");
  TORCH_CHECK(q_in.dim() == 3 && pool.dim() == 4 && kv_in.dim() == 3 && allow_in.dim() == 2);
  TORCH_CHECK(pool.is_contiguous() && pool.scalar_type() == q_in.scalar_type());
  at::Tensor q = q_in.contiguous(), kv = kv_in.contiguous(), allow = allow_in.contiguous();
  int64_t b = q.size(0), hq = q.size(1), d = q.size(2), hkv = pool.size(1);
  TORCH_CHECK(pool.size(3) == d && hq % hkv == 0, "shapes of q and the pool disagree");
  TORCH_CHECK(kv.size(0) == hkv && kv.size(1) == b && allow.size(0) == b);
  TORCH_CHECK(allow.size(1) == kv.size(2) && kv.scalar_type() == at::kLong);
  TORCH_CHECK(allow.scalar_type() == at::kBool);
  at::Tensor out = at::empty_like(q);
  bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "decode_attention runs bf16 and float32");
  switch (d) {
#define PASTRY_ATTEND(D16)                                                                  \
  case D16 * 16:                                                                            \
    if (bf16) {                                                                             \
      decode_attention_impl<at::BFloat16, D16>(q, pool, k_layer, v_layer, kv, allow, scale, \
                                               out);                                        \
    } else {                                                                                \
      decode_attention_impl<float, D16>(q, pool, k_layer, v_layer, kv, allow, scale, out);  \
    }                                                                                       \
    break;
    PASTRY_ATTEND(1)
    PASTRY_ATTEND(2)
    PASTRY_ATTEND(4)
    PASTRY_ATTEND(5)
    PASTRY_ATTEND(6)
    PASTRY_ATTEND(8)
    PASTRY_ATTEND(16)
#undef PASTRY_ATTEND
    default:
      TORCH_CHECK(false, "decode_attention takes head dims 16 to 128 in 16s and 256, not ", d);
  }
  return out;
}

// Whether decode_attention takes this head dim.
bool attention_head_dim(int64_t d) {
  return cpu_has_bf16() && d % 16 == 0 && (d <= 128 ? d != 48 && d != 112 : d == 256);
}

// ------------------------------------------------------------------ float32 panels
//
// A float32 weight [N, K] is packed once, at load, into panels of 64 output columns:
// [ceil(N/64)][K][64], the last panel zero-padded (Linear.prepack; the plain weight is then
// dropped). Each thread takes whole panels and walks a panel in chunks of kPanelK inputs
// (32 KB, held in L1); each chunk serves every row of x, six rows at a time (24
// accumulators: 6 rows x 4 vectors of 16 columns; per input, 4 loads of the weight, 6
// broadcasts of x and 24 FMAs), while the first row block prefetches the next chunk. The
// weight so streams from memory once per call whatever the row count, where MKL's sgemm
// over the [N, K] weight streams it at about half the bandwidth for 4-32 rows (decode
// batches; measured on SmolLM2-135M's projections, benchmarks/RESULTS.md). Each output is
// a float32 sum, blocked by chunk (panel_rows): results differ from sgemm's in the last bits.

constexpr int64_t kPanel = 64;    // output columns per panel
constexpr int64_t kPanelK = 128;  // inputs per chunk of a panel
constexpr int kPanelRows = 6;     // rows of x per pass over a chunk
constexpr int64_t kPanelSplitRows = 96;  // from these rows, a panel's rows split in two

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

at::Tensor panel_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w must be a 2-D float32 weight");
  int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(n > 0 && k > 0, "an empty weight");
  at::Tensor padded = at::zeros({panels * kPanel, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

// y[MR rows, one panel's columns] (+)= x[MR rows, kc inputs] * chunk [kc][64]; `mask`
// selects the panel's columns that exist; `next` (or null) is prefetched into L1. A chunk
// sums into fresh accumulators that are then added to y: sums of at most kPanelK terms in
// a row, then one per chunk (rounding error grows with 128 + K/128 terms, not with K: sgemm
// blocks its sums alike, and the logits stay within 1e-4 of transformers'). The loops
// over rows and vectors are unrolled (the library builds at -O2, which would otherwise
// keep the 24 accumulators in memory).
template <int MR>
__attribute__((target("avx512f"))) void panel_rows(
    const float* x, int64_t xs, const float* w, int64_t kc, float* y, int64_t ys,
    const __mmask16* mask, bool first, const float* next) {
  __m512 acc[MR][4];
  #pragma GCC unroll 8
  for (int m = 0; m < MR; m++) {
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      acc[m][j] = _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < kc; kk++) {
    const float* wk = w + kk * kPanel;
    if (next != nullptr) {
      const char* pf = reinterpret_cast<const char*>(next + kk * kPanel);
      _mm_prefetch(pf, _MM_HINT_T0);
      _mm_prefetch(pf + 64, _MM_HINT_T0);
      _mm_prefetch(pf + 128, _MM_HINT_T0);
      _mm_prefetch(pf + 192, _MM_HINT_T0);
    }
    __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    #pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
      __m512 xv = _mm512_set1_ps(x[m * xs + kk]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xv, w3, acc[m][3]);
    }
  }
  #pragma GCC unroll 8
  for (int m = 0; m < MR; m++) {
    #pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      float* out = y + m * ys + j * 16;
      __m512 sum = first ? acc[m][j] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask[j], out), acc[m][j]);
      _mm512_mask_storeu_ps(out, mask[j], sum);
    }
  }
}

using PanelRows = void (*)(
    const float*, int64_t, const float*, int64_t, float*, int64_t, const __mmask16*, bool,
    const float*);
const PanelRows kPanelRowsOf[kPanelRows + 1] = {
    nullptr, panel_rows<1>, panel_rows<2>, panel_rows<3>, panel_rows<4>, panel_rows<5>,
    panel_rows<6>};

// y [M, N] = x [M, K] W^T (+ bias), W packed by panel_pack.
at::Tensor panel_linear(
    const at::Tensor& x_in, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
    int64_t n) {
  TORCH_CHECK(cpu_has_avx512(), "this CPU lacks AVX-512");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be 2-D float32");
  TORCH_CHECK(
      panels.dim() == 3 && panels.size(2) == kPanel && panels.scalar_type() == at::kFloat &&
          panels.is_contiguous(),
      "not a weight of panel_pack");
  at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  int64_t m = x.size(0), k = x.size(1), count = panels.size(0);
  TORCH_CHECK(panels.size(1) == k, "x has ", k, " columns, the weight ", panels.size(1));
  TORCH_CHECK(n > (count - 1) * kPanel && n <= count * kPanel, "n does not match the panels");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m > 0) {
    const float* xp = x.const_data_ptr<float>();
    const float* wp = panels.const_data_ptr<float>();
    float* yp = y.mutable_data_ptr<float>();
    int64_t xs = x.stride(0);
    // work items: a panel times a share of the rows. Few rows (decode): one share, each
    // thread streams whole panels. Many rows: two shares of whole row blocks, so that two
    // threads stay even when N has an odd number of panels (SmolLM2's 576 = 9 panels).
    int64_t blocks = (m + kPanelRows - 1) / kPanelRows;
    int64_t shares = m >= kPanelSplitRows ? 2 : 1;
    int64_t per = (blocks + shares - 1) / shares * kPanelRows;
    at::parallel_for(0, count * shares, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; i++) {
        int64_t p = i / shares, r0 = (i % shares) * per, r1 = std::min(m, r0 + per);
        int64_t cols = std::min(kPanel, n - p * kPanel);
        __mmask16 mask[4];
        for (int j = 0; j < 4; j++) {
          int64_t c = std::clamp<int64_t>(cols - j * 16, 0, 16);
          mask[j] = static_cast<__mmask16>((1u << c) - 1);
        }
        const float* panel = wp + p * k * kPanel;
        for (int64_t k0 = 0; k0 < k; k0 += kPanelK) {
          int64_t kc = std::min(kPanelK, k - k0);
          const float* next = k0 + kPanelK < k ? panel + (k0 + kPanelK) * kPanel
                              : i + 1 < i1     ? wp + (i + 1) / shares * k * kPanel
                                               : nullptr;
          for (int64_t r = r0; r < r1; r += kPanelRows) {
            int rows = static_cast<int>(std::min<int64_t>(kPanelRows, r1 - r));
            kPanelRowsOf[rows](
                xp + r * xs + k0, xs, panel + k0 * kPanel, kc, yp + r * n + p * kPanel, n, mask,
                k0 == 0, r == r0 ? next : nullptr);
          }
        }
      }
    });
  }
  if (bias.has_value()) {
    y.add_(*bias);
  }
  return y;
}

bool panel_supported() { return cpu_has_avx512(); }

// ------------------------------------------------------------------ int4 x int8 (VNNI)
//
// The llama.cpp approach for few rows: the activations are quantized to int8 per group of
// 32 inputs (x ~ d * xq, d = max|x| / 127) and the int4 weight multiplies them in integers:
// one vpdpbusd sums, for each of 16 output rows, the products of 4 unsigned codes and 4
// signed activations. With w = q * s + m per group (q in 0..15; m = zero - 8 * scale),
// y += s * d * sum(q * xq) + m * d * sum(xq): the product of w and the quantized x, whose
// error is sum(w * (x - d * xq)) (with x's own sum in the second term, the error would be
// s * sum(q * (x - d * xq)) over codes that are all positive: ~2x larger; llama.cpp's Q8_1
// sums alike).
// The weight is Pastry's own layout, packed once at load (pastry/engine/native.py,
// q4_pack): [N/16][K/8][16][4] bytes, byte b of row j's four for inputs k0..k0+7 holding
// the code of input k0 + b (low nibble) and of k0 + 4 + b (high), so that one 64-byte load
// holds 16 rows x 8 inputs; scales and mins as [N/16][K/32][2][16] float32. Per 16 rows, 32
// inputs and row of x: 4 loads, 8 vpdpbusd, 2 FMAs; the weight streams from memory once per
// kQ4Rows rows of x (a block's bytes stay in L1 for the next rows).

constexpr int kQ4Rows = 8;  // rows of x per pass over a block of the weight

bool cpu_has_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

// Rows of x [M, K] as int8 per group of 32 (xq [M, K]), their scales d and d * sum(xq)
// (sx) [M, G].
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void q8_rows(
    const T* x, int64_t m, int64_t k, int8_t* xq, float* d, float* sx) {
  int64_t groups = k / 32;
  for (int64_t r = 0; r < m; r++) {
    for (int64_t g = 0; g < groups; g++) {
      const T* xg = x + r * k + g * 32;
      __m512 a = load16(xg), b = load16(xg + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m512 vi = _mm512_set1_ps(inv);
      // rounded to nearest (even), as the MXCSR default; |x| * inv <= 127
      __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vi));
      __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vi));
      int8_t* out = xq + r * k + g * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qb));
      int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      d[r * groups + g] = scale;
      sx[r * groups + g] = scale * static_cast<float>(sum);
    }
  }
}

// y[MR rows, 16 columns] = x[MR rows] * one 16-row block of the weight (see above).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void q4_block(
    const uint8_t* w, const float* sm, int64_t groups, const int8_t* xq, int64_t k,
    const float* d, const float* sx, float* y, int64_t ys) {
  __m512 acc[MR];
  #pragma GCC unroll 8
  for (int r = 0; r < MR; r++) {
    acc[r] = _mm512_setzero_ps();
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* wg = w + g * 256;
    __m512i c[8];
    #pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      __m512i v = _mm512_loadu_si512(wg + i * 64);
      c[2 * i] = _mm512_and_si512(v, low);                         // inputs 8i .. 8i+3
      c[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);  // 8i+4 .. 8i+7
    }
    __m512 s = _mm512_loadu_ps(sm + g * 32), mn = _mm512_loadu_ps(sm + g * 32 + 16);
    #pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
      const int8_t* xg = xq + r * k + g * 32;
      __m512i t = _mm512_setzero_si512();
      #pragma GCC unroll 8
      for (int i = 0; i < 8; i++) {
        int32_t four;
        std::memcpy(&four, xg + 4 * i, 4);
        t = _mm512_dpbusd_epi32(t, c[i], _mm512_set1_epi32(four));
      }
      __m512 dr = _mm512_set1_ps(d[r * groups + g]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(s, dr), acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * groups + g]), acc[r]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < MR; r++) {
    _mm512_storeu_ps(y + r * ys, acc[r]);
  }
}

using Q4Block = void (*)(const uint8_t*, const float*, int64_t, const int8_t*, int64_t,
                         const float*, const float*, float*, int64_t);
constexpr Q4Block kQ4BlockOf[kQ4Rows + 1] = {
    nullptr, q4_block<1>, q4_block<2>, q4_block<3>, q4_block<4>,
    q4_block<5>, q4_block<6>, q4_block<7>, q4_block<8>};

// y [M, N] = x [M, K] W^T (+ bias) for an int4 weight in the layout above (packed
// [N/16, K/8, 16, 4] uint8, sm [N/16, K/32, 2, 16] float32); y in x's dtype.
at::Tensor q4_linear(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sm,
    const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(cpu_has_vnni(), "this CPU lacks AVX512_VNNI");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  TORCH_CHECK(
      x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
      "x must be float32 or bfloat16");
  int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(
      packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(1) * 8 == k &&
          packed.size(2) == 16 && packed.size(3) == 4 && packed.is_contiguous(),
      "packed must be a contiguous uint8 [N/16, K/8, 16, 4] for K = ", k);
  int64_t blocks = packed.size(0), groups = k / 32, n = blocks * 16;
  TORCH_CHECK(k % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(
      sm.dim() == 4 && sm.scalar_type() == at::kFloat && sm.size(0) == blocks &&
          sm.size(1) == groups && sm.size(2) == 2 && sm.size(3) == 16 && sm.is_contiguous(),
      "sm must be a contiguous float32 [N/16, K/32, 2, 16]");
  at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor ds = at::empty({2, m, groups}, x.options().dtype(at::kFloat));
  float* d = ds.data_ptr<float>();
  float* sx = d + m * groups;
  if (x.scalar_type() == at::kFloat) {
    q8_rows(xc.data_ptr<float>(), m, k, xq.data_ptr<int8_t>(), d, sx);
  } else {
    q8_rows(xc.data_ptr<at::BFloat16>(), m, k, xq.data_ptr<int8_t>(), d, sx);
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = sm.data_ptr<float>();
  const int8_t* qp = xq.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      for (int64_t r = 0; r < m; r += kQ4Rows) {
        int rows = static_cast<int>(std::min<int64_t>(kQ4Rows, m - r));
        kQ4BlockOf[rows](
            wp + b * (k / 8) * 64, sp + b * groups * 32, groups, qp + r * k, k,
            d + r * groups, sx + r * groups, yp + r * n + b * 16, n);
      }
    }
  });
  if (bias.has_value()) {
    y.add_(*bias);
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

bool q4_supported() { return cpu_has_vnni(); }

// ------------------------------------------------------------------ pastry::linear

// How a projection multiplies (pastry.engine.native.DENSE / BLOCKED / INT4 / INT8 / PANELS / Q4).
constexpr int64_t kDense = 0;    // oneDNN-packed (mkldnn layout) or a plain [N, K] weight
constexpr int64_t kBlocked = 1;  // oneDNN-packed, read in place below `small_m` rows
constexpr int64_t kInt4 = 2;     // _weight_int4pack_mm_for_cpu, groups of 32
constexpr int64_t kInt8 = 3;     // _weight_int8pack_mm, per-channel scales
constexpr int64_t kPanels = 4;   // float32 panels (panel_pack), at every row count
constexpr int64_t kQ4 = 5;       // int4 in q4_linear's layout (scales: its sm)

// Linear.forward of a dense weight: oneDNN's packed product, or F.linear.
at::Tensor dense_linear(
    const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  if (w.is_mkldnn()) {
    return packed_linear(x, w, bias);
  }
  return at::linear(x, w, bias);
}

at::Tensor add_bias(at::Tensor y, const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? y + *bias : y;
}

struct Projection {
  int64_t kind;
  at::Tensor weight;                 // packed / plain / int4 codes / int8 codes
  std::optional<at::Tensor> scales;  // int4: scale_zeros; int8: scales; q4: sm
  std::optional<at::Tensor> dense;   // int4, q4: the expanded copy (packed or plain)
  std::optional<at::Tensor> bias;
  int64_t threshold;  // blocked: rows below which it runs; int4, q4: rows from which
                      // `dense` runs; int8: rows from which the weight is expanded
  int64_t expand_from;  // int4 without `dense`: rows from which it is expanded (0: never)
  int64_t n, kp;      // blocked: output rows, padded inputs; panels: output rows
  const uint16_t* data;  // blocked: the packed bytes
};

struct Projections : torch::CustomClassHolder {
  std::vector<Projection> items;

  // kind, weight, scales, dense copy, bias, threshold, expand_from, n, kp (see Projection)
  void add(
      int64_t kind, at::Tensor weight, std::optional<at::Tensor> scales,
      std::optional<at::Tensor> dense, std::optional<at::Tensor> bias, int64_t threshold,
      int64_t expand_from, int64_t n, int64_t kp) {
    TORCH_CHECK(kind >= kDense && kind <= kQ4, "unknown projection kind ", kind);
    TORCH_CHECK(kind != kPanels || cpu_has_avx512(), "this CPU lacks AVX-512");
    TORCH_CHECK(kind != kQ4 || cpu_has_vnni(), "this CPU lacks AVX512_VNNI");
    TORCH_CHECK(
        (kind != kInt4 && kind != kInt8 && kind != kQ4) || scales.has_value(),
        "a quantized projection needs its scales");
    const uint16_t* data = nullptr;
    if (kind == kBlocked) {
      TORCH_CHECK(cpu_has_bf16(), "this CPU lacks AVX512_BF16");
      TORCH_CHECK(weight.is_mkldnn(), "a blocked projection needs a oneDNN-packed weight");
      data = mkldnn_data(weight);
    }
    TORCH_CHECK(expand_from == 0 || (kind == kInt4 && cpu_has_bf16()), "cannot expand");
    items.push_back(Projection{
        kind, std::move(weight), std::move(scales), std::move(dense), std::move(bias),
        threshold, expand_from, n, kp, data});
  }

  int64_t size() const { return static_cast<int64_t>(items.size()); }

  at::Tensor run(int64_t index, const at::Tensor& x) const {
    TORCH_CHECK(index >= 0 && index < size(), "projection ", index, " of ", size());
    const Projection& p = items[index];
    switch (p.kind) {
      case kDense:
        return dense_linear(x, p.weight, p.bias);
      case kPanels:
        return panel_linear(x, p.weight, p.bias, p.n);
      case kBlocked:
        if (x.size(0) < p.threshold) {
          return blocked_product(x, p.data, p.n, p.kp, p.bias);
        }
        return packed_linear(x, p.weight, p.bias);
      case kQ4:
        if (p.dense.has_value() && x.size(0) >= p.threshold) {
          return add_bias(dense_linear(x, *p.dense, std::nullopt), p.bias);
        }
        return add_bias(q4_linear(x, p.weight, *p.scales, std::nullopt), p.bias);
      case kInt4:
        if (p.dense.has_value() && x.size(0) >= p.threshold) {
          return add_bias(dense_linear(x, *p.dense, std::nullopt), p.bias);
        }
        if (p.expand_from > 0 && x.size(0) >= p.expand_from) {
          return add_bias(int4_expanded(x, p.weight, *p.scales, std::nullopt), p.bias);
        }
        return add_bias(
            at::_weight_int4pack_mm_for_cpu(x.contiguous(), p.weight, 32, *p.scales), p.bias);
      default:  // kInt8
        if (x.size(0) >= p.threshold) {
          at::Tensor w = p.weight.to(p.scales->scalar_type()) * p.scales->unsqueeze(1);
          return add_bias(at::linear(x, w), p.bias);
        }
        return add_bias(at::_weight_int8pack_mm(x.contiguous(), p.weight, *p.scales), p.bias);
    }
  }

  void use();
  void release();
};

// The projections of the model the calling thread is running (engines of one process
// each forward on their own worker thread).
thread_local Projections* current = nullptr;

void Projections::use() { current = this; }
void Projections::release() {
  if (current == this) {
    current = nullptr;
  }
}

at::Tensor linear(const at::Tensor& x, int64_t index, int64_t out_features) {
  TORCH_CHECK(current != nullptr, "pastry::linear called outside CompiledDecode");
  return current->run(index, x);
}

// Projection `index` of `projections`, outside a step (tests compare it with Linear.forward).
at::Tensor call(const c10::intrusive_ptr<Projections>& projections, int64_t index, at::Tensor x) {
  return projections->run(index, x);
}

}  // namespace

TORCH_LIBRARY(pastry_native, m) {
  m.class_<Projections>("Projections")
      .def(torch::init<>())
      .def("add", &Projections::add)
      .def("size", &Projections::size)
      .def("use", &Projections::use)
      .def("release", &Projections::release);
  m.def("call", &call);
  m.def("supported", &supported);
  m.def("blocked_linear", &blocked_linear);
  m.def("panel_pack", &panel_pack);
  m.def("panel_linear", &panel_linear);
  m.def("panel_supported", &panel_supported);
  m.def("q4_linear", &q4_linear);
  m.def("q4_supported", &q4_supported);
  m.def("int4_expanded", &int4_expanded);
  m.def("int4_expand", &int4_expand);
  m.def("int4_expandable", &int4_expandable);
  m.def("attention_head_dim", &attention_head_dim);
  // a CPU kernel (not a composite one), so that the compiler keeps it opaque
  m.def(
      "decode_attention(Tensor q, Tensor pool, int k_layer, int v_layer, Tensor kv, "
      "Tensor allow, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pastry, CPU, m) { m.impl("linear", &linear); }

TORCH_LIBRARY_IMPL(pastry_native, CPU, m) { m.impl("decode_attention", &decode_attention); }
