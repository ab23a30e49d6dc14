// The container image (deploy/container/build.sh) under podman, run the way
// deploy/k8s runs it: the server's and the workers' containers take their
// command, args, env, volume mounts and security settings from the manifests
// (parsed from the YAML here, never copied), each container on an emulated
// host (tests/testing/emulated_hosts.h: its own address; the Service name
// zeroshard-server resolves to host0, as the cluster's DNS would).
//
//   - build.sh builds the image from the test's binaries (its one command,
//     in a podman store of the test's own);
//   - the server container turns healthy (the image's HEALTHCHECK, the gRPC
//     health service); the workers' init container waits for it and exits 0;
//   - a node agent container on worker 0's host carries its stream to the
//     server (its command line is the test's: no manifest runs an agent);
//   - two worker containers train; one is killed (SIGKILL) mid-run and a
//     replacement with the same completion index is started, as the Indexed
//     Job would; the run finishes on both, and the server consolidates the
//     last checkpoint.
//
// The manifests' training flags are for GPUs (NCCL, a 12-layer GPT): flags
// appended after them (the last occurrence wins) shrink the run to CPUs and 2
// workers. Needs root, podman and runc (tools/install_deps.sh); skips saying
// so otherwise, and fails under CI=true.
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/emulated_hosts.h"
#include "tests/testing/process.h"

namespace zeroshard::testing {
namespace {

using nlohmann::json;

std::string ShellQuote(const std::string& s) {
  return absl::StrCat("'", absl::StrReplaceAll(s, {{"'", "'\\''"}}), "'");
}

bool Poll(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (condition()) return true;
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(500));
  }
}

void Note(const std::string& what) {
  std::cerr << absl::FormatTime("%H:%M:%E3S ", absl::Now(), absl::UTCTimeZone()) << what
            << std::endl;
}

std::string Missing() {
  if (geteuid() != 0) return "the podman test needs root (a podman store, network namespaces)";
  std::vector<std::string> missing;
  for (const char* tool : {"/usr/bin/podman", "/usr/sbin/runc", "/usr/bin/runc", "/usr/bin/etcd"}) {
    if (access(tool, X_OK) == 0) continue;
    if (absl::EndsWith(tool, "/runc") &&
        (access("/usr/sbin/runc", X_OK) == 0 || access("/usr/bin/runc", X_OK) == 0)) {
      continue;
    }
    missing.push_back(tool);
  }
  if (missing.empty()) return "";
  return absl::StrCat("the podman test needs ", absl::StrJoin(missing, ", "),
                      " (podman, runc, etcd-server): run tools/install_deps.sh");
}

// Every document of a YAML file, as JSON (PyYAML: python3-yaml).
std::vector<json> LoadYaml(const std::string& path) {
  auto [code, output] = RunCommand(
      "/usr/bin/python3 -c 'import json, sys, yaml; "
      "print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))' " +
      path + " 2>&1");
  EXPECT_EQ(code, 0) << output;
  json docs = json::parse(output, nullptr, /*allow_exceptions=*/false);
  return docs.is_array() ? docs.get<std::vector<json>>() : std::vector<json>();
}

// The pod template of the manifest of `kind` in `docs`.
json PodSpec(const std::vector<json>& docs, const std::string& kind) {
  for (const json& d : docs) {
    if (d.value("kind", "") == kind) return d["spec"]["template"]["spec"];
  }
  ADD_FAILURE() << "no " << kind << " in the manifest";
  return json::object();
}

json ContainerNamed(const json& pod, const std::string& group, const std::string& name) {
  for (const json& c : pod.value(group, json::array())) {
    if (c.value("name", "") == name) return c;
  }
  ADD_FAILURE() << "no " << group << " named " << name;
  return json::object();
}

