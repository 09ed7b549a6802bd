# Flags live on targets, never in global CMAKE_CXX_FLAGS: every pdserve target calls
# pd_target_defaults() so warnings-as-errors and sanitizers apply uniformly.

function(pd_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wshadow -Wnon-virtual-dtor
      -Wold-style-cast -Wcast-align -Wunused -Woverloaded-virtual -Wnull-dereference
      -Wimplicit-fallthrough -Wno-missing-field-initializers>
    # gcc in ISO C++ mode fuses no multiply-add the source does not spell; clang would (its
    # default is -ffp-contract=on), and the CPU kernels' bit-exact tests rely on gcc's rule.
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:Clang>>:-ffp-contract=off>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings --expt-relaxed-constexpr>)
  if(PD_SANITIZE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${PD_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all>)
    if(PD_SANITIZE MATCHES "thread")
      # gcc warns that TSan does not model atomic_thread_fence, which Boost.Asio uses.
      target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-tsan>)
    endif()
    target_link_options(${target} PRIVATE -fsanitize=${PD_SANITIZE})
  endif()
endfunction()

# A library's link-time sanitizer flags must reach executables too; interface options do that.
function(pd_library target)
  pd_target_defaults(${target})
  if(PD_SANITIZE)
    target_link_options(${target} INTERFACE -fsanitize=${PD_SANITIZE})
  endif()
endfunction()
