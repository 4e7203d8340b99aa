// Direct connections, through shared memory and over TCP: messages of
// every size both ways, in order; the handshake's checks; the end of a peer
// seen by the other side.
#include "common/direct_connection.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

constexpr uint64_t kInstance = 0x5eed;

std::string Text(const grpc::Slice& s) {
  return std::string(reinterpret_cast<const char*>(s.begin()), s.size());
}

// What one end received, in order, and how it ended.
struct Inbox {
  absl::Mutex mu;
  std::vector<DirectMessage> messages ABSL_GUARDED_BY(mu);
  int wrapped_bodies ABSL_GUARDED_BY(mu) = 0;  // borrowed in two parts
  std::optional<absl::Status> closed ABSL_GUARDED_BY(mu);

  // Borrowed bodies are copied here (and stay marked borrowed).
  void Start(DirectConnection& c, DirectConnection::BorrowsFn borrows = nullptr) {
    c.Start(
        [this](DirectMessage m) {
          absl::MutexLock lock(&mu);
          if (m.borrowed) {
            wrapped_bodies += m.wrapped.size() > 0;
            m.body = grpc::Slice(Text(m.body) + Text(m.wrapped));
            m.wrapped = grpc::Slice();
          }
          messages.push_back(std::move(m));
        },
        [this](const absl::Status& s) {
          absl::MutexLock lock(&mu);
          closed = s;
        },
        nullptr, std::move(borrows));
  }
  // Waits (generously) until n messages are in.
  bool AwaitMessages(size_t n) {
    absl::MutexLock lock(&mu);
    wanted = n;
    return mu.AwaitWithTimeout(absl::Condition(this, &Inbox::Enough), absl::Seconds(60));
  }
  std::optional<absl::Status> AwaitClosed() {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(this, &Inbox::Closed), absl::Seconds(60));
    return closed;
  }

 private:
  bool Enough() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return messages.size() >= wanted; }
  bool Closed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return closed.has_value(); }
  size_t wanted ABSL_GUARDED_BY(mu) = 0;
};

std::string UniqueName() {
  static int next = 0;
  return absl::StrCat("pstrain-shm-test-", getpid(), "-", next++);
}

grpc::ByteBuffer Bytes(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

// A free loopback TCP port: bound, then let go (nothing listens on it).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(address);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &len);
  close(fd);
  return ntohs(address.sin_port);
}

// The parameter: over TCP (else through shared memory).
class DirectConnectionTest : public ::testing::TestWithParam<bool> {
 protected:
  bool tcp() const { return GetParam(); }

  // A listener whose connections are kept (and started) in server_.
  void Listen(ShmOptions options = {}) {
    name_ = UniqueName();
    auto accept = [this](std::unique_ptr<DirectConnection> c) {
      absl::MutexLock lock(&mu_);
      server_inbox_.Start(*c);
      server_ = std::move(c);
    };
    absl::StatusOr<std::unique_ptr<DirectListener>> listener =
        tcp() ? DirectListener::ListenTcp("127.0.0.1", kInstance, options, accept)
              : DirectListener::Listen(name_, kInstance, options, accept);
    PSTRAIN_ASSERT_OK(listener);
    listener_ = *std::move(listener);
    if (tcp()) {
      EXPECT_GT(listener_->port(), 0);
    }
  }
  // A client of the listener (or of nobody).
  absl::StatusOr<std::unique_ptr<DirectConnection>> Connect(uint64_t instance,
                                                            const ShmOptions& options = {},
                                                            bool nobody = false) {
    constexpr absl::Duration kTimeout = absl::Seconds(10);
    if (tcp()) {
      return DirectConnection::ConnectTcp("127.0.0.1", nobody ? UnusedPort() : listener_->port(),
                                          instance, options, kTimeout);
    }
    return DirectConnection::Connect(nobody ? UniqueName() : name_, instance, options, kTimeout);
  }
  DirectConnection* AwaitServer() {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::unique_ptr<DirectConnection>* s) { return *s != nullptr; }, &server_),
        absl::Seconds(60));
    return server_.get();
  }
  void TearDown() override {
    if (listener_ != nullptr) listener_->Stop();
    absl::MutexLock lock(&mu_);
    server_.reset();
  }

  std::string name_;
  std::unique_ptr<DirectListener> listener_;
  absl::Mutex mu_;
  std::unique_ptr<DirectConnection> server_ ABSL_GUARDED_BY(mu_);
  Inbox server_inbox_;
};

