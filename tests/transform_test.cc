// The transform layer: conversions checked against references computed here
// by plain search over every value a target format has (no bit tricks), the
// shard plans, and the header-only checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <tuple>
#include <vector>

#include "fingerprint/fingerprint.h"
#include "format/checkpoint.h"
#include "format/dtype.h"
#include "format/synthetic.h"
#include "format/writer.h"
#include "io/file.h"
#include "loader/loader.h"
#include "memory/manifest.h"
#include "test_util.h"
#include "transform/apply.h"
#include "transform/convert.h"
#include "transform/plan.h"

namespace weightd {
namespace {

using format::DType;

// Every finite non-negative value of a format, with its encoding, by value;
// rounding to nearest, ties to the even encoding, picks from these.
struct Candidates {
  std::vector<std::pair<double, uint32_t>> values;
  double overflow_at = 0;    // the first value past the largest finite
  uint32_t overflow_to = 0;  // what it rounds to there (inf, or the max)
};

Candidates Enumerate(DType dtype) {
  Candidates c;
  const uint32_t count = dtype == DType::kF8_E4M3 ? 0x80 : 0x8000;
  for (uint32_t bits = 0; bits < count; ++bits) {
    double v;
    if (dtype == DType::kBF16) {
      v = format::DecodeBF16(static_cast<uint16_t>(bits));
    } else if (dtype == DType::kF16) {
      v = format::DecodeF16(static_cast<uint16_t>(bits));
    } else {
      v = format::DecodeMinifloat(dtype, bits);
    }
    if (std::isfinite(v)) c.values.push_back({v, bits});
  }
  std::sort(c.values.begin(), c.values.end());
  // With IEEE infinities, rounding treats infinity as the next step after
  // the largest finite value (2^16 for F16, 2^128 for BF16); E4M3 saturates.
  if (dtype == DType::kF16) {
    c.overflow_at = 65536.0;
    c.overflow_to = 0x7c00;
  } else if (dtype == DType::kBF16) {
    c.overflow_at = std::ldexp(1.0, 128);
    c.overflow_to = 0x7f80;
  } else {
    c.overflow_at = std::numeric_limits<double>::infinity();
    c.overflow_to = 0x7e;
  }
  return c;
}

// The reference: nearest by plain comparison, ties to the even encoding.
uint32_t Nearest(const Candidates& c, double a) {
  if (a >= c.overflow_at) return c.overflow_to;
  auto hi = std::lower_bound(c.values.begin(), c.values.end(), std::pair(a, 0u),
                             [](const auto& x, const auto& y) { return x.first < y.first; });
  double hi_value;
  uint32_t hi_bits;
  if (hi == c.values.end()) {
    if (std::isinf(c.overflow_at)) return c.values.back().second;  // saturate
    hi_value = c.overflow_at;
    hi_bits = c.overflow_to;
  } else {
    hi_value = hi->first;
    hi_bits = hi->second;
  }
  if (hi_value == a || hi == c.values.begin()) return hi_bits;
  const auto lo = std::prev(hi);
  const double below = a - lo->first, above = hi_value - a;
  if (below < above) return lo->second;
  if (above < below) return hi_bits;
  return (lo->second & 1) == 0 ? lo->second : hi_bits;
}

uint32_t Reference(const Candidates& c, double x, DType dtype) {
  const uint32_t sign = dtype == DType::kF8_E4M3 ? 0x80 : 0x8000;
  if (std::isnan(x)) return std::signbit(x) ? sign : 0;  // only checked for NaN-ness
  if (std::isinf(x)) return (std::signbit(x) ? sign : 0) | c.overflow_to;
  return (std::signbit(x) ? sign : 0) | Nearest(c, std::fabs(x));
}

bool IsNaN(DType dtype, uint32_t bits) {
  if (dtype == DType::kF8_E4M3) return (bits & 0x7f) == 0x7f;
  if (dtype == DType::kF16) return (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff) != 0;
  return (bits & 0x7f80) == 0x7f80 && (bits & 0x7f) != 0;
}

uint32_t Convert(DType to, float x) {
  switch (to) {
    case DType::kBF16:
      return transform::FloatToBF16(x);
    case DType::kF16:
      return transform::FloatToF16(x);
    default:
      return transform::FloatToE4M3(x);
  }
}

void CheckOne(const Candidates& c, DType to, double x, uint32_t got) {
  if (std::isnan(x)) {
    ASSERT_TRUE(IsNaN(to, got)) << x;
    return;
  }
  ASSERT_EQ(got, Reference(c, x, to)) << "x = " << x << " (" << std::hexfloat << x << ")";
}

// Every 16-bit pattern of `from` into `to`; for a 16-bit `to`, through the
// array cast too (its vector loops and dispatch), all in one call.
void ExhaustiveFrom16(DType from, DType to) {
  const Candidates c = Enumerate(to);
  std::vector<uint16_t> all(0x10000), cast(0x10000);
  for (uint32_t bits = 0; bits < 0x10000; ++bits) all[bits] = static_cast<uint16_t>(bits);
  const bool array = to == DType::kBF16 || to == DType::kF16;
  if (array) {
    transform::Cast(from, std::as_bytes(std::span(all)), to,
                    std::as_writable_bytes(std::span(cast)), all.size());
  }
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float x = from == DType::kBF16 ? format::DecodeBF16(static_cast<uint16_t>(bits))
                                         : format::DecodeF16(static_cast<uint16_t>(bits));
    CheckOne(c, to, x, Convert(to, x));
    if (array) CheckOne(c, to, x, cast[bits]);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(Convert, Bf16ToFp16Exhaustive) { ExhaustiveFrom16(DType::kBF16, DType::kF16); }
TEST(Convert, Fp16ToBf16Exhaustive) { ExhaustiveFrom16(DType::kF16, DType::kBF16); }
TEST(Convert, Bf16ToE4M3Exhaustive) { ExhaustiveFrom16(DType::kBF16, DType::kF8_E4M3); }
TEST(Convert, Fp16ToE4M3Exhaustive) { ExhaustiveFrom16(DType::kF16, DType::kF8_E4M3); }

TEST(Convert, WideningIsExactForEvery16BitValue) {
  for (DType from : {DType::kBF16, DType::kF16}) {
    for (uint32_t bits = 0; bits < 0x10000; ++bits) {
      const uint16_t b = static_cast<uint16_t>(bits);
      std::byte src[2], dst[4];
      std::memcpy(src, &b, 2);
      transform::Cast(from, src, DType::kF32, dst, 1);
      float got;
      std::memcpy(&got, dst, 4);
      const float want = from == DType::kBF16 ? format::DecodeBF16(b) : format::DecodeF16(b);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got));
      } else {
        ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << bits;
      }
    }
  }
}

