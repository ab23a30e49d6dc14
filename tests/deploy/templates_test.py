#!/usr/bin/python3
"""Checks the deploy templates against the real binaries.

Every --flag that deploy/k8s/*.yaml, deploy/slurm/zeroshard.sbatch and
deploy/systemd/zeroshard-server.{service,env} pass to shard_server,
shard_worker or shardctl must be one that binary accepts, as its --helpfull
output (read at test time) lists. Structural checks on top: gRPC probes on the
service port, an Indexed worker Job with parallelism = completions =
--world_size, volumes mounted where the flags point, the worker's --server
naming the server's Service, and the like.

  /usr/bin/python3 tests/deploy/templates_test.py \
      --shard_server=bazel-bin/shard_server/shard_server \
      --shard_worker=bazel-bin/worker/shard_worker \
      --shardctl=bazel-bin/client/shardctl [--root=.]

Run by `bazel test //tests/deploy:templates_test`. Exits 1 naming file,
binary and flag on the first run of failures. Before it passes, it also
proves it can fail: every flag name each template uses is renamed in turn
and must then be reported, and a few structural mutations must be caught.
"""

import argparse
import copy
import glob
import os
import re
import subprocess
import sys

import yaml

BINARIES = ("shard_server", "shard_worker", "shardctl")
SHELLS = ("sh", "bash", "dash")
OPERATORS = ("&&", "||", ";;", ";", "&", "|", "(", ")", "\n")
REDIRECTS = (">>", ">&", "<&", "&>", ">", "<")


# --------------------------------------------------------------------------
# The binaries' flags, from --helpfull
# --------------------------------------------------------------------------

class FlagSet(object):
  """The flags one binary accepts: name -> is_bool."""

  def __init__(self, binary, flags):
    self.binary = binary
    self.flags = flags

  def accepts(self, name):
    if name in self.flags:
      return True
    # absl: --nofoo sets a bool flag foo to false.
    return name.startswith("no") and self.flags.get(name[2:], False)


def parse_helpfull(text):
  """Flag name -> is_bool, from absl's --helpfull output."""
  flags = {}
  current = None
  entry = []

  def finish():
    if current is not None:
      flags[current] = bool(re.search(r"default: (true|false);\s*$", " ".join(entry)))

  in_section = False
  for line in text.splitlines():
    if re.match(r"^\s*Flags from \S+:\s*$", line):
      finish()
      current, entry, in_section = None, [], True
      continue
    if not in_section:
      continue
    m = re.match(r"^    --([A-Za-z0-9_]+) ", line) or re.match(r"^    --([A-Za-z0-9_]+)$", line)
    if m:
      finish()
      current, entry = m.group(1), [line.strip()]
    elif line.startswith("      ") and current is not None:
      entry.append(line.strip())
    elif not line.strip():
      continue
    else:  # the closing "Try --helpfull ..." text
      finish()
      current, entry, in_section = None, [], False
  finish()
  return flags


def load_flagset(binary, path):
  if not os.access(path, os.X_OK):
    raise SystemExit("templates_test: %s binary %s is not executable" % (binary, path))
  # absl prints the usage and exits 1 after --helpfull.
  proc = subprocess.run([path, "--helpfull"], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, timeout=60)
  text = proc.stdout.decode("utf-8", "replace")
  flags = parse_helpfull(text)
  if "flagfile" not in flags or len(flags) < 6:
    raise SystemExit("templates_test: could not read the flags of %s from `%s --helpfull`"
                     " (exit %d):\n%s" % (binary, path, proc.returncode, text[:2000]))
  return FlagSet(binary, flags)


# --------------------------------------------------------------------------
# A small shell reader: words, operators, array assignments, expansions
# --------------------------------------------------------------------------

class Word(object):
  def __init__(self, raw, line):
    self.raw = raw
    self.line = line


class Array(object):
  """NAME=( ... ) or NAME+=( ... )."""

  def __init__(self, name, append, words, line):
    self.name = name
    self.append = append
    self.words = words
    self.line = line


def _skip_balanced(text, i, open_ch, close_ch):
  """text[i] == open_ch; returns the index after the matching close_ch,
  stepping over quotes and nested pairs."""
  depth = 0
  n = len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2
      continue
    if c == "'":
      j = text.find("'", i + 1)
      i = n if j < 0 else j + 1
      continue
    if c == '"':
      i = _skip_double_quoted(text, i)
      continue
    if c == open_ch:
      depth += 1
    elif c == close_ch:
      depth -= 1
      if depth == 0:
        return i + 1
    i += 1
  raise ValueError("unbalanced %s%s" % (open_ch, close_ch))


def _skip_double_quoted(text, i):
  """text[i] == '"'; returns the index after the closing quote."""
  i += 1
  n = len(text)
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2
    elif c == '"':
      return i + 1
    elif c == "$" and i + 1 < n and text[i + 1] in "({":
      i = _skip_balanced(text, i + 1, text[i + 1], ")" if text[i + 1] == "(" else "}")
    else:
      i += 1
  raise ValueError("unterminated double quote")


def _read_word(text, i):
  """The raw text of the word starting at text[i], and the index after it."""
  n = len(text)
  start = i
  while i < n:
    c = text[i]
    if c == "\\":
      i += 2
    elif c == "'":
      j = text.find("'", i + 1)
      if j < 0:
        raise ValueError("unterminated single quote")
      i = j + 1
    elif c == '"':
      i = _skip_double_quoted(text, i)
    elif c == "$" and i + 1 < n and text[i + 1] in "({":
      i = _skip_balanced(text, i + 1, text[i + 1], ")" if text[i + 1] == "(" else "}")
    elif c in " \t\r\n;&|()<>":
      break
    else:
      i += 1
  return text[start:i], i


def lex(text):
  """Tokens of a shell text: Word, Array, or an operator string
  (';', '&', '&&', '||', '|', '(', ')', '\\n'). Redirections and their
  targets are dropped; comments and line continuations are removed."""
  tokens = []
  i, n, line = 0, len(text), 1
  last_word_end = -1
  while i < n:
    c = text[i]
    if c == "\\" and text[i + 1:i + 2] == "\n":  # line continuation
      i += 2
      line += 1
      continue
    if c in " \t\r":
      i += 1
      continue
    if c == "#":  # a comment (words never start with #)
      while i < n and text[i] != "\n":
        i += 1
      continue
    redirect = next((r for r in REDIRECTS if text.startswith(r, i)), None)
    if redirect is not None:
      # "2>&1": a number right before the operator is its fd, not a word.
      if (last_word_end == i and tokens and isinstance(tokens[-1], Word)
          and tokens[-1].raw.isdigit()):
        tokens.pop()
      i += len(redirect)
      while i < n and text[i] in " \t":
        i += 1
      target, i = _read_word(text, i)  # the file: dropped
      line += target.count("\n")
      continue
    op = next((o for o in OPERATORS if text.startswith(o, i)), None)
    if op is not None:
      tokens.append(op)
      line += op.count("\n")
      i += len(op)
      continue
    raw, j = _read_word(text, i)
    m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=$", raw)
    if m and text[j:j + 1] == "(":
      # NAME=( ... ) or NAME+=( ... ): an array assignment.
      close = _find_array_end(text, j)
      words = [t for t in lex(text[j + 1:close]) if isinstance(t, Word)]
      for w in words:
        w.line += line - 1
      tokens.append(Array(m.group(1), bool(m.group(2)), words, line))
      line += text.count("\n", i, close)
      i = close + 1
      continue
    tokens.append(Word(raw, line))
    line += raw.count("\n")
    i = last_word_end = j
  return tokens


