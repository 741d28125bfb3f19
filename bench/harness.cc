#include "bench/harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <thread>

namespace shard::bench {
namespace {

// Samples kept in a record's JSON: enough for a benchmark's trials and repeats.
constexpr size_t kKeptSamples = 100;

// `digits` significant digits, without exponents where a column must stay readable: whole
// numbers (and anything from 10,000 up) with no decimals.
std::string Number(double x, int digits = 4) {
  if (!std::isfinite(x)) return "-";
  char text[64];
  if (std::fabs(x) >= 1e4 || (x == std::floor(x) && std::fabs(x) < 1e15)) {
    std::snprintf(text, sizeof(text), "%.0f", x);
  } else {
    std::snprintf(text, sizeof(text), "%.*g", digits, x);
  }
  return text;
}

// Whole numbers (counts, bytes) as JSON integers.
Json JsonNumber(double x) {
  if (x == std::floor(x) && std::fabs(x) < 9e15) return static_cast<int64_t>(x);
  return x;
}

std::string NumberOrDash(const std::optional<double>& x) { return x ? Number(*x) : "-"; }

const char* StatisticName(Statistic stat) {
  switch (stat) {
    case Statistic::kMedian: return "median";
    case Statistic::kBest: return "best";
    case Statistic::kMean: return "mean";
  }
  return "?";
}

std::string TargetText(const Target& target) {
  switch (target.kind) {
    case Target::Kind::kNone: return "";
    case Target::Kind::kAtLeast: return ">= " + Number(target.ratio);
    case Target::Kind::kBelow: return "< " + Number(target.ratio);
  }
  return "";
}

// The table's words for the built-in figures ("busbw_gbps": "busbw").
std::string FigureWord(const std::string& figure) {
  if (figure == "time_ms") return "time";
  if (figure == "algbw_gbps") return "algbw";
  if (figure == "busbw_gbps") return "busbw";
  return figure;
}

struct Column {
  const char* header;
  int width;
  bool left;  // text columns; numbers are right-aligned
};

// The table's columns but the last ("details": comparisons, extras, the note), which is as wide
// as it needs.
constexpr Column kColumns[] = {
    {"op", 14, true},         {"impl", 14, true},      {"size(B)", 12, false},
    {"count", 11, false},     {"type", 5, false},      {"ranks", 5, false},
    {"iters", 6, false},      {"samples", 7, false},   {"stat", 6, false},
    {"time(ms)", 10, false},  {"min(ms)", 10, false},  {"p99(ms)", 10, false},
    {"max(ms)", 10, false},   {"algbw(GB/s)", 11, false}, {"busbw(GB/s)", 11, false},
    {"#wrong", 6, false},
};
constexpr size_t kColumnCount = sizeof(kColumns) / sizeof(kColumns[0]);

// One line of the table: `cells` under kColumns, then `details`. A cell wider than its column
// pushes the rest of the line right rather than being cut.
std::string Line(const char* start, const std::vector<std::string>& cells,
                 const std::string& details) {
  std::string line = start;
  for (size_t c = 0; c < kColumnCount; ++c) {
    const Column& column = kColumns[c];
    const std::string& cell = cells[c];
    const std::string pad(std::max<int>(0, column.width - static_cast<int>(cell.size())), ' ');
    if (c > 0) line += ' ';
    line += column.left ? cell + pad : pad + cell;
  }
  if (!details.empty()) line += "  " + details;
  return line;
}

// The last column: comparisons, extras, the note.
std::string Details(const Record& record) {
  std::vector<std::string> parts;
  for (const Comparison& c : record.comparisons()) {
    char ratio[64];
    std::snprintf(ratio, sizeof(ratio), "%.2fx", c.ratio);
    std::string part = FigureWord(c.figure) + " " + ratio + " " + c.peer;
    if (c.target.kind != Target::Kind::kNone) {
      part += " [" + TargetText(c.target) + ": " + (c.met() ? "met" : "MISSED") + "]";
    }
    parts.push_back(part);
  }
  // Extras are counts and fractions too (a plan's imbalance, 1.00001): more digits.
  for (const auto& [name, value] : record.extras()) {
    parts.push_back(name + " " + Number(value, 6));
  }
  if (!record.note().empty()) parts.push_back(record.note());
  std::string details;
  for (const std::string& part : parts) details += (details.empty() ? "" : "; ") + part;
  return details;
}

Json OrNull(const std::optional<double>& x) { return x ? Json(*x) : Json(nullptr); }
Json OrNull(const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); }
Json OrNull(int64_t x) { return x != 0 ? Json(x) : Json(nullptr); }

}  // namespace

