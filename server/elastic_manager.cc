#include "server/elastic_manager.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "shard/v1/state.pb.h"
#include "spdlog/spdlog.h"

namespace shard {
namespace {

constexpr char kReshapeRecord[] = "reshape";

}  // namespace

absl::StatusOr<std::unique_ptr<ElasticManager>> ElasticManager::Create(StateStore* store,
                                                                       bool recover) {
  std::unique_ptr<ElasticManager> manager(new ElasticManager(store));
  v1::ReshapeRecord record;
  SHARD_ASSIGN_OR_RETURN(bool loaded, store->Load(kReshapeRecord, &record));
  absl::MutexLock lock(&manager->mu_);
  if (loaded && recover && record.generation() > 0) {
    manager->in_flight_ = InFlightReshape{record.generation(), record.request(),
                                          record.description(),
                                          absl::FromUnixMillis(record.since_unix_ms())};
  } else if (loaded && record.generation() > 0) {
    SHARD_RETURN_IF_ERROR(manager->PersistLocked());
  }
  return manager;
}

absl::Status ElasticManager::PersistLocked() {
  v1::ReshapeRecord record;
  if (in_flight_.has_value()) {
    record.set_generation(in_flight_->generation);
    record.set_request(in_flight_->request);
    record.set_description(in_flight_->description);
    record.set_since_unix_ms(absl::ToUnixMillis(in_flight_->since));
  }
  return store_->Save(kReshapeRecord, record);
}

std::optional<InFlightReshape> ElasticManager::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

absl::Status ElasticManager::Start(InFlightReshape reshape) {
  absl::MutexLock lock(&mu_);
  in_flight_ = std::move(reshape);
  if (absl::Status saved = PersistLocked(); !saved.ok()) {
    in_flight_.reset();
    return saved;
  }
  spdlog::info("{}: checkpoint requested (request {} of generation {}); training pauses at the "
               "next step boundary",
               in_flight_->description, in_flight_->request, in_flight_->generation);
  return absl::OkStatus();
}

void ElasticManager::Finish(const std::string& outcome) {
  absl::MutexLock lock(&mu_);
  if (!in_flight_.has_value()) return;
  spdlog::info("{} (request {} of generation {}): {}", in_flight_->description,
               in_flight_->request, in_flight_->generation, outcome);
  in_flight_.reset();
  if (absl::Status saved = PersistLocked(); !saved.ok()) {
    // Harmless if lost: a restart finds the generation changed or the request answered.
    spdlog::error("{}", saved.message());
  }
}

std::string ElasticManager::transition() const {
  absl::MutexLock lock(&mu_);
  if (!in_flight_.has_value()) return "";
  return absl::StrCat(in_flight_->description, ": waiting for the checkpoint of request ",
                      in_flight_->request);
}

}  // namespace shard
