// CheckingCommunicator: a communicator wrapper that enforces the NCCL backend's rules on every call, so that the
// multi-rank CPU tests exercise each collective a GPU run issues under those rules. Turned on by the environment
// variable TITAN_CHECK_COLLECTIVES=1 (the test suite sets it; users may, to debug a hang). See docs/distributed.md.
#pragma once
#include <memory>

#include "titan/distributed/communicator.h"

namespace titan::distributed {

// Wraps `inner` when TITAN_CHECK_COLLECTIVES=1, else returns it unchanged. Groups split from a checking
// communicator are checking too. Checked on every call:
//  - arguments: tensors contiguous, on the backend's device, of a dtype the NCCL backend moves (no int16, complex)
//    and, for averages, reduce; gathered/scattered sizes size() times the local ones; peers and roots in range;
//  - agreement: every rank of a group issues the same collective (operation, dtype, element count, reduction,
//    root) as its call number N, checked through a small all-gather issued just before it on the same
//    communicator; a point-to-point message carries its dtype and count, which the receiver must expect exactly
//    (NCCL, unlike MPI, does not accept a smaller message into a larger buffer).
// A violation throws UserError naming the communicator, the call and what each rank issued.
std::shared_ptr<Communicator> maybe_checking(std::shared_ptr<Communicator> inner);
// The wrapper itself, whatever the environment says.
std::shared_ptr<Communicator> make_checking_communicator(std::shared_ptr<Communicator> inner);
bool collective_checks_enabled();

}  // namespace titan::distributed
