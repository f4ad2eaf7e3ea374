// The decoder layers of a Llama-family model for one step, in one call from Python: decode steps,
// and prompt and mixed steps (paged prompt attention for the requests after the decodes).
//
// A decode step of a small model is short (a few milliseconds for SmolLM2-135M with 4-bit weights
// on two cores), and the Python around its ~12 kernel calls per layer (module calls, argument
// parsing, dispatch) cost about as much as the kernels themselves. DecodeStack holds each layer's
// weights once (built by splitserve/executor/cpu_decode_stack.py after loading) and runs all the
// layers and the final norm in C++, calling the same kernels, in the same order and with the same
// row padding, as the Python modules do: its result equals theirs bit for bit (tested).
//
// What it runs: RMSNorm (fused with the residual add from the second norm on), q/k/v as one
// matmul, Qwen3's per-head q and k RMSNorms where the layer has them, rotary in place, the paged KV write, paged decode attention, o_proj, SiLU-and-mul between
// gate/up and down. Linears are dense (at::linear, with the bias fused as F.linear does), prepacked
// bfloat16 or float32 (oneDNN's _linear_pointwise, bias fused) or GGUF blocks (splitserve::gguf_mm, then the
// bias added) in runs of output rows. With tensor parallelism each rank runs its share of the heads
// and of the MLP, and the row-parallel products (o_proj, down_proj) are summed over the ranks in
// place, their bias added after the sum, as tp_all_reduce sums them: through shared memory
// (shm_all_reduce.h) where the ranks share a machine, else torch's functional all-reduce on the
// tensor-parallel group (the same backend call as torch.distributed.all_reduce). What it does not run
// (LoRA, pipeline parallelism, quantized KV caches ...) the Python side never
// builds it for. Under torch.profiler each kernel call is an event of its own (STACK_EVENT).
// Registered through ops_registry.cpp.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpu_ops.h"
#include "shm_all_reduce.h"

