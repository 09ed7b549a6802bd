# pdserve logits / generate end to end on the golden checkpoints (issue 4).
pd_add_test(test_cli_model SOURCES test_cli_model.cpp LIBS pd_common LABELS integration)
add_dependencies(test_cli_model pdserve)
