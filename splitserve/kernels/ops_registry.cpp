// torch.ops.splitserve_cpu: every operator of splitserve's C++ CPU kernels, registered in one place
// (the kernels are declared in cpu_ops.h, which says which file holds each). The library is built
// and loaded by splitserve/kernels/build.py and called through splitserve/kernels/__init__.py and
// splitserve/kernels/gguf.py.
#include <torch/library.h>

#include "cpu_ops.h"

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "int num_decodes, float scale, int sliding_window) -> ()", &splitserve::decode_attention);
  m.def("write_kv(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()", &splitserve::write_kv);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &splitserve::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor", &splitserve::add_rms_norm);
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &splitserve::rotary);
  m.def("silu_and_mul(Tensor x) -> Tensor", &splitserve::silu_and_mul);
  m.def("sample(Tensor logits, Tensor temperature, Tensor u) -> (Tensor, Tensor)", &splitserve::sample);
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int first, float scale, int sliding_window) -> ()",
        &splitserve::prefill_attention);
  m.def("set_prompt_attention_brgemm(bool float32, bool bfloat16) -> (bool, bool)",
        &splitserve::set_prompt_attention_brgemm);
  m.def("gguf_mm(Tensor x, Tensor w, int qtype, int N, int K, bool native_bf16=False, int path=0) -> Tensor",
        &splitserve::gguf_mm);
  m.def("gguf_dequantize(Tensor w, int qtype, int N, int K, ScalarType dtype) -> Tensor",
        &splitserve::gguf_dequantize);
  m.def("gguf_repack(Tensor w, int qtype, int N, int K) -> Tensor", &splitserve::gguf_repack);
  m.def("moe_experts_gguf(Tensor x, Tensor ids, Tensor weights, Tensor[] gate_up, int qtype_gate_up, Tensor[] down, "
        "int qtype_down, int first_expert, int intermediate, bool native_bf16) -> Tensor",
        &splitserve::moe_experts_gguf);
  m.def("gguf_embedding(Tensor ids, Tensor w, int qtype, int K, ScalarType dtype) -> Tensor",
        &splitserve::gguf_embedding);
  splitserve::register_shm_all_reduce(m);  // before DecodeStack, whose set_tp_shm takes its class
  splitserve::register_decode_stack(m);
}
