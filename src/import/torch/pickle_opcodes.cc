// The pickle interpreter's byte loop: one step per opcode family, each reading its operands
// after the opcode; the refused opcodes are named here. What a call builds is in unpickle.cc.
#include <algorithm>
#include <cstring>
#include <string>

#include "base/util.hpp"
#include "import/torch/pickle_machine.hpp"

namespace ferry::torch_import::pickle {

Result<Value*> Machine::Run(uint64_t* consumed) {
  if (size_ < 2 || data_[0] != 0x80) {
    op_pos_ = 0;
    return Fail("not a pickle of protocol 2 or later (only protocols 2 to 5 are read)");
  }
  if (++heap_->nesting > kMaxPickleNesting) {
    --heap_->nesting;
    return Fail("pickles nested more than ", kMaxPickleNesting, " deep");
  }
  struct Unnest {
    Heap* h;
    ~Unnest() { --h->nesting; }
  } unnest{heap_};
  while (true) {
    op_pos_ = pos_;
    if (pos_ >= size_) return Fail("pickle ends without STOP");
    uint8_t op = data_[pos_++];
    if (op == '.') return Stop(consumed);
    FERRY_RETURN_IF_ERROR(Step(op));
  }
}

Result<Value*> Machine::Stop(uint64_t* consumed) {
  if (stack_.size() != 1 || !marks_.empty()) {
    return Fail("STOP with ", stack_.size(), " values on the stack");
  }
  if (consumed) {
    *consumed = pos_;
  } else if (pos_ != size_) {
    return Fail(size_ - pos_, " bytes after STOP");
  }
  return stack_.back();
}

// Each opcode family has its own step; the refused opcodes are named here.
Status Machine::Step(uint8_t op) {
  switch (op) {
    case 0x80:  // PROTO
    case 0x95:  // FRAME
      return Framing(op);
    case '(':  // MARK
    case '0':  // POP
    case '1':  // POP_MARK
    case '2':  // DUP
      return StackOp(op);
    case 'N':
    case 0x88:  // NEWTRUE
    case 0x89:  // NEWFALSE
    case 'J':   // BININT
    case 'K':   // BININT1
    case 'M':   // BININT2
    case 0x8a:  // LONG1
    case 0x8b:  // LONG4
    case 'G':   // BINFLOAT
      return Scalar(op);
    case 'X':   // BINUNICODE
    case 0x8c:  // SHORT_BINUNICODE
    case 0x8d:  // BINUNICODE8
    case 'T':   // BINSTRING
    case 'U':   // SHORT_BINSTRING
    case 'B':   // BINBYTES
    case 'C':   // SHORT_BINBYTES
    case 0x8e:  // BINBYTES8
    case 0x96:  // BYTEARRAY8
      return String(op);
    case ')':   // EMPTY_TUPLE
    case 0x85:  // TUPLE1
    case 0x86:  // TUPLE2
    case 0x87:  // TUPLE3
    case 't':   // TUPLE
    case 'l':   // LIST
    case 0x91:  // FROZENSET
    case ']':   // EMPTY_LIST
    case '}':   // EMPTY_DICT
    case 0x8f:  // EMPTY_SET
    case 'd':   // DICT
      return Container(op);
    case 'a':   // APPEND
    case 'e':   // APPENDS
    case 0x90:  // ADDITEMS
    case 's':   // SETITEM
    case 'u':   // SETITEMS
      return Fill(op);
    case 'h':   // BINGET
    case 'j':   // LONG_BINGET
    case 'q':   // BINPUT
    case 'r':   // LONG_BINPUT
    case 0x94:  // MEMOIZE
      return MemoOp(op);
    case 'c':   // GLOBAL
    case 0x93:  // STACK_GLOBAL
      return GlobalOp(op);
    case 'R':   // REDUCE
    case 0x81:  // NEWOBJ
    case 0x92:  // NEWOBJ_EX
    case 'b':   // BUILD
    case 'Q':   // BINPERSID
      return ObjectOp(op);
    default:
      return Refuse(op);
  }
}

Status Machine::Framing(uint8_t op) {
  if (op == 0x80) {  // PROTO
    FERRY_RETURN_IF_ERROR(Need(1));
    uint8_t v = data_[pos_++];
    if (v < 2 || v > 5) return Fail("pickle protocol ", int{v}, " (only 2 to 5 are read)");
    return Status::Ok();
  }
  // FRAME: a length hint, nothing to do but check it
  FERRY_RETURN_IF_ERROR(Need(8));
  if (LoadLE(data_ + pos_, 8) > size_ - pos_ - 8) return Fail("FRAME past the end");
  pos_ += 8;
  return Status::Ok();
}

Status Machine::StackOp(uint8_t op) {
  switch (op) {
    case '(':  // MARK
      if (marks_.size() >= kMaxPickleMarks) {
        return Error(StatusCode::kResourceExhausted, opt_.where, ": MARKs nested deeper than ",
                     kMaxPickleMarks, " at byte ", opt_.offset_base + op_pos_);
      }
      marks_.push_back(stack_.size());
      return Status::Ok();
    case '0':  // POP
      if (stack_.size() > MarkFloor()) {
        stack_.pop_back();
      } else if (!marks_.empty() && stack_.size() == marks_.back()) {
        marks_.pop_back();  // POP of a MARK, as CPython allows
      } else {
        return Fail("POP of an empty stack");
      }
      return Status::Ok();
    case '1': {  // POP_MARK
      FERRY_ASSIGN_OR_RETURN(auto dropped, PopMark());
      (void)dropped;
      return Status::Ok();
    }
    default:  // DUP
      if (stack_.size() <= MarkFloor()) return Fail("DUP of an empty stack");
      return Push(stack_.back());
  }
}

Status Machine::Scalar(uint8_t op) {
  switch (op) {
    case 'N': {
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kNone));
      return Push(v);
    }
    case 0x88:
    case 0x89: {  // NEWTRUE, NEWFALSE
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kBool));
      v->b = op == 0x88;
      return Push(v);
    }
    case 'J':
    case 'K':
    case 'M': {  // BININT (i32), BININT1 (u8), BININT2 (u16)
      int n = op == 'J' ? 4 : op == 'K' ? 1 : 2;
      FERRY_RETURN_IF_ERROR(Need(n));
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kInt));
      uint64_t raw = LoadLE(data_ + pos_, n);
      v->i = op == 'J' ? int64_t{static_cast<int32_t>(raw)} : static_cast<int64_t>(raw);
      pos_ += n;
      return Push(v);
    }
    case 0x8a:
    case 0x8b: {  // LONG1, LONG4: little-endian two's complement of a given length
      int lw = op == 0x8a ? 1 : 4;
      FERRY_RETURN_IF_ERROR(Need(lw));
      uint64_t n = LoadLE(data_ + pos_, lw);
      if (op == 0x8b && (n >> 31) != 0) return Fail("negative LONG4 length");
      pos_ += lw;
      FERRY_RETURN_IF_ERROR(Need(n));
      FERRY_ASSIGN_OR_RETURN(Value * v, New(n <= 8 ? Kind::kInt : Kind::kBigInt));
      if (n <= 8) {
        uint64_t raw = n ? LoadLE(data_ + pos_, static_cast<int>(n)) : 0;
        if (n > 0 && n < 8 && (data_[pos_ + n - 1] & 0x80)) raw |= ~uint64_t{0} << (8 * n);
        v->i = static_cast<int64_t>(raw);
      } else {
        v->s.assign(reinterpret_cast<const char*>(data_ + pos_), n);
      }
      pos_ += n;
      return Push(v);
    }
    default: {  // BINFLOAT, big-endian
      FERRY_RETURN_IF_ERROR(Need(8));
      uint64_t raw = 0;
      for (int k = 0; k < 8; ++k) raw = (raw << 8) | data_[pos_ + k];
      pos_ += 8;
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kFloat));
      std::memcpy(&v->f, &raw, 8);
      return Push(v);
    }
  }
}