// F32 and F64 sources: every midpoint between neighbouring target values
// and a float either side of it, plus random values over the whole range.
TEST(Convert, Fp32AndFp64SourcesRoundAtEveryMidpoint) {
  std::mt19937_64 rng(7);
  for (DType to : {DType::kBF16, DType::kF16, DType::kF8_E4M3}) {
    const Candidates c = Enumerate(to);
    std::vector<double> xs = {0.0, -0.0, 1e-45, 1e30, -1e30, 448.0, 464.0, 65504.0, 65520.0};
    for (size_t i = 0; i + 1 < c.values.size(); ++i) {
      const double mid = (c.values[i].first + c.values[i + 1].first) / 2;
      xs.push_back(mid);
      xs.push_back(std::nextafter(static_cast<float>(mid), 0.0f));
      xs.push_back(std::nextafter(static_cast<float>(mid), 1e30f));
    }
    for (int i = 0; i < 200000; ++i) {
      xs.push_back(static_cast<double>(std::bit_cast<float>(static_cast<uint32_t>(rng()))));
    }
    for (double x : xs) {
      for (double signed_x : {x, -x}) {
        const auto f = static_cast<float>(signed_x);
        CheckOne(c, to, f, Convert(to, f));  // float inputs: exactly f
        if (to == DType::kF8_E4M3) continue;
        // Doubles (not first rounded to float) through the F64 path.
        const uint32_t from_double = to == DType::kBF16 ? transform::DoubleToBF16(signed_x)
                                                        : transform::DoubleToF16(signed_x);
        CheckOne(c, to, signed_x, from_double);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

TEST(Convert, CastsKeepNaNAndInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(transform::FloatToBF16(inf), 0x7f80);
  EXPECT_EQ(transform::FloatToBF16(-inf), 0xff80);
  EXPECT_EQ(transform::FloatToF16(-inf), 0xfc00);
  EXPECT_EQ(transform::FloatToE4M3(inf), 0x7e);  // saturates
  EXPECT_EQ(transform::FloatToE4M3(-inf), 0xfe);
  EXPECT_EQ(transform::FloatToE4M3(-std::nanf("")), 0xff);
  EXPECT_TRUE(IsNaN(DType::kBF16, transform::FloatToBF16(std::nanf(""))));
  EXPECT_TRUE(IsNaN(DType::kF16, transform::DoubleToF16(std::nan(""))));
}

float DecodeE4M3(uint8_t b) {
  return static_cast<float>(format::DecodeMinifloat(DType::kF8_E4M3, b));
}

// The half-step of E4M3 around |y|: what round-to-nearest may be off by.
double HalfStep(double y) {
  y = std::fabs(y);
  if (y < std::ldexp(1.0, -6)) return std::ldexp(1.0, -10);  // subnormal steps are 2^-9
  int e;
  std::frexp(y, &e);
  return std::ldexp(1.0, e - 1 - 3 - 1);
}

// `values` encoded as `dtype` (F32, F16 or BF16), and decoded back.
std::vector<std::byte> Encode(DType dtype, const std::vector<float>& values) {
  std::vector<std::byte> out(values.size() * format::DTypeBits(dtype) / 8);
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + i * 4, &values[i], 4);
      continue;
    }
    const uint16_t b = dtype == DType::kBF16 ? transform::FloatToBF16(values[i])
                                             : transform::FloatToF16(values[i]);
    std::memcpy(out.data() + i * 2, &b, 2);
  }
  return out;
}

float Decode(DType dtype, const std::vector<std::byte>& bytes, size_t i) {
  if (dtype == DType::kF32) {
    float x;
    std::memcpy(&x, bytes.data() + i * 4, 4);
    return x;
  }
  uint16_t b;
  std::memcpy(&b, bytes.data() + i * 2, 2);
  return dtype == DType::kBF16 ? format::DecodeBF16(b) : format::DecodeF16(b);
}

void CheckQuantize(DType from) {
  // 300 x 260: partial blocks at both edges; a wider source (stride 300) so
  // the columns come from the middle of each row.
  const uint64_t rows = 300, cols = 260, stride = 300, skip = 17;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(rows * stride);
  for (uint64_t r = 0; r < rows; ++r) {
    // Each block row at its own magnitude, one block all zeros.
    const float magnitude = std::ldexp(1.0f, static_cast<int>(r / 128) * 6 - 8);
    for (uint64_t c = 0; c < stride; ++c) {
      float v = normal(rng) * magnitude;
      if (r < 128 && c >= skip + 128 && c < skip + 256) v = 0;
      values[r * stride + c] = v;
    }
  }
  values[5 * stride + skip + 3] = std::numeric_limits<float>::quiet_NaN();
  values[6 * stride + skip + 3] = -std::numeric_limits<float>::infinity();
  const std::vector<std::byte> src = Encode(from, values);
  const size_t size = format::DTypeBits(from) / 8;
  const uint64_t brows = 3, bcols = 3;
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scales(brows * bcols);
  transform::QuantizeFp8Block(from, std::span(src).subspan(skip * size), stride, rows, cols,
                              std::as_writable_bytes(std::span(q)),
                              std::as_writable_bytes(std::span(scales)));
  const Candidates e4m3 = Enumerate(DType::kF8_E4M3);
  for (uint64_t br = 0; br < brows; ++br) {
    for (uint64_t bc = 0; bc < bcols; ++bc) {
      double amax = 0;
      for (uint64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (uint64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
          const double x = Decode(from, src, r * stride + skip + c);
          if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
        }
      }
      const float scale = scales[br * bcols + bc];
      EXPECT_EQ(scale, amax > 0 ? static_cast<float>(amax) / 448.0f : 1.0f) << br << "," << bc;
      for (uint64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (uint64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
          const float x = Decode(from, src, r * stride + skip + c);
          const uint8_t got = q[r * cols + c];
          const float y = x / scale;
          if (std::isnan(x)) {
            ASSERT_EQ(got & 0x7f, 0x7f);
            continue;
          }
          ASSERT_EQ(got, Reference(e4m3, y, DType::kF8_E4M3)) << r << "," << c;
          if (!std::isfinite(x)) continue;
          // Dequantized, within half an E4M3 step of the scaled value.
          const double error = std::fabs(static_cast<double>(DecodeE4M3(got)) * scale - x);
          ASSERT_LE(error, HalfStep(y) * scale * (1 + 1e-6)) << r << "," << c << " x=" << x;
        }
      }
    }
  }
}

TEST(Quantize, BlocksScaleToTheirMaximumAndRoundWithinHalfAStep) {
  for (DType from : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(std::string(format::DTypeName(from)));
    CheckQuantize(from);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// F32 blocks can hold values so small that max / 448 is 0 in float: the
// scale must not be, or every zero in the block turns into NaN.
TEST(Quantize, ABlockOfTheTiniestFloatsGetsAScaleAndNoNaN) {
  const uint64_t rows = 4, cols = 8;
  std::vector<float> values(rows * cols, 0.0f);
  const float tiniest = std::numeric_limits<float>::denorm_min();
  values[3] = tiniest;
  values[9] = -2 * tiniest;
  const std::vector<std::byte> src = Encode(DType::kF32, values);
  std::vector<uint8_t> q(rows * cols);
  float scale = -1;
  transform::QuantizeFp8Block(DType::kF32, src, cols, rows, cols,
                              std::as_writable_bytes(std::span(q)),
                              std::as_writable_bytes(std::span(&scale, 1)));
  EXPECT_GT(scale, 0.0f);
  for (size_t i = 0; i < q.size(); ++i) {
    ASSERT_NE(q[i] & 0x7f, 0x7f) << "NaN at " << i;  // E4M3's only NaN codes
    EXPECT_EQ(static_cast<float>(DecodeE4M3(q[i]) * scale), values[i]) << i;
  }
}

// --- shard plans ---

std::shared_ptr<const transform::ShardPlan> Plan(const std::string& spec) {
  auto p = transform::ShardPlan::Load(spec);
  EXPECT_TRUE(p.ok()) << p.error().message();
  return p.ok() ? *p : nullptr;
}

TEST(ShardPlan, LlamaPresetCoversLlamaMistralAndQwenNames) {
  auto plan = Plan("llama");
  using transform::Split;
  const std::vector<std::pair<std::string, Split>> cases = {
      {"model.layers.0.self_attn.q_proj.weight", Split::kColumn},
      {"model.layers.0.self_attn.k_proj.bias", Split::kColumn},  // Qwen
      {"model.layers.3.mlp.gate_proj.weight", Split::kColumn},
      {"model.layers.3.mlp.up_proj.weight", Split::kColumn},
      {"model.layers.0.self_attn.o_proj.weight", Split::kRow},
      {"model.layers.0.self_attn.o_proj.bias", Split::kReplicate},
      {"model.layers.9.mlp.down_proj.weight", Split::kRow},
      {"model.layers.1.block_sparse_moe.experts.7.w1.weight", Split::kColumn},  // Mixtral
      {"model.layers.1.block_sparse_moe.experts.7.w2.weight", Split::kRow},
      {"model.layers.1.block_sparse_moe.gate.weight", Split::kReplicate},
      {"model.embed_tokens.weight", Split::kVocab},
      {"lm_head.weight", Split::kVocab},
      {"model.norm.weight", Split::kReplicate},
      {"model.layers.0.input_layernorm.weight", Split::kReplicate},
      {"model.layers.0.self_attn.q_proj.weight_scale_inv",
       Split::kReplicate},  // cut with its weight
  };
  for (const auto& [name, split] : cases) {
    EXPECT_EQ(transform::SplitName(plan->SplitOf(name)), transform::SplitName(split)) << name;
  }
  // A rule sees the whole name, past a NUL a header may spell in it.
  const std::string with_nul("model.layers.0.self_attn.q_proj.weight\0x", 40);
  EXPECT_EQ(plan->SplitOf(with_nul), Split::kReplicate);
}

TEST(ShardPlan, FilesAreRulesInOrderAndEqualRulesHaveEqualDigests) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/plan.toml";
  std::ofstream(path) << "# first match wins\n"
                         "[[rule]]\nmatch = 'special\\.weight$'\nsplit = \"replicate\"\n"
                         "[[rule]]\nmatch = '\\.weight$'\nsplit = \"row\"\n";
  auto plan = Plan(path);
  ASSERT_NE(plan, nullptr);
  EXPECT_EQ(plan->name(), "file");
  EXPECT_EQ(plan->SplitOf("a.special.weight"), transform::Split::kReplicate);
  EXPECT_EQ(plan->SplitOf("a.other.weight"), transform::Split::kRow);
  EXPECT_EQ(plan->SplitOf("a.other.bias"), transform::Split::kReplicate);
  auto same =
      transform::ShardPlan::FromRules("x", {{"special\\.weight$", transform::Split::kReplicate},
                                            {"\\.weight$", transform::Split::kRow}});
  ASSERT_TRUE(same.ok());
  EXPECT_EQ((*same)->digest(), plan->digest());
  EXPECT_NE(Plan("llama")->digest(), plan->digest());
  EXPECT_NE(Plan("llama")->digest(), Plan("replicate")->digest());
  // One rule must not spell two in the digest's text (rules are split
  // there by tabs and newlines): `a`, then `b` split by rows, and this
  // would have shared a digest, and a resident model.
  auto spelled = transform::ShardPlan::FromRules("x", {{"a\nrow\tb", transform::Split::kColumn}});
  ASSERT_FALSE(spelled.ok());
  EXPECT_NE(spelled.error().message().find("control characters"), std::string::npos)
      << spelled.error().message();
  EXPECT_FALSE(transform::ShardPlan::FromRules("x", {{"a\x7f", transform::Split::kRow}}).ok());
}

TEST(ShardPlan, BadPlansAreErrorsThatSayWhy) {
  testing::TempDir dir;
  auto error_of = [&](const std::string& text) {
    const std::string path = dir.path() + "/bad.toml";
    std::ofstream(path) << text;
    auto p = transform::ShardPlan::Load(path);
    return p.ok() ? std::string("(no error)") : p.error().message();
  };
  EXPECT_NE(error_of("[[rule]]\nmatch = 'x'\nsplit = \"diagonal\"\n").find("unknown split"),
            std::string::npos);
  EXPECT_NE(error_of("[[rule]]\nmatch = '(unclosed'\nsplit = \"row\"\n").find("(unclosed"),
            std::string::npos);
  EXPECT_NE(error_of("[[rule]]\nsplit = \"row\"\n").find("needs a `match`"), std::string::npos);
  EXPECT_NE(error_of("[[rule]]\nmatch = '(a)\\1'\nsplit = \"row\"\n").find("back-references"),
            std::string::npos);
  // What would make compiling or matching blow up is refused, with why.
  for (auto [pattern, why] : {std::pair{"e+++++++", "a repetition must follow"},
                              {"a*?", "a repetition must follow"},
                              {"a{1000}", "counted repetition"},
                              {"((((a))))", "nested more than 3 deep"},
                              {"[[=a=])]((((a)+)+)+)+", "nested more than 3 deep"},
                              {"a)(b", "a ) without its ("},
                              {"(a?a?a?a?)+", "a repeated group must not hold a repetition"},
                              {"((a+)b)*", "a repeated group must not hold a repetition"},
                              {"[[:alpha:]", "unclosed bracket"}}) {
    const std::string message =
        error_of(std::string("[[rule]]\nmatch = '") + pattern + "'\nsplit = \"row\"\n");
    EXPECT_NE(message.find(why), std::string::npos) << pattern << ": " << message;
  }
  EXPECT_TRUE(transform::ShardPlan::FromRules(
                  "ok", {{"(^|\\.)experts\\.[0-9]+\\.(w1|w3)\\.weight$", transform::Split::kRow},
                         {"[]a-]+x?", transform::Split::kRow},
                         {"(ab)+(c|d)*[0-9]+", transform::Split::kRow},
                         {"^[[:alpha:]_.]+[[:digit:]]*$", transform::Split::kRow}})
                  .ok());
  // Every rule is tried on every name: a plan holds a few dozen at most.
  std::string many;
  for (int i = 0; i < 129; ++i)
    many += "[[rule]]\nmatch = '^q" + std::to_string(i) + "$'\nsplit = \"row\"\n";
  EXPECT_NE(error_of(many).find("at most 128 rules"), std::string::npos) << error_of(many);
  EXPECT_NE(error_of("[other]\nx = 1\n").find("unknown key `other`"), std::string::npos);
  EXPECT_NE(error_of("not toml [").find("not a TOML"), std::string::npos);
  auto unknown = transform::ShardPlan::Load("gpt");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.error().message().find("presets: llama, replicate"), std::string::npos);
}

// --- the per-tensor plan, from headers only ---

// Source tensors are views into parsed headers; these tests' names and
// shapes live here, for the length of the test program.
transform::SourceTensor T(std::string name, DType dtype, std::vector<uint64_t> shape) {
  static std::deque<std::string> names;
  static std::deque<std::vector<uint64_t>> shapes;
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return {names.emplace_back(std::move(name)), dtype, shapes.emplace_back(std::move(shape)),
          n * format::DTypeBits(dtype) / 8};
}

Result<transform::TensorPlan> PlanOf(std::vector<transform::SourceTensor> sources, int tp,
                                     const std::string& dtype = "keep",
                                     const std::string& quant = "none",
                                     const std::string& plan = "llama") {
  std::sort(sources.begin(), sources.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  auto p = transform::ResolveProcessing(tp, dtype, quant, plan);
  if (!p.ok()) return p.error();
  return transform::PlanTensors(sources, *p);
}

std::string ErrorOf(const Result<transform::TensorPlan>& r) {
  return r.ok() ? "(no error)" : r.error().message();
}

// The plan's output called `name` (a failure, and the first, if none is).
const transform::OutputTensor& OutputNamed(const transform::TensorPlan& plan,
                                           const std::string& name) {
  for (const auto& o : plan.outputs)
    if (o.name == name) return o;
  ADD_FAILURE() << name << " missing";
  return plan.outputs[0];
}

TEST(TensorPlan, SplitsCastsAndQuantizesWhatTheRulesSay) {
  auto plan = PlanOf({T("model.embed_tokens.weight", DType::kBF16, {1001, 64}),
                      T("model.layers.0.self_attn.q_proj.weight", DType::kBF16, {256, 64}),
                      T("model.layers.0.self_attn.o_proj.weight", DType::kBF16, {64, 256}),
                      T("model.layers.0.input_layernorm.weight", DType::kF32, {64}),
                      T("model.layers.0.rotary.inv_freq", DType::kI64, {32})},
                     4, "fp16", "fp8-block");
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  auto find = [&](const std::string& name) -> const transform::OutputTensor& {
    return OutputNamed(*plan, name);
  };
  const auto& embed = find("model.embed_tokens.weight");
  EXPECT_EQ(embed.shape, (std::vector<uint64_t>{251, 64}));  // 1001 padded to 1004
  EXPECT_EQ(embed.op, transform::Op::kCast);
  EXPECT_EQ(embed.dtype, DType::kF16);
  const auto& q = find("model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(q.shape, (std::vector<uint64_t>{64, 64}));
  EXPECT_EQ(q.dtype, DType::kF8_E4M3);
  EXPECT_EQ(find("model.layers.0.self_attn.q_proj.weight_scale_inv").shape,
            (std::vector<uint64_t>{1, 1}));
  const auto& o = find("model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(o.shape, (std::vector<uint64_t>{64, 64}));
  EXPECT_EQ(o.ColOffset(3), 192u);
  EXPECT_EQ(find("model.layers.0.input_layernorm.weight").dtype, DType::kF16);
  EXPECT_EQ(find("model.layers.0.rotary.inv_freq").op, transform::Op::kCopy);  // never cast
}

// A tensor of no bytes may claim any first dimension; its share per rank
// is rounded up without wrapping (it once came out as 0).
TEST(TensorPlan, ADimensionNearTwoToTheSixtyFourIsCutWithoutWrapping) {
  const uint64_t huge = UINT64_MAX;  // 2^64 - 1 rows of nothing
  auto plan = PlanOf({T("model.embed_tokens.weight", DType::kBF16, {huge, 0}),
                      T("model.layers.0.mlp.up_proj.weight", DType::kBF16, {0, huge}),
                      T("model.layers.0.mlp.gate_proj.weight", DType::kBF16, {huge - 127, 0})},
                     2, "keep", "fp8-block");
  ASSERT_TRUE(plan.ok()) << plan.error().message();
  auto find = [&](const std::string& name) -> const transform::OutputTensor& {
    return OutputNamed(*plan, name);
  };
  EXPECT_EQ(find("model.embed_tokens.weight").shape,
            (std::vector<uint64_t>{uint64_t{1} << 63, 0}));  // vocab: rounded up
  EXPECT_EQ(find("model.embed_tokens.weight").bytes, 0u);
  EXPECT_EQ(find("model.layers.0.mlp.up_proj.weight_scale_inv").shape,
            (std::vector<uint64_t>{0, (uint64_t{1} << 57)}));
  EXPECT_EQ(find("model.layers.0.mlp.gate_proj.weight_scale_inv").shape,
            (std::vector<uint64_t>{uint64_t{1} << 56, 0}));
}

TEST(TensorPlan, HeaderOnlyChecksNameTheTensorAndTheRule) {
  // A split dimension not divisible by the rank count.
  EXPECT_NE(ErrorOf(PlanOf({T("a.q_proj.weight", DType::kBF16, {100, 8})}, 3))
                .find("tensor `a.q_proj.weight`: column split: dim 0 (100) is not divisible by "
                      "--tp-size 3"),
            std::string::npos);
  EXPECT_NE(
      ErrorOf(PlanOf({T("a.o_proj.weight", DType::kBF16, {8})}, 2)).find("row split cuts dim 1"),
      std::string::npos);
  // An FP8 shard boundary inside a 128-row block.
  EXPECT_NE(ErrorOf(PlanOf({T("a.up_proj.weight", DType::kF8_E4M3, {384, 256}),
                            T("a.up_proj.weight_scale_inv", DType::kF32, {3, 2})},
                           2))
                .find("column split gives 192 rows per rank, which cuts a 128x128 FP8 block"),
            std::string::npos);
  EXPECT_TRUE(PlanOf({T("a.up_proj.weight", DType::kF8_E4M3, {512, 256}),
                      T("a.up_proj.weight_scale_inv", DType::kF32, {4, 2})},
                     2)
                  .ok());
  // Scales whose shape is not their weight's blocks.
  EXPECT_NE(ErrorOf(PlanOf({T("a.up_proj.weight", DType::kF8_E4M3, {512, 256}),
                            T("a.up_proj.weight_scale_inv", DType::kF32, {4, 4})},
                           2))
                .find("128x128 blocks of its weight"),
            std::string::npos);
  // Scales without their weight, or for a weight that is not FP8.
  EXPECT_NE(ErrorOf(PlanOf({T("a.up_proj.weight_scale_inv", DType::kF32, {4, 2})}, 2))
                .find("block scales without their weight `a.up_proj.weight`"),
            std::string::npos);
  EXPECT_NE(ErrorOf(PlanOf({T("a.up_proj.weight", DType::kBF16, {512, 256}),
                            T("a.up_proj.weight_scale_inv", DType::kF32, {4, 2})},
                           2))
                .find("not FP8"),
            std::string::npos);
  // Quantization formats weightd does not understand.
  EXPECT_NE(ErrorOf(PlanOf({T("a.q_proj.qweight", DType::kI32, {64, 64})}, 2))
                .find("GPTQ/AWQ packed int4"),
            std::string::npos);
  // ... which still pass through untouched with no processing at all.
  EXPECT_TRUE(PlanOf({T("a.q_proj.qweight", DType::kI32, {64, 64})}, 1, "keep", "none").ok());
  // Flags.
  EXPECT_NE(ErrorOf(PlanOf({}, 2, "keep", "none", "gpt")).find("unknown shard plan `gpt`"),
            std::string::npos);
  EXPECT_NE(ErrorOf(PlanOf({}, 2, "fp64")).find("--dtype fp64"), std::string::npos);
  EXPECT_NE(ErrorOf(PlanOf({}, 2, "keep", "int4")).find("--quant int4"), std::string::npos);
}

TEST(TensorPlan, OneRankWithoutQuantizationNeedsNoPlan) {
  auto p = transform::ResolveProcessing(1, "bf16", "none", "llama");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->plan->name(), "replicate");
  auto q = transform::ResolveProcessing(1, "keep", "fp8-block", "llama");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->plan->name(), "llama");  // it decides what is quantized
  // Splitting or quantizing with no plan named is an error, not replication.
  for (auto [tp, quant] : {std::pair{2, "none"}, {1, "fp8-block"}}) {
    auto none = transform::ResolveProcessing(tp, "keep", quant, "");
    ASSERT_FALSE(none.ok());
    EXPECT_NE(none.error().message().find("name a --shard-plan"), std::string::npos);
  }
  EXPECT_EQ(transform::ResolveProcessing(1, "bf16", "none", "")->plan->name(), "replicate");
}

// --- through the loader ---

// Every read the loader makes, recorded (path, offset, bytes).
class RecordingFileSystem final : public testing::PassThroughFileSystem {
 public:
  struct Read {
    std::string path;
    uint64_t offset, bytes;
  };
  using PassThroughFileSystem::Open;
  Result<std::unique_ptr<io::RandomAccessFile>> Open(const std::string& path,
                                                     io::Symlinks symlinks) override {
    WEIGHTD_ASSIGN_OR_RETURN(auto file, base_.Open(path, symlinks));
    return std::unique_ptr<io::RandomAccessFile>(new File(std::move(file), this));
  }

  std::vector<Read> reads() {
    std::lock_guard lock(mu_);
    return reads_;
  }

 private:
  class File final : public testing::PassThroughFile {
   public:
    File(std::unique_ptr<io::RandomAccessFile> f, RecordingFileSystem* fs)
        : PassThroughFile(std::move(f)), fs_(fs) {}
    Status ReadExactly(uint64_t offset, std::span<std::byte> dst) const override {
      {
        std::lock_guard lock(fs_->mu_);
        fs_->reads_.push_back({path(), offset, dst.size()});
      }
      return PassThroughFile::ReadExactly(offset, dst);
    }

   private:
    RecordingFileSystem* fs_;
  };

  std::mutex mu_;
  std::vector<Read> reads_;
};

transform::Processing Resolve(int tp, const std::string& dtype = "keep",
                              const std::string& quant = "none",
                              const std::string& plan = "llama") {
  auto p = transform::ResolveProcessing(tp, dtype, quant, plan);
  EXPECT_TRUE(p.ok()) << p.error().message();
  return *p;
}

// One rank's tensors, by name, as views into its sealed segment.
std::map<std::string, std::span<const std::byte>> TensorsOf(const loader::LoadedRank& rank) {
  std::map<std::string, std::span<const std::byte>> out;
  const auto bytes = rank.segment->readable();
  auto m = memory::ReadManifest(bytes);
  EXPECT_TRUE(m.ok());
  for (const auto& t : m->tensors) {
    out[std::string(t.name)] =
        bytes.subspan(static_cast<size_t>(t.offset), static_cast<size_t>(t.bytes));
  }
  return out;
}

// Puts the ranks' pieces of one tensor back together as the plan cut it.
std::vector<std::byte> Reassemble(const format::TensorInfo& t, transform::Split split,
                                  const std::vector<std::span<const std::byte>>& pieces) {
  const size_t n = pieces.size();
  std::vector<std::byte> out;
  const uint64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const uint64_t row_bytes = rows == 0 ? 0 : t.bytes() / rows;
  switch (split) {
    case transform::Split::kReplicate:
      for (const auto& p : pieces) EXPECT_TRUE(std::equal(p.begin(), p.end(), pieces[0].begin()));
      out.assign(pieces[0].begin(), pieces[0].end());
      break;
    case transform::Split::kColumn:
    case transform::Split::kVocab:
      for (const auto& p : pieces) out.insert(out.end(), p.begin(), p.end());
      // Vocab padding: zero rows past the tensor's own.
      for (size_t i = static_cast<size_t>(t.bytes()); i < out.size(); ++i) {
        EXPECT_EQ(out[i], std::byte{0}) << t.name << " padding byte " << i;
      }
      out.resize(static_cast<size_t>(t.bytes()));
      break;
    case transform::Split::kRow: {
      const uint64_t share = row_bytes / n;
      for (uint64_t r = 0; r < rows; ++r) {
        for (const auto& p : pieces) {
          auto from = p.begin() + static_cast<std::ptrdiff_t>(r * share);
          out.insert(out.end(), from, from + static_cast<std::ptrdiff_t>(share));
        }
      }
      break;
    }
  }
  return out;
}

// BF16 widened to F32 by hand, bit by bit (exact: the same value), as the
// reference for a load cast to fp32.
std::vector<std::byte> WidenBf16(std::span<const std::byte> bf16) {
  std::vector<std::byte> out(bf16.size() * 2, std::byte{0});
  for (size_t i = 0; i < bf16.size() / 2; ++i) {
    out[i * 4 + 2] = bf16[i * 2];
    out[i * 4 + 3] = bf16[i * 2 + 1];
  }
  return out;
}

// Loads `path` split for `tp` ranks (`dtype` keep, or fp32 for BF16
// checkpoints) and puts every tensor back together from the ranks: it must
// be the file's bytes, widened where cast.
void CheckRoundTrip(const std::string& path, int tp, const std::string& plan,
                    const std::string& dtype = "keep") {
  loader::LoadOptions o;
  o.processing = Resolve(tp, dtype, "none", plan);
  o.max_inflight = 4;
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message();
  ASSERT_EQ(loaded->ranks.size(), static_cast<size_t>(tp));
  std::vector<std::map<std::string, std::span<const std::byte>>> ranks;
  for (const auto& r : loaded->ranks) ranks.push_back(TensorsOf(r));
  auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), path);
  ASSERT_TRUE(ckpt.ok());
  size_t split_tensors = 0, cast_tensors = 0;
  for (const auto& shard : ckpt->shards) {
    const auto file = testing::ReadFileBytes(shard.path);
    for (const auto& t : shard.header.tensors) {
      std::vector<std::span<const std::byte>> pieces;
      for (const auto& r : ranks) {
        auto it = r.find(std::string(t.name));
        ASSERT_NE(it, r.end()) << t.name;
        pieces.push_back(it->second);
      }
      const transform::Split split =
          tp == 1 ? transform::Split::kReplicate : o.processing.plan->SplitOf(std::string(t.name));
      if (split != transform::Split::kReplicate) ++split_tensors;
      const auto at =
          file.begin() + static_cast<std::ptrdiff_t>(shard.header.data_offset() + t.begin);
      std::vector<std::byte> expected(at, at + static_cast<std::ptrdiff_t>(t.bytes()));
      format::TensorInfo held = t;  // as the ranks hold it
      if (dtype == "fp32") {
        ASSERT_TRUE(t.dtype == DType::kBF16 || !transform::IsCastSource(t.dtype)) << t.name;
        if (t.dtype == DType::kBF16) {
          expected = WidenBf16(expected);
          held.dtype = DType::kF32;
          held.end = held.begin + expected.size();
          ++cast_tensors;
        }
      }
      const auto whole = Reassemble(held, split, pieces);
      ASSERT_EQ(whole.size(), expected.size()) << t.name;
      ASSERT_TRUE(whole == expected) << t.name << " at tp " << tp << ", dtype " << dtype;
    }
  }
  if (tp > 1 && plan == "llama") {
    EXPECT_GT(split_tensors, 0u);
  }
  if (dtype == "fp32") {
    EXPECT_GT(cast_tensors, 0u);
  }
  // The digest is the checkpoint's, whatever was done to the bytes.
  auto fp = fingerprint::FingerprintCheckpoint(io::PosixFileSystem(), path, {});
  ASSERT_TRUE(fp.ok());
  EXPECT_EQ(loaded->checkpoint_digest, fp->digest);
}

