// dtypes: names, storage sizes and the DLPack type codes.

#include "capi/internal.hpp"

using namespace ferry::capi;  // NOLINT(build/namespaces): the entry points are shells over these

namespace {

struct DlType {
  uint8_t code;
  uint8_t bits;
};

constexpr DlType kDlTypes[FERRY_NUM_DTYPES] = {
    {kDLBool, 8},
    {kDLUInt, 8},
    {kDLUInt, 16},
    {kDLUInt, 32},
    {kDLUInt, 64},
    {kDLInt, 8},
    {kDLInt, 16},
    {kDLInt, 32},
    {kDLInt, 64},
    {kDLFloat, 16},
    {kDLBfloat, 16},
    {kDLFloat, 32},
    {kDLFloat, 64},
    {kDLComplex, 64},
    {kDLComplex, 128},
    {kDLFloat8_e4m3fn, 8},
    {kDLFloat8_e5m2, 8},
    {kDLFloat8_e8m0fnu, 8},
    {kDLFloat8_e4m3fnuz, 8},
    {kDLFloat8_e5m2fnuz, 8},
    {kDLFloat6_e2m3fn, 6},
    {kDLFloat6_e3m2fn, 6},
    {kDLFloat4_e2m1fn, 4},
};

}  // namespace

namespace ferry::capi {

bool ValidDType(int32_t dtype) { return dtype >= 0 && dtype < FERRY_NUM_DTYPES; }

DLDataType ToDl(ferry::DType dtype) {
  DlType t = kDlTypes[static_cast<int>(dtype)];
  DLDataType out;
  out.code = t.code;
  out.bits = t.bits;
  out.lanes = 1;
  return out;
}

bool FromDl(DLDataType type, ferry::DType* out) {
  if (type.lanes != 1) return false;
  for (int i = 0; i < FERRY_NUM_DTYPES; ++i) {
    if (kDlTypes[i].code == type.code && kDlTypes[i].bits == type.bits) {
      *out = static_cast<ferry::DType>(i);
      return true;
    }
  }
  return false;
}

}  // namespace ferry::capi

extern "C" {

const char* ferry_dtype_name(int32_t dtype) {
  if (!ValidDType(dtype)) return "?";
  return ferry::DTypeName(static_cast<ferry::DType>(dtype));
}

int ferry_dtype_parse(const char* name, int32_t* dtype, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(name);
    FERRY_C_REQUIRE(dtype);
    auto d = ferry::ParseDType(name);
    if (!d) {
      return Fail(error, FERRY_NOT_FOUND,
                  ferry::StrCat("ferry_dtype_parse: unknown dtype ", ferry::Quote(name)));
    }
    *dtype = static_cast<int32_t>(*d);
    return FERRY_OK;
  });
}

int ferry_dtype_storage_bytes(int32_t dtype, uint64_t numel, uint64_t* nbytes,
                              ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(nbytes);
    if (!ValidDType(dtype)) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_storage_bytes: unknown dtype ", dtype));
    }
    auto n = ferry::StorageBytes(static_cast<ferry::DType>(dtype), numel);
    if (!n) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_storage_bytes: ", numel, " elements overflow"));
    }
    *nbytes = *n;
    return FERRY_OK;
  });
}

int ferry_dtype_to_dlpack(int32_t dtype, DLDataType* out, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(out);
    if (!ValidDType(dtype)) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_to_dlpack: unknown dtype ", dtype));
    }
    *out = ToDl(static_cast<ferry::DType>(dtype));
    return FERRY_OK;
  });
}

int ferry_dtype_from_dlpack(DLDataType type, int32_t* dtype, ferry_error_t* error) {
  return Guard(error, [&, fn = __func__] {
    FERRY_C_REQUIRE(dtype);
    ferry::DType d;
    if (!FromDl(type, &d)) {
      return Fail(error, FERRY_INVALID_ARGUMENT,
                  ferry::StrCat("ferry_dtype_from_dlpack: no ferry dtype for DLPack code ",
                                int{type.code}, " bits ", int{type.bits}, " lanes ", type.lanes));
    }
    *dtype = static_cast<int32_t>(d);
    return FERRY_OK;
  });
}

}  // extern "C"
