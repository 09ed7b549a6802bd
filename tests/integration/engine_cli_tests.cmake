# pdserve logits / generate end to end on the golden checkpoints.
pd_add_test(test_cli_model SOURCES test_cli_model.cpp LIBS pd_engine pd_tokenizer pd_common LABELS integration)
add_dependencies(test_cli_model pdserve)
# The trained default model through `pdserve generate` vs the PyTorch reference answers.
pd_add_test(test_cli_trained_model SOURCES test_cli_trained_model.cpp LIBS pd_engine pd_tokenizer pd_common Boost::json LABELS integration)
target_compile_definitions(test_cli_trained_model PRIVATE PD_MODELS_DIR="${PROJECT_SOURCE_DIR}/models")
add_dependencies(test_cli_trained_model pdserve)