TEST(Sharding, ConcatenatedRanksGiveBackEveryTensorBitForBit) {
  testing::TempDir dir;
  const std::string llama = dir.Join("llama");
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(llama, {.preset = "llama", .size_bytes = 4 << 20}).ok());
  for (int tp : {1, 2, 4, 8}) {
    CheckRoundTrip(llama, tp, "llama");
    if (::testing::Test::HasFatalFailure()) return;
  }
  // Cast on the way, by bands of rows, each rank its own columns or rows.
  for (int tp : {1, 4}) {
    CheckRoundTrip(llama, tp, "llama", "fp32");
    if (::testing::Test::HasFatalFailure()) return;
  }
  // A vocabulary that does not divide: zero rows pad the last rank.
  const std::string odd = dir.Join("odd.safetensors");
  std::vector<format::TensorData> tensors;
  for (auto [name, rows] : {std::pair{"model.embed_tokens.weight", 1001},
                            {"lm_head.weight", 1001},
                            {"x.q_proj.weight", 16},
                            {"x.o_proj.weight", 8}}) {
    format::TensorData d{{name, DType::kBF16, {static_cast<uint64_t>(rows), 16}}, {}};
    for (int i = 0; i < rows * 16 * 2; ++i) d.bytes.push_back(static_cast<std::byte>(i * 7 + rows));
    tensors.push_back(std::move(d));
  }
  ASSERT_TRUE(format::WriteSafetensors(odd, tensors).ok());
  for (int tp : {2, 4, 8}) CheckRoundTrip(odd, tp, "llama");
  for (int tp : {2, 8}) CheckRoundTrip(odd, tp, "llama", "fp32");
}

