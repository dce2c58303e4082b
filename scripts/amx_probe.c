/* Exits 0 when this CPU and kernel run an AMX int8 tile multiply (scripts/build_llama_cpp.sh): some VMs
   report amx_tile in /proc/cpuinfo without enabling the tile state, and the kernel then refuses it. */
#include <immintrin.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
  unsigned char palette_id, start_row, reserved[14];
  unsigned short colsb[16];
  unsigned char rows[16];
};

int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 1;
  struct tile_config config = {0};
  config.palette_id = 1;
  for (int t = 0; t < 3; t++) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  static signed char a[16 * 64], b[16 * 64];
  static int c[16 * 16];
  for (int i = 0; i < 16 * 64; i++) a[i] = 1, b[i] = 2;
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_loadd(1, a, 64);
  _tile_loadd(2, b, 64);
  _tile_dpbssd(0, 1, 2);
  _tile_stored(0, c, 64);
  _tile_release();
  printf("%d\n", c[0]);
  return c[0] == 128 ? 0 : 1;
}
