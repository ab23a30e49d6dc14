// absl::Status to grpc::Status at the edge: the codes are the same numbers,
// and the message goes along unchanged.
#ifndef ZEROSHARD_SHARD_SERVER_BASE_GRPC_STATUS_H_
#define ZEROSHARD_SHARD_SERVER_BASE_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"

namespace zeroshard {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_BASE_GRPC_STATUS_H_