// A podman store, image and containers of this test's own, removed at the end.
class Podman {
 public:
  Podman() {
    // Stores of runs whose process is gone (a crashed test): their containers
    // stopped and removed, the store reset and deleted.
    RunCommand(
        "for d in /tmp/zspodman-*-*; do p=${d#/tmp/zspodman-}; p=${p%%-*}; "
        "[ -d \"$d\" ] && ! kill -0 \"$p\" 2>/dev/null || continue; "
        "P=\"podman --root $d/storage --runroot $d/run --runtime runc --cgroup-manager cgroupfs\"; "
        "$P rm -af -t 0; $P system reset --force; rm -rf \"$d\"; done >/dev/null 2>&1");
    // Short: conmon's socket paths must fit in 108 bytes.
    std::string dir = absl::StrCat("/tmp/zspodman-", getpid(), "-XXXXXX");
    dir_ = mkdtemp(dir.data()) != nullptr ? dir : "/tmp/zspodman-failed";
  }
  ~Podman() {
    for (const std::string& name : containers_) Run("rm -f -t 0 " + name);
    Run("system reset --force");
    RunCommand("rm -rf " + dir_);
  }
  const std::string& dir() const { return dir_; }
  std::string Command() const {
    // crun refuses this machine's cgroups; runc + cgroupfs. Limits passed
    // explicitly: podman's defaults are above what runc may set here.
    return absl::StrCat("podman --root ", dir_, "/storage --runroot ", dir_,
                        "/run --runtime runc --cgroup-manager cgroupfs ");
  }
  std::pair<int, std::string> Run(const std::string& args) {
    return RunCommand(Command() + args + " 2>&1");
  }
  void Track(const std::string& name) { containers_.push_back(name); }
  static std::string Limits() {
    return absl::StrCat("--ulimit nofile=", sysconf(_SC_OPEN_MAX), ":", sysconf(_SC_OPEN_MAX),
                        " --ulimit nproc=4096:4096 ");
  }

 private:
  std::string dir_;
  std::vector<std::string> containers_;
};

// `podman run` arguments for container `c` of pod `pod`, as Kubernetes would
// run it: command + args with $(VAR) from its env (fieldRef values given in
// `field_env`), the volumes at their mountPaths (a directory of `volumes` per
// volume name; emptyDir volumes become tmpfs), the security context.
std::string RunArgs(const json& pod, const json& c,
                    const std::map<std::string, std::string>& field_env,
                    const std::map<std::string, std::string>& volumes,
                    const std::vector<std::string>& extra_args) {
  std::map<std::string, std::string> env = field_env;
  std::string out;
  for (const json& e : c.value("env", json::array())) {
    const std::string name = e["name"];
    if (e.contains("value")) env[name] = e["value"];
    EXPECT_TRUE(env.count(name)) << "no value for env " << name;
    absl::StrAppend(&out, "-e ", ShellQuote(name + "=" + env[name]), " ");
  }
  std::map<std::string, json> pod_volumes;
  for (const json& v : pod.value("volumes", json::array())) pod_volumes[v["name"]] = v;
  for (const json& m : c.value("volumeMounts", json::array())) {
    const std::string name = m["name"], path = m["mountPath"];
    if (pod_volumes.count(name) && pod_volumes[name].contains("emptyDir")) {
      absl::StrAppend(&out, "--tmpfs ", path, ":mode=1777 ");
      continue;
    }
    EXPECT_TRUE(volumes.count(name)) << "no directory for volume " << name;
    absl::StrAppend(&out, "-v ", volumes.at(name), ":", path,
                    m.value("readOnly", false) ? ":ro" : "", " ");
  }
  const json psc = pod.value("securityContext", json::object());
  if (psc.contains("runAsUser")) {
    absl::StrAppend(&out, "--user ", psc["runAsUser"].get<int>(), ":",
                    psc.value("runAsGroup", psc["runAsUser"].get<int>()), " ");
  }
  const json sc = c.value("securityContext", json::object());
  if (sc.value("readOnlyRootFilesystem", false)) absl::StrAppend(&out, "--read-only ");
  if (!sc.value("allowPrivilegeEscalation", true)) {
    absl::StrAppend(&out, "--security-opt no-new-privileges ");
  }
  for (const json& cap : sc.value("capabilities", json::object()).value("drop", json::array())) {
    absl::StrAppend(&out, "--cap-drop ", cap.get<std::string>(), " ");
  }
  std::vector<std::string> argv;
  for (const json& a : c.value("command", json::array())) argv.push_back(a);
  for (const json& a : c.value("args", json::array())) argv.push_back(a);
  for (const std::string& a : extra_args) argv.push_back(a);
  EXPECT_FALSE(argv.empty()) << c.dump();
  std::string entry = argv.empty() ? "" : argv[0];
  std::string rest;
  for (size_t i = 1; i < argv.size(); ++i) {
    std::string arg = argv[i];
    for (const auto& [name, value] : env) {
      arg = absl::StrReplaceAll(arg, {{"$(" + name + ")", value}});
    }
    absl::StrAppend(&rest, ShellQuote(arg), " ");
  }
  // The manifest's image: "zeroshard:latest", which build.sh tags.
  return absl::StrCat(out, "--entrypoint ", ShellQuote(entry), " ",
                      ShellQuote(c.value("image", "")), " ", rest);
}