// BINUNICODE (u32), SHORT_BINUNICODE (u8), BINUNICODE8; BINSTRING (i32), SHORT_BINSTRING;
// BINBYTES (u32), SHORT_BINBYTES, BINBYTES8, BYTEARRAY8.
Status Machine::String(uint8_t op) {
  int lw = (op == 0x8c || op == 'U' || op == 'C')     ? 1
           : (op == 0x8d || op == 0x8e || op == 0x96) ? 8
                                                      : 4;
  FERRY_RETURN_IF_ERROR(Need(lw));
  uint64_t n = LoadLE(data_ + pos_, lw);
  if (op == 'T' && (n >> 31) != 0) return Fail("negative BINSTRING length");
  pos_ += lw;
  bool text = op == 'X' || op == 0x8c || op == 0x8d || op == 'T' || op == 'U';
  return PushString(text ? Kind::kStr : Kind::kBytes, n);
}

Status Machine::Container(uint8_t op) {
  switch (op) {
    case ')': {
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kTuple));
      return Push(v);
    }
    case 0x85:
    case 0x86:
    case 0x87: {  // TUPLE1..3
      size_t n = op - 0x84;
      if (stack_.size() < MarkFloor() + n) return Fail("TUPLE", n, " of a short stack");
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kTuple));
      v->items.assign(stack_.end() - n, stack_.end());
      stack_.resize(stack_.size() - n);
      return Push(v);
    }
    case 't':
    case 'l':
    case 0x91: {  // TUPLE, LIST, FROZENSET
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      FERRY_ASSIGN_OR_RETURN(Value * v, New(op == 't'   ? Kind::kTuple
                                            : op == 'l' ? Kind::kList
                                                        : Kind::kSet));
      v->items = std::move(items);
      return Push(v);
    }
    case ']':
    case '}':
    case 0x8f: {  // EMPTY_LIST, EMPTY_DICT, EMPTY_SET
      FERRY_ASSIGN_OR_RETURN(Value * v, New(op == ']'   ? Kind::kList
                                            : op == '}' ? Kind::kDict
                                                        : Kind::kSet));
      return Push(v);
    }
    default: {  // DICT
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      if (items.size() % 2) return Fail("DICT with an odd number of items");
      FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kDict));
      for (size_t k = 0; k < items.size(); k += 2) v->dict.emplace_back(items[k], items[k + 1]);
      return Push(v);
    }
  }
}

