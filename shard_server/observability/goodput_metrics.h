// The goodput ledger's series on /metrics (docs/goodput.md): each job's
// seconds by cause, its goodput and its MFU, from JobStatus.goodput.
#ifndef ZEROSHARD_SHARD_SERVER_OBSERVABILITY_GOODPUT_METRICS_H_
#define ZEROSHARD_SHARD_SERVER_OBSERVABILITY_GOODPUT_METRICS_H_

#include <string>
#include <vector>

#include "proto/zeroshard.pb.h"

namespace zeroshard {

// Appends zeroshard_job_seconds_total{job,cause} (productive as
// cause="productive"), zeroshard_job_goodput_ratio{job} and
// zeroshard_job_mfu_ratio{job} (-1: not known yet) in the Prometheus text
// format. `job_labels[j]` is `job="<id>"` of status.jobs(j).
void WriteGoodputFamilies(const v1::GetStatusResponse& status,
                          const std::vector<std::string>& job_labels, std::string* out);

}  // namespace zeroshard

#endif  // ZEROSHARD_SHARD_SERVER_OBSERVABILITY_GOODPUT_METRICS_H_
