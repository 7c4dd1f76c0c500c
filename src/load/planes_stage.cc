#include "load/planes_stage.hpp"

#ifdef FERRY_HAVE_CUDA_KERNELS

#include <algorithm>
#include <chrono>

#include "base/util.hpp"
#include "cuda/cuda_util.hpp"

namespace ferry {

namespace {

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

PlanesStage::~PlanesStage() { Release(); }

void PlanesStage::Release() {
  if (ctx_ == nullptr && twins_ == nullptr) return;
  // Frees run in the context the resources belong to, whatever thread drops the loader.
  ScopedContext scope(ctx_);
  if (copy_ != nullptr) cudaStreamSynchronize(copy_);
  if (done_ != nullptr && done_recorded_) cudaEventSynchronize(done_);
  for (cudaEvent_t e : copied_) cudaEventDestroy(e);
  for (cudaEvent_t e : decoded_) cudaEventDestroy(e);
  copied_.clear();
  decoded_.clear();
  for (cudaEvent_t* e : {&done_, &fetched_}) {
    if (*e != nullptr) cudaEventDestroy(*e);
    *e = nullptr;
  }
  done_recorded_ = false;
  if (copy_ != nullptr) cudaStreamDestroy(copy_);
  copy_ = nullptr;
  if (twins_ != nullptr) cudaFree(twins_);
  twins_ = nullptr;
  if (errors_ != nullptr) cudaFree(errors_);
  errors_ = nullptr;
  if (table_ != nullptr) cudaFree(table_);
  table_ = nullptr;
  if (host_errors_ != nullptr) cudaFreeHost(host_errors_);
  host_errors_ = nullptr;
  if (host_table_ != nullptr) cudaFreeHost(host_table_);
  host_table_ = nullptr;
  errors_cap_ = 0;
  nslots_ = ntwins_ = ngroup_slots_ = slot_bytes_ = 0;
  ctx_ = nullptr;
}

Status PlanesStage::Prepare(CUcontext ctx, size_t nslots, size_t slot_bytes,
                            const PlanesStageShape& shape, const std::string& where) {
  if (ctx == ctx_ && twins_ != nullptr && nslots == nslots_ && slot_bytes == slot_bytes_ &&
      shape.group == shape_.group && shape.twin_factor == shape_.twin_factor &&
      shape.prewarm == shape_.prewarm) {
    shape_ = shape;
    return Status::Ok();
  }
  Release();
  ctx_ = ctx;
  shape_ = shape;
  shape_.group = std::max(1, shape.group);
  const size_t group = static_cast<size_t>(shape_.group);
  // Whole groups of twins, at least one group's worth.
  ntwins_ = std::max(group, nslots * static_cast<size_t>(std::max(1, shape.twin_factor)));
  ntwins_ = (ntwins_ + group - 1) / group * group;
  ngroup_slots_ = ntwins_ / group;
  void* p = nullptr;
  FERRY_CUDA_RETURN(cudaMalloc(&p, ntwins_ * slot_bytes), where);
  twins_ = static_cast<uint8_t*>(p);
  nslots_ = nslots;
  slot_bytes_ = slot_bytes;
  FERRY_CUDA_RETURN(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking), where);
  copied_.assign(ngroup_slots_, nullptr);
  decoded_.assign(ngroup_slots_, nullptr);
  for (std::vector<cudaEvent_t>* v : {&copied_, &decoded_}) {
    for (cudaEvent_t& e : *v) {
      FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), where);
    }
  }
  FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), where);
  FERRY_CUDA_RETURN(cudaEventCreateWithFlags(&fetched_, cudaEventDisableTiming), where);
  remaining_ = std::make_unique<std::atomic<int>[]>(ngroup_slots_);
  arrived_.assign(ngroup_slots_, {});
  launched_.assign(ngroup_slots_, 0);
  if (shape_.prewarm) {
    // Under lazy module loading the decode kernel would otherwise load at its first launch,
    // inside the first load's pipeline.
    Status st = planes::PrepareDevice();
    if (!st.ok()) return Error(st.code(), where, ": ", st.message());
  }
  return Status::Ok();
}