// APPEND, APPENDS, ADDITEMS, SETITEM, SETITEMS: into the container below the arguments.
Status Machine::Fill(uint8_t op) {
  switch (op) {
    case 'a': {  // APPEND
      FERRY_ASSIGN_OR_RETURN(Value * x, Pop());
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(Kind::kList)) {
        return Fail("APPEND to something that is not a list");
      }
      stack_.back()->items.push_back(x);
      return Status::Ok();
    }
    case 'e':
    case 0x90: {  // APPENDS, ADDITEMS
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      Kind want = op == 'e' ? Kind::kList : Kind::kSet;
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(want)) {
        return Fail(op == 'e' ? "APPENDS to something that is not a list"
                              : "ADDITEMS to something that is not a set");
      }
      auto& dst = stack_.back()->items;
      dst.insert(dst.end(), items.begin(), items.end());
      return Status::Ok();
    }
    case 's': {  // SETITEM
      FERRY_ASSIGN_OR_RETURN(Value * val, Pop());
      FERRY_ASSIGN_OR_RETURN(Value * key, Pop());
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(Kind::kDict)) {
        return Fail("SETITEM on something that is not a dict");
      }
      stack_.back()->dict.emplace_back(key, val);
      return Status::Ok();
    }
    default: {  // SETITEMS
      FERRY_ASSIGN_OR_RETURN(auto items, PopMark());
      if (items.size() % 2) return Fail("SETITEMS with an odd number of items");
      if (stack_.size() <= MarkFloor() || !stack_.back()->is(Kind::kDict)) {
        return Fail("SETITEMS on something that is not a dict");
      }
      for (size_t k = 0; k < items.size(); k += 2) {
        stack_.back()->dict.emplace_back(items[k], items[k + 1]);
      }
      return Status::Ok();
    }
  }
}

Status Machine::MemoOp(uint8_t op) {
  if (op == 0x94) {  // MEMOIZE
    if (stack_.size() <= MarkFloor()) return Fail("MEMOIZE of an empty stack");
    return Memo(memo_.size(), stack_.back());
  }
  // BINGET, LONG_BINGET, BINPUT, LONG_BINPUT
  int n = op == 'h' || op == 'q' ? 1 : 4;
  FERRY_RETURN_IF_ERROR(Need(n));
  uint64_t idx = LoadLE(data_ + pos_, n);
  pos_ += n;
  if (op == 'h' || op == 'j') {
    auto it = memo_.find(idx);
    if (it == memo_.end()) return Fail("memo entry ", idx, " read before it was written");
    return Push(it->second);
  }
  if (stack_.size() <= MarkFloor()) return Fail("PUT of an empty stack");
  return Memo(idx, stack_.back());
}