Machine ThisMachine() {
  Machine machine;
  machine.cpu = "unknown CPU";
  machine.cores = static_cast<int>(std::thread::hardware_concurrency());
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    const size_t start = line.find_first_not_of(" \t", colon + 1);
    if (colon != std::string::npos && start != std::string::npos) {
      machine.cpu = line.substr(start, line.find_last_not_of(" \t\r") + 1 - start);
    }
    break;
  }
  return machine;
}

Stats Summarize(std::vector<double> samples_ms) {
  Stats stats;
  if (samples_ms.empty()) return stats;
  const size_t n = samples_ms.size();
  if (n <= kKeptSamples) stats.kept_ms = samples_ms;
  double sum = 0;
  for (double sample : samples_ms) sum += sample;
  std::sort(samples_ms.begin(), samples_ms.end());
  auto quantile = [&](double q) {
    return samples_ms[std::min(n - 1, static_cast<size_t>(q * static_cast<double>(n)))];
  };
  stats.samples = static_cast<int>(n);
  stats.min_ms = samples_ms.front();
  stats.median_ms = quantile(0.5);
  stats.p99_ms = quantile(0.99);
  stats.max_ms = samples_ms.back();
  stats.mean_ms = sum / static_cast<double>(n);
  return stats;
}

std::vector<double> CollectRuns(int warmup, int samples, const std::function<double()>& run) {
  for (int i = 0; i < warmup; ++i) run();
  std::vector<double> ms;
  ms.reserve(samples);
  for (int i = 0; i < samples; ++i) ms.push_back(run());
  return ms;
}

std::vector<double> TimeRuns(int warmup, int samples, const std::function<void()>& run) {
  return CollectRuns(warmup, samples, [&] {
    const auto start = std::chrono::steady_clock::now();
    run();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
  });
}

bool Comparison::met() const {
  switch (target.kind) {
    case Target::Kind::kNone: return false;
    case Target::Kind::kAtLeast: return ratio >= target.ratio;
    case Target::Kind::kBelow: return ratio < target.ratio;
  }
  return false;
}

Record::Record(Descriptor what, Stats stats) : what_(std::move(what)), stats_(std::move(stats)) {}

double Record::time_ms() const {
  switch (what_.stat) {
    case Statistic::kMedian: return stats_.median_ms;
    case Statistic::kBest: return stats_.min_ms;
    case Statistic::kMean: return stats_.mean_ms;
  }
  return stats_.median_ms;
}

std::optional<double> Record::algbw_gbps() const {
  if (what_.bytes <= 0 || time_ms() <= 0) return std::nullopt;
  return static_cast<double>(what_.bytes) / (time_ms() * 1e-3) / 1e9;
}

std::optional<double> Record::busbw_gbps() const {
  const std::optional<double> algbw = algbw_gbps();
  if (!algbw || what_.bus_factor <= 0) return std::nullopt;
  return *algbw * what_.bus_factor;
}

std::optional<double> Record::figure(const std::string& name) const {
  if (name == "time_ms") return time_ms();
  if (name == "algbw_gbps") return algbw_gbps();
  if (name == "busbw_gbps") return busbw_gbps();
  for (const auto& [extra, value] : extras_) {
    if (extra == name) return value;
  }
  return std::nullopt;
}

Record& Record::Wrong(int64_t wrong) {
  wrong_ = wrong;
  return *this;
}

Record& Record::Extra(std::string name, double value) {
  extras_.emplace_back(std::move(name), value);
  return *this;
}

Record& Record::Note(std::string note) {
  note_ = std::move(note);
  return *this;
}

Record& Record::Compare(const std::string& figure_name, std::string peer, double peer_value,
                        Target target) {
  const std::optional<double> value = figure(figure_name);
  if (!value || !(peer_value > 0) || !std::isfinite(peer_value)) return *this;
  comparisons_.push_back(
      {figure_name, *value, std::move(peer), peer_value, *value / peer_value, target});
  return *this;
}

