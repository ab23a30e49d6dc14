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

cuDNN (optional; the fused attention of worker/cuda/cudnn_attention.h):
  headers: $CUDNN_HOME/include if set (authoritative, as CUDA_HOME), else the
    CUDA include directory, /usr/include, /usr/include/x86_64-linux-gnu or
    /usr/local/include: cudnn.h and cudnn_version.h, cuDNN 9 or newer.
  frontend: the header-only cuDNN frontend (cudnn_frontend.h) in
    $CUDNN_FRONTEND_INCLUDE if set (authoritative), else in the cache
    directory tools/install_deps.sh unpacks it to,
    ${XDG_CACHE_HOME:-$HOME/.cache}/zeroshard/cudnn_frontend-<version>/include,
    <version> as pinned in //third_party/cuda:cudnn_frontend.pin (an older
    frontend is refused; a newer one is taken).
  libcudnn.so.9 is not needed to build: the frontend is compiled in its
  dynamic-loading mode and libcudnn is dlopen'ed on first use. When found
  (beside the headers, under $CUDNN_HOME, or in /usr/lib/x86_64-linux-gnu)
  its directory is the binaries' runpath, so they find it in place.

The generated repository provides:
  @local_cuda//:cuda_headers  the toolkit's include directory
  @local_cuda//:cudart        headers + -lcudart (rpath set, binaries run in place)
  @local_cuda//:cublas        + -lcublas -lcublasLt
  @local_cuda//:nccl          + nccl.h, -lnccl
  @local_cuda//:cudnn_frontend  the cuDNN and frontend headers, compiled with
                              NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING (no -lcudnn:
                              the user dlopens it) and CUDNN_FRONTEND_SKIP_JSON_LIB
  @local_cuda//:defs.bzl      CUDA_AVAILABLE, CUDA_HOME, NVCC, CUDA_VERSION,
                              NCCL_VERSION, CUDA_REASON (why it is unavailable),
                              CUDNN_AVAILABLE, CUDNN_REASON, CUDNN_VERSION
                              (91900 for 9.19.0), CUDNN_FRONTEND_VERSION (13200),
                              CUDNN_FRONTEND_INCLUDE, CUDNN_LIB_DIR ("" if none)
Without a usable CUDA + cuBLAS + NCCL the same targets exist but are empty,
CUDA_AVAILABLE is False, and //third_party/cuda:cuda.bzl leaves every GPU
target out, so the rest of the workspace still builds. Likewise without cuDNN
or its frontend (CUDNN_AVAILABLE False): :cudnn_frontend is empty and the
cudnn_* macros of cuda.bzl leave their targets out.

The rule re-runs when CUDA_HOME, NCCL_HOME, CUDNN_HOME, CUDNN_FRONTEND_INCLUDE,
HOME, XDG_CACHE_HOME or PATH change; after installing or moving a toolkit, cuDNN
or the frontend without changing them (e.g. the first tools/install_deps.sh
after a build), run `bazel sync --configure`.
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

def _find_cudnn_headers(rctx, cuda):
    """Returns (include dir, None) or (None, reason)."""
    cudnn_home = rctx.os.environ.get("CUDNN_HOME", "")
    if cudnn_home:
        dirs = [cudnn_home + "/include"]
    else:
        dirs = [cuda.include, "/usr/include", "/usr/include/x86_64-linux-gnu", "/usr/local/include"]
    for d in dirs:
        if _exists(rctx, d + "/cudnn.h") and _exists(rctx, d + "/cudnn_version.h"):
            return d, None
    where = ("CUDNN_HOME=%s: " % cudnn_home) if cudnn_home else ""
    return None, "%sno cudnn.h + cudnn_version.h in %s" % (where, ", ".join(dirs))

def _find_cudnn_lib(rctx, cuda, major):
    """The directory holding libcudnn.so.<major>, or "" (not needed to build)."""
    cudnn_home = rctx.os.environ.get("CUDNN_HOME", "")
    homes = [cudnn_home] if cudnn_home else [cuda.home]
    dirs = []
    for home in homes:
        dirs += ["%s/%s" % (home, sub) for sub in _LIB_SUBDIRS]
    if not cudnn_home:
        dirs.append("/usr/lib/x86_64-linux-gnu")
    for d in dirs:
        if _exists(rctx, "%s/libcudnn.so.%d" % (d, major)):
            return d
    return ""

def _pinned_frontend_version(rctx):
    pin = rctx.read(rctx.path(Label("//third_party/cuda:cudnn_frontend.pin")))
    for line in pin.splitlines():
        if line.startswith("version="):
            return line[len("version="):].strip()
    fail("third_party/cuda/cudnn_frontend.pin has no version= line")

def _version_code(text):
    """"1.32.0" -> 13200, as CUDNN_FRONTEND_VERSION counts."""
    parts = [int(p) for p in text.split(".")]
    return parts[0] * 10000 + parts[1] * 100 + parts[2]

def _find_cudnn_frontend(rctx):
    """Returns (struct(include, version), None) or (None, reason)."""
    pinned = _pinned_frontend_version(rctx)
    explicit = rctx.os.environ.get("CUDNN_FRONTEND_INCLUDE", "")
    if explicit:
        include = explicit
        where = "CUDNN_FRONTEND_INCLUDE=%s" % explicit
    else:
        cache = rctx.os.environ.get("XDG_CACHE_HOME", "")
        if not cache:
            cache = rctx.os.environ.get("HOME", "") + "/.cache"
        include = "%s/zeroshard/cudnn_frontend-%s/include" % (cache, pinned)
        where = include
    header = include + "/cudnn_frontend_version.h"
    if not _exists(rctx, include + "/cudnn_frontend.h") or not _exists(rctx, header):
        return None, ("%s has no cudnn_frontend.h / cudnn_frontend_version.h (tools/install_deps.sh " +
                      "fetches the frontend; then `bazel sync --configure`)") % where
    version = (_define(rctx, header, "CUDNN_FRONTEND_MAJOR_VERSION") * 10000 +
               _define(rctx, header, "CUDNN_FRONTEND_MINOR_VERSION") * 100 +
               _define(rctx, header, "CUDNN_FRONTEND_PATCH_VERSION"))
    if version < _version_code(pinned):
        return None, "%s: cuDNN frontend %d is older than the pinned %s" % (where, version, pinned)
    return struct(include = include, version = version), None

