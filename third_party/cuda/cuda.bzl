"""Macros for GPU targets: nvcc compilation and targets that exist only with CUDA.

Every GPU target's name must contain "cuda" or "nccl" (enforced here), so CI
can list them with `bazel query 'attr(name, "cuda|nccl", //...)'`.

The cudnn_* macros and if_cudnn are the same for targets that also need
cuDNN and its frontend (@local_cuda//:cudnn_frontend; CUDNN_AVAILABLE, see
cuda_configure.bzl): without them those targets are left out while the other
GPU targets build.

When @local_cuda found no usable CUDA + NCCL (CUDA_AVAILABLE is False, see
cuda_configure.bzl), each macro here defines nothing: GPU targets are left
out and the rest of the workspace builds. Referencing a GPU target by label
from a non-GPU target would then fail to resolve, so only GPU targets (made
with these macros) may depend on GPU targets.
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "CUDNN_AVAILABLE", "NVCC")

# Ampere (A100) and Hopper (H100), as SASS; no PTX, so other architectures
# fail at load time with cudaErrorNoKernelImageForDevice rather than JIT.
DEFAULT_GENCODE = [
    "arch=compute_80,code=sm_80",
    "arch=compute_90,code=sm_90",
]

def _check_name(name):
    if "cuda" not in name and "nccl" not in name:
        fail("GPU target '%s': the name must contain 'cuda' or 'nccl' (CI lists GPU " % name +
             "targets by name)")

def _cuda_archive_impl(ctx):
    cc_toolchain = ctx.attr._cc_toolchain[cc_common.CcToolchainInfo]
    headers = []
    include_flags = []
    defines = []
    for dep in ctx.attr.deps:
        cc = dep[CcInfo].compilation_context
        headers.append(cc.headers)
        # nvcc has no -iquote; -I finds the same files.
        for d in cc.quote_includes.to_list():
            include_flags += ["-I", d]
        for d in cc.includes.to_list():
            include_flags += ["-I", d]
        for d in cc.system_includes.to_list():
            include_flags += ["-isystem", d]
        defines += ["-D" + d for d in cc.defines.to_list()]

    # Like cc_library: the workspace root and its generated-file roots.
    base_flags = [
        "-I",
        ".",
        "-I",
        ctx.bin_dir.path,
        "-I",
        ctx.genfiles_dir.path,
    ] + include_flags + defines
    inputs = depset(ctx.files.hdrs, transitive = headers)

    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_objs/%s/%s.o" % (ctx.label.name, src.basename[:-len(".cu")]))
        args = ctx.actions.args()
        args.add("-ccbin", cc_toolchain.compiler_executable)
        args.add_all(["-std=c++17", "-O2", "-Xcompiler", "-fPIC"])
        for g in ctx.attr.gencode:
            args.add("-gencode", g)
        args.add_all(base_flags)
        args.add_all(ctx.attr.copts)
        args.add("-c", src)
        args.add("-o", obj)
        ctx.actions.run(
            executable = ctx.attr.nvcc,
            arguments = [args],
            inputs = depset([src], transitive = [inputs]),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "Compiling CUDA %s" % src.short_path,
            # nvcc finds its host compiler's assembler and linker through PATH.
            use_default_shell_env = True,
        )
        objects.append(obj)

    archive = ctx.actions.declare_file("lib%s.a" % ctx.label.name)
    args = ctx.actions.args()
    args.add("rcsD", archive)
    args.add_all(objects)
    ctx.actions.run(
        executable = cc_toolchain.ar_executable,
        arguments = [args],
        inputs = objects,
        outputs = [archive],
        mnemonic = "NvccArchive",
        progress_message = "Archiving CUDA objects %s" % archive.short_path,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([archive]))]

_cuda_archive = rule(
    implementation = _cuda_archive_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".h", ".cuh"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "gencode": attr.string_list(),
        "nvcc": attr.string(mandatory = True),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
)

def cuda_library(
        name,
        srcs = [],
        hdrs = [],
        cu_hdrs = [],
        deps = [],
        copts = [],
        gencode = DEFAULT_GENCODE,
        visibility = None,
        **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc.

    `srcs` may mix .cu files (nvcc) and host C++ files (.cc, compiled as any
    cc_library source). The .cu files become a static archive (`<name>_cu`, position-independent)
    wrapped in a cc_library `<name>` that exports `hdrs` and links cudart.
    `cu_hdrs` (.h or .cuh) are private headers the .cu files include.
    `deps` provide headers to nvcc and are linked into dependents. `copts` go
    to nvcc (use -Xcompiler for host-compiler flags).
    Defines nothing without CUDA.
    """
    _check_name(name)
    if not CUDA_AVAILABLE:
        return
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    cc_srcs = [s for s in srcs if not s.endswith(".cu")]
    _cuda_archive(
        name = name + "_cu",
        srcs = cu_srcs,
        hdrs = hdrs + cu_hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        copts = copts,
        gencode = gencode,
        nvcc = NVCC,
        visibility = ["//visibility:private"],
        tags = kwargs.get("tags", []),
        testonly = kwargs.get("testonly", False),
    )
    if not cc_srcs and "linkstatic" not in kwargs:
        # Only the nvcc archive: nothing for a shared library to hold.
        kwargs["linkstatic"] = 1
    native.cc_library(
        name = name,
        srcs = [":" + name + "_cu"] + cc_srcs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cudart"],
        visibility = visibility,
        **kwargs
    )

