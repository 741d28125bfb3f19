// The benchmarks' one harness, after nccl-tests: every measurement is described by a Descriptor
// (what was measured, on how many bytes or elements, by how many ranks, how often), measured into
// a Record (statistics of its samples, its bandwidth, its ratio to the peer or limit measured in
// the same run), and printed by one Report as an aligned table and as JSON, with the same fields
// in every benchmark.
//
// It depends on the standard library, CLI11 and nlohmann-json alone (header-only libraries):
// shard-bench-gpu links it and runs on GPU machines that have none of our shared libraries.
// Not thread-safe: one thread builds and prints a run's report.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "nlohmann/json.hpp"

namespace shard::bench {

using Json = nlohmann::ordered_json;

// The machine a run measured on: benchmarks report ratios to limits measured in the same run,
// and name the CPU those limits belong to.
struct Machine {
  std::string cpu;  // the first "model name" of /proc/cpuinfo
  int cores = 0;    // logical CPUs
};
Machine ThisMachine();

// Statistics of a measurement's samples, in milliseconds. Percentiles are samples, not
// interpolations: the q-quantile is the sorted samples' element floor(q * n) (the median of an
// even count is the upper middle one).
struct Stats {
  int samples = 0;
  double min_ms = 0, median_ms = 0, p99_ms = 0, max_ms = 0, mean_ms = 0;
  // The samples in their order, where there are few (trials, repeats); thousands of call
  // latencies are summarized only.
  std::vector<double> kept_ms;
};
Stats Summarize(std::vector<double> samples_ms);

// Runs `run` `warmup` times untimed, then `samples` times, each timed on the steady clock;
// returns each timed run's milliseconds.
std::vector<double> TimeRuns(int warmup, int samples, const std::function<void()>& run);
// The same where `run` times itself (between two CUDA events, say) and returns milliseconds.
std::vector<double> CollectRuns(int warmup, int samples, const std::function<double()>& run);

// Which statistic of the samples a record's time, and so its bandwidth, is.
enum class Statistic { kMedian, kBest, kMean };

// What one measurement is (nccl-tests' test descriptor). Every field has an initializer, so
// that designated initializers may leave any out (GCC warns of a field left out without one).
struct Descriptor {
  std::string op = {};    // what is measured: "all_reduce", "save", "adam", "detect"
  std::string impl = {};  // whose implementation or which configuration: "shm", "range", "memory"
  // The bytes its bandwidth counts (algbw = bytes / time): nccl-tests' size, the buffer a
  // collective is about; for a kernel or a copy, what it reads and writes as its peer counts
  // them. 0: no bandwidth.
  int64_t bytes = 0;
  int64_t count = 0;   // the elements (or items) it is about; 0: none
  std::string dtype = {};  // their type ("f32"); empty: none
  int ranks = 0;       // the world size; 0: not measured on ranks
  int warmup = 0;      // untimed runs before the samples
  int iters = 1;       // runs per sample (a sample is their mean)
  Statistic stat = Statistic::kMedian;
  // busbw = algbw x this: common/bus_bandwidth.h's BusBandwidthFactor for a collective;
  // 0: no bus bandwidth.
  double bus_factor = 0;
};

// A bound on a comparison's ratio that the benchmark states (and reports met or not).
struct Target {
  enum class Kind { kNone, kAtLeast, kBelow };
  Kind kind = Kind::kNone;
  double ratio = 0;
};
inline Target AtLeast(double ratio) { return {Target::Kind::kAtLeast, ratio}; }
inline Target Below(double ratio) { return {Target::Kind::kBelow, ratio}; }

// One of a record's figures against the same figure of its peer: a limit measured in the same
// run ("memcpy"), another implementation ("gloo"), or a stated bound ("target 50 ms").
struct Comparison {
  std::string figure;  // "time_ms", "algbw_gbps", "busbw_gbps" or one of the record's extras
  double value = 0;    // the record's
  std::string peer;
  double peer_value = 0;
  double ratio = 0;    // value / peer_value
  Target target;
  bool met() const;
};

// One measurement: its descriptor, the statistics of its samples and what follows from them.
class Record {
 public:
  Record(Descriptor what, Stats stats);

  const Descriptor& what() const { return what_; }
  const Stats& stats() const { return stats_; }
  // The descriptor's statistic of the samples.
  double time_ms() const;
  // GB/s (1e9 bytes) at time_ms(); nullopt without bytes (or bus_factor).
  std::optional<double> algbw_gbps() const;
  std::optional<double> busbw_gbps() const;
  // "time_ms", "algbw_gbps", "busbw_gbps" or an extra, by name; nullopt where it has none.
  std::optional<double> figure(const std::string& name) const;

  // Results found wrong while measuring (nccl-tests' #wrong).
  Record& Wrong(int64_t wrong);
  // A further figure of this measurement: "steps_lost", "heartbeats_per_s".
  Record& Extra(std::string name, double value);
  Record& Note(std::string note);
  // Compares `figure` with `peer`'s `peer_value` (same unit); a figure the record lacks, or a
  // peer_value that is not positive, is not compared.
  Record& Compare(const std::string& figure, std::string peer, double peer_value,
                  Target target = {});

  const std::optional<int64_t>& wrong() const { return wrong_; }
  const std::vector<std::pair<std::string, double>>& extras() const { return extras_; }
  const std::string& note() const { return note_; }
  const std::vector<Comparison>& comparisons() const { return comparisons_; }
  Json ToJson() const;

 private:
  Descriptor what_;
  Stats stats_;
  std::optional<int64_t> wrong_;
  std::vector<std::pair<std::string, double>> extras_;
  std::vector<Comparison> comparisons_;
  std::string note_;
};

// Where a run's JSON goes (--json [PATH]): nowhere (empty); to stdout instead of the table ("-",
// also what --json alone gives); or to a file, beside the table.
struct Output {
  std::string json;
  bool json_to_stdout() const { return json == "-"; }
};
void AddOutputOptions(CLI::App& app, Output* output);

// A run's records and notes, printed as they come: in the table, notes as "# " lines and the
// columns' header before the first row; in JSON (written by Finish), one object with the bench,
// the machine, the notes in order, the records, and facts of the run outside any record (Set).
class Report {
 public:
  // Prints the Machine line (table) or keeps it (JSON).
  Report(std::string bench, Output output);

  void Note(const std::string& line);
  void Add(const Record& record);
  // A fact of the run that is no measurement (JSON only: notes say it in the table).
  void Set(const std::string& key, Json value);
  // Writes the JSON, if asked for; false (and a message on stderr) if its file cannot be.
  bool Finish();

 private:
  bool table() const { return !output_.json_to_stdout(); }

  std::string bench_;
  Output output_;
  Json json_;
  bool header_printed_ = false;
};

}  // namespace shard::bench
