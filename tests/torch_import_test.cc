// The restricted unpickler and the zip reader behind PyTorch checkpoint import
// (src/torch_import), on hand-assembled pickles and archives. End-to-end conversions of
// torch-format checkpoints are tested from Python (tests/python/test_torch_import.py).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>

#include "base/util.hpp"
#include "import/torch/import_writer.hpp"
#include "import/torch/te_extra_state.hpp"
#include "import/torch/torch_checkpoint.hpp"
#include "import/torch/unpickle.hpp"
#include "import/torch/zip.hpp"
#include "test_util.hpp"
#include "torch_builders.hpp"

namespace ferry::torch_import {
namespace {

using Kind = Value::Kind;
using torch_test::DcpChunk;
using torch_test::DcpTensor;
using torch_test::Pickle;

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Container slots (list, tuple and set items, dict entries) held by the distinct values
// reachable from `root`: what a pickle's values occupy, however often they are shared.
uint64_t HeldSlots(const Value* root) {
  std::set<const Value*> seen;
  std::vector<const Value*> todo{root};
  uint64_t slots = 0;
  while (!todo.empty()) {
    const Value* v = todo.back();
    todo.pop_back();
    if (v == nullptr || !seen.insert(v).second) continue;
    slots += v->items.size() + v->dict.size();
    for (const Value* x : v->items) todo.push_back(x);
    for (const auto& [k, x] : v->dict) todo.push_back(x);
    todo.push_back(v->args);
    todo.push_back(v->state);
  }
  return slots;
}

Result<Value*> RunPickle(Heap* heap, const std::string& bytes) {
  UnpickleOptions o;
  o.where = "t.pkl";
  return Unpickle(heap, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), o);
}

std::string Msg(const std::string& bytes) {
  Heap heap;
  auto r = RunPickle(&heap, bytes);
  EXPECT_FALSE(r.ok());
  return r.ok() ? "" : r.status().message();
}

TEST(UnpickleTest, PlainValues) {
  Heap heap;
  // pickle.dumps({"a": [1, -2, 300, 2**40, 1.5, None, True, "x", b"yz"], "t": (1, 2)}, 3)
  std::string p(
      "\200\003}q\000(X\001\000\000\000aq\001]q\002(K\001J\376\377\377\377M,\001\212\006\000"
      "\000\000\000\000\001G\077\370\000\000\000\000\000\000N\210X\001\000\000\000xq\003C"
      "\002yzq\004eX\001\000\000\000tq\005K\001K\002\206q\006u.",
      79);
  auto r = RunPickle(&heap, p);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Value* a = (*r)->Get("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items.size(), 9u);
  EXPECT_EQ(a->items[0]->i, 1);
  EXPECT_EQ(a->items[1]->i, -2);
  EXPECT_EQ(a->items[2]->i, 300);
  EXPECT_EQ(a->items[3]->i, int64_t{1} << 40);
  EXPECT_EQ(a->items[4]->f, 1.5);
  EXPECT_TRUE(a->items[5]->is(Kind::kNone));
  EXPECT_TRUE(a->items[6]->b);
  EXPECT_EQ(a->items[7]->s, "x");
  EXPECT_TRUE(a->items[8]->is(Kind::kBytes));
  EXPECT_EQ(a->items[8]->s, "yz");
  EXPECT_EQ((*r)->Get("t")->items.size(), 2u);
}

TEST(UnpickleTest, RefusesEveryOtherGlobalNamingItAndTheOffset) {
  EXPECT_EQ(Msg(std::string("\200\002cos\012system\012X\002\000\000\000ls\205R.", 23)),
            "t.pkl: refused global 'os.system' (not a tensor, container or recipe the importer "
            "knows; nothing was run) at byte 2");
  // STACK_GLOBAL of memoized strings (protocol 4).
  std::string sg(
      "\200\004\225\024\000\000\000\000\000\000\000\214\010builtins\224\214\004eval"
      "\224\223\224.",
      32);
  EXPECT_EQ(Msg(sg),
            "t.pkl: refused global 'builtins.eval' (not a tensor, container or recipe the "
            "importer knows; nothing was run) at byte 29");
  EXPECT_EQ(Msg(std::string("\200\002(X\001\000\000\000xios\012system\012.", 21)),
            "t.pkl: refused opcode INST (builds an arbitrary object) at byte 9");
  EXPECT_EQ(Msg(std::string("\200\002(ctorch\012Size\012o.", 17)),
            "t.pkl: refused opcode OBJ (builds an arbitrary object) at byte 15");
  EXPECT_NE(Msg("\x80\x02\x82\x01.").find("EXT"), std::string::npos);
  EXPECT_NE(Msg("(dp0\n.").find("only protocols 2 to 5"), std::string::npos);
  EXPECT_NE(Msg("\x80\x06N.").find("pickle protocol 6"), std::string::npos);
}

TEST(UnpickleTest, AllowedNamesDoNotMeanAnythingGoes) {
  // torch.Size is allowed as a REDUCE of a tuple, not as a class to NEWOBJ.
  EXPECT_NE(Msg("\x80\x02\x63torch\nSize\n)\x81.").find("NEWOBJ of 'torch.Size'"),
            std::string::npos);
  // A tensor needs a storage, not an int.
  EXPECT_NE(
      Msg(std::string("\200\002ctorch._utils\012_rebuild_tensor_v2\012(K\000K\000)))\211}tR.", 48))
          .find("the first argument is not a storage"),
      std::string::npos);
  // _codecs.encode only of latin-1 text.
  EXPECT_NE(
      Msg(std::string(
              "\200\002c_codecs\012encode\012X\001\000\000\000xX\005\000\000\000utf-8\206R.", 37))
          .find("_codecs.encode other than"),
      std::string::npos);
  // BUILD is refused on plain values.
  EXPECT_NE(Msg("\x80\x02K\x01}b.").find("BUILD on a value"), std::string::npos);
}

TEST(UnpickleTest, Limits) {
  std::string marks = "\x80\x02" + std::string(kMaxPickleMarks + 1, '(') + ".";
  Heap heap;
  auto r = RunPickle(&heap, marks);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("MARKs nested deeper than 1024"), std::string::npos);
  // A length prefix far past the input.
  EXPECT_NE(Msg(std::string("\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x3f.", 13))
                .find("truncated pickle"),
            std::string::npos);
  EXPECT_NE(Msg("\x80\x02h\x05.").find("memo entry 5 read before it was written"),
            std::string::npos);
  EXPECT_NE(Msg("\x80\x02N").find("pickle ends without STOP"), std::string::npos);
  EXPECT_NE(Msg("\x80\x02NN.").find("STOP with 2 values"), std::string::npos);
  EXPECT_NE(Msg("\x80\x02N.junk").find("4 bytes after STOP"), std::string::npos);
  EXPECT_NE(Msg("\x80\x02"
                "a.")
                .find("stack underflow"),
            std::string::npos);
}

TEST(UnpickleTest, SelfReferenceIsACycleNotAProblem) {
  Heap heap;
  // l = []; l.append(l)
  auto r = RunPickle(&heap, std::string("\x80\x02]q\x00h\x00\x61.", 9));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ((*r)->items.size(), 1u);
  EXPECT_EQ((*r)->items[0], *r);
}

TEST(TensorCopyTest, StridedViewsAreGatheredDense) {
  float data[12];
  for (int i = 0; i < 12; ++i) data[i] = static_cast<float>(i);
  Storage st;
  st.key = "0";
  st.dtype = *TorchDTypeByName("float32");
  st.data = reinterpret_cast<const uint8_t*>(data);
  st.nbytes = sizeof(data);
  TensorRef t;
  t.storage = &st;
  t.dtype = st.dtype;
  t.storage_offset = 1;
  t.shape = {3, 2};
  t.stride = {1, 4};  // columns of a [2, 4] block starting at 1, transposed
  EXPECT_FALSE(IsContiguous(t));
  float out[6];
  ASSERT_TRUE(CopyTensorBytes(t, 0, reinterpret_cast<uint8_t*>(out), 24, nullptr, "t").ok());
  const float want[6] = {1, 5, 2, 6, 3, 7};
  EXPECT_EQ(std::memcmp(out, want, 24), 0);
  // A piece starting mid-element.
  uint8_t part[9];
  ASSERT_TRUE(CopyTensorBytes(t, 6, part, 9, nullptr, "t").ok());
  EXPECT_EQ(std::memcmp(part, reinterpret_cast<const uint8_t*>(want) + 6, 9), 0);
  EXPECT_EQ(CopyTensorBytes(t, 20, part, 9, nullptr, "t").code(), StatusCode::kInvalidArgument);
}

TEST(ZipTest, RefusesWhatTorchNeverWrites) {
  auto open = [](const std::string& b) {
    return ZipArchive::Open(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "a.zip");
  };
  EXPECT_EQ(open("short").status().message(), "a.zip: not a zip archive (5 bytes)");
  std::string no_end(100, 'x');
  EXPECT_EQ(open(no_end).status().message(), "a.zip: no zip end of central directory record");
  // An end record claiming a directory past the file.
  std::string eocd = std::string("PK\x05\x06", 4) + std::string(6, '\0') +
                     std::string("\x01\x00\x2e\x00\x00\x00\x10\x00\x00\x00\x00\x00", 12);
  EXPECT_EQ(open(eocd).status().message(),
            "a.zip: central directory (offset 16, 46 bytes) lies outside the archive");
  std::string empty = std::string("PK\x05\x06", 4) + std::string(18, '\0');
  auto z = open(empty);
  ASSERT_TRUE(z.ok()) << z.status().ToString();
  EXPECT_TRUE(z->entries().empty());
}

TEST(TorchZipTest, LegacyFilesGetAClearError) {
  std::string legacy("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15);
  Heap heap;
  auto r =
      LoadTorchZip(&heap, reinterpret_cast<const uint8_t*>(legacy.data()), legacy.size(), "old.pt");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(r.status().message().find("old.pt: a legacy torch.save file"), std::string::npos);
}

// ---- issue 23, item 13: arguments shared through the memo are shared, not copied ----------

// One tuple of `n` items used as the arguments of `m` calls (5 bytes each), as the issue's
// 1.1 MB pickle did: every call kept its own copy of the tuple, n * m slots in all.
std::string SharedArgumentsPickle(uint32_t n, uint32_t m) {
  Pickle p;
  p.Global("transformer_engine.common.recipe", "Format").Put(0).Pop().Int(7).Put(1).Pop();
  p.Mark();
  for (uint32_t i = 0; i < n; ++i) p.Get(1);
  p.Tuple().Put(2).Pop();
  p.Global("torch", "Size").Put(3).Pop();
  for (uint32_t k = 0; k < m; ++k) {
    p.Get(0).Get(2).Reduce().Pop();           // Format(*args): a record
    p.Get(0).Get(2).Op('\x81').Pop();         // NEWOBJ of the same
    p.Get(3).Mark().Get(2).Tuple().Reduce();  // torch.Size(args)
    p.Pop();
  }
  return p.Op('}').Done();
}

TEST(UnpickleTest, SharedArgumentsAreSharedNotCopied) {
  const std::string bytes = SharedArgumentsPickle(20000, 20000);  // 1.3 MB
  Heap heap;
  auto r = RunPickle(&heap, bytes);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(heap.copied, 0u);
  // At most one value per opcode, and every one of them reachable holds no copied slots.
  EXPECT_LE(heap.values(), bytes.size());
  Pickle keep;  // the same calls, their results kept in a list
  keep.Global("transformer_engine.common.recipe", "Format").Put(0).Pop().Int(7).Put(1).Pop();
  keep.Mark();
  for (int i = 0; i < 1000; ++i) keep.Get(1);
  keep.Tuple().Put(2).Pop().Mark();
  for (int k = 0; k < 1000; ++k) keep.Get(0).Get(2).Reduce().Get(0).Get(2).Op('\x81');
  Heap heap2;
  auto kept = RunPickle(&heap2, keep.List().Done());
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  ASSERT_EQ((*kept)->items.size(), 2000u);
  EXPECT_LE(HeldSlots(*kept), 2000u + 1000u + 2u);  // the list, the one tuple, the Format's
  EXPECT_EQ((*kept)->items[0]->Elements().size(), 1000u);
  EXPECT_EQ((*kept)->items[1999]->args, (*kept)->items[0]->args);
}

TEST(UnpickleTest, ConversionsOfASharedValueHappenOnce) {
  // _codecs.encode and bytearray of one long string or bytes, 50,000 times.
  Pickle p;
  p.Global("_codecs", "encode").Put(0).Pop().Str(std::string(20000, 'x')).Put(1).Pop();
  p.Global("builtins", "bytearray").Put(2).Pop().Bytes(std::string(20000, 'y')).Put(3).Pop();
  p.Mark();
  for (int k = 0; k < 50000; ++k) {
    p.Get(0).Get(1).Str("latin1").Op('\x86').Reduce();
    p.Get(2).Get(3).Op('\x85').Reduce();
  }
  Heap heap;
  auto r = RunPickle(&heap, p.List().Done());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ((*r)->items.size(), 100000u);
  EXPECT_EQ((*r)->items[0], (*r)->items[99998]);  // one encoded value
  EXPECT_EQ((*r)->items[1], (*r)->items[99999]);  // bytearray(b) is b
  EXPECT_EQ((*r)->items[0]->s, std::string(20000, 'x'));
}

TEST(UnpickleTest, CopiesOfASharedListAreCountedAgainstThePickle) {
  // set(list) must copy (the list may grow later); a shared list copied over and over is
  // refused once the copies pass kPickleCopiesPerByte per byte of the pickle.
  Pickle p;
  p.Global("builtins", "set").Put(0).Pop().Mark();
  for (int i = 0; i < 10000; ++i) p.Op('N');
  p.List().Put(1).Pop();
  for (int k = 0; k < 20000; ++k) p.Get(0).Get(1).Op('\x85').Reduce().Pop();
  Heap heap;
  auto r = RunPickle(&heap, p.Op('N').Done());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("copies more than 2 container items per byte"),
            std::string::npos)
      << r.status().message();
  EXPECT_LE(heap.copied, 2 * p.bytes().size() + kPickleCopySlack + 10000);
  // A few copies are fine.
  Pickle few;
  few.Global("builtins", "set").Mark().Op('N').Op('N').List().Op('\x85').Reduce();
  Heap heap2;
  auto ok = RunPickle(&heap2, few.Done());
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)->items.size(), 2u);
}

