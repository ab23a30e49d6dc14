#include "common/model_spec.h"

#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TensorSpec Tensor(std::string name, std::vector<int64_t> shape, std::string dtype = "F32",
                  std::string unit = "") {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.dtype = std::move(dtype);
  t.unit = std::move(unit);
  return t;
}

// The status message must contain every one of `parts`.
void ExpectError(absl::string_view json, std::vector<std::string> parts) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpecJson(json);
  ASSERT_FALSE(spec.ok()) << json;
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& part : parts) {
    EXPECT_NE(spec.status().message().find(part), std::string::npos)
        << "message \"" << spec.status().message() << "\" lacks \"" << part << "\"";
  }
}

TEST(TensorSpecTest, RowsAndElements) {
  TensorSpec matrix = Tensor("w", {2000, 3000});
  EXPECT_EQ(matrix.Rows(), 2000);
  EXPECT_EQ(matrix.RowElements(), 3000);
  EXPECT_EQ(matrix.Elements(), 6000000);
  TensorSpec vector = Tensor("b", {7});
  EXPECT_EQ(vector.Rows(), 7);
  EXPECT_EQ(vector.RowElements(), 1);
  EXPECT_EQ(vector.Elements(), 7);
  TensorSpec scalar = Tensor("s", {});
  EXPECT_EQ(scalar.Rows(), 1);
  EXPECT_EQ(scalar.RowElements(), 1);
  EXPECT_EQ(scalar.Elements(), 1);
  TensorSpec cube = Tensor("c", {3, 4, 5});
  EXPECT_EQ(cube.Rows(), 3);
  EXPECT_EQ(cube.RowElements(), 20);
  EXPECT_EQ(cube.Elements(), 60);
  TensorSpec empty = Tensor("e", {0, 5});
  EXPECT_EQ(empty.Rows(), 0);
  EXPECT_EQ(empty.RowElements(), 5);
  EXPECT_EQ(empty.Elements(), 0);
}

TEST(ModelSpecJsonTest, ParsesTheDocumentedForm) {
  absl::StatusOr<ModelSpec> spec = ParseModelSpecJson(
      R"({"tensors":[{"name":"0.weight","shape":[2000,2000],"dtype":"F32","unit":"0"},
                     {"name":"0.bias","shape":[2000],"dtype":"BF16","unit":"0"},
                     {"name":"scale","shape":[]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_EQ(spec->tensors.size(), 3u);
  EXPECT_EQ(spec->tensors[0].name, "0.weight");
  EXPECT_EQ(spec->tensors[0].shape, (std::vector<int64_t>{2000, 2000}));
  EXPECT_EQ(spec->tensors[0].unit, "0");
  EXPECT_EQ(spec->tensors[1].dtype, "BF16");
  // dtype and unit are optional.
  EXPECT_EQ(spec->tensors[2].dtype, "F32");
  EXPECT_EQ(spec->tensors[2].unit, "");
  EXPECT_TRUE(spec->tensors[2].shape.empty());
}

TEST(ModelSpecJsonTest, RoundTrips) {
  ModelSpec spec;
  spec.tensors = {Tensor("transformer.wte.weight", {50257, 768}, "F32", "embed"),
                  Tensor("scalar", {}, "F16", ""), Tensor("odd \"name\"\n", {0, 3}, "BF16", "u"),
                  Tensor("big", {int64_t{1} << 40, 1}, "F32", "x")};
  const std::string json = ModelSpecToJson(spec);
  absl::StatusOr<ModelSpec> parsed = ParseModelSpecJson(json);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << json;
  ASSERT_EQ(parsed->tensors.size(), spec.tensors.size());
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    EXPECT_EQ(parsed->tensors[i].name, spec.tensors[i].name);
    EXPECT_EQ(parsed->tensors[i].shape, spec.tensors[i].shape);
    EXPECT_EQ(parsed->tensors[i].dtype, spec.tensors[i].dtype);
    EXPECT_EQ(parsed->tensors[i].unit, spec.tensors[i].unit);
  }
  EXPECT_EQ(ModelSpecToJson(*parsed), json);
  EXPECT_EQ(ModelSpecToJson(ModelSpec{}), R"({"tensors":[]})");
}

TEST(ModelSpecJsonTest, StructuralOnly) {
  // Semantic problems (negative dims, duplicate names, unknown dtypes) are the
  // planner's to report.
  absl::StatusOr<ModelSpec> spec = ParseModelSpecJson(
      R"({"tensors":[{"name":"a","shape":[-1],"dtype":"F99"},{"name":"a","shape":[1]}]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->tensors[0].shape[0], -1);
}

TEST(ModelSpecJsonTest, Errors) {
  ExpectError("", {"not valid JSON"});
  ExpectError("{\"tensors\":[", {"not valid JSON"});
  ExpectError("[]", {"expected a JSON object", "a JSON array"});
  ExpectError("{}", {"\"tensors\" is missing"});
  ExpectError(R"({"tensors":{}})", {"\"tensors\" is a JSON object", "expected an array"});
  ExpectError(R"({"tensors":[], "extra":1})", {"unknown top-level field \"extra\""});
  ExpectError(R"({"tensors":[{"name":"a","shape":[1]}, 5]})",
              {"tensor 1", "expected an object", "got 5"});
  ExpectError(R"({"tensors":[{"shape":[1]}]})", {"tensor 0", "\"name\" is missing"});
  ExpectError(R"({"tensors":[{"name":3,"shape":[1]}]})",
              {"tensor 0", "\"name\" is 3", "expected a string"});
  ExpectError(R"({"tensors":[{"name":"a","shape":[1]},{"name":"b"}]})",
              {"tensor 1 (\"b\")", "\"shape\" is missing", "expected an array of integers"});
  ExpectError(R"({"tensors":[{"name":"b","shape":"2x2"}]})",
              {"tensor 0 (\"b\")", "\"shape\" is \"2x2\""});
  ExpectError(R"({"tensors":[{"name":"w","shape":[2,2.5]}]})",
              {"tensor 0 (\"w\")", "shape[1] is 2.5", "expected a 64-bit integer"});
  ExpectError(R"({"tensors":[{"name":"w","shape":[18446744073709551615]}]})",
              {"shape[0] is 18446744073709551615"});
  ExpectError(R"({"tensors":[{"name":"w","shape":[2],"dtype":32}]})",
              {"tensor 0 (\"w\")", "\"dtype\" is 32", "expected a string"});
  ExpectError(R"({"tensors":[{"name":"w","shape":[2],"unit":null}]})",
              {"\"unit\" is null", "expected a string"});
  ExpectError(R"({"tensors":[{"name":"w","shape":[2],"shap":[2]}]})",
              {"tensor 0 (\"w\")", "unknown field \"shap\""});
}

}  // namespace
}  // namespace zeroshard
