// The restricted unpickler and the zip reader behind PyTorch checkpoint import
// (src/torch_import), on hand-assembled pickles and archives. End-to-end conversions of
// torch-format checkpoints are tested from Python (tests/python/test_torch_import.py).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "import/torch/torch_checkpoint.hpp"
#include "import/torch/unpickle.hpp"
#include "import/torch/zip.hpp"

namespace ferry::torch_import {
namespace {

using Kind = Value::Kind;

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

}  // namespace
}  // namespace ferry::torch_import