// ---- issue 23, item 16: counts checked before use ------------------------------------------

std::string TensorMessage(const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                          int64_t offset = 0) {
  Storage st;
  st.key = "0";
  st.dtype = *TorchDTypeByName("float32");
  static const float data[4] = {};
  st.data = reinterpret_cast<const uint8_t*>(data);
  st.nbytes = sizeof(data);
  Heap heap;
  UnpickleOptions o;
  o.where = "t.pkl";
  o.persistent_load = [&](Value*, uint64_t) -> Result<Value*> {
    Value* v = heap.New(Kind::kStorage);
    v->storage = &st;
    return v;
  };
  const std::string bytes = Pickle().Tensor("0", 4, offset, size, stride).Done();
  auto r = Unpickle(&heap, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), o);
  return r.ok() ? "accepted" : r.status().message();
}

TEST(UnpickleTest, ElementAndByteCountsAreCheckedBeforeUse) {
  EXPECT_EQ(TensorMessage({2, 2}, {2, 1}), "accepted");
  // A broadcast view of 2^62 float32 elements: 2^64 bytes, which wrapped to 0.
  EXPECT_NE(TensorMessage({int64_t{1} << 62}, {0}).find("is more than 2^63 bytes"),
            std::string::npos);
  // The furthest element is 2^64 - 1 elements in: one more wrapped to 0, inside any storage.
  EXPECT_NE(TensorMessage({3}, {INT64_MAX}, 1).find("reach past 64 bits"), std::string::npos);
  EXPECT_NE(TensorMessage({int64_t{1} << 32, int64_t{1} << 32}, {0, 0})
                .find("has more elements than 64 bits count"),
            std::string::npos);
  EXPECT_NE(TensorMessage({2, -3}, {1, 1}).find("negative size or stride in dimension 1"),
            std::string::npos);
  EXPECT_NE(TensorMessage({2}, {-1}, 1).find("negative size or stride"), std::string::npos);
  EXPECT_NE(TensorMessage(std::vector<int64_t>(65, 1), std::vector<int64_t>(65, 1))
                .find("size has 65 dimensions (limit 64)"),
            std::string::npos);
}

// ---- whole checkpoints (files) -------------------------------------------------------------

Result<std::unique_ptr<TorchCheckpoint>> OpenSaved(const testing::TempDir& dir,
                                                   const std::string& pickle,
                                                   const std::string& storage = std::string(16,
                                                                                            '\0')) {
  const std::string path = dir.File("m.pt");
  WriteFile(path, torch_test::TorchSave(pickle, {{"0", storage}}));
  return TorchCheckpoint::Open(path);
}

TEST(TorchCheckpointTest, F4ElementCountsAreCheckedToo) {
  testing::TempDir dir;
  // float4_e2m1fn_x2 holds two F4 elements per byte: 2^62 bytes (a broadcast view) are 2^63
  // F4 elements, one more than an int64 counts.
  Pickle p;
  p.Op('}').Str("w");
  p.Global("torch._utils", "_rebuild_tensor_v3").Mark();
  p.Mark().Str("storage").Global("torch", "UntypedStorage").Str("0").Str("cpu").Int(16).Tuple();
  p.Op('Q').Int(0).Ints({int64_t{1} << 62}).Ints({0}).Op('\x89');
  p.Global("collections", "OrderedDict").Op(')').Reduce().Global("torch", "float4_e2m1fn_x2");
  p.Tuple().Reduce().Op('s');
  auto r = OpenSaved(dir, p.Done());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor 'w' of torch.float4_e2m1fn_x2 has more F4 elements"),
            std::string::npos)
      << r.status().message();
}

