// The checkpoint format's own pieces: CRC-32 against zlib, and titan-dcp files written by two "ranks" read back
// whole, in sub-boxes, straight into the caller's tensor, converted, and with a damaged piece.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include "test_util.h"
#include "titan/common/checksum.h"
#include "titan/common/error.h"
#include "titan/components/checkpoint/formats/dcp.h"

namespace {

uint32_t zlib_crc(const unsigned char* p, size_t n) { return static_cast<uint32_t>(crc32(0L, p, static_cast<uInt>(n))); }

}  // namespace

TEST(Checksum, EqualsZlibForEveryLengthAlignmentAndSplit) {
  std::mt19937 rng(7);
  std::vector<unsigned char> data((1u << 20) + 100);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  for (size_t start : {0, 1, 3, 15}) {
    for (size_t n : {0, 1, 7, 15, 16, 17, 63, 64, 65, 255, 4095, 4097, 65536 + 13, (1 << 20) + 3}) {
      const unsigned char* p = data.data() + start;
      const uint32_t expected = zlib_crc(p, n);
      EXPECT_EQ(titan::crc32_update(0, p, n), expected) << titan::crc32_implementation() << " start " << start << " n " << n;
      for (size_t split : {size_t{0}, n / 3, n}) {
        // Chained updates and a concatenation of two separately computed CRCs give the whole one.
        EXPECT_EQ(titan::crc32_update(titan::crc32_update(0, p, split), p + split, n - split), expected) << n << " " << split;
        EXPECT_EQ(titan::crc32_concat(titan::crc32_update(0, p, split), titan::crc32_update(0, p + split, n - split), n - split),
                  expected)
            << n << " " << split;
      }
    }
  }
}

TEST(CheckpointFormat, PiecesReadBackWholeInBoxesDirectAndConvertedAndADamagedPieceIsNamed) {
  titan_test::TempDir dir;
  const std::string step = dir.path() + "/step-1";
  std::filesystem::create_directories(step + ".partial");
  const at::Tensor matrix = at::arange(20, at::kFloat).reshape({5, 4});  // rows 0-2 on rank 0, rows 3-4 on rank 1
  const at::Tensor scalar = at::scalar_tensor(42, at::kLong);
  const at::Tensor small = at::arange(6, at::kFloat).reshape({2, 3}).to(at::kBFloat16);
  std::vector<nlohmann::json> parts;
  {
    titan::checkpoint::RankWriter writer(step + ".partial", 0);
    writer.add("matrix", matrix.narrow(0, 0, 3), {0, 0}, {5, 4});
    writer.add("scalar", scalar, {}, {});
    parts.push_back(writer.finish());
  }
  {
    titan::checkpoint::RankWriter writer(step + ".partial", 1);
    writer.add("matrix", matrix.narrow(0, 3, 2), {3, 0}, {5, 4});
    writer.add("small", small, {0, 0}, {2, 3});
    parts.push_back(writer.finish());
  }
  titan::checkpoint::commit(step + ".partial", step, [&] {
    nlohmann::json meta = titan::checkpoint::merge_rank_parts(parts);
    const nlohmann::json header = titan::checkpoint::metadata_header(1, true, 2, "test");
    for (const auto& [k, v] : header.items()) meta[k] = v;
    return meta;
  }());
  {
    titan::checkpoint::Reader reader(step);
    // Every piece carries the CRC-32 of its bytes; the file's is the pieces' combined.
    const auto& piece = reader.metadata()["tensors"]["matrix"]["pieces"][1];
    ASSERT_TRUE(piece.contains("crc32"));
    const at::Tensor rows = matrix.narrow(0, 3, 2).contiguous();
    EXPECT_EQ(piece["crc32"].get<uint32_t>(), zlib_crc(static_cast<const unsigned char*>(rows.data_ptr()), rows.nbytes()));
    std::ifstream f(step + "/rank-00000.bin", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(reader.metadata()["files"]["rank-00000.bin"]["crc32"].get<uint32_t>(),
              zlib_crc(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()));

    at::Tensor whole = at::zeros({5, 4});
    reader.read_box("matrix", {0, 0}, whole);  // two pieces
    EXPECT_TRUE(at::equal(whole, matrix));
    at::Tensor middle = at::zeros({3, 2});
    reader.read_box("matrix", {1, 1}, middle);  // rows across both pieces, a column range
    EXPECT_TRUE(at::equal(middle, matrix.slice(0, 1, 4).slice(1, 1, 3)));
    at::Tensor exact = at::zeros({2, 4});
    reader.read_box("matrix", {3, 0}, exact);  // exactly rank 1's piece: read straight into `exact`
    EXPECT_TRUE(at::equal(exact, matrix.narrow(0, 3, 2)));
    at::Tensor as_double = at::zeros({5, 4}, at::kDouble);
    reader.read_box("matrix", {0, 0}, as_double);
    EXPECT_TRUE(at::equal(as_double, matrix.to(at::kDouble)));
    at::Tensor transposed = at::zeros({4, 5}).t();  // not contiguous: through a block
    reader.read_box("matrix", {0, 0}, transposed);
    EXPECT_TRUE(at::equal(transposed, matrix));
    at::Tensor s = at::zeros({}, at::kLong);
    reader.read_box("scalar", {}, s);
    EXPECT_EQ(s.item<int64_t>(), 42);
    at::Tensor b = at::zeros({2, 3}, at::kBFloat16);
    reader.read_box("small", {0, 0}, b);
    EXPECT_TRUE(at::equal(b, small));
  }
  // One flipped bit in rank 1's "small": reading it fails naming the file and the tensor; rank 0's pieces, checked
  // on their own, still read.
  const std::string data1 = step + "/rank-00001.bin";
  {
    std::fstream f(data1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(2 * 4 * 4 + 1);  // the matrix's 2 x 4 float rows come first
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 4);
    f.seekp(2 * 4 * 4 + 1);
    f.write(&c, 1);
  }
  titan::checkpoint::Reader reader(step);
  at::Tensor b = at::zeros({2, 3}, at::kBFloat16);
  try {
    reader.read_box("small", {0, 0}, b);
    FAIL() << "a damaged piece was read";
  } catch (const titan::UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank-00001.bin\" fails its CRC-32 check (corrupt) in the 12 bytes at 32 that hold \"small\""),
              std::string::npos)
        << what;
  }
  at::Tensor top = at::zeros({3, 4});
  reader.read_box("matrix", {0, 0}, top);
  EXPECT_TRUE(at::equal(top, matrix.narrow(0, 0, 3)));
}
