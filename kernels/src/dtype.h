// Host conversions between fp32 and the storage dtypes (bf16, fp16), round-to-nearest-even,
// NaN preserved. Shared by the CPU backend and the tests.
#ifndef REPLAYSSM_KERNELS_SRC_DTYPE_H_
#define REPLAYSSM_KERNELS_SRC_DTYPE_H_

#include <cstdint>
#include <cstring>

namespace replayssm::kernels {

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) { return BitsFloat(static_cast<uint32_t>(x.bits) << 16); }

inline float ToFloat(F16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0x1f) return BitsFloat(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsFloat(sign);
  int e = -1;  // subnormal: normalize
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return BitsFloat(sign | ((112u - e) << 23) | ((mant & 0x3ffu) << 13));
}

template <typename T>
T FromFloat(float f);

template <>
inline float FromFloat<float>(float f) {
  return f;
}

template <>
inline Bf16 FromFloat<Bf16>(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

template <>
inline F16 FromFloat<F16>(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return F16{static_cast<uint16_t>(sign | 0x7e00u)};  // nan
  if (a >= 0x477ff000u) return F16{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (a < 0x38800000u) {  // subnormal or zero in fp16: round a * 2^24 to an integer
    const float scaled = BitsFloat(a) * 16777216.0f;  // exact
    uint32_t m = static_cast<uint32_t>(scaled);
    const float rem = scaled - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return F16{static_cast<uint16_t>(sign | m)};
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return F16{static_cast<uint16_t>(sign | (r >> 13))};
}

// Rounds an fp32 value through storage type T and back.
template <typename T>
inline float RoundTo(float f) {
  return ToFloat(FromFloat<T>(f));
}

// By a runtime dtype code (RSSM_DTYPE_F32 = 0, BF16 = 1, F16 = 2): for code that handles
// bytes of any dtype (the tests' buffers, references and oracles).
inline float LoadAs(int32_t dtype, const void* src) {
  if (dtype == 1 || dtype == 2) {
    uint16_t bits;
    std::memcpy(&bits, src, 2);
    return dtype == 1 ? ToFloat(Bf16{bits}) : ToFloat(F16{bits});
  }
  float f;
  std::memcpy(&f, src, 4);
  return f;
}

inline void StoreAs(int32_t dtype, float x, void* dst) {
  if (dtype == 1 || dtype == 2) {
    const uint16_t bits = dtype == 1 ? FromFloat<Bf16>(x).bits : FromFloat<F16>(x).bits;
    std::memcpy(dst, &bits, 2);
  } else {
    std::memcpy(dst, &x, 4);
  }
}

// x rounded through the dtype and back.
inline float RoundAs(int32_t dtype, float x) {
  if (dtype == 1) return RoundTo<Bf16>(x);
  if (dtype == 2) return RoundTo<F16>(x);
  return x;
}

}  // namespace replayssm::kernels

#endif  // REPLAYSSM_KERNELS_SRC_DTYPE_H_
