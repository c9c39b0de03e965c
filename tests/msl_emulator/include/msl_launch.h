// Binding kernel parameters and launching grids (used by the launchers the
// translator appends to each kernel source).
#pragma once

#include "metal_shim.h"  // (std headers come first, from msl_runtime.h)

namespace msl_rt {

struct Param {
  int kind;   // 0: [[buffer(index)]], else a builtin (see BUILTINS in __init__.py)
  int index;
};

struct Entry {
  const char* name;
  void (*body)();
};

inline void builtin_value(int kind, uint32_t out[3]) {
  const Builtins& b = current_group->builtins;
  uint32_t local[3];
  thread_position(local);
  uint32_t index = uint32_t(self().index);
  out[0] = out[1] = out[2] = 0;
  switch (kind) {
    case 1: for (int i = 0; i < 3; ++i) out[i] = b.tg_id[i] * b.tg_size[i] + local[i]; break;
    case 2: for (int i = 0; i < 3; ++i) out[i] = b.tg_id[i]; break;
    case 3: for (int i = 0; i < 3; ++i) out[i] = local[i]; break;
    case 4: out[0] = index; break;
    case 5: for (int i = 0; i < 3; ++i) out[i] = b.tg_size[i]; break;
    case 6: for (int i = 0; i < 3; ++i) out[i] = b.tg_count[i]; break;
    case 7: for (int i = 0; i < 3; ++i) out[i] = b.grid_threads[i]; break;
    case 8: out[0] = index / kSimdWidth; break;
    case 9: out[0] = index % kSimdWidth; break;
    case 10: out[0] = kSimdWidth; break;
    case 11: out[0] = uint32_t((current_group->fibers.size() + kSimdWidth - 1) / kSimdWidth); break;
  }
}

template <typename P>
inline P bind(const Param& p) {
  if constexpr (std::is_pointer_v<P>) {
    return (P)buffer(p.index);  // C-style: into the parameter's address space
  } else if constexpr (std::is_reference_v<P>) {
    return *(std::remove_reference_t<P>*)buffer(p.index);
  } else if (p.kind == 0) {
    return *(P*)buffer(p.index);
  } else {
    uint32_t v[3];
    builtin_value(p.kind, v);
    if constexpr (std::is_arithmetic_v<P>) {
      return P(v[0]);
    } else {
      P out;
      for (int i = 0; i < int(__builtin_vectorelements(P)); ++i) out[i] = v[i];
      return out;
    }
  }
}

template <typename... A, std::size_t... I>
inline void invoke_impl(void (*f)(A...), const Param* params, std::index_sequence<I...>) {
  f(bind<A>(params[I])...);
}

template <typename... A>
inline void invoke(void (*f)(A...), const Param* params) {
  invoke_impl(f, params, std::index_sequence_for<A...>{});
}

inline int dispatch(const Entry* entries, int count, const char* name, const uint32_t* grid,
                    const uint32_t* tg, void* const* buffers, int nbuf, char* err, int errlen) {
  const Entry* entry = nullptr;
  for (int i = 0; i < count; ++i) {
    if (std::string(entries[i].name) == name) entry = &entries[i];
  }
  if (!entry) {
    std::snprintf(err, errlen, "unknown kernel %s", name);
    return 2;
  }
  Group g;
  g.buffers = buffers;
  g.buffer_count = nbuf;
  for (int i = 0; i < 3; ++i) {
    g.builtins.tg_count[i] = grid[i];
    g.builtins.tg_size[i] = tg[i];
    g.builtins.grid_threads[i] = grid[i] * tg[i];
  }
  for (uint32_t z = 0; z < grid[2]; ++z)
    for (uint32_t y = 0; y < grid[1]; ++y)
      for (uint32_t x = 0; x < grid[0]; ++x) {
        g.builtins.tg_id[0] = x;
        g.builtins.tg_id[1] = y;
        g.builtins.tg_id[2] = z;
        std::string error;
        if (!run_threadgroup(g, entry->body, error)) {
          std::snprintf(err, errlen, "threadgroup (%u, %u, %u): %s", x, y, z, error.c_str());
          return 1;
        }
      }
  return 0;
}

}  // namespace msl_rt

#define MSL_EMULATOR_EXPORTS(count)                                                          \
  extern "C" int msl_dispatch(const char* name, const uint32_t* grid, const uint32_t* tg,    \
                              void* const* buffers, int nbuf, char* err, int errlen) {       \
    return msl_rt::dispatch(msl_entries, count, name, grid, tg, buffers, nbuf, err, errlen); \
  }