def cuda_cc_library(name, **kwargs):
    """A cc_library (host code calling CUDA / NCCL) that exists only with CUDA."""
    _check_name(name)
    if CUDA_AVAILABLE:
        native.cc_library(name = name, **kwargs)

def cuda_cc_binary(name, **kwargs):
    """A cc_binary that exists only with CUDA."""
    _check_name(name)
    if CUDA_AVAILABLE:
        native.cc_binary(name = name, **kwargs)

def cuda_cc_test(name, **kwargs):
    """A cc_test that exists only with CUDA. It must not need a GPU to pass:
    CI runs it on machines without one."""
    _check_name(name)
    if CUDA_AVAILABLE:
        native.cc_test(name = name, **kwargs)

def if_cuda(if_true, if_false = []):
    """`if_true` when CUDA is available, else `if_false`.

    For targets that exist either way but gain GPU support when they can, e.g.
    in shard_worker's cc_binary:
        deps = [...] + if_cuda(["//worker/comm:nccl_communicator"]),
        defines = if_cuda(["ZEROSHARD_HAVE_CUDA"]),
    """
    return if_true if CUDA_AVAILABLE else if_false

def cudnn_cc_library(name, **kwargs):
    """A cuda_cc_library that also needs cuDNN: exists only with CUDA and cuDNN."""
    _check_name(name)
    if CUDA_AVAILABLE and CUDNN_AVAILABLE:
        native.cc_library(name = name, **kwargs)

def cudnn_cc_binary(name, **kwargs):
    """A cuda_cc_binary that also needs cuDNN: exists only with CUDA and cuDNN."""
    _check_name(name)
    if CUDA_AVAILABLE and CUDNN_AVAILABLE:
        native.cc_binary(name = name, **kwargs)

def cudnn_cc_test(name, **kwargs):
    """A cuda_cc_test that also needs cuDNN's headers and frontend (not a GPU,
    and not necessarily libcudnn: CI runs it on machines without either)."""
    _check_name(name)
    if CUDA_AVAILABLE and CUDNN_AVAILABLE:
        native.cc_test(name = name, **kwargs)

def if_cudnn(if_true, if_false = []):
    """`if_true` when CUDA and cuDNN (with its frontend) are available, else
    `if_false`. For GPU targets that use cuDNN when they can, e.g. the device
    GPT:
        deps = [...] + if_cudnn([":cuda_cudnn_attention"]),
        local_defines = if_cudnn(["ZEROSHARD_HAVE_CUDNN"]),
    """
    return if_true if CUDA_AVAILABLE and CUDNN_AVAILABLE else if_false
