// Starting and stopping the MPI runtime and titan's communication threads (called by world() and shutdown()).
#pragma once

namespace titan::distributed {

void mpi_initialize();
void mpi_finalize();
// Seconds the MPI worker thread has spent inside MPI calls (communication time, overlapped or not).
double mpi_busy_seconds();

// Stops communication threads and finalizes MPI if titan started it; call before the process exits normally.
void shutdown();

}  // namespace titan::distributed
