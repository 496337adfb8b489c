// The loads and stores the CUDA kernels share: Vec, a few elements of a state row, ring record
// or key-channel slice held raw in registers and moved in the widest pieces their alignment
// allows (FlashInfer's vec_t), with the global accesses' cache policies.
#ifndef REPLAYSSM_KERNELS_CUDA_LOADS_CUH_
#define REPLAYSSM_KERNELS_CUDA_LOADS_CUH_

#include "common.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

// 16- and 8-byte global accesses with a cache policy (BaselineCache, layout.h).
template <int CACHE>
__device__ __forceinline__ uint4 LoadGlobal16(const void* p) {
  if constexpr (CACHE == kCacheStream || CACHE == kCacheStreamLoad || CACHE == kCacheKeepStores) {
    return __ldcs(static_cast<const uint4*>(p));
  } else if constexpr (CACHE == kCacheNoL1) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else {
    return *static_cast<const uint4*>(p);
  }
}
template <int CACHE>
__device__ __forceinline__ uint2 LoadGlobal8(const void* p) {
  if constexpr (CACHE == kCacheStream || CACHE == kCacheStreamLoad || CACHE == kCacheKeepStores) {
    return __ldcs(static_cast<const uint2*>(p));
  } else if constexpr (CACHE == kCacheNoL1) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(p));
    return v;
  } else {
    return *static_cast<const uint2*>(p);
  }
}
// An L2 policy that keeps the lines it touches past normal ones (kCacheKeepStores).
__device__ __forceinline__ uint64_t EvictLastPolicy() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
template <int CACHE>
__device__ __forceinline__ void StoreGlobal16(void* p, uint4 v) {
  if constexpr (CACHE == kCacheStream || CACHE == kCacheNoL1) {
    __stcs(static_cast<uint4*>(p), v);
  } else if constexpr (CACHE == kCacheKeepStores) {
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w), "l"(EvictLastPolicy())
                 : "memory");
  } else {
    *static_cast<uint4*>(p) = v;
  }
}
template <int CACHE>
__device__ __forceinline__ void StoreGlobal8(void* p, uint2 v) {
  if constexpr (CACHE == kCacheStream || CACHE == kCacheNoL1) {
    __stcs(static_cast<uint2*>(p), v);
  } else if constexpr (CACHE == kCacheKeepStores) {
    asm volatile("st.global.L2::cache_hint.v2.u32 [%0], {%1, %2}, %3;" ::"l"(p), "r"(v.x), "r"(v.y),
                 "l"(EvictLastPolicy())
                 : "memory");
  } else {
    *static_cast<uint2*>(p) = v;
  }
}

// N consecutive elements of T kept raw in registers (converted on use). Global loads and
// stores take 16- or 8-byte pieces when `vec` (p aligned to the piece), else element by
// element; shared-memory ones always go in pieces (p aligned to them, at most 16 bytes).
template <typename T, int N>
struct Vec {
  static constexpr int kBytes = N * int(sizeof(T));
  static constexpr int kWords = (kBytes + 3) / 4;
  uint32_t w[kWords];

  __device__ __forceinline__ float Get(int e) const {
    return ToF(reinterpret_cast<const T*>(w)[e]);
  }
  __device__ __forceinline__ void Set(int e, float x) { reinterpret_cast<T*>(w)[e] = FromF<T>(x); }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }

  template <int CACHE = kCacheStream>
  __device__ __forceinline__ void Load(const T* p, bool vec) {
    if (vec) {
      if constexpr (kBytes % 16 == 0) {
#pragma unroll
        for (int i = 0; i < kBytes / 16; ++i) {
          const uint4 x = LoadGlobal16<CACHE>(reinterpret_cast<const uint4*>(p) + i);
          w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
        }
        return;
      } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
        for (int i = 0; i < kBytes / 8; ++i) {
          const uint2 x = LoadGlobal8<CACHE>(reinterpret_cast<const uint2*>(p) + i);
          w[2 * i] = x.x, w[2 * i + 1] = x.y;
        }
        return;
      }
    }
    T* d = reinterpret_cast<T*>(w);
