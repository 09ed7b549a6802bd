# Tensor parallelism across processes.

pd_add_test(test_tp_process SOURCES test_tp_process.cpp LIBS pd_decode LABELS integration)
# Every rank's pool registered with kvtransfer; a real prefill writes all of them (real UCX).
pd_add_test(test_tp_kv SOURCES test_tp_kv.cpp LIBS pd_decode pd_prefill LABELS unit)
