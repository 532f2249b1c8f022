// What cpu_qdot.cc (weights in rows) and cpu_qdot_tiles.cc (weights in 16-row tiles) share: one call's task.
#pragma once

#include <cstdint>

namespace specjax::qdot {

enum Kind { kInt8 = 1, kInt4 = 2 };
enum Path : int32_t { kPathPortable = 0, kPathAvx2 = 1, kPathVnni = 2 };

struct DotTask {
  const uint8_t* w;        // int8 [N, D] bytes, or int4 [N, D/2] (16 bytes per 32 columns: column j low nibble
                           // of byte j, column j + 16 high nibble); tiled: the same bytes in 16-row tiles
  const float* scale;      // [N, D/G] (tiled: per tile [D/G, 16])
  const float* offset;     // int4 [N, D/G] (tiled as scale); null for int8
  float* y;                // [rows, N]
  const int64_t* row;      // [M]: the rows of y computed
  int64_t M, N, D, G, XB;  // XB: columns per x scale (32 to 256)
  Kind kind;
  // x, quantized (QuantizeRows): row m of each is the m-th live row
  const int8_t* qx;        // [M, Dp] (zero past D; Dp = D rounded up to 64)
  const float* sx;         // [M, D/32]: each 32-column block's x scale (amax / 127 of its scale block)
  const float* sxv;        // row layout, VNNI with XB = 32: [M, Dp/64, 16], each 64-column step's two block scales
  const float* xsum;       // int4: [M, D/G], x's fp32 sum over each weight group
  const int32_t* corr;     // row layout: [M, Dp/4]: -c x the sum of each 4 consecutive qx, where an int32 lane of 4
                           // products starts: c = 8 for int4 (the centring), 128 for int8 on VNNI (w + 128)
  int64_t Dp;
  const int32_t* bsum;     // tiled: [M, D/32], each 32-column block's sum of qx
};

// Tiled layout (cpu_qdot_tiles.cc): y's columns [16 t0, 16 t1) for every live row, on `path`.
void RowBlockTiles(const DotTask& t, int32_t path, int64_t t0, int64_t t1);

}  // namespace specjax::qdot
