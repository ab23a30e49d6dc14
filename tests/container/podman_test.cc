// The container image (deploy/container/build.sh) under podman, run the way
// deploy/k8s runs it: the server's and the workers' containers take their
// command, args, env, volume mounts and security settings from the manifests
// (parsed from the YAML here, never copied), each container on an emulated
// host (tests/cluster/emulated_hosts.h: its own address; the Service name
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
#include "tests/cluster/emulated_hosts.h"
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

TEST(PodmanTest, TheManifestsContainersTrainSurviveAReplacedWorkerAndConsolidate) {
  if (std::string missing = Missing(); !missing.empty()) {
    const char* ci = getenv("CI");
    if (ci != nullptr && std::string(ci) == "true") FAIL() << missing;
    GTEST_SKIP() << missing;
  }
  Podman podman;
  const std::string tmp = MakeTempDir("podman");

  // The image, by build.sh from this test's binaries.
  const std::string bin = tmp + "/bin";
  RunCommand("mkdir -p " + bin);
  for (const char* f :
       {"shard_server/shard_server", "worker/shard_worker", "client/shardctl", "agent/shard_agent",
        "python/zeroshard-0.1.0-cp311-cp311-linux_x86_64.whl"}) {
    RunCommand(absl::StrCat("ln -sf \"$(realpath ", RunfilePath(f), ")\" ", bin, "/"));
  }
  Note("building the image");
  auto [bcode, bout] =
      RunCommand(absl::StrCat("/bin/bash ", RunfilePath("deploy/container/build.sh"),
                              " --bin_dir=", bin, " --podman_root=", podman.dir(), " 2>&1"));
  ASSERT_EQ(bcode, 0) << bout;
  Note("image built: " +
       std::string(absl::StripAsciiWhitespace(bout.substr(bout.rfind("build.sh:")))));

  auto hosts_or = EmulatedHosts::Create(3);
  ASSERT_TRUE(hosts_or.ok()) << hosts_or.status();
  std::unique_ptr<EmulatedHosts> hosts = *std::move(hosts_or);

  // The volumes: the claims as host directories owned by the pods' user.
  std::map<std::string, std::string> volumes = {
      {"state", tmp + "/state"}, {"checkpoints", tmp + "/checkpoints"}, {"auth", tmp + "/auth"}};
  for (const auto& [name, dir] : volumes) RunCommand("mkdir -p " + dir);
  WriteFile(tmp + "/auth/token", "podman-test-token\n");
  RunCommand(absl::StrCat("chown -R 65532:65532 ", tmp, "/state ", tmp, "/checkpoints ", tmp,
                          "/auth && chmod 0600 ", tmp, "/auth/token"));

  const std::vector<json> server_docs = LoadYaml(RunfilePath("deploy/k8s/server.yaml"));
  const std::vector<json> worker_docs = LoadYaml(RunfilePath("deploy/k8s/workers.yaml"));
  const json server_pod = PodSpec(server_docs, "StatefulSet");
  const json worker_pod = PodSpec(worker_docs, "Job");

  // Each container on its emulated host; "zeroshard-server" is host0.
  // The image's HEALTHCHECK is the server's: the others run without it.
  auto start = [&](const std::string& name, int host, const std::string& run_args, bool detach) {
    podman.Track(name);
    return podman.Run(absl::StrCat("run ", detach ? "-d " : "--rm ", "--name ", name,
                                   " --network ns:/run/netns/", hosts->netns(host), " --hostname ",
                                   name, " --add-host zeroshard-server:", hosts->address(0), " ",
                                   Podman::Limits(), name == "zs-server" ? "" : "--no-healthcheck ",
                                   run_args));
  };
  auto [scode, sout] =
      start("zs-server", 0,
            RunArgs(server_pod, ContainerNamed(server_pod, "containers", "shard-server"), {},
                    volumes, {}),
            true);
  ASSERT_EQ(scode, 0) << sout;
  // The image's HEALTHCHECK: the gRPC health service answers SERVING.
  EXPECT_TRUE(
      Poll([&] { return podman.Run("healthcheck run zs-server").first == 0; }, absl::Seconds(60)))
      << podman.Run("logs zs-server").second;
  Note("server healthy");

  // The workers' init container: waits for the server, then exits 0.
  auto [icode, iout] =
      start("zs-wait", 1,
            RunArgs(worker_pod, ContainerNamed(worker_pod, "initContainers", "wait-for-server"), {},
                    volumes, {}),
            false);
  EXPECT_EQ(icode, 0) << iout;

  // The training flags for CPUs and 2 workers, after the manifest's own.
  const std::vector<std::string> cpu_run = {
      "--world_size=2",
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
  const json worker = ContainerNamed(worker_pod, "containers", "shard-worker");
  // A node agent on host1 for worker 0 (docs/scale.md). No manifest runs one
  // (there is no DaemonSet), so its command line is written here.
  const std::string agent_dir = tmp + "/agent";
  RunCommand(absl::StrCat("mkdir -p ", agent_dir, " && chown 65532:65532 ", agent_dir));
  auto [acode, aout] =
      start("zs-agent", 1,
            absl::StrCat("-v ", tmp, "/auth:/etc/zeroshard/auth:ro -v ", agent_dir,
                         ":/run/zeroshard --read-only --cap-drop ALL --entrypoint shard_agent "
                         "zeroshard:latest --server=zeroshard-server:7070 "
                         "--token_file=/etc/zeroshard/auth/token --insecure "
                         "--listen=unix:/run/zeroshard/agent.sock"),
            true);
  ASSERT_EQ(acode, 0) << aout;
  ASSERT_TRUE(Poll([&] { return access((agent_dir + "/agent.sock").c_str(), F_OK) == 0; },
                   absl::Seconds(30)))
      << podman.Run("logs zs-agent").second;
  // Worker 0 (host1) reaches the server through the agent; worker 1 directly.
  auto start_worker = [&](const std::string& name, int index) {
    std::vector<std::string> flags = cpu_run;
    std::string agent_mount;
    if (index == 0) {
      flags.push_back("--agent=unix:/run/zeroshard/agent.sock");
      agent_mount = absl::StrCat("-v ", agent_dir, ":/run/zeroshard ");
    }
    return start(name, 1 + index,
                 agent_mount + RunArgs(worker_pod, worker,
                                       {{"JOB_COMPLETION_INDEX", std::to_string(index)},
                                        {"POD_IP", hosts->address(1 + index)}},
                                       volumes, flags),
                 true);
  };
  for (int i = 0; i < 2; ++i) {
    auto [wcode, wout] = start_worker(absl::StrCat("zs-worker-", i), i);
    ASSERT_EQ(wcode, 0) << wout;
  }
  const std::string ctl =
      "exec zs-server shardctl --token_file=/etc/zeroshard/auth/token --insecure ";
  auto complete_checkpoint = [&] {
    auto [code, out] = podman.Run(ctl + "checkpoints --job=zeroshard-train");
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() >= 2 && f[1] == "yes") return true;
    }
    return false;
  };
  ASSERT_TRUE(Poll(complete_checkpoint, absl::Seconds(120)))
      << podman.Run("logs zs-worker-0").second << podman.Run("logs zs-server").second;
  Note("a complete checkpoint; killing worker 1");
  EXPECT_EQ(podman.Run("kill -s KILL zs-worker-1").first, 0);
  EXPECT_EQ(
      absl::StripAsciiWhitespace(
          RunCommand(absl::StrCat("timeout 60 ", podman.Command(), "wait zs-worker-1")).second),
      "137");
  // The Indexed Job's replacement: same completion index, so the same worker id.
  auto [rcode, rout] = start_worker("zs-worker-1-replacement", 1);
  ASSERT_EQ(rcode, 0) << rout;

  for (const char* name : {"zs-worker-0", "zs-worker-1-replacement"}) {
    // 60 steps of 100 ms and a re-join: well under the bound.
    auto [code, out] = RunCommand(absl::StrCat("timeout 240 ", podman.Command(), "wait ", name));
    EXPECT_EQ(absl::StripAsciiWhitespace(out), "0")
        << name << ":\n"
        << podman.Run(absl::StrCat("logs --tail 30 ", name)).second;
  }
  Note("workers finished");
  json r0 = json::parse(ReadFileOrEmpty(tmp + "/checkpoints/report-0.json"), nullptr, false);
  json r1 = json::parse(ReadFileOrEmpty(tmp + "/checkpoints/report-1.json"), nullptr, false);
  ASSERT_TRUE(r0.is_object() && r1.is_object());
  EXPECT_EQ(r0["params_sum"], r1["params_sum"]);
  EXPECT_GE(r0["recoveries"].size(), 1u) << "rank 0 did not recover from the killed worker";
  // Worker 0's stream went through the agent: the server saw the agent's.
  EXPECT_TRUE(absl::StrContains(podman.Run("logs zs-server").second, "agent_stream_opened"))
      << podman.Run("logs zs-agent").second;

  auto [ccode, cout] = podman.Run(ctl +
                                  "consolidate --job=zeroshard-train --step=latest "
                                  "--out=/var/lib/zeroshard/checkpoints/model.safetensors");
  EXPECT_EQ(ccode, 0) << cout;
  EXPECT_TRUE(absl::StrContains(cout, "consolidated step 60")) << cout;
  EXPECT_GT(ReadFileOrEmpty(tmp + "/checkpoints/model.safetensors").size(), 1000u);
}

}  // namespace
}  // namespace zeroshard::testing
