# ctest fixture pd_default_model (tests/CMakeLists.txt): writes the default-preset checkpoint to
# DIR with PDSERVE, replacing what an earlier run left. Fails the fixture (and so every test that
# requires it is reported not run) when make-model fails.
foreach(var PDSERVE DIR TOKENIZER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "make_default_model.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${DIR}")
execute_process(COMMAND "${PDSERVE}" make-model "${DIR}" --preset default --tokenizer "${TOKENIZER}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pdserve make-model ${DIR} failed: ${rc}")
endif()
