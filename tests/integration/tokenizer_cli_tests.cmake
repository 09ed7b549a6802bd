# pdserve tokenize / detokenize / chat-template end to end on the golden tokenizer data.
pd_add_test(test_cli_tokenize SOURCES test_cli_tokenize.cpp LIBS pd_engine pd_tokenizer pd_common Boost::json LABELS integration)
add_dependencies(test_cli_tokenize pdserve)
