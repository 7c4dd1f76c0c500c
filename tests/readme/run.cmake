# ctest driver: the README's C++ and C quick starts, exactly as written there, built against
# the TensorFerry build installed into a scratch prefix and run:
#   - quickstart.cc and quickstart.c with the README's CMakeLists (find_package; the C program
#     links TensorFerry::ferry_static from a C compiler),
#   - quickstart.c again with the README's pkg-config commands (tensorferry.pc).
#
# -DBUILD_DIR=<build tree> -DREADME=<README.md> -DWORK_DIR=<scratch> -DGENERATOR=<generator>
# -DC_COMPILER=<cc> -DCXX_COMPILER=<c++>
foreach(var BUILD_DIR README WORK_DIR GENERATOR C_COMPILER CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake needs -D${var}=...")
  endif()
endforeach()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/app")
set(APP "${WORK_DIR}/app")
set(PREFIX "${WORK_DIR}/prefix")

function(run_step what)
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY "${APP}" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok\n${out}")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# The first ```<lang> block after `heading` in the README.
file(READ "${README}" readme)
function(readme_block heading lang out_var)
  string(FIND "${readme}" "${heading}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "README: no heading '${heading}'")
  endif()
  string(SUBSTRING "${readme}" ${at} -1 rest)
  set(fence "```${lang}\n")
  string(FIND "${rest}" "${fence}" begin)
  if(begin EQUAL -1)
    message(FATAL_ERROR "README: no ${lang} block after '${heading}'")
  endif()
  string(LENGTH "${fence}" fence_length)
  math(EXPR begin "${begin} + ${fence_length}")
  string(SUBSTRING "${rest}" ${begin} -1 rest)
  string(FIND "${rest}" "\n```" end)
  math(EXPR end "${end} + 1")
  string(SUBSTRING "${rest}" 0 ${end} block)
  set(${out_var} "${block}" PARENT_SCOPE)
endfunction()

readme_block("## C++ quick start" "cpp" cpp_source)
readme_block("## C++ quick start" "cmake" cmake_lists)
readme_block("## C quick start" "c" c_source)
readme_block("## C quick start" "sh" pkg_config_commands)
file(WRITE "${APP}/quickstart.cc" "${cpp_source}")
file(WRITE "${APP}/quickstart.c" "${c_source}")
file(WRITE "${APP}/CMakeLists.txt" "${cmake_lists}")

run_step("install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${PREFIX}")

# The exported package names no path of the machine that built it.
file(GLOB_RECURSE exported "${PREFIX}/*/cmake/TensorFerry/*.cmake")
foreach(f ${exported})
  file(STRINGS "${f}" hits REGEX "/[A-Za-z0-9_.+-]+/[A-Za-z0-9_./+-]*zstd")
  if(hits)
    message(FATAL_ERROR "${f} names a path of the build machine: ${hits}")
  endif()
endforeach()

run_step("configure" ${CMAKE_COMMAND} -S "${APP}" -B "${APP}/build" -G "${GENERATOR}"
  "-DCMAKE_C_COMPILER=${C_COMPILER}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
  "-DCMAKE_PREFIX_PATH=${PREFIX}" -DCMAKE_BUILD_TYPE=Release)
run_step("build" ${CMAKE_COMMAND} --build "${APP}/build")
run_step("run quickstart (C++)" "${APP}/build/quickstart")
if(NOT last_output MATCHES "w: 131072 bytes on the (host|GPU)")
  message(FATAL_ERROR "quickstart printed:\n${last_output}")
endif()
run_step("run quickstart_c (C, static library)" "${APP}/build/quickstart_c")
if(NOT last_output MATCHES "tensor 0: 2-d, (host|device) memory")
  message(FATAL_ERROR "quickstart_c printed:\n${last_output}")
endif()

# pkg-config, with the README's commands run by sh. A sanitized build needs the sanitizer
# runtime at link time: tests/run_sanitizers.sh passes it in LDFLAGS.
find_program(SH sh REQUIRED)
find_program(PKG_CONFIG pkg-config REQUIRED)
file(GLOB pc_dirs "${PREFIX}/lib*/pkgconfig" "${PREFIX}/lib*/*/pkgconfig")
if(NOT pc_dirs)
  message(FATAL_ERROR "no tensorferry.pc installed under ${PREFIX}")
endif()
set(script "${pkg_config_commands}")
if(DEFINED ENV{LDFLAGS})
  # No ';' in the script: CMake would split the argument there.
  set(script "cc() {\n  command cc \"$@\" $LDFLAGS\n}\n${script}")
endif()
file(REMOVE "${APP}/quickstart_c" "${APP}/model_c.ferry")
set(ENV{PKG_CONFIG_PATH} "${pc_dirs}")
run_step("pkg-config build and run (C, shared library)" ${SH} -ec "${script}")
if(NOT last_output MATCHES "tensor 0: 2-d, (host|device) memory")
  message(FATAL_ERROR "pkg-config build printed:\n${last_output}")
endif()

# Static linking with exactly what `pkg-config --static --libs` says: with the shared library
# gone from the prefix, -lferry finds libferry.a, whose dependencies (zstd, dl, the C++
# runtime, cudart where built with CUDA) must all come from tensorferry.pc.
file(GLOB shared_libs "${PREFIX}/lib*/libferry.so*" "${PREFIX}/lib*/*/libferry.so*")
file(REMOVE ${shared_libs})
file(REMOVE "${APP}/quickstart_c" "${APP}/model_c.ferry")
set(static_script "cc -std=c99 quickstart.c $(pkg-config --cflags --static --libs tensorferry) \
-o quickstart_c\n./quickstart_c\n")
if(DEFINED ENV{LDFLAGS})
  set(static_script "cc() {\n  command cc \"$@\" $LDFLAGS\n}\n${static_script}")
endif()
run_step("pkg-config --static build and run (C, static library)" ${SH} -ec "${static_script}")
if(NOT last_output MATCHES "tensor 0: 2-d, (host|device) memory")
  message(FATAL_ERROR "pkg-config --static build printed:\n${last_output}")
endif()
file(REMOVE_RECURSE "${WORK_DIR}")