// Names that sort between a weight and its new scales, and packed F4 that a
// layer rule matches, with one rank: each tensor gets its own bytes.
TEST(Sharding, QuantizedScalesLandOnTheirOwnTensor) {
  testing::TempDir dir;
  const std::string path = dir.Join("m.safetensors");
  std::vector<format::TensorData> tensors;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  format::TensorData w{{"l.q_proj.weight", DType::kBF16, {256, 256}}, {}};
  for (int i = 0; i < 256 * 256; ++i) {
    const uint16_t b = transform::FloatToBF16(normal(rng));
    w.bytes.push_back(static_cast<std::byte>(b & 0xff));
    w.bytes.push_back(static_cast<std::byte>(b >> 8));
  }
  tensors.push_back(w);
  tensors.push_back({{"l.q_proj.weight_bias", DType::kBF16, {4}},
                     {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}, std::byte{5},
                      std::byte{6}, std::byte{7}, std::byte{8}}});
  tensors.push_back({{"l.up_proj.weight", DType::kF4, {2, 3}},
                     {std::byte{0x12}, std::byte{0x34}, std::byte{0x56}}});
  ASSERT_TRUE(format::WriteSafetensors(path, tensors).ok());
  loader::LoadOptions o;
  o.processing = Resolve(1, "keep", "fp8-block");
  auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
  ASSERT_TRUE(loaded.ok()) << loaded.error().message();
  auto got = TensorsOf(loaded->ranks[0]);
  const auto& bias = got["l.q_proj.weight_bias"];
  EXPECT_TRUE(std::equal(bias.begin(), bias.end(), tensors[1].bytes.begin()));
  const auto& packed = got["l.up_proj.weight"];
  EXPECT_TRUE(std::equal(packed.begin(), packed.end(), tensors[2].bytes.begin()));
  // The scales and weights are exactly what the conversion makes.
  std::vector<std::byte> q(256 * 256), scales(2 * 2 * 4);
  transform::QuantizeFp8Block(DType::kBF16, w.bytes, 256, 256, 256, q, scales);
  const auto& got_q = got["l.q_proj.weight"];
  const auto& got_scales = got["l.q_proj.weight_scale_inv"];
  EXPECT_TRUE(std::equal(got_q.begin(), got_q.end(), q.begin()));
  ASSERT_EQ(got_scales.size(), scales.size());
  EXPECT_TRUE(std::equal(got_scales.begin(), got_scales.end(), scales.begin()));
}

