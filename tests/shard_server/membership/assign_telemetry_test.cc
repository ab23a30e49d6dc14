#include "shard_server/membership/assign_telemetry.h"

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

// Counts the test binary's allocations (this operator new replaces the
// global one for libprotobuf's allocations too): what AssignTelemetry is for.
namespace {
std::atomic<int64_t> allocations{0};
}  // namespace

void* operator new(size_t size) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace zeroshard {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::util::MessageDifferencer;

// Sets every field of `m` and of its sub-messages, through reflection, to a
// value made from `seed`: a field added to the proto later is covered too.
void FillEveryField(int seed, Message* m) {
  const google::protobuf::Descriptor* d = m->GetDescriptor();
  const google::protobuf::Reflection* r = m->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const int v = seed * 100 + i + 1;
    if (f->is_repeated()) {
      ADD_FAILURE() << f->full_name() << " is repeated: the test does not fill it yet";
      continue;
    }
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE:
        FillEveryField(seed, r->MutableMessage(m, f));
        break;
      case FieldDescriptor::CPPTYPE_INT32: r->SetInt32(m, f, v); break;
      case FieldDescriptor::CPPTYPE_INT64: r->SetInt64(m, f, int64_t{v} << 33); break;
      case FieldDescriptor::CPPTYPE_UINT32: r->SetUInt32(m, f, static_cast<uint32_t>(v)); break;
      case FieldDescriptor::CPPTYPE_UINT64: r->SetUInt64(m, f, static_cast<uint64_t>(v) << 33); break;
      case FieldDescriptor::CPPTYPE_FLOAT: r->SetFloat(m, f, v + 0.5f); break;
      case FieldDescriptor::CPPTYPE_DOUBLE: r->SetDouble(m, f, v + 0.25); break;
      case FieldDescriptor::CPPTYPE_BOOL: r->SetBool(m, f, true); break;
      case FieldDescriptor::CPPTYPE_ENUM:
        r->SetEnumValue(m, f, f->enum_type()->value(f->enum_type()->value_count() - 1)->number());
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        // Longer than the small-string buffer: a heap allocation to keep.
        r->SetString(m, f, absl::StrCat("transformer.h.", v, ".attention.c_attn"));
        break;
    }
  }
}

v1::RankTelemetry Filled(int seed) {
  v1::RankTelemetry t;
  FillEveryField(seed, &t);
  return t;
}

TEST(AssignTelemetryTest, TheResultEqualsTheSourceWhateverWasThere) {
  v1::RankTelemetry no_subs = Filled(3);
  no_subs.clear_memory();
  no_subs.clear_in_progress();
  v1::RankTelemetry only_progress = Filled(4);
  only_progress.clear_memory();
  const v1::RankTelemetry sources[] = {Filled(1), Filled(2), no_subs, only_progress,
                                       v1::RankTelemetry()};
  for (const v1::RankTelemetry& before : sources) {
    for (const v1::RankTelemetry& from : sources) {
      v1::RankTelemetry to = before;
      AssignTelemetry(from, &to);
      EXPECT_TRUE(MessageDifferencer::Equals(to, from))
          << "from:\n" << from.DebugString() << "onto:\n" << before.DebugString() << "got:\n"
          << to.DebugString();
      EXPECT_EQ(to.has_memory(), from.has_memory());
      EXPECT_EQ(to.has_in_progress(), from.has_in_progress());
    }
  }
}

// What it is for: a beat onto a member's telemetry allocates nothing (`*to =
// from` allocated 4 times: the sub-messages and the unit name's string).
TEST(AssignTelemetryTest, AllocatesNothingWhenTheSubMessagesAreThere) {
  v1::RankTelemetry to = Filled(1);
  const v1::RankTelemetry from = Filled(2);
  const int64_t before = allocations.load();
  AssignTelemetry(from, &to);
  EXPECT_EQ(allocations.load() - before, 0);
  EXPECT_TRUE(MessageDifferencer::Equals(to, from));
}

// The largest telemetry a worker sends: a collective in progress with the
// longest unit name kept, every counter, and the time ledger of the first
// ranks (every field, at FLOP counts' magnitude) is within the bound.
TEST(AssignTelemetryTest, AFullBeatWithATimeLedgerIsWithinTheBounds) {
  v1::HeartbeatRequest beat;
  FillEveryField(9, beat.mutable_telemetry());
  beat.mutable_telemetry()->mutable_in_progress()->set_unit(std::string(kMaxUnitNameBytes, 'u'));
  v1::TimeLedger* time = beat.mutable_telemetry()->mutable_time();
  time->set_model_flops(1.234567e21);
  time->set_peak_flop_budget(9.87654321e21);
  EXPECT_TRUE(ValidateBeatPayload(beat).ok()) << beat.telemetry().ByteSizeLong() << " bytes";
  time->set_restore(-0.5);
  const absl::Status refused = ValidateBeatPayload(beat);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("HeartbeatRequest.telemetry.time.restore is -0.5"),
            std::string::npos)
      << refused;
}

}  // namespace
}  // namespace zeroshard