Json Record::ToJson() const {
  Json out = {{"op", what_.op},
              {"impl", OrNull(what_.impl)},
              {"bytes", OrNull(what_.bytes)},
              {"count", OrNull(what_.count)},
              {"dtype", OrNull(what_.dtype)},
              {"ranks", OrNull(int64_t{what_.ranks})},
              {"warmup", what_.warmup},
              {"iters", what_.iters},
              {"samples", stats_.samples},
              {"stat", StatisticName(what_.stat)},
              {"time_ms", time_ms()},
              {"min_ms", stats_.min_ms},
              {"median_ms", stats_.median_ms},
              {"p99_ms", stats_.p99_ms},
              {"max_ms", stats_.max_ms},
              {"mean_ms", stats_.mean_ms},
              {"samples_ms", stats_.kept_ms.empty() ? Json(nullptr) : Json(stats_.kept_ms)},
              {"algbw_gbps", OrNull(algbw_gbps())},
              {"busbw_gbps", OrNull(busbw_gbps())},
              {"wrong", wrong_ ? Json(*wrong_) : Json(nullptr)}};
  Json vs = Json::array();
  for (const Comparison& c : comparisons_) {
    const bool targeted = c.target.kind != Target::Kind::kNone;
    vs.push_back({{"figure", c.figure},
                  {"value", c.value},
                  {"peer", c.peer},
                  {"peer_value", c.peer_value},
                  {"ratio", c.ratio},
                  {"target", OrNull(TargetText(c.target))},
                  {"met", targeted ? Json(c.met()) : Json(nullptr)}});
  }
  out["vs"] = vs;
  Json extra = Json::object();
  for (const auto& [name, value] : extras_) extra[name] = JsonNumber(value);
  out["extra"] = extra;
  out["note"] = OrNull(note_);
  return out;
}

void AddOutputOptions(CLI::App& app, Output* output) {
  app.add_option("--json", output->json,
                 "also write the results as JSON to PATH; alone (or -): print JSON instead of "
                 "the table")
      ->expected(0, 1)
      ->default_str("-")
      ->type_name("[PATH]");
}

Report::Report(std::string bench, Output output)
    : bench_(std::move(bench)), output_(std::move(output)) {
  const Machine machine = ThisMachine();
  json_ = {{"bench", bench_},
           {"machine", {{"cpu", machine.cpu}, {"cores", machine.cores}}},
           {"notes", Json::array()},
           {"records", Json::array()}};
  if (table()) {
    std::printf("# Machine: %s, %d cores\n", machine.cpu.c_str(), machine.cores);
    std::fflush(stdout);
  }
}

void Report::Note(const std::string& line) {
  json_["notes"].push_back(line);
  if (!table()) return;
  std::printf("# %s\n", line.c_str());
  std::fflush(stdout);
}

void Report::Add(const Record& record) {
  json_["records"].push_back(record.ToJson());
  if (!table()) return;
  if (!header_printed_) {
    std::vector<std::string> headers;
    for (const Column& column : kColumns) headers.emplace_back(column.header);
    std::printf("%s\n", Line("# ", headers, "details").c_str());
    header_printed_ = true;
  }
  const Descriptor& what = record.what();
  const Stats& stats = record.stats();
  auto count = [](int64_t x) { return x != 0 ? std::to_string(x) : std::string("-"); };
  const std::vector<std::string> cells = {
      what.op,
      what.impl.empty() ? "-" : what.impl,
      count(what.bytes),
      count(what.count),
      what.dtype.empty() ? "-" : what.dtype,
      count(what.ranks),
      std::to_string(what.iters),
      std::to_string(stats.samples),
      StatisticName(what.stat),
      Number(record.time_ms()),
      Number(stats.min_ms),
      Number(stats.p99_ms),
      Number(stats.max_ms),
      NumberOrDash(record.algbw_gbps()),
      NumberOrDash(record.busbw_gbps()),
      record.wrong() ? std::to_string(*record.wrong()) : "-"};
  std::printf("%s\n", Line("  ", cells, Details(record)).c_str());
  std::fflush(stdout);
}

void Report::Set(const std::string& key, Json value) { json_[key] = std::move(value); }

bool Report::Finish() {
  if (output_.json.empty()) return true;
  // Notes may quote a process's log: bytes that are not UTF-8 are replaced, not fatal.
  const std::string text = json_.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
  if (output_.json_to_stdout()) {
    std::fputs(text.c_str(), stdout);
    std::fflush(stdout);
    return true;
  }
  std::ofstream out(output_.json);
  out << text;
  out.close();
  if (!out) {
    std::fprintf(stderr, "%s: cannot write %s\n", bench_.c_str(), output_.json.c_str());
    return false;
  }
  return true;
}

}  // namespace shard::bench
