// AMX helpers the CPU kernels share: the once-per-process permission request for the tile data
// state, and the 64-byte tile configuration that LDTILECFG reads.
//
// Linux hands a process the AMX tile registers (XTILEDATA, 8 KiB of XSAVE state) only after it
// asks with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); before that, the first tile
// instruction faults (SIGILL). The grant is process-wide and idempotent. A kernel that can be
// refused (an older kernel, a hypervisor hiding the state) keeps its AVX-512 path and takes it
// when qw_amx_request() returns 0.
//
// Everything here exists only when the compiler targets AMX (-march=native on an AMX CPU defines
// __AMX_TILE__ and __AMX_BF16__); QW_HAVE_AMX says so.
#ifndef QWORKER_CPU_AMX_H
#define QWORKER_CPU_AMX_H

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define QW_HAVE_AMX 1

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QW_ARCH_REQ_XCOMP_PERM 0x1023
#define QW_XFEATURE_XTILEDATA 18

// LDTILECFG's memory operand (palette 1): tile t holds rows[t] rows of colsb[t] bytes.
typedef struct __attribute__((aligned(64))) {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} qw_amx_tilecfg;

_Static_assert(sizeof(qw_amx_tilecfg) == 64, "LDTILECFG reads 64 bytes");

// 1 when this process may use the tile registers, 0 when the kernel refused. Asked once; a race
// between threads asks twice, which is harmless (the request is idempotent).
static inline int qw_amx_request(void) {
    static int state = -1;  // -1: not asked yet
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, QW_ARCH_REQ_XCOMP_PERM, QW_XFEATURE_XTILEDATA) == 0 ? 1 : 0;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s;
}

// A configuration of every tile as `rows` x `colsb` bytes (the tiles a kernel does not use are
// harmless at that size).
static inline void qw_amx_config_all(qw_amx_tilecfg *cfg, int rows, int colsb) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg->rows[t] = (uint8_t)rows;
        cfg->colsb[t] = (uint16_t)colsb;
    }
}

#endif  // __AMX_BF16__ && __AMX_TILE__
#endif  // QWORKER_CPU_AMX_H
