// The `ropepool` command: `bench` (the default workload, verified, next to memcpy
// bandwidth) and `verify` (a randomized self-check against the float64 reference).
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli_common.hpp"

namespace {

const char* kMainHelp = R"(usage: ropepool <command> [options]

Fused RoPE + KV-cache pool write (rope_pool_fused), CPU backend.

commands:
  bench     time the default workload (Llama-3-8B attention shape, bfloat16, T in
            1,16,256,4096,32768), each result verified against the float64 reference,
            with GB/s next to this machine's memcpy bandwidth measured in the same run
  verify    randomized self-check against the float64 reference over dtypes, head sizes,
            head counts and token counts; prints "N passed, M failed", exits 1 on failure

options:
  -h, --help     this text; `ropepool <command> --help` for a command's options
  --version      print the version

The number of worker threads defaults to ROPEPOOL_NUM_THREADS or all hardware threads;
both commands take --threads N.

exit status: 0 success, 1 a check failed, 2 bad command line.
)";

}  // namespace

int main(int argc, char** argv) {
  using namespace ropepool::cli;
  std::vector<std::string> rest(argv + 1, argv + argc);
  if (rest.empty()) {
    std::fputs(kMainHelp, stderr);
    return 2;
  }
  const std::string command = rest.front();
  rest.erase(rest.begin());
  try {
    if (command == "-h" || command == "--help" || command == "help") {
      if (command == "help" && !rest.empty()) {
        if (rest.front() == "bench") return std::fputs(bench_help(), stdout), 0;
        if (rest.front() == "verify") return std::fputs(verify_help(), stdout), 0;
      }
      std::fputs(kMainHelp, stdout);
      return 0;
    }
    if (command == "--version" || command == "-V") {
      std::printf("ropepool %s\n", ropepool::kVersion);
      return 0;
    }
    Args args(command, rest);
    if (command == "bench") return run_bench(args);
    if (command == "verify") return run_verify(args);
    throw UsageError{"unknown command '" + command + "' (expected bench or verify)"};
  } catch (const UsageError& e) {
    std::fprintf(stderr, "ropepool: %s\nTry 'ropepool%s --help'.\n", e.message.c_str(),
                 command == "bench" || command == "verify" ? (" " + command).c_str() : "");
    return 2;
  } catch (const ropepool::Error& e) {
    std::fprintf(stderr, "ropepool: %s\n", e.what());
    if (!e.hint().empty()) std::fprintf(stderr, "  hint: %s\n", e.hint().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ropepool: error: %s\n", e.what());
    return 1;
  }
}
