# Model engine, CPU backend (issue 4): kernels, sampling, and the golden comparisons.
pd_add_test(test_engine_kernels SOURCES test_engine_kernels.cpp LIBS pd_common LABELS unit)
pd_add_test(test_engine SOURCES test_engine.cpp LIBS pd_common LABELS unit)
