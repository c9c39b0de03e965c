// Builtins, scalar/vector types, conversions and math, compared with NumPy.
#include <metal_stdlib>
using namespace metal;

// Every builtin attribute, in its uint3 form where it has one.
[[kernel]] void builtins(
    device uint* out [[buffer(0)]],
    uint3 thread_in_grid [[thread_position_in_grid]],
    uint3 group_in_grid [[threadgroup_position_in_grid]],
    uint3 thread_in_group [[thread_position_in_threadgroup]],
    uint index_in_group [[thread_index_in_threadgroup]],
    uint3 group_size [[threads_per_threadgroup]],
    uint3 groups [[threadgroups_per_grid]],
    uint3 grid_size [[threads_per_grid]],
    uint simdgroup [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint simd_width [[threads_per_simdgroup]],
    uint simdgroups [[simdgroups_per_threadgroup]]) {
  const uint linear = (thread_in_grid.z * grid_size.y + thread_in_grid.y) * grid_size.x + thread_in_grid.x;
  device uint* o = out + linear * 20;
  o[0] = thread_in_grid.x; o[1] = thread_in_grid.y; o[2] = thread_in_grid.z;
  o[3] = group_in_grid.x; o[4] = group_in_grid.y; o[5] = group_in_grid.z;
  o[6] = thread_in_group.x; o[7] = thread_in_group.y; o[8] = thread_in_group.z;
  o[9] = index_in_group;
  o[10] = group_size.x; o[11] = group_size.y; o[12] = group_size.z;
  o[13] = groups.x * 100 + groups.y * 10 + groups.z;
  o[14] = grid_size.x * 10000 + grid_size.y * 100 + grid_size.z;
  o[15] = simdgroup; o[16] = lane; o[17] = simd_width; o[18] = simdgroups;
  o[19] = 1;  // written
}

// half and bfloat round trips: in -> float -> out of the same type, plus the
// float -> T -> float rounding of a float input.
template <typename T, typename Bits>
[[kernel]] void round_trip(
    const device T* in [[buffer(0)]],
    device T* same [[buffer(1)]],
    const device float* wide [[buffer(2)]],
    device float* narrowed [[buffer(3)]],
    device Bits* bits [[buffer(4)]],
    uint i [[thread_position_in_grid]]) {
  same[i] = static_cast<T>(static_cast<float>(in[i]));
  narrowed[i] = static_cast<float>(static_cast<T>(wide[i]));
  bits[i] = as_type<Bits>(static_cast<T>(wide[i]));
}
template [[host_name("round_trip_half")]] [[kernel]] decltype(round_trip<half, ushort>) round_trip<half, ushort>;
template [[host_name("round_trip_bfloat")]] [[kernel]] decltype(round_trip<bfloat, ushort>) round_trip<bfloat, ushort>;

constant int MATH_OUTPUTS = 16;

// Scalar and vector math on x > 0 (x from NumPy).
[[kernel]] void math_ops(
    const device float* x [[buffer(0)]],
    device float* out [[buffer(1)]],
    uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  device float* o = out + i * MATH_OUTPUTS;
  o[0] = exp(v);
  o[1] = fast::exp2(v);
  o[2] = precise::log(v);
  o[3] = log2(v);
  o[4] = sqrt(v);
  o[5] = rsqrt(v);
  o[6] = fma(v, 2.0f, -1.0f);
  o[7] = clamp(v, 0.5f, 1.5f);
  o[8] = select(-v, v, v > 1.0f);
  o[9] = floor(v * 3.0f) + ceil(v * 5.0f);
  const float4 q = float4(v, v * 2.0f, float2(v * 3.0f, -v));
  const float4 e = exp(q);          // element-wise on a vector
  const float2 s = q.zy + e.xw;     // swizzles
  o[10] = s.x;
  o[11] = s.y;
  o[12] = abs(q).w + float(abs(int(-7)));
  o[13] = max(q, 1.0f).x + min(half4(q), half4(1.0h)).y;
  o[14] = isinf(v / 0.0f) && !isnan(v) ? 1.0f : 0.0f;
  o[15] = float(numeric_limits<half>::max()) + float(as_type<uint>(1.0f) == 0x3f800000u);
}
