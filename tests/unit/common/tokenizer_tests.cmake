# Tokenizer, incremental detokenizer and chat template (issue 3): golden data of Hugging Face
# `tokenizers` and Jinja on the real DeepSeek-V3 files (scripts/fetch-tokenizer.sh).
pd_add_test(test_tokenizer SOURCES test_tokenizer.cpp LIBS pd_common Boost::json LABELS unit)
pd_add_test(test_detokenizer SOURCES test_detokenizer.cpp LIBS pd_common Boost::json LABELS unit)
pd_add_test(test_chat_template SOURCES test_chat_template.cpp LIBS pd_common Boost::json LABELS unit)
pd_add_test(test_tokenizer_internals SOURCES test_tokenizer_internals.cpp LIBS pd_common PkgConfig::PCRE2 Boost::json
            LABELS unit)
target_include_directories(test_tokenizer_internals PRIVATE ${PROJECT_SOURCE_DIR}/common/src/tokenizer)