def _find_cudnn(rctx, cuda):
    """Returns (struct, None) for usable cuDNN headers + frontend, else (None, reason)."""
    include, reason = _find_cudnn_headers(rctx, cuda)
    if include == None:
        return None, reason
    version_h = include + "/cudnn_version.h"
    major = _define(rctx, version_h, "CUDNN_MAJOR")
    version = (major * 10000 + _define(rctx, version_h, "CUDNN_MINOR") * 100 +
               _define(rctx, version_h, "CUDNN_PATCHLEVEL"))
    if major < 9:
        return None, "%s: cuDNN %d found, 9 or newer needed" % (version_h, version)
    frontend, reason = _find_cudnn_frontend(rctx)
    if frontend == None:
        return None, reason
    return struct(
        include = include,
        version = version,
        lib = _find_cudnn_lib(rctx, cuda, major),
        frontend = frontend,
    ), None

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

cc_library(name = "cudnn_frontend")
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
CUDNN_AVAILABLE = {cudnn_available}
CUDNN_REASON = {cudnn_reason}
CUDNN_VERSION = {cudnn_version}
CUDNN_FRONTEND_VERSION = {cudnn_frontend_version}
CUDNN_FRONTEND_INCLUDE = {cudnn_frontend_include}
CUDNN_LIB_DIR = {cudnn_lib}
"""

# cuDNN's headers and the frontend's (the frontend directory is symlinked in
# whole; cuDNN's headers only when they are not already the toolkit's).
_CUDNN_BUILD = """
# The cuDNN frontend over cuDNN's headers, with libcudnn loaded at run time
# (dynamic-loading mode: no -lcudnn; the user sets cudnn_frontend::cudnn_dlhandle).
# JSON (the frontend's serialization and errata file) is compiled out.
cc_library(
    name = "cudnn_frontend",
    hdrs = glob(["cudnn_frontend/include/**"]){cudnn_hdrs},
    includes = ["cudnn_frontend/include"{cudnn_includes}],
    defines = [
        "NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING",
        "CUDNN_FRONTEND_SKIP_JSON_LIB",
    ],
    linkopts = ["-ldl"{cudnn_rpath}],
    deps = [":cuda_headers"],
)
"""

_CUDNN_STUB_BUILD = """
# cuDNN is NOT available: {reason}
cc_library(name = "cudnn_frontend")
"""

def _cudnn_build(rctx, cuda, cudnn):
    """Symlinks cuDNN's files into the repository; returns the BUILD text."""
    rctx.symlink(cudnn.frontend.include, "cudnn_frontend/include")
    hdrs, includes = "", ""
    if cudnn.include != cuda.include:
        # Only cuDNN's headers: their directory may be /usr/include.
        for f in rctx.path(cudnn.include).readdir():
            if f.basename.startswith("cudnn") and f.basename.endswith(".h"):
                rctx.symlink(f, "cudnn/include/" + f.basename)
        hdrs = ' + glob(["cudnn/include/*.h"])'
        includes = ', "cudnn/include"'
    rpath = ', "-Wl,-rpath,%s"' % cudnn.lib if cudnn.lib else ""
    return _CUDNN_BUILD.format(cudnn_hdrs = hdrs, cudnn_includes = includes, cudnn_rpath = rpath)

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
            cudnn_available = "False",
            cudnn_reason = repr("CUDA is not available: " + reason),
            cudnn_version = "0",
            cudnn_frontend_version = "0",
            cudnn_frontend_include = repr(""),
            cudnn_lib = repr(""),
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
    cudnn, cudnn_reason = _find_cudnn(rctx, cuda)
    if cudnn != None:
        cudnn_build = _cudnn_build(rctx, cuda, cudnn)
    else:
        cudnn_build = _CUDNN_STUB_BUILD.format(reason = cudnn_reason)
    rctx.file("BUILD.bazel", _BUILD.format(
        home = cuda.home,
        lib = cuda.lib,
        nccl_lib = nccl.lib,
        nccl_hdrs = nccl_hdrs,
    ) + cudnn_build)
    rctx.file("defs.bzl", _DEFS.format(
        available = "True",
        reason = repr(""),
        home = repr(cuda.home),
        nvcc = repr(cuda.nvcc),
        cuda_version = str(cuda_version),
        nccl_version = str(nccl_version),
        cudnn_available = str(cudnn != None),
        cudnn_reason = repr(cudnn_reason or ""),
        cudnn_version = str(cudnn.version if cudnn else 0),
        cudnn_frontend_version = str(cudnn.frontend.version if cudnn else 0),
        cudnn_frontend_include = repr(cudnn.frontend.include if cudnn else ""),
        cudnn_lib = repr(cudnn.lib if cudnn else ""),
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = [
        "CUDA_HOME",
        "NCCL_HOME",
        "CUDNN_HOME",
        "CUDNN_FRONTEND_INCLUDE",
        "HOME",
        "XDG_CACHE_HOME",
        "PATH",
    ],
    configure = True,
    local = True,
    doc = "Finds the local CUDA toolkit, NCCL and cuDNN (see the module docstring).",
)
