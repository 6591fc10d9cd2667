// What every AMX kernel here needs before its first tile instruction: Linux's permission for the tile state, and
// the tile configuration's memory layout (ldtilecfg's 64 bytes). Shared by amx_matmul.cpp and kblock_amx.h.
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

// Linux gives a process the AMX tile state only when asked (it enlarges every signal frame).
inline bool request_amx() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace amx