// ---- issue 23, item 12: values reached through shared references ----------------------------

// {"x": L_k} where L_0 = [] and L_i = [L_(i-1), L_(i-1)]: 2^k paths over k + 1 lists, in a few
// hundred bytes. Every path was walked (and named, and imported as metadata).
std::string SharedListsPickle(int k) {
  Pickle p;
  p.Op('}').Str("x").Op(']').Put(0).Pop();
  for (int i = 1; i <= k; ++i) p.Mark().Get(i - 1).Get(i - 1).List().Put(i).Pop();
  return p.Get(k).Op('s').Done();
}

TEST(TorchCheckpointTest, SharedReferencesCostWhatTheirPathsProduce) {
  testing::TempDir dir;
  auto r = OpenSaved(dir, SharedListsPickle(48));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("through shared references"), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("m.pt: entry 'x.0.0."), std::string::npos);
  // A little sharing is what checkpoints hold (tied weights, a config saved twice): every
  // path is imported under its own name.
  auto small = OpenSaved(dir, SharedListsPickle(3));
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_EQ((*small)->metadata().size(), 8u);
  EXPECT_EQ((*small)->metadata()[7].first, "x.1.1.1");
  // Output larger than the pickle is fine where real checkpoints make it: a million small
  // ints (2 bytes each) become 3.9 MB of metadata text.
  Pickle ids;
  ids.Op('}').Str("ids").Mark();
  for (int i = 0; i < 1000000; ++i) ids.Op('K').Op(static_cast<char>(i % 100));
  auto many = OpenSaved(dir, ids.List().Op('s').Done());
  ASSERT_TRUE(many.ok()) << many.status().ToString();
  EXPECT_EQ((*many)->metadata()[0].second.size(), 3900000u);
  Pickle tied;
  tied.Op('}').Mark().Str("a").Tensor("0", 4, 0, {4}, {1}).Put(0).Str("b").Get(0).Op('u');
  auto t = OpenSaved(dir, tied.Done());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ((*t)->tensors().size(), 2u);
  EXPECT_EQ((*t)->tensors()[1].name, "b");
  EXPECT_EQ((*t)->tensors()[0].ref, (*t)->tensors()[1].ref);
}