Status PlanesStage::StartLoad(size_t nblocks, size_t nbatches, bool verify, cudaStream_t stream,
                              const std::string& where) {
  if (nblocks > errors_cap_) {
    if (errors_ != nullptr) {
      // The previous load's copies and decodes are done: its errors were fetched after them
      // (or it failed, and EndLoad's event covers them).
      if (done_recorded_) cudaEventSynchronize(done_);
      cudaFree(errors_);
      cudaFree(table_);
      cudaFreeHost(host_errors_);
      cudaFreeHost(host_table_);
      errors_ = nullptr;
      table_ = nullptr;
      host_errors_ = nullptr;
      host_table_ = nullptr;
      errors_cap_ = 0;
    }
    size_t cap = std::max<size_t>(nblocks, 1024);
    void* p = nullptr;
    FERRY_CUDA_RETURN(cudaMalloc(&p, cap * sizeof(uint32_t)), where);
    errors_ = static_cast<uint32_t*>(p);
    FERRY_CUDA_RETURN(cudaMalloc(&p, cap * sizeof(DeviceBlock)), where);
    table_ = static_cast<DeviceBlock*>(p);
    FERRY_CUDA_RETURN(cudaHostAlloc(&p, cap * sizeof(uint32_t), cudaHostAllocDefault), where);
    host_errors_ = static_cast<uint32_t*>(p);
    FERRY_CUDA_RETURN(cudaHostAlloc(&p, cap * sizeof(DeviceBlock), cudaHostAllocDefault), where);
    host_table_ = static_cast<DeviceBlock*>(p);
    errors_cap_ = cap;
  }
  FERRY_CUDA_RETURN(cudaMemsetAsync(errors_, 0, nblocks * sizeof(uint32_t), stream), where);
  // The device slots still hold the previous load's blocks until its decodes ran.
  if (done_recorded_) FERRY_CUDA_RETURN(cudaStreamWaitEvent(copy_, done_, 0), where);
  nblocks_ = nblocks;
  nbatches_ = nbatches;
  verify_ = verify;
  const size_t group = static_cast<size_t>(shape_.group);
  for (size_t s = 0; s < ngroup_slots_; ++s) {
    const size_t first = s * group;
    remaining_[s].store(first < nbatches ? static_cast<int>(std::min(group, nbatches - first)) : 0);
    arrived_[s].assign(group, {});
    launched_[s] = 0;
  }
  aborted_ = false;
  first_launch_.store(0, std::memory_order_relaxed);
  return Status::Ok();
}

void PlanesStage::Abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
  }
  cv_.notify_all();
}

Status PlanesStage::Enqueue(size_t j, const uint8_t* host, size_t bytes,
                            const std::vector<PlanesStaged>& blocks, cudaStream_t stream,
                            const std::string& where) {
  const size_t group = static_cast<size_t>(shape_.group);
  const size_t g = j / group, gs = g % ngroup_slots_;
  // The twin's previous batch belongs to group g - ngroup_slots_: its decode must have been
  // enqueued (then the copy stream waits for it to run) before this batch's copy.
  const bool reused = g >= ngroup_slots_;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return aborted_ || !reused || launched_[gs] > g - ngroup_slots_; });
    if (aborted_) return Status::Ok();
  }
  for (const PlanesStaged& b : blocks) {
    host_table_[b.error_index] = DeviceBlock{b.dst, b.layout.raw_size, b.checksum};
  }
  uint8_t* twin = twins_ + (j % ntwins_) * slot_bytes_;
  if (reused) FERRY_CUDA_RETURN(cudaStreamWaitEvent(copy_, decoded_[gs], 0), where);
  FERRY_CUDA_RETURN(cudaMemcpyAsync(twin, host, bytes, cudaMemcpyHostToDevice, copy_), where);
  Arrived& mine = arrived_[gs][j % group];
  mine.first = blocks.empty() ? 0 : blocks.front().error_index;
  mine.jobs.clear();
  for (const PlanesStaged& b : blocks) {
    mine.jobs.push_back(planes::DeviceJob{twin + b.soff, b.dst, b.layout});
  }
  // The last batch of the group launches it; every other batch's copy was enqueued before it
  // counted itself in, so an event recorded now follows all of them.
  if (remaining_[gs].fetch_sub(1, std::memory_order_acq_rel) != 1) return Status::Ok();
  return Launch(g, stream, where);
}

