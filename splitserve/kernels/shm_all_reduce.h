// ShmAllReduce: the sum of a tensor over the tensor-parallel ranks of one machine through shared
// memory (shm_all_reduce.cpp says how). Declared here for decode_stack.cpp, which sums its
// row-parallel products with it.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <atomic>
#include <cstdint>

namespace splitserve {

class ShmAllReduce : public torch::CustomClassHolder {
 public:
  // segment: the mapped file (uint8) of header_bytes(world) + world * slot_bytes bytes.
  ShmAllReduce(at::Tensor segment, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s);
  static int64_t header_bytes(int64_t world);
  // x summed over the ranks, in place (float32, bfloat16 or float16 on the CPU).
  void all_reduce(const at::Tensor& x);

 private:
  std::atomic<int64_t>* arrived(int64_t r) const;
  std::atomic<int64_t>* left(int64_t r) const;
  std::atomic<int64_t>* pid(int64_t r) const;
  uint8_t* slot(int64_t r) const;
  template <typename Counter>
  void wait_all(Counter counter, int64_t value, const char* what) const;
  void reduce_chunk(const at::Tensor& chunk);

  at::Tensor segment_;
  uint8_t* base_;
  int64_t rank_, world_, slot_bytes_;
  double timeout_s_;
  int64_t parent_;  // the process that started this rank (the engine), at construction
  int64_t calls_ = 0;
};

}  // namespace splitserve
