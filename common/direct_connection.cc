#include "common/direct_connection.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/direct_wire.h"
#include "common/shm_pipe.h"

namespace pstrain {

DirectConnection::DirectConnection(int socket_fd, void* region, size_t region_bytes, bool is_client,
                                   const ShmOptions& options, int peer_pid)
    : socket_fd_(socket_fd),
      wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)),
      region_(region),
      region_bytes_(region_bytes),
      options_(options),
      peer_pid_(peer_pid) {
  if (region == nullptr) {
    peer_ = TcpPeer(socket_fd);
    staged_ = std::make_unique<unsigned char[]>(kStagedBytes);
    return;
  }
  peer_ = absl::StrCat("local process ", peer_pid);
  // The pipes' size as checked, not as the shared header says now.
  std::tie(out_, in_) = PipesOf(region, static_cast<uint64_t>(options.pipe_bytes), is_client);
}

DirectConnection::~DirectConnection() {
  Close();
  close(socket_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (region_ != nullptr) munmap(region_, region_bytes_);
}

void DirectConnection::Start(MessageFn on_message, ClosedFn on_closed,
                             std::function<void()> on_tick, BorrowsFn borrows) {
  on_message_ = std::move(on_message);
  on_closed_ = std::move(on_closed);
  on_tick_ = std::move(on_tick);
  borrows_ = std::move(borrows);
  {
    absl::MutexLock lock(&send_mu_);
    started_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
}

bool DirectConnection::Send(uint8_t type, uint8_t flags, uint32_t stream,
                            const grpc::ByteBuffer* body, std::function<void()> on_written) {
  std::vector<grpc::Slice> slices;
  if (body != nullptr && !body->Dump(&slices).ok()) return false;
  return Send(type, flags, stream, std::move(slices), std::move(on_written));
}

bool DirectConnection::Send(uint8_t type, uint8_t flags, uint32_t stream,
                            std::vector<grpc::Slice> body, std::function<void()> on_written) {
  std::vector<std::unique_ptr<Outgoing>> one;
  one.push_back(MakeOutgoing(type, flags, stream, std::move(body), std::move(on_written)));
  return SendQueued(std::move(one));
}

bool DirectConnection::SendAll(std::vector<Message> messages, bool ahead) {
  std::vector<std::unique_ptr<Outgoing>> all;
  for (Message& m : messages) {
    std::vector<grpc::Slice> slices;
    if (m.body != nullptr && !m.body->Dump(&slices).ok()) return false;
    all.push_back(MakeOutgoing(m.type, m.flags, m.stream, std::move(slices),
                               std::move(m.on_written)));
  }
  return SendQueued(std::move(all), ahead);
}

std::unique_ptr<DirectConnection::Outgoing> DirectConnection::MakeOutgoing(
    uint8_t type, uint8_t flags, uint32_t stream, std::vector<grpc::Slice> body,
    std::function<void()> on_written) {
  auto message = std::make_unique<Outgoing>();
  uint64_t length = 0;
  for (const grpc::Slice& s : body) length += s.size();
  const uint32_t n = static_cast<uint32_t>(length);
  for (int i = 0; i < 4; ++i) {
    message->header[i] = static_cast<unsigned char>(n >> (8 * i));
    message->header[4 + i] = static_cast<unsigned char>(stream >> (8 * i));
  }
  message->header[8] = type;
  message->header[9] = flags;
  message->header[10] = message->header[11] = 0;
  message->body = std::move(body);
  message->on_written = std::move(on_written);
  return message;
}

bool DirectConnection::SendQueued(std::vector<std::unique_ptr<Outgoing>> messages,
                                  bool ahead) {
  bool wake;
  {
    absl::MutexLock lock(&send_mu_);
    if (ended_) return false;
    // Where they go: the queue's end; ahead, before the first message that
    // is neither begun nor sent ahead itself.
    auto at = queue_.end();
    if (ahead) {
      at = std::find_if(queue_.begin(), queue_.end(), [](const std::unique_ptr<Outgoing>& m) {
        return m->header_sent == 0 && !m->ahead;
      });
      for (auto& m : messages) m->ahead = true;
    }
    const bool first = at == queue_.begin();
    queue_.insert(at, std::make_move_iterator(messages.begin()),
                  std::make_move_iterator(messages.end()));
    // Nothing ahead of them: straight into the pipe or socket, on this
    // thread.
    if (first) FlushLocked();
    // What did not fit is the connection's thread's to write.
    wake = !queue_.empty();
  }
  if (wake) Wake();
  return true;
}

bool DirectConnection::FlushLocked() {
  return over_tcp() ? FlushToSocketLocked() : FlushToPipeLocked();
}

bool DirectConnection::FlushToPipeLocked() {
  bool progress = false;
  bool ring = false;
  std::vector<std::function<void()>> written;
  while (!queue_.empty() && !out_->broken()) {
    Outgoing& m = *queue_.front();
    bool stalled = false;
    if (m.header_sent < kMessageHeaderBytes) {
      const size_t n =
          out_->Write(m.header + m.header_sent, kMessageHeaderBytes - m.header_sent, &ring);
      m.header_sent += n;
      progress |= n > 0;
      stalled = m.header_sent < kMessageHeaderBytes;
    }
    while (!stalled && m.slice < m.body.size()) {
      const grpc::Slice& s = m.body[m.slice];
      const size_t n = out_->Write(s.begin() + m.offset, s.size() - m.offset, &ring);
      m.offset += n;
      progress |= n > 0;
      if (m.offset == s.size()) {
        ++m.slice;
        m.offset = 0;
      } else {
        stalled = true;
      }
    }
    if (stalled) break;
    if (m.on_written) written.push_back(std::move(m.on_written));
    queue_.pop_front();
  }
  if (ring) RingPeer();
  // The callbacks touch only their own state (see the header): safe under
  // the lock, and in order.
  for (auto& fn : written) fn();
  return progress;
}

bool DirectConnection::Post(std::function<void()> fn) {
  {
    absl::MutexLock lock(&send_mu_);
    if (ended_) return false;
    posted_.push_back(std::move(fn));
  }
  Wake();
  return true;
}

void DirectConnection::Close() {
  bool join;
  {
    absl::MutexLock lock(&send_mu_);
    closing_ = true;
    join = started_;
    if (!started_) ended_ = true;
  }
  Wake();
  if (join && thread_.joinable()) thread_.join();
  shutdown(socket_fd_, SHUT_RDWR);
}

void DirectConnection::Wake() {
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // EAGAIN: the counter is full, the thread is awake anyway.
  }
}

void DirectConnection::RingPeer() {
  if (over_tcp()) return;  // the bytes themselves wake the peer
  const char bell = 0;
  if (send(socket_fd_, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    // EAGAIN: the peer has doorbells enough to read; a broken socket shows
    // in the connection's poll.
  }
}

absl::StatusOr<bool> DirectConnection::Drain() {
  bool any = false;
  bool ring = false;
  while (true) {
    if (header_got_ < kMessageHeaderBytes) {
      const size_t n = ReadIn(header_ + header_got_, kMessageHeaderBytes - header_got_, &ring);
      header_got_ += n;
      any |= n > 0;
      if (header_got_ < kMessageHeaderBytes) break;
      uint32_t length = 0;
      for (int i = 0; i < 4; ++i) length |= static_cast<uint32_t>(header_[i]) << (8 * i);
      if (length > static_cast<uint64_t>(options_.max_message_bytes)) {
        if (ring) RingPeer();
        return absl::InvalidArgumentError(
            absl::StrCat(over_tcp() ? "message" : "shared-memory message", " of ", length,
                         " bytes, more than the ", options_.max_message_bytes, " allowed"));
      }
      body_length_ = length;
      body_started_ = false;
    }
    if (!body_started_) {
      if (!over_tcp() && borrows_ && borrows_(header_[8])) {
        DirectMessage message = HeaderMessage();
        if (in_->Peek(body_length_, &message.body, &message.wrapped)) {
          message.borrowed = true;
          header_got_ = 0;
          on_message_(std::move(message));
          in_->Skip(body_length_, &ring);
          continue;
        }
        // Still being written, and the pipe holds all of it: wait for it
        // rather than copy it as it comes.
        if (body_length_ <= in_->capacity()) break;
      }
      body_ = grpc::Slice(body_length_);
      body_got_ = 0;
      body_started_ = true;
    }
    if (body_got_ < body_.size()) {
      const size_t n =
          ReadIn(const_cast<uint8_t*>(body_.begin()) + body_got_, body_.size() - body_got_, &ring);
      body_got_ += n;
      any |= n > 0;
      if (body_got_ < body_.size()) break;
    }
    DirectMessage message = HeaderMessage();
    message.body = std::move(body_);
    body_ = grpc::Slice();
    header_got_ = 0;
    body_got_ = 0;
    on_message_(std::move(message));
  }
  if (ring) RingPeer();
  if (over_tcp()) {
    if (!receive_end_.ok()) return receive_end_;
  } else if (in_->broken()) {
    return absl::DataLossError("shared-memory pipe: the peer's index is out of range");
  }
  return any;
}

DirectMessage DirectConnection::HeaderMessage() const {
  DirectMessage message;
  message.type = header_[8];
  message.flags = header_[9];
  for (int i = 0; i < 4; ++i) message.stream |= static_cast<uint32_t>(header_[4 + i]) << (8 * i);
  return message;
}

size_t DirectConnection::ReadIn(unsigned char* dst, size_t n, bool* ring) {
  return over_tcp() ? ReadSocket(dst, n) : in_->Read(dst, n, ring);
}

void DirectConnection::Loop() {
  absl::Status end;
  pollfd fds[2] = {{socket_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  constexpr absl::Duration kTick = absl::Seconds(1);
  absl::Time next_tick = absl::Now() + kTick;
  while (true) {
    if (on_tick_ && absl::Now() >= next_tick) {
      on_tick_();
      next_tick = absl::Now() + kTick;
    }
    std::vector<std::function<void()>> posted;
    bool progress = false;
    {
      absl::MutexLock lock(&send_mu_);
      if (closing_) {
        end = absl::CancelledError("connection closed");
        break;
      }
      posted.swap(posted_);
      progress |= FlushLocked();
      if (over_tcp() ? send_failed_ : out_->broken()) {
        end = over_tcp()
                  ? absl::UnavailableError("the peer closed the connection")
                  : absl::DataLossError("shared-memory pipe: the peer's index is out of range");
        break;
      }
    }
    for (auto& fn : posted) fn();
    progress |= !posted.empty();
    absl::StatusOr<bool> drained = Drain();
    if (!drained.ok()) {
      end = drained.status();
      break;
    }
    if (progress || *drained) continue;
    if (over_tcp()) {
      Sleep(kTick);
      continue;
    }

    // Nothing to do: say so in the shared flags, look once more, sleep.
    bool waiting_to_write;
    {
      absl::MutexLock lock(&send_mu_);
      waiting_to_write = !queue_.empty();
    }
    in_->SetReaderSleeping(true);
    out_->SetWriterWaiting(waiting_to_write);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    // A body awaited whole is ready once all of it is in.
    const size_t wanted = header_got_ == kMessageHeaderBytes && !body_started_ ? body_length_ : 1;
    const bool ready = in_->Readable() >= wanted || (waiting_to_write && out_->Writable() > 0) ||
                       in_->broken() || out_->broken();
    if (!ready) {
      fds[0].revents = fds[1].revents = 0;
      poll(fds, 2, static_cast<int>(absl::ToInt64Milliseconds(kTick)));
    }
    in_->SetReaderSleeping(false);
    out_->SetWriterWaiting(false);
    uint64_t counter;
    if (read(wake_fd_, &counter, sizeof(counter)) < 0) {
      // EAGAIN: nobody woke us.
    }
    // Doorbells carry no data; an end of stream is the peer gone.
    char bells[256];
    ssize_t got;
    while ((got = recv(socket_fd_, bells, sizeof(bells), MSG_DONTWAIT)) > 0) {
    }
    if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR) ||
        (fds[0].revents & (POLLERR | POLLHUP)) != 0) {
      // Take what the peer wrote before it went.
      absl::StatusOr<bool> last = Drain();
      end = last.ok() ? absl::UnavailableError("the shared-memory peer closed the connection")
                      : last.status();
      break;
    }
  }
  {
    absl::MutexLock lock(&send_mu_);
    ended_ = true;
    queue_.clear();
    posted_.clear();
  }
  shutdown(socket_fd_, SHUT_RDWR);
  if (on_closed_) on_closed_(end);
}

}  // namespace pstrain