TEST(Sharding, OneRankAloneIsThatRankOfAllAndReadsLess) {
  testing::TempDir dir;
  const std::string path = dir.Join("m");
  ASSERT_TRUE(
      format::WriteSyntheticCheckpoint(path, {.preset = "llama", .size_bytes = 4 << 20}).ok());
  loader::LoadOptions all;
  all.processing = Resolve(4, "fp16", "fp8-block");
  auto every = loader::LoadCheckpoint(io::PosixFileSystem(), path, all);
  ASSERT_TRUE(every.ok()) << every.error().message();
  for (int rank : {0, 3}) {
    RecordingFileSystem fs;
    loader::LoadOptions one = all;
    one.ranks = {rank};
    auto alone = loader::LoadCheckpoint(fs, path, one);
    ASSERT_TRUE(alone.ok()) << alone.error().message();
    ASSERT_EQ(alone->ranks.size(), 1u);
    const auto a = alone->ranks[0].segment->readable();
    const auto b = every->ranks[static_cast<size_t>(rank)].segment->readable();
    ASSERT_EQ(a.size(), b.size());
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << "rank " << rank;
    EXPECT_EQ(alone->checkpoint_digest, every->checkpoint_digest);
    uint64_t read = 0;
    for (const auto& r : fs.reads()) read += r.bytes;
    EXPECT_LT(read, every->data_bytes) << "rank " << rank << " read what every rank needs";
  }
}

