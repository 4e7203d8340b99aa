// The in-process carrier (carrier.h): calls into the parameter service of
// a server in this very process (a colocated one, common/in_process_service.h),
// through one session. It declines every other server.
#ifndef PSTRAIN_WORKER_IN_PROCESS_CARRIER_H_
#define PSTRAIN_WORKER_IN_PROCESS_CARRIER_H_

#include <memory>
#include <vector>

#include "common/in_process_service.h"
#include "worker/carrier.h"

namespace pstrain::worker {

class InProcessCarrier final : public Carrier {
 public:
  // `reached[s]`: whether server s is `service`'s (at least one is).
  // `service` must outlive the carrier.
  InProcessCarrier(InProcessService* service, std::vector<bool> reached)
      : reached_(std::move(reached)), session_(service->OpenSession()) {}

  bool StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer>& requests, absl::Time deadline,
                     SentFn& on_sent, ReplyFn& on_reply, DoneFn& on_done) override {
    if (!reached_[server]) return false;
    session_->Exchange(method, std::move(requests), std::move(on_sent), std::move(on_reply),
                       std::move(on_done));
    return true;
  }
  void CancelAll() override { session_->CancelAll(); }

 private:
  const std::vector<bool> reached_;
  const std::unique_ptr<InProcessService::Session> session_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_IN_PROCESS_CARRIER_H_
