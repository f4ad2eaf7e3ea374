// The sum of a tensor over the tensor-parallel ranks of one machine through shared memory, in place:
// what torch.distributed.all_reduce(x, group) computes, without gloo's loopback TCP. A decode step of
// a small model sums two row-parallel products per layer; over gloo each sum cost about a
// millisecond on two cores, more than the layer's own work, so tensor parallelism on one CPU machine
// ran several times slower than one rank.
//
// The segment (a file in /dev/shm mapped by every rank, splitserve/distributed/shm_all_reduce.py):
//   header: for each rank r, three 64-byte lines holding arrived[r], left[r] (std::atomic<int64_t>)
//           and the rank's process id (written when it maps the segment);
//   data:   one slot of slot_bytes per rank.
// Call g (1, 2, ... : every rank makes the same calls in the same order) of a chunk of x:
//   1. wait until every left[r] >= g - 1 (the others have read this rank's slot of call g - 1);
//   2. copy the chunk into this rank's slot; arrived[rank] = g (release);
//   3. wait until every arrived[r] >= g (acquire);
//   4. x's chunk = slot 0 + slot 1 + ... in rank order (float accumulation for 16-bit types, so every
//      rank computes the same bits; with two ranks, exactly what gloo's sum gives);
//   5. left[rank] = g.
// Tensors larger than a slot go chunk by chunk. A rank that waits for a rank whose process is gone
// (killed, or a zombie), or whose own parent (the engine) is gone, or that waits longer than the
// timeout, fails with an error that names the ranks it waited for: the engine then restarts them
// all instead of a rank spinning in here.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "cpu_ops.h"
#include "shm_all_reduce.h"

namespace splitserve {

namespace {
constexpr int64_t kLine = 64;
}  // namespace

ShmAllReduce::ShmAllReduce(at::Tensor segment, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s)
    : segment_(std::move(segment)), rank_(rank), world_(world), slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
  TORCH_CHECK(world_ >= 2 && rank_ >= 0 && rank_ < world_, "shm all-reduce: rank ", rank_, " of ", world_);
  TORCH_CHECK(slot_bytes_ >= kLine && slot_bytes_ % kLine == 0, "shm all-reduce: slots of whole 64-byte lines");
  TORCH_CHECK(segment_.scalar_type() == at::kByte && segment_.is_contiguous() &&
                  segment_.numel() >= header_bytes(world_) + world_ * slot_bytes_,
              "shm all-reduce: the segment is too small");
  base_ = segment_.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base_) % kLine == 0, "shm all-reduce: the segment must be 64-byte aligned");
  pid(rank_)->store(static_cast<int64_t>(getpid()), std::memory_order_release);
  parent_ = static_cast<int64_t>(getppid());
}

int64_t ShmAllReduce::header_bytes(int64_t world) { return 3 * world * kLine; }

std::atomic<int64_t>* ShmAllReduce::pid(int64_t r) const {
  return reinterpret_cast<std::atomic<int64_t>*>(base_ + (2 * world_ + r) * kLine);
}

namespace {
// Whether process `pid` is gone: no such process, or a zombie its parent has not reaped yet.
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;  // not written yet: the rank has not mapped the segment
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  return close != std::string::npos && close + 2 < text.size() && (text[close + 2] == 'Z' || text[close + 2] == 'X');
}
}  // namespace

std::atomic<int64_t>* ShmAllReduce::arrived(int64_t r) const {
  return reinterpret_cast<std::atomic<int64_t>*>(base_ + r * kLine);
}
std::atomic<int64_t>* ShmAllReduce::left(int64_t r) const {
  return reinterpret_cast<std::atomic<int64_t>*>(base_ + (world_ + r) * kLine);
}
uint8_t* ShmAllReduce::slot(int64_t r) const { return base_ + header_bytes(world_) + r * slot_bytes_; }

void ShmAllReduce::all_reduce(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "shm all-reduce: a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "shm all-reduce: float32, bfloat16 or float16, got ", x.scalar_type());
  at::Tensor flat = x.is_contiguous() ? x.view({-1}) : x.contiguous().view({-1});
  const int64_t per_chunk = slot_bytes_ / flat.element_size();
  for (int64_t start = 0; start < flat.numel(); start += per_chunk)
    reduce_chunk(flat.narrow(0, start, std::min(per_chunk, flat.numel() - start)));
  if (!x.is_contiguous()) x.copy_(flat.view(x.sizes()));
}

// Until every counter(r) >= value; spins, then yields the core (ranks may share cores).
template <typename Counter>
void ShmAllReduce::wait_all(Counter counter, int64_t value, const char* what) const {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t spins = 0;; ++spins) {
    bool all = true;
    for (int64_t r = 0; r < world_ && all; ++r) all = counter(r)->load(std::memory_order_acquire) >= value;
    if (all) return;
    if (spins < 2000) continue;
    std::this_thread::yield();
    if (spins % 4096 != 0) continue;
    std::string late, gone;
    for (int64_t r = 0; r < world_; ++r)
      if (counter(r)->load(std::memory_order_acquire) < value) {
        late += (late.empty() ? "" : ", ") + std::to_string(r);
        if (process_gone(pid(r)->load(std::memory_order_acquire))) gone += (gone.empty() ? "" : ", ") + std::to_string(r);
      }
    TORCH_CHECK(gone.empty(), "shm all-reduce: tensor-parallel rank(s) ", gone, " exited while rank ", rank_,
                " waited for them to ", what);
    TORCH_CHECK(static_cast<int64_t>(getppid()) == parent_, "shm all-reduce: the engine process of rank ", rank_,
                " exited while it waited for rank(s) ", late, " to ", what);
    TORCH_CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <= timeout_s_,
                "shm all-reduce: tensor-parallel rank ", rank_, " waited more than ", timeout_s_, " s for rank(s) ",
                late, " to ", what, " (a rank died or stopped)");
  }
}

void ShmAllReduce::reduce_chunk(const at::Tensor& chunk) {
  const int64_t g = ++calls_;
  wait_all([this](int64_t r) { return left(r); }, g - 1, "finish the previous sum");
  std::memcpy(slot(rank_), chunk.data_ptr(), chunk.numel() * chunk.element_size());
  arrived(rank_)->store(g, std::memory_order_release);
  wait_all([this](int64_t r) { return arrived(r); }, g, "arrive");
  const auto view = [&](int64_t r) { return at::from_blob(slot(r), {chunk.numel()}, chunk.options()); };
  at::Tensor acc = chunk.scalar_type() == at::kFloat ? view(0).clone() : view(0).to(at::kFloat);
  for (int64_t r = 1; r < world_; ++r) acc.add_(view(r).to(at::kFloat));
  chunk.copy_(acc);
  left(rank_)->store(g, std::memory_order_release);
}

}  // namespace splitserve

namespace {

void shm_all_reduce(const c10::intrusive_ptr<splitserve::ShmAllReduce>& group, at::Tensor x) { group->all_reduce(x); }

}  // namespace

// Called from ops_registry.cpp's TORCH_LIBRARY(splitserve_cpu, m).
void splitserve::register_shm_all_reduce(torch::Library& m) {
  m.class_<splitserve::ShmAllReduce>("ShmAllReduce")
      .def(torch::init<at::Tensor, int64_t, int64_t, int64_t, double>())
      .def_static("header_bytes", &splitserve::ShmAllReduce::header_bytes);
  // An operator, so that the wait releases the GIL. x is summed in place.
  m.def("shm_all_reduce(__torch__.torch.classes.splitserve_cpu.ShmAllReduce group, Tensor(a!) x) -> ()",
        &shm_all_reduce);
}
