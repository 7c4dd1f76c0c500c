# ctest driver: install the TensorFerry build tree into a scratch prefix, then configure, build
# and run tests/consumer against it, as a downstream project would.
#
# -DBUILD_DIR=<TensorFerry build tree> -DSOURCE_DIR=<tests/consumer> -DWORK_DIR=<scratch>
# -DGENERATOR=<CMake generator> -DCXX_COMPILER=<compiler>
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake needs -D${var}=...")
  endif()
endforeach()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run_step("install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
# No generated FlatBuffers code may leak into the installed headers.
file(GLOB_RECURSE installed_headers "${WORK_DIR}/prefix/include/*")
foreach(h ${installed_headers})
  file(STRINGS "${h}" hits REGEX "flatbuffers|_generated\\.h")
  if(hits)
    message(FATAL_ERROR "installed header ${h} mentions FlatBuffers: ${hits}")
  endif()
endforeach()

run_step("configure" ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
  "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
  -DCMAKE_BUILD_TYPE=Release)
run_step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
foreach(exe consumer consumer_static)
  run_step("run ${exe}" "${WORK_DIR}/build/${exe}" "${WORK_DIR}/${exe}.ferry")
  message(STATUS "${last_output}")
endforeach()
file(REMOVE_RECURSE "${WORK_DIR}")
