// The pickle interpreter's machine, shared by the files that implement it: unpickle.cc (the
// calls the allow-list answers: REDUCE, NEWOBJ, BUILD, tensor rebuilds) and pickle_opcodes.cc
// (the byte loop and every opcode family). Nothing outside src/import/torch/ includes it.
#ifndef FERRY_SRC_IMPORT_TORCH_PICKLE_MACHINE_HPP_
#define FERRY_SRC_IMPORT_TORCH_PICKLE_MACHINE_HPP_

#include <cstdint>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/util.hpp"
#include "import/torch/unpickle.hpp"

namespace ferry::torch_import::pickle {

using Kind = Value::Kind;

// The allow-listed global "module.name" is, or nullopt (pickle_globals.cc).
std::optional<Global> Resolve(std::string_view module, std::string_view name);

inline uint64_t LoadLE(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

// One pickle being read: its stack, marks and memo, and the values it built in the heap.
class Machine {
 public:
  Machine(Heap* heap, const uint8_t* data, uint64_t size, const UnpickleOptions& options)
      : heap_(heap), data_(data), size_(size), opt_(options) {}

  Result<Value*> Run(uint64_t* consumed);

 private:
  template <typename... Args>
  Status Fail(const Args&... args) const {
    return Error(StatusCode::kDataLoss, opt_.where, ": ", args..., " at byte ",
                 opt_.offset_base + op_pos_);
  }
  Result<Value*> New(Kind k) {
    if (heap_->values() >= kMaxPickleValues) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": more than ", kMaxPickleValues,
                   " values at byte ", opt_.offset_base + op_pos_);
    }
    return heap_->New(k);
  }
  Status Need(uint64_t n) const {
    if (size_ - pos_ < n) return Fail("truncated pickle: ", n, " more bytes needed");
    return Status::Ok();
  }
  Status Push(Value* v) {
    if (stack_.size() >= kMaxPickleStack) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": pickle stack deeper than ",
                   kMaxPickleStack, " at byte ", opt_.offset_base + op_pos_);
    }
    stack_.push_back(v);
    return Status::Ok();
  }
  Result<Value*> Pop() {
    if (stack_.size() <= MarkFloor()) return Fail("pickle stack underflow");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  size_t MarkFloor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Pops everything above the last MARK, and the mark.
  Result<std::vector<Value*>> PopMark() {
    if (marks_.empty()) return Fail("pickle opcode needs a MARK and there is none");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value*> out(stack_.begin() + m, stack_.end());
    stack_.resize(m);
    return out;
  }
  Status Memo(uint64_t idx, Value* v) {
    if (memo_.size() >= kMaxPickleMemo && !memo_.count(idx)) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": pickle memo larger than ",
                   kMaxPickleMemo, " at byte ", opt_.offset_base + op_pos_);
    }
    memo_[idx] = v;
    return Status::Ok();
  }
  // Counts `n` container items about to be copied against the pickle's size.
  Status Charge(uint64_t n) {
    copied_ += n;
    heap_->copied += n;
    if (copied_ > kPickleCopiesPerByte * size_ + kPickleCopySlack) {
      return Error(StatusCode::kResourceExhausted, opt_.where, ": the pickle copies more than ",
                   kPickleCopiesPerByte, " container items per byte of its ", size_,
                   " bytes (the same container rebuilt over and over) at byte ",
                   opt_.offset_base + op_pos_);
    }
    return Status::Ok();
  }
  Status PushString(Kind k, uint64_t n) {
    FERRY_RETURN_IF_ERROR(Need(n));
    FERRY_ASSIGN_OR_RETURN(Value * v, New(k));
    v->s.assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return Push(v);
  }
  // One step per opcode family (Step dispatches); each reads its operands after the opcode.
  Status Step(uint8_t op);
  Result<Value*> Stop(uint64_t* consumed);
  Status Framing(uint8_t op);
  Status StackOp(uint8_t op);
  Status Scalar(uint8_t op);
  Status String(uint8_t op);
  Status Container(uint8_t op);
  Status Fill(uint8_t op);
  Status MemoOp(uint8_t op);
  Status GlobalOp(uint8_t op);
  Status ObjectOp(uint8_t op);
  Status Refuse(uint8_t op);
  Status Reduce(Value* callable, Value* args);
  Result<Value*> ReduceContainer(Global g, const std::vector<Value*>& args);
  Result<Value*> ReduceBytes(Global g, const std::vector<Value*>& args);
  Status NewObj(Value* cls, Value* args, Value* kwargs);
  Status Build(Value* obj, Value* state);
  Result<Value*> RebuildTensor(Global g, const std::vector<Value*>& args);

  Heap* heap_;
  const uint8_t* data_;
  uint64_t size_;
  const UnpickleOptions& opt_;
  uint64_t pos_ = 0, op_pos_ = 0;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value*> memo_;
  uint64_t copied_ = 0;
  // _codecs.encode and _load_from_bytes results by their argument value: a memoized argument
  // converted again (a few bytes of pickle each time) gives the value converted the first time.
  std::unordered_map<const Value*, Value*> converted_;
};

}  // namespace ferry::torch_import::pickle

#endif  // FERRY_SRC_IMPORT_TORCH_PICKLE_MACHINE_HPP_