Status PlanesStage::Launch(size_t g, cudaStream_t stream, const std::string& where) {
  const size_t group = static_cast<size_t>(shape_.group);
  const size_t gs = g % ngroup_slots_;
  FERRY_CUDA_RETURN(cudaEventRecord(copied_[gs], copy_), where);
  FERRY_CUDA_RETURN(cudaStreamWaitEvent(stream, copied_[gs], 0), where);
  std::vector<planes::DeviceJob> jobs;
  const uint32_t first = arrived_[gs][0].first;
  for (const Arrived& batch : arrived_[gs])
    jobs.insert(jobs.end(), batch.jobs.begin(), batch.jobs.end());
  if (first_launch_.load(std::memory_order_relaxed) == 0) {
    first_launch_.store(NowSeconds(), std::memory_order_relaxed);
  }
  // Blocks of consecutive batches are consecutive in the load's error array.
  Status st =
      planes::DecodeOnDevice(jobs.data(), static_cast<int>(jobs.size()), errors_ + first, stream);
  if (st.ok() && verify_ && shape_.verify_each_group) {
    st =
        VerifyOnDevice(host_table_ + first, static_cast<int>(jobs.size()), errors_ + first, stream);
  }
  if (!st.ok()) return Error(st.code(), where, ": ", st.message());
  FERRY_CUDA_RETURN(cudaEventRecord(decoded_[gs], stream), where);
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The slot passes to group g + ngroup_slots_: its batches wait for this line.
    const size_t next = (g + ngroup_slots_) * group;
    remaining_[gs].store(next < nbatches_ ? static_cast<int>(std::min(group, nbatches_ - next))
                                          : 0);
    for (Arrived& batch : arrived_[gs]) batch.jobs.clear();
    launched_[gs] = g + 1;
  }
  cv_.notify_all();
  return Status::Ok();
}

Status PlanesStage::Finish(cudaStream_t stream, std::vector<uint32_t>* out,
                           const std::string& where) {
  const size_t n = nblocks_;
  out->assign(n, 0);
  if (n == 0) return Status::Ok();
  if (verify_ && !shape_.verify_each_group) {
    // One launch over every block: hashing is latency-bound per block, so all of them at once
    // keep the device busy where a group's few would not.
    FERRY_CUDA_RETURN(cudaMemcpyAsync(table_, host_table_, n * sizeof(DeviceBlock),
                                      cudaMemcpyHostToDevice, stream),
                      where);
    Status st = VerifyTableOnDevice(table_, static_cast<int>(n), errors_, stream);
    if (!st.ok()) return Error(st.code(), where, ": ", st.message());
  }
  FERRY_CUDA_RETURN(
      cudaMemcpyAsync(host_errors_, errors_, n * sizeof(uint32_t), cudaMemcpyDeviceToHost, stream),
      where);
  // Waits for this copy (and so for the decodes before it on `stream`), not for the stream:
  // work other threads enqueue on it meanwhile is not ours to wait for.
  FERRY_CUDA_RETURN(cudaEventRecord(fetched_, stream), where);
  FERRY_CUDA_RETURN(cudaEventSynchronize(fetched_), where);
  std::copy(host_errors_, host_errors_ + n, out->begin());
  return Status::Ok();
}

void PlanesStage::EndLoad(cudaStream_t stream) {
  // Also after a failure: whatever was enqueued must run before the next load's copies.
  if (cudaEventRecord(done_, stream) == cudaSuccess) {
    done_recorded_ = true;
  } else {
    cudaGetLastError();
    if (copy_ != nullptr) cudaStreamSynchronize(copy_);
    cudaStreamSynchronize(stream);
    done_recorded_ = false;
  }
}

}  // namespace ferry

#endif  // FERRY_HAVE_CUDA_KERNELS
