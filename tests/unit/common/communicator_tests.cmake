# Tensor-parallel collectives (issue 6): loopback threads, shared memory across processes, NCCL.
pd_add_test(test_communicator SOURCES test_communicator.cpp LIBS pd_common LABELS unit)
pd_add_test(test_tcp_communicator SOURCES test_tcp_communicator.cpp LIBS pd_common LABELS unit)
