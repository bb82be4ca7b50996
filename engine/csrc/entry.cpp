// The tensor-facing entry points of the kernels (any instruction set: quant.cpp for AVX-512,
// quant_avx2.cpp for AVX2 implement linear() and expert() beneath them).
#include "quant.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

namespace ms {

QW make_qw(int64_t fmt, int64_t G, int64_t N, int64_t K, const at::Tensor& codes,
           const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(fmt >= 0 && fmt <= 4, "bad format id");
  TORCH_CHECK(K % 32 == 0 && (fmt == F_BF16 || K % G == 0), "K must be a multiple of 32 and of G");
  TORCH_CHECK(fmt != F_MXFP4 || G == 32, "mxfp4 has blocks of 32");
  TORCH_CHECK(codes.is_contiguous(), "codes must be contiguous");
  int64_t want = fmt == F_INT4 || fmt == F_NF4 || fmt == F_MXFP4 ? N * K / 2 : fmt == F_INT8 ? N * K : N * K * 2;
  TORCH_CHECK(codes.numel() * codes.element_size() == want, "codes have the wrong size");
  QW w{(int)fmt, G, N, K, (const uint8_t*)codes.data_ptr(), nullptr, nullptr};
  if (fmt == F_MXFP4) {  // E8M0 bytes, one per block of 32
    TORCH_CHECK(scales.is_contiguous() && scales.numel() == N * (K / 32) && scales.element_size() == 1, "bad scales");
    w.scales = (const uint16_t*)scales.data_ptr();
  } else if (fmt != F_BF16) {
    TORCH_CHECK(scales.is_contiguous() && scales.numel() == N * (K / G) && scales.element_size() == 2, "bad scales");
    w.scales = (const uint16_t*)scales.data_ptr();
  }
  if (fmt == F_INT4) {
    TORCH_CHECK(mins.is_contiguous() && mins.numel() == N * (K / G) && mins.element_size() == 2, "bad mins");
    w.mins = (const uint16_t*)mins.data_ptr();
  }
  return w;
}

at::Tensor as_f32_2d(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [T, ", K, "]");
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x;
  return x.to(at::kFloat).contiguous();
}

at::Tensor qlinear(at::Tensor x, int64_t fmt, int64_t G, int64_t N, int64_t K, at::Tensor codes,
                   at::Tensor scales, at::Tensor mins, int64_t direct_max_t, int64_t i8a) {
  QW w = make_qw(fmt, G, N, K, codes, scales, mins);
  at::Tensor xf = as_f32_2d(x, K);
  at::Tensor out = at::empty({xf.size(0), N}, at::kFloat);
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;  // other Python threads (disk readers) run meanwhile
  linear(w, xp, xf.size(0), op, direct_max_t, i8a != 0);
  return out;
}

// SwiGLU expert: out[T, H] = (silu(x @ gate.T) * (x @ up.T)) @ down.T; gate/up [I, H], down [H, I].
at::Tensor expert_forward(at::Tensor x, int64_t fmt, int64_t G, int64_t I, int64_t H,
                          at::Tensor gc, at::Tensor gs, at::Tensor gm,
                          at::Tensor uc, at::Tensor us, at::Tensor um,
                          at::Tensor dc, at::Tensor ds, at::Tensor dm,
                          int64_t direct_max_t, int64_t i8a) {
  QW wg = make_qw(fmt, G, I, H, gc, gs, gm), wu = make_qw(fmt, G, I, H, uc, us, um),
     wd = make_qw(fmt, G, H, I, dc, ds, dm);
  at::Tensor xf = as_f32_2d(x, H);
  at::Tensor out = at::empty({xf.size(0), H}, at::kFloat);
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  expert(wg, wu, wd, xp, xf.size(0), op, direct_max_t, i8a != 0);
  return out;
}

}  // namespace ms