TEST_P(DirectConnectionTest, MessagesOfEverySizeArriveWholeAndInOrderBothWays) {
  ShmOptions options;
  options.pipe_bytes = 64 << 10;  // smaller than some messages: they stream through
  ASSERT_NO_FATAL_FAILURE(Listen(options));
  Inbox client_inbox;  // outlives the connection, which calls into it
  absl::StatusOr<std::unique_ptr<DirectConnection>> client = Connect(kInstance, options);
  PSTRAIN_ASSERT_OK(client);
  client_inbox.Start(**client);
  DirectConnection* server = AwaitServer();
  ASSERT_NE(server, nullptr);
  if (tcp()) {
    EXPECT_EQ(server->peer(), "ipv4:127.0.0.1");
  } else {
    EXPECT_EQ(server->peer_pid(), getpid());
  }

  std::mt19937 rng(7);
  std::vector<std::string> sent;
  for (size_t size : {0, 1, 11, 12, 13, 4096, 65535, 65536, 65537, 300000, 1 << 20}) {
    std::string body(size, '\0');
    for (char& c : body) c = static_cast<char>(rng());
    sent.push_back(body);
  }
  int written = 0;
  for (size_t i = 0; i < sent.size(); ++i) {
    const grpc::ByteBuffer body = Bytes(sent[i]);
    ASSERT_TRUE((*client)->Send(2, static_cast<uint8_t>(i), static_cast<uint32_t>(1000 + i), &body,
                                [&written] { ++written; }));
    ASSERT_TRUE(server->Send(4, 0, static_cast<uint32_t>(i), &body));
  }
  ASSERT_TRUE(server_inbox_.AwaitMessages(sent.size()));
  ASSERT_TRUE(client_inbox.AwaitMessages(sent.size()));
  absl::MutexLock lock(&server_inbox_.mu);
  absl::MutexLock lock2(&client_inbox.mu);
  for (size_t i = 0; i < sent.size(); ++i) {
    const DirectMessage& in = server_inbox_.messages[i];
    EXPECT_EQ(in.type, 2);
    EXPECT_EQ(in.flags, i);
    EXPECT_EQ(in.stream, 1000 + i);
    EXPECT_EQ(Text(in.body), sent[i]) << "message " << i;
    const DirectMessage& back = client_inbox.messages[i];
    EXPECT_EQ(back.type, 4);
    EXPECT_EQ(back.stream, i);
    EXPECT_EQ(Text(back.body), sent[i]) << "message " << i;
  }
  EXPECT_EQ(written, static_cast<int>(sent.size()));
}

