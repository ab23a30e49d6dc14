// Emulated CUDA (see cuda_emulation.h): the flash attention kernels'
// `#include <cuda_runtime.h>` resolves here in the emulation test.
#include "cuda_emulation.h"
#include "cuda_runtime_api.h"
