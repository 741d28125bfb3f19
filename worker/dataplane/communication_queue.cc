#include "worker/dataplane/communication_queue.h"

#include <utility>

namespace shard {

CommunicationQueue::CommunicationQueue(bool threaded, std::function<absl::Status()> bind) {
  if (threaded) thread_ = std::thread([this, bind = std::move(bind)] { Loop(bind); });
}

CommunicationQueue::~CommunicationQueue() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

CommunicationQueue::Ticket CommunicationQueue::Submit(Operation operation) {
  if (!threaded()) {
    absl::MutexLock lock(&mu_);
    const Ticket ticket = ++submitted_;
    if (error_.ok()) {
      // Run outside the lock: the operation may take long, and Done() may be asked meanwhile.
      mu_.Unlock();
      absl::Status status = operation();
      mu_.Lock();
      if (!status.ok() && error_.ok()) error_ = std::move(status);
    }
    completed_ = ticket;
    return ticket;
  }
  absl::MutexLock lock(&mu_);
  pending_.push_back(std::move(operation));
  return ++submitted_;
}

absl::Status CommunicationQueue::Wait(Ticket ticket) {
  absl::MutexLock lock(&mu_);
  // An error ends the wait at once: the operations after it are dropped.
  auto done = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return completed_ >= ticket || !error_.ok();
  };
  mu_.Await(absl::Condition(&done));
  return error_;
}

absl::Status CommunicationQueue::Drain() {
  Ticket last = 0;
  {
    absl::MutexLock lock(&mu_);
    last = submitted_;
  }
  return Wait(last);
}

bool CommunicationQueue::Done(Ticket ticket) {
  absl::MutexLock lock(&mu_);
  return completed_ >= ticket;
}

void CommunicationQueue::Loop(const std::function<absl::Status()>& bind) {
  if (absl::Status bound = bind ? bind() : absl::OkStatus(); !bound.ok()) {
    absl::MutexLock lock(&mu_);
    error_ = std::move(bound);
    return;
  }
  while (true) {
    Operation operation;
    bool failed = false;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !pending_.empty();
      };
      mu_.Await(absl::Condition(&work));
      if (stopping_) return;
      operation = std::move(pending_.front());
      pending_.pop_front();
      failed = !error_.ok();
    }
    absl::Status status = failed ? absl::OkStatus() : operation();
    absl::MutexLock lock(&mu_);
    if (!status.ok() && error_.ok()) error_ = std::move(status);
    ++completed_;
  }
}

}  // namespace shard