// Through shared memory, a receiver may take the messages of some types
// borrowed: read where they lie in the pipe, when all of one is there and
// does not wrap around the pipe's end (else copied, as over TCP, and as
// every other type).
TEST_P(DirectConnectionTest, BorrowedBodiesAreReadWhereTheyLie) {
  ShmOptions options;
  options.pipe_bytes = 64 << 10;
  ASSERT_NO_FATAL_FAILURE(Listen(options));
  Inbox client_inbox;
  absl::StatusOr<std::unique_ptr<DirectConnection>> client = Connect(kInstance, options);
  PSTRAIN_ASSERT_OK(client);
  DirectConnection* server = AwaitServer();
  ASSERT_NE(server, nullptr);
  // Written before the client reads: all of each is in the pipe, none wraps.
  const std::vector<std::pair<uint8_t, size_t>> first = {
      {4, 0}, {4, 100}, {5, 100}, {4, 30000}, {5, 20}, {4, 4096}};
  std::vector<std::string> sent;
  for (const auto& [type, size] : first) {
    sent.push_back(std::string(size, static_cast<char>('a' + sent.size())));
    const grpc::ByteBuffer body = Bytes(sent.back());
    ASSERT_TRUE(server->Send(type, 0, static_cast<uint32_t>(sent.size()), &body));
  }
  client_inbox.Start(**client, [](uint8_t type) { return type == 4; });
  // Larger than the pipe: it streams through, copied.
  sent.push_back(std::string(200000, 'z'));
  const grpc::ByteBuffer large = Bytes(sent.back());
  ASSERT_TRUE(server->Send(4, 0, static_cast<uint32_t>(sent.size()), &large));
  // Sent while the client reads: each is awaited whole; the first wraps
  // around the pipe's end (it starts 37,792 bytes in, the sizes above and
  // 12-byte headers summed, modulo 64 KiB) and comes in two parts.
  for (int i = 0; i < 3; ++i) {
    sent.push_back(std::string(30000, static_cast<char>('0' + i)));
    const grpc::ByteBuffer body = Bytes(sent.back());
    ASSERT_TRUE(server->Send(4, 0, static_cast<uint32_t>(sent.size()), &body));
  }
  ASSERT_TRUE(client_inbox.AwaitMessages(sent.size()));
  absl::MutexLock lock(&client_inbox.mu);
  for (size_t i = 0; i < sent.size(); ++i) {
    const DirectMessage& m = client_inbox.messages[i];
    EXPECT_EQ(m.stream, i + 1);
    EXPECT_EQ(Text(m.body), sent[i]) << "message " << i;
    const bool borrowable = i < first.size() ? first[i].first == 4 : sent[i].size() <= (64 << 10);
    EXPECT_EQ(m.borrowed, borrowable && !tcp()) << "message " << i;
  }
  EXPECT_EQ(client_inbox.wrapped_bodies, tcp() ? 0 : 1);
}

// Messages sent ahead pass the queued ones not begun yet, in their own
// order, but never cut into the one being written.
TEST_P(DirectConnectionTest, MessagesSentAheadPassQueuedOnesNotBegun) {
  ShmOptions options;
  options.pipe_bytes = 64 << 10;
  ASSERT_NO_FATAL_FAILURE(Listen(options));
  Inbox client_inbox;  // outlives the connection, whose end it records
  absl::StatusOr<std::unique_ptr<DirectConnection>> client = Connect(kInstance, options);
  PSTRAIN_ASSERT_OK(client);
  DirectConnection* server = AwaitServer();
  ASSERT_NE(server, nullptr);
  // Nothing reads yet: the first (larger than the pipe, or than loopback's
  // socket buffers) is begun and stalls, the next two wait in the queue.
  const std::string large(48 << 20, 'L');
  const grpc::ByteBuffer large_body = Bytes(large);
  for (uint32_t stream : {1, 2, 3}) ASSERT_TRUE(server->Send(1, 0, stream, &large_body));
  const grpc::ByteBuffer small_body = Bytes("small");
  auto small = [&](uint32_t stream) {
    return DirectConnection::Message{
        .type = 2, .flags = 0, .stream = stream, .body = &small_body, .on_written = nullptr};
  };
  ASSERT_TRUE(server->SendAll({small(10), small(11)}, /*ahead=*/true));
  ASSERT_TRUE(server->SendAll({small(12)}, /*ahead=*/true));
  ASSERT_TRUE(server->SendAll({small(13)}));
  client_inbox.Start(**client);
  ASSERT_TRUE(client_inbox.AwaitMessages(7));
  absl::MutexLock lock(&client_inbox.mu);
  std::vector<uint32_t> order;
  for (const DirectMessage& m : client_inbox.messages) {
    order.push_back(m.stream);
    EXPECT_EQ(m.body.size(), m.type == 1 ? large.size() : 5) << "stream " << m.stream;
  }
  EXPECT_EQ(order, (std::vector<uint32_t>{1, 10, 11, 12, 2, 3, 13}));
}

TEST_P(DirectConnectionTest, ManyThreadsSendingKeepEachMessageWhole) {
  ASSERT_NO_FATAL_FAILURE(Listen());
  absl::StatusOr<std::unique_ptr<DirectConnection>> client = Connect(kInstance);
  PSTRAIN_ASSERT_OK(client);
  ASSERT_NE(AwaitServer(), nullptr);
  constexpr int kThreads = 4, kEach = 500;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const grpc::ByteBuffer body = Bytes(std::string(1000 + i, static_cast<char>('a' + t)));
        (*client)->Send(1, 0, static_cast<uint32_t>(t * kEach + i), &body);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(server_inbox_.AwaitMessages(kThreads * kEach));
  absl::MutexLock lock(&server_inbox_.mu);
  std::vector<int> next(kThreads, 0);
  for (const DirectMessage& m : server_inbox_.messages) {
    const int t = static_cast<int>(m.stream / kEach), i = static_cast<int>(m.stream % kEach);
    EXPECT_EQ(i, next[t]++) << "one thread's messages in its order";
    EXPECT_EQ(Text(m.body), std::string(1000 + i, static_cast<char>('a' + t)));
  }
}