// GLOBAL "module\nname\n", STACK_GLOBAL: only allow-listed names (Resolve).
Status Machine::GlobalOp(uint8_t op) {
  std::string module, name;
  if (op == 'c') {
    for (std::string* part : {&module, &name}) {
      const void* nl =
          std::memchr(data_ + pos_, '\n', std::min<uint64_t>(size_ - pos_, kMaxGlobalName));
      if (nl == nullptr) return Fail("GLOBAL without a newline-terminated name");
      uint64_t end = static_cast<const uint8_t*>(nl) - data_;
      part->assign(reinterpret_cast<const char*>(data_ + pos_), end - pos_);
      pos_ = end + 1;
    }
  } else {
    FERRY_ASSIGN_OR_RETURN(Value * n, Pop());
    FERRY_ASSIGN_OR_RETURN(Value * m, Pop());
    if (!m->is_str() || !n->is_str()) return Fail("STACK_GLOBAL of non-strings");
    if (m->s.size() > kMaxGlobalName || n->s.size() > kMaxGlobalName) {
      return Fail("STACK_GLOBAL of a name longer than ", kMaxGlobalName, " bytes");
    }
    module = m->s;
    name = n->s;
  }
  auto g = Resolve(module, name);
  if (!g) {
    return Fail("refused global ", Quote(StrCat(module, ".", name)),
                " (not a tensor, container or recipe the importer knows; nothing was run)");
  }
  FERRY_ASSIGN_OR_RETURN(Value * v, New(Kind::kGlobal));
  v->s = StrCat(module, ".", name);
  v->global = *g;
  return Push(v);
}

// REDUCE, NEWOBJ, NEWOBJ_EX, BUILD, BINPERSID: calls, all answered by the allow-list.
Status Machine::ObjectOp(uint8_t op) {
  switch (op) {
    case 'R': {  // REDUCE
      FERRY_ASSIGN_OR_RETURN(Value * args, Pop());
      FERRY_ASSIGN_OR_RETURN(Value * fn, Pop());
      return Reduce(fn, args);
    }
    case 0x81:
    case 0x92: {  // NEWOBJ (cls, args), NEWOBJ_EX (cls, args, kwargs)
      Value* kwargs = nullptr;
      if (op == 0x92) {
        FERRY_ASSIGN_OR_RETURN(kwargs, Pop());
      }
      FERRY_ASSIGN_OR_RETURN(Value * args, Pop());
      FERRY_ASSIGN_OR_RETURN(Value * cls, Pop());
      return NewObj(cls, args, kwargs);
    }
    case 'b': {  // BUILD
      FERRY_ASSIGN_OR_RETURN(Value * state, Pop());
      if (stack_.size() <= MarkFloor()) return Fail("BUILD of an empty stack");
      return Build(stack_.back(), state);
    }
    default: {  // BINPERSID
      FERRY_ASSIGN_OR_RETURN(Value * pid, Pop());
      if (!opt_.persistent_load) return Fail("persistent id where none is expected");
      FERRY_ASSIGN_OR_RETURN(Value * v, opt_.persistent_load(pid, opt_.offset_base + op_pos_));
      return Push(v);
    }
  }
}

Status Machine::Refuse(uint8_t op) {
  switch (op) {
    case 'i':
      return Fail("refused opcode INST (builds an arbitrary object)");
    case 'o':
      return Fail("refused opcode OBJ (builds an arbitrary object)");
    case 0x82:
    case 0x83:
    case 0x84:
      return Fail("refused opcode EXT (copyreg extension registry)");
    case 0x97:
    case 0x98:
      return Fail("refused out-of-band buffer opcode");
    case 'P':
    case 'I':
    case 'L':
    case 'F':
    case 'S':
    case 'V':
    case 'g':
    case 'p':
      return Fail("protocol 0 opcode ", Quote(std::string(1, static_cast<char>(op))),
                  " (only protocols 2 to 5 are read)");
    default:
      return Fail("unknown pickle opcode 0x", std::hex, int{op});
  }
}

}  // namespace ferry::torch_import::pickle
