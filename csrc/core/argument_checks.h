// What the ops' argument checks share: shapes and dtypes as text, the error
// an op throws (std::invalid_argument, a ValueError in Python, prefixed with
// the op's name) and the kernels' element type of an MLX float dtype.
#pragma once

#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "csrc/core/attention_problem.h"
#include "mlx/array.h"
#include "mlx/utils.h"

namespace mlx_attn {

inline std::string shape_string(const mlx::core::Shape& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + ")";
}

inline std::string shape_string(const mlx::core::array& a) {
  return shape_string(a.shape());
}

inline std::string dtype_string(mlx::core::Dtype t) {
  std::ostringstream out;
  out << t;
  return out.str();
}

[[noreturn]] inline void throw_invalid(const char* op, const std::string& message) {
  throw std::invalid_argument(std::string("[") + op + "] " + message);
}

// float32, float16 or bfloat16; nothing for other dtypes.
inline std::optional<ElemType> float_elem_type(mlx::core::Dtype t) {
  if (t == mlx::core::float32) return ElemType::float32;
  if (t == mlx::core::float16) return ElemType::float16;
  if (t == mlx::core::bfloat16) return ElemType::bfloat16;
  return std::nullopt;
}

}  // namespace mlx_attn
