# Model config, expected tensor layout, checkpoint validation and the random-model factory.
pd_add_test(test_model_config SOURCES test_model_config.cpp LIBS pd_common Boost::json LABELS unit)
pd_add_test(test_model_factory SOURCES test_model_factory.cpp LIBS pd_common LABELS unit)
