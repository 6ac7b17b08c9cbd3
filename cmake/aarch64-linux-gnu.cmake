# Cross-compiling for 64-bit Arm Linux (Grace, Graviton) on a Debian x86-64 host, with Debian's
# cross compiler (g++-aarch64-linux-gnu) and the arm64 builds of the libraries (multiarch:
# dpkg --add-architecture arm64). Programs and tests run through qemu-user, so ctest runs the
# test suites as they are. scripts/cross-aarch64.sh installs all of it and runs the checks.
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# The code generators (protoc, grpc_cpp_plugin) are the host's; libraries and their pkg-config
# files are the target's (the host's pkg-config finds x86-64 libraries: OpenSSL's, for gRPC).
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(PKG_CONFIG_EXECUTABLE aarch64-linux-gnu-pkg-config CACHE FILEPATH "pkg-config for arm64")
# The arm64 loader and C library of the multiarch packages (libc6:arm64), not the cross
# toolchain's copies under /usr/aarch64-linux-gnu: the two are different builds, and a program
# loaded by one with the other's libc hangs in its first pthread_create.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/)
