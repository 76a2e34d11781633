// Processing throughput (src/transform/): dtype casts and FP8 block
// quantization of a generated BF16 matrix, on one core and on every core,
// against memcpy of the same bytes on as many cores. Writes a markdown
// section to stdout.
//
//   transform_bench [--mib 256] [--repeats 5]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "transform/convert.h"

namespace {

using weightd::format::DType;
namespace transform = weightd::transform;

constexpr uint64_t kCols = 4096;

// Runs `work(row0, row1)` over `rows` rows split among `threads` threads;
// the median wall time of `repeats` runs.
template <typename F>
double Time(int threads, int repeats, uint64_t rows, F&& work) {
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    times.push_back(bench::TimeIt([&] {
      std::vector<std::thread> team;
      // Whole 128-row blocks per thread, so the quantization splits cleanly.
      const uint64_t blocks = (rows + 127) / 128;
      for (int t = 0; t < threads; ++t) {
        const uint64_t r0 = std::min(rows, blocks * t / threads * 128);
        const uint64_t r1 = std::min(rows, blocks * (t + 1) / threads * 128);
        team.emplace_back([&, r0, r1] { work(r0, r1); });
      }
      for (auto& th : team) th.join();
    }));
  }
  return bench::Median(times);
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t mib = 256;
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mib") mib = std::strtoull(argv[i + 1], nullptr, 10);
    if (flag == "--repeats") repeats = std::atoi(argv[i + 1]);
  }
  const uint64_t rows = std::max<uint64_t>(128, (mib << 20) / (kCols * 2) / 128 * 128);
  const uint64_t elements = rows * kCols;
  const uint64_t bytes = elements * 2;

  // Weights of a trained model's spread: normal, a few large outliers.
  std::vector<uint16_t> src(elements);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (uint64_t i = 0; i < elements; ++i) {
    src[i] = transform::FloatToBF16(i % 9973 == 0 ? normal(rng) * 50 : normal(rng));
  }
  const auto* in = reinterpret_cast<const std::byte*>(src.data());
  // Every destination touched once first: page faults are not the subject.
  std::vector<std::byte> copy(bytes, std::byte{1}), f16(bytes, std::byte{1}),
      f32(bytes * 2, std::byte{1}), fp8(elements, std::byte{1});
  std::vector<std::byte> scales(((rows + 127) / 128) * (kCols / 128) * 4, std::byte{1});

  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("## Processing throughput (transform layer)\n\n");
  std::printf(
      "Written by `make bench` (bench/transform_bench.cc): a %.0f MiB BF16 matrix of %llu x %llu\n"
      "(normal weights, a few outliers), converted in memory. GB/s of BF16 input; the reference\n"
      "is memcpy of the same bytes on as many threads. Medians of %d.\n\n",
      static_cast<double>(bytes) / (1 << 20), static_cast<unsigned long long>(rows),
      static_cast<unsigned long long>(kCols), repeats);
  std::printf("| operation | threads | time | GB/s of input | vs memcpy |\n");
  std::printf("| --- | ---: | ---: | ---: | ---: |\n");
  for (int threads : {1, cores}) {
    const uint64_t row_bytes = kCols * 2;
    const double memcpy_s = Time(threads, repeats, rows, [&](uint64_t r0, uint64_t r1) {
      std::memcpy(copy.data() + r0 * row_bytes, in + r0 * row_bytes, (r1 - r0) * row_bytes);
    });
    const double f16_s = Time(threads, repeats, rows, [&](uint64_t r0, uint64_t r1) {
      transform::Cast(DType::kBF16, std::span(in + r0 * row_bytes, (r1 - r0) * row_bytes),
                      DType::kF16, std::span(f16.data() + r0 * row_bytes, (r1 - r0) * row_bytes),
                      (r1 - r0) * kCols);
    });
    const double f32_s = Time(threads, repeats, rows, [&](uint64_t r0, uint64_t r1) {
      transform::Cast(
          DType::kBF16, std::span(in + r0 * row_bytes, (r1 - r0) * row_bytes), DType::kF32,
          std::span(f32.data() + r0 * row_bytes * 2, (r1 - r0) * row_bytes * 2), (r1 - r0) * kCols);
    });
    const double fp8_s = Time(threads, repeats, rows, [&](uint64_t r0, uint64_t r1) {
      const uint64_t scale_row = (kCols / 128) * 4;
      transform::QuantizeFp8Block(
          DType::kBF16, std::span(in + r0 * row_bytes, (r1 - r0) * row_bytes), kCols, r1 - r0,
          kCols, std::span(fp8.data() + r0 * kCols, (r1 - r0) * kCols),
          std::span(scales.data() + r0 / 128 * scale_row, (r1 - r0 + 127) / 128 * scale_row));
    });
    auto row = [&](const char* what, double s) {
      std::printf("| %s | %d | %.1f ms | %.2f | %.2fx |\n", what, threads, s * 1e3,
                  static_cast<double>(bytes) / s / 1e9, memcpy_s / s);
    };
    row("memcpy (reference)", memcpy_s);
    row("cast bf16 -> fp16", f16_s);
    row("cast bf16 -> fp32", f32_s);
    row("fp8-block (bf16 -> e4m3 + scales)", fp8_s);
  }
  std::printf(
      "\n`vs memcpy` above 1 would mean faster than copying; the bar is >= 1 GB/s of BF16\n"
      "input per core for fp8-block.\n\n");
  return 0;
}