namespace {

constexpr int64_t kDense = -1;   // a dense [rows, K] weight
constexpr int64_t kPacked = -2;  // a bfloat16 or float32 weight prepacked for oneDNN (kernels/packed_linear.py)

struct Run {
  int64_t qtype;  // ggml type of GGUF blocks, kDense or kPacked
  int64_t rows;
  at::Tensor weight;
};

struct StackLinear {
  std::vector<Run> runs;  // consecutive output rows
  at::Tensor bias;        // undefined when none
  bool fused_bias = false;  // a dense linear adds its bias in at::linear, as F.linear does
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  at::Tensor q_norm, k_norm;  // Qwen3's per-head norms [head_dim]; undefined when the layer has none
  StackLinear linears[4];  // qkv, o, gate_up, down
  int64_t sliding_window;
};

enum Slot : int64_t { kQKV = 0, kO = 1, kGateUp = 2, kDown = 3 };

// A torch.profiler event around one of the stack's own kernel calls, named as the operator the
// Python modules call ("splitserve_cpu::decode_attention"), so that `bench throughput --profile`
// splits the stack's time by kernel (benchmarks/profiling.py). Nothing is recorded, and next to
// nothing spent, while no profiler runs. The products are operators already (their own events).
#define STACK_EVENT(kernel) RECORD_FUNCTION("splitserve_cpu::" kernel, c10::ArrayRef<const c10::IValue>{})

// x [M, K] with zero rows appended up to `rows` (splitserve/kernels/row_buckets.py).
at::Tensor padded(const at::Tensor& x, int64_t rows) {
  if (rows <= x.size(0)) return x;
  at::Tensor out = at::empty({rows, x.size(1)}, x.options());
  out.narrow(0, 0, x.size(0)).copy_(x);
  out.narrow(0, x.size(0), rows - x.size(0)).zero_();
  return out;
}

// x summed over the ranks of the process group called `group`, in place (what
// torch.distributed.all_reduce(x, group) computes): _c10d_functional::all_reduce_, then wait_tensor.
void all_reduce_sum(const at::Tensor& x, const std::string& group) {
  static const c10::OperatorHandle reduce =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce_", "");
  static const c10::OperatorHandle wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  torch::jit::Stack stack{x, c10::IValue(std::string("sum")), c10::IValue(group)};
  reduce.callBoxed(&stack);
  torch::jit::Stack waited{stack[0]};
  wait.callBoxed(&waited);
}

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""), through the dispatcher.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x,
                          packed,
                          bias.defined() ? c10::IValue(bias) : c10::IValue(),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool native_bf16,
              bool batch_invariant)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        native_bf16_(native_bf16),
        batch_invariant_(batch_invariant) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, int64_t sliding_window) {
    StackLayer layer;
    layer.input_norm = input_norm;
    layer.post_norm = post_norm;
    layer.sliding_window = sliding_window;
    layers_.push_back(std::move(layer));
  }

  // A run of output rows of linear `slot` of the last layer added.
  void add_run(int64_t slot, at::Tensor weight, int64_t qtype, int64_t rows) {
    TORCH_CHECK(!layers_.empty() && slot >= 0 && slot < 4, "add_run needs a layer and a slot in [0, 4)");
    TORCH_CHECK(qtype >= 0 ? weight.scalar_type() == at::kByte
                           : qtype == kPacked ? weight.is_mkldnn()
                                              : qtype == kDense && weight.dim() == 2 && weight.size(0) == rows,
                "a run's weight must be GGUF blocks (uint8), a oneDNN-packed or a dense [rows, K] tensor");
    layers_.back().linears[slot].runs.push_back({qtype, rows, weight});
  }

  // Qwen3: RMSNorm over each head of q and of k (weights [head_dim]) before the rotation.
  void set_qk_norm(at::Tensor q_norm, at::Tensor k_norm) {
    TORCH_CHECK(!layers_.empty(), "set_qk_norm needs a layer");
    TORCH_CHECK(q_norm.numel() == head_dim_ && k_norm.numel() == head_dim_, "q/k norm weights must be [head_dim]");
    layers_.back().q_norm = q_norm;
    layers_.back().k_norm = k_norm;
  }

  // Tensor parallelism: the name of the tensor-parallel process group (torch.distributed's
  // group_name) whose ranks the row-parallel products are summed over.
  void set_tp_group(std::string group) { tp_group_ = std::move(group); }
  // ... or the ranks' shared-memory sums, where they share a machine (distributed/shm_all_reduce.py).
  void set_tp_shm(c10::intrusive_ptr<splitserve::ShmAllReduce> shm) { tp_shm_ = std::move(shm); }

  void set_bias(int64_t slot, at::Tensor bias, bool fused) {
    TORCH_CHECK(!layers_.empty() && slot >= 0 && slot < 4, "set_bias needs a layer and a slot in [0, 4)");
    layers_.back().linears[slot].bias = bias;
    layers_.back().linears[slot].fused_bias = fused;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: [T, hidden] embeddings of the step's T tokens, the num_decodes decode tokens (one per
  // request) first; cos, sin as the rotary kernel takes them; kv_caches: one per layer;
  // block_tables, seq_lens, slot_mapping and query_start_loc (int64, read only when some request
  // has prompt tokens) as the attention metadata has them; padded_rows: the rows bfloat16 products
  // are padded to. Returns the final norm's output [T, hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                     int64_t num_decodes, const at::Tensor& final_norm, int64_t padded_rows) const {
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers(), "one KV cache per layer");
    TORCH_CHECK(x.dim() == 2, "x must be [T, hidden]");
    const int64_t T = x.size(0), q_width = num_heads_ * head_dim_, kv_width = num_kv_heads_ * head_dim_;
    const int64_t num_reqs = seq_lens.size(0);
    TORCH_CHECK(num_decodes == num_reqs || query_start_loc.numel() == num_reqs + 1,
                "a step with prompt tokens needs query_start_loc [R + 1]");
    at::Tensor residual = x;
    at::Tensor h;
    for (int64_t i = 0; i < num_layers(); ++i) {
      const StackLayer& layer = layers_[i];
      {
        STACK_EVENT("rms_norm");
        h = i == 0 ? splitserve::rms_norm(residual, layer.input_norm, eps_)
                   : splitserve::add_rms_norm(h, residual, layer.input_norm, eps_);
      }
      const at::Tensor qkv = apply(layer.linears[kQKV], h, padded_rows);
      at::Tensor q = qkv.narrow(1, 0, q_width).view({T, num_heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_width, kv_width).view({T, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({T, num_kv_heads_, head_dim_});
      if (layer.q_norm.defined()) {  // as RMSNorm.forward on the [T, heads, head_dim] views: rows copied out
        STACK_EVENT("rms_norm");
        q = splitserve::rms_norm(q.reshape({T * num_heads_, head_dim_}), layer.q_norm, eps_).view(q.sizes());
        k = splitserve::rms_norm(k.reshape({T * num_kv_heads_, head_dim_}), layer.k_norm, eps_).view(k.sizes());
      }
      {
        STACK_EVENT("rotary");
        splitserve::rotary(q, k, cos, sin);
      }
      {
        STACK_EVENT("write_kv");
        splitserve::write_kv(kv_caches[i], k, v, slot_mapping);
      }
      at::Tensor attn = at::empty({T, num_heads_, head_dim_}, q.options());
      if (num_decodes > 0) {
        STACK_EVENT("decode_attention");
        splitserve::decode_attention(attn, q, kv_caches[i], block_tables, seq_lens, num_decodes, scale_,
                                     layer.sliding_window);
      }
      if (num_decodes < num_reqs) {  // as CPUAttentionBackend.prefill: the requests after the decodes
        STACK_EVENT("prefill_attention");
        splitserve::prefill_attention(attn, q, kv_caches[i], block_tables, seq_lens, query_start_loc, num_decodes,
                                      scale_, layer.sliding_window);
      }
      const at::Tensor o = apply(layer.linears[kO], attn.view({T, q_width}), padded_rows, true);
      {
        STACK_EVENT("add_rms_norm");
        h = splitserve::add_rms_norm(o, residual, layer.post_norm, eps_);
      }
      const at::Tensor gate_up = apply(layer.linears[kGateUp], h, padded_rows);
      at::Tensor act;
      {
        STACK_EVENT("silu_and_mul");
        act = splitserve::silu_and_mul(gate_up);
      }
      h = apply(layer.linears[kDown], act, padded_rows, true);
    }
    STACK_EVENT("add_rms_norm");
    return splitserve::add_rms_norm(h, residual, final_norm, eps_);
  }

 private:
  // x [M, K] times the linear's runs, as Linear.forward and GGUFLinearMethod.apply compute it; a
  // row-parallel one (`row`) summed over the tensor-parallel ranks before its bias.
  at::Tensor apply(const StackLinear& linear, const at::Tensor& x, int64_t padded_rows, bool row = false) const {
    const int64_t M = x.size(0), K = x.size(1);
    std::vector<at::Tensor> outputs;
    outputs.reserve(linear.runs.size());
    for (const Run& run : linear.runs) {
      if (run.qtype == kPacked) {  // as packed_linear.linear
        const at::Tensor y = packed_linear(padded(x, padded_rows), run.weight, linear.fused_bias ? linear.bias : at::Tensor());
        outputs.push_back(y.narrow(0, 0, M));
      } else if (run.qtype == kDense) {  // bfloat16 products go through oneDNN: padded rows (row_buckets.linear)
        const at::Tensor xp = x.scalar_type() == at::kBFloat16 || batch_invariant_ ? padded(x, padded_rows) : x;
        const at::Tensor y = linear.fused_bias ? at::linear(xp, run.weight, linear.bias) : at::linear(xp, run.weight);
        outputs.push_back(y.narrow(0, 0, M));
      } else {  // as splitserve.kernels.gguf.gguf_mm
        STACK_EVENT("gguf_mm");
        const bool pad = x.scalar_type() == at::kBFloat16 && native_bf16_ && !batch_invariant_;
        const at::Tensor xp = (pad ? padded(x, padded_rows) : x).contiguous();
        outputs.push_back(
            splitserve::gguf_mm(xp, run.weight, run.qtype, run.rows, K, native_bf16_, batch_invariant_ ? 1 : 0)
                .narrow(0, 0, M));
      }
    }
    at::Tensor y = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
    if (row && tp_shm_) tp_shm_->all_reduce(y);
    else if (row && !tp_group_.empty()) all_reduce_sum(y, tp_group_);
    if (linear.bias.defined() && !linear.fused_bias) y = y + linear.bias;
    return y;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  bool native_bf16_;
  bool batch_invariant_;  // the rows' results must not depend on their count (kernels/batch_invariant.py)
  std::string tp_group_;  // empty: one rank (or tp_shm_)
  c10::intrusive_ptr<splitserve::ShmAllReduce> tp_shm_;
  std::vector<StackLayer> layers_;
};

at::Tensor decode_stack_forward(const c10::intrusive_ptr<DecodeStack>& stack, const at::Tensor& x,
                                const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> kv_caches,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& slot_mapping, const at::Tensor& query_start_loc,
                                int64_t num_decodes, const at::Tensor& final_norm, int64_t padded_rows) {
  return stack->forward(x, cos, sin, kv_caches, block_tables, seq_lens, slot_mapping, query_start_loc, num_decodes,
                        final_norm, padded_rows);
}

}  // namespace

// Called from ops_registry.cpp's TORCH_LIBRARY(splitserve_cpu, m).
void splitserve::register_decode_stack(torch::Library& m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, bool, bool>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_run", &DecodeStack::add_run)
      .def("set_bias", &DecodeStack::set_bias)
      .def("set_qk_norm", &DecodeStack::set_qk_norm)
      .def("set_tp_group", &DecodeStack::set_tp_group)
      .def("set_tp_shm", &DecodeStack::set_tp_shm)
      .def("num_layers", &DecodeStack::num_layers);
  // An operator rather than a method, so that the call releases the GIL as every torch op does. x (the
  // residual stream) and the KV caches are written in place.
  m.def(
      "decode_stack_forward(__torch__.torch.classes.splitserve_cpu.DecodeStack stack, Tensor(a!) x, Tensor cos, "
      "Tensor sin, Tensor(b!)[] kv_caches, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, "
      "Tensor query_start_loc, int num_decodes, Tensor final_norm, int padded_rows) -> Tensor",
      &decode_stack_forward);
}
