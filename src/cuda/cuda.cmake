# CUDA build settings of the ropepool target. Included by the top-level CMakeLists.txt after
# enable_language(CUDA) (one line: include(src/cuda/cuda.cmake)).

# CMake < 3.26 knows no C++20 flag for nvcc, so the target's cxx_std_20 fails at generate
# time ("requires the language dialect CUDA20"); nvcc 12+ accepts -std=c++20.
if(CMAKE_VERSION VERSION_LESS 3.26 AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()

# Line info costs nothing at run time and lets compute-sanitizer name source lines.
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/rope_pool_cuda.cu PROPERTIES
  COMPILE_OPTIONS "-lineinfo")
