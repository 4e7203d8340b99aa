#include "common/rpc.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(AdvertisedAddressTest, TheListenHostUnlessAWildcardOrTheAdvertisedOne) {
  EXPECT_EQ(*AdvertisedAddress("127.0.0.1:0", "", 5000), "127.0.0.1:5000");
  EXPECT_EQ(*AdvertisedAddress("10.1.2.3:7000", "", 7000), "10.1.2.3:7000");
  EXPECT_EQ(*AdvertisedAddress("0.0.0.0:0", "server-1.pstrain", 5000), "server-1.pstrain:5000");
  EXPECT_EQ(*AdvertisedAddress("0.0.0.0:7000", "server-1:7001", 7000), "server-1:7001");
  EXPECT_EQ(*AdvertisedAddress("[::]:0", "[fd00::1]", 5000), "[fd00::1]:5000");
  for (const char* wildcard : {"0.0.0.0:0", "[::]:7000", ":7000"}) {
    const absl::StatusOr<std::string> a = AdvertisedAddress(wildcard, "", 7000);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << wildcard;
    EXPECT_TRUE(absl::StrContains(a.status().message(), "--advertise_address")) << a.status();
  }
  for (const char* bad : {"0.0.0.0", "host:port", "host:70000", "a b:1", ":80"}) {
    EXPECT_EQ(AdvertisedAddress("127.0.0.1:0", bad, 1).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace pstrain
