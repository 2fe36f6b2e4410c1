// nn/float8.h's layouts: the float8 cast's column-major result, and the layout of MX block exponents that LibTorch's
// blockwise-scaled matmul reads (cuBLAS's block scaling factors for 1 x 32 blocks), checked element by element against
// the layout's definition: 128 x 4 tiles of exponents stored one after the other along the rows of tiles, (i, j) of a
// tile at i % 32 * 16 + i / 32 * 4 + j, the padding zero. (The matmul itself runs on sm_100 GPUs only:
// tests/gpu/test_gpu_kernels.cpp.)
#include <gtest/gtest.h>

#include "titan/nn/float8.h"

namespace {

TEST(MxBlockedScales, EveryExponentLandsWhereTheTiledLayoutPutsIt) {
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{128, 4}, {333, 8}, {40, 3}, {256, 13}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    // Distinct values (mod 251, never 0) so that a misplaced exponent shows.
    const at::Tensor exponent = (at::arange(rows * cols, at::kLong) % 251 + 1).to(at::kByte).view({rows, cols});
    const at::Tensor blocked = titan::nn::float8::mx_blocked_scales(exponent);
    ASSERT_EQ(blocked.scalar_type(), at::kFloat8_e8m0fnu);
    const int64_t row_tiles = (rows + 127) / 128, col_tiles = (cols + 3) / 4;
    ASSERT_EQ(blocked.numel(), row_tiles * 128 * col_tiles * 4);
    const at::Tensor bytes = blocked.view(at::kByte).contiguous();
    const uint8_t* got = bytes.data_ptr<uint8_t>();
    const uint8_t* want = exponent.data_ptr<uint8_t>();
    std::vector<bool> filled(static_cast<size_t>(blocked.numel()), false);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t tile = (i / 128) * col_tiles + j / 4, r = i % 128, c = j % 4;
        const int64_t at = tile * 512 + (r % 32) * 16 + (r / 32) * 4 + c;
        ASSERT_EQ(got[at], want[i * cols + j]) << "exponent (" << i << ", " << j << ") at " << at;
        filled[static_cast<size_t>(at)] = true;
      }
    for (size_t at = 0; at < filled.size(); ++at)
      if (!filled[at]) ASSERT_EQ(got[at], 0) << "padding at " << at;
  }
}


// scaled_cast's column-major result (as at::_scaled_mm takes its second operand): the same values as the row-major
// cast, laid out with the transpose contiguous, from row- and column-major inputs, per tensor, row and column.
TEST(Float8Cast, ColumnMajorResultHasTheRowMajorValues) {
  at::manual_seed(5);
  for (const bool column_major_input : {false, true}) {
    for (int kind = 0; kind < 3; ++kind) {
      at::Tensor x = at::randn({37, 45}) * 100;
      if (column_major_input) x = x.t().contiguous().t();
      const at::Tensor scale = kind == 0   ? at::scalar_tensor(0.5)
                               : kind == 1 ? at::rand({37, 1}) + 0.5
                                           : at::rand({1, 45}) + 0.5;
      for (const auto format : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
        const at::Tensor row = titan::nn::float8::scaled_cast(x, scale, format);
        const at::Tensor column = titan::nn::float8::scaled_cast(x, scale, format, /*column_major=*/true);
        EXPECT_TRUE(column.t().is_contiguous());
        EXPECT_TRUE(at::equal(row.view(at::kByte), column.view(at::kByte)));
      }
    }
  }
}

}  // namespace
