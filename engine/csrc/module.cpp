// Python bindings of the native kernels (built by engine/quant/kernels.py:load_extension).
#include "deltanet.h"
#include "deepseek.h"
#include "phases.h"
#include "pool.h"
#include "quant.h"
#include "i8a.h"
#include "step.h"

#include <ATen/ops/empty.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

// The classes are module-local: the AVX-512 and AVX2 builds can be loaded in one process.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &ms::qlinear, "out[T, N] = x[T, K] @ w[N, K].T for a quantized w");
  m.def("expert_forward", &ms::expert_forward, "SwiGLU expert on quantized gate/up/down");
  m.def("set_prefetch_rows", &ms::set_prefetch_rows, "software prefetch distance in rows (bench)");
  m.def("has_vnni", &ms::has_vnni, "whether this CPU has AVX512-VNNI (the AVX-512 build's integer-activation kernels)");
  m.def("has_int8_dots", &ms::has_int8_dots,
        "whether this build has integer-activation kernels here (AVX512-VNNI, or AVX2's vpmaddubsw/vpmaddwd)");
  m.def("amx_usable", &ms::amx_usable, "whether this CPU and kernel let the process use AMX-INT8 tiles");
  m.def("amx_on", &ms::amx_on, "whether prefill-sized int4 x int8 calls take the AMX kernel");
  m.def("i8a_act_bytes", &ms::quant_act_bytes,
        "bytes of one token's int8 activations for K weights (whole 512-byte groups: the VNNI kernel's loads)");
  m.def("set_amx", &ms::set_amx, "turn the AMX kernel on or off (same bits as VNNI); returns the previous setting");
  m.def("stream_nta", &ms::stream_nta, "whether the kernels request streamed weight rows with prefetchnta (quant.h)");
  m.def("set_stream_nta", &ms::set_stream_nta,
        "prefetchnta (on) or prefetcht0 for streamed weight rows (a hint: same bits); returns the previous setting");

  py::class_<ms::Linear>(m, "Linear", py::module_local()).def(py::init(&ms::make_linear));
  py::class_<ms::Attn>(m, "Attn", py::module_local())
      .def(py::init([](ms::Linear q, ms::Linear k, ms::Linear v, ms::Linear o, at::Tensor ln1,
                       at::Tensor ln2, at::Tensor qn, at::Tensor kn, int64_t nh, int64_t nkv, int64_t d,
                       double eps) {
        return ms::Attn{q, k, v, o, ln1, ln2, qn, kn, nh, nkv, d, eps};
      }))
      .def_readwrite("gated", &ms::Attn::gated)
      .def_readwrite("rotary_dim", &ms::Attn::rotary_dim)
      .def_readwrite("sinks", &ms::Attn::sinks)
      .def_readwrite("window", &ms::Attn::window);
  py::class_<ms::ExpertAct>(m, "ExpertAct", py::module_local())
      .def(py::init([](int64_t act, double alpha, double limit, at::Tensor gb, at::Tensor ub, at::Tensor db) {
        return ms::ExpertAct{act, alpha, limit, gb, ub, db};
      }));
  py::class_<ms::FFN>(m, "FFN", py::module_local()).def(py::init([](ms::Linear g, ms::Linear u, ms::Linear d, at::Tensor gate) {
    return ms::FFN{g, u, d, gate};
  }));
  py::class_<ms::DeltaNet>(m, "DeltaNet", py::module_local())
      .def(py::init([](ms::Linear qkvz, ms::Linear ba, ms::Linear out, at::Tensor ln1, at::Tensor ln2,
                       at::Tensor conv, at::Tensor a, at::Tensor dt_bias, at::Tensor norm, int64_t nk, int64_t nv,
                       int64_t dk, int64_t dv, double eps) {
        return ms::DeltaNet{qkvz, ba, out, ln1, ln2, conv, a, dt_bias, norm, nk, nv, dk, dv, eps};
      }));
  py::class_<ms::MLA>(m, "MLA", py::module_local())
      .def(py::init([](std::optional<ms::Linear> qa, ms::Linear qb, ms::Linear kva, ms::Linear o, at::Tensor ln1,
                       at::Tensor ln2, at::Tensor qan, at::Tensor kvan, at::Tensor wuk, at::Tensor wuv, int64_t nh,
                       int64_t rank, int64_t rope, int64_t nope, int64_t vd, int64_t half, double eps, double eps_q,
                       double eps_kv, double scale, bool interleave) {
        return ms::MLA{qa, qb, kva, o, ln1, ln2, qan, kvan, wuk, wuv, nh, rank, rope, nope, vd, half,
                       eps, eps_q, eps_kv, scale, interleave};
      }))
      .def_readwrite("kvb", &ms::MLA::kvb);
  py::class_<ms::GroupRouter>(m, "GroupRouter", py::module_local())
      .def(py::init([](at::Tensor w, at::Tensor bias, int64_t top_k, int64_t n_group, int64_t topk_group,
                       bool normalize, double scaling) {
        return ms::GroupRouter{w, bias, top_k, n_group, topk_group, normalize, scaling};
      }));
  py::class_<ms::Layers>(m, "Layers", py::module_local())
      .def(py::init([](std::vector<ms::Attn> attn, std::vector<std::optional<ms::FFN>> ffn,
                       std::vector<at::Tensor> router, std::vector<int64_t> top_k, std::vector<bool> normalize,
                       std::optional<ms::Linear> head, at::Tensor norm, double eps) {
        return ms::Layers{attn, ffn, router, top_k, normalize, head, norm, eps};
      }));
  m.attr("SLOT_ROW") = ms::SLOT_ROW;
  m.def("set_phase_timing", [](bool on) { ms::g_phase_timing.store(on); },
        "time the step's phases on the calling thread (phases.h)");
  m.def("phase_times", [](bool reset) {
    py::dict out;
    for (int p = 0; p < ms::PH_COUNT; p++) {
      out[ms::PHASE_NAMES[p]] = ms::g_phase_seconds[p];
      if (reset) ms::g_phase_seconds[p] = 0.0;
    }
    return out;
  }, "seconds spent in each phase of the step since the last reset", py::arg("reset") = false);
  m.def("set_threads", &ms::set_threads, "threads (caller included) of the native worker pool");
  m.def("num_threads", &ms::num_threads, "threads of the native worker pool");
  m.def("parallel_selfcheck", [](int64_t jobs, int64_t n) {
    py::gil_scoped_release no_gil;
    return ms::parallel_selfcheck(jobs, n);
  }, "the worker pool's self-check: items not run exactly `jobs` times in `jobs` parallel calls");
  m.def("attn_block", &ms::attn_block, "x += attention block; returns the post-attention norm of x");
  m.def("deltanet_block", &ms::deltanet_block, "x += Gated DeltaNet of a step's rows (any kind); returns the post-attention norm");
  m.def("deltanet_step", &ms::deltanet_step, "Gated DeltaNet: conv step + delta-rule update of one token");
  m.def("head_block", &ms::head_block, "logits of the final norm of some rows through the LM head");
  m.def("run_layers", &ms::run_layers,
        "the layers of a step from `start` on, until one needs an expert that is not resident; after the "
        "last, the logits of `head_rows`");
  m.def("route", &ms::route, "top-k routing in float32: (ids [T, K], weights [T, K])", py::arg("h"),
        py::arg("wr"), py::arg("top_k"), py::arg("normalize"), py::arg("bias") = at::empty({0}));
  m.def("mla_block", &ms::mla_block, "x += multi-head latent attention block; returns the post-attention norm");
  m.def("route_grouped", &ms::route_grouped, "group-limited sigmoid top-k routing: (ids, weights, distinct ids)");
  m.def("ffn_block", &ms::ffn_block, "x += routed experts from slots (+ shared or dense SwiGLU)",
        py::arg("x"), py::arg("h"), py::arg("ids"), py::arg("w"), py::arg("experts"), py::arg("slots"),
        py::arg("slot_table"), py::arg("dense").none(true), py::arg("dmt"), py::arg("i8a"),
        py::arg("act").none(true) = (ms::ExpertAct*)nullptr, py::arg("direct") = false,
        py::arg("pre") = std::vector<at::Tensor>{});
  m.def("expert_outputs", &ms::expert_outputs, "unweighted outputs of routed experts from slots, for ffn_block's pre",
        py::arg("h"), py::arg("ids"), py::arg("w"), py::arg("experts"), py::arg("slots"), py::arg("slot_table"),
        py::arg("dmt"), py::arg("i8a"), py::arg("act").none(true) = (ms::ExpertAct*)nullptr);
}