#pragma unroll
    for (int e = 0; e < N; ++e) d[e] = p[e];
  }
  template <int CACHE = kCacheStream>
  __device__ __forceinline__ void Store(T* p, bool vec) const {
    if (vec) {
      if constexpr (kBytes % 16 == 0) {
#pragma unroll
        for (int i = 0; i < kBytes / 16; ++i) {
          StoreGlobal16<CACHE>(reinterpret_cast<uint4*>(p) + i,
                               make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]));
        }
        return;
      } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
        for (int i = 0; i < kBytes / 8; ++i) {
          StoreGlobal8<CACHE>(reinterpret_cast<uint2*>(p) + i, make_uint2(w[2 * i], w[2 * i + 1]));
        }
        return;
      }
    }
    const T* s = reinterpret_cast<const T*>(w);
#pragma unroll
    for (int e = 0; e < N; ++e) p[e] = s[e];
  }

  __device__ __forceinline__ void LoadShared(const T* p) {
    if constexpr (kBytes % 16 == 0) {
#pragma unroll
      for (int i = 0; i < kBytes / 16; ++i) {
        const uint4 x = reinterpret_cast<const uint4*>(p)[i];
        w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
      }
    } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
      for (int i = 0; i < kBytes / 8; ++i) {
        const uint2 x = reinterpret_cast<const uint2*>(p)[i];
        w[2 * i] = x.x, w[2 * i + 1] = x.y;
      }
    } else {
      T* d = reinterpret_cast<T*>(w);
#pragma unroll
      for (int e = 0; e < N; ++e) d[e] = p[e];
    }
  }
  __device__ __forceinline__ void StoreShared(T* p) const {
    static_assert(kBytes % 16 == 0, "16-byte pieces only");
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      reinterpret_cast<uint4*>(p)[i] =
          make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    }
  }
};

// A decode token's raw q and k (and KDA's a and dt_bias, per channel; GDN's one each, in [0])
// for the lane's key channels [c0, c0 + KC), zero past K (has_c false): row r's token qkv,
// v-head h of qk-head hq; K, H: the layer's (the caller's copies, so that the addresses are
// the ones it computes for its other loads). The baseline and small-replay kernels' loads.
template <typename A, bool KDA, int KC>
__device__ __forceinline__ void LoadStepToken(const LayerDesc& ly, const A* qkv, int r, int h,
                                              int hq, int K, int H, int c0, bool has_c, A (&qr)[KC],
                                              A (&kr)[KC], A (&ar)[KC], float (&db)[KC]) {
  const A* const ga = static_cast<const A*>(ly.a) + int64_t{r} * ly.a_stride;
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    qr[e] = kr[e] = ar[e] = A{};
    db[e] = 0.f;
    if (has_c) {
      qr[e] = qkv[int64_t{hq} * K + c0 + e];
      kr[e] = qkv[int64_t{H + hq} * K + c0 + e];
      if constexpr (KDA) {
        ar[e] = ga[int64_t{h} * K + c0 + e];
        db[e] = ly.dt_bias[int64_t{h} * K + c0 + e];
      }
    }
  }
  if constexpr (!KDA) ar[0] = ga[h], db[0] = ly.dt_bias[h];
}

// That token's q and k as floats (zero past K), normalized and q scaled; returns k·q
// (NormalizeQk, as the bulk kernel's NormDraft).
template <typename A, int KC>
__device__ __forceinline__ float StepTokenQk(const LayerDesc& ly, const A (&qr)[KC],
                                             const A (&kr)[KC], bool has_c, float (&q)[KC],
                                             float (&kk)[KC]) {
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    q[e] = has_c ? ToF(qr[e]) : 0.f;
    kk[e] = has_c ? ToF(kr[e]) : 0.f;
  }
  return NormalizeQk<KC>(ly, q, kk);
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_LOADS_CUH_
