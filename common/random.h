// Reproducible pseudo-random numbers: the same on every platform and
// compiler (unlike <random>'s distributions), so that anything drawn from a
// job's seed (sample orders, initial values, generated data) is bitwise
// the same everywhere.
#ifndef PSTRAIN_COMMON_RANDOM_H_
#define PSTRAIN_COMMON_RANDOM_H_

#include <cstdint>

namespace pstrain {

// SplitMix64's output function of x + the golden-ratio increment: a
// bijection of 64-bit words whose outputs for consecutive inputs look
// independent.
inline uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The SplitMix64 generator: advances `state` and returns the next word.
inline uint64_t SplitMix64(uint64_t& state) {
  const uint64_t next = Mix64(state);
  state += 0x9e3779b97f4a7c15ULL;
  return next;
}

// A draw in [0, n) from a 64-bit word, by multiply-shift (no rejection).
inline uint64_t BelowN(uint64_t word, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(word) * n) >> 64);
}

// A double in [0, 1) from the word's top 53 bits.
inline double UnitDouble(uint64_t word) { return static_cast<double>(word >> 11) * 0x1.0p-53; }

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RANDOM_H_
