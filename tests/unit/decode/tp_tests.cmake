# Tensor parallelism (issue 6): sharded engine in one process (threads), and across processes.
pd_add_test(test_tp_engine SOURCES test_tp_engine.cpp LIBS pd_decode LABELS unit)
pd_add_test(test_tp_process SOURCES test_tp_process.cpp LIBS pd_decode LABELS integration)
