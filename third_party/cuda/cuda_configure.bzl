"""cuda_configure: finds the local CUDA toolkit and NCCL; never downloads anything.

Use in WORKSPACE:

    load("//third_party/cuda:cuda_configure.bzl", "cuda_configure")
    cuda_configure(name = "local_cuda")

Where CUDA is looked for, first match wins:
  1. $CUDA_HOME. When it is set it is authoritative: if it holds no usable
     toolkit, CUDA is reported unavailable rather than silently taken from
     elsewhere (so CUDA_HOME=/nonexistent is the way to build without CUDA).
  2. The parent of the directory of `nvcc` on $PATH (also with symlinks
     resolved, for distributions that put a symlink in /usr/bin).
  3. /usr/local/cuda.
NCCL ($NCCL_HOME if set, else the CUDA directory, else /usr and
/usr/lib/x86_64-linux-gnu, else /usr/local) must provide nccl.h and
libnccl.so.

The generated repository provides:
  @local_cuda//:cuda_headers  the toolkit's include directory
  @local_cuda//:cudart        headers + -lcudart (rpath set, binaries run in place)
  @local_cuda//:cublas        + -lcublas -lcublasLt
  @local_cuda//:nccl          + nccl.h, -lnccl
  @local_cuda//:defs.bzl      CUDA_AVAILABLE, CUDA_HOME, NVCC, CUDA_VERSION,
                              NCCL_VERSION, CUDA_REASON (why it is unavailable)
Without a usable CUDA + cuBLAS + NCCL the same targets exist but are empty,
CUDA_AVAILABLE is False, and //third_party/cuda:cuda.bzl leaves every GPU
target out, so the rest of the workspace still builds.

The rule re-runs when CUDA_HOME, NCCL_HOME or PATH change; after installing or
moving a toolkit without changing them, run `bazel sync --configure`.
"""

_LIB_SUBDIRS = ["lib64", "lib", "targets/x86_64-linux/lib", "lib/x86_64-linux-gnu"]

def _exists(rctx, path):
    return rctx.path(path).exists

def _find_lib_dir(rctx, home, lib):
    for sub in _LIB_SUBDIRS:
        d = "%s/%s" % (home, sub)
        if _exists(rctx, "%s/lib%s.so" % (d, lib)):
            return d
    return None

def _check_cuda_home(rctx, home):
    """Returns (struct, None) for a usable toolkit at `home`, else (None, reason)."""
    if not _exists(rctx, home):
        return None, "%s does not exist" % home
    nvcc = home + "/bin/nvcc"
    if not _exists(rctx, nvcc):
        return None, "%s has no bin/nvcc" % home
    include = home + "/include"
    if not _exists(rctx, include + "/cuda_runtime.h"):
        return None, "%s has no include/cuda_runtime.h" % home
    if not _exists(rctx, include + "/cublas_v2.h"):
        return None, "%s has no include/cublas_v2.h (cuBLAS)" % home
    lib = _find_lib_dir(rctx, home, "cudart")
    if lib == None:
        return None, "%s has no libcudart.so under %s" % (home, ", ".join(_LIB_SUBDIRS))
    if not _exists(rctx, lib + "/libcublas.so") or not _exists(rctx, lib + "/libcublasLt.so"):
        return None, "%s has no libcublas.so / libcublasLt.so" % lib
    return struct(home = home, nvcc = nvcc, include = include, lib = lib), None

def _find_cuda(rctx):
    """Returns (struct, None) or (None, reason), following the order in the module doc."""
    cuda_home = rctx.os.environ.get("CUDA_HOME", "")
    if cuda_home:
        cuda, reason = _check_cuda_home(rctx, cuda_home)
        if cuda == None:
            return None, "CUDA_HOME=%s: %s" % (cuda_home, reason)
        return cuda, None
    reasons = []
    nvcc = rctx.which("nvcc")
    if nvcc != None:
        candidates = [str(nvcc.dirname.dirname)]
        real = str(nvcc.realpath.dirname.dirname)
        if real not in candidates:
            candidates.append(real)
        for home in candidates:
            cuda, reason = _check_cuda_home(rctx, home)
            if cuda != None:
                return cuda, None
            reasons.append("nvcc on PATH (%s): %s" % (nvcc, reason))
    else:
        reasons.append("no nvcc on PATH")
    cuda, reason = _check_cuda_home(rctx, "/usr/local/cuda")
    if cuda != None:
        return cuda, None
    reasons.append(reason)
    return None, "; ".join(reasons)

def _find_nccl(rctx, cuda):
    """Returns (struct(include, lib), None) or (None, reason)."""
    candidates = []
    nccl_home = rctx.os.environ.get("NCCL_HOME", "")
    if nccl_home:
        candidates.append((nccl_home + "/include", _find_lib_dir(rctx, nccl_home, "nccl")))
    else:
        candidates.append((cuda.include, _find_lib_dir(rctx, cuda.home, "nccl")))
        candidates.append(("/usr/include", "/usr/lib/x86_64-linux-gnu"))
        candidates.append(("/usr/local/include", _find_lib_dir(rctx, "/usr/local", "nccl")))
    for include, lib in candidates:
        if lib != None and _exists(rctx, include + "/nccl.h") and _exists(rctx, lib + "/libnccl.so"):
            return struct(include = include, lib = lib), None
    if nccl_home:
        return None, "NCCL_HOME=%s has no include/nccl.h and lib*/libnccl.so" % nccl_home
    return None, "no nccl.h + libnccl.so under %s, /usr or /usr/local" % cuda.home

