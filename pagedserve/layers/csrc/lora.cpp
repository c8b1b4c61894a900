// The LoRA product of one linear layer for a step that mixes adapters (layers/lora.py):
//   y[t] += B_s^T (A_s x[t])   for every row t whose adapter slot s = slots[t] is > 0,
// each row multiplying only its own adapter's columns (the dense masked form computes
// every resident adapter's for every row).  A_all [C, in] holds each slot's A rows
// stacked, Bt_all [C, out] each slot's B (transposed, pre-scaled) rows; slot s owns rows
// [col_start[s], col_start[s + 1]) of both.  Float accumulation, for float32 and bfloat16
// tensors; rows run in parallel when there is enough work.  Plain loops: the compiler
// vectorizes them for the machine (-march=native; the inner loops are long and contiguous).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 16;

template <typename T>
void apply_rows(const T* x, T* y, const T* a, const T* bt, const int64_t* col_start, int64_t num_slots,
                const int64_t* slots, int64_t begin, int64_t end, int64_t in, int64_t out) {
  std::vector<float> xf(in), yf(out), xa;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t s = slots[t];
    if (s <= 0 || s >= num_slots) continue;
    const int64_t c0 = col_start[s], r = col_start[s + 1] - c0;
    if (r <= 0) continue;
    const T* xr = x + t * in;
    for (int64_t i = 0; i < in; ++i) xf[i] = static_cast<float>(xr[i]);
    xa.assign(r, 0.f);
    for (int64_t c = 0; c < r; ++c) {
      const T* ar = a + (c0 + c) * in;
      // 16 partial sums, one per lane: a vector loop without reassociating a float sum.
      float lanes[kLanes] = {0.f};
      int64_t i = 0;
      for (; i + kLanes <= in; i += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<float>(ar[i + l]) * xf[i + l];
      float acc = 0.f;
      for (; i < in; ++i) acc += static_cast<float>(ar[i]) * xf[i];
      for (int l = 0; l < kLanes; ++l) acc += lanes[l];
      xa[c] = acc;
    }
    std::fill(yf.begin(), yf.end(), 0.f);
    for (int64_t c = 0; c < r; ++c) {
      const T* br = bt + (c0 + c) * out;
      const float v = xa[c];
      for (int64_t o = 0; o < out; ++o) yf[o] += v * static_cast<float>(br[o]);
    }
    T* yr = y + t * out;
    for (int64_t o = 0; o < out; ++o) yr[o] = static_cast<T>(static_cast<float>(yr[o]) + yf[o]);
  }
}

void apply(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const at::Tensor& bt,
           const at::Tensor& col_start, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && a.dim() == 2 && bt.dim() == 2, "lora: 2-D tensors expected");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && bt.is_contiguous(),
              "lora: contiguous tensors expected");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == a.scalar_type() &&
              x.scalar_type() == bt.scalar_type(), "lora: x, y, A and B must share a dtype");
  TORCH_CHECK(col_start.scalar_type() == at::kLong && slots.scalar_type() == at::kLong, "lora: int64 indices");
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1);
  TORCH_CHECK(y.size(0) == rows && slots.numel() == rows && a.size(1) == in && bt.size(1) == out &&
              a.size(0) == bt.size(0), "lora: shapes do not match");
  const int64_t num_slots = col_start.numel() - 1;
  const int64_t* cs = col_start.data_ptr<int64_t>();
  TORCH_CHECK(num_slots >= 1 && cs[num_slots] == a.size(0), "lora: col_start must end at A's rows");
  const int64_t per_row = (a.size(0) / num_slots + 1) * (in + out);
  const int64_t grain = std::max<int64_t>(1, 200000 / std::max<int64_t>(per_row, 1));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "lora_apply", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* bp = bt.data_ptr<scalar_t>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      apply_rows<scalar_t>(xp, yp, ap, bp, cs, num_slots, sp, begin, end, in, out);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply", &apply, pybind11::call_guard<pybind11::gil_scoped_release>());
}
