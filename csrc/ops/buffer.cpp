// get_buffer_layout op and the buffer checks every op shares.
#include "ops/ops.hpp"

namespace megamoe {

namespace {

void check_config(int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens_per_rank,
                  int64_t top_k, int64_t hidden, int64_t intermediate) {
  MEGAMOE_CHECK_POSITIVE(num_experts, "num_experts");
  MEGAMOE_CHECK_POSITIVE(num_ranks, "num_ranks");
  TORCH_CHECK_VALUE(num_ranks <= layout::kMaxRanks, "num_ranks: expected at most ", layout::kMaxRanks,
                    " (the EP barriers take one thread of a block per rank), got ", num_ranks);
  TORCH_CHECK_VALUE(rank >= 0 && rank < num_ranks, "rank: expected a value in [0, ", num_ranks,
                    "), got ", rank);
  MEGAMOE_CHECK_MULTIPLE(num_experts, "num_experts (experts split evenly over num_ranks)", num_ranks);
  TORCH_CHECK_VALUE(max_tokens_per_rank >= 0, "max_tokens_per_rank: expected a value >= 0, got ",
                    max_tokens_per_rank);
  MEGAMOE_CHECK_POSITIVE(top_k, "top_k");
  TORCH_CHECK_VALUE(top_k <= num_experts, "top_k: expected a value <= num_experts (", num_experts,
                    "), got ", top_k);
  // num_ranks <= 128 and top_k <= num_experts keep the divisor positive and this test free of overflow
  TORCH_CHECK_VALUE(max_tokens_per_rank <= layout::kMaxPoolRows / (num_ranks * top_k),
                    "max_tokens_per_rank: expected num_ranks x max_tokens_per_rank x top_k <= ", layout::kMaxPoolRows,
                    " (the kernels number the pool's rows in int32), got ", num_ranks, " x ", max_tokens_per_rank,
                    " x ", top_k);
  MEGAMOE_CHECK_POSITIVE(hidden, "hidden");
  MEGAMOE_CHECK_MULTIPLE(hidden, "hidden", 128);
  MEGAMOE_CHECK_POSITIVE(intermediate, "intermediate");
  MEGAMOE_CHECK_MULTIPLE(intermediate, "intermediate", 128);
}

}  // namespace

at::Tensor get_buffer_layout(int64_t num_experts, int64_t num_ranks, int64_t max_tokens_per_rank,
                             int64_t top_k, int64_t hidden, int64_t intermediate,
                             c10::string_view act_format) {
  const auto act = parse_act_format(act_format);
  check_config(num_experts, num_ranks, 0, max_tokens_per_rank, top_k, hidden, intermediate);
  const auto l = layout::BufferLayout::make(num_experts, num_ranks, max_tokens_per_rank, top_k, hidden,
                                            intermediate, act == ActFormat::kFP4);
  std::vector<int64_t> fields;
#define MEGAMOE_PUSH_FIELD(name) fields.push_back(l.name);
  MEGAMOE_BUFFER_LAYOUT_FIELDS(MEGAMOE_PUSH_FIELD)
#undef MEGAMOE_PUSH_FIELD
  return at::tensor(fields, at::kLong);
}

BufferArgs check_buffer(const at::Tensor& buffer, int64_t num_experts, int64_t num_ranks, int64_t rank,
                        int64_t max_tokens_per_rank, int64_t top_k, int64_t hidden,
                        int64_t intermediate, ActFormat act_format) {
  check_config(num_experts, num_ranks, rank, max_tokens_per_rank, top_k, hidden, intermediate);
  BufferArgs b;
  b.layout = layout::BufferLayout::make(num_experts, num_ranks, max_tokens_per_rank, top_k, hidden,
                                        intermediate, act_format == ActFormat::kFP4);
  b.rank = rank;
  MEGAMOE_CHECK_DTYPE(buffer, "buffer", at::kByte);
  MEGAMOE_CHECK_DIM(buffer, "buffer", 1);
  MEGAMOE_CHECK_CONTIGUOUS(buffer, "buffer");
  TORCH_CHECK_VALUE(buffer.numel() >= b.layout.total_bytes, "buffer: expected at least ",
                    b.layout.total_bytes, " bytes for this configuration (act_format '",
                    to_string(act_format), "'), got ", buffer.numel(),
                    "; allocate it with megamoe.get_symm_buffer for the same sizes");
  // TMA needs 16-byte aligned global addresses; regions sit at 128-byte offsets from the start.
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(buffer.data_ptr()) % 16 == 0,
                    "buffer: expected a 16-byte aligned start (a fresh allocation), got address ",
                    buffer.data_ptr());
  return b;
}

at::Tensor buffer_view(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes,
                       at::ScalarType dtype) {
  int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  return buffer.narrow(0, offset, bytes).view(dtype).view(sizes);
}

}  // namespace megamoe
