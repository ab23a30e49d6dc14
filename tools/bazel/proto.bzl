"""C++ and gRPC code generated from a .proto with the system protoc and grpc_cpp_plugin."""

def cc_grpc_proto(name, src, grpc = True, deps = [], imports = [], visibility = None):
    """Generates <base>.pb.{h,cc} (and .grpc.pb.{h,cc}) and a cc_library `name`.

    `imports`: the .proto files `src` imports (same folder, imported by base
    name), whose cc_grpc_proto libraries are in `deps`.
    """
    base = src[:-len(".proto")]
    outs = [base + ".pb.h", base + ".pb.cc"]
    cmd = "protoc -I$$(dirname $(location %s)) --cpp_out=$(@D) " % src
    if grpc:
        outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
        cmd += "--grpc_out=$(@D) --plugin=protoc-gen-grpc=$$(which grpc_cpp_plugin) "
    cmd += "$(location %s)" % src
    native.genrule(
        name = name + "_gen",
        srcs = [src] + imports,
        outs = outs,
        cmd = cmd,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = ["@system//:grpc", "@system//:protobuf"] + deps,
        visibility = visibility,
    )