def _find_array_end(text, i):
  """text[i] == '(' opening an array; the index of its ')'."""
  j = i + 1
  n = len(text)
  while j < n:
    c = text[j]
    if c == "\\":
      j += 2
    elif c == "'":
      j = text.find("'", j + 1) + 1
    elif c == '"':
      j = _skip_double_quoted(text, j)
    elif c == "#" and text[j - 1] in " \t\n(":
      while j < n and text[j] != "\n":
        j += 1
    elif c == "$" and j + 1 < n and text[j + 1] in "({":
      j = _skip_balanced(text, j + 1, text[j + 1], ")" if text[j + 1] == "(" else "}")
    elif c == ")":
      return j
    else:
      j += 1
  raise ValueError("unterminated array assignment")


class Env(object):
  """Variables while reading a script: scalars (str) and arrays (list).
  Both branches of every conditional are taken, so appends accumulate:
  the flags checked are every flag the script may pass."""

  def __init__(self, values=None, positional=None, systemd=False):
    self.values = dict(values or {})
    self.positional = list(positional or [])
    self.systemd = systemd


class _Fields(object):
  """Builds the fields of one word while it is expanded."""

  def __init__(self):
    self.fields = []
    self.current = None  # None: no field started

  def add(self, text, quoted=True):
    if self.current is None:
      self.current = ""
    self.current += text
    if quoted:
      self.current = self.current  # an empty quoted string still makes a field

  def split_add(self, text):
    parts = text.split()
    if not parts:
      return
    if text[:1].isspace():
      self.break_field()
    for k, part in enumerate(parts):
      if k:
        self.break_field()
      self.add(part)
    if text[-1:].isspace():
      self.break_field()

  def break_field(self):
    if self.current is not None:
      self.fields.append(self.current)
    self.current = None

  def done(self):
    self.break_field()
    return self.fields


def expand(raw, env):
  """The fields a shell word expands to. $(...) and unknown variables stay
  literal; ${X:+alt} and ${X+alt} always give alt (the flags in it are
  checked whether or not X is set)."""
  out = _Fields()
  _expand_into(raw, env, out, quoted=False)
  return out.done()


def _expand_into(raw, env, out, quoted):
  i, n = 0, len(raw)
  while i < n:
    c = raw[i]
    if c == "\\" and i + 1 < n:
      if quoted and raw[i + 1] not in '$`"\\\n':
        out.add(raw[i:i + 2])
      elif raw[i + 1] != "\n":
        out.add(raw[i + 1])
      i += 2
    elif c == "'" and not quoted:
      j = raw.find("'", i + 1)
      out.add(raw[i + 1:j])
      i = j + 1
    elif c == '"' and not quoted:
      j = _skip_double_quoted(raw, i)
      out.add("")
      _expand_into(raw[i + 1:j - 1], env, out, quoted=True)
      i = j
    elif c == "$":
      i = _expand_dollar(raw, i, env, out, quoted)
    else:
      out.add(c)
      i += 1


def _lookup(name, env):
  if name == "@" or name == "*":
    return list(env.positional)
  if name.isdigit():
    k = int(name)
    return env.positional[k - 1] if 0 < k <= len(env.positional) else None
  return env.values.get(name)


def _emit(value, out, quoted, literal, split):
  if value is None:
    out.add(literal)
  elif isinstance(value, list):
    for k, v in enumerate(value):
      if k:
        out.break_field()
      out.add(v)
  elif quoted or not split:
    out.add(value)
  else:
    out.split_add(value)


