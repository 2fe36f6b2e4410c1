// titan: the command-line entry point. Bad input surfaces as UserError with a message naming what was wrong.
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "titan/cli/commands.h"
#include "titan/common/error.h"
#include "titan/common/process_exit.h"
#include "titan/common/strings.h"
#include "titan/distributed/communicator.h"
#include "titan/distributed/mpi_runtime.h"
#include "titan/models/registry.h"
#include "titan/trainer/control.h"

namespace {

std::string usage() {
  return
    "titan.cpp " TITAN_VERSION " - native LLM pretraining\n"
    "\n"
    "usage: titan <command> [options]\n"
    "\n"
    "commands:\n"
    "  train       train a model (torchtitan-compatible TOML and --section.key options; `titan train --help`)\n"
    "  tokenizer   encode, decode or train tokenizers (`titan tokenizer --help`)\n"
    "  data        pre-tokenize datasets into token shards, inspect shards (`titan data --help`)\n"
    "  convert     checkpoints between titan, Hugging Face safetensors, torch DCP, torch.save .pt and Meta .pth, and to\n"
    "              llama.cpp's GGUF (`titan convert --help`)\n"
    "  generate    sample continuations of prompts from a checkpoint (`titan generate --help`)\n"
    "  estimate    parameters, FLOPs per token and training-state memory of a job's model\n"
    "  plan        memory per rank, step time, tokens/s and MFU of a layout on a GPU cluster; --search finds the best\n"
    "\n"
    "model families (model.name): " +
         titan::join(titan::models::model_names(), ", ") + "\n";
}

// How long a rank that does not log waits before reporting an error in what the user gave (below).
constexpr auto kErrorReportDelay = std::chrono::seconds(5);

// Prints an error that ends the command. Under a launcher every rank usually meets an error in what the user gave
// (UserError: a mistyped key, a missing file, the memory check) at the same point, and printing it once per rank
// buries it. For those, the ranks that log (rank 0 unless LOG_RANK says otherwise) print at once and exit; another
// rank waits a few seconds first. When rank 0 met the error too, the launcher ends the job in that time (mpirun and
// torchrun stop the other ranks when one exits with an error), so the error appears once. A rank still running after
// the wait has an error rank 0 did not have and prints it, naming its rank. Other errors (CUDA's, LibTorch's) are
// printed at once by every rank. A rank that has learnt that another rank failed (titan::peer_failure_noted: a
// PeerFailure, NCCL's report of a peer's abort) waits longer, logging or not, whatever its error: the failing rank
// reports first and its exit ends the job, so the cause is what appears. The exit code is the same either way.
void report_error(const char* message, bool user_error) {
  titan::distributed::LaunchInfo launch;
  try {
    launch = titan::distributed::detect_launch();
  } catch (const std::exception&) {
  }
  const bool peer = titan::peer_failure_noted();
  if (launch.world_size > 1 && (peer || (user_error && !titan::rank_logs(launch.rank)))) {
    if (peer) std::this_thread::sleep_for(titan::kPeerFailureReportDelay);
    else std::this_thread::sleep_for(kErrorReportDelay);
    std::fprintf(stderr, "error (rank %d of %d): %s\n", launch.rank, launch.world_size, message);
    return;
  }
  std::fprintf(stderr, "error: %s\n", message);
}

}  // namespace

static int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(usage().c_str(), args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {
    std::puts("titan.cpp " TITAN_VERSION);
    return 0;
  }
  const std::string command = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  try {
    if (command == "train") {
      int code = titan::cli::run_train(rest);
      // Leave MPI cleanly after a normal end; after an error the process just exits (non-zero), which makes
      // mpirun stop the other ranks instead of waiting for them in MPI_Finalize.
      titan::distributed::shutdown();
      return code;
    }
    if (command == "tokenizer") return titan::cli::run_tokenizer(rest);
    if (command == "estimate") return titan::cli::run_estimate(rest);
    if (command == "plan") return titan::cli::run_plan(rest);
    if (command == "data") return titan::cli::run_data(rest);
    if (command == "convert") return titan::cli::run_convert(rest);
    if (command == "generate") {
      int code = titan::cli::run_generate(rest);  // under mpirun: tensor parallel over the ranks
      titan::distributed::shutdown();
      return code;
    }
    std::fprintf(stderr, "error: unknown command \"%s\"\n\n%s", command.c_str(), usage().c_str());
    return 2;
  } catch (const titan::UserError& e) {
    report_error(e.what(), /*user_error=*/true);
    return 2;
  } catch (const std::filesystem::filesystem_error& e) {
    // A path the user gave that cannot be made or read (permissions, a missing parent, a read-only file system).
    report_error(e.what(), /*user_error=*/true);
    return 2;
  } catch (const c10::Error& e) {
    report_error(e.what_without_backtrace(), /*user_error=*/false);
    return 1;
  } catch (const std::exception& e) {
    report_error(e.what(), /*user_error=*/false);
    return 1;
  }
}

// Every command's objects are destroyed when run() returns; the process then ends without LibTorch's static
// destructors (common/process_exit.h).
int main(int argc, char** argv) { titan::exit_skipping_static_destructors(run(argc, argv)); }
