# Checkpoint I/O: dtypes, safetensors reader/writer, SHA-256.
pd_add_test(test_dtype SOURCES test_dtype.cpp LIBS pd_common LABELS unit)
pd_add_test(test_safetensors SOURCES test_safetensors.cpp LIBS pd_common LABELS unit)
pd_add_test(test_sha256 SOURCES test_sha256.cpp LIBS pd_common LABELS unit)

# The safetensors fuzz entry point, replayed over its seed corpus (no libFuzzer needed).
pd_add_test(test_fuzz_safetensors_corpus
  SOURCES ${PROJECT_SOURCE_DIR}/tests/fuzz/fuzz_safetensors.cpp ${PROJECT_SOURCE_DIR}/tests/fuzz/replay_corpus_test.cpp
  LIBS pd_common LABELS unit)
target_compile_definitions(test_fuzz_safetensors_corpus PRIVATE
  PD_FUZZ_CORPUS_DIR="${PROJECT_SOURCE_DIR}/tests/fuzz/corpus/safetensors")