def _expand_dollar(raw, i, env, out, quoted):
  n = len(raw)
  if i + 1 >= n:
    out.add("$")
    return i + 1
  nxt = raw[i + 1]
  if nxt == "(":  # command or arithmetic substitution: kept literal
    j = _skip_balanced(raw, i + 1, "(", ")")
    out.add(raw[i:j])
    return j
  if nxt == "{":
    j = _skip_balanced(raw, i + 1, "{", "}")
    body = raw[i + 2:j - 1]
    m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!])(\[[@*]\])?(?:(:?[-+=?])(.*))?$",
                 body, re.S)
    if not m:
      out.add(raw[i:j])
      return j
    name, index, op, arg = m.group(1), m.group(2), m.group(3), m.group(4)
    value = _lookup(name, env)
    if value is not None and not isinstance(value, list) and index:
      value = [value]
    if isinstance(value, list) and not index and name not in "@*":
      value = value[0] if value else ""
    if op in ("+", ":+"):
      _expand_into(arg, env, out, quoted)  # the alternative, always
      return j
    if op in ("-", ":-", "=", ":="):
      empty = value is None or (op.startswith(":") and value in ("", []))
      if empty:
        _expand_into(arg, env, out, quoted)
        return j
    _emit(value, out, quoted, raw[i:j], split=not env.systemd)
    return j
  m = re.match(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]|[@*#?$!]", raw[i + 1:])
  if not m:
    out.add("$")
    return i + 1
  name = m.group(0)
  _emit(_lookup(name, env), out, quoted, "$" + name, split=True)
  return i + 1 + len(name)


def commands(tokens):
  """Simple commands: (items, terminator) where items are Words and
  Arrays, terminator the operator that ended the command."""
  result = []
  items = []
  for t in tokens:
    if isinstance(t, str):
      if items:
        result.append((items, t))
      items = []
    else:
      items.append(t)
  if items:
    result.append((items, "\n"))
  return result


class Invocation(object):
  def __init__(self, source, where, binary, argv, context):
    self.source = source    # file name
    self.where = where      # "line 12", "StatefulSet/x container y", ...
    self.binary = binary    # shard_server | shard_worker | shardctl
    self.argv = argv        # the fields after the binary
    self.context = context  # the whole command (e.g. srun ... binary ...)
    self.background = False
    self.launcher = []      # what runs it: ["srun", "--overlap", ...]

  def flags(self):
    """(name, value or None) of every --flag, up to a bare '--'."""
    result = []
    for arg in self.argv:
      if arg == "--":
        break
      if arg.startswith("--"):
        name, eq, value = arg[2:].partition("=")
        result.append((name, value if eq else None))
    return result

  def flag(self, name):
    values = [v for n, v in self.flags() if n == name]
    return values[-1] if values else None


def binary_of(field):
  base = field.rstrip("/").rsplit("/", 1)[-1]
  return base if base in BINARIES else None


def invocations_in_argv(argv, env, source, where, depth=0, launcher=None):
  """Invocations in one command's fields: the binaries themselves, and
  inside `sh -c SCRIPT NAME ARGS...` scripts. launcher: the fields before
  the binary (e.g. srun and its options), or the command that ran the shell."""
  found = []
  for k, field in enumerate(argv):
    b = binary_of(field)
    if b:
      inv = Invocation(source, where, b, argv[k + 1:], argv)
      inv.launcher = launcher if launcher is not None else argv[:k]
      found.append(inv)
      break
    if field.rsplit("/", 1)[-1] in SHELLS and argv[k + 1:k + 2] == ["-c"]:
      if k + 2 >= len(argv):
        break
      script = argv[k + 2]
      positional = argv[k + 4:]
      inner = Env(env.values, positional)
      found.extend(invocations_in_shell(script, source, inner, where_prefix=where,
                                        depth=depth + 1,
                                        launcher=launcher if launcher is not None else argv[:k]))
      break
  return found


def invocations_in_shell(text, source, env=None, where_prefix="", depth=0, launcher=None):
  """Invocations of the binaries in a shell script, reading its variable
  and array assignments in order (both branches of conditionals)."""
  if depth > 4:
    return []
  env = env if env is not None else Env()
  found = []
  for items, terminator in commands(lex(text)):
    words = [t for t in items if isinstance(t, Word)]
    arrays = [t for t in items if isinstance(t, Array)]
    for a in arrays:
      values = []
      for w in a.words:
        values.extend(expand(w.raw, env))
      if a.append:
        old = env.values.get(a.name)
        old = old if isinstance(old, list) else ([old] if old else [])
        env.values[a.name] = old + values
      else:
        env.values[a.name] = values
    if not words:
      continue
    assigns = [re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", w.raw, re.S) for w in words]
    if all(assigns):
      for m in assigns:
        fields = expand(m.group(3), Env(env.values, env.positional))
        value = " ".join(fields) if fields else ""
        if m.group(2):
          value = (env.values.get(m.group(1)) or "") + value
        env.values[m.group(1)] = value
      continue
    argv = []
    for w in words:
      argv.extend(expand(w.raw, env))
    if where_prefix:
      where = "%s, line %d of its sh -c script" % (where_prefix, words[0].line)
    else:
      where = "line %d" % words[0].line
    for inv in invocations_in_argv(argv, env, source, where, depth, launcher):
      inv.background = terminator == "&"
      found.append(inv)
  return found


# --------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------

class Report(object):
  def __init__(self, texts=None):
    self.texts = texts or {}
    self.errors = []
    self.invocations = []

  def error(self, source, message):
    self.errors.append("%s: %s" % (source, message))


def flag_lines(texts, source, name):
  """Where --name is written: "file:line" of each occurrence in the files
  behind an invocation's source."""
  found = []
  for f, text in sorted(texts.items()):
    if source == f or source.startswith(f + " ") or (source.startswith(UNIT + " + ") and
                                                     f == ENVFILE):
      for k, line in enumerate(text.splitlines(), 1):
        if re.search(r"--%s(?=[=\s\"'\\]|$)" % re.escape(name), line):
          found.append("%s:%d" % (f, k))
  return found


def check_flags(inv, flagsets, report):
  fs = flagsets[inv.binary]
  for name, _ in inv.flags():
    if not fs.accepts(name):
      at = flag_lines(report.texts, inv.source, name)
      report.error(inv.source, "%s (%s) passes --%s, which %s does not accept "
                   "(not in `%s --helpfull`)%s"
                   % (inv.binary, inv.where, name, inv.binary, inv.binary,
                      "; written at " + ", ".join(at) if at else ""))
  report.invocations.append(inv)


# ---- Kubernetes ----

def pod_templates(doc):
  """(pod spec, pod metadata) of a workload document."""
  kind = doc.get("kind")
  spec = doc.get("spec") or {}
  if kind == "Pod":
    return spec, doc.get("metadata") or {}
  if kind in ("StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Job"):
    t = spec.get("template") or {}
    return t.get("spec") or {}, t.get("metadata") or {}
  if kind == "CronJob":
    t = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
    return t.get("spec") or {}, t.get("metadata") or {}
  return None, None


def container_invocations(container, source, where):
  command = [str(x) for x in (container.get("command") or [])]
  args = [str(x) for x in (container.get("args") or [])]
  argv = command + args
  return invocations_in_argv(argv, Env(), source, where)


def mount_for(container, path):
  """The volumeMount whose mountPath holds path (the longest)."""
  best = None
  for m in container.get("volumeMounts") or []:
    mp = m.get("mountPath", "").rstrip("/")
    if path == mp or path.startswith(mp + "/"):
      if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
        best = m
  return best


def volume_named(pod, name):
  for v in pod.get("volumes") or []:
    if v.get("name") == name:
      return v
  return None


def env_field_ref(container, name):
  for e in container.get("env") or []:
    if e.get("name") == name:
      return (((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath"))
  return None


def container_port_numbers(container):
  """containerPort by name, and the set of numbers."""
  by_name = {}
  numbers = set()
  for p in container.get("ports") or []:
    numbers.add(p.get("containerPort"))
    if p.get("name"):
      by_name[p["name"]] = p.get("containerPort")
  return by_name, numbers


def port_of(address):
  m = re.match(r"^(.*):([0-9]+)$", address or "")
  return (m.group(1), int(m.group(2))) if m else (None, None)


def pod_containers(docs):
  """(source, doc, pod, pod metadata, container, where) for every container
  of every pod template in docs, a list of (source, document)."""
  for source, doc in docs:
    pod, pod_meta = pod_templates(doc)
    if pod is None:
      continue
    title = "%s/%s" % (doc.get("kind"), (doc.get("metadata") or {}).get("name"))
    for group in ("initContainers", "containers"):
      for c in pod.get(group) or []:
        yield source, doc, pod, pod_meta, c, "%s, container %s" % (title, c.get("name"))


def check_k8s(files, flagsets, report):
  """files: name -> list of YAML documents."""
  docs = []
  for name, file_docs in sorted(files.items()):
    for d in file_docs:
      if isinstance(d, dict):
        docs.append((name, d))
  services = [(n, d) for n, d in docs if d.get("kind") == "Service"]
  pvcs = {(d.get("metadata") or {}).get("name"): d for n, d in docs
          if d.get("kind") == "PersistentVolumeClaim"}

  server_pods = []   # (source, doc, pod, container, invocation)
  worker_pods = []
  client_invs = []
  for source, doc, pod, pod_meta, c, where in pod_containers(docs):
    invs = container_invocations(c, source, where)
    # etcd: the image holds Debian's etcd too (deploy/container/build.sh).
    if (not invs and str(c.get("image", "")).startswith("zeroshard")
        and (c.get("command") or [""])[0] != "etcd"):
      report.error(source, "%s runs image %s but no zeroshard binary could be found in its "
                   "command/args" % (where, c.get("image")))
    for inv in invs:
      check_flags(inv, flagsets, report)
      # $(VAR) in args must be a variable of the container.
      env_names = set(e.get("name") for e in c.get("env") or [])
      for arg in inv.argv:
        for var in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
          if var not in env_names and (c.get("command") or [""])[0] not in ("/bin/sh", "sh",
                                                                           "/bin/bash",
                                                                           "bash"):
            report.error(source, "%s (%s): %s refers to $(%s), not in the container's env"
                         % (inv.binary, where, arg, var))
      entry = (source, doc, pod, pod_meta, c, inv)
      if inv.binary == "shard_server":
        server_pods.append(entry)
      elif inv.binary == "shard_worker":
        worker_pods.append(entry)
      else:
        client_invs.append(entry)

  if len(server_pods) != 1:
    report.error("deploy/k8s", "expected exactly one container running shard_server, found %d"
                 % len(server_pods))
  if not worker_pods:
    report.error("deploy/k8s", "no container runs shard_worker")

  server_claim = None
  server_secret = None
  server_selector_labels = {}
  listen_port = None
  for source, doc, pod, pod_meta, c, inv in server_pods:
    name = "%s/%s" % (doc.get("kind"), doc["metadata"]["name"])
    spec = doc.get("spec") or {}
    server_selector_labels = (pod_meta.get("labels") or {})
    if doc.get("kind") != "StatefulSet":
      report.error(source, "%s: shard_server should run in a StatefulSet" % name)
    if spec.get("replicas", 1) != 1:
      report.error(source, "%s: replicas must be 1 (one control plane), not %r"
                   % (name, spec.get("replicas")))
    host, listen_port = port_of(inv.flag("listen"))
    if listen_port is None:
      report.error(source, "%s: shard_server needs --listen=HOST:PORT" % name)
    by_name, numbers = container_port_numbers(c)
    if listen_port is not None and listen_port not in numbers:
      report.error(source, "%s: --listen port %s is not a containerPort %s"
                   % (name, listen_port, sorted(numbers)))
    if host in ("127.0.0.1", "localhost"):
      report.error(source, "%s: --listen=%s is unreachable from other pods"
                   % (name, inv.flag("listen")))
    for probe in ("readinessProbe", "livenessProbe"):
      p = c.get(probe)
      if not p:
        report.error(source, "%s: container %s has no %s" % (name, c.get("name"), probe))
        continue
      other = [k for k in ("httpGet", "tcpSocket", "exec") if k in p]
      if "grpc" not in p or other:
        report.error(source, "%s: %s must be a native gRPC probe (grpc: {port: %s}), found %s"
                     % (name, probe, listen_port, sorted(k for k in p if k in
                                                         ("grpc", "httpGet", "tcpSocket", "exec"))))
        continue
      port = p["grpc"].get("port")
      if port != listen_port:
        report.error(source, "%s: %s probes gRPC port %r, but the server listens on %r"
                     % (name, probe, port, listen_port))
      if p["grpc"].get("service"):
        report.error(source, "%s: %s asks for health service %r; the server reports the "
                     "overall status (service \"\")" % (name, probe, p["grpc"]["service"]))
    # State and checkpoints on persistent volumes mounted where the flags point.
    templates = {(t.get("metadata") or {}).get("name"): t
                 for t in spec.get("volumeClaimTemplates") or []}
    for flag in ("state_dir", "checkpoint_root"):
      path = inv.flag(flag)
      if not path:
        report.error(source, "%s: shard_server has no --%s" % (name, flag))
        continue
      m = mount_for(c, path)
      if m is None:
        report.error(source, "%s: --%s=%s is not on any volumeMount of container %s"
                     % (name, flag, path, c.get("name")))
        continue
      vol = m.get("name")
      if flag == "state_dir" and vol not in templates:
        report.error(source, "%s: --state_dir=%s is on volume %r, not a volumeClaimTemplate"
                     % (name, path, vol))
      if vol not in templates:
        v = volume_named(pod, vol)
        claim = ((v or {}).get("persistentVolumeClaim") or {}).get("claimName")
        if not claim:
          report.error(source, "%s: --%s=%s is on volume %r, which is not a PVC"
                       % (name, flag, path, vol))
        elif flag == "checkpoint_root":
          server_claim = claim
      if m.get("readOnly"):
        report.error(source, "%s: --%s=%s is mounted readOnly" % (name, flag, path))
    token = inv.flag("auth_token_file")
    if token:
      m = mount_for(c, token)
      v = volume_named(pod, m.get("name")) if m else None
      if not v or "secret" not in v:
        report.error(source, "%s: --auth_token_file=%s is not on a Secret volume" % (name, token))
      else:
        server_secret = v["secret"].get("secretName")
    # The pod runs as non-root.
    sc = dict(pod.get("securityContext") or {})
    sc.update(c.get("securityContext") or {})
    if not sc.get("runAsNonRoot"):
      report.error(source, "%s: securityContext.runAsNonRoot is not set" % name)
    res = c.get("resources") or {}
    if not res.get("requests") or not res.get("limits"):
      report.error(source, "%s: container %s needs resources.requests and limits"
                   % (name, c.get("name")))

  # The Service that selects the server pod.
  server_services = {}
  for source, svc in services:
    sel = (svc.get("spec") or {}).get("selector") or {}
    if sel and all(server_selector_labels.get(k) == v for k, v in sel.items()):
      server_services[svc["metadata"]["name"]] = (source, svc)
  if server_pods and not server_services:
    report.error(server_pods[0][0], "no Service selects the shard_server pod")
  sts = server_pods[0][1] if server_pods else None
  if sts is not None and sts.get("kind") == "StatefulSet":
    gov = (sts.get("spec") or {}).get("serviceName")
    if gov not in server_services:
      report.error(server_pods[0][0], "StatefulSet serviceName %r is not a Service selecting it"
                   % gov)
  for sname, (source, svc) in server_services.items():
    c = server_pods[0][4]
    by_name, numbers = container_port_numbers(c)
    for p in (svc.get("spec") or {}).get("ports") or []:
      target = p.get("targetPort", p.get("port"))
      target = by_name.get(target, target)
      if target != listen_port:
        report.error(source, "Service %s port %s targets %r, but the server listens on %r"
                     % (sname, p.get("port"), target, listen_port))

  def check_server_address(source, inv, where):
    addr = inv.flag("server")
    host, port = port_of(addr)
    if addr is None:
      report.error(source, "%s (%s) has no --server" % (inv.binary, where))
      return
    svc_name = (host or "").split(".")[0]
    if svc_name not in server_services:
      report.error(source, "%s (%s): --server=%s is not a Service of the shard_server pod %s"
                   % (inv.binary, where, addr, sorted(server_services)))
      return
    ports = [p.get("port") for p in server_services[svc_name][1]["spec"].get("ports") or []]
    if port not in ports:
      report.error(source, "%s (%s): --server=%s, but Service %s serves ports %s"
                   % (inv.binary, where, addr, svc_name, ports))

  for source, doc, pod, pod_meta, c, inv in client_invs:
    check_server_address(source, inv, inv.where)

  for source, doc, pod, pod_meta, c, inv in worker_pods:
    name = "%s/%s" % (doc.get("kind"), doc["metadata"]["name"])
    spec = doc.get("spec") or {}
    check_server_address(source, inv, inv.where)
    if doc.get("kind") != "Job":
      report.error(source, "%s: shard_worker should run in an Indexed Job" % name)
      continue
    if spec.get("completionMode") != "Indexed":
      report.error(source, "%s: completionMode must be Indexed, not %r"
                   % (name, spec.get("completionMode")))
    completions, parallelism = spec.get("completions"), spec.get("parallelism")
    if completions is None or completions != parallelism:
      report.error(source, "%s: parallelism (%r) must equal completions (%r): every worker "
                   "of the job runs at once" % (name, parallelism, completions))
    world = inv.flag("world_size")
    if world is None or not world.isdigit() or int(world) != completions:
      report.error(source, "%s: shard_worker --world_size=%s must equal completions (%r)"
                   % (name, world, completions))
    # A failed worker pod must come back with its completion index (and so its
    # worker id and rank) so the job can re-form at W.
    policy = pod.get("restartPolicy")
    backoff = spec.get("backoffLimit", 6)
    if policy not in ("Never", "OnFailure"):
      report.error(source, "%s: restartPolicy must be Never or OnFailure, not %r" % (name, policy))
    if not isinstance(backoff, int) or backoff < 1:
      report.error(source, "%s: backoffLimit %r restarts no failed worker: give it >= 1"
                   % (name, backoff))
    if policy == "Never":
      rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
      fails_on_bad_flag = any(
          r.get("action") == "FailJob" and 2 in ((r.get("onExitCodes") or {}).get("values") or [])
          and (r.get("onExitCodes") or {}).get("operator") == "In" for r in rules)
      if not fails_on_bad_flag:
        report.error(source, "%s: podFailurePolicy must fail the Job on exit code 2 (a bad flag: "
                     "restarting cannot help)" % name)
    worker_id = inv.flag("worker_id") or ""
    refs = re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", worker_id)
    index_path = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    if not any(env_field_ref(c, r) == index_path for r in refs):
      report.error(source, "%s: --worker_id=%s does not come from the completion index "
                   "(an env var with fieldRef %s)" % (name, worker_id or "(none)", index_path))
    host = inv.flag("host") or ""
    refs = re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", host)
    if not any(env_field_ref(c, r) == "status.podIP" for r in refs):
      report.error(source, "%s: --host=%s is not the pod IP (an env var with fieldRef "
                   "status.podIP)" % (name, host or "(none)"))
    if inv.flag("backend") == "nccl":
      limits = (c.get("resources") or {}).get("limits") or {}
      if str(limits.get("nvidia.com/gpu")) != "1":
        report.error(source, "%s: --backend=nccl needs resources.limits nvidia.com/gpu: 1 "
                     "(one GPU per worker), found %r" % (name, limits.get("nvidia.com/gpu")))
    ckpt = inv.flag("checkpoint_dir")
    if ckpt:
      m = mount_for(c, ckpt)
      v = volume_named(pod, m.get("name")) if m else None
      claim = ((v or {}).get("persistentVolumeClaim") or {}).get("claimName")
      if not claim:
        report.error(source, "%s: --checkpoint_dir=%s is not on a PVC volume" % (name, ckpt))
      elif inv.flag("checkpoint_transport") in (None, "fs"):
        if server_claim is not None and claim != server_claim:
          report.error(source, "%s: --checkpoint_dir is on claim %r, the server's "
                       "--checkpoint_root on %r: with --checkpoint_transport=fs they must share"
                       % (name, claim, server_claim))
        pvc = pvcs.get(claim)
        if pvc is not None and "ReadWriteMany" not in (pvc.get("spec") or {}).get(
            "accessModes", []):
          report.error(source, "PersistentVolumeClaim %s is shared by W workers and the server: "
                       "accessModes must include ReadWriteMany" % claim)
    for flag in ("token_file",):
      path = inv.flag(flag)
      if path:
        m = mount_for(c, path)
        v = volume_named(pod, m.get("name")) if m else None
        secret = ((v or {}).get("secret") or {}).get("secretName")
        if not secret:
          report.error(source, "%s: --%s=%s is not on a Secret volume" % (name, flag, path))
        elif server_secret and secret != server_secret:
          report.error(source, "%s: --%s comes from Secret %r, the server's token from %r"
                       % (name, flag, secret, server_secret))
    if server_secret and not inv.flag("token_file"):
      report.error(source, "%s: the server requires a token (--auth_token_file) but "
                   "shard_worker has no --token_file" % name)


# ---- Slurm ----

def check_slurm(name, text, flagsets, report):
  sbatch = {}
  for m in re.finditer(r"^#SBATCH\s+--([a-z-]+)(?:[= ](\S+))?", text, re.M):
    sbatch[m.group(1)] = m.group(2)
  for needed in ("nodes", "ntasks-per-node", "gpus-per-task"):
    if needed not in sbatch:
      report.error(name, "no #SBATCH --%s" % needed)
  invs = invocations_in_shell(text, name)
  for inv in invs:
    check_flags(inv, flagsets, report)
  servers = [i for i in invs if i.binary == "shard_server"]
  workers = [i for i in invs if i.binary == "shard_worker"]
  clients = [i for i in invs if i.binary == "shardctl"]
  if len(servers) != 1:
    report.error(name, "expected one shard_server step, found %d" % len(servers))
  if len(workers) != 1:
    report.error(name, "expected one shard_worker step, found %d" % len(workers))
  if not any("status" in i.argv for i in clients):
    report.error(name, "no `shardctl ... status` health wait")
  for s in servers:
    if s.launcher[:1] != ["srun"]:
      report.error(name, "shard_server (%s) is not started by srun" % s.where)
    elif "--overlap" not in s.launcher:
      report.error(name, "shard_server (%s): its srun step needs --overlap" % s.where)
    if not s.background:
      report.error(name, "shard_server (%s) must run in the background (&)" % s.where)
    for flag in ("listen", "state_dir", "checkpoint_root"):
      if not s.flag(flag):
        report.error(name, "shard_server (%s) has no --%s" % (s.where, flag))
  for w in workers:
    if w.launcher[:1] != ["srun"]:
      report.error(name, "shard_worker (%s) is not started by srun" % w.where)
    expect = {
        "worker_id": r"\$\(hostname\)/\$SLURM_LOCALID|\$SLURMD_NODENAME/\$SLURM_LOCALID",
        "world_size": r"^\$\{?SLURM_NTASKS\}?$",
        "backend": r"^nccl$",
        "server": r".+:.+",
        "checkpoint_dir": r".+",
    }
    for flag, pattern in sorted(expect.items()):
      value = w.flag(flag)
      if value is None or not re.search(pattern, value):
        report.error(name, "shard_worker (%s): --%s=%s, expected to match /%s/"
                     % (w.where, flag, value, pattern))
    # A node's name need not resolve (tests/slurm's nodes: it did not); the
    # default --host is the node's address on its route to the server.
    host = w.flag("host")
    if host is not None and re.search(r"hostname|SLURMD_NODENAME", host):
      report.error(name, "shard_worker (%s): --host=%s is a node name, which need not resolve; "
                   "leave --host to its default (the address on the route to --server)"
                   % (w.where, host))
    if servers:
      s = servers[0]
      if w.flag("checkpoint_dir") != s.flag("checkpoint_root"):
        report.error(name, "shard_worker --checkpoint_dir=%s differs from shard_server "
                     "--checkpoint_root=%s" % (w.flag("checkpoint_dir"),
                                               s.flag("checkpoint_root")))
      _, listen = port_of(s.flag("listen"))
      _, port = port_of(w.flag("server"))
      if listen is None or port is None or listen != port:
        report.error(name, "shard_worker --server=%s does not use the server's --listen port (%s)"
                     % (w.flag("server"), s.flag("listen")))
  if not re.search(r"^\s*trap\s+\S+.*\bEXIT\b", text, re.M):
    report.error(name, "no `trap ... EXIT` to stop the server when the script ends")


# ---- systemd ----

def parse_unit(text):
  """section -> list of (key, value); continuation lines joined."""
  sections = {}
  current = None
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    i += 1
    stripped = line.strip()
    if not stripped or stripped[0] in "#;":
      continue
    while stripped.endswith("\\") and i < len(lines):
      nxt = lines[i].strip()
      i += 1
      if nxt[:1] in ("#", ";"):
        continue
      stripped = stripped[:-1] + " " + nxt
    m = re.match(r"^\[(.+)\]$", stripped)
    if m:
      current = m.group(1)
      sections.setdefault(current, [])
      continue
    key, _, value = stripped.partition("=")
    sections.setdefault(current, []).append((key.strip(), value.strip()))
  return sections


def parse_env_file(text):
  values = {}
  for line in text.splitlines():
    s = line.strip()
    if not s or s[0] in "#;":
      continue
    key, eq, value = s.partition("=")
    if not eq:
      continue
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
      value = value[1:-1]
    values[key.strip()] = value
  return values


def check_systemd(unit_name, unit_text, env_name, env_text, flagsets, report, installed_as=None):
  unit = parse_unit(unit_text)
  service = unit.get("Service") or []

  def get(key):
    return [v for k, v in service if k == key]

  env = parse_env_file(env_text)
  env_files = get("EnvironmentFile")
  loaded = os.path.basename(installed_as or env_name)
  if not any(os.path.basename(f.lstrip("-")) == loaded for f in env_files):
    report.error(unit_name, "EnvironmentFile= does not load %s (found %s)" % (loaded, env_files))
  exec_start = get("ExecStart")
  if len(exec_start) != 1:
    report.error(unit_name, "expected one ExecStart=, found %d" % len(exec_start))
    return
  command = exec_start[0].lstrip("@-+!:")
  referenced = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", command))
  for var in sorted(referenced - set(env)):
    report.error(unit_name, "ExecStart uses $%s, which %s does not set" % (var, env_name))
  for var in sorted(set(env) - referenced):
    report.error(env_name, "%s is set but ExecStart in %s does not use it" % (var, unit_name))
  # systemd: ${VAR} is one argument, $VAR splits at whitespace.
  argv = []
  e = Env(env, systemd=True)
  for t in lex(command):
    if isinstance(t, Word):
      argv.extend(expand(t.raw, e))
  invs = invocations_in_argv(argv, e, unit_name + " + " + os.path.basename(env_name), "ExecStart")
  if not invs or invs[0].binary != "shard_server":
    report.error(unit_name, "ExecStart does not run shard_server: %s" % command)
    return
  for inv in invs:
    check_flags(inv, flagsets, report)
  inv = invs[0]
  wants = {
      "Restart": "on-failure",
      "StateDirectory": "zeroshard",
      "NoNewPrivileges": "yes",
      "ProtectSystem": "strict",
      "PrivateTmp": "yes",
  }
  for key, value in sorted(wants.items()):
    if value not in get(key):
      report.error(unit_name, "[Service] needs %s=%s (found %s)" % (key, value, get(key)))
  user = get("User")
  if not user or user[-1] in ("root", "0"):
    report.error(unit_name, "[Service] needs a dedicated User= (found %s)" % user)
  writable = ["/var/lib/" + d for v in get("StateDirectory") for d in v.split()]
  writable += [p.lstrip("-+") for v in get("ReadWritePaths") for p in v.split()]
  if not get("ReadWritePaths"):
    report.error(unit_name, "[Service] has no ReadWritePaths=")
  replicated = bool(inv.flag("etcd_endpoints"))
  if replicated and not inv.flag("metrics_listen"):
    report.error(env_name, "a replicated server needs --metrics_listen: its health check and a "
                 "follower's /metrics (docs/deploy.md) read that port")
  for flag in ("state_dir", "checkpoint_root"):
    path = inv.flag(flag)
    if flag == "state_dir" and replicated:
      if path:
        report.error(env_name, "--state_dir=%s beside --etcd_endpoints: the state is in etcd"
                     % path)
      continue
    if not path:
      report.error(unit_name, "shard_server has no --%s" % flag)
    elif not any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable):
      report.error(unit_name, "--%s=%s is not writable under ProtectSystem=strict: not below "
                   "StateDirectory= or ReadWritePaths= %s" % (flag, path, writable))


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

SLURM = "deploy/slurm/zeroshard.sbatch"
UNIT = "deploy/systemd/zeroshard-server.service"
ENVFILE = "deploy/systemd/zeroshard-server.env"
HA_ENVFILE = "deploy/systemd/zeroshard-server-ha.env"
ETCD_UNIT = "deploy/systemd/zeroshard-etcd.service"
ETCD_ENVFILE = "deploy/systemd/zeroshard-etcd.env"


def etcd_flag_names():
  """etcd's flags from its own --help (None: no etcd binary here)."""
  import shutil
  import subprocess
  binary = shutil.which("etcd")
  if binary is None:
    return None
  out = subprocess.run([binary, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=30).stdout
  return set(re.findall(r"^\s+--([a-z0-9-]+)", out, re.M))


def check_etcd_unit(unit_name, unit_text, env_name, env_text, etcd_flags, report):
  """The etcd member's unit loads its environment file, runs etcd, keeps its
  data below StateDirectory=, and every ETCD_* setting is one of etcd's flags
  (etcd reads ETCD_NAME as --name, ...)."""
  unit = parse_unit(unit_text)
  service = unit.get("Service") or []

  def get(key):
    return [v for k, v in service if k == key]

  env = parse_env_file(env_text)
  if not any(os.path.basename(f.lstrip("-")) == os.path.basename(env_name)
             for f in get("EnvironmentFile")):
    report.error(unit_name, "EnvironmentFile= does not load %s" % os.path.basename(env_name))
  exec_start = get("ExecStart")
  if len(exec_start) != 1 or os.path.basename(exec_start[0].split()[0].lstrip("@-+!:")) != "etcd":
    report.error(unit_name, "expected one ExecStart= running etcd, found %s" % exec_start)
  for var in sorted(env):
    if not var.startswith("ETCD_"):
      report.error(env_name, "%s is not an etcd setting (ETCD_*)" % var)
    elif etcd_flags is not None:
      flag = var[len("ETCD_"):].lower().replace("_", "-")
      if flag not in etcd_flags:
        report.error(env_name, "%s: etcd has no --%s (etcd --help)" % (var, flag))
  for needed in ("ETCD_NAME", "ETCD_DATA_DIR", "ETCD_INITIAL_CLUSTER"):
    if needed not in env:
      report.error(env_name, "%s is not set" % needed)
  data = env.get("ETCD_DATA_DIR", "")
  writable = ["/var/lib/" + d for v in get("StateDirectory") for d in v.split()]
  if data and not any(data == w or data.startswith(w.rstrip("/") + "/") for w in writable):
    report.error(unit_name, "ETCD_DATA_DIR=%s is not below StateDirectory= %s" % (data, writable))


HA_K8S = "deploy/k8s/ha/"


def check_k8s_flags(files, flagsets, report):
  """Every zeroshard binary a manifest runs gets only flags it accepts."""
  found = 0
  docs = [(n, d) for n, ds in sorted(files.items()) for d in ds if isinstance(d, dict)]
  for source, _, _, _, c, where in pod_containers(docs):
    for inv in container_invocations(c, source, where):
      check_flags(inv, flagsets, report)
      found += 1
  if files and found == 0:
    report.error(HA_K8S, "no zeroshard binary found in %s" % ", ".join(sorted(files)))


def read_templates(root):
  texts = {}
  for pattern in ("deploy/k8s/*.yaml", "deploy/k8s/ha/*.yaml"):
    for path in sorted(glob.glob(os.path.join(root, pattern))):
      texts[os.path.relpath(path, root)] = open(path).read()
  for rel in (SLURM, UNIT, ENVFILE, HA_ENVFILE, ETCD_UNIT, ETCD_ENVFILE):
    path = os.path.join(root, rel)
    if not os.path.exists(path):
      raise SystemExit("templates_test: %s is missing" % rel)
    texts[rel] = open(path).read()
  for rel in ("deploy/k8s/server.yaml", "deploy/k8s/workers.yaml"):
    if rel not in texts:
      raise SystemExit("templates_test: %s is missing" % rel)
  return texts


def run_checks(texts, flagsets, k8s_docs=None):
  report = Report(texts)
  if k8s_docs is None:
    k8s_docs = {}
    for name, text in texts.items():
      if name.endswith(".yaml"):
        try:
          k8s_docs[name] = list(yaml.safe_load_all(text))
        except yaml.YAMLError as e:
          report.error(name, "invalid YAML: %s" % e)
  # Three servers on etcd (deploy/k8s/ha) are another deployment of the
  # same Job: their own invocations' flags are checked here, the one
  # server's structure (its claim, probes, Service) by check_k8s.
  ha = {n: d for n, d in k8s_docs.items() if n.startswith(HA_K8S)}
  check_k8s({n: d for n, d in k8s_docs.items() if n not in ha}, flagsets, report)
  check_k8s_flags(ha, flagsets, report)
  try:
    check_slurm(SLURM, texts[SLURM], flagsets, report)
  except ValueError as e:
    report.error(SLURM, "cannot read the shell script: %s" % e)
  for env_file in (ENVFILE, HA_ENVFILE):
    if env_file not in texts:
      continue
    try:
      # The HA file is installed in the single server's file's place.
      check_systemd(UNIT, texts[UNIT], env_file, texts[env_file], flagsets, report,
                    installed_as=ENVFILE)
    except ValueError as e:
      report.error(UNIT, "cannot read ExecStart with %s: %s" % (env_file, e))
  if ETCD_UNIT in texts and ETCD_ENVFILE in texts:
    check_etcd_unit(ETCD_UNIT, texts[ETCD_UNIT], ETCD_ENVFILE, texts[ETCD_ENVFILE],
                    ETCD_FLAGS, report)
  check_server_auth(report)
  return report


ETCD_FLAGS = etcd_flag_names()

AUTH_FLAGS = ("auth_token_file", "job_tokens_dir", "tls_client_ca", "insecure")


def check_server_auth(report):
  """A shard_server listening off loopback with no authentication refuses to
  start unless --insecure says so: every template's server must pass one."""
  for inv in report.invocations:
    if inv.binary != "shard_server":
      continue
    host, _ = port_of(inv.flag("listen"))
    host = (host or "").strip("[]")
    if host.startswith("127.") or host in ("::1", "localhost"):
      continue
    if not any(inv.flag(f) is not None or (f, None) in inv.flags() for f in AUTH_FLAGS):
      report.error(inv.source, "shard_server (%s) listens on --listen=%s with no authentication "
                   "(--auth_token_file, --job_tokens_dir, --tls_client_ca) and no --insecure: "
                   "it refuses to start" % (inv.where, inv.flag("listen")))


def self_test(texts, flagsets, baseline):
  """The checker must catch: every flag name a template uses, renamed; and a
  few broken structures. Returns a list of misses."""
  misses = []
  used = {}  # file -> flag names seen there
  for inv in baseline.invocations:
    files = [f for f in texts if inv.source == f or inv.source.startswith(f + " ")]
    for f in files:
      used.setdefault(f, set()).update(n for n, _ in inv.flags())
  # The env file's flags are reported against the unit + env pair.
  for inv in baseline.invocations:
    if inv.source.startswith(UNIT + " + "):
      used.setdefault(ENVFILE, set()).update(n for n, _ in inv.flags())
  renamed_count = 0
  for f, names in sorted(used.items()):
    for flag in sorted(names):
      bogus = flag + "_zzbogus"
      mutated, count = re.subn(r"--%s(?=[=\s\"'\\]|$)" % re.escape(flag), "--" + bogus, texts[f],
                               flags=re.M)
      if count == 0:
        continue  # the flag is in another file of the pair
      renamed_count += 1
      t = dict(texts)
      t[f] = mutated
      r = run_checks(t, flagsets)
      if not any(("--" + bogus) in e and "does not accept" in e for e in r.errors):
        misses.append("%s: --%s renamed to --%s was not reported" % (f, flag, bogus))
  if renamed_count < 20:
    misses.append("only %d flags could be renamed: is the template reader finding the "
                  "invocations?" % renamed_count)

  # The structural mutations are of the one-server deployment.
  docs = {n: list(yaml.safe_load_all(s)) for n, s in texts.items()
          if n.endswith(".yaml") and not n.startswith(HA_K8S)}

  def mutate(description, fn, expect):
    d = copy.deepcopy(docs)
    applied = False
    for name in d:
      for doc in d[name]:
        if isinstance(doc, dict) and fn(doc):
          applied = True
    r = run_checks(texts, flagsets, k8s_docs=d)
    if not applied:
      misses.append("mutation '%s' found nothing to change" % description)
    elif not any(expect in e for e in r.errors):
      misses.append("mutation '%s' was not reported (expected '%s'; got %s)"
                    % (description, expect, r.errors))

  def job(fn):
    return lambda doc: doc.get("kind") == "Job" and fn(doc["spec"]) is None

  def first_container(kind, fn):
    def apply(doc):
      if doc.get("kind") != kind:
        return False
      fn(doc["spec"]["template"]["spec"]["containers"][0])
      return True
    return apply

  mutate("parallelism != completions", job(lambda s: s.update(parallelism=s["completions"] + 1)),
         "must equal completions")
  mutate("NonIndexed job", job(lambda s: s.update(completionMode="NonIndexed")),
         "completionMode must be Indexed")
  mutate("httpGet readiness probe",
         first_container("StatefulSet", lambda c: c.update(
             readinessProbe={"httpGet": {"port": 7070, "path": "/"}})),
         "readinessProbe must be a native gRPC probe")
  mutate("liveness probe on another port",
         first_container("StatefulSet", lambda c: c["livenessProbe"]["grpc"].update(port=7071)),
         "livenessProbe probes gRPC port 7071")
  mutate("state dir mounted elsewhere",
         first_container("StatefulSet", lambda c: [m.update(mountPath="/elsewhere")
                                                    for m in c["volumeMounts"]]),
         "--state_dir=")
  mutate("worker --server to a missing Service",
         first_container("Job", lambda c: c.update(args=[
             "--server=nowhere:7070" if a.startswith("--server=") else a for a in c["args"]])),
         "--server=nowhere:7070 is not a Service")

  # A server off loopback that authenticates no one, told nothing.
  t = dict(texts)
  t[ENVFILE] = re.sub(r" --insecure\b", "", texts[ENVFILE])
  if t[ENVFILE] == texts[ENVFILE] or not any(
      "no authentication" in e for e in run_checks(t, flagsets).errors):
    misses.append("dropping --insecure from %s's unauthenticated server was not reported"
                  % ENVFILE)

  # Shell structure: the sbatch script without its trap.
  t = dict(texts)
  t[SLURM] = re.sub(r"^(\s*)trap (\S+) EXIT", r"\1: \2", texts[SLURM], flags=re.M)
  if t[SLURM] == texts[SLURM] or not any("trap" in e for e in run_checks(t, flagsets).errors):
    misses.append("removing the sbatch script's EXIT trap was not reported")
  return misses


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shard_server", required=True)
  parser.add_argument("--shard_worker", required=True)
  parser.add_argument("--shardctl", required=True)
  parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "..", ".."),
                      help="the directory holding deploy/")
  parser.add_argument("--skip_self_test", action="store_true")
  args = parser.parse_args()

  flagsets = {
      "shard_server": load_flagset("shard_server", args.shard_server),
      "shard_worker": load_flagset("shard_worker", args.shard_worker),
      "shardctl": load_flagset("shardctl", args.shardctl),
  }
  for b, fs in sorted(flagsets.items()):
    print("%s accepts %d flags" % (b, len(fs.flags)))
  texts = read_templates(args.root)
  report = run_checks(texts, flagsets)
  for inv in report.invocations:
    print("  %s (%s): %s %s" % (inv.source, inv.where, inv.binary,
                                " ".join("--" + n for n, _ in inv.flags())))
  if report.errors:
    print("\nFAIL: %d problem(s) in the deploy templates:" % len(report.errors))
    for e in report.errors:
      print("  " + e)
    return 1
  by_binary = {}
  for inv in report.invocations:
    by_binary[inv.binary] = by_binary.get(inv.binary, 0) + 1
  for b in BINARIES:
    if not by_binary.get(b):
      print("FAIL: the templates never invoke %s: the reader must be broken" % b)
      return 1
  print("\nOK: %d invocations in %d files, every flag accepted (%s)"
        % (len(report.invocations), len(texts),
           ", ".join("%s x%d" % (b, by_binary[b]) for b in BINARIES)))
  if not args.skip_self_test:
    misses = self_test(texts, flagsets, report)
    if misses:
      print("\nFAIL: the checker missed injected faults:")
      for m in misses:
        print("  " + m)
      return 1
    print("OK: the checker reports every renamed flag and each injected structural fault")
  return 0


if __name__ == "__main__":
  sys.exit(main())