// The training flags for CPUs and 2 workers, after the manifest's own.
const std::vector<std::string>& CpuRun() {
  static const auto* flags =
      new std::vector<std::string>{"--world_size=2",
                                   "--backend=gloo",
                                   "--layers=2",
                                   "--heads=2",
                                   "--d_model=32",
                                   "--context=32",
                                   "--steps=60",
                                   "--batch=4",
                                   "--warmup_steps=5",
                                   "--val_every=0",
                                   "--param_dtype=f32",
                                   "--reduce_dtype=f32",
                                   "--threads=1",
                                   "--checkpoint_every=10",
                                   "--test_step_delay_ms=100",
                                   "--collective_timeout=60s",
                                   "--report=/var/lib/zeroshard/checkpoints/report-{rank}.json"};
  return *flags;
}

class PodmanTest : public ::testing::Test {
 protected:
  // The image, by build.sh from this test's binaries, in the test's store.
  void BuildImage() {
    const std::string bin = tmp_ + "/bin";
    RunCommand("mkdir -p " + bin);
    for (const char* f :
         {"shard_server/shard_server", "worker/shard_worker", "client/shardctl",
          "agent/shard_agent", "python/zeroshard-0.1.0-cp311-cp311-linux_x86_64.whl"}) {
      RunCommand(absl::StrCat("ln -sf \"$(realpath ", RunfilePath(f), ")\" ", bin, "/"));
    }
    Note("building the image");
    auto [code, out] =
        RunCommand(absl::StrCat("/bin/bash ", RunfilePath("deploy/container/build.sh"),
                                " --bin_dir=", bin, " --podman_root=", podman_.dir(), " 2>&1"));
    ASSERT_EQ(code, 0) << out;
    Note("image built: " +
         std::string(absl::StripAsciiWhitespace(out.substr(out.rfind("build.sh:")))));
  }

  // The hosts, the volumes (the claims as directories owned by the pods'
  // user) and the pod templates of the manifests.
  void SetUpCluster() {
    auto hosts = EmulatedHosts::Create(3);
    ASSERT_TRUE(hosts.ok()) << hosts.status();
    hosts_ = *std::move(hosts);
    volumes_ = {{"state", tmp_ + "/state"},
                {"checkpoints", tmp_ + "/checkpoints"},
                {"auth", tmp_ + "/auth"}};
    for (const auto& [name, dir] : volumes_) RunCommand("mkdir -p " + dir);
    WriteFile(tmp_ + "/auth/token", "podman-test-token\n");
    RunCommand(absl::StrCat("mkdir -p ", agent_dir_, " && chown -R 65532:65532 ", tmp_, "/state ",
                            tmp_, "/checkpoints ", tmp_, "/auth ", agent_dir_, " && chmod 0600 ",
                            tmp_, "/auth/token"));
    server_pod_ = PodSpec(LoadYaml(RunfilePath("deploy/k8s/server.yaml")), "StatefulSet");
    worker_pod_ = PodSpec(LoadYaml(RunfilePath("deploy/k8s/workers.yaml")), "Job");
  }

