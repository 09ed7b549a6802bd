# HTTP helpers and metrics (issue 8)
pd_add_test(test_metrics SOURCES test_metrics.cpp LIBS pd_common LABELS unit)
pd_add_test(test_http SOURCES test_http.cpp LIBS pd_common LABELS unit)
