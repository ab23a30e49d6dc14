"""Every image deploy/k8s names is the one deploy/container/build.sh builds.

Reads every YAML file under deploy/k8s (ha/ included): each container's and
init container's `image:` must be build.sh's repository (IMAGE=...) with its
"latest" tag or none, and each kustomization's `images:` entry must rename that
repository (newName/newTag are the user's registry and commit tag). The
binary a container runs (command[0], or the first word of a `sh -c` script's
commands) must be one build.sh puts in the image. Then the same checks on
broken copies of the manifests (another image, a kustomization renaming
something else, a binary the image lacks) must fail: a checker that passes
everything fails here.

  images_test.py --root=DIR
"""
import argparse
import copy
import glob
import os
import re
import shlex
import sys

import yaml

BUILD_SH = "deploy/container/build.sh"


def image_facts(root):
  """(repository, set of executables in the image) from build.sh."""
  text = open(os.path.join(root, BUILD_SH)).read()
  m = re.search(r"^IMAGE=([A-Za-z0-9._/-]+)", text, re.M)
  if not m:
    raise SystemExit("images_test: no IMAGE= line in %s" % BUILD_SH)
  executables = set()
  # binaries=(bazel-bin/... bazel-bin/...) and `install ... SRC "$root/.../NAME"` lines.
  arr = re.search(r"^binaries=\(([^)]*)\)", text, re.M)
  if not arr:
    raise SystemExit("images_test: no binaries=(...) array in %s" % BUILD_SH)
  executables.update(os.path.basename(p) for p in arr.group(1).split())
  for dest in re.findall(r'^install -m 0755 \S+ "\$root/(?:usr/local/bin|bin)/([^"/]+)"', text,
                         re.M):
    executables.add(dest)
  return m.group(1), executables


def containers(doc):
  """(where, container) of every pod template in a manifest document."""
  spec = (doc.get("spec") or {})
  pod = None
  if doc.get("kind") == "Pod":
    pod = spec
  elif doc.get("kind") == "CronJob":
    pod = (((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}).get("spec")
  else:
    pod = (spec.get("template") or {}).get("spec")
  if not pod:
    return
  title = "%s/%s" % (doc.get("kind"), (doc.get("metadata") or {}).get("name"))
  for group in ("initContainers", "containers"):
    for c in pod.get(group) or []:
      yield "%s %s %s" % (title, group, c.get("name")), c


def run_binaries(c):
  """The executables a container runs: command[0], or for `sh -c SCRIPT` the
  first word of each simple command in the script (shell keywords and
  builtins left out)."""
  command = list(c.get("command") or []) + list(c.get("args") or [])
  if not command:
    return []
  if os.path.basename(command[0]) in ("sh", "bash") and len(command) >= 3 and command[1] == "-c":
    names = [os.path.basename(command[0])]
    for part in re.split(r"[;&|\n]|\bdo\b|\bthen\b|\$\(", command[2]):
      words = shlex.split(part, comments=True) if part.strip() else []
      while words and words[0] in ("until", "while", "if", "then", "do", "done", "fi", "!",
                                   "else"):
        words = words[1:]
      if words and words[0] not in ("echo", "exit", "true", "false", "[", "[[", "test", "exec",
                                    "export", "cd", "set") and not words[0].startswith(">"):
        names.append(os.path.basename(words[0]))
    return names
  return [os.path.basename(command[0])]


def check(files, repository, executables):
  """files: path -> list of YAML documents. Returns the problems found."""
  problems = []
  named = 0
  for path, docs in sorted(files.items()):
    for doc in docs:
      if not isinstance(doc, dict):
        continue
      if doc.get("kind") == "Kustomization":
        for entry in doc.get("images") or []:
          if entry.get("name") != repository:
            problems.append("%s: kustomization images entry renames %r, not %r (the image "
                            "deploy/container/build.sh builds)" % (path, entry.get("name"),
                                                                   repository))
        continue
      for where, c in containers(doc):
        image = str(c.get("image", ""))
        named += 1
        repo, _, tag = image.partition(":")
        if repo != repository or tag not in ("", "latest"):
          problems.append("%s: %s names image %r; expected %r (what deploy/container/build.sh "
                          "builds; a registry goes in kustomization.yaml's images:)"
                          % (path, where, image, repository + ":latest"))
        for binary in run_binaries(c):
          if binary not in executables:
            problems.append("%s: %s runs %r, which deploy/container/build.sh does not put in "
                            "the image (it holds %s)" % (path, where, binary,
                                                         ", ".join(sorted(executables))))
  if named == 0:
    problems.append("no container found in deploy/k8s: is the reader broken?")
  return problems


def self_test(files, repository, executables):
  """Broken copies the checker must report."""
  misses = []

  def mutate(description, fn, expect):
    d = copy.deepcopy(files)
    applied = False
    for path in d:
      for doc in d[path]:
        if isinstance(doc, dict) and fn(doc):
          applied = True
          break
      if applied:
        break
    found = check(d, repository, executables)
    if not applied:
      misses.append("mutation '%s' found nothing to change" % description)
    elif not any(expect in p for p in found):
      misses.append("mutation '%s' not reported (expected %r in %s)" % (description, expect, found))

  def first_container(fn):
    def apply(doc):
      for _, c in containers(doc):
        fn(c)
        return True
      return False
    return apply

  mutate("a placeholder image", first_container(lambda c: c.update(image="example/other:v1")),
         "names image 'example/other:v1'")
  mutate("another tag", first_container(lambda c: c.update(image=repository + ":v0")),
         "names image '%s:v0'" % repository)
  mutate("a binary not in the image",
         first_container(lambda c: c.update(command=["python3"], args=[])),
         "runs 'python3'")
  mutate("a script running a binary not in the image",
         first_container(lambda c: c.update(command=["/bin/sh", "-c"],
                                            args=["until curl http://x; do sleep 1; done"])),
         "runs 'curl'")
  mutate("a kustomization renaming another image",
         lambda doc: doc.get("kind") == "Kustomization" and
         doc.update(images=[{"name": "other", "newTag": "v1"}]) is None,
         "renames 'other'")
  return misses


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--root", default=".")
  args = parser.parse_args()
  repository, executables = image_facts(args.root)
  print("deploy/container/build.sh builds %s holding %s" % (repository,
                                                            ", ".join(sorted(executables))))
  files = {}
  for path in sorted(glob.glob(os.path.join(args.root, "deploy/k8s/**/*.yaml"), recursive=True)):
    files[os.path.relpath(path, args.root)] = list(yaml.safe_load_all(open(path)))
  if len(files) < 5:
    print("FAIL: only %d YAML files under deploy/k8s (expected server, workers, ha/...)"
          % len(files))
    return 1
  problems = check(files, repository, executables)
  for p in problems:
    print("FAIL: " + p)
  misses = self_test(files, repository, executables)
  for m in misses:
    print("FAIL (self-test): " + m)
  if problems or misses:
    return 1
  print("PASS: every image in %d files under deploy/k8s is %s" % (len(files), repository))
  return 0


if __name__ == "__main__":
  sys.exit(main())