TEST_P(DirectConnectionTest, AnotherInstanceOrNobodyIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Listen());
  absl::StatusOr<std::unique_ptr<DirectConnection>> other = Connect(kInstance + 1);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
  absl::StatusOr<std::unique_ptr<DirectConnection>> nobody =
      Connect(kInstance, {}, /*nobody=*/true);
  EXPECT_EQ(nobody.status().code(), absl::StatusCode::kUnavailable) << nobody.status();
  ShmOptions bad;
  bad.pipe_bytes = 100000;  // not a power of two
  EXPECT_EQ(Connect(kInstance, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// A peer that is no shared-memory client (garbage, or silence) is refused
// and the listener goes on taking good ones.
TEST_P(DirectConnectionTest, AGarbageHandshakeIsRefusedAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(Listen());
  int fd;
  if (tcp()) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(listener_->port()));
    ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0);
  } else {
    fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, name_.data(), name_.size());
    ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&address),
                      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name_.size())),
              0);
  }
  const char garbage[24] = "not a handshake at all";
  ASSERT_EQ(send(fd, garbage, sizeof(garbage), 0), static_cast<ssize_t>(sizeof(garbage)));
  char reply[64];
  EXPECT_GE(recv(fd, reply, sizeof(reply), 0), 0);  // refused (or just closed)
  close(fd);
  absl::StatusOr<std::unique_ptr<DirectConnection>> good = Connect(kInstance);
  PSTRAIN_EXPECT_OK(good);
}

TEST_P(DirectConnectionTest, EachSideSeesTheOtherEnd) {
  ASSERT_NO_FATAL_FAILURE(Listen());
  Inbox client_inbox;  // outlives the connection, which calls into it
  absl::StatusOr<std::unique_ptr<DirectConnection>> client = Connect(kInstance);
  PSTRAIN_ASSERT_OK(client);
  client_inbox.Start(**client);
  ASSERT_NE(AwaitServer(), nullptr);
  client->reset();  // the client goes
  std::optional<absl::Status> closed = server_inbox_.AwaitClosed();
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kUnavailable) << *closed;
  std::optional<absl::Status> own = client_inbox.AwaitClosed();
  ASSERT_TRUE(own.has_value());
  EXPECT_EQ(own->code(), absl::StatusCode::kCancelled) << *own;
  const grpc::ByteBuffer body = Bytes("late");
  absl::MutexLock lock(&mu_);
  EXPECT_FALSE(server_->Send(4, 0, 1, &body));
}

TEST_P(DirectConnectionTest, AMessageOverTheLimitEndsTheConnection) {
  ShmOptions small;
  small.max_message_bytes = 1000;
  ASSERT_NO_FATAL_FAILURE(Listen(small));
  Inbox client_inbox;  // outlives the connection, which calls into it
  absl::StatusOr<std::unique_ptr<DirectConnection>> client = Connect(kInstance);
  PSTRAIN_ASSERT_OK(client);
  client_inbox.Start(**client);
  ASSERT_NE(AwaitServer(), nullptr);
  const grpc::ByteBuffer big = Bytes(std::string(1001, 'x'));
  ASSERT_TRUE((*client)->Send(2, 0, 1, &big));
  std::optional<absl::Status> closed = server_inbox_.AwaitClosed();
  ASSERT_TRUE(closed.has_value());
  EXPECT_EQ(closed->code(), absl::StatusCode::kInvalidArgument) << *closed;
  std::optional<absl::Status> seen = client_inbox.AwaitClosed();
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->code(), absl::StatusCode::kUnavailable) << *seen;
}

INSTANTIATE_TEST_SUITE_P(Carriers, DirectConnectionTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Tcp" : "SharedMemory";
                         });

}  // namespace
}  // namespace pstrain
