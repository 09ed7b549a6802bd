#pragma once
// Per-instruction-set kernel tables. Each lives in its own translation unit compiled with that
// ISA's flags; nothing inline from a shared header may be odr-used there (the linker could keep
// an AVX-512 copy of it for everyone), so those files use only intrinsics, local helpers and
// kernels_tile_driver.h, whose templates sit in an unnamed namespace and are instantiated with
// each file's own traits.

#include "pd/engine/kernels.h"

namespace pd::model::detail {

const KernelTable& genericKernels();
const KernelTable& avx2Kernels();
const KernelTable& avx512Kernels();

}  // namespace pd::model::detail
