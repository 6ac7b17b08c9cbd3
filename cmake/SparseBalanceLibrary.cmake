# sb_add_library: one installed SparseBalance library, declared the same way in every folder.
#
#   sb_add_library(planner SOURCES planner.cc types.cc
#                  PUBLIC SparseBalance::contract absl::status PRIVATE Threads::Threads)
#
# makes target sb_planner (file libsparsebalance_planner, position-independent), its alias
# SparseBalance::planner (exported under that name), with the source root as include
# directory (`#include "planner/types.h"`), and installs it into the SparseBalanceTargets
# export. Headers: every *.h of the calling folder goes to include/<name>/ unless HEADERS
# names the ones to install, or NO_HEADERS installs none (generated or internal code).
include_guard(GLOBAL)
include(GNUInstallDirs)

function(sb_add_library name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_HEADERS" "" "SOURCES;PUBLIC;PRIVATE;HEADERS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "sb_add_library(${name}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  set(target sb_${name})
  add_library(${target} ${arg_SOURCES})
  add_library(SparseBalance::${name} ALIAS ${target})
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${target} PUBLIC ${arg_PUBLIC} PRIVATE ${arg_PRIVATE})
  set_target_properties(${target} PROPERTIES OUTPUT_NAME sparsebalance_${name}
                                             POSITION_INDEPENDENT_CODE ON EXPORT_NAME ${name})

  install(TARGETS ${target} EXPORT SparseBalanceTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  if(arg_NO_HEADERS)
    return()
  elseif(arg_HEADERS)
    install(FILES ${arg_HEADERS} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${name})
  else()
    install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${name}
            FILES_MATCHING PATTERN "*.h" PATTERN "*_api.inc")
  endif()
endfunction()
