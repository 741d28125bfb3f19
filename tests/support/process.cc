#include "tests/support/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

extern char** environ;

namespace shard::testing {

std::string BinaryPath(const std::string& name) { return absl::StrCat(SHARD_BIN_DIR, "/", name); }

absl::StatusOr<Process> Process::Start(std::vector<std::string> argv, std::string log_path,
                                       const std::vector<std::string>& env) {
  // Everything the child uses is made before the fork: between fork and exec it makes system
  // calls only (another thread may have held the allocator's lock at the fork).
  std::vector<char*> args;
  for (std::string& arg : argv) args.push_back(arg.data());
  args.push_back(nullptr);
  std::vector<std::string> environment = env;
  for (char** entry = environ; *entry != nullptr; ++entry) environment.emplace_back(*entry);
  std::vector<char*> envp;
  for (std::string& entry : environment) envp.push_back(entry.data());
  envp.push_back(nullptr);
  // The child writes errno here if it cannot start the program; exec closes it, so the parent
  // reads nothing once the program runs.
  int failure[2];
  if (::pipe2(failure, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": pipe: ",
                                            std::strerror(errno)));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    int error = ESRCH;  // the starting thread ended before the line above
    if (::getppid() == parent) {
      const int in = ::open("/dev/null", O_RDONLY);
      const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (in >= 0 && log >= 0 && ::dup2(in, STDIN_FILENO) >= 0 &&
          ::dup2(log, STDOUT_FILENO) >= 0 && ::dup2(log, STDERR_FILENO) >= 0) {
        if (in > STDERR_FILENO) ::close(in);
        if (log > STDERR_FILENO) ::close(log);
        ::execve(args[0], args.data(), envp.data());
      }
      error = errno;
    }
    [[maybe_unused]] const ssize_t written = ::write(failure[1], &error, sizeof(error));
    ::_exit(127);
  }
  const int fork_error = errno;
  ::close(failure[1]);
  if (pid < 0) {
    ::close(failure[0]);
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": fork: ",
                                            std::strerror(fork_error)));
  }
  int error = 0;
  ssize_t got = 0;
  do {
    got = ::read(failure[0], &error, sizeof(error));
  } while (got < 0 && errno == EINTR);
  ::close(failure[0]);
  if (got == sizeof(error)) {
    ::waitpid(pid, nullptr, 0);
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(error)));
  }
  return Process(pid, std::move(log_path));
}

Process::Process(Process&& other) noexcept
    : pid_(other.pid_),
      log_path_(std::move(other.log_path_)),
      exit_code_(other.exit_code_),
      max_rss_kb_(other.max_rss_kb_) {
  other.pid_ = -1;
}

Process& Process::operator=(Process&& other) noexcept {
  if (this != &other) {
    this->~Process();
    pid_ = other.pid_;
    log_path_ = std::move(other.log_path_);
    exit_code_ = other.exit_code_;
    max_rss_kb_ = other.max_rss_kb_;
    other.pid_ = -1;
  }
  return *this;
}

Process::~Process() {
  if (running()) {
    ::kill(pid_, SIGKILL);
    Wait(absl::Seconds(10));
  }
}

std::string Process::Log() const {
  std::ifstream in(log_path_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void Process::Signal(int signal) const {
  if (running()) ::kill(pid_, signal);
}

std::optional<int> Process::Wait(absl::Duration timeout) {
  if (exit_code_.has_value()) return exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    struct rusage usage = {};
    const pid_t done = ::wait4(pid_, &status, WNOHANG, &usage);
    if (done == pid_) {
      max_rss_kb_ = usage.ru_maxrss;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (done < 0 && errno != EINTR) return std::nullopt;
    if (absl::Now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

CommandResult RunCommand(std::vector<std::string> argv, absl::Duration timeout) {
  const std::string log = absl::StrCat(MakeTempDir("command"), "/output");
  CommandResult result;
  const absl::Time start = absl::Now();
  absl::StatusOr<Process> process = Process::Start(std::move(argv), log);
  if (!process.ok()) {
    result.output = std::string(process.status().message());
    return result;
  }
  std::optional<int> code = process->Wait(timeout);
  result.elapsed = absl::Now() - start;
  result.exit_code = code.value_or(-1);
  result.max_rss_kb = process->max_rss_kb();
  if (!code.has_value()) process->Signal(SIGKILL);
  result.output = process->Log();
  return result;
}

std::string MakeTempDir(const std::string& name) {
  static int counter = 0;
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string base = ::testing::TempDir();
  const std::string dir =
      absl::StrCat(base, "/shard-", getpid(), "-", test ? test->name() : "test", "-", name, "-",
                   counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

bool Eventually(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return condition();
}

}  // namespace shard::testing