  // A container on emulated host `host`; "zeroshard-server" resolves to
  // host0, as the Service's name would. The image's HEALTHCHECK is the
  // server's: the others run without it.
  std::pair<int, std::string> Start(const std::string& name, int host, const std::string& args,
                                    bool detach = true) {
    podman_.Track(name);
    return podman_.Run(
        absl::StrCat("run ", detach ? "-d " : "--rm ", "--name ", name, " --network ns:/run/netns/",
                     hosts_->netns(host), " --hostname ", name,
                     " --add-host zeroshard-server:", hosts_->address(0), " ", Podman::Limits(),
                     name == "zs-server" ? "" : "--no-healthcheck ", args));
  }

  // A node agent on host1 for worker 0 (docs/scale.md). No manifest runs one
  // (there is no DaemonSet), so its command line is written here.
  void StartAgent() {
    auto [code, out] =
        Start("zs-agent", 1,
              absl::StrCat("-v ", tmp_, "/auth:/etc/zeroshard/auth:ro -v ", agent_dir_,
                           ":/run/zeroshard --read-only --cap-drop ALL --entrypoint shard_agent "
                           "zeroshard:latest --server=zeroshard-server:7070 "
                           "--token_file=/etc/zeroshard/auth/token --insecure "
                           "--listen=unix:/run/zeroshard/agent.sock"));
    ASSERT_EQ(code, 0) << out;
    ASSERT_TRUE(Poll([&] { return access((agent_dir_ + "/agent.sock").c_str(), F_OK) == 0; },
                     absl::Seconds(30)))
        << podman_.Run("logs zs-agent").second;
  }

  // Pod `index` of the Indexed Job on host 1 + index. Worker 0 reaches the
  // server through the agent; worker 1 directly.
  std::pair<int, std::string> StartWorker(const std::string& name, int index) {
    std::vector<std::string> flags = CpuRun();
    std::string agent_mount;
    if (index == 0) {
      flags.push_back("--agent=unix:/run/zeroshard/agent.sock");
      agent_mount = absl::StrCat("-v ", agent_dir_, ":/run/zeroshard ");
    }
    const json worker = ContainerNamed(worker_pod_, "containers", "shard-worker");
    return Start(name, 1 + index,
                 agent_mount + RunArgs(worker_pod_, worker,
                                       {{"JOB_COMPLETION_INDEX", std::to_string(index)},
                                        {"POD_IP", hosts_->address(1 + index)}},
                                       volumes_, flags));
  }

  // shardctl in the server's container, with the manifests' token.
  std::pair<int, std::string> Shardctl(const std::string& args) {
    return podman_.Run(
        "exec zs-server shardctl --token_file=/etc/zeroshard/auth/token "
        "--insecure " +
        args);
  }

  bool HasCompleteCheckpoint() {
    for (absl::string_view line :
         absl::StrSplit(Shardctl("checkpoints --job=zeroshard-train").second, '\n')) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() >= 2 && f[1] == "yes") return true;
    }
    return false;
  }

  // The container's exit code from `podman wait`, bounded.
  std::string WaitExit(const std::string& name, int seconds) {
    return std::string(absl::StripAsciiWhitespace(
        RunCommand(absl::StrCat("timeout ", seconds, " ", podman_.Command(), "wait ", name))
            .second));
  }

  // Destroyed in reverse: the containers and the store go before the hosts.
  std::unique_ptr<EmulatedHosts> hosts_;
  Podman podman_;
  const std::string tmp_ = MakeTempDir("podman");
  const std::string agent_dir_ = tmp_ + "/agent";
  std::map<std::string, std::string> volumes_;
  json server_pod_, worker_pod_;
};

