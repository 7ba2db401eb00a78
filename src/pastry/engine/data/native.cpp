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
// 2. The CPU kernel of pastry::linear, the compiled decode step's opaque projection call
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

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

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

// ------------------------------------------------------------------ pastry::linear

// How a projection multiplies (pastry.engine.native.DENSE / BLOCKED / INT4 / INT8).
constexpr int64_t kDense = 0;    // oneDNN-packed (mkldnn layout) or a plain [N, K] weight
constexpr int64_t kBlocked = 1;  // oneDNN-packed, read in place below `small_m` rows
constexpr int64_t kInt4 = 2;     // _weight_int4pack_mm_for_cpu, groups of 32
constexpr int64_t kInt8 = 3;     // _weight_int8pack_mm, per-channel scales

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
  std::optional<at::Tensor> scales;  // int4: scale_zeros; int8: scales
  std::optional<at::Tensor> dense;   // int4: the expanded copy (packed or plain)
  std::optional<at::Tensor> bias;
  int64_t threshold;  // blocked: rows below which it runs; int4: rows from which `dense`
                      // runs; int8: rows from which the weight is expanded
  int64_t n, kp;      // blocked: output rows, padded inputs
  const uint16_t* data;  // blocked: the packed bytes
};

struct Projections : torch::CustomClassHolder {
  std::vector<Projection> items;

  // kind, weight, scales, dense copy, bias, threshold, n, kp (see Projection)
  void add(
      int64_t kind, at::Tensor weight, std::optional<at::Tensor> scales,
      std::optional<at::Tensor> dense, std::optional<at::Tensor> bias, int64_t threshold,
      int64_t n, int64_t kp) {
    TORCH_CHECK(kind >= kDense && kind <= kInt8, "unknown projection kind ", kind);
    TORCH_CHECK(kind < kInt4 || scales.has_value(), "a quantized projection needs its scales");
    const uint16_t* data = nullptr;
    if (kind == kBlocked) {
      TORCH_CHECK(cpu_has_bf16(), "this CPU lacks AVX512_BF16");
      TORCH_CHECK(weight.is_mkldnn(), "a blocked projection needs a oneDNN-packed weight");
      data = mkldnn_data(weight);
    }
    items.push_back(Projection{
        kind, std::move(weight), std::move(scales), std::move(dense), std::move(bias),
        threshold, n, kp, data});
  }

  int64_t size() const { return static_cast<int64_t>(items.size()); }

  at::Tensor run(int64_t index, const at::Tensor& x) const {
    TORCH_CHECK(index >= 0 && index < size(), "projection ", index, " of ", size());
    const Projection& p = items[index];
    switch (p.kind) {
      case kDense:
        return dense_linear(x, p.weight, p.bias);
      case kBlocked:
        if (x.size(0) < p.threshold) {
          return blocked_product(x, p.data, p.n, p.kp, p.bias);
        }
        return packed_linear(x, p.weight, p.bias);
      case kInt4:
        if (p.dense.has_value() && x.size(0) >= p.threshold) {
          return add_bias(dense_linear(x, *p.dense, std::nullopt), p.bias);
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
}

TORCH_LIBRARY_IMPL(pastry, CPU, m) { m.impl("linear", &linear); }
