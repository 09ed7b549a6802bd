#pragma once
/// Moved to common (pd/common/model_hash.h, namespace pd) so that decode need not link prefill;
/// these names keep the prefill-side callers compiling. Thread rules: as pd::modelHash.

#include "pd/common/model_hash.h"

namespace pd::prefill {

using pd::modelHash;
using pd::modelHashHex;

}  // namespace pd::prefill