TEST_F(PodmanTest, TheManifestsContainersTrainSurviveAReplacedWorkerAndConsolidate) {
  if (std::string missing = Missing(); !missing.empty()) {
    const char* ci = getenv("CI");
    if (ci != nullptr && std::string(ci) == "true") FAIL() << missing;
    GTEST_SKIP() << missing;
  }
  ASSERT_NO_FATAL_FAILURE(BuildImage());
  ASSERT_NO_FATAL_FAILURE(SetUpCluster());

  auto [scode, sout] =
      Start("zs-server", 0,
            RunArgs(server_pod_, ContainerNamed(server_pod_, "containers", "shard-server"), {},
                    volumes_, {}));
  ASSERT_EQ(scode, 0) << sout;
  // `shardctl health` (the HEALTHCHECK's command) fails where nothing serves.
  auto [ucode, uout] = podman_.Run("exec zs-server shardctl --server=127.0.0.1:7071 health");
  EXPECT_NE(ucode, 0) << uout;
  // The image's HEALTHCHECK: the gRPC health service answers SERVING.
  EXPECT_TRUE(
      Poll([&] { return podman_.Run("healthcheck run zs-server").first == 0; }, absl::Seconds(60)))
      << podman_.Run("logs zs-server").second;
  Note("server healthy");
  // The workers' init container: waits for the server, then exits 0.
  auto [icode, iout] =
      Start("zs-wait", 1,
            RunArgs(worker_pod_, ContainerNamed(worker_pod_, "initContainers", "wait-for-server"),
                    {}, volumes_, {}),
            /*detach=*/false);
  EXPECT_EQ(icode, 0) << iout;
  ASSERT_NO_FATAL_FAILURE(StartAgent());

  for (int i = 0; i < 2; ++i) {
    auto [code, out] = StartWorker(absl::StrCat("zs-worker-", i), i);
    ASSERT_EQ(code, 0) << out;
  }
  ASSERT_TRUE(Poll([&] { return HasCompleteCheckpoint(); }, absl::Seconds(120)))
      << podman_.Run("logs zs-worker-0").second << podman_.Run("logs zs-server").second;
  Note("a complete checkpoint; killing worker 1");
  EXPECT_EQ(podman_.Run("kill -s KILL zs-worker-1").first, 0);
  EXPECT_EQ(WaitExit("zs-worker-1", 60), "137");
  // The Indexed Job's replacement: same completion index, so the same worker id.
  auto [rcode, rout] = StartWorker("zs-worker-1-replacement", 1);
  ASSERT_EQ(rcode, 0) << rout;
  for (const char* name : {"zs-worker-0", "zs-worker-1-replacement"}) {
    // 60 steps of 100 ms and a re-join: well under the bound.
    EXPECT_EQ(WaitExit(name, 240), "0")
        << name << ":\n"
        << podman_.Run(absl::StrCat("logs --tail 30 ", name)).second;
  }
  Note("workers finished");

  json r0 = json::parse(ReadFileOrEmpty(tmp_ + "/checkpoints/report-0.json"), nullptr, false);
  json r1 = json::parse(ReadFileOrEmpty(tmp_ + "/checkpoints/report-1.json"), nullptr, false);
  ASSERT_TRUE(r0.is_object() && r1.is_object());
  EXPECT_EQ(r0["params_sum"], r1["params_sum"]);
  EXPECT_GE(r0["recoveries"].size(), 1u) << "rank 0 did not recover from the killed worker";
  // Worker 0's stream went through the agent: the server saw the agent's.
  EXPECT_TRUE(absl::StrContains(podman_.Run("logs zs-server").second, "agent_stream_opened"))
      << podman_.Run("logs zs-agent").second;
  auto [ccode, cout] = Shardctl(
      "consolidate --job=zeroshard-train --step=latest "
      "--out=/var/lib/zeroshard/checkpoints/model.safetensors");
  EXPECT_EQ(ccode, 0) << cout;
  EXPECT_TRUE(absl::StrContains(cout, "consolidated step 60")) << cout;
  EXPECT_GT(ReadFileOrEmpty(tmp_ + "/checkpoints/model.safetensors").size(), 1000u);
}

}  // namespace
}  // namespace zeroshard::testing
