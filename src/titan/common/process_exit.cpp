#include "titan/common/process_exit.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(leak_sanitizer)
#define TITAN_EXIT_NORMALLY 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define TITAN_EXIT_NORMALLY 1
#endif

namespace titan {

void exit_skipping_static_destructors(int code) {
#if defined(TITAN_EXIT_NORMALLY)
  std::exit(code);
#else
  std::cout.flush();
  std::cerr.flush();
  std::clog.flush();
  std::fflush(nullptr);
  std::_Exit(code);
#endif
}

}  // namespace titan
