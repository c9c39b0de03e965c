// Metal Shading Language as clang C++: the part of the language and of
// <metal_stdlib> that compute kernels use, for type-checking and running them
// on the CPU. Force-included before every translated kernel source.
#pragma once

#include "msl_runtime.h"  // standard headers first, before the keyword macros

#include "msl_types.h"
#include "msl_math.h"
#include "msl_simd.h"
#include "msl_simdgroup_matrix.h"
#include "msl_builtins.h"

#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif
