// The unit tests' entry point: GoogleTest's, ending as titan does without LibTorch's static destructors
// (common/process_exit.h). CTest runs each test in its own process, so that is saved about a hundred times a run.
#include <gtest/gtest.h>

#include "titan/common/process_exit.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  titan::exit_skipping_static_destructors(RUN_ALL_TESTS());
}
