/* AMX tile state for the kernels that #include it: the OS's permission (asked once per process) and the record that
 * configures the tiles. */
#ifndef CPLLM_AMX_TILES_H
#define CPLLM_AMX_TILES_H
#if defined(__AMX_TILE__)
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

/* What _tile_loadconfig reads: palette 1, each tile's bytes per row and rows. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands a process the AMX tile state only when asked (once per process; oneDNN asks the same way). */
static int amx_permitted(void) {
    static int state = 0;  /* 0 not asked, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}
#endif
#endif