// A tensor of no elements may still claim 2^42 rows: processed, it is no
// work (it was 2^22 band jobs of 2^20 empty rows each, hours of them).
TEST(Sharding, TensorsWithNoElementsAreNoWorkHoweverManyRowsTheyClaim) {
  testing::TempDir dir;
  std::vector<format::TensorData> tensors = {
      {{"a.o_proj.weight", DType::kBF16, {uint64_t{1} << 42, 0}}, {}},
      {{"a.q_proj.weight", DType::kBF16, {uint64_t{1} << 40, 0}}, {}},
      {{"a.up_proj.weight", DType::kBF16, {256, 256}}, std::vector<std::byte>(256 * 256 * 2)}};
  const std::string path = dir.Join("empty.safetensors");
  ASSERT_TRUE(format::WriteSafetensors(path, tensors).ok());
  for (const auto& [tp, dtype, quant] : std::vector<std::tuple<int, std::string, std::string>>{
           {1, "fp16", "none"}, {2, "keep", "none"}, {2, "bf16", "fp8-block"}}) {
    loader::LoadOptions o;
    o.processing = Resolve(tp, dtype, quant);
    auto loaded = loader::LoadCheckpoint(io::PosixFileSystem(), path, o);
    ASSERT_TRUE(loaded.ok()) << loaded.error().message();
    for (const auto& rank : loaded->ranks) {
      auto held = TensorsOf(rank);
      EXPECT_TRUE(held.at("a.o_proj.weight").empty());
      EXPECT_TRUE(held.at("a.q_proj.weight").empty());
    }
  }
}