def _define(rctx, header, name):
    """The integer value of `#define name N` in `header`, or 0."""
    for line in rctx.read(header).splitlines():
        parts = [p for p in line.replace("\t", " ").split(" ") if p]
        if len(parts) >= 3 and parts[0] == "#define" and parts[1] == name and parts[2].isdigit():
            return int(parts[2])
    return 0

_STUB_BUILD = """# Generated by //third_party/cuda:cuda_configure.bzl: CUDA is NOT available.
# Reason: {reason}
# These targets are empty so that labels resolve; //third_party/cuda:cuda.bzl
# leaves every GPU target out of the build.
package(default_visibility = ["//visibility:public"])

cc_library(name = "cuda_headers")

cc_library(name = "cudart")

cc_library(name = "cublas")

cc_library(name = "nccl")
"""

_BUILD = """# Generated by //third_party/cuda:cuda_configure.bzl from {home}.
package(default_visibility = ["//visibility:public"])

# The toolkit's headers. Some (CCCL's <nv/target>, used by cuda_fp16.h) have
# no file extension, which cc_library only accepts as textual headers.
cc_library(
    name = "cuda_headers",
    hdrs = glob(["cuda/include/**/*.h", "cuda/include/**/*.hpp", "cuda/include/**/*.cuh"]),
    textual_hdrs = glob(
        ["cuda/include/**"],
        exclude = [
            "cuda/include/**/*.h",
            "cuda/include/**/*.hpp",
            "cuda/include/**/*.cuh",
        ],
    ),
    includes = ["cuda/include"],
)

# Linked by absolute path with an rpath: the libraries stay where the toolkit
# installed them (their sonames are versioned, so copying the unversioned
# symlinks next to the binary would not satisfy the loader).
cc_library(
    name = "cudart",
    linkopts = [
        "-L{lib}",
        "-Wl,-rpath,{lib}",
        "-lcudart",
        "-ldl",
        "-lrt",
        "-lpthread",
    ],
    deps = [":cuda_headers"],
)

cc_library(
    name = "cublas",
    linkopts = [
        "-L{lib}",
        "-Wl,-rpath,{lib}",
        "-lcublas",
        "-lcublasLt",
    ],
    deps = [":cudart"],
)

cc_library(
    name = "nccl",
{nccl_hdrs}
    linkopts = [
        "-L{nccl_lib}",
        "-Wl,-rpath,{nccl_lib}",
        "-lnccl",
    ],
    deps = [":cudart"],
)
"""

_DEFS = """# Generated by //third_party/cuda:cuda_configure.bzl.
CUDA_AVAILABLE = {available}
CUDA_REASON = {reason}
CUDA_HOME = {home}
NVCC = {nvcc}
CUDA_VERSION = {cuda_version}
NCCL_VERSION = {nccl_version}
"""

def _cuda_configure_impl(rctx):
    cuda, reason = _find_cuda(rctx)
    nccl = None
    if cuda != None:
        nccl, reason = _find_nccl(rctx, cuda)
    if cuda == None or nccl == None:
        rctx.file("BUILD.bazel", _STUB_BUILD.format(reason = reason))
        rctx.file("defs.bzl", _DEFS.format(
            available = "False",
            reason = repr(reason),
            home = repr(""),
            nvcc = repr(""),
            cuda_version = "0",
            nccl_version = "0",
        ))
        return

    # Symlinks, not copies: the toolkit is large and must stay consistent with
    # the libraries the binaries load at run time.
    rctx.symlink(cuda.include, "cuda/include")
    rctx.symlink(cuda.lib, "cuda/lib")
    rctx.symlink(cuda.home + "/bin", "cuda/bin")
    if nccl.include == cuda.include:
        # nccl.h is already one of :cuda_headers; declaring it twice under two
        # include paths would make the inclusion check depend on their order.
        nccl_hdrs = ""
    else:
        # Only nccl.h: its directory may be /usr/include, which must not be
        # exported wholesale.
        rctx.symlink(nccl.include + "/nccl.h", "nccl/include/nccl.h")
        nccl_hdrs = '    hdrs = ["nccl/include/nccl.h"],\n    includes = ["nccl/include"],\n'

    cuda_version = _define(rctx, cuda.include + "/cuda_runtime_api.h", "CUDART_VERSION")
    nccl_version = _define(rctx, nccl.include + "/nccl.h", "NCCL_VERSION_CODE")
    rctx.file("BUILD.bazel", _BUILD.format(
        home = cuda.home,
        lib = cuda.lib,
        nccl_lib = nccl.lib,
        nccl_hdrs = nccl_hdrs,
    ))
    rctx.file("defs.bzl", _DEFS.format(
        available = "True",
        reason = repr(""),
        home = repr(cuda.home),
        nvcc = repr(cuda.nvcc),
        cuda_version = str(cuda_version),
        nccl_version = str(nccl_version),
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_HOME", "NCCL_HOME", "PATH"],
    configure = True,
    local = True,
    doc = "Finds the local CUDA toolkit and NCCL (see the module docstring).",
)