TEST(TorchCheckpointTest, ExtraStateVariablesAreBoundedToo) {
  // extra_fp8_variables of nested shared lists, 200 wide and 8 deep: 200^8 nodes.
  Pickle p;
  p.Op('}').Str("extra_fp8_variables").Op('}').Str("v").Op(']').Put(0).Pop();
  for (int i = 1; i <= 8; ++i) {
    p.Mark();
    for (int k = 0; k < 200; ++k) p.Get(i - 1);
    p.List().Put(i).Pop();
  }
  p.Get(8).Op('s').Op('s');
  Heap heap;
  auto root = RunPickle(&heap, p.Done());
  ASSERT_TRUE(root.ok()) << root.status().ToString();
  WalkBudget budget;
  budget.Grant(p.bytes().size());
  std::vector<std::pair<std::string, std::string>> md;
  auto st = DecodeExtraState(&heap, *root, "m", nullptr, "te.pt: 'm._extra_state'", &md, &budget);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.status().message().find("te.pt: 'm._extra_state': reading the checkpoint's"),
            std::string::npos)
      << st.status().message();
}

// ---- issue 23, item 17: a tensor in two shards --------------------------------------------

TEST(TorchCheckpointTest, ATensorInTwoShardsNamesBoth) {
  testing::TempDir dir;
  Pickle p;
  p.Op('}').Str("a").Tensor("0", 4, 0, {4}, {1}).Op('s');
  WriteFile(dir.File("s1.bin"), torch_test::TorchSave(p.Done(), {{"0", std::string(16, '\0')}}));
  p.Str("b").Tensor("0", 4, 0, {4}, {1}).Op('s');
  WriteFile(dir.File("s2.bin"), torch_test::TorchSave(p.Done(), {{"0", std::string(16, '\0')}}));
  WriteFile(dir.File("m.bin.index.json"), R"({"weight_map": {"a": "s1.bin", "b": "s2.bin"}})");
  auto r = TorchCheckpoint::Open(dir.File("m.bin.index.json"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), dir.File("m.bin.index.json") + ": tensor 'a' is in two shards: " +
                                      dir.File("s1.bin") + " and " + dir.File("s2.bin"));
  // And a weight_map that is simply wrong says which shard does hold the tensor.
  Pickle b;
  b.Op('}').Str("b").Tensor("0", 4, 0, {4}, {1}).Op('s');
  WriteFile(dir.File("s2.bin"), torch_test::TorchSave(b.Done(), {{"0", std::string(16, '\0')}}));
  WriteFile(dir.File("m.bin.index.json"), R"({"weight_map": {"a": "s2.bin", "b": "s1.bin"}})");
  r = TorchCheckpoint::Open(dir.File("m.bin.index.json"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("puts tensor 'a' in shard " + dir.File("s2.bin") +
                                      ", which does not hold it (" + dir.File("s1.bin") + " does)"),
            std::string::npos)
      << r.status().message();
}

// ---- DCP folders: items 14 and 20 -----------------------------------------------------------

// A data file holding one torch.save archive of a float32 [1, 4] tensor; its length.
int64_t WriteDcpItem(const std::string& path) {
  Pickle p;
  p.Tensor("0", 4, 0, {1, 4}, {4, 1});
  const std::string zip = torch_test::TorchSave(p.Done(), {{"0", torch_test::FloatBytes(4)}});
  WriteFile(path, zip);
  return static_cast<int64_t>(zip.size());
}

TEST(DcpTest, ChunksAssembleAndEachItemIsReadOnce) {
  testing::TempDir dir;
  const int64_t len = WriteDcpItem(dir.File("d"));
  WriteFile(dir.File(".metadata"),
            torch_test::DcpMetadata({{"w", {1, 4}, {{{0, 0}, {1, 4}, "d", 0, len}}}}));
  auto ok = TorchCheckpoint::Open(dir.path());
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  ASSERT_EQ((*ok)->tensors().size(), 1u);
  EXPECT_EQ((*ok)->tensors()[0].nbytes, 16u);
  // 600 chunks naming the same item: each was parsed again (a 2 MB item made that > 1 GiB);
  // now the second claim on the item's bytes is refused, naming both.
  DcpTensor many{"w", {600, 4}, {}};
  for (int64_t i = 0; i < 600; ++i) many.chunks.push_back({{i, 0}, {1, 4}, "d", 0, len});
  WriteFile(dir.File(".metadata"), torch_test::DcpMetadata({many}));
  auto r = TorchCheckpoint::Open(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), StrCat(dir.File("d"), ": tensor 'w' chunk 1 (bytes 0 to ", len,
                                         ") and tensor 'w' chunk 0 (bytes 0 to ", len,
                                         ") overlap: each item of a data file is read once"));
  // Overlapping without being equal, across tensors.
  WriteFile(dir.File(".metadata"),
            torch_test::DcpMetadata({{"a", {1, 4}, {{{0, 0}, {1, 4}, "d", 0, len}}},
                                     {"b", {1, 4}, {{{0, 0}, {1, 4}, "d", 1, len - 1}}}}));
  r = TorchCheckpoint::Open(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tensor 'b' chunk 0 (bytes 1 to"), std::string::npos)
      << r.status().message();
}

TEST(DcpTest, EmptyFilesAreCleanErrors) {
  // Empty files map to no address at all; copying "their bytes" was memcpy(dst, NULL, 0),
  // which UBSan (the asan preset) aborts on.
  testing::TempDir dir;
  WriteFile(dir.File(".metadata"), "");
  auto r = TorchCheckpoint::Open(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find(".metadata: not a pickle"), std::string::npos)
      << r.status().message();
  WriteFile(dir.File("d"), "");
  WriteFile(dir.File(".metadata"),
            torch_test::DcpMetadata({{"w", {1, 4}, {{{0, 0}, {1, 4}, "d", 0, 0}}}}));
  r = TorchCheckpoint::Open(dir.path());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), dir.File("d") + " at offset 0: not a zip archive (0 bytes)");
  WriteFile(dir.File("e.pt"), "");
  EXPECT_FALSE(TorchCheckpoint::Open(dir.File("e.pt")).ok());
}

