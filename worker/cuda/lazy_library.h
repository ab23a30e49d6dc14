// A shared library loaded on first use, and C functions forwarding to it:
// cublas_lazy.cc and cublaslt_lazy.cc define the cuBLAS / cuBLASLt
// functions the worker calls this way, so that a process that never
// multiplies on a GPU never maps those libraries (linked in, libcublas with
// libcublasLt cost every process, CPU runs too, ~210 MB of resident memory
// at start-up, #15).
//
//   constexpr char kSoname[] = "libfoo.so.1";
//   constexpr char kName[] = "foo";
//   ZS_LAZY_FORWARD(kSoname, kName, int, fooCreate, (foo_t* f), (f), FOO_NOT_LOADED)
//
// defines extern "C" fooCreate, which dlopens kSoname (through the binary's
// runpath) the first time any of its forwarders runs, resolves fooCreate
// once, and returns the fallback when either fails (the reason is printed
// once, naming the library).
#ifndef ZEROSHARD_WORKER_CUDA_LAZY_LIBRARY_H_
#define ZEROSHARD_WORKER_CUDA_LAZY_LIBRARY_H_

#include <dlfcn.h>

#include <cstdio>

namespace zeroshard {
namespace gpu {
namespace lazy {

// The handle of `kSoname`, opened once (nullptr when it cannot be).
template <const char* kSoname, const char* kName>
void* Library() {
  static void* handle = [] {
    void* h = dlopen(kSoname, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) std::fprintf(stderr, "%s: cannot load %s: %s\n", kName, kSoname, dlerror());
    return h;
  }();
  return handle;
}

template <typename F, const char* kSoname, const char* kName>
F Resolve(const char* symbol) {
  void* h = Library<kSoname, kName>();
  if (h == nullptr) return nullptr;
  void* f = dlsym(h, symbol);
  if (f == nullptr) std::fprintf(stderr, "%s: %s has no %s\n", kName, kSoname, symbol);
  return reinterpret_cast<F>(f);
}

}  // namespace lazy
}  // namespace gpu
}  // namespace zeroshard

// Each forwarder resolves its function once (a thread-safe static).
#define ZS_LAZY_FORWARD(soname, lib_name, ret, name, params, args, fallback)           \
  extern "C" ret name params {                                                         \
    using Fn = ret(*) params;                                                          \
    static const Fn fn = ::zeroshard::gpu::lazy::Resolve<Fn, soname, lib_name>(#name); \
    if (fn == nullptr) return fallback;                                                \
    return fn args;                                                                    \
  }

#endif  // ZEROSHARD_WORKER_CUDA_LAZY_LIBRARY_H_