TEST(Sharding, PlansThatCannotBeServedFailBeforeAnyWeightByteIsRead) {
  testing::TempDir dir;
  auto write = [&](const std::string& name, std::vector<transform::SourceTensor> specs) {
    std::vector<format::TensorData> tensors;
    for (auto& s : specs) {
      tensors.push_back({{std::string(s.name), s.dtype, {s.shape.begin(), s.shape.end()}},
                         std::vector<std::byte>(s.bytes, std::byte{1})});
    }
    const std::string path = dir.Join(name);
    EXPECT_TRUE(format::WriteSafetensors(path, tensors).ok());
    return path;
  };
  struct Case {
    std::string path;
    int tp;
    std::string quant;
    std::string error;
  };
  const std::vector<Case> cases = {
      {write("odd.safetensors", {T("a.q_proj.weight", DType::kBF16, {100, 8})}), 3, "none",
       "column split: dim 0 (100) is not divisible by --tp-size 3"},
      {write("fp8.safetensors", {T("a.up_proj.weight", DType::kF8_E4M3, {384, 256}),
                                 T("a.up_proj.weight_scale_inv", DType::kF32, {3, 2})}),
       2, "fp8-block", "which cuts a 128x128 FP8 block"},
      {write("lonely.safetensors", {T("a.up_proj.weight_scale_inv", DType::kF32, {3, 2})}), 2,
       "none", "block scales without their weight"},
      {write("fused.safetensors", {T("l.self_attn.qkv_proj.weight", DType::kBF16, {96, 32}),
                                   T("l.self_attn.o_proj.weight", DType::kBF16, {32, 32})}),
       2, "none", "a fused projection"},
      {write("gptq.safetensors", {T("a.q_proj.qweight", DType::kI32, {16, 64}),
                                  T("a.q_proj.scales", DType::kF16, {1, 64})}),
       2, "none", "GPTQ/AWQ packed int4"},
  };
  for (const Case& c : cases) {
    RecordingFileSystem fs;
    loader::LoadOptions o;
    o.processing = Resolve(c.tp, "keep", c.quant);
    auto loaded = loader::LoadCheckpoint(fs, c.path, o);
    ASSERT_FALSE(loaded.ok()) << c.path;
    EXPECT_NE(loaded.error().message().find(c.error), std::string::npos)
        << loaded.error().message();
    // Only the length prefix and the header were read.
    auto ckpt = format::OpenCheckpoint(io::PosixFileSystem(), c.path);
    ASSERT_TRUE(ckpt.ok());
    const uint64_t data_offset = ckpt->shards[0].header.data_offset();
    ASSERT_FALSE(fs.reads().empty());
    for (const auto& r : fs.reads()) {
      EXPECT_LE(r.offset + r.bytes, data_offset) << c.path << ": read at " << r.offset;
    }
  }
}

}  // namespace
}  // namespace weightd
