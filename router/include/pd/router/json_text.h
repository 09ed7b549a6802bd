#pragma once
/// The router's names for the JSON text helpers in pd/common/json_text.h.

#include "pd/common/json_text.h"

namespace pd::router {

using pd::appendJsonString;
using pd::appendSanitizedUtf8;
using pd::firstInvalidUtf8;
using pd::hasLoneSurrogateEscape;
using pd::isValidUtf8;
using pd::sanitizeUtf8;
using pd::Utf8StreamSanitizer;

}  // namespace pd::router
