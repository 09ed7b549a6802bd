#pragma once
// Per-instruction-set kernel tables. Each lives in its own translation unit compiled with that
// ISA's flags; nothing inline from a shared header may be odr-used there (the linker could keep
// an AVX-512 copy of it for everyone), so those files use only intrinsics and local helpers.

#include "pd/engine/kernels.h"

namespace pd::model::detail {

const KernelTable& genericKernels();
const KernelTable& avx2Kernels();
const KernelTable& avx512Kernels();

}  // namespace pd::model::detail
