#include "common/plan/plan_codec.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace zeroshard {
namespace {

void TensorToProto(const TensorSpec& tensor, v1::TensorSpec* proto) {
  proto->set_name(tensor.name);
  proto->mutable_shape()->Reserve(static_cast<int>(tensor.shape.size()));
  for (int64_t dim : tensor.shape) proto->add_shape(dim);
  proto->set_dtype(tensor.dtype);
  proto->set_unit(tensor.unit);
}

TensorSpec TensorFromProto(const v1::TensorSpec& proto) {
  TensorSpec tensor;
  tensor.name = proto.name();
  tensor.shape.assign(proto.shape().begin(), proto.shape().end());
  tensor.dtype = proto.dtype();
  tensor.unit = proto.unit();
  return tensor;
}

// JSON text of a value; invalid UTF-8 is replaced rather than thrown on.
std::string Dump(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

// A JSON string literal.
std::string Quote(const std::string& text) { return Dump(nlohmann::ordered_json(text)); }

}  // namespace

v1::ModelSpec ModelSpecToProto(const ModelSpec& spec) {
  v1::ModelSpec proto;
  proto.mutable_tensors()->Reserve(static_cast<int>(spec.tensors.size()));
  for (const TensorSpec& tensor : spec.tensors) TensorToProto(tensor, proto.add_tensors());
  return proto;
}

ModelSpec ModelSpecFromProto(const v1::ModelSpec& proto) {
  ModelSpec spec;
  spec.tensors.reserve(proto.tensors_size());
  for (const v1::TensorSpec& tensor : proto.tensors()) {
    spec.tensors.push_back(TensorFromProto(tensor));
  }
  return spec;
}

v1::PlanOptions PlanOptionsToProto(const PlanOptions& options) {
  v1::PlanOptions proto;
  proto.set_max_unit_bytes(options.max_unit_bytes);
  proto.set_alignment_elements(options.alignment_elements);
  proto.set_split_fraction(options.split_fraction);
  proto.set_row_chunk_ranks(options.row_chunk_ranks);
  proto.set_shard_group_size(options.shard_group_size);
  return proto;
}

PlanOptions PlanOptionsFromProto(const v1::PlanOptions& proto) {
  PlanOptions options;
  options.max_unit_bytes = proto.max_unit_bytes();
  options.alignment_elements = proto.alignment_elements();
  options.split_fraction = proto.split_fraction();
  options.row_chunk_ranks = proto.row_chunk_ranks();
  options.shard_group_size = proto.shard_group_size();
  return options;
}

v1::ShardPlan ShardPlanToProto(const ShardPlan& plan) {
  v1::ShardPlan proto;
  proto.set_version(plan.version);
  proto.set_world_size(plan.world_size);
  proto.set_hash(plan.hash);
  *proto.mutable_options() = PlanOptionsToProto(plan.options);
  proto.mutable_units()->Reserve(static_cast<int>(plan.units.size()));
  for (const ShardUnit& unit : plan.units) {
    v1::Unit* unit_proto = proto.add_units();
    unit_proto->set_name(unit.name);
    unit_proto->set_chunk_elements(unit.chunk_elements);
    unit_proto->mutable_tensors()->Reserve(static_cast<int>(unit.tensors.size()));
    for (const TensorSpec& tensor : unit.tensors) TensorToProto(tensor, unit_proto->add_tensors());
    unit_proto->mutable_pieces()->Reserve(static_cast<int>(unit.pieces.size()));
    for (const Piece& piece : unit.pieces) {
      v1::Piece* piece_proto = unit_proto->add_pieces();
      piece_proto->set_tensor(piece.tensor);
      piece_proto->set_row_begin(piece.row_begin);
      piece_proto->set_row_end(piece.row_end);
      piece_proto->set_rank(piece.rank);
      piece_proto->set_offset(piece.offset);
    }
  }
  return proto;
}

ShardPlan ShardPlanFromProto(const v1::ShardPlan& proto) {
  ShardPlan plan;
  plan.version = proto.version();
  plan.world_size = proto.world_size();
  plan.hash = proto.hash();
  plan.options = PlanOptionsFromProto(proto.options());
  plan.units.reserve(proto.units_size());
  for (const v1::Unit& unit_proto : proto.units()) {
    ShardUnit& unit = plan.units.emplace_back();
    unit.name = unit_proto.name();
    unit.chunk_elements = unit_proto.chunk_elements();
    unit.tensors.reserve(unit_proto.tensors_size());
    for (const v1::TensorSpec& tensor : unit_proto.tensors()) {
      unit.tensors.push_back(TensorFromProto(tensor));
    }
    unit.pieces.reserve(unit_proto.pieces_size());
    for (const v1::Piece& piece : unit_proto.pieces()) {
      unit.pieces.push_back(
          Piece{piece.tensor(), piece.row_begin(), piece.row_end(), piece.rank(), piece.offset()});
    }
  }
  return plan;
}

double PaddingOverhead(const ShardPlan& plan) {
  // Doubles: W * chunk may exceed int64 in sum, and the planner's 2^53-element
  // limit keeps the element total exact.
  double allocated = 0;
  double elements = 0;
  for (const ShardUnit& unit : plan.units) {
    // One shard group holds the model once (all W ranks without groups).
    allocated += static_cast<double>(plan.options.Groups(plan.world_size).size()) *
                 static_cast<double>(unit.chunk_elements);
    for (const TensorSpec& tensor : unit.tensors)
      elements += static_cast<double>(tensor.Elements());
  }
  return elements > 0 ? allocated / elements - 1 : 0;
}

std::string PlanToJson(const ShardPlan& plan) { return PlanToJson(plan, nullptr); }

std::string PlanToJson(const ShardPlan& plan, const nlohmann::ordered_json& extra) {
  size_t pieces = 0;
  for (const ShardUnit& unit : plan.units) pieces += unit.pieces.size();
  std::string out;
  out.reserve(256 + 80 * pieces);
  absl::StrAppend(&out, "{\"world_size\":", plan.world_size,
                  ",\"shard_group_size\":", plan.options.Groups(plan.world_size).size(),
                  ",\"plan_hash\":", Quote(plan.hash),
                  ",\"padding_overhead\":", nlohmann::json(PaddingOverhead(plan)).dump(),
                  ",\"units\":[");
  std::vector<std::string> quoted_names;  // the unit's tensor names, escaped once
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const ShardUnit& unit = plan.units[u];
    quoted_names.clear();
    for (const TensorSpec& tensor : unit.tensors) quoted_names.push_back(Quote(tensor.name));
    absl::StrAppend(&out, u == 0 ? "" : ",", "{\"name\":", Quote(unit.name),
                    ",\"chunk_elements\":", unit.chunk_elements, ",\"pieces\":[");
    for (size_t i = 0; i < unit.pieces.size(); ++i) {
      const Piece& p = unit.pieces[i];
      // A piece of a plan that skipped ValidatePlan may name no tensor.
      const bool known = p.tensor >= 0 && static_cast<size_t>(p.tensor) < quoted_names.size();
      absl::StrAppend(&out, i == 0 ? "" : ",",
                      "{\"tensor\":", known ? quoted_names[p.tensor] : "\"\"",
                      ",\"row_begin\":", p.row_begin, ",\"row_end\":", p.row_end,
                      ",\"rank\":", p.rank, ",\"offset\":", p.offset, "}");
    }
    out += "]}";
  }
  out += "]";
  if (extra.is_object()) {
    for (auto it = extra.begin(); it != extra.end(); ++it) {
      absl::StrAppend(&out, ",", Quote(it.key()), ":", Dump(it.value()));
    }
  }
  out += "}";
  return out;
}

}  // namespace zeroshard
