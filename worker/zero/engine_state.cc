// ZeroEngine's state in and out (engine.h): Initialize and the moments from
// row sources (a fresh start, a checkpoint, a recovery), and this rank's
// pieces visited for checkpoints and snapshots.
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/plan/shard_groups.h"
#include "worker/zero/engine.h"
#include "worker/zero/engine_internal.h"

namespace zeroshard {

using engine_internal::Bytes;

absl::Status ZeroEngine::FillRows(const RowSource& fill, const TensorSpec& tensor,
                                  int64_t row_begin, int64_t row_end, float* target) {
  if (backend_->host_accessible()) return fill(tensor, row_begin, row_end, target);
  std::vector<float> host((row_end - row_begin) * tensor.RowElements());
  if (absl::Status s = fill(tensor, row_begin, row_end, host.data()); !s.ok()) return s;
  return backend_->CopyFromHost(target, host.data(), host.size() * sizeof(float));
}

absl::Status ZeroEngine::Initialize(const RowSource& fill) {
  ReleaseHeldParameters();
  const bool bf16_params = options_.param_dtype == DType::kBF16;
  // Gathers a Step issued early would read the values about to be replaced.
  if (absl::Status s = gather_thread_->Drain(); !s.ok()) return s;
  slots_.clear();
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    UnitState& state = *state_[u];
    state.secondary_fresh = false;  // rebuilt by the next forward's gather
    if (stage_.params_sharded) {
      for (int i : layout.own_segments) {
        const Segment& s = layout.segments[i];
        absl::Status st = FillRows(fill, layout.tensors[s.tensor], s.row_begin, s.row_end,
                                   state.master.f32() + s.chunk_offset);
        if (!st.ok()) return st;
      }
      continue;
    }
    // Stages 0-2 hold every row: f32 in a temporary, then the replicated
    // parameters (param dtype) and, with bf16, the f32 master.
    TrackedBuffer flat(&memory_, MemoryCategory::kCommBuffers,
                       Bytes(layout.flat_elements, DType::kF32), /*zero=*/false);
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      absl::Status st = FillRows(fill, layout.tensors[t], 0, layout.tensors[t].Rows(),
                                 flat.f32() + layout.tensor_offsets[t]);
      if (!st.ok()) return st;
    }
    backend_->Convert(flat.data(), DType::kF32, state.replicated.data(), options_.param_dtype,
                      layout.flat_elements);
    if (bf16_params) {
      if (!stage_.state_sharded) {
        backend_->Copy(state.master.data(), flat.data(), flat.bytes());
      } else {
        PackOwn(layout, flat.f32(), state.master.f32());
      }
    }
  }
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  return ResetOuterState();  // DiLoCo: these parameters are the anchor
}

absl::Status ZeroEngine::InitializeMoment(Moment moment, const RowSource& fill) {
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    Optimizer& opt = *state_[u]->optimizer;
    float* target = moment == Moment::kExpAvg ? opt.exp_avg() : opt.exp_avg_sq();
    if (target == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("optimizer '", opt.name(), "' keeps no ",
                       moment == Moment::kExpAvg ? "exp_avg" : "exp_avg_sq", " state to load"));
    }
    if (!stage_.state_sharded) {  // replicated: every row, flat layout
      for (size_t t = 0; t < layout.tensors.size(); ++t) {
        absl::Status st = FillRows(fill, layout.tensors[t], 0, layout.tensors[t].Rows(),
                                   target + layout.tensor_offsets[t]);
        if (!st.ok()) return st;
      }
      continue;
    }
    for (int i : layout.own_segments) {
      const Segment& s = layout.segments[i];
      absl::Status st =
          FillRows(fill, layout.tensors[s.tensor], s.row_begin, s.row_end, target + s.chunk_offset);
      if (!st.ok()) return st;
    }
  }
  return backend_->Synchronize();
}

TrackedBuffer& ZeroEngine::MasterShard(int unit) { return state_[unit]->master; }

void ZeroEngine::MarkSecondaryStale(int unit) { state_[unit]->secondary_fresh = false; }

int ZeroEngine::replica_peer() const { return ShardGroups(world_, group_size_).NextReplica(rank_); }

