// A plain text table for CLIs: columns sized to their widest cell.
#ifndef ZEROSHARD_COMMON_TABLE_H_
#define ZEROSHARD_COMMON_TABLE_H_

#include <string>
#include <vector>

namespace zeroshard {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void AddRow(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string ToString() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// 1536 -> "1.5 KiB".
std::string HumanBytes(double bytes);
// A loss for a table: "%.4f", or "NaN" / "inf" / "-inf" (a diverged step
// must not read as a number).
std::string FormatLoss(double loss);

}  // namespace zeroshard

#endif  // ZEROSHARD_COMMON_TABLE_H_
