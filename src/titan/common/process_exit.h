// exit_skipping_static_destructors(code): the end of titan's programs.
//
// Returning from main runs every static destructor of every library loaded, and LibTorch's (its operator registry,
// thousands of schemas and kernels) take about 0.4 s of CPU per process on a 2-core EPYC, more than the whole start
// of a small run; under mpirun every rank pays it. titan's own state is gone by then (main's locals are destroyed,
// MPI and NCCL are shut down, files are closed), so the programs flush the C and C++ streams and end the process
// with _Exit. Sanitized builds exit normally, so that LeakSanitizer's check at exit still runs.
#pragma once

namespace titan {

[[noreturn]] void exit_skipping_static_destructors(int code);

}  // namespace titan