absl::Status ZeroEngine::ForEachOwnPiece(const std::function<absl::Status(const PieceView&)>& visit,
                                         bool with_replica_peer) {
  const bool bf16_params = options_.param_dtype == DType::kBF16;
  if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
  std::vector<std::vector<float>> host;  // staging, device backends only
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    UnitState& st = *state_[u];
    std::vector<const Segment*> pieces;
    for (const Segment& seg : layout.saved) pieces.push_back(&seg);
    if (with_replica_peer) {
      for (const Segment& seg : layout.replica_peer_saved) pieces.push_back(&seg);
    }
    for (const Segment* piece : pieces) {
      const Segment& seg = *piece;
      PieceView view;
      view.tensor = &layout.tensors[seg.tensor];
      view.row_begin = seg.row_begin;
      view.row_end = seg.row_end;
      view.elements = seg.length;
      // Where the piece's master values and moments live.
      int64_t state_offset = !stage_.state_sharded ? seg.flat_offset : seg.chunk_offset;
      if (stage_.params_sharded || bf16_params) {
        view.params = st.master.f32() + state_offset;
      } else {
        view.params = st.replicated.f32() + seg.flat_offset;
      }
      float* m = st.optimizer->exp_avg();
      float* v = st.optimizer->exp_avg_sq();
      view.exp_avg = m ? m + state_offset : nullptr;
      view.exp_avg_sq = v ? v + state_offset : nullptr;
      // DiLoCo runs at stages 1-3: its state is chunked like the master.
      float* anchor = st.anchor.empty() ? nullptr : st.anchor.f32();
      float* momentum = st.outer_optimizer ? st.outer_optimizer->exp_avg() : nullptr;
      view.outer_anchor = anchor ? anchor + seg.chunk_offset : nullptr;
      view.outer_momentum = momentum ? momentum + seg.chunk_offset : nullptr;
      if (!backend_->host_accessible()) {
        // Device memory: the visitor sees host copies.
        const int64_t bytes = seg.length * static_cast<int64_t>(sizeof(float));
        for (float** p : {&view.params, &view.exp_avg, &view.exp_avg_sq, &view.outer_anchor,
                          &view.outer_momentum}) {
          if (*p == nullptr) continue;
          host.emplace_back(seg.length);
          if (absl::Status s = backend_->CopyToHost(host.back().data(), *p, bytes); !s.ok()) {
            return s;
          }
          *p = host.back().data();
        }
      }
      absl::Status s = visit(view);
      host.clear();
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::Status ZeroEngine::InitializeOuterState(const RowSource& anchor, const RowSource* momentum,
                                              int64_t outer_steps) {
  if (!diloco()) {
    return absl::FailedPreconditionError(
        "InitializeOuterState is DiLoCo's (--sync=diloco); this engine has no outer state");
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitLayout& layout = units_[u];
    UnitState& st = *state_[u];
    Optimizer& outer = *st.outer_optimizer;
    float* buffer = outer.exp_avg();
    if (momentum != nullptr && buffer == nullptr) {
      return absl::FailedPreconditionError(
          "the outer SGD keeps no momentum buffer (--outer_momentum=0) to load");
    }
    // The chunk's padding stays zero: its outer gradient is zero.
    if (buffer != nullptr) backend_->Zero(buffer, Bytes(layout.chunk_elements, DType::kF32));
    for (int i : layout.own_segments) {
      const Segment& s = layout.segments[i];
      const TensorSpec& tensor = layout.tensors[s.tensor];
      absl::Status filled =
          FillRows(anchor, tensor, s.row_begin, s.row_end, st.anchor.f32() + s.chunk_offset);
      if (filled.ok() && momentum != nullptr) {
        filled = FillRows(*momentum, tensor, s.row_begin, s.row_end, buffer + s.chunk_offset);
      }
      if (!filled.ok()) return filled;
    }
    // SGD's step 0 marks its momentum buffer as not yet filled (optimizer.h).
    outer.set_step(momentum != nullptr ? outer_steps : 0);
  }
  outer_steps_ = outer_steps;
  return backend_->Synchronize();
}

int64_t ZeroEngine::optimizer_step() const {
  return state_.empty() ? 0 : state_[0]->optimizer->step();
}

void ZeroEngine::set_optimizer_step(int64_t step) {
  for (auto& s : state_) s->optimizer->set_step(step);
}

}  // namespace zeroshard