TEST(UnpickleTest, LargeDictsAreIndexedForLookups) {
  // Fields of DCP objects are looked up by name; a field dict shared by many objects was
  // scanned once per lookup.
  Heap heap;
  Value* big = heap.New(Kind::kDict);
  for (int i = 0; i < 100000; ++i) {
    Value* k = heap.New(Kind::kStr);
    k->s = "f" + std::to_string(i);
    big->dict.emplace_back(k, k);
  }
  for (int i = 0; i < 100000; ++i) {
    ASSERT_NE(big->Get("f" + std::to_string(i)), nullptr);
  }
  EXPECT_EQ(big->Get("missing"), nullptr);
  Value* dup = heap.New(Kind::kStr);
  dup->s = "f7";
  big->dict.emplace_back(dup, dup);  // appended after indexing; the first still wins
  EXPECT_EQ(big->Get("f7"), big->dict[7].second);
  Value* late = heap.New(Kind::kStr);
  late->s = "late";
  big->dict.emplace_back(late, late);
  EXPECT_EQ(big->Get("late"), late);
}

// ---- issue 23, item 21: only what the output format can read back --------------------------

TEST(ImportWriterTest, SafetensorsOutputFollowsTheReadersRules) {
  testing::TempDir dir;
  auto convert = [&](const std::string& name, const std::string& key) {
    Pickle p;
    p.Op('}').Mark().Str(name).Tensor("0", 4, 0, {4}, {1}).Str(key).Int(1).Op('u');
    auto ck = OpenSaved(dir, p.Done());
    EXPECT_TRUE(ck.ok()) << ck.status().ToString();
    std::filesystem::remove(dir.File("o.safetensors"));
    ImportWriteOptions o;
    Status st = WriteImported(**ck, dir.File("o.safetensors"), o);
    if (st.ok()) {
      // Whatever was written must open.
      auto back = Reader::Open(dir.File("o.safetensors"));
      EXPECT_TRUE(back.ok()) << back.status().ToString();
      return std::string("written");
    }
    EXPECT_FALSE(std::filesystem::exists(dir.File("o.safetensors")));
    return st.message();
  };
  EXPECT_EQ(convert("w", "k"), "written");
  EXPECT_EQ(convert(std::string("w\0x", 3), "k"),
            dir.File("o.safetensors") +
                ": tensor name 'w\\x00x' contains a NUL byte; safetensors cannot hold it");
  EXPECT_NE(convert(std::string(70000, 'w'), "k").find("is 70000 bytes (limit 65536)"),
            std::string::npos);
  EXPECT_EQ(convert("w", ""),
            dir.File("o.safetensors") + ": metadata key '' is empty; safetensors cannot hold it");
  EXPECT_NE(convert("w", std::string("k\0", 2)).find("metadata key 'k\\x00' contains a NUL"),
            std::string::npos);
}

