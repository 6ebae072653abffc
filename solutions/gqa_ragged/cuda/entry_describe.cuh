// Host side of prefill_entry.cu, part 1: the includes, and arguments.describe's text of any
// argument (a tensor's dtype and shape, Python's repr of other values) for error messages.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_kernel.cuh"

namespace {

using tvm::ffi::AnyView;
using tvm::ffi::TensorView;
using namespace gqa_prefill;

constexpr double kLog2E = 1.4426950408889634;  // 1 / ln(2)
constexpr int64_t kAlignBytes = 16;    // the kernels' vector and TMA loads
constexpr int64_t kAlignElements = 8;  // 16 bytes of a 16-bit dtype

// ---- describe(): what arguments.describe writes --------------------------------------------

std::string dtype_name(DLDataType dtype) {
  return std::string(tvm::ffi::DLDataTypeToString(dtype));
}

std::string int_list(const int64_t* values, int n) {  // "[2, 5, 32, 128]"
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << values[i];
  os << "]";
  return os.str();
}

std::string shape_text(const TensorView& t) { return int_list(t.shape().data(), t.ndim()); }

// "bfloat16 [2, 5, 32, 128]" or "a 0-d float32 tensor"
std::string describe(const TensorView& t) {
  if (t.ndim() == 0) return "a 0-d " + dtype_name(t.dtype()) + " tensor";
  return dtype_name(t.dtype()) + " " + shape_text(t);
}

// Python's repr of a float: the shortest digits that read back, fixed notation for exponents
// -4 .. 15.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  for (int precision = 0; precision < 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  const std::string text(buf);  // [-]d.ddde[+-]xx
  const size_t e = text.find('e');
  const int exponent = std::atoi(text.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i) {
    if (text[i] >= '0' && text[i] <= '9') digits += text[i];
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = std::signbit(x) ? "-" : "";
  if (exponent < -4 || exponent > 15) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    std::snprintf(buf, sizeof buf, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + buf;
  }
  if (exponent < 0) return out + "0." + std::string(-exponent - 1, '0') + digits;
  const size_t int_digits = exponent + 1;
  if (digits.size() < int_digits) digits.append(int_digits - digits.size(), '0');
  const std::string fraction = digits.size() > int_digits ? digits.substr(int_digits) : "0";
  return out + digits.substr(0, int_digits) + "." + fraction;
}

// Python's repr of a str (non-ASCII characters kept as they are) or of bytes.
std::string quoted_repr(const std::string& value, bool bytes) {
  const bool has_single = value.find('\'') != std::string::npos;
  const char quote = has_single && value.find('"') == std::string::npos ? '"' : '\'';
  std::string out = bytes ? "b" : "";
  out += quote;
  for (const char c : value) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == quote || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (byte < 0x20 || byte == 0x7f || (bytes && byte > 0x7f)) {
      char escape[5];
      std::snprintf(escape, sizeof escape, "\\x%02x", byte);
      out += escape;
    } else {
      out += c;
    }
  }
  return out + quote;
}

bool is_str(const AnyView& x) {
  const int32_t index = x.type_index();
  return index == tvm::ffi::TypeIndex::kTVMFFIRawStr ||
         index == tvm::ffi::TypeIndex::kTVMFFISmallStr || index == tvm::ffi::TypeIndex::kTVMFFIStr;
}
bool is_bytes(const AnyView& x) {
  const int32_t index = x.type_index();
  return index == tvm::ffi::TypeIndex::kTVMFFIByteArrayPtr ||
         index == tvm::ffi::TypeIndex::kTVMFFISmallBytes ||
         index == tvm::ffi::TypeIndex::kTVMFFIBytes;
}

// A Python value as tvm-ffi passes it: (type name, repr). Lists and tuples both arrive as an
// ffi.Array (written as a list); values without a Python counterpart give their type key.
std::pair<std::string, std::string> python_value(const AnyView& x) {
  if (x == nullptr) return {"NoneType", "None"};
  if (auto b = x.as<bool>()) return {"bool", *b ? "True" : "False"};
  if (auto i = x.as<int64_t>()) return {"int", std::to_string(*i)};
  if (auto f = x.as<double>()) return {"float", float_repr(*f)};
  if (is_str(x)) return {"str", quoted_repr(std::string(x.cast<tvm::ffi::String>()), false)};
  if (is_bytes(x)) return {"bytes", quoted_repr(std::string(x.cast<tvm::ffi::Bytes>()), true)};
  if (auto array = x.as<tvm::ffi::Array<tvm::ffi::Any>>()) {
    std::string items;
    for (const tvm::ffi::Any& item : *array) {
      items += (items.empty() ? "" : ", ") + python_value(item).second;
    }
    return {"list", "[" + items + "]"};
  }
  const std::string key = x.GetTypeKey();
  return {key, "<" + key + ">"};
}

// arguments.describe: a tensor's dtype and shape, else "<type name> <repr, 60 characters>".
std::string describe(const AnyView& x) {
  if (auto t = x.try_cast<TensorView>()) return describe(*t);
  auto [type, repr] = python_value(x);
  size_t end = 0;
  for (int chars = 0; end < repr.size() && chars < 60; ++chars) {
    do ++end;  // one UTF-8 character
    while (end < repr.size() && (static_cast<unsigned char>(repr[end]) & 0xC0) == 0x80);
  }
  return type + " " + repr.substr(0, end);
}

std::string describe_device(const DLDevice& d) {  // as torch.device prints
  std::ostringstream os;
  switch (d.device_type) {
    case kDLCPU: os << "cpu"; break;
    case kDLCUDA: os << "cuda:" << d.device_id; break;
    default: os << "device type " << static_cast<int>(d.device_type) << ":" << d.device_id;
  }
  return os.str();
}

[[noreturn]] void fail(const char* name, const std::string& expected, const std::string& got) {
  TVM_FFI_THROW(ValueError) << name << ": expected " << expected << ", got " << got;
  TVM_FFI_UNREACHABLE();  // the throw is in a destructor, which nvcc does not see as noreturn
}

}  // namespace