// Plain float values keep a '.' or an exponent, spelled as Python's repr() spells them, so
// they read back as floats (1.0 was "1", an int).
TEST(TorchCheckpointTest, FloatsAreSpelledAsPythonReprSpellsThem) {
  const std::vector<std::pair<double, std::string>> cases = {
      {1.0, "1.0"},
      {0.1, "0.1"},
      {-2.5, "-2.5"},
      {1e20, "1e+20"},
      {1e16, "1e+16"},
      {1e15, "1000000000000000.0"},
      {123456789.0, "123456789.0"},
      {1e-5, "1e-05"},
      {0.0001, "0.0001"},
      {0.00012345, "0.00012345"},
      {-0.0, "-0.0"},
      {0.0, "0.0"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {1.0 / 3, "0.3333333333333333"},
      {12345678901234567.0, "1.2345678901234568e+16"},
      {9999999999999998.0, "9999999999999998.0"},
      {1.5e-7, "1.5e-07"},
      {std::numeric_limits<double>::quiet_NaN(), "nan"},
      {std::numeric_limits<double>::infinity(), "inf"},
      {-std::numeric_limits<double>::infinity(), "-inf"},
  };
  for (const auto& [value, text] : cases) EXPECT_EQ(PythonFloatRepr(value), text) << text;
}

}  // namespace
}  // namespace ferry::torch_import
